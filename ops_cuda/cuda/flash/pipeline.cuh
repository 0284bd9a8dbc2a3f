// The loop every flash kernel runs, and the fragment helpers they share: one operand
// block stays in shared memory while the tiles of the other stream through it (NVIDIA: two
// stages, the copy of the next visible tile in flight while the current one is computed;
// AMD: one stage, loaded then computed).
#ifndef FUSEDATTN_FLASH_PIPELINE_CUH_
#define FUSEDATTN_FLASH_PIPELINE_CUH_

#include <climits>

#include "fusedattn/gpu_runtime.h"
#include "spans.cuh"
#include "tensor_core.cuh"

namespace fusedattn {
namespace flash {

// For each tile t in [0, n_tiles) with relation(t).any, in order: load(t, stage) issues the
// tile's copies into `stage` (0 .. kPipelineStages - 1), compute(t, stage, relation(t).full)
// runs after they (and every copy committed before this call) have landed. Block-wide.
template <int kThreads, typename Relation, typename Load, typename Compute>
__device__ __forceinline__ void stream_tiles(int n_tiles, Relation relation, Load load, Compute compute) {
  __shared__ TileWindow<kThreads> window;
  if (threadIdx.x == 0) window.base = INT_MIN / 2;
  __syncthreads();
  bool full;
  int t = next_tile<kThreads>(window, -1, n_tiles, relation, &full);
  if (t < n_tiles) load(t, 0);
  tile_copies_commit();
  for (int stage = 0; t < n_tiles; stage = kPipelineStages == 2 ? stage ^ 1 : 0) {
    bool next_full;
    const int next = next_tile<kThreads>(window, t, n_tiles, relation, &next_full);
    if constexpr (kPipelineStages == 2) {
      if (next < n_tiles) load(next, stage ^ 1);
      tile_copies_commit();
      tile_copies_wait<1>();
    }
    __syncthreads();
    compute(t, stage, full);
    __syncthreads();  // the stage is refilled kPipelineStages tiles on
    if constexpr (kPipelineStages == 1) {
      if (next < n_tiles) load(next, 0);
    }
    t = next;
    full = next_full;
  }
  tile_copies_wait<0>();
}

// Loads rows [row0, row0 + kRows) of a strided global array of 16-bit elements
// (row r at src + r * row_stride elements, 8 * kChunks contiguous elements) into
// `tile`; rows at or past `rows` read as zeros. All kThreads threads take part: each
// copies one chunk column of every (kThreads / kChunks)-th row (copy_chunk: NVIDIA
// asynchronous, see tile_copies_wait; AMD synchronous).
template <int kRows, int kChunks, int kThreads>
__device__ __forceinline__ void load_tile(SwizzledTile<kChunks> tile, const uint16_t* src, int64_t row_stride,
                                          int64_t row0, int64_t rows) {
  constexpr int kRowsPerPass = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kRowsPerPass == 0, "whole passes");
  const int r0 = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks;
  const uint16_t* p = src + (row0 + r0) * row_stride + c * 8;
  const int64_t step = kRowsPerPass * row_stride;
#pragma unroll
  for (int k = 0; k < kRows / kRowsPerPass; ++k) {
    const int r = r0 + k * kRowsPerPass;
    const bool valid = row0 + r < rows;
    copy_chunk(tile.row(r) + static_cast<uint32_t>((c ^ (r % 8)) * 16), valid ? p + k * step : src, valid);
  }
}

// The elements of one row in a lane's tile (adjacent columns): element e is row e / kRowElems
// of the lane's kLaneRows, column slot e % kRowElems.
constexpr int kRowElems = 4 / kLaneRows;

// x combined by op over the lanes that hold the same fragment row.
template <typename Op>
__device__ __forceinline__ float row_reduce(float x, Op op) {
#pragma unroll
  for (int m = kRowLaneMaskLow; m <= kRowLaneMaskHigh; m *= 2) x = op(x, warp_shfl_xor(x, m));
  return x;
}

// Sets the elements of a warp's kWarpRows x (8 * kTiles) fragment for which !visible(tile, element)
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

// Stores a warp's kWarpRows x (8 * kTiles) accumulators as 16-bit elements of type ET, the
// lane's row r times factor[r]: row i (global index row0 + i, only those < rows) at
// dst + i * row_stride, columns from col0.
template <ElementType ET, int kTiles>
__device__ __forceinline__ void store_rows(const float (&acc)[kTiles][4], const float (&factor)[kLaneRows],
                                           uint16_t* dst, int64_t row_stride, FragmentCoords at, int64_t rows) {
#pragma unroll
  for (int half = 0; half < kLaneRows; ++half) {
    const int64_t r = at.row(kRowElems * half);
    if (r >= rows) continue;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
#pragma unroll
      for (int e = kRowElems * half; e < kRowElems * (half + 1); e += 2) {
        *reinterpret_cast<uint32_t*>(dst + r * row_stride + at.col(t, e)) =
            pack2<ET>(acc[t][e] * factor[half], acc[t][e + 1] * factor[half]);
      }
    }
  }
}

// store_rows with every row times `factor`.
template <ElementType ET, int kTiles>
__device__ __forceinline__ void store_rows(const float (&acc)[kTiles][4], float factor, uint16_t* dst,
                                           int64_t row_stride, FragmentCoords at, int64_t rows) {
  float factors[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) factors[r] = factor;
  store_rows<ET>(acc, factors, dst, row_stride, at, rows);
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_PIPELINE_CUH_
