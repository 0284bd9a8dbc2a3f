// Hopper (sm_90a) building blocks of the flash kernels: mbarriers, TMA tile loads,
// setmaxnreg, shared-memory matrix descriptors and warpgroup matrix products (wgmma,
// through CUTLASS's CuTe instruction wrappers).
//
// Shared-memory tiles: every operand tile is stored as the tensor-memory accelerator
// writes it with 128-byte swizzling: "atoms" of 64 columns (128 bytes of 16-bit elements),
// each [rows x 128 bytes] with the 16-byte chunks of row r permuted by r % 8; a tile of
// D columns is D / 64 such atoms, one after the other. Atoms start 1024-byte aligned.
#ifndef FUSEDATTN_FLASH_SM90_PRIMITIVES_CUH_
#define FUSEDATTN_FLASH_SM90_PRIMITIVES_CUH_

#include <cuda.h>

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "../mma.cuh"

namespace fusedattn {
namespace flash {
namespace sm90 {

constexpr int kAtomColumns = 64;  // 16-bit elements per 128-byte swizzle atom row
constexpr int kAtomRowBytes = 128;
// The most dynamic shared memory an sm_90 block may opt into; a launch asking for more
// fails with a bare "invalid argument", so every kernel's layout is checked against it.
constexpr int kMaxSharedBytes = 227 * 1024;

// ---- mbarriers (shared-memory addresses) ------------------------------------

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes initialised barriers visible to the other threads and to the copy engine.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Arrives and announces `bytes` that copies will complete on this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- ordering ------------------------------------------------------------------

// Makes this thread's ordinary shared-memory stores visible to later asynchronous-proxy
// reads (wgmma operands, TMA), once a barrier orders them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Waits until `threads` threads (a multiple of 32) have reached named barrier `id` (1-15).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Counts this thread's warp toward named barrier `id` without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// stmatrix.x4: four 8 x 8 matrices of 16-bit elements, register j of every lane into matrix
// j, whose row i is at the address lane 8 j + i gives.
__device__ __forceinline__ void store_matrices_x4(uint32_t address, const uint32_t (&a)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(a[0]),
               "r"(a[1]), "r"(a[2]), "r"(a[3])
               : "memory");
}

// stmatrix.x4.trans: the same four matrices, each stored transposed (row i at the address
// lane 8 j + i gives then holds column i of the lanes' matrix j).
__device__ __forceinline__ void store_matrices_x4_trans(uint32_t address, const uint32_t (&a)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(a[0]),
               "r"(a[1]), "r"(a[2]), "r"(a[3])
               : "memory");
}

__device__ __forceinline__ void store_zero_16(uint32_t address) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(address), "r"(0) : "memory");
}

// ---- bulk copies (the asynchronous proxy) --------------------------------------

// Adds `bytes` (a multiple of 16) of float32 at shared address src to global dst (16-byte
// aligned) element by element, asynchronously, as one bulk group of this thread.
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;\n" ::"l"(dst),
               "r"(src), "r"(bytes)
               : "memory");
}

// Adds four float32 to global dst (16-byte aligned) element by element (no return value).
__device__ __forceinline__ void reduce_add_v4(float* dst, const float (&x)[4]) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3])
               : "memory");
}

// The thread's warpgroup in the block, through a shuffle: the compiler then knows it is
// warp-uniform and keeps what derives from it (the consumers' shared-memory descriptors)
// in uniform registers, not rebuilt per thread before every wgmma.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
}

// Waits until this thread's bulk groups have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

__device__ __forceinline__ void store_shared_v4(uint32_t address, const float (&x)[4]) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "f"(x[0]), "f"(x[1]), "f"(x[2]),
               "f"(x[3])
               : "memory");
}

// ---- TMA ---------------------------------------------------------------------

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Copies the box of a 4-d tensor map at coordinates (c0 innermost .. c3) to shared memory
// at dst, completing its bytes on barrier bar. Elements outside the tensor read as zero.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// One thread's load of a tile of kRows rows in kAtoms swizzle atoms (64 columns each, one
// after another from dst): announces the tile's bytes on barrier bar, then copies atom a
// from the box at (64 a, c1, c2, c3) of the map.
template <int kRows, int kAtoms>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c1, int c2,
                                              int c3) {
  mbarrier_arrive_expect_tx(bar, kRows * kAtoms * kAtomRowBytes);
#pragma unroll
  for (int atom = 0; atom < kAtoms; ++atom) {
    tma_load_4d(dst + atom * kRows * kAtomRowBytes, map, bar, atom * kAtomColumns, c1, c2, c3);
  }
}

