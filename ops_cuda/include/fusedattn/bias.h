// The bias arrays of fusedattn/ops/backends/xla.py (scores_and_visible), for every kernel:
//
//   pre_scale  (bias_type 1): s_ij = scale * (q_i . k_j + bias[bb, hb, i, j])
//   post_scale (bias_type 2): s_ij = scale * q_i . k_j + bias[bb, hb, i, j]
//
// bias is float32 [Bb, Hb, Sq, Skv] over the canonical (padded) positions, Bb 1 or B and Hb
// 1 or H (a dim of extent 1 is shared by every batch row or head). Its gradient is dS, the
// gradient of the scores s, times scale for pre_scale, summed over the shared dims.
#ifndef FUSEDATTN_BIAS_H_
#define FUSEDATTN_BIAS_H_

#include <cstdint>

#include "fusedattn/portability.h"

namespace fusedattn {

// The bias_type attribute of the flash op.
enum BiasKind : int32_t { kBiasNone = 0, kBiasPreScale = 1, kBiasPostScale = 2 };

// The scaled score of q.k = qk with the bias term `bias` (a call with a bias array).
FA_HOST_DEVICE FA_INLINE float biased_score(int32_t bias_type, float scale, float qk, float bias) {
  return bias_type == kBiasPreScale ? scale * (qk + bias) : scale * qk + bias;
}

// The bias term's gradient from dS, the gradient of the score.
FA_HOST_DEVICE FA_INLINE float bias_gradient(int32_t bias_type, float scale, float ds) {
  return bias_type == kBiasPreScale ? scale * ds : ds;
}

// Offset of row (b, h, i) of a [Bb, Hb, Sq, Skv] bias (Bb, Hb: 1 or the full extent).
FA_HOST_DEVICE FA_INLINE int64_t bias_row_offset(int64_t b, int64_t h, int64_t i, int64_t bias_batch,
                                                 int64_t bias_heads, int64_t Sq, int64_t Skv) {
  const int64_t bb = bias_batch == 1 ? 0 : b, hb = bias_heads == 1 ? 0 : h;
  return ((bb * bias_heads + hb) * Sq + i) * Skv;
}

}  // namespace fusedattn

#endif  // FUSEDATTN_BIAS_H_
