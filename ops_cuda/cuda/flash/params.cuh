// What the flash kernels receive, and the per-(batch row, head) context they derive.
#ifndef FUSEDATTN_FLASH_PARAMS_CUH_
#define FUSEDATTN_FLASH_PARAMS_CUH_

#include <cstdint>

#include "fusedattn/gpu_runtime.h"
#include "fusedattn/layout.h"
#include "fusedattn/mask.h"
#include "fusedattn/philox.h"
#include "fusedattn/softmax.h"
#include "spans.cuh"
#include "tensor_core.cuh"

namespace fusedattn {
namespace flash {

// The canonical call (see ffi_args.h) as device pointers; 16-bit elements.
struct FlashArgs {
  AttentionParams p;
  const uint16_t* q;     // [B, Sq, H, D]
  const uint16_t* k;     // [B, Skv, Hkv, D]
  const uint16_t* v;     // [B, Skv, Hkv, D]
  const int32_t* q_seg;  // [L, Sq] (and q_pos, q_diag)
  const int32_t* q_pos;
  const int32_t* q_diag;
  const int32_t* kv_seg;  // [L, Skv] (and kv_pos)
  const int32_t* kv_pos;
  const float* offset;   // [L_offset, H]
  const uint32_t* seed;  // [L_seed, 2]
  const Span* spans;     // [L, n_q_spans + n_kv_spans]
  // forward results; backward inputs
  uint16_t* o;  // [B, Sq, H, D]
  float* lse;   // [B, H, Sq]
  // backward
  const uint16_t* dout;  // [B, Sq, H, D]
  float* delta;          // [B, H, Sq]: rowsum(dO * O)
  uint16_t* dq;
  uint16_t* dk;
  uint16_t* dv;
  float* d_offset;  // [B, H]
  // ALiBi (alibi_tile.cuh; last, so that the kernels without it see the same parameters):
  // the slopes [L_slopes, H]; backward: d_slopes [B, H], from slope_slots partial sums per
  // (b, h) in slope_partials [B, H, slope_slots]
  const float* slopes;
  float* d_slopes;
  float* slope_partials;
  int64_t slope_slots;
  // A bias array (bias_tile.cuh; p.bias_type != kBiasNone, every kernel's bias variant): bias
  // [Bb, Hb, Sq, Skv]; backward: the terms of its gradient of every (b, h, i, j), float32
  // [B, H, Sq, Skv] (d_bias itself, zeroed first, where bias_gradient_direct; null where the
  // gradient is not wanted).
  const float* bias;
  float* bias_terms;
};

// The tile and row (batch row x head) of block `index` of a grid of tiles x rows blocks;
// blocks start in index order. Under a causal mask the blocks go in sections of `section`
// rows, and within a section the tile varies slowest: tile 0 is every row's longest (the
// forward and dQ number query tiles from the last, dK/dV key tiles from the first), so the
// section's long blocks start before its short ones fill the tail, longest-first (+5% at
// s=8192 over rows varying slowest, which started the last row's longest block near the
// end). Otherwise every block of a row has the same work and the row varies slowest: its
// blocks run side by side and share its K/V in L2 (the forward measured 2-7% faster than
// tile-major). 32-bit: a grid's block count fits, and the division is a few instructions.
struct BlockTile {
  int tile, row;
};

__device__ __forceinline__ BlockTile block_tile(const MaskParams& mask, int index, int tiles, int rows, int section) {
  if (!mask.causal) return BlockTile{index % tiles, index / tiles};
  const int first_row = index / (section * tiles) * section;
  const int in_section = index % (section * tiles);
  const int section_rows = min(section, rows - first_row);
  return BlockTile{in_section / section_rows, first_row + in_section % section_rows};
}

// Rows per section, so that the blocks in flight share their streamed operands in L2: as
// many rows (of `rows`) as fit 32 MB of the H100/H200's 50 MB L2 at row_bytes each. With
// them the sm90 backward (Q and dO per K/V head) measured 1.5-4% faster at causal 2k-4k
// tokens; the persistent forward, whose static rounds balance over the whole grid, 5-13%
// slower.
__device__ __forceinline__ int l2_section(int rows, int64_t row_bytes) {
  const int64_t fit = (int64_t{32} << 20) / row_bytes;
  return fit < 1 ? 1 : fit > rows ? rows : static_cast<int>(fit);
}

// One (batch row, head) of the call: token vectors, softmax sink, dropout key.
struct HeadContext {
  const int32_t* q_seg;
  const int32_t* q_pos;
  const int32_t* q_diag;
  const int32_t* kv_seg;
  const int32_t* kv_pos;
  const Span* q_spans;
  const Span* kv_spans;
  int64_t n_q_spans, n_kv_spans;
  float sink;
  uint32_t seed0, seed1, philox_batch;
};

// broadcast_row and broadcast_inner (layout.h) of batch row b for an input of `rows` rows,
// in 32 bits (the counts fit) and without a division where the input has one row or one
// per batch row, the usual cases: eight 64-bit divisions per work item and thread cost the
// sm90 forward about 5% at 512 tokens.
struct BroadcastRow {
  int row, inner;
};

__device__ __forceinline__ BroadcastRow broadcast_row32(int b, int batch, int rows) {
  if (rows == batch) return {b, 0};
  if (rows == 1) return {0, b};
  const int per = batch / rows;
  return {b / per, b % per};
}

__device__ __forceinline__ HeadContext head_context(const FlashArgs& a, int64_t b, int64_t h) {
  const AttentionParams& p = a.p;
  const int b32 = static_cast<int>(b), batch = static_cast<int>(p.batch);
  const BroadcastRow seed = broadcast_row32(b32, batch, static_cast<int>(p.seed_rows));
  const int64_t tr = broadcast_row32(b32, batch, static_cast<int>(p.token_rows)).row;
  const int64_t offset_row = broadcast_row32(b32, batch, static_cast<int>(p.offset_rows)).row;
  const int64_t seed_row = seed.row;
  HeadContext c;
  c.q_seg = a.q_seg + tr * p.seqlen_q;
  c.q_pos = a.q_pos + tr * p.seqlen_q;
  c.q_diag = a.q_diag + tr * p.seqlen_q;
  c.kv_seg = a.kv_seg + tr * p.seqlen_kv;
  c.kv_pos = a.kv_pos + tr * p.seqlen_kv;
  c.n_q_spans = span_count(p.seqlen_q);
  c.n_kv_spans = span_count(p.seqlen_kv);
  c.q_spans = a.spans + tr * (c.n_q_spans + c.n_kv_spans);
  c.kv_spans = c.q_spans + c.n_q_spans;
  c.sink = softmax_sink_logit(p.softmax_type, a.offset[offset_row * p.heads + h]);
  c.seed0 = a.seed[2 * seed_row];
  c.seed1 = a.seed[2 * seed_row + 1];
  c.philox_batch = static_cast<uint32_t>(seed.inner);
  return c;
}

// Query token i of the row (seg 0, never visible, past the end).
__device__ __forceinline__ QueryToken query_token(const HeadContext& c, int64_t i, int64_t seqlen_q) {
  if (i >= seqlen_q) return make_query_token(0, 0, 0);
  return make_query_token(c.q_seg[i], c.q_pos[i], c.q_diag[i]);
}

// Whether key j (of seqlen_kv) is visible from query token qt.
__device__ __forceinline__ bool key_visible(const MaskParams& m, const HeadContext& c, const QueryToken& qt,
                                            int64_t j, int64_t seqlen_kv) {
  return j < seqlen_kv && visible(m, qt, c.kv_seg[j], c.kv_pos[j]);
}

// The dropout factors (0 or 1 / (1 - rate)) of a lane's four elements of one accumulator
// tile whose rows are queries and columns keys: row_a is the lane's first row and col0 its
// first column (even); f[e] is element e's. One Philox evaluation (a counter group: four
// keys of one row) per lane and tile:
//   NVIDIA: the lane holds two keys of a group in each of two rows (row_a, row_a + 8);
//     lanes l and l ^ 1 need the same groups, so each draws one row and the pair swaps halves.
//   AMD: the lane holds one whole group of one row.
__device__ __forceinline__ void dropout_fragment(const AttentionParams& p, const HeadContext& c, int64_t h,
                                                 int64_t row_a, int64_t col0, float (&f)[4]) {
  uint32_t words[4];
  if constexpr (kLaneRows == 2) {
    const bool odd = threadIdx.x & 1;  // an odd lane holds columns 2 and 3 of the group
    const Philox4 d = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                    static_cast<uint32_t>(row_a + (odd ? 8 : 0)), static_cast<uint32_t>(col0 >> 2));
    const uint32_t got0 = warp_shfl_xor(odd ? d.x[0] : d.x[2], 1);
    const uint32_t got1 = warp_shfl_xor(odd ? d.x[1] : d.x[3], 1);
    const uint32_t own0 = odd ? d.x[2] : d.x[0], own1 = odd ? d.x[3] : d.x[1];
    words[0] = odd ? got0 : own0;
    words[1] = odd ? got1 : own1;
    words[2] = odd ? own0 : got0;
    words[3] = odd ? own1 : got1;
  } else {
    const Philox4 d = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                    static_cast<uint32_t>(row_a), static_cast<uint32_t>(col0 >> 2));
#pragma unroll
    for (int e = 0; e < 4; ++e) words[e] = d.x[e];
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) f[e] = words[e] >= p.dropout_threshold ? p.dropout_scale : 0.0f;
}

