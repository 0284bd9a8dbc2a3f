// The online softmax of the flash forward kernels, shared by the sm_80 (mma.sync) and
// sm_90a (wgmma) kernels: both hold a warp's scores and outputs in the same fragment
// layout (16 rows per warp; lane l holds rows l/4 and l/4 + 8, see mma.cuh and
// pipeline.cuh), so one tile step and one epilogue serve both.
#ifndef FUSEDATTN_FLASH_SOFTMAX_TILE_CUH_
#define FUSEDATTN_FLASH_SOFTMAX_TILE_CUH_

#include <cmath>

#include "params.cuh"
#include "pipeline.cuh"

namespace fusedattn {
namespace flash {

// One key tile of a warp's 16 rows: scores [16 x kN] (fragments) become the weights
// exp(s - m) (dropout applied) that O += P V takes; the row statistics move to the new
// running max, and factor[r] receives what the outputs accumulated so far must be
// multiplied by (rescale_rows) for the lane's row r. `full`: every (query, key) pair of the
// tile is visible; otherwise masked elements are set to -inf by selection (never
// arithmetic), so that anything K holds there contributes nothing. kv: the fragment's
// coordinates (rows: queries, columns: keys).
template <int kN>
__device__ __forceinline__ void softmax_weights(float (&scores)[kN / 8][4], SoftmaxState (&state)[2],
                                                const FlashArgs& a, const HeadContext& c,
                                                const QueryToken (&query)[2], int64_t h, FragmentCoords kv,
                                                bool full, float (&factor)[2]) {
  const AttentionParams& p = a.p;
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) scores[n][e] *= p.scale;
  }
  if (!full) {
    mask_fragment(scores, -INFINITY, [&](int n, int e) {
      return key_visible(p.mask, c, query[e / 2], kv.col(n, e), p.seqlen_kv);
    });
  }
  float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) block_max[e / 2] = fmaxf(block_max[e / 2], scores[n][e]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 1));
    block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 2));
    factor[r] = state[r].rescale(block_max[r]);
    state[r].any |= block_max[r] > -INFINITY;
  }
  // exp(x - m) as exp2(x log2(e) - m log2(e)); masked x = -inf gives 0 (a row without a
  // visible key so far has m = -inf and every weight masked).
  const float m_log2[2] = {state[0].any ? state[0].m * kLog2e : 0.0f, state[1].any ? state[1].m * kLog2e : 0.0f};
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float w = exp2f(scores[n][e] * kLog2e - m_log2[e / 2]);
      state[e / 2].l += w;
      scores[n][e] = w;
    }
  }
  if (p.dropout) {
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
      float f[4];
      dropout_fragment(p, c, h, kv.row(0), kv.col(n, 0), f);
#pragma unroll
      for (int e = 0; e < 4; ++e) scores[n][e] *= f[e];
    }
  }
}

// o [16 x D] (fragments) times the lane's row factors.
template <int D>
__device__ __forceinline__ void rescale_rows(float (&o)[D / 8][4], const float (&factor)[2]) {
#pragma unroll
  for (int d = 0; d < D / 8; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] *= factor[e / 2];
  }
}

// softmax_weights, with o [16 x D] rescaled at once.
template <int kN, int D>
__device__ __forceinline__ void softmax_tile(float (&scores)[kN / 8][4], float (&o)[D / 8][4],
                                             SoftmaxState (&state)[2], const FlashArgs& a, const HeadContext& c,
                                             const QueryToken (&query)[2], int64_t h, FragmentCoords kv,
                                             bool full) {
  float factor[2];
  softmax_weights<kN>(scores, state, a, c, query, h, kv, full, factor);
  rescale_rows<D>(o, factor);
}

// The end of a warp's 16 rows: completes the row sums over the lane quads, folds the
// softmax sink in, stores o / denominator (rows < seqlen_q) at dst (row stride q_stride,
// the rows of `at`) and the log-sum-exp at lse_row (the [Sq] row of lse of this batch row
// and head).
template <ElementType ET, int D>
__device__ __forceinline__ void finish_rows(const float (&o)[D / 8][4], SoftmaxState (&state)[2],
                                            const AttentionParams& p, float sink, uint16_t* dst, int64_t q_stride,
                                            FragmentCoords at, float* lse_row) {
  float inverse[2];
  float lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    state[r].l += __shfl_xor_sync(0xffffffffu, state[r].l, 1);
    state[r].l += __shfl_xor_sync(0xffffffffu, state[r].l, 2);
    lse[r] = state[r].finalize(p.softmax_type, sink, &inverse[r]);
  }
  store_rows<ET>(o, inverse, dst, q_stride, at, p.seqlen_q);
  if (at.lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = at.row(2 * r);
      if (i < p.seqlen_q) lse_row[i] = lse[r];
    }
  }
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SOFTMAX_TILE_CUH_
