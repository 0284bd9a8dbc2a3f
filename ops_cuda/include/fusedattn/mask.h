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

FA_HOST_DEVICE FA_INLINE bool visible(const MaskParams& p, const QueryToken& q, int32_t kv_seg,
                                      int32_t kv_pos) {
  if (q.seg == 0 || q.seg != kv_seg) return false;
  const int64_t pos = kv_pos;
  if (p.causal && pos > q.diagonal) return false;
  if (p.window_left >= 0 && pos < q.diagonal - p.window_left) return false;
  if (p.window_right >= 0 && pos > q.diagonal + p.window_right) return false;
  return true;
}

FA_HOST_DEVICE FA_INLINE bool visible(const MaskParams& p, int32_t q_seg, int32_t q_pos, int32_t q_diag,
                                      int32_t kv_seg, int32_t kv_pos) {
  return visible(p, make_query_token(q_seg, q_pos, q_diag), kv_seg, kv_pos);
}

}  // namespace fusedattn

#endif  // FUSEDATTN_MASK_H_
