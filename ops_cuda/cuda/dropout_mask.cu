// fusedattn_dropout_mask for platform "CUDA": the device build of the shared
// Philox dropout (fusedattn/philox.h). Same contract as the host handler:
//
// operand: seed U32 [..., 2] (leading product L dividing the batch B)
// result:  keep PRED [..., H, Sq, Skv] (B = product of the leading dims)
// attribute: dropout_rate f64
//
// fusedattn_philox (also for tests): the raw Philox4x32-10 words.
// operands: counters U32 [..., 4], keys U32 [..., 2]; result U32 [..., 4]
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/philox.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

// One thread per group of four keys (one Philox call) of one row (b, h, i).
__global__ void dropout_mask_kernel(const uint32_t* seed, bool* keep, int64_t batch, int64_t seed_rows,
                                    int64_t heads, int64_t sq, int64_t skv, uint32_t threshold) {
  const int64_t quads = (skv + 3) / 4;
  const int64_t total = batch * heads * sq * quads;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t quad = t % quads;
    const int64_t row = t / quads;  // (b * heads + h) * sq + i
    const int64_t i = row % sq;
    const int64_t h = (row / sq) % heads;
    const int64_t b = row / (sq * heads);
    const int64_t sr = broadcast_row(b, batch, seed_rows);
    const uint32_t pb = static_cast<uint32_t>(broadcast_inner(b, batch, seed_rows));
    const Philox4 draws = dropout_draws(seed[2 * sr], seed[2 * sr + 1], pb, static_cast<uint32_t>(h),
                                        static_cast<uint32_t>(i), static_cast<uint32_t>(quad));
    bool* dst = keep + row * skv + quad * 4;
    for (int lane = 0; lane < 4 && quad * 4 + lane < skv; ++lane) dst[lane] = draws.x[lane] >= threshold;
  }
}

ffi::Error DropoutMaskCudaImpl(cudaStream_t stream, ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> keep,
                               double dropout_rate) {
  constexpr const char* kOp = "fusedattn_dropout_mask (CUDA)";
  if (keep->element_type() != ffi::DataType::PRED) {
    return invalid(kOp, std::string("the result must be bool, got ") + dtype_name(keep->element_type()));
  }
  const auto dims = keep->dimensions();
  if (dims.size() < 3) return invalid(kOp, "the result must have shape [..., H, Sq, Skv], got " + dims_string(dims));
  const size_t r = dims.size();
  const int64_t batch = product(leading_dims(dims, 3));
  const int64_t heads = dims[r - 3], sq = dims[r - 2], skv = dims[r - 1];
  int64_t seed_rows = 0;
  if (auto e = check_rows(kOp, "seed", seed, ffi::DataType::U32, {2}, &seed_rows); e.failure()) return e;
  if (auto e = check_divides(kOp, "seed", seed_rows, batch); e.failure()) return e;
  if (!(dropout_rate >= 0.0 && dropout_rate < 1.0)) {
    return invalid(kOp, "dropout_rate must be in [0, 1), got " + std::to_string(dropout_rate));
  }
  const int64_t total = batch * heads * sq * ((skv + 3) / 4);
  if (total == 0) return ffi::Error::Success();
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 65535);
  dropout_mask_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      seed.typed_data<uint32_t>(), keep->typed_data<bool>(), batch, seed_rows, heads, sq, skv,
      dropout_threshold(dropout_rate));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(kOp) + ": kernel launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

__global__ void philox_kernel(const uint32_t* c, const uint32_t* k, uint32_t* out, int64_t n) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Philox4 x = philox4x32_10(c[4 * r], c[4 * r + 1], c[4 * r + 2], c[4 * r + 3], k[2 * r], k[2 * r + 1]);
    for (int w = 0; w < 4; ++w) out[4 * r + w] = x.x[w];
  }
}

ffi::Error PhiloxCudaImpl(cudaStream_t stream, ffi::AnyBuffer counters, ffi::AnyBuffer keys,
                          ffi::Result<ffi::AnyBuffer> words) {
  constexpr const char* kOp = "fusedattn_philox (CUDA)";
  int64_t n = 0, n_keys = 0;
  if (auto e = check_rows(kOp, "counters", counters, ffi::DataType::U32, {4}, &n); e.failure()) return e;
  if (auto e = check_rows(kOp, "keys", keys, ffi::DataType::U32, {2}, &n_keys); e.failure()) return e;
  if (n_keys != n) return invalid(kOp, "counters and keys must have the same leading dims");
  if (auto e = check_exact(kOp, "the result", words->element_type(), words->dimensions(), ffi::DataType::U32,
                           concat(leading_dims(counters.dimensions(), 1), {4}));
      e.failure()) {
    return e;
  }
  if (n == 0) return ffi::Error::Success();
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65535);
  philox_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      counters.typed_data<uint32_t>(), keys.typed_data<uint32_t>(), words->typed_data<uint32_t>(), n);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(kOp) + ": kernel launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fusedattn

FA_FFI_EXPORT(FusedattnDropoutMaskCuda);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnDropoutMaskCuda, fusedattn::DropoutMaskCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // seed
                                  .Ret<xla::ffi::AnyBuffer>()  // keep
                                  .Attr<double>("dropout_rate"));

FA_FFI_EXPORT(FusedattnPhiloxCuda);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnPhiloxCuda, fusedattn::PhiloxCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // counters
                                  .Arg<xla::ffi::AnyBuffer>()  // keys
                                  .Ret<xla::ffi::AnyBuffer>());  // words
