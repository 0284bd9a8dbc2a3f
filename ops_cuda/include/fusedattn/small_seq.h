// The small-sequence op: one query token per segment, at most kSmallSeqMaxKeys
// keys, a huge batch. Shared by the host build and the CUDA/HIP kernels.
//
// Operands (canonical BSHD, see fusedattn/ops/backends/small_seq.py):
//   forward:  0 q [..., Sq, H, D]   1 k [..., Skv, Hkv, D]   2 v [..., Skv, Hkv, D]
//             3 kv_start S32 [..., Sq]  4 kv_len S32 [..., Sq]   5 seed U32 [..., 2]
//             attributes: scale f32, dropout_rate f64, max_keys i64 (the static bound)
//             results: o [..., Sq, H, D] (q's dtype), lse F32 [..., Sq, H]
//   backward: the forward's six, then 6 o, 7 lse, 8 do; results dq, dk, dv.
//
// lse is the log-sum-exp of a query's scaled scores (-inf without keys, NaN for
// a broken bound). With it the backward gets each weight from its own score,
// p_j = exp(s_j - lse), so it takes every key and value row once, in one pass,
// without holding a query's scores, and stores dk_j and dv_j as it goes. The
// forward's extra bytes are 4 per query head against D * (2 + 2 * keys)
// elements of q, o, k and v. On the H200 (b=30720, h=16, bf16, fwd+bwd of the
// kernels) this took the 16-key case from 4.76 to 3.52 ms at d=128 and from 9.82 to 6.82 ms
// at d=256, against a backward that recomputed the softmax and went over the
// keys twice (benchmarks/probes/small_seq_sweep.py, benchmarks/small_seq.py).
//
// The backward reads o for delta = rowsum(dO * O). Summing delta instead as
// sum_j p_j dp_j in the key pass saves those bytes but needs a second dq sum
// and the dk stores after the last key: measured slower on the H200 at every
// key count but 2 (bf16, b=30720, fwd+bwd, d=128: +1.6% at 4 and 8 keys, +5% at
// 6, +0.7% at 12, +55% at 16; results/small_seq_backward_without_o.json against
// results/small_seq.json, XLA's times within 1% in both runs), so it reads o.
//
// Query token (b, i) attends keys kv_start .. kv_start + kv_len - 1 of row b.
// kv_len == 0: a padding query (output 0, zero gradients). kv_len < 0 or
// kv_len > max_keys: the data broke a declared bound; the query's output and
// dq are NaN, never silently wrong numbers (Python also raises, see
// small_seq.py). Keys outside every query's range get zero dk and dv.
#ifndef FUSEDATTN_SMALL_SEQ_H_
#define FUSEDATTN_SMALL_SEQ_H_

#include <cmath>
#include <cstdint>

#include "fusedattn/philox.h"
#include "fusedattn/portability.h"

namespace fusedattn {

constexpr int kSmallSeqMaxKeys = 16;

struct SmallSeqParams {
  int64_t batch;      // B: product of q's leading dims
  int64_t seqlen_q;   // Sq: query tokens per row
  int64_t seqlen_kv;  // Skv
  int64_t heads;      // H
  int64_t kv_heads;   // Hkv (divides H)
  int64_t head_dim;   // D (q, k and v)
  int64_t seed_rows;  // leading product of the seed operand
  int64_t max_keys;   // the declared bound on kv_len
  float scale;
  bool dropout;
  uint32_t dropout_threshold;
  float dropout_scale;  // 1 / (1 - rate)
};

// Whether a query's kv_len is servable; false means a broken bound (NaN out).
FA_HOST_DEVICE FA_INLINE bool small_seq_len_ok(int32_t kv_len, int64_t max_keys) {
  return kv_len >= 0 && kv_len <= max_keys;
}

// Softmax of the first `len` of N scaled scores, in place: s[j] becomes p_j
// (0 for j >= len; all 0 when len == 0). Returns the scores' log-sum-exp
// (-inf when len == 0).
template <int N>
FA_HOST_DEVICE FA_INLINE float small_seq_softmax(float (&s)[N], int len) {
  float m = -INFINITY;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#pragma unroll
#endif
  for (int j = 0; j < N; ++j) m = j < len ? fmaxf(m, s[j]) : m;
  float total = 0.0f;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#pragma unroll
#endif
  for (int j = 0; j < N; ++j) {
    s[j] = j < len ? expf(s[j] - m) : 0.0f;
    total += s[j];
  }
  const float inv = len > 0 ? 1.0f / total : 0.0f;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#pragma unroll
#endif
  for (int j = 0; j < N; ++j) s[j] *= inv;
  return len > 0 ? m + logf(total) : -INFINITY;
}

// The backward's weight of a live key from its scaled score and the forward's lse.
FA_HOST_DEVICE FA_INLINE float small_seq_weight(float scaled_score, float lse) {
  return expf(scaled_score - lse);
}

// The dropout factor of weight (b, h, i, j): 0 when dropped, 1/(1-rate) when
// kept, 1 without dropout. `philox_b` is the Philox batch coordinate
// (broadcast_inner of layout.h) and j the key's token index in its row.
FA_HOST_DEVICE FA_INLINE float small_seq_dropout_factor(const SmallSeqParams& p, uint32_t seed0,
                                                        uint32_t seed1, int64_t philox_b, int64_t h,
                                                        int64_t i, int64_t j) {
  if (!p.dropout) return 1.0f;
  const bool keep = dropout_keep(seed0, seed1, p.dropout_threshold, static_cast<uint32_t>(philox_b),
                                 static_cast<uint32_t>(h), static_cast<uint32_t>(i),
                                 static_cast<uint32_t>(j));
  return keep ? p.dropout_scale : 0.0f;
}

}  // namespace fusedattn

#endif  // FUSEDATTN_SMALL_SEQ_H_
