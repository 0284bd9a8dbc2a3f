// The loop every flash kernel runs: one operand block stays in shared memory
// while the tiles of the other stream through two stages, the copy of the next
// visible tile in flight while the current one is computed.
#ifndef FUSEDATTN_FLASH_PIPELINE_CUH_
#define FUSEDATTN_FLASH_PIPELINE_CUH_

#include <climits>

#include "mma.cuh"
#include "spans.cuh"

namespace fusedattn {
namespace flash {

// For each tile t in [0, n_tiles) with relation(t).any, in order: load(t, stage) issues the
// tile's cp.async copies into `stage` (0 or 1), compute(t, stage, relation(t).full) runs after
// they (and every copy committed before this call) have landed. Block-wide.
template <int kThreads, typename Relation, typename Load, typename Compute>
__device__ __forceinline__ void stream_tiles(int n_tiles, Relation relation, Load load, Compute compute) {
  __shared__ TileWindow<kThreads> window;
  if (threadIdx.x == 0) window.base = INT_MIN / 2;
  __syncthreads();
  bool full;
  int t = next_tile<kThreads>(window, -1, n_tiles, relation, &full);
  if (t < n_tiles) load(t, 0);
  cp_async_commit();
  for (int stage = 0; t < n_tiles; stage ^= 1) {
    bool next_full;
    const int next = next_tile<kThreads>(window, t, n_tiles, relation, &next_full);
    if (next < n_tiles) load(next, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    compute(t, stage, full);
    __syncthreads();  // the stage is refilled two tiles on
    t = next;
    full = next_full;
  }
  cp_async_wait<0>();
}

// Lane l's two rows (l/4 and l/4 + 8) and columns of the 16 x 8 accumulator tile t of a warp:
// element e of tile t is row row0 + lane/4 + 8 * (e / 2), column col0 + 8 t + 2 (lane % 4) + e % 2.
struct FragmentCoords {
  int64_t row0, col0;
  int lane;
  __device__ __forceinline__ int64_t row(int e) const { return row0 + lane / 4 + 8 * (e / 2); }
  __device__ __forceinline__ int64_t col(int t, int e) const { return col0 + 8 * t + 2 * (lane % 4) + e % 2; }
};

// Sets the elements of a warp's 16 x (8 * kTiles) fragment for which !visible(tile, element)
// to `value`. Kept apart from the arithmetic on every element, so that the common path (a
// tile with nothing masked) runs through compact code.
template <int kTiles, typename Visible>
__device__ __forceinline__ void mask_fragment(float (&x)[kTiles][4], float value, Visible visible) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!visible(t, e)) x[t][e] = value;
    }
  }
}

// Stores a warp's 16 x (8 * kTiles) accumulators as 16-bit elements of type ET, the lane's
// first row times factor[0] and its second times factor[1]:
// row r (global index row0 + r, only those < rows) at dst + r * row_stride, columns from col0.
template <ElementType ET, int kTiles>
__device__ __forceinline__ void store_rows(const float (&acc)[kTiles][4], const float (&factor)[2], uint16_t* dst,
                                           int64_t row_stride, FragmentCoords at, int64_t rows) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t r = at.row(2 * half);
    if (r >= rows) continue;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      *reinterpret_cast<uint32_t*>(dst + r * row_stride + at.col(t, 0)) =
          pack2<ET>(acc[t][2 * half] * factor[half], acc[t][2 * half + 1] * factor[half]);
    }
  }
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_PIPELINE_CUH_
