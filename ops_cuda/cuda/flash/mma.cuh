// The NVIDIA tensor-core layer of the flash kernels (CUDA, sm_80 and later; the
// interface: tensor_core.cuh): mma.sync m16n8k16 with float accumulators, ldmatrix,
// cp.async, and a swizzled shared-memory tile of 16-byte chunks (and movmatrix, outside the
// interface: the paged decode kernel's, CUDA only).
//
// Fragment layouts (lane l of 32; PTX ISA "mma.m16n8k16"; fragment_maps.h, mma_sync_map):
//   C/D (16 x 8, float): c[0], c[1] = row l/4,     cols 2(l%4), 2(l%4)+1
//                        c[2], c[3] = row l/4 + 8, the same cols
//   A (16 x 16): a[0] rows 0-7 k 0-7, a[1] rows 8-15 k 0-7, a[2] rows 0-7 k 8-15,
//                a[3] rows 8-15 k 8-15 (two 16-bit values each, as in C)
//   B (16 x 8):  b[0] k 0-7, b[1] k 8-15 of col l/4, rows 2(l%4), 2(l%4)+1
// so the C fragments of two adjacent 8-column tiles are, packed to 16 bits, the
// A fragment of one 16-deep step: scores feed the next product from registers.
#ifndef FUSEDATTN_FLASH_MMA_CUH_
#define FUSEDATTN_FLASH_MMA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "fragment_maps.h"
#include "fusedattn/portability.h"

