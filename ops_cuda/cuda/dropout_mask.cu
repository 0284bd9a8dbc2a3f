// fusedattn_dropout_mask and fusedattn_philox for the GPU platforms (CUDA, and ROCm from
// the same source): the device build of the shared Philox dropout (fusedattn/philox.h). Contract:
// fusedattn/dropout_mask_ffi.h.
#include <algorithm>
#include <cstdint>

#include "fusedattn/gpu_runtime.h"  // first: the HIP runtime declares the device intrinsics
#include "fusedattn/dropout_mask_ffi.h"
#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/philox.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

// Both kernels loop over their work in grid strides, so a capped grid serves any size.
constexpr int kThreads = 256;

unsigned grid_stride_blocks(int64_t work) {
  return static_cast<unsigned>(std::min<int64_t>((work + kThreads - 1) / kThreads, 65535));
}

// One thread per counter (kDrawsPerCounter keys, one Philox call) of one row (b, h, i).
__global__ void dropout_mask_kernel(const uint32_t* seed, bool* keep, int64_t batch, int64_t seed_rows,
                                    int64_t heads, int64_t sq, int64_t skv, uint32_t threshold) {
  const int64_t groups = (skv + kDrawsPerCounter - 1) / kDrawsPerCounter;
  const int64_t total = batch * heads * sq * groups;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t group = t % groups;
    const int64_t row = t / groups;  // (b * heads + h) * sq + i
    const int64_t i = row % sq;
    const int64_t h = (row / sq) % heads;
    const int64_t b = row / (sq * heads);
    const int64_t sr = broadcast_row(b, batch, seed_rows);
    const uint32_t pb = static_cast<uint32_t>(broadcast_inner(b, batch, seed_rows));
    const Philox4 draws = dropout_draws(seed[2 * sr], seed[2 * sr + 1], pb, static_cast<uint32_t>(h),
                                        static_cast<uint32_t>(i), static_cast<uint32_t>(group));
    bool* dst = keep + row * skv + group * kDrawsPerCounter;
    for (int slot = 0; slot < kDrawsPerCounter && group * kDrawsPerCounter + slot < skv; ++slot) {
      dst[slot] = draw16(draws, slot) >= threshold;
    }
  }
}

ffi::Error DropoutMaskGpuImpl(gpuStream_t stream, ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> keep,
                               double dropout_rate) {
  constexpr const char* kOp = "fusedattn_dropout_mask (" FA_FFI_PLATFORM ")";
  DropoutMaskShape s;
  if (auto e = parse_dropout_mask_call(kOp, seed, *keep, dropout_rate, &s); e.failure()) return e;
  const int64_t total = s.batch * s.heads * s.sq * ((s.skv + kDrawsPerCounter - 1) / kDrawsPerCounter);
  if (total == 0) return ffi::Error::Success();
  dropout_mask_kernel<<<grid_stride_blocks(total), kThreads, 0, stream>>>(
      seed.typed_data<uint32_t>(), keep->typed_data<bool>(), s.batch, s.seed_rows, s.heads, s.sq, s.skv,
      dropout_threshold(dropout_rate));
  return launch_status(kOp);
}

__global__ void philox_kernel(const uint32_t* c, const uint32_t* k, uint32_t* out, int64_t n) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Philox4 x = philox4x32_10(c[4 * r], c[4 * r + 1], c[4 * r + 2], c[4 * r + 3], k[2 * r], k[2 * r + 1]);
    for (int w = 0; w < 4; ++w) out[4 * r + w] = x.x[w];
  }
}

ffi::Error PhiloxGpuImpl(gpuStream_t stream, ffi::AnyBuffer counters, ffi::AnyBuffer keys,
                          ffi::Result<ffi::AnyBuffer> words) {
  constexpr const char* kOp = "fusedattn_philox (" FA_FFI_PLATFORM ")";
  int64_t n = 0;
  if (auto e = parse_philox_call(kOp, counters, keys, *words, &n); e.failure()) return e;
  if (n == 0) return ffi::Error::Success();
  philox_kernel<<<grid_stride_blocks(n), kThreads, 0, stream>>>(
      counters.typed_data<uint32_t>(), keys.typed_data<uint32_t>(), words->typed_data<uint32_t>(), n);
  return launch_status(kOp);
}

}  // namespace
}  // namespace fusedattn

FA_FFI_EXPORT(FusedattnDropoutMaskGpu);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnDropoutMaskGpu, fusedattn::DropoutMaskGpuImpl,
                              fusedattn::bind_dropout_mask(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<gpuStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

FA_FFI_EXPORT(FusedattnPhiloxGpu);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnPhiloxGpu, fusedattn::PhiloxGpuImpl,
                              fusedattn::bind_philox(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<gpuStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
