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

// Word w (0 .. 3, known at run time: a lane's place in its group) of a counter's draws, by
// two levels of selects: indexing d.x would put it in local memory, and a compare chain
// compiles to divergent branches around every shuffle that uses it.
__device__ __forceinline__ uint32_t draw_word(const Philox4& d, int w) {
  const bool odd = w & 1;
  const uint32_t low = odd ? d.x[1] : d.x[0];
  const uint32_t high = odd ? d.x[3] : d.x[2];
  return (w & 2) ? high : low;
}

// The dropout bits (bit 4 t + e: element e of tile n + t kept) of a lane's elements in two
// adjacent accumulator tiles n, n + 1 of `kv`, whose rows are queries and columns keys. A
// Philox counter holds the eight 16-bit draws of eight keys of one row (philox.h), the keys
// of one tile. One counter a lane for the two tiles:
//   NVIDIA: the four lanes l ^ m (m = 0 .. 3) hold the same two rows (row(0), row(2)), word
//     l % 4 (keys 2 (l % 4), + 1) of each counter; lane q = l % 4 draws counter #q (row
//     q / 2, tile n + q % 2) and a 4 x 4 shuffle transpose hands each lane its word of all four.
//   AMD: lanes l and l ^ 32 hold one row, words 2 h, 2 h + 1 (h = l / 32) of each counter;
//     lane h draws tile n + h and the pair swaps the other half.
__device__ __forceinline__ uint32_t dropout_kept_pair(const AttentionParams& p, const HeadContext& c, int64_t h,
                                                      FragmentCoords kv, int n) {
  uint32_t kept = 0;
  if constexpr (kLaneRows == 2) {
    const int q = kv.lane % 4;
    const Philox4 d = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                    static_cast<uint32_t>(kv.row(2 * (q / 2))),
                                    static_cast<uint32_t>(kv.col(n + q % 2, 0) / kDrawsPerCounter));
    uint32_t from[4];  // from[m]: word q of counter #(q ^ m)
    from[0] = draw_word(d, q);
#pragma unroll
    for (int m = 1; m < 4; ++m) from[m] = warp_shfl_xor(draw_word(d, q ^ m), m);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int k = q ^ m;  // counter #k: elements 2 (k / 2), + 1 of tile n + k % 2
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        kept |= static_cast<uint32_t>(draw16(from[m], half) >= p.dropout_threshold) << (4 * (k % 2) + 2 * (k / 2) + half);
      }
    }
  } else {
    const int half = kv.lane / 32;
    const Philox4 d = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                    static_cast<uint32_t>(kv.row(0)),
                                    static_cast<uint32_t>(kv.col(n + half, 0) / kDrawsPerCounter));
    const uint32_t own[2] = {half ? d.x[2] : d.x[0], half ? d.x[3] : d.x[1]};
    const uint32_t got[2] = {warp_shfl_xor(half ? d.x[0] : d.x[2], 32), warp_shfl_xor(half ? d.x[1] : d.x[3], 32)};
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t w = t == half ? own[e / 2] : got[e / 2];
        kept |= static_cast<uint32_t>(draw16(w, e % 2) >= p.dropout_threshold) << (4 * t + e);
      }
    }
  }
  return kept;
}

#if !defined(__HIPCC__)
// Dropout for weights packed two to a register, as the A operand of O += P V (mma.cuh's
// pack order: register j of the tile pair n, n + 1 holds elements 2 (j % 2), + 1 of tile
// n + j / 2, the draws 2 (l % 4), + 1 of counter #(2 (j % 2) + j / 2) below, low half
// first). NVIDIA fragments only (the sm90 forward).
//
// The flags of a lane's elements in tiles n, n + 1 of `kv` (rows: queries, columns: keys),
// one word: lane q = l % 4 of a quad draws counter #q (row 2 (q / 2) of the lane's rows, tile
// n + q % 2, as dropout_kept_pair), compares its eight draws at once (kept_top_bits) and
// puts draw 2 w + half of counter #k at bit 16 half + 15 - w - 4 k; three shuffles give the
// quad's lanes each other's flags.
__device__ __forceinline__ uint32_t dropout_flags_pair(const AttentionParams& p, const HeadContext& c, int64_t h,
                                                       FragmentCoords kv, int n) {
  const int q = kv.lane % 4;
  // kv.col0 is a multiple of 8 and the lane's columns of a tile are within its 8: the
  // counter's key block in 32 bits.
  const Philox4 d = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                  static_cast<uint32_t>(kv.row(2 * (q / 2))),
                                  static_cast<uint32_t>(kv.col0) / kDrawsPerCounter + n + q % 2);
  uint32_t own = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) own |= (kept_top_bits(d.x[w], p.dropout_threshold) & 0x80008000u) >> w;
  own >>= 4 * q;
  uint32_t flags = own;
#pragma unroll
  for (int m = 1; m < 4; ++m) flags |= warp_shfl_xor(own, m);
  return flags;
}

// Register j of a tile pair's packed weights with its dropped elements zeroed (flags:
// dropout_flags_pair's; the kept ones keep their value, the scale 1 / (1 - rate) is the
// caller's).
__device__ __forceinline__ uint32_t drop_packed(uint32_t weights, uint32_t flags, int lane, int j) {
  // The lane's two flags to bits 15 and 31, each then spread over its half.
  const uint32_t tops = flags << (lane % 4 + 4 * (2 * (j % 2) + j / 2));
  uint32_t halves;
  asm("prmt.b32 %0, %1, 0, 0xbb99;" : "=r"(halves) : "r"(tops));  // bytes 0-1: bit 15's sign, 2-3: bit 31's
  return weights & halves;
}
#endif  // !__HIPCC__

// dropout_kept_pair for a backward's transposed fragments: rows are keys, columns queries
// (tiles n, n + 1 of `at`, whose first row is a multiple of 8). The eight keys of a counter
// sit in the eight lanes of a group, kRowLaneStride apart (r = lane / kRowLaneStride % 8:
// the lane's key is r in its block of eight), and the group's elements need eight counters
// (#(4 t + e): the query of element e of tile n + t, the key block of its row); lane r draws
// counter #r, compares its eight draws at once (kept_byte: row r of the group's 8 x 8 flags)
// and three shuffles transpose the flags (transpose_step), so that lane r holds draw r of
// all eight: one Philox call a lane per two tiles.
__device__ __forceinline__ uint32_t dropout_kept_transposed(const AttentionParams& p, const HeadContext& c, int64_t h,
                                                            FragmentCoords at, int n) {
  const int r = (at.lane / kRowLaneStride) % 8;
  const Philox4 d = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                  static_cast<uint32_t>(at.col(n + r / 4, r % 4)),
                                  static_cast<uint32_t>(at.row(r % 4) / kDrawsPerCounter));
  uint32_t kept = kept_byte(d, p.dropout_threshold);
#pragma unroll
  for (int span = 4; span > 0; span /= 2) {
    kept = transpose_step(kept, warp_shfl_xor(kept, span * kRowLaneStride), r, span);
  }
  return kept;  // bit 4 t + e: element e of tile n + t
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
