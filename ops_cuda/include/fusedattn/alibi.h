// The ALiBi term of fusedattn/ops/backends/xla.py (_alibi_bias), for every kernel:
//
//   s_ij = scale * q_i . k_j + alibi_ij,   alibi_ij = -slope[h] * |kv_pos[j] - (q_pos[i] + q_diag[i])|
//
// over the canonical token positions (mask.h's diagonal), so it holds under padding,
// packing and bottom-right causal alike. slope is float32 [h] (the paper's slopes or the
// caller's). Its gradient: d slope[h] = sum over (b, i, j) of dS_ij * (-|distance_ij|),
// dS being the gradient of the scores s.
#ifndef FUSEDATTN_ALIBI_H_
#define FUSEDATTN_ALIBI_H_

#include <cstdint>

#include "fusedattn/portability.h"

namespace fusedattn {

// |kv_pos - diagonal| as float32 (diagonal = q_pos + q_diag, mask.h's QueryToken).
FA_HOST_DEVICE FA_INLINE float alibi_distance(int64_t diagonal, int32_t kv_pos) {
  const int64_t d = static_cast<int64_t>(kv_pos) - diagonal;
  return static_cast<float>(d < 0 ? -d : d);
}

// alibi_distance from the two positions as float32: equal to it while |kv_pos| and
// |diagonal| are at most 2^24 (the conversions are exact and the difference is rounded
// once, as alibi_distance's conversion is), as token positions are. The GPU kernels convert
// each query's and key's position once and take this per (query, key) pair.
FA_HOST_DEVICE FA_INLINE float alibi_distance(float diagonal, float kv_pos) {
  const float d = kv_pos - diagonal;
  return d < 0.0f ? -d : d;
}

// The term added to the scaled score: -slope * |distance|.
FA_HOST_DEVICE FA_INLINE float alibi_term(float slope, int64_t diagonal, int32_t kv_pos) {
  return -slope * alibi_distance(diagonal, kv_pos);
}

}  // namespace fusedattn

#endif  // FUSEDATTN_ALIBI_H_
