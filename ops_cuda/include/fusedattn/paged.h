// Paged KV cache index math (fusedattn/ops/paged.py), shared by the host decode
// kernel and device kernels.
//
//   q        [B, Sq, H, D]           o [B, Sq, H, Dv] (rows outside every sequence: 0)
//   k_pages  [N, PS, Hkv, D]         v_pages [N, PS, Hkv, Dv]
//   page_table S32 [S, P]            q_start, q_len, kv_len S32 [S]
//
// S = B * M sequences, M per q row: sequence s lives in q row s / M, its queries
// are rows q_start[s] .. q_start[s] + q_len[s] - 1 of that row, and its key j
// (0 <= j < kv_len[s]) is token j % PS of pool page page_table[s, j / PS].
// Query i of a sequence sits at position i with mask diagonal
// i + (bottom_right ? kv_len - q_len : 0); key j at position j (mask.h).
// The lengths are the caller's, unchecked: q_len <= 0 leaves slot s unused, and a
// negative kv_len means no keys. The kernels read a negative kv_len as it is (a clamp
// cost the sm_80 CUDA kernels registers and spills): it breaks no bound below, uses no
// page, and every key range they clip to kv_len is empty. A used sequence whose data
// breaks the call's bounds is broken (every output of its queries NaN): paged_lengths_ok
// and paged_page_ok are the kernels' one definition of that (fusedattn/ops/paged.py's
// broken_sequences is its twin, for the guard and the xla backend).
#ifndef FUSEDATTN_PAGED_H_
#define FUSEDATTN_PAGED_H_

#include <cstdint>

#include "fusedattn/mask.h"
#include "fusedattn/portability.h"

namespace fusedattn {

struct PagedParams {
  int64_t batch;          // B (q rows)
  int64_t seqlen_q;       // Sq (tokens per q row)
  int64_t heads;          // H
  int64_t kv_heads;       // Hkv (divides H)
  int64_t head_dim;       // D
  int64_t head_dim_v;     // Dv
  int64_t num_pages;      // N
  int64_t page_size;      // PS
  int64_t sequences;      // S = B * M
  int64_t pages_per_seq;  // P
  int64_t max_seqlen_q;   // declared bound on a sequence's queries (-1: none)
  int64_t max_seqlen_kv;  // declared bound on a sequence's keys (-1: none)
  float scale;
  MaskParams mask;
  bool bottom_right;
  int32_t softmax_type;
};

// Sequence s's first q row offset, from a q_start operand that may be absent (nullptr: 0).
FA_HOST_DEVICE FA_INLINE int32_t paged_q_start(const int32_t* q_start, int64_t s) {
  return q_start == nullptr ? 0 : q_start[s];
}

// Head h's softmax offset, from an offset operand that may be absent (nullptr: 0).
FA_HOST_DEVICE FA_INLINE float paged_softmax_offset(const float* offset, int64_t h) {
  return offset == nullptr ? 0.0f : offset[h];
}

// The q row (batch index) of sequence s.
FA_HOST_DEVICE FA_INLINE int64_t paged_row_of(const PagedParams& p, int64_t s) {
  return s / (p.sequences / p.batch);
}

// Offset of element (token j, head g, dim d) of sequence s in a [N, PS, Hkv, Dx] pool,
// given the sequence's page-table row.
FA_HOST_DEVICE FA_INLINE int64_t paged_kv_offset(const int32_t* table_row, int64_t j, int64_t g, int64_t d,
                                                 int64_t PS, int64_t Hkv, int64_t Dx) {
  const int64_t page = table_row[j / PS];
  return ((page * PS + j % PS) * Hkv + g) * Dx + d;
}

// The length part of paged_sequence_ok, for a used sequence (q_len > 0): its q range lies
// in its row, its keys within its table row, and both counts within the declared bounds.
FA_HOST_DEVICE FA_INLINE bool paged_lengths_ok(const PagedParams& p, int32_t q_start, int32_t q_len,
                                               int32_t kv_len) {
  if (q_start < 0 || static_cast<int64_t>(q_start) + q_len > p.seqlen_q) return false;
  if (p.max_seqlen_q >= 0 && q_len > p.max_seqlen_q) return false;
  if (p.max_seqlen_kv >= 0 && kv_len > p.max_seqlen_kv) return false;
  return kv_len <= p.pages_per_seq * p.page_size;
}

// Whether a page-table entry names a page of the pool.
FA_HOST_DEVICE FA_INLINE bool paged_page_ok(const PagedParams& p, int32_t page) {
  return page >= 0 && page < p.num_pages;
}

// Whether a used sequence can be served: paged_lengths_ok, and every page it uses inside the pool.
FA_HOST_DEVICE FA_INLINE bool paged_sequence_ok(const PagedParams& p, const int32_t* table_row, int32_t q_start,
                                                int32_t q_len, int32_t kv_len) {
  if (!paged_lengths_ok(p, q_start, q_len, kv_len)) return false;
  for (int64_t i = 0; i * p.page_size < kv_len; ++i) {
    if (!paged_page_ok(p, table_row[i])) return false;
  }
  return true;
}

// The mask's view of query i of a sequence with q_len queries and kv_len keys.
FA_HOST_DEVICE FA_INLINE QueryToken paged_query_token(const PagedParams& p, int32_t i, int32_t q_len,
                                                      int32_t kv_len) {
  return make_query_token(1, i, p.bottom_right ? kv_len - q_len : 0);
}

}  // namespace fusedattn

#endif  // FUSEDATTN_PAGED_H_
