// Launchers of the Hopper (sm_90a) flash kernels (forward.cuh, backward.cuh), one source per
// kernel and head dim (forward_d<D>.cu, backward_d<D>.cu); built when 90 is in
// FUSEDATTN_CUDA_ARCHS (FUSEDATTN_FLASH_SM90).
#ifndef FUSEDATTN_FLASH_SM90_LAUNCH_H_
#define FUSEDATTN_FLASH_SM90_LAUNCH_H_

#include <string>

#include "../params.cuh"
#include "fusedattn/gpu_runtime.h"
#include "fusedattn/portability.h"

namespace fusedattn {
namespace flash {
namespace sm90 {

// Launches the forward of head dim D on a device of compute capability 9.0 (a.spans
// summarised on the same stream first). Returns "" or why it could not launch (the
// driver refused a TMA descriptor); kernel errors surface through the stream's last error.
template <int D>
std::string launch_forward(gpuStream_t stream, const FlashArgs& a, ElementType type);

// Queries per tile of the backward: its float32 dQ accumulator holds whole tiles.
constexpr int kBackwardQueryTile = 64;

// Floats of the backward's dQ accumulator: [B, H, ceil(Sq / 64) * 64, D] (in the kernel's
// order, backward.cuh: DqAccumulator); the launcher and the workspace size both read it.
FA_HOST_DEVICE inline int64_t dq_accum_floats(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t head_dim) {
  return batch * heads * ((seqlen_q + kBackwardQueryTile - 1) / kBackwardQueryTile * kBackwardQueryTile) * head_dim;
}

// The keys of a backward block (BackwardTiles::kN): 128, 64 at head dim 256.
FA_HOST_DEVICE constexpr int64_t backward_key_tile(int64_t head_dim) { return head_dim == 256 ? 64 : 128; }

// With ALiBi the backward also needs a.slope_partials, slope_slots(Skv, D) floats per (b, h),
// zeroed by the launcher: one per consumer warp of each block of backward_key_tile(D) keys.
constexpr int64_t kSlopeWarpsPerKeyTile = 8;
FA_HOST_DEVICE inline int64_t slope_slots(int64_t seqlen_kv, int64_t head_dim) {
  const int64_t keys = backward_key_tile(head_dim);
  return (seqlen_kv + keys - 1) / keys * kSlopeWarpsPerKeyTile;
}

// Launches the backward of head dim D (64 or 128: BackwardTiles) on a device of compute
// capability 9.0: the prologue of every backward (a.delta, a.d_offset), the sm_90a kernel,
// whose dQ sums in dq_accum (dq_accum_floats, zeroed here), dq from that sum, with ALiBi
// a.d_slopes from the kernel's partial sums and, with a bias array, d_bias (its terms in
// a.bias_terms, summed in a fixed order where the array is broadcast: bias_tile.cuh).
// Needs a.spans summarised first and Sq, Skv > 0 (TMA describes no empty tensor). Returns ""
// or why it could not launch; kernel errors surface through the stream's last error.
template <int D>
std::string launch_backward(gpuStream_t stream, const FlashArgs& a, ElementType type, float* dq_accum,
                            float* d_bias);

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_LAUNCH_H_
