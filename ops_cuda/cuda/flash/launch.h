// Launchers of the flash kernels for one head dim D (instantiated in flash_d<D>.cu,
// one source per head dim so that a parallel build compiles them side by side).
#ifndef FUSEDATTN_FLASH_LAUNCH_H_
#define FUSEDATTN_FLASH_LAUNCH_H_

#include "fusedattn/gpu_runtime.h"
#include "fusedattn/portability.h"
#include "params.cuh"

namespace fusedattn {
namespace flash {

// Both need a.spans summarised (launch_summarise_spans) on the same stream first; the
// backward also needs a.delta, a buffer of [B, H, Sq] floats it fills, and with a bias array
// a.bias_terms ([B, H, Sq, Skv] floats) and d_bias (the array's gradient; a.bias_terms
// itself where bias_gradient_direct). Errors surface through the stream's last error.
template <int D>
void launch_forward(gpuStream_t stream, const FlashArgs& a, ElementType type);
template <int D>
void launch_backward(gpuStream_t stream, const FlashArgs& a, ElementType type, float* d_bias);

// With ALiBi the backward also needs a.slope_partials, sm80_slope_slots(Sq) floats per (b, h):
// one per warp of each dq_kernel block (kSlopeQueryTile queries, kSlopeWarpsPerQueryTile warps).
constexpr int64_t kSlopeQueryTile = 64;
constexpr int64_t kSlopeWarpsPerQueryTile = 128 / kWarpSize;
FA_HOST_DEVICE inline int64_t sm80_slope_slots(int64_t seqlen_q) {
  return (seqlen_q + kSlopeQueryTile - 1) / kSlopeQueryTile * kSlopeWarpsPerQueryTile;
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_LAUNCH_H_
