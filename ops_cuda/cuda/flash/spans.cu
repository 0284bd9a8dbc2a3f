// The pass that summarises token rows as spans (see spans.cuh).
#include "spans.cuh"

namespace fusedattn {
namespace flash {

// Summarises one token row: spans [0, n_q) over the queries, then [n_q, n_q + n_kv) over
// the keys. One team of 32 lanes (kSpanTokens: a warp on CUDA, half a wavefront on AMD) per
// span; grid (token rows, ceil((n_q + n_kv) / teams per block)).
__global__ void summarise_spans_kernel(const int32_t* q_seg, const int32_t* q_pos, const int32_t* q_diag,
                                const int32_t* kv_seg, const int32_t* kv_pos, int64_t seqlen_q, int64_t seqlen_kv,
                                Span* spans) {
  const int64_t n_q = (seqlen_q + kSpanTokens - 1) / kSpanTokens;
  const int64_t n_kv = (seqlen_kv + kSpanTokens - 1) / kSpanTokens;
  const int64_t index = static_cast<int64_t>(blockIdx.y) * (blockDim.x / kSpanTokens) + threadIdx.x / kSpanTokens;
  if (index >= n_q + n_kv) return;  // the whole team (on AMD, the other half of a wave64 goes on alone)
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x % kSpanTokens;
  const bool query = index < n_q;
  const int64_t length = query ? seqlen_q : seqlen_kv;
  const int64_t token = (query ? index : index - n_q) * kSpanTokens + lane;
  int32_t seg = 0;
  int64_t coordinate = 0;
  if (token < length) {
    const int64_t at = row * length + token;
    seg = query ? q_seg[at] : kv_seg[at];
    coordinate = query ? static_cast<int64_t>(q_pos[at]) + q_diag[at] : kv_pos[at];
  }
  const bool real = seg != 0;
  const bool fits = coordinate >= INT_MIN && coordinate <= INT_MAX;
  int32_t seg_lo = real ? seg : INT_MAX, seg_hi = real ? seg : INT_MIN;
  // A coordinate outside int32 widens the span to the whole range (conservative for
  // skipping) and makes it incomplete (never "full").
  int32_t lo = !real ? INT_MAX : fits ? static_cast<int32_t>(coordinate) : INT_MIN;
  int32_t hi = !real ? INT_MIN : fits ? static_cast<int32_t>(coordinate) : INT_MAX;
  const bool complete = team32_all(real && fits);
#pragma unroll
  for (int offset = kSpanTokens / 2; offset > 0; offset /= 2) {
    seg_lo = min(seg_lo, warp_shfl_xor(seg_lo, offset));
    seg_hi = max(seg_hi, warp_shfl_xor(seg_hi, offset));
    lo = min(lo, warp_shfl_xor(lo, offset));
    hi = max(hi, warp_shfl_xor(hi, offset));
  }
  if (lane == 0) {
    Span s;
    s.seg_lo = seg_lo;
    s.seg_hi = seg_hi;
    s.lo = lo;
    s.hi = hi;
    s.complete = complete;
    s.pad[0] = s.pad[1] = s.pad[2] = 0;
    spans[row * (n_q + n_kv) + index] = s;
  }
}

void launch_summarise_spans(gpuStream_t stream, const int32_t* q_seg, const int32_t* q_pos,
                                   const int32_t* q_diag, const int32_t* kv_seg, const int32_t* kv_pos,
                                   int64_t rows, int64_t seqlen_q, int64_t seqlen_kv, Span* spans) {
  constexpr int kTeams = 8;
  const int64_t n = span_count(seqlen_q) + span_count(seqlen_kv);
  if (rows == 0 || n == 0) return;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((n + kTeams - 1) / kTeams));
  summarise_spans_kernel<<<grid, kTeams * kSpanTokens, 0, stream>>>(q_seg, q_pos, q_diag, kv_seg, kv_pos, seqlen_q, seqlen_kv,
                                                    spans);
}

}  // namespace flash
}  // namespace fusedattn
