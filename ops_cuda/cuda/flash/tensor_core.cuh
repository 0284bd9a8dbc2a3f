// The tensor-core layer of the flash kernels: everything that depends on the matrix-core
// instructions (products, fragment loads, tile copies, the fragment layout), one header per
// vendor behind one interface, so that the kernels (forward.cuh, backward.cuh) and their
// shared helpers (pipeline.cuh, softmax_tile.cuh, params.cuh) are one text for both:
//
//   mma.cuh   NVIDIA, sm_80 and later: mma.sync m16n8k16, ldmatrix, cp.async; warps of 32
//   mfma.cuh  AMD CDNA (gfx90a, gfx94x), wave64: MFMA 32x32x8, LDS reads, plain loads
//
// Each provides, in namespace fusedattn::flash:
//   fragment_map                                 its lane maps (fragment_maps.h), whence
//                                                kWarpRows, kLaneRows, kRowLaneMaskLow/High
//   kPipelineStages                              stages of the streamed tiles (2 or 1)
//   kMaxDynamicSharedBytes                       shared memory a block may ask for
//   FragmentCoords{row0, col0, lane}             row(e), col(t, e), first_of_row()
//   SharedAddress, smem_address(p)               shared-memory addresses of the tiles
//   SwizzledTile<kChunks>{base}, row(r)          a tile of rows of 8 * kChunks 16-bit elements
//   copy_chunk(dst, src, valid)                  16 bytes global -> shared (zeros if !valid)
//   tile_copies_commit(), tile_copies_wait<k>()  ordering of those copies (pipeline.cuh's load_tile)
//   warp_rows_times_rows<ET, kDepth, kCols>      acc += X[rows of the warp] Y^T   (S = Q K^T)
//   warp_regs_times_rows<ET, kDepth, kOut>       acc += P (fragments) Z          (O += P V)
//   pack2<ET>(a, b)                              two floats as one 32-bit pair of ET
// (and, shared, zero(acc)). Used by the flash kernels and the paged decode kernel (CUDA).
#ifndef FUSEDATTN_FLASH_TENSOR_CORE_CUH_
#define FUSEDATTN_FLASH_TENSOR_CORE_CUH_

#if defined(__HIPCC__)
#include "mfma.cuh"
#else
#include "mma.cuh"
#endif

namespace fusedattn {
namespace flash {

constexpr int kWarpRows = fragment_map::kWarpRows;  // rows of a warp's fragment
constexpr int kLaneRows = fragment_map::kLaneRows;  // rows a lane holds in a tile
// The lanes that hold the same fragment row: lane ^ m for the powers of two m in [low, high].
constexpr int kRowLaneMaskLow = fragment_map::kRowLaneMaskLow, kRowLaneMaskHigh = fragment_map::kRowLaneMaskHigh;
// Lanes between the holders of adjacent fragment rows (rows r .. r + 3, r a multiple of 4,
// sit in the four lanes lane ^ (m kRowLaneStride), m = 0 .. 3).
constexpr int kRowLaneStride = fragment_map::kRowLaneStride;

// Zeroes a warp's accumulators (tiles of kWarpRows x 8, four elements a lane).
template <int kTiles>
__device__ __forceinline__ void zero(float (&acc)[kTiles][4]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_TENSOR_CORE_CUH_