// Copies the box of a 4-d tensor map at coordinates (c0 innermost .. c3) from shared memory
// at src, as one bulk group of this thread; elements outside the tensor are not written.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// ---- registers ---------------------------------------------------------------

// Per-warpgroup register budgets (the kernel needs a register cap at entry:
// __launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- matrix descriptors --------------------------------------------------------

// The swizzle mode "128 bytes" (bits 62-63) and an 8-row group stride of 1024 bytes (bits 32-45).
constexpr uint64_t kDescriptorSwizzle128 = (uint64_t{1} << 62) | (uint64_t{1024 >> 4} << 32);

// A K-major operand (rows: M or N, 16-bit elements contiguous along K): 16 columns (one
// product's depth) of a swizzle atom, starting at byte `address` (the atom's row 0 plus
// 32 bytes per 16 columns).
__device__ __forceinline__ uint64_t k_major_descriptor(uint32_t address) {
  return kDescriptorSwizzle128 | (uint64_t{1} << 16) | ((address & 0x3FFFF) >> 4);
}

// An MN-major operand (rows: K, elements contiguous along N): 16 rows of a tile of
// N / 64 atoms `atom_bytes` apart, starting at byte `address` (row 16 k of atom 0).
__device__ __forceinline__ uint64_t mn_major_descriptor(uint32_t address, uint32_t atom_bytes) {
  return kDescriptorSwizzle128 | (uint64_t{atom_bytes >> 4} << 16) | ((address & 0x3FFFF) >> 4);
}

// The descriptor of the same operand `bytes` (a multiple of 16) further on. The start
// address field is the low 14 bits (address / 16) and shared memory ends below 256 KB,
// so adding there cannot carry into the other fields; from one descriptor per tile, each
// product's is one add of a constant (rebuilding it from the address costs several).
__device__ __forceinline__ uint64_t descriptor_plus(uint64_t descriptor, uint32_t bytes) {
  return descriptor + (bytes >> 4);
}

// ---- warpgroup products (m64 nN k16, float accumulators) ---------------------------

// The accumulators of a 64 x N product are, per warp, the C fragments of mma.sync 16 x 8
// tiles (mma.cuh): acc[N / 8][4], warp w of the warpgroup holding rows 16 w .. 16 w + 15.
template <ElementType ET, int N>
struct Gmma;

#define FUSEDATTN_SM90_GMMA(ET_, TYPES, N)                                                                     \
  template <>                                                                                                  \
  struct Gmma<ET_, N> {                                                                                        \
    using SS = cute::SM90::GMMA::MMA_64x##N##x16_F32##TYPES##_SS<cute::SM90::GMMA::Major::K,                   \
                                                                 cute::SM90::GMMA::Major::K>;                  \
    using RS = cute::SM90::GMMA::MMA_64x##N##x16_F32##TYPES##_RS<cute::SM90::GMMA::Major::K,                   \
                                                                 cute::SM90::GMMA::Major::MN>;                 \
    using SSMN = cute::SM90::GMMA::MMA_64x##N##x16_F32##TYPES##_SS<cute::SM90::GMMA::Major::MN,                \
                                                                   cute::SM90::GMMA::Major::MN>;               \
    using SSMK = cute::SM90::GMMA::MMA_64x##N##x16_F32##TYPES##_SS<cute::SM90::GMMA::Major::MN,                \
                                                                   cute::SM90::GMMA::Major::K>;                \
  };
FUSEDATTN_SM90_GMMA(ElementType::kBF16, BF16BF16, 32)
FUSEDATTN_SM90_GMMA(ElementType::kBF16, BF16BF16, 64)
FUSEDATTN_SM90_GMMA(ElementType::kBF16, BF16BF16, 128)
FUSEDATTN_SM90_GMMA(ElementType::kBF16, BF16BF16, 256)
FUSEDATTN_SM90_GMMA(ElementType::kF16, F16F16, 32)
FUSEDATTN_SM90_GMMA(ElementType::kF16, F16F16, 64)
FUSEDATTN_SM90_GMMA(ElementType::kF16, F16F16, 128)
FUSEDATTN_SM90_GMMA(ElementType::kF16, F16F16, 256)
#undef FUSEDATTN_SM90_GMMA

