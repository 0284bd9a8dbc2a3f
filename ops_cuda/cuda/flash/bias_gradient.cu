// A bias array's gradient where the array is broadcast over batch rows or heads (see
// bias_tile.cuh): the per-(b, h) terms summed in a fixed order (bitwise repeatable). The
// terms buffer is not zeroed: a backward kernel writes every pair of each tile it visits, and
// it visits every tile holding a pair of spans (kSpanTokens queries x keys) that relate()
// finds visible (a tile's span is their union, and relate is monotone in the spans); the sum
// reads only such span pairs and counts the others as 0, which their terms are (P = 0 there).
#include "bias_tile.cuh"

namespace fusedattn {
namespace flash {
namespace {

constexpr int kSumThreads = 256;

// kVector consecutive elements of one (bb, hb) plane of d_bias.
template <int kVector> struct Floats;
template <> struct Floats<1> { using type = float; };
template <> struct Floats<4> { using type = float4; };

__device__ __forceinline__ void accumulate(float (&sum)[1], float x) { sum[0] += x; }
__device__ __forceinline__ void accumulate(float (&sum)[4], float4 x) {
  sum[0] += x.x;
  sum[1] += x.y;
  sum[2] += x.z;
  sum[3] += x.w;
}
__device__ __forceinline__ void store(float* to, const float (&sum)[1]) { *to = sum[0]; }
__device__ __forceinline__ void store(float* to, const float (&sum)[4]) {
  *reinterpret_cast<float4*>(to) = make_float4(sum[0], sum[1], sum[2], sum[3]);
}

// Whether the backward wrote the terms of query i and key j in batch row b: some pair of
// their spans may be visible (the spans of the row's tokens, as the kernels read them).
__device__ __forceinline__ bool terms_written(const FlashArgs& a, int64_t b, int64_t i, int64_t j) {
  const HeadContext c = head_context(a, b, 0);  // the spans are the same for every head
  return relate(a.p.mask, c.q_spans[i / kSpanTokens], c.kv_spans[j / kSpanTokens]).any;
}

// A thread per kVector elements (bb, hb, i, j..j+kVector) of d_bias (kVector = 4 where rows
// hold a multiple of 4 keys, so that a thread's keys share a row and a span and are 16-byte
// aligned): the terms of every (b, h) they stand for, added in order of b, then h.
template <int kVector>
__global__ void __launch_bounds__(kSumThreads) bias_gradient_sum_kernel(const FlashArgs a, float* d_bias) {
  static_assert(kSpanTokens % kVector == 0, "a thread's keys lie in one span");
  using Vector = typename Floats<kVector>::type;
  const AttentionParams& p = a.p;
  const int64_t plane = p.seqlen_q * p.seqlen_kv;
  const int64_t x = (static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x) * kVector;
  if (x >= p.bias_batch * p.bias_heads * plane) return;
  const int64_t ij = x % plane, bh = x / plane, hb = bh % p.bias_heads, bb = bh / p.bias_heads;
  const int64_t i = ij / p.seqlen_kv, j = ij % p.seqlen_kv;
  const int64_t b0 = p.bias_batch == 1 ? 0 : bb, b1 = p.bias_batch == 1 ? p.batch : bb + 1;
  const int64_t h0 = p.bias_heads == 1 ? 0 : hb, h1 = p.bias_heads == 1 ? p.heads : hb + 1;
  float sum[kVector] = {};
  for (int64_t b = b0; b < b1; ++b) {
    if (!terms_written(a, b, i, j)) continue;
    const float* terms = a.bias_terms + (b * p.heads) * plane + ij;
#pragma unroll 4
    for (int64_t h = h0; h < h1; ++h) accumulate(sum, *reinterpret_cast<const Vector*>(terms + h * plane));
  }
  store(d_bias + x, sum);
}

template <int kVector>
void launch_sum(gpuStream_t stream, const FlashArgs& a, float* d_bias, int64_t elements) {
  const int64_t threads = (elements + kVector - 1) / kVector;
  const int64_t blocks = (threads + kSumThreads - 1) / kSumThreads;
  if (blocks > 0) bias_gradient_sum_kernel<kVector><<<static_cast<unsigned>(blocks), kSumThreads, 0, stream>>>(a, d_bias);
}

}  // namespace

void clear_bias_terms(gpuStream_t stream, const FlashArgs& a) {
  const AttentionParams& p = a.p;
  if (bias_gradient_direct(p)) {
    (void)gpuMemsetAsync(a.bias_terms, 0, sizeof(float) * p.batch * p.heads * p.seqlen_q * p.seqlen_kv,
                         stream);  // errors: the handler's launch_status
  }
}

void launch_bias_gradient_sum(gpuStream_t stream, const FlashArgs& a, float* d_bias) {
  const AttentionParams& p = a.p;
  const int64_t plane = p.seqlen_q * p.seqlen_kv, elements = p.bias_batch * p.bias_heads * plane;
  // Four keys a thread where they share a row and a span (rows of a multiple of 4 keys).
  if (p.seqlen_kv % 4 == 0) {
    launch_sum<4>(stream, a, d_bias, elements);
  } else {
    launch_sum<1>(stream, a, d_bias, elements);
  }
}

}  // namespace flash
}  // namespace fusedattn
