// The AMD tensor-core layer of the flash kernels (HIP, CDNA2/CDNA3: gfx90a, gfx94x; wave64;
// the interface: tensor_core.cuh): MFMA 32x32x8 (bf16_1k, f16) with float accumulators,
// operands read from LDS by plain loads, tiles copied global -> LDS by plain loads and
// stores (one pipeline stage). Compile-checked only: never run on AMD hardware.
//
// A wave's fragment is 32 rows x 8 columns per tile, lane l holding row l % 32 and columns
// 4 (l / 32) .. + 3 (fragment_maps.h, mfma_map). A product X Y^T is issued as C = Y X^T
// (MFMA rows: the fragment's columns), so that C's lane layout is the fragment's and a
// fragment, packed to 16 bits, is the B operand of the next product (P V, dS K).
// The tiles are stored as on NVIDIA (16-byte chunks, chunk c of row r at c ^ (r % 8)).
#ifndef FUSEDATTN_FLASH_MFMA_CUH_
#define FUSEDATTN_FLASH_MFMA_CUH_

#include <hip/hip_runtime.h>

#include <cstdint>

#include "fragment_maps.h"
#include "fusedattn/portability.h"

namespace fusedattn {
namespace flash {

namespace fragment_map = mfma_map;  // the lane maps of this platform (tensor_core.cuh)
constexpr int kPipelineStages = 1;  // plain loads: a tile is loaded, then computed
// LDS per workgroup (64 KB on gfx90a and gfx94x), less room for the kernels' static shared memory.
constexpr int kMaxDynamicSharedBytes = 65536 - 1024;

// Lane l's row (l % 32) and columns of the 32 x 8 accumulator tile t of a wave: element e of
// tile t is row row0 + l % 32, column col0 + 8 t + 4 (l / 32) + e.
struct FragmentCoords {
  int64_t row0, col0;
  int lane;
  __device__ __forceinline__ int64_t row(int) const { return row0 + mfma_map::frag_row(lane); }
  __device__ __forceinline__ int64_t col(int t, int e) const { return col0 + 8 * t + mfma_map::frag_col(lane, e); }
  __device__ __forceinline__ bool first_of_row() const { return mfma_map::frag_col(lane, 0) == 0; }
};

using SharedAddress = unsigned char*;  // a pointer into the kernel's LDS

__device__ __forceinline__ SharedAddress smem_address(unsigned char* p) { return p; }

// Two floats as one register of two 16-bit values of element type ET (low = a), rounded to
// nearest even as on NVIDIA.
template <ElementType ET>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return static_cast<uint32_t>(Element<ET>::store(a)) | (static_cast<uint32_t>(Element<ET>::store(b)) << 16);
}

typedef float Floatx16 __attribute__((ext_vector_type(16)));
typedef short Shortx4 __attribute__((ext_vector_type(4)));
typedef _Float16 Halfx4 __attribute__((ext_vector_type(4)));

// Four 16-bit operand elements (element i in bits 16 (i % 2) of word i / 2).
struct Operand4 {
  uint32_t w[2];
};

// c += a * b for one 32 x 32 x 8 block (a: A elements, b: B elements of the lane).
template <ElementType ET>
__device__ __forceinline__ void mfma_32x32x8(Floatx16& c, Operand4 a, Operand4 b) {
  if constexpr (ET == ElementType::kBF16) {
    c = __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(__builtin_bit_cast(Shortx4, a), __builtin_bit_cast(Shortx4, b), c,
                                                 0, 0, 0);
  } else {
    c = __builtin_amdgcn_mfma_f32_32x32x8f16(__builtin_bit_cast(Halfx4, a), __builtin_bit_cast(Halfx4, b), c, 0, 0,
                                             0);
  }
}

// A [rows x 8*kChunks] tile of 16-bit elements in LDS, stored as 16-byte chunks with chunk c
// of row r at slot r * kChunks + (c ^ (r % 8)) (the NVIDIA layout).
template <int kChunks>
struct SwizzledTile {
  static_assert(kChunks >= 8 && kChunks % 8 == 0, "rows of at least 64 elements");
  SharedAddress base;

  __device__ __forceinline__ SharedAddress row(int r) const { return base + r * kChunks * 16; }

  // The element at column col of row r.
  __device__ __forceinline__ const uint16_t* at(int r, int col) const {
    return reinterpret_cast<const uint16_t*>(row(r) + ((col / 8) ^ (r % 8)) * 16) + col % 8;
  }

  // Elements col .. col + 3 of row r (col a multiple of 4: within one chunk).
  __device__ __forceinline__ Operand4 four(int r, int col) const {
    const uint2 v = *reinterpret_cast<const uint2*>(at(r, col));
    return Operand4{{v.x, v.y}};
  }
};

// Copies 16 bytes global -> LDS (plain loads and stores: complete on return); zeros when !valid.
__device__ __forceinline__ void copy_chunk(SharedAddress lds, const uint16_t* global, bool valid) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (valid) v = *reinterpret_cast<const uint4*>(global);
  *reinterpret_cast<uint4*>(lds) = v;
}

