// What the Hopper kernels share about the tiles they stream: the producer warp's search
// for the visible ones (spans.cuh relations, 32 tiles at a time, a lane each) and the
// zeroing of padding rows (segment id 0) in a TMA-written shared-memory tile, and the mask
// of a fragment as bits.
#ifndef FUSEDATTN_FLASH_SM90_TILES_CUH_
#define FUSEDATTN_FLASH_SM90_TILES_CUH_

#include "../spans.cuh"
#include "primitives.cuh"

namespace fusedattn {
namespace flash {
namespace sm90 {

constexpr int kConsumersBarrier = 1;  // named barrier of the two consumer warpgroups
// Named barriers 4 + cw: consumer warpgroup cw alone (its staged output for a bulk copy:
// the forward's O, the backward's dQ tile, dK and dV).
constexpr int kWarpgroupBarrier = 4;

// The producer warp's view of the tiles: the relations of the 32 tiles from `first` (one
// lane each), as bit masks; refilled when the search leaves them.
struct TileScan {
  int first;
  uint32_t any, full, padded;  // padded: the tile may hold padding tokens (its span is incomplete)
};

// The first tile t > after with relation(t).any, or n_tiles; warp-wide (every lane gets
// it). relation(t, &complete) returns the TileRelation of tile t and whether its streamed
// operand's span is complete.
template <typename Relation>
__device__ __forceinline__ int next_visible(TileScan& scan, int after, int n_tiles, Relation relation) {
  for (int t = after + 1; t < n_tiles;) {
    if (t >= scan.first + 32) {
      scan.first = t;
      const int mine = t + static_cast<int>(threadIdx.x % 32);
      TileRelation r{false, false};
      bool complete = true;
      if (mine < n_tiles) r = relation(mine, &complete);
      scan.any = __ballot_sync(0xffffffffu, r.any);
      scan.full = __ballot_sync(0xffffffffu, r.full);
      scan.padded = __ballot_sync(0xffffffffu, !complete);
    }
    const uint32_t ahead = scan.any >> (t - scan.first);
    if (ahead) return t + __ffs(ahead) - 1;
    t = scan.first + 32;
  }
  return n_tiles;
}

// Bit 4 n + e set where element (n, e) of a lane's [16 x kCols] fragment satisfies pred(n, e)
// (kCols <= 64). The loop over n is not unrolled, so that the predicate (the mask's token
// loads, a Philox draw) holds few registers at a time beside the accumulators.
template <int kCols, typename Pred>
__device__ __forceinline__ uint32_t fragment_bits(Pred pred) {
  static_assert(kCols <= 64, "one bit per element of a 32-bit word");
  uint32_t bits = 0;
#pragma unroll 1
  for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) bits |= static_cast<uint32_t>(pred(n, e)) << (4 * n + e);
  }
  return bits;
}

// Zeroes the rows of the padding tokens (segment id 0, seg[row0 + r]) of a tile of kRows
// rows at `tile` (kAtoms swizzle atoms of kRows x 128 bytes), so that whatever they hold
// (even NaN or Inf) meets only zero weights. Rows past `seqlen` are zero already (TMA).
// kThreads threads take part (index: thread), a row's 128 bytes of one atom each in turn; the
// caller orders the stores before the products that read the tile (fence_proxy_async, a barrier).
template <int kRows, int kAtoms, int kThreads>
__device__ __forceinline__ void zero_padding_rows(uint32_t tile, const int32_t* seg, int64_t row0, int64_t seqlen,
                                                  int thread) {
#pragma unroll 1
  for (int item = thread; item < kRows * kAtoms; item += kThreads) {
    const int row = item % kRows, atom = item / kRows;
    const int64_t j = row0 + row;
    if (j < seqlen && seg[j] == 0) {
      const uint32_t address = tile + atom * kRows * kAtomRowBytes + row * kAtomRowBytes;
#pragma unroll
      for (int k = 0; k < 8; ++k) store_zero_16(address + 16 * k);
    }
  }
}

// The address from which `lane` stores, with store_matrices_x4, the four 8 x 8 matrices of
// 16-bit elements {rows row0 .. + 7, row0 + 8 .. + 15} x {16-byte chunks chunk0, chunk0 + 1}
// of a swizzled tile in shared memory at `tile` (chunk c of row r of the atom: at
// (c / 8) x atom_bytes + 128 r + (c % 8 ^ r % 8) x 16): matrix j holds rows 8 (j % 2) ..,
// chunk chunk0 + j / 2, and lane l addresses row l % 8 of matrix l / 8. A lane's register j
// is then its pair of matrix j at row lane / 4, columns 2 (lane % 4) .. + 1: the fragment
// order of an mma or wgmma accumulator.
__device__ __forceinline__ uint32_t matrix_row_address(uint32_t tile, uint32_t atom_bytes, int row0, int chunk0,
                                                       int lane) {
  const int matrix = lane / 8, r = row0 + lane % 8 + 8 * (matrix % 2), chunk = chunk0 + matrix / 2;
  return tile + (chunk / 8) * atom_bytes + r * kAtomRowBytes + (((chunk % 8) ^ (r % 8)) << 4);
}

// A warpgroup's float32 results (acc: 64 x D, warp w holding rows row0 + lane / 4 (+ 8) of
// a tile of kTileRows rows), times each row's factor, into that tile in shared memory at
// `tile`, swizzled as TMA reads it: a TMA store of the rows follows (the tile's own operand
// is no longer read there). Four 8 x 8 matrices (16 columns of the warp's 16 rows) per
// stmatrix.
template <ElementType ET, int D, int kTileRows>
__device__ __forceinline__ void stage_rows(const float (&acc)[D / 8][4], const float (&factor)[kLaneRows],
                                           uint32_t tile, int row0, int lane) {
#pragma unroll
  for (int t = 0; t < D / 8; t += 2) {
    uint32_t packed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float* x = &acc[t + j / 2][2 * (j % 2)];
      packed[j] = pack2<ET>(x[0] * factor[j % 2], x[1] * factor[j % 2]);
    }
    store_matrices_x4(matrix_row_address(tile, kTileRows * kAtomRowBytes, row0, t, lane), packed);
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_TILES_CUH_
