// Softmax variants as an extra "sink" logit that takes part in the
// normalisation but has no value row:
//
//   vanilla     no sink
//   off_by_one  sink logit 0            (adds 1 to the denominator)
//   learnable   sink logit offset[h]    (adds exp(offset[h]))
//
//   p_j = exp(s_j - m) / (exp(sink - m) + sum_k exp(s_k - m)),
//   m = max(max over visible s, sink); s = scale * q.k (the sink is not scaled).
//
// The forward stores lse = m + log(denominator). A query with no visible key
// outputs exactly 0 and gets zero gradients: its lse is +inf (kEmptyRowLse),
// so every recomputed weight exp(s - lse) and exp(sink - lse) is exactly 0.
#ifndef FUSEDATTN_SOFTMAX_H_
#define FUSEDATTN_SOFTMAX_H_

#include <cmath>
#include <cstdint>

#include "fusedattn/portability.h"

namespace fusedattn {

enum SoftmaxType : int32_t {
  kSoftmaxVanilla = 0,
  kSoftmaxOffByOne = 1,
  kSoftmaxLearnable = 2,
};

FA_HOST_DEVICE FA_INLINE bool softmax_has_sink(int32_t type) { return type != kSoftmaxVanilla; }

// The sink logit of head h: 0 for off_by_one, offset for learnable (meaningless for vanilla).
FA_HOST_DEVICE FA_INLINE float softmax_sink_logit(int32_t type, float offset) {
  return type == kSoftmaxLearnable ? offset : 0.0f;
}

FA_HOST_DEVICE FA_INLINE float empty_row_lse() { return INFINITY; }

// Running (online) softmax statistics over the visible scores of one row:
// m is the running max, l the sum of exp(s - m). Blocked device kernels fold
// tiles with `rescale`; the host kernel folds one score at a time.
struct SoftmaxState {
  float m;
  float l;
  bool any;  // whether any visible key was seen

  FA_HOST_DEVICE FA_INLINE void init() {
    m = -INFINITY;
    l = 0.0f;
    any = false;
  }

  // Folds the max of a block of scores in; returns the factor exp(m_old - m_new)
  // by which previously accumulated sums (and outputs) must be multiplied.
  FA_HOST_DEVICE FA_INLINE float rescale(float block_max) {
    if (block_max <= m) return 1.0f;
    const float factor = any ? expf(m - block_max) : 0.0f;
    m = block_max;
    l *= factor;
    return factor;
  }

  // Adds exp(s - m) for a visible score s (after rescale(s) or a block max >= s).
  FA_HOST_DEVICE FA_INLINE float add(float s) {
    const float p = expf(s - m);
    l += p;
    any = true;
    return p;
  }

  // Folds the sink in and returns the log-sum-exp of the row (kEmptyRowLse for
  // a row without visible keys). `inv_denominator` receives the factor that
  // turns exp(s - m) into p (0 for empty rows).
  FA_HOST_DEVICE FA_INLINE float finalize(int32_t type, float sink, float* inv_denominator) {
    if (!any) {
      *inv_denominator = 0.0f;
      return empty_row_lse();
    }
    float total = l;
    float mx = m;
    if (softmax_has_sink(type)) {
      if (sink > mx) {
        total = l * expf(mx - sink) + 1.0f;
        mx = sink;
      } else {
        total = l + expf(sink - mx);
      }
      // The accumulated exp(s - m) terms are relative to m, not mx.
      *inv_denominator = expf(m - mx) / total;
    } else {
      *inv_denominator = 1.0f / total;
    }
    return mx + logf(total);
  }
};

// The weight of a visible score given the stored lse (0 for empty rows).
FA_HOST_DEVICE FA_INLINE float softmax_weight(float s, float lse) { return expf(s - lse); }

// The sink's weight given the stored lse (0 for vanilla and for empty rows).
FA_HOST_DEVICE FA_INLINE float softmax_sink_weight(int32_t type, float sink, float lse) {
  return softmax_has_sink(type) ? expf(sink - lse) : 0.0f;
}

}  // namespace fusedattn

#endif  // FUSEDATTN_SOFTMAX_H_
