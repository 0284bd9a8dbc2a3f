// ALiBi in the GPU flash kernels (sm_80, sm_90a and MFMA alike): the term of
// fusedattn/alibi.h on the fragments of a score tile, and the slopes' gradient.
//
// The kernels hold unscaled scores x = q . k and scale them inside the softmax (exp of
// scale x - m), so the term enters as x += (-slope / scale) |distance| (the scale is
// positive: the op checks it), before the mask and the row maximum, as in the host build.
// The slopes' gradient, d slope[h] = sum over visible (i, j) of dS_ij (-|distance_ij|)
// (dS: the gradient of the scaled score, which the backward holds), is summed per warp
// into its own slot of a workspace of partial sums (no atomics: every slot has one writer),
// which slope_gradient.cu adds up in a fixed order: the backward stays bitwise repeatable.
#ifndef FUSEDATTN_FLASH_ALIBI_TILE_CUH_
#define FUSEDATTN_FLASH_ALIBI_TILE_CUH_

#include <cstdint>

#include "fusedattn/alibi.h"
#include "params.cuh"

namespace fusedattn {
namespace flash {

// slope[h] / scale for batch row b: what the unscaled scores gain per unit of distance (negated).
__device__ __forceinline__ float alibi_coefficient(const FlashArgs& a, int64_t b, int64_t h) {
  const AttentionParams& p = a.p;
  return a.slopes[broadcast_row(b, p.batch, p.slopes_rows) * p.heads + h] / p.scale;
}

// Positions enter as float32 (alibi.h: the float overload of alibi_distance, exact for
// positions up to 2^24), converted once per query and per key rather than per pair.

// The diagonal (q_pos + q_diag) of query i of the row as float32; 0 past the end (masked there).
__device__ __forceinline__ float query_diagonal(const HeadContext& c, int64_t i, int64_t seqlen_q) {
  return i < seqlen_q ? static_cast<float>(static_cast<int64_t>(c.q_pos[i]) + c.q_diag[i]) : 0.0f;
}

// The position of key j of the row as float32; 0 past the end (masked there).
__device__ __forceinline__ float key_position(const HeadContext& c, int64_t j, int64_t seqlen_kv) {
  return j < seqlen_kv ? static_cast<float>(c.kv_pos[j]) : 0.0f;
}

// x [kCols / 8][4] (a warp's fragments of unscaled scores) += -coefficient * distance(t, e)
// for element e of tile t (distance: alibi_distance of that element's query and key).
template <int kCols, typename Distance>
__device__ __forceinline__ void add_alibi(float (&x)[kCols / 8][4], float coefficient, Distance distance) {
#pragma unroll
  for (int t = 0; t < kCols / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[t][e] = fmaf(-coefficient, distance(t, e), x[t][e]);
  }
}

// The lane's part of the slope's gradient of a tile: sum of ds(t, e) * (-distance(t, e)) over
// its fragments (ds: the scores' gradient, 0 where masked).
template <int kCols, typename Distance>
__device__ __forceinline__ float alibi_slope_partial(const float (&ds)[kCols / 8][4], Distance distance) {
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kCols / 8; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) sum = fmaf(-ds[t][e], distance(t, e), sum);
  }
  return sum;
}

// The sum of `value` over the lanes of a warp (every lane gets it; a fixed order).
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += warp_shfl_xor(value, offset);
  return value;
}

// Stores the warp's sum of `partial` at *slot (all lanes of the warp call it).
__device__ __forceinline__ void store_warp_partial(float partial, float* slot) {
  const float sum = warp_sum(partial);
  if (threadIdx.x % kWarpSize == 0) *slot = sum;
}

// The partial sums of batch row b and head h: [a.slope_slots] floats of a.slope_partials.
__device__ __forceinline__ float* head_slope_slots(const FlashArgs& a, int64_t b, int64_t h) {
  return a.slope_partials + (b * a.p.heads + h) * a.slope_slots;
}

// a.d_slopes[b, h] = the sum of the a.slope_slots partial sums of (b, h), in a fixed order.
void launch_slope_gradient(gpuStream_t stream, const FlashArgs& a);

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_ALIBI_TILE_CUH_
