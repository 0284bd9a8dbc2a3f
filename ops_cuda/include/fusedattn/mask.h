// The visibility predicate of fusedattn/ops/backends/base.py, for every kernel.
//
//   visible(b, i, j) =  q_seg[b, i] != 0  and  q_seg[b, i] == kv_seg[b, j]
//                       and (not causal or kv_pos[b, j] <= q_pos[b, i] + q_diag[b, i])
//                       and (left  < 0 or kv_pos[b, j] >= q_pos[b, i] + q_diag[b, i] - left)
//                       and (right < 0 or kv_pos[b, j] <= q_pos[b, i] + q_diag[b, i] + right)
//
// seg: segment id (0 = padding); pos: position within the segment; q_diag: the
// shift of the mask's diagonal for that query's segment (0 top-left, kv_len -
// q_len bottom-right). Windows are inclusive; -1 (any negative) = unbounded.
#ifndef FUSEDATTN_MASK_H_
#define FUSEDATTN_MASK_H_

#include <cstdint>

#include "fusedattn/portability.h"

namespace fusedattn {

struct MaskParams {
  bool causal;
  int64_t window_left;   // < 0: unbounded
  int64_t window_right;  // < 0: unbounded
};

// The per-query part of the predicate, computed once per row.
struct QueryToken {
  int32_t seg;
  int64_t diagonal;  // q_pos + q_diag
};

FA_HOST_DEVICE FA_INLINE QueryToken make_query_token(int32_t q_seg, int32_t q_pos, int32_t q_diag) {
  QueryToken t;
  t.seg = q_seg;
  t.diagonal = static_cast<int64_t>(q_pos) + static_cast<int64_t>(q_diag);
  return t;
}

// What a query token sees, as its segment id and a closed range of key positions, both in
// int32 (lo > hi: nothing), so that a kernel tests each key with three comparisons:
// visible(p, q, seg, pos) == in_range(query_range(p, q), seg, pos) for every int32 pos.
struct QueryRange {
  int32_t seg;
  int32_t lo, hi;
};

FA_HOST_DEVICE FA_INLINE QueryRange query_range(const MaskParams& p, const QueryToken& q) {
  // Windows past 2^33 reach as far as unbounded ones (|diagonal| < 2^32), and the sums
  // below cannot overflow.
  constexpr int64_t kFar = int64_t{1} << 33;
  int64_t lo = INT32_MIN, hi = INT32_MAX;
  if (p.causal && q.diagonal < hi) hi = q.diagonal;
  if (p.window_right >= 0) {
    const int64_t right = q.diagonal + (p.window_right < kFar ? p.window_right : kFar);
    if (right < hi) hi = right;
  }
  if (p.window_left >= 0) {
    const int64_t left = q.diagonal - (p.window_left < kFar ? p.window_left : kFar);
    if (left > lo) lo = left;
  }
  if (q.seg == 0 || lo > hi) return QueryRange{q.seg, INT32_MAX, INT32_MIN};
  return QueryRange{q.seg, static_cast<int32_t>(lo), static_cast<int32_t>(hi)};
}

// Every term evaluated (no early return): a GPU kernel tests many keys at once, and selects
// beat divergent branches there.
FA_HOST_DEVICE FA_INLINE bool in_range(const QueryRange& r, int32_t kv_seg, int32_t kv_pos) {
  return (kv_seg == r.seg) & (kv_pos >= r.lo) & (kv_pos <= r.hi);
}

FA_HOST_DEVICE FA_INLINE bool visible(const MaskParams& p, const QueryToken& q, int32_t kv_seg,
                                      int32_t kv_pos) {
  return in_range(query_range(p, q), kv_seg, kv_pos);
}

FA_HOST_DEVICE FA_INLINE bool visible(const MaskParams& p, int32_t q_seg, int32_t q_pos, int32_t q_diag,
                                      int32_t kv_seg, int32_t kv_pos) {
  return visible(p, make_query_token(q_seg, q_pos, q_diag), kv_seg, kv_pos);
}

}  // namespace fusedattn

#endif  // FUSEDATTN_MASK_H_