// Word w (0 .. 3, known at run time: a lane's place in its group) of a counter's draws, by
// two levels of selects: indexing d.x would put it in local memory, and a compare chain
// compiles to divergent branches around every shuffle that uses it.
__device__ __forceinline__ uint32_t draw_word(const Philox4& d, int w) {
  const bool odd = w & 1;
  const uint32_t low = odd ? d.x[1] : d.x[0];
  const uint32_t high = odd ? d.x[3] : d.x[2];
  return (w & 2) ? high : low;
}

// Which elements of a backward's transposed fragment tile are kept (bit e: element e): rows
// are keys, columns queries (tile n of `at`, whose first row is a multiple of 4). The four
// keys of a Philox counter (philox.h: (j / 4, i, h, b)) sit in the four lanes of a quad,
// kRowLaneStride apart, and each of those lanes needs one draw of each of four counters (its
// elements' queries and key groups): lane k of the quad (k = lane / kRowLaneStride % 4)
// draws the counter of its element k, whose word k' is the draw for the quad's lane k', and
// a 4 x 4 transpose over the quad (three shuffles) hands each lane its word of every
// counter: one Philox call a lane and tile instead of one per element.
__device__ __forceinline__ uint32_t dropout_kept_transposed(const AttentionParams& p, const HeadContext& c, int64_t h,
                                                            FragmentCoords at, int n) {
  const int k = (at.lane / kRowLaneStride) % 4;
  const Philox4 d = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                  static_cast<uint32_t>(at.col(n, k)), static_cast<uint32_t>(at.row(k) >> 2));
  uint32_t kept = 0;
#pragma unroll
  for (int m = 0; m < 4; ++m) {  // word k of the counter drawn by lane k ^ m: the draw of element k ^ m
    const uint32_t draw = m == 0 ? draw_word(d, k) : warp_shfl_xor(draw_word(d, k ^ m), m * kRowLaneStride);
    kept |= static_cast<uint32_t>(draw >= p.dropout_threshold) << (k ^ m);
  }
  return kept;
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^x for the softmax weights: on NVIDIA the bare ex2.approx.ftz (one MUFU op; exp2f adds a
// range check and two multiplies per element to keep results below 2^-126, weights that
// no sum of them can notice). 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__HIPCC__)
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_PARAMS_CUH_
