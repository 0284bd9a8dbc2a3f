// Bias arrays in the GPU flash kernels (the sm_80 text, on CUDA and over MFMA, and the
// sm_90a kernels): the term of fusedattn/bias.h on the fragments of a score tile, and the
// terms of its gradient.
//
// The kernels hold unscaled scores x = q . k and scale them inside the softmax, so the
// array's element enters as x += bias (pre_scale: scale (x + bias)) or x += bias / scale
// (post_scale: scale x + bias), before the mask and the row maximum, as in the host build.
// Masked pairs are then selected out whatever the bias holds there. The backward's dS (the
// gradient of the scaled score) gives each pair's term bias_gradient(dS); the one writer of
// each (b, h, i, j) it visits (the sm_80 dq kernel; in the sm_90a backward the block of the
// pair's key tile) stores them into a.bias_terms: d_bias itself for a full array (zeroed
// first: pairs of tiles no query sees stay 0), else a buffer that bias_gradient.cu sums over
// the array's broadcast dims in a fixed order (bitwise repeatable), reading only the pairs
// the kernels write.
#ifndef FUSEDATTN_FLASH_BIAS_TILE_CUH_
#define FUSEDATTN_FLASH_BIAS_TILE_CUH_

#include <cstdint>

#include "fusedattn/bias.h"
#include "params.cuh"

namespace fusedattn {
namespace flash {

// Row 0 of the bias array's (b, h) plane [Sq, Skv].
__device__ __forceinline__ const float* bias_plane(const FlashArgs& a, int64_t b, int64_t h) {
  const AttentionParams& p = a.p;
  return a.bias + bias_row_offset(b, h, 0, p.bias_batch, p.bias_heads, p.seqlen_q, p.seqlen_kv);
}

// scores[n][e] (unscaled, of query query_of(n, e) and key key_of(n, e)) += the bias term of
// that pair, in the scores' units; pairs past either end are left alone (masked there).
template <int kCols, typename QueryOf, typename KeyOf>
__device__ __forceinline__ void add_bias(float (&scores)[kCols / 8][4], const FlashArgs& a, int64_t b, int64_t h,
                                         QueryOf query_of, KeyOf key_of) {
  const AttentionParams& p = a.p;
  const float* plane = bias_plane(a, b, h);
  const float unit = p.bias_type == kBiasPreScale ? 1.0f : 1.0f / p.scale;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t i = query_of(n, e), j = key_of(n, e);
      if (i < p.seqlen_q && j < p.seqlen_kv) scores[n][e] = fmaf(plane[i * p.seqlen_kv + j], unit, scores[n][e]);
    }
  }
}

// Stores the bias gradient's terms of a tile of dS (ds[n][e] of query query_of(n, e) and key
// key_of(n, e); pairs past either end are not stored) into a.bias_terms' (b, h) plane
// [B, H, Sq, Skv]; nothing where a.bias_terms is null (the gradient not wanted).
template <int kCols, typename QueryOf, typename KeyOf>
__device__ __forceinline__ void store_bias_terms(const float (&ds)[kCols / 8][4], const FlashArgs& a, int64_t b,
                                                 int64_t h, QueryOf query_of, KeyOf key_of) {
  if (a.bias_terms == nullptr) return;  // the bias's gradient is not wanted
  const AttentionParams& p = a.p;
  float* plane = a.bias_terms + (b * p.heads + h) * p.seqlen_q * p.seqlen_kv;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t i = query_of(n, e), j = key_of(n, e);
      if (i < p.seqlen_q && j < p.seqlen_kv) plane[i * p.seqlen_kv + j] = bias_gradient(p.bias_type, p.scale, ds[n][e]);
    }
  }
}

// Whether the bias array has every batch row and head: its gradient is then the terms
// themselves (a.bias_terms points at d_bias), else bias_gradient.cu sums them into d_bias.
__host__ __device__ __forceinline__ bool bias_gradient_direct(const AttentionParams& p) {
  return p.bias_batch == p.batch && p.bias_heads == p.heads;
}

// Before a backward with a bias array: zeroes d_bias where it is the terms themselves
// (bias_gradient_direct: pairs no kernel visits must read 0); a broadcast array's terms need
// no zeroing (launch_bias_gradient_sum reads only the pairs the kernels write).
void clear_bias_terms(gpuStream_t stream, const FlashArgs& a);

// d_bias [Bb, Hb, Sq, Skv] = a.bias_terms summed over the batch rows and heads each element
// stands for (b in order, then h), for a bias that is not direct.
void launch_bias_gradient_sum(gpuStream_t stream, const FlashArgs& a, float* d_bias);

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_BIAS_TILE_CUH_
