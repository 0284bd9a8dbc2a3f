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

// The keys a block sums (of one query row of one (bb, hb) plane) and the spans they make up.
template <int kVector> constexpr int kBlockKeys = kSumThreads * kVector;
template <int kVector> constexpr int kBlockSpans = kBlockKeys<kVector> / kSpanTokens;
constexpr int kSumTeams = kSumThreads / 32;  // teams of 32 threads: warps (half wavefronts on AMD)

// Bit s: whether the backward wrote the terms of query i with the keys of span `first_span`
// + s in batch row b (some pair of the two spans may be visible; the spans are the same for
// every head). Computed by a team of 32 lanes (a warp; half a wavefront on AMD), a lane per
// span.
template <int kVector>
__device__ __forceinline__ uint32_t written_spans(const FlashArgs& a, int64_t b, int64_t i, int64_t first_span) {
  static_assert(kBlockSpans<kVector> <= 32, "a span a lane");
  const HeadContext c = head_context(a, b, 0);
  const int lane = threadIdx.x % 32;
  const int64_t span = first_span + lane;
  const bool written = lane < kBlockSpans<kVector> && span < c.n_kv_spans &&
                       relate(a.p.mask, c.q_spans[i / kSpanTokens], c.kv_spans[span]).any;
  return static_cast<uint32_t>(warp_ballot(written) >> (threadIdx.x % kWarpSize / 32 * 32));  // wave64: our half
}

// A block per (bb, hb, i) and kBlockKeys keys of d_bias, a thread per kVector of them
// (kVector = 4 where rows hold a multiple of 4 keys, so that a thread's keys are 16-byte
// aligned): the terms of every (b, h) they stand for, added in order of b, then h. The batch
// rows go kSumTeams at a time: each team of 32 threads finds which of the block's spans one
// of them wrote (written_spans), then every thread adds the terms of those that wrote its span.
template <int kVector>
__global__ void __launch_bounds__(kSumThreads) bias_gradient_sum_kernel(const FlashArgs a, float* d_bias) {
  static_assert(kSpanTokens % kVector == 0, "a thread's keys lie in one span");
  using Vector = typename Floats<kVector>::type;
  const AttentionParams& p = a.p;
  const int64_t plane = p.seqlen_q * p.seqlen_kv;
  const int64_t row = blockIdx.x, i = row % p.seqlen_q, bh = row / p.seqlen_q;
  const int64_t hb = bh % p.bias_heads, bb = bh / p.bias_heads;
  const int64_t first_key = static_cast<int64_t>(blockIdx.y) * kBlockKeys<kVector>;
  const int64_t j = first_key + threadIdx.x * kVector;
  const int my_span = threadIdx.x * kVector / kSpanTokens;
  const int64_t b0 = p.bias_batch == 1 ? 0 : bb, b1 = p.bias_batch == 1 ? p.batch : bb + 1;
  const int64_t h0 = p.bias_heads == 1 ? 0 : hb, h1 = p.bias_heads == 1 ? p.heads : hb + 1;
  const int team = threadIdx.x / 32;
  __shared__ uint32_t written[kSumTeams];
  float sum[kVector] = {};
  for (int64_t round = b0; round < b1; round += kSumTeams) {
    if (round + team < b1) {
      const uint32_t spans = written_spans<kVector>(a, round + team, i, first_key / kSpanTokens);
      if (threadIdx.x % 32 == 0) written[team] = spans;
    }
    __syncthreads();
    if (j < p.seqlen_kv) {
      for (int w = 0; w < kSumTeams && round + w < b1; ++w) {
        if (!((written[w] >> my_span) & 1u)) continue;
        const float* terms = a.bias_terms + ((round + w) * p.heads) * plane + i * p.seqlen_kv + j;
#pragma unroll 4
        for (int64_t h = h0; h < h1; ++h) accumulate(sum, *reinterpret_cast<const Vector*>(terms + h * plane));
      }
    }
    __syncthreads();
  }
  if (j < p.seqlen_kv) store(d_bias + bh * plane + i * p.seqlen_kv + j, sum);
}

template <int kVector>
void launch_sum(gpuStream_t stream, const FlashArgs& a, float* d_bias) {
  const AttentionParams& p = a.p;
  const int64_t rows = p.bias_batch * p.bias_heads * p.seqlen_q;
  const int64_t chunks = (p.seqlen_kv + kBlockKeys<kVector> - 1) / kBlockKeys<kVector>;
  if (rows > 0 && chunks > 0) {
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
    bias_gradient_sum_kernel<kVector><<<grid, kSumThreads, 0, stream>>>(a, d_bias);
  }
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
  // Four keys a thread where they share a row and a span (rows of a multiple of 4 keys).
  if (a.p.seqlen_kv % 4 == 0) {
    launch_sum<4>(stream, a, d_bias);
  } else {
    launch_sum<1>(stream, a, d_bias);
  }
}

}  // namespace flash
}  // namespace fusedattn