template <typename Op, int kTiles, size_t... I>
__device__ __forceinline__ void gmma_ss_impl(uint64_t a, uint64_t b, float (&acc)[kTiles][4], bool accumulate,
                                             std::index_sequence<I...>) {
  Op::fma(a, b, acc[I / 4][I % 4]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <typename Op, int kTiles, size_t... I>
__device__ __forceinline__ void gmma_rs_impl(const uint32_t (&a)[4], uint64_t b, float (&acc)[kTiles][4],
                                             std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, acc[I / 4][I % 4]..., cute::SM90::GMMA::ScaleOut::One);
}

// acc (64 x N) = A B^T (+ acc when accumulate): A [64 x 16] and B [N x 16] K-major in
// shared memory (k_major_descriptor).
template <ElementType ET, int N>
__device__ __forceinline__ void gmma_ss(uint64_t a, uint64_t b, float (&acc)[N / 8][4], bool accumulate) {
  gmma_ss_impl<typename Gmma<ET, N>::SS>(a, b, acc, accumulate, std::make_index_sequence<N / 2>{});
}

// acc (64 x N) = A B^T over kDepth columns: A [64 x kDepth] and B [N x kDepth] K-major tiles
// of kDepth / 64 swizzle atoms, a_atom and b_atom bytes apart, from row 0 at a and b.
template <ElementType ET, int N, int kDepth>
__device__ __forceinline__ void gmma_rows_times_rows(uint32_t a, uint32_t a_atom, uint32_t b, uint32_t b_atom,
                                                     float (&acc)[N / 8][4]) {
  const uint64_t a0 = k_major_descriptor(a), b0 = k_major_descriptor(b);
#pragma unroll
  for (int ks = 0; ks < kDepth / 16; ++ks) {
    const uint32_t column = (ks % 4) * 32;  // 16 columns of the atom, in bytes
    gmma_ss<ET, N>(descriptor_plus(a0, (ks / 4) * a_atom + column), descriptor_plus(b0, (ks / 4) * b_atom + column),
                   acc, ks > 0);
  }
}

// acc (64 x N) = A B (+ acc when accumulate): A [64 x 16] and B [16 x N] MN-major in shared
// memory (mn_major_descriptor; A's 64 columns one swizzle atom).
template <ElementType ET, int N>
__device__ __forceinline__ void gmma_ss_mn(uint64_t a, uint64_t b, float (&acc)[N / 8][4], bool accumulate) {
  gmma_ss_impl<typename Gmma<ET, N>::SSMN>(a, b, acc, accumulate, std::make_index_sequence<N / 2>{});
}

// acc (64 x N) = A B (+ acc when accumulate): A [64 x 16] MN-major (mn_major_descriptor; its
// 64 rows one swizzle atom) and B [16 x N] as B^T [N x 16] K-major (k_major_descriptor).
template <ElementType ET, int N>
__device__ __forceinline__ void gmma_ss_mk(uint64_t a, uint64_t b, float (&acc)[N / 8][4], bool accumulate) {
  gmma_ss_impl<typename Gmma<ET, N>::SSMK>(a, b, acc, accumulate, std::make_index_sequence<N / 2>{});
}

// acc (64 x N) += A B: A [64 x 16] from registers (the mma.sync A fragment layout, per
// warp 16 rows), B [16 x N] MN-major in shared memory (mn_major_descriptor).
template <ElementType ET, int N>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t b, float (&acc)[N / 8][4]) {
  gmma_rs_impl<typename Gmma<ET, N>::RS>(a, b, acc, std::make_index_sequence<N / 2>{});
}

// Keeps the compiler from moving accesses of the accumulators across the asynchronous products.
template <int kTiles>
__device__ __forceinline__ void fence_accumulators(float (&acc)[kTiles][4]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(acc[t][e]);
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_PRIMITIVES_CUH_
