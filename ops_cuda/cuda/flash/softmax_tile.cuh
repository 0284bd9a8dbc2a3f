// The online softmax of the flash forward kernels, shared by the sm_80 (mma.sync), the
// AMD (MFMA) and the sm_90a (wgmma) kernels: the NVIDIA ones hold a warp's scores and
// outputs in the same fragment layout (16 rows per warp; lane l holds rows l/4 and l/4 + 8,
// see mma.cuh), the AMD one in its own (32 rows per wave64, one per lane: mfma.cuh); the
// text below reads the layout through FragmentCoords, kLaneRows and row_reduce only, so one
// tile step and one epilogue serve all three.
#ifndef FUSEDATTN_FLASH_SOFTMAX_TILE_CUH_
#define FUSEDATTN_FLASH_SOFTMAX_TILE_CUH_

#include <cmath>

#include "params.cuh"
#include "pipeline.cuh"

namespace fusedattn {
namespace flash {

// parts[0] op parts[1] op ... as a tree (kParts a power of two).
template <int kParts, typename Op>
__device__ __forceinline__ float combine_parts(const float (&parts)[kParts], Op op) {
  static_assert((kParts & (kParts - 1)) == 0, "a power of two");
  float x[kParts];
#pragma unroll
  for (int k = 0; k < kParts; ++k) x[k] = parts[k];
#pragma unroll
  for (int width = kParts / 2; width >= 1; width /= 2) {
#pragma unroll
    for (int k = 0; k < width; ++k) x[k] = op(x[k], x[k + width]);
  }
  return x[0];
}

// The running maxima moved to the rows' block maxima (scaled, [kLaneRows]) wherever those
// exceed them; factor[r]: what the row's past sums and outputs must be multiplied by.
__device__ __forceinline__ void move_maxima(SoftmaxState (&state)[kLaneRows], const float (&block_max)[kLaneRows],
                                            float (&factor)[kLaneRows]) {
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    // Branch-free: exp2 of 0 is exactly 1 where the max stays; a row without a visible key
    // so far has l = 0 and o = 0, whatever the factor.
    const float m = fmaxf(state[r].m, block_max[r]);
    factor[r] = state[r].any ? fast_exp2((state[r].m - m) * kLog2e) : 0.0f;
    state[r].l *= factor[r];
    state[r].m = m;
    state[r].any |= block_max[r] > -INFINITY;
  }
}

// move_maxima with stale maxima: a row's running max moves only when its block max exceeds
// it by more than kStaleMax (or the row has seen nothing yet). The weights are then at most
// e^kStaleMax = 2^8, which float32 sums and bf16/fp16 weights hold as exactly as weights
// <= 1, and o / l, with the same max in both, is unchanged. Returns whether any row of the
// warp moved (warp-uniform; factor holds only ones otherwise): once the maxima settle, O's
// rescale is skipped.
constexpr float kStaleMax = 8.0f * 0.69314718f;  // 8 ln 2
__device__ __forceinline__ bool move_stale_maxima(SoftmaxState (&state)[kLaneRows],
                                                  const float (&block_max)[kLaneRows], float (&factor)[kLaneRows]) {
  bool move[kLaneRows], lane_moves = false;
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    move[r] = block_max[r] > -INFINITY && (!state[r].any || block_max[r] - state[r].m > kStaleMax);
    lane_moves |= move[r];
    factor[r] = 1.0f;
  }
  const bool moved = warp_ballot(lane_moves) != 0;
  if (moved) {
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
      // A row without a visible key so far has m = -inf (factor 0) and l = 0, o = 0.
      factor[r] = move[r] ? fast_exp2((state[r].m - block_max[r]) * kLog2e) : 1.0f;
      state[r].l *= factor[r];
      state[r].m = move[r] ? block_max[r] : state[r].m;
    }
  }
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) state[r].any |= block_max[r] > -INFINITY;
  return moved;
}

