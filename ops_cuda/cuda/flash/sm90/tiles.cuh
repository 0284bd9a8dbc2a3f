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
// the forward's O, the backward's dQ tile).
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
// kThreads threads take part (index: thread); the caller orders the stores before the
// products that read the tile (fence_proxy_async, a barrier).
template <int kRows, int kAtoms, int kThreads>
__device__ __forceinline__ void zero_padding_rows(uint32_t tile, const int32_t* seg, int64_t row0, int64_t seqlen,
                                                  int thread) {
  // A row is kThreadsPerRow runs of kChunks 16-byte chunks, each within one atom.
  constexpr int kThreadsPerRow = kThreads / kRows;
  constexpr int kChunks = kAtoms * kAtomRowBytes / 16 / kThreadsPerRow;
  static_assert(kThreadsPerRow * kRows == kThreads && kChunks >= 1 && 8 % kChunks == 0, "whole runs in an atom");
  const int row = thread / kThreadsPerRow, first = (thread % kThreadsPerRow) * kChunks;
  const int64_t j = row0 + row;
  if (j < seqlen && seg[j] == 0) {
    const uint32_t address = tile + (first / 8) * kRows * kAtomRowBytes + row * kAtomRowBytes + (first % 8) * 16;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) store_zero_16(address + 16 * k);
  }
}

// A warpgroup's float32 results (acc: 64 x D, warp w holding rows row0 + lane / 4 (+ 8) of
// a tile of kTileRows rows), times each row's factor, into that tile in shared memory at
// `tile`, swizzled as TMA reads it (row r of atom a at a x kTileRows x 128 + 128 r, 16-byte
// chunk c at (c ^ r % 8) x 16): a TMA store of the rows follows (the tile's own operand is no
// longer read there). The quarter-warp of a row writes one chunk; 8 rows, 8 chunks: no bank
// conflicts.
template <ElementType ET, int D, int kTileRows>
__device__ __forceinline__ void stage_rows(const float (&acc)[D / 8][4], const float (&factor)[kLaneRows],
                                           uint32_t tile, int row0, int lane) {
#pragma unroll
  for (int half = 0; half < kLaneRows; ++half) {
    const int r = row0 + lane / 4 + 8 * half;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      const uint32_t address = tile + (t / 8) * kTileRows * kAtomRowBytes + r * kAtomRowBytes +
                               (((t % 8) ^ (r % 8)) << 4) + (lane % 4) * 4;
      const uint32_t packed = pack2<ET>(acc[t][2 * half] * factor[half], acc[t][2 * half + 1] * factor[half]);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(address), "r"(packed) : "memory");
    }
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_TILES_CUH_