// The copies of copy_chunk have completed when it returns: nothing to order.
__device__ __forceinline__ void tile_copies_commit() {}

template <int kPending>
__device__ __forceinline__ void tile_copies_wait() {}

// The accumulators of the MFMA for 32-column block `block` of a fragment, and back.
template <int kTiles>
__device__ __forceinline__ Floatx16 gather_block(const float (&acc)[kTiles][4], int block) {
  Floatx16 c;
#pragma unroll
  for (int r = 0; r < mfma_map::kItems; ++r) c[r] = acc[mfma_map::item_tile(block, r)][mfma_map::item_element(r)];
  return c;
}

template <int kTiles>
__device__ __forceinline__ void scatter_block(float (&acc)[kTiles][4], int block, const Floatx16& c) {
#pragma unroll
  for (int r = 0; r < mfma_map::kItems; ++r) acc[mfma_map::item_tile(block, r)][mfma_map::item_element(r)] = c[r];
}

// acc (tiles over columns [0, kCols)) += X[x_row0 .. +32, :kDepth] * Y[0 .. kCols, :kDepth]^T,
// X and Y rows in swizzled tiles (S = Q K^T, dP = dO V^T for one wave), as C = Y X^T per
// 32-column block: A = Y's rows, B = X's rows.
template <ElementType ET, int kDepth, int kCols, int kXChunks, int kYChunks>
__device__ __forceinline__ void warp_rows_times_rows(float (&acc)[kCols / 8][4], SwizzledTile<kXChunks> x,
                                                     int x_row0, SwizzledTile<kYChunks> y) {
  static_assert(kCols % mfma_map::kBlock == 0 && kDepth % mfma_map::kDepth == 0, "whole MFMA blocks");
  const int lane = threadIdx.x % mfma_map::kLanes;
#pragma unroll
  for (int block = 0; block < kCols / mfma_map::kBlock; ++block) {
    Floatx16 c = gather_block(acc, block);
#pragma unroll
    for (int ks = 0; ks < kDepth / mfma_map::kDepth; ++ks) {
      const int k0 = ks * mfma_map::kDepth;
      const Operand4 a = y.four(block * mfma_map::kBlock + mfma_map::a_row(lane), k0 + mfma_map::a_depth(lane, 0));
      const Operand4 b = x.four(x_row0 + mfma_map::b_col(lane), k0 + mfma_map::b_depth(lane, 0));
      mfma_32x32x8<ET>(c, a, b);
    }
    scatter_block(acc, block, c);
  }
}

// acc (tiles over output cols [8 * chunk0, 8 * chunk0 + kOut)) += P * Z[0 .. kDepth, cols],
// with P (32 x kDepth) in registers as fragments (p[t], t = 0 .. kDepth/8) and Z's rows in a
// swizzled tile (O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K), as C = Z^T P^T per
// 32-column block: A = Z's columns (four LDS reads a lane), B = P's fragments packed.
template <ElementType ET, int kDepth, int kOut, int kZChunks>
__device__ __forceinline__ void warp_regs_times_rows(float (&acc)[kOut / 8][4], const float (&p)[kDepth / 8][4],
                                                     SwizzledTile<kZChunks> z, int chunk0) {
  static_assert(kOut % mfma_map::kBlock == 0 && kDepth % mfma_map::kDepth == 0, "whole MFMA blocks");
  const int lane = threadIdx.x % mfma_map::kLanes;
#pragma unroll
  for (int block = 0; block < kOut / mfma_map::kBlock; ++block) {
    Floatx16 c = gather_block(acc, block);
    const int col = 8 * chunk0 + block * mfma_map::kBlock + mfma_map::a_row(lane);
#pragma unroll
    for (int ks = 0; ks < kDepth / mfma_map::kDepth; ++ks) {
      const int k0 = ks * mfma_map::kDepth;
      uint16_t a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = *z.at(k0 + mfma_map::a_depth(lane, i), col);
      const Operand4 av{{a[0] | static_cast<uint32_t>(a[1]) << 16, a[2] | static_cast<uint32_t>(a[3]) << 16}};
      // B element i (depth k0 + b_depth(lane, i), column b_col(lane)) is the lane's fragment
      // element i of tile ks (column frag_col(lane, i), row frag_row(lane)): fragment_maps.h.
      const Operand4 bv{{pack2<ET>(p[ks][0], p[ks][1]), pack2<ET>(p[ks][2], p[ks][3])}};
      mfma_32x32x8<ET>(c, av, bv);
    }
    scatter_block(acc, block, c);
  }
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_MFMA_CUH_
