// A bias array's gradient where the array is broadcast over batch rows or heads (see
// bias_tile.cuh): the per-(b, h) terms summed in a fixed order (bitwise repeatable).
#include "bias_tile.cuh"

namespace fusedattn {
namespace flash {
namespace {

constexpr int kSumThreads = 256;

// A thread per element (bb, hb, i, j) of d_bias: the terms of every (b, h) it stands for.
__global__ void __launch_bounds__(kSumThreads) bias_gradient_sum_kernel(const FlashArgs a, float* d_bias) {
  const AttentionParams& p = a.p;
  const int64_t plane = p.seqlen_q * p.seqlen_kv;
  const int64_t x = static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x;
  if (x >= p.bias_batch * p.bias_heads * plane) return;
  const int64_t ij = x % plane, bh = x / plane, hb = bh % p.bias_heads, bb = bh / p.bias_heads;
  const int64_t b0 = p.bias_batch == 1 ? 0 : bb, b1 = p.bias_batch == 1 ? p.batch : bb + 1;
  const int64_t h0 = p.bias_heads == 1 ? 0 : hb, h1 = p.bias_heads == 1 ? p.heads : hb + 1;
  float sum = 0.0f;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t h = h0; h < h1; ++h) sum += a.bias_terms[(b * p.heads + h) * plane + ij];
  }
  d_bias[x] = sum;
}

}  // namespace

void launch_bias_gradient_sum(gpuStream_t stream, const FlashArgs& a, float* d_bias) {
  const AttentionParams& p = a.p;
  const int64_t elements = p.bias_batch * p.bias_heads * p.seqlen_q * p.seqlen_kv;
  const int64_t blocks = (elements + kSumThreads - 1) / kSumThreads;
  if (blocks > 0) bias_gradient_sum_kernel<<<static_cast<unsigned>(blocks), kSumThreads, 0, stream>>>(a, d_bias);
}

}  // namespace flash
}  // namespace fusedattn