// One key tile of a warp's kWarpRows rows: unscaled scores [kWarpRows x kN] (fragments), masked
// elements -inf (set by selection, never arithmetic, so that anything K holds there
// contributes nothing), become the weights exp(scale s - m) (dropout applied) that O += P V
// takes; the row statistics move to the new running max, and factor[r] receives what the
// outputs accumulated so far must be multiplied by (rescale_rows) for the lane's row r.
// kv: the fragment's coordinates (rows: queries, columns: keys). kStale: the maxima move
// by move_stale_maxima (the sm90 forward, where the other warpgroup's products hide the
// vote), else by move_maxima (the sm_80 and AMD kernels, whose warps would wait for the
// vote before their exponentials; `moved` is then true).
//
// after_max(moved) runs once the maxima and factors are known, before the weights are
// computed (the sm90 forward waits there for the product that still reads the previous
// weights, so that the rescale of O and the packing of the weights can interleave with the
// exponentials). kMayDrop = false: no dropout here (a kernel instance for calls without
// it, or the sm90 forward, which drops its packed weights by dropout_flags_pair's flags).
struct NoStep {
  __device__ __forceinline__ void operator()(bool) const {}
};
template <int kN, bool kMayDrop = true, bool kStale = false, typename AfterMax = NoStep>
__device__ __forceinline__ void softmax_weights(float (&scores)[kN / 8][4], SoftmaxState (&state)[kLaneRows],
                                                const FlashArgs& a, const HeadContext& c, int64_t h,
                                                FragmentCoords kv, float (&factor)[kLaneRows],
                                                AfterMax after_max = {}) {
  const AttentionParams& p = a.p;
  // Maxima and sums in kParts independent partials per row, so that the dependent chains
  // are kN / 8 / 2 long instead of kN / 4 (both rows' chains in flight together).
  constexpr int kParts = 2 * kRowElems;
  const auto part = [](int n, int e) { return (n % 2) * kRowElems + e % kRowElems; };
  float partial[kLaneRows][kParts];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
#pragma unroll
    for (int k = 0; k < kParts; ++k) partial[r][k] = -INFINITY;
  }
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float& x = partial[e / kRowElems][part(n, e)];
      x = fmaxf(x, scores[n][e]);
    }
  }
  float block_max[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) block_max[r] = combine_parts(partial[r], [](float x, float y) { return fmaxf(x, y); });
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    // The scale is positive (the op checks it), so the scaled scores' maximum is this one scaled.
    block_max[r] = row_reduce(block_max[r], [](float x, float y) { return fmaxf(x, y); }) * p.scale;
  }
  bool moved = true;
  if constexpr (kStale) {
    moved = move_stale_maxima(state, block_max, factor);
  } else {
    move_maxima(state, block_max, factor);
  }
  after_max(moved);
  // exp(scale x - m) as exp2(x scale log2(e) - m log2(e)), one multiply-add per element;
  // masked x = -inf gives 0 (a row without a visible key so far has m = -inf and every
  // weight masked).
  const float scale_log2 = p.scale * kLog2e;
  float m_log2[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    m_log2[r] = state[r].any ? state[r].m * kLog2e : 0.0f;
#pragma unroll
    for (int k = 0; k < kParts; ++k) partial[r][k] = 0.0f;
  }
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float w = fast_exp2(fmaf(scores[n][e], scale_log2, -m_log2[e / kRowElems]));
      partial[e / kRowElems][part(n, e)] += w;
      scores[n][e] = w;
    }
  }
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) state[r].l += combine_parts(partial[r], [](float x, float y) { return x + y; });
  static_assert(kN % 16 == 0, "dropout bits come two tiles at a time");
  if (kMayDrop && p.dropout) {
#pragma unroll
    for (int n = 0; n < kN / 8; n += 2) {
      const uint32_t kept = dropout_kept_pair(p, c, h, kv, n);
#pragma unroll
      for (int k = 0; k < 8; ++k) scores[n + k / 4][k % 4] *= (kept >> k) & 1u ? p.dropout_scale : 0.0f;
    }
  }
}

// o [kWarpRows x D] (fragments) times the lane's row factors.
template <int D>
__device__ __forceinline__ void rescale_rows(float (&o)[D / 8][4], const float (&factor)[kLaneRows]) {
#pragma unroll
  for (int d = 0; d < D / 8; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] *= factor[e / kRowElems];
  }
}

// softmax_weights, after masking the scores unless `full` (every (query, key) pair of the
// tile visible), with o [kWarpRows x D] rescaled at once.
template <int kN, int D>
__device__ __forceinline__ void softmax_tile(float (&scores)[kN / 8][4], float (&o)[D / 8][4],
                                             SoftmaxState (&state)[kLaneRows], const FlashArgs& a,
                                             const HeadContext& c, const QueryToken (&query)[kLaneRows], int64_t h,
                                             FragmentCoords kv, bool full) {
  if (!full) {
    mask_fragment(scores, -INFINITY, [&](int n, int e) {
      return key_visible(a.p.mask, c, query[e / kRowElems], kv.col(n, e), a.p.seqlen_kv);
    });
  }
  float factor[kLaneRows];
  softmax_weights<kN>(scores, state, a, c, h, kv, factor);
  rescale_rows<D>(o, factor);
}

// The statistics at the end of a warp's kWarpRows rows: completes the row sums over the
// lanes, folds the softmax sink in, stores the log-sum-exp at lse_row (the [Sq] row of lse
// of this batch row and head; rows < seqlen_q of `at`) and returns each lane row's
// 1 / denominator in `inverse`.
__device__ __forceinline__ void finish_statistics(SoftmaxState (&state)[kLaneRows], const AttentionParams& p,
                                                  float sink, FragmentCoords at, float* lse_row,
                                                  float (&inverse)[kLaneRows]) {
  float lse[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    state[r].l = row_reduce(state[r].l, [](float x, float y) { return x + y; });
    lse[r] = state[r].finalize(p.softmax_type, sink, &inverse[r]);
  }
  if (at.first_of_row()) {
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
      const int64_t i = at.row(kRowElems * r);
      if (i < p.seqlen_q) lse_row[i] = lse[r];
    }
  }
}

// finish_statistics, then o / denominator (rows < seqlen_q) stored at dst (row stride
// q_stride, the rows of `at`).
template <ElementType ET, int D>
__device__ __forceinline__ void finish_rows(const float (&o)[D / 8][4], SoftmaxState (&state)[kLaneRows],
                                            const AttentionParams& p, float sink, uint16_t* dst, int64_t q_stride,
                                            FragmentCoords at, float* lse_row) {
  float inverse[kLaneRows];
  finish_statistics(state, p, sink, at, lse_row, inverse);
  store_rows<ET>(o, inverse, dst, q_stride, at, p.seqlen_q);
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SOFTMAX_TILE_CUH_
