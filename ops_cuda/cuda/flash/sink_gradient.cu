// The learnable softmax offset's gradient (see backward.cuh):
// d_offset[b, h] = -sum_i exp(sink - lse_i) delta_i.
#include "backward.cuh"

namespace fusedattn {
namespace flash {
namespace {

// One block of 256 threads per (b, h), a fixed summation order.
__global__ void __launch_bounds__(256) sink_gradient_kernel(const FlashArgs a) {
  const AttentionParams& p = a.p;
  const int64_t bh = blockIdx.x, h = bh % p.heads, b = bh / p.heads;
  const HeadContext c = head_context(a, b, h);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < p.seqlen_q; i += 256) {
    const int64_t at = bh * p.seqlen_q + i;
    sum -= softmax_sink_weight(p.softmax_type, c.sink, a.lse[at]) * a.delta[at];
  }
  constexpr int kWarps = 256 / kWarpSize;
  __shared__ float partial[kWarps];
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) sum += warp_shfl_xor(sum, offset);
  if (threadIdx.x % kWarpSize == 0) partial[threadIdx.x / kWarpSize] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += partial[w];
    a.d_offset[bh] = total;
  }
}

}  // namespace

void launch_sink_gradient(gpuStream_t stream, const FlashArgs& a) {
  const int64_t blocks = a.p.batch * a.p.heads;
  if (blocks > 0) sink_gradient_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
}

}  // namespace flash
}  // namespace fusedattn
