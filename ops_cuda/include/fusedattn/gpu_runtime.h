// One source for CUDA and HIP device code: the runtime API names, the stream
// type the FFI hands us, the platform's name and kernel launch status for the
// handlers' errors, the warp width, and warp shuffles and votes.
//
// CUDA warps have 32 lanes; AMD CDNA wavefronts 64. Kernels size their lane
// teams from kWarpSize, so one source serves both.
#ifndef FUSEDATTN_GPU_RUNTIME_H_
#define FUSEDATTN_GPU_RUNTIME_H_

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#define FA_FFI_PLATFORM "ROCM"
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuMemsetAsync hipMemsetAsync
#define gpuFuncSetAttribute hipFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#else
#include <cuda_runtime.h>
#define FA_FFI_PLATFORM "CUDA"
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuMemsetAsync cudaMemsetAsync
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#endif

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fusedattn {

// The status of the kernel launch `op` just made.
inline xla::ffi::Error launch_status(const char* op) {
  const gpuError_t err = gpuGetLastError();
  if (err != gpuSuccess) {
    return xla::ffi::Error::Internal(std::string(op) + ": kernel launch failed: " + gpuGetErrorString(err));
  }
  return xla::ffi::Error::Success();
}

#if defined(__HIPCC__)
constexpr int kWarpSize = 64;  // the CDNA targets of the ROCm build (gfx90a, gfx940)
#else
constexpr int kWarpSize = 32;
#endif

// Lane `src` of the warp's value (all lanes take part).
__device__ __forceinline__ float warp_shfl(float value, int src) {
#if defined(__HIPCC__)
  return __shfl(value, src, kWarpSize);
#else
  return __shfl_sync(0xffffffffu, value, src, kWarpSize);
#endif
}

// The value of lane (lane ^ mask) (all lanes take part); T: float, int or unsigned int.
template <typename T>
__device__ __forceinline__ T warp_shfl_xor(T value, int mask) {
#if defined(__HIPCC__)
  return __shfl_xor(value, mask, kWarpSize);
#else
  return __shfl_xor_sync(0xffffffffu, value, mask, kWarpSize);
#endif
}

// Bit l of the result: pred of lane l of the warp (all lanes take part).
#if defined(__HIPCC__)
__device__ __forceinline__ uint64_t warp_ballot(bool pred) { return __ballot(pred); }
#else
__device__ __forceinline__ uint32_t warp_ballot(bool pred) { return __ballot_sync(0xffffffffu, pred); }
#endif

// Whether pred holds on every lane of the caller's aligned team of 32 lanes (the whole warp
// on CUDA, half a wavefront on AMD; all lanes of the warp take part).
__device__ __forceinline__ bool team32_all(bool pred) {
#if defined(__HIPCC__)
  return static_cast<uint32_t>(__ballot(!pred) >> (threadIdx.x % kWarpSize / 32 * 32)) == 0;
#else
  return __all_sync(0xffffffffu, pred);
#endif
}

__device__ __forceinline__ void warp_sync() {
#if defined(__HIPCC__)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

}  // namespace fusedattn

#endif  // FUSEDATTN_GPU_RUNTIME_H_
