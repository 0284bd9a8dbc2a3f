// ALiBi's slope gradient (see alibi_tile.cuh): d_slopes[b, h] = the sum of the backward
// kernel's partial sums of (b, h), in slot order (bitwise repeatable).
#include "alibi_tile.cuh"

namespace fusedattn {
namespace flash {
namespace {

constexpr int kSlopeThreads = 128;

// A thread per (b, h).
__global__ void __launch_bounds__(kSlopeThreads) slope_gradient_kernel(const FlashArgs a) {
  const int64_t bh = static_cast<int64_t>(blockIdx.x) * kSlopeThreads + threadIdx.x;
  if (bh >= a.p.batch * a.p.heads) return;
  const float* slots = a.slope_partials + bh * a.slope_slots;
  float sum = 0.0f;
  for (int64_t k = 0; k < a.slope_slots; ++k) sum += slots[k];
  a.d_slopes[bh] = sum;
}

}  // namespace

void launch_slope_gradient(gpuStream_t stream, const FlashArgs& a) {
  const int64_t blocks = (a.p.batch * a.p.heads + kSlopeThreads - 1) / kSlopeThreads;
  if (blocks > 0) slope_gradient_kernel<<<static_cast<unsigned>(blocks), kSlopeThreads, 0, stream>>>(a);
}

}  // namespace flash
}  // namespace fusedattn