namespace fusedattn {
namespace flash {

namespace fragment_map = mma_sync_map;  // the lane maps of this platform (tensor_core.cuh)
constexpr int kPipelineStages = 2;  // cp.async: the next tile's copy in flight while one is computed
constexpr int kMaxDynamicSharedBytes = 227 * 1024;  // shared memory a block may have on sm_80 and sm_90

// Lane l's two rows (l/4 and l/4 + 8) and columns of the 16 x 8 accumulator tile t of a warp:
// element e of tile t is row row0 + lane/4 + 8 * (e / 2), column col0 + 8 t + 2 (lane % 4) + e % 2.
// (The maps are sums of a lane part and an element part; added in this order, the element's
// constant folds into the 64-bit index.)
struct FragmentCoords {
  int64_t row0, col0;
  int lane;
  __device__ __forceinline__ int64_t row(int e) const {
    return row0 + mma_sync_map::c_row(lane, 0) + mma_sync_map::c_row(0, e);
  }
  __device__ __forceinline__ int64_t col(int t, int e) const {
    return col0 + 8 * t + mma_sync_map::c_col(lane, 0) + mma_sync_map::c_col(0, e);
  }
  // Whether the lane holds column 0 of its rows (one lane per row writes the row's statistics).
  __device__ __forceinline__ bool first_of_row() const { return lane % 4 == 0; }
};

using SharedAddress = uint32_t;  // a shared-memory address, as ldmatrix and cp.async take it

__device__ __forceinline__ SharedAddress smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two floats as one register of two 16-bit values of element type ET (low = a).
template <ElementType ET>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (ET == ElementType::kBF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// d += a * b for one 16 x 8 x 16 step.
template <ElementType ET>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (ET == ElementType::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The transpose of an 8 x 8 matrix of 16-bit values held as lane l's row l/4, columns
// 2(l%4), 2(l%4)+1 (a C fragment half packed by pack2, or an ldmatrix result), in the same
// layout: a score tile's fragment becomes the B operand of the next product.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Copies 16 bytes global -> shared asynchronously (cp.async; tile_copies_commit and
// tile_copies_wait order the copies); zero-fills when !valid.
__device__ __forceinline__ void copy_chunk(uint32_t smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}

// Closes the group of tile copies issued since the last call.
__device__ __forceinline__ void tile_copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void tile_copies_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// A [rows x 8*kChunks] tile of 16-bit elements in shared memory, stored as 16-byte
// chunks with chunk c of row r at slot r * kChunks + (c ^ (r % 8)): the eight rows an
// ldmatrix reads at one chunk column land in eight different bank groups.
template <int kChunks>
struct SwizzledTile {
  static_assert(kChunks >= 8 && kChunks % 8 == 0, "rows of at least 64 elements");
  uint32_t base;  // shared-memory address

  __device__ __forceinline__ uint32_t row(int r) const { return base + static_cast<uint32_t>(r * kChunks * 16); }
};

// The byte offsets, within a row whose index is lane % 8 modulo 8, of the swizzled chunks
// 2m + odd (m = 0 .. 3): chunk c of such a row sits at 16 * (c & ~7) + offset[(c / 2) % 4]
// when c % 2 == odd. Every operand a lane reads in the products below is of this form, so
// the swizzle costs four registers per lane instead of address arithmetic per load.
struct LaneChunks {
  uint32_t offset[4];

  __device__ __forceinline__ explicit LaneChunks(int odd) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < 4; ++m) offset[m] = static_cast<uint32_t>((((2 * m) | odd) ^ (lane % 8)) * 16);
  }

  // The address of chunk 2 * pair + odd of the row at row_address.
  __device__ __forceinline__ uint32_t at(uint32_t row_address, int pair) const {
    return row_address + static_cast<uint32_t>((2 * pair) & ~7) * 16 + offset[pair % 4];
  }
};

// acc[t] (16 x 8 tiles t = 0 .. kCols/8) += X[x_row0 .. +16, :kDepth] * Y[0 .. kCols, :kDepth]^T,
// X and Y rows in swizzled tiles (the scores S = Q K^T, and dP = dO V^T, for one warp;
// x_row0 a multiple of 16).
template <ElementType ET, int kDepth, int kCols, int kXChunks, int kYChunks>
__device__ __forceinline__ void warp_rows_times_rows(float (&acc)[kCols / 8][4], SwizzledTile<kXChunks> x,
                                                     int x_row0, SwizzledTile<kYChunks> y) {
  const int lane = threadIdx.x % 32;
  const LaneChunks a_chunks(lane / 16), b_chunks((lane / 8) % 2);
  const uint32_t x_row = x.row(x_row0 + (lane % 8) + 8 * ((lane / 8) % 2));
  const uint32_t y_row = y.row((lane % 8) + 8 * (lane / 16));
#pragma unroll
  for (int ks = 0; ks < kDepth / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, a_chunks.at(x_row, ks));
    const uint32_t y_address = b_chunks.at(y_row, ks);
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, y_address + np * 16 * kYChunks * 16);
      mma_16816<ET>(acc[2 * np], a, b[0], b[1]);
      mma_16816<ET>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[t] (16 x 8 tiles over output cols [8 * chunk0, 8 * chunk0 + kOut)) += P * Z[0 .. kDepth, cols],
// with P (16 x kDepth) in registers as C fragments (p[t], t = 0 .. kDepth/8) and Z's rows in a
// swizzled tile (O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K); chunk0 a multiple of 8.
template <ElementType ET, int kDepth, int kOut, int kZChunks>
__device__ __forceinline__ void warp_regs_times_rows(float (&acc)[kOut / 8][4], const float (&p)[kDepth / 8][4],
                                                     SwizzledTile<kZChunks> z, int chunk0) {
  const int lane = threadIdx.x % 32;
  const LaneChunks b_chunks(lane / 16);
  const uint32_t z_row = z.row((lane % 8) + 8 * ((lane / 8) % 2)) + chunk0 * 16;
#pragma unroll
  for (int ks = 0; ks < kDepth / 16; ++ks) {
    const uint32_t a[4] = {pack2<ET>(p[2 * ks][0], p[2 * ks][1]), pack2<ET>(p[2 * ks][2], p[2 * ks][3]),
                           pack2<ET>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                           pack2<ET>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
#pragma unroll
    for (int dp = 0; dp < kOut / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_chunks.at(z_row + ks * 16 * kZChunks * 16, dp));
      mma_16816<ET>(acc[2 * dp], a, b[0], b[1]);
      mma_16816<ET>(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_MMA_CUH_
