// Tile skipping for the flash kernels over any token layout (the canonical
// per-token vectors of fusedattn/ops/backends/base.py: segment ids, positions,
// diagonal shifts). Before the attention kernels run, one pass summarises every
// run of kSpanTokens consecutive tokens of each token row as a Span: the range
// of its segment ids, the range of its mask coordinate (queries: position +
// diagonal shift; keys: position) and whether every token is a real one. The
// kernels then decide per (query tile, key tile) pair, from two spans alone,
// whether no pair of tokens can be visible (skip the tile), whether every pair
// is (no per-element mask), or neither (the exact predicate of mask.h per
// element). The decisions are conservative: "skip" and "full" are claimed only
// when the predicate guarantees them, so the result never depends on them.
#ifndef FUSEDATTN_FLASH_SPANS_CUH_
#define FUSEDATTN_FLASH_SPANS_CUH_

#include <climits>
#include <cstdint>

#include "fusedattn/gpu_runtime.h"
#include "fusedattn/mask.h"

namespace fusedattn {
namespace flash {

constexpr int kSpanTokens = 32;

// A run of tokens. Empty (no token with a nonzero segment id): seg_lo > seg_hi.
struct alignas(16) Span {
  int32_t seg_lo, seg_hi;  // segment ids of the tokens with seg != 0
  int32_t lo, hi;          // their mask coordinates (int32 range; see `complete`)
  int32_t complete;        // every token of the run exists, has seg != 0 and a coordinate within int32
  int32_t pad[3];
};

__device__ __forceinline__ Span empty_span() {
  Span s;
  s.seg_lo = INT_MAX;
  s.seg_hi = INT_MIN;
  s.lo = INT_MAX;
  s.hi = INT_MIN;
  s.complete = 0;
  return s;
}

__device__ __forceinline__ bool span_any(const Span& s) { return s.seg_lo <= s.seg_hi; }

__device__ __forceinline__ Span span_union(const Span& a, const Span& b) {
  Span s;
  s.seg_lo = min(a.seg_lo, b.seg_lo);
  s.seg_hi = max(a.seg_hi, b.seg_hi);
  s.lo = min(a.lo, b.lo);
  s.hi = max(a.hi, b.hi);
  s.complete = a.complete & b.complete;
  return s;
}

// The span of tokens [first, first + kCount) of a row of spans, for a tile at a multiple of
// kCount (runs past the row's end are empty and incomplete).
template <int kCount>
__device__ __forceinline__ Span tile_span(const Span* row_spans, int64_t n_spans, int64_t first) {
  static_assert(kCount % kSpanTokens == 0, "tiles of whole span summaries");
  Span s = empty_span();
  s.complete = 1;
  for (int i = 0; i < kCount / kSpanTokens; ++i) {
    const int64_t index = first / kSpanTokens + i;
    s = span_union(s, index < n_spans ? row_spans[index] : empty_span());
  }
  return s;
}

struct TileRelation {
  bool any;   // some (query, key) pair may be visible
  bool full;  // every pair is visible
};

// The predicate of mask.h lifted to spans of queries (coordinate: diagonal) and keys
// (coordinate: position).
__device__ __forceinline__ TileRelation relate(const MaskParams& m, const Span& q, const Span& k) {
  const int64_t q_lo = q.lo, q_hi = q.hi, k_lo = k.lo, k_hi = k.hi;
  TileRelation r;
  r.any = span_any(q) && span_any(k) && max(q.seg_lo, k.seg_lo) <= min(q.seg_hi, k.seg_hi) &&
          (!m.causal || k_lo <= q_hi) && (m.window_left < 0 || k_hi >= q_lo - m.window_left) &&
          (m.window_right < 0 || k_lo <= q_hi + m.window_right);
  r.full = r.any && q.complete && k.complete && q.seg_lo == q.seg_hi && k.seg_lo == k.seg_hi &&
           q.seg_lo == k.seg_lo && (!m.causal || k_hi <= q_lo) &&
           (m.window_left < 0 || k_lo >= q_hi - m.window_left) &&
           (m.window_right < 0 || k_hi <= q_lo + m.window_right);
  return r;
}

FA_HOST_DEVICE inline int64_t span_count(int64_t seqlen) { return (seqlen + kSpanTokens - 1) / kSpanTokens; }

// Summarises `rows` token rows into spans [rows, span_count(Sq) + span_count(Skv)]: each
// row's query spans, then its key spans (spans.cu).
void launch_summarise_spans(gpuStream_t stream, const int32_t* q_seg, const int32_t* q_pos, const int32_t* q_diag,
                            const int32_t* kv_seg, const int32_t* kv_pos, int64_t rows, int64_t seqlen_q,
                            int64_t seqlen_kv, Span* spans);

// A block's view of which tiles it visits: the relations of kThreads consecutive tiles
// from `base`, as bit masks (one word per warp), evaluated once per kThreads tiles.
template <int kThreads>
struct TileWindow {
  uint32_t any[kThreads / 32];
  uint32_t full[kThreads / 32];
  int base;
};

// The first tile t in (after, n_tiles) for which `relation(t).any`, or n_tiles; *full
// receives relation(t).full. Block-wide: every thread calls it with the same arguments;
// the window (in shared memory, base initialised below any tile) is refilled, with
// kThreads tiles tested at once, only when t leaves it.
template <int kThreads, typename Relation>
__device__ __forceinline__ int next_tile(TileWindow<kThreads>& window, int after, int n_tiles,
                                         Relation relation, bool* full) {
  for (int t = after + 1; t < n_tiles;) {
    if (t < window.base || t >= window.base + kThreads) {
      __syncthreads();  // every thread is done reading the window
      const int tile = t + static_cast<int>(threadIdx.x);
      TileRelation r{false, false};
      if (tile < n_tiles) r = relation(tile);
      const auto any = warp_ballot(r.any), all = warp_ballot(r.full);
      if (threadIdx.x % 32 == 0) {  // a word per 32 threads (a wave64 ballot holds two)
        const int shift = threadIdx.x % kWarpSize / 32 * 32;
        window.any[threadIdx.x / 32] = static_cast<uint32_t>(any >> shift);
        window.full[threadIdx.x / 32] = static_cast<uint32_t>(all >> shift);
      }
      if (threadIdx.x == 0) window.base = t;
      __syncthreads();
    }
    const int offset = t - window.base;
    for (int w = offset / 32; w < kThreads / 32; ++w) {
      const uint32_t bits = window.any[w] & (w == offset / 32 ? ~0u << (offset % 32) : ~0u);
      if (bits) {
        const int index = w * 32 + __ffs(bits) - 1;
        *full = (window.full[w] >> (index % 32)) & 1u;
        return window.base + index;
      }
    }
    t = window.base + kThreads;
  }
  *full = false;
  return n_tiles;
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SPANS_CUH_
