// The paged decode op for platform "cpu" (contract: fusedattn/paged_decode_ffi.h,
// index math: fusedattn/paged.h): the compiled reference of the paged path, so CI
// runs a kernel that reads K/V through a page table. Float32 accumulation, one
// thread; per (sequence, query, head) two passes over the visible keys (max, then
// exp-sum and weighted values), as flash_host.cc does per row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fusedattn/ffi_args.h"
#include "fusedattn/mask.h"
#include "fusedattn/paged.h"
#include "fusedattn/paged_decode_ffi.h"
#include "fusedattn/portability.h"
#include "fusedattn/softmax.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

template <ElementType ET>
using Store = typename Element<ET>::Storage;

template <ElementType ET>
struct PagedOperands {
  const Store<ET>* q;
  const Store<ET>* k;
  const Store<ET>* v;
  const int32_t* page_table;
  const int32_t* q_start;  // nullptr: every q_start 0
  const int32_t* q_len;
  const int32_t* kv_len;  // as the caller gave them (paged.h)
  const float* offset;  // nullptr: every offset 0
  Store<ET>* o;
};

// Writes row (b, i, h) of o: value for every element.
template <ElementType ET>
void fill_row(const PagedParams& p, Store<ET>* o, int64_t b, int64_t i, int64_t h, float value) {
  Store<ET>* row = o + bshd_offset(b, i, h, 0, p.seqlen_q, p.heads, p.head_dim_v);
  for (int64_t d = 0; d < p.head_dim_v; ++d) row[d] = Element<ET>::store(value);
}

// Attention of query i (head h) of sequence s over its visible keys, into o.
template <ElementType ET>
void attend_query(const PagedParams& p, const PagedOperands<ET>& a, int64_t s, int32_t i, int64_t h,
                  std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t b = paged_row_of(p, s);
  const int64_t row = paged_q_start(a.q_start, s) + i;
  const int32_t kv_len = a.kv_len[s];
  const int32_t* table = a.page_table + s * p.pages_per_seq;
  const int64_t g = kv_head_of(h, p.heads, p.kv_heads);
  const Store<ET>* qrow = a.q + bshd_offset(b, row, h, 0, p.seqlen_q, p.heads, p.head_dim);
  for (int64_t d = 0; d < p.head_dim; ++d) qf[d] = Element<ET>::load(qrow[d]);
  const QueryToken qt = paged_query_token(p, i, a.q_len[s], kv_len);
  float row_max = -INFINITY;
  for (int32_t j = 0; j < kv_len; ++j) {
    scores[j] = -INFINITY;
    if (!visible(p.mask, qt, 1, j)) continue;
    const Store<ET>* krow = a.k + paged_kv_offset(table, j, g, 0, p.page_size, p.kv_heads, p.head_dim);
    float dot = 0.0f;
    for (int64_t d = 0; d < p.head_dim; ++d) dot += qf[d] * Element<ET>::load(krow[d]);
    scores[j] = p.scale * dot;
    row_max = std::max(row_max, scores[j]);
  }
  SoftmaxState st;
  st.init();
  std::fill(acc.begin(), acc.end(), 0.0f);
  if (row_max > -INFINITY) {
    st.rescale(row_max);
    for (int32_t j = 0; j < kv_len; ++j) {
      if (scores[j] == -INFINITY) continue;
      const float w = st.add(scores[j]);
      const Store<ET>* vrow = a.v + paged_kv_offset(table, j, g, 0, p.page_size, p.kv_heads, p.head_dim_v);
      for (int64_t d = 0; d < p.head_dim_v; ++d) acc[d] += w * Element<ET>::load(vrow[d]);
    }
  }
  float inv = 0.0f;
  st.finalize(p.softmax_type, softmax_sink_logit(p.softmax_type, paged_softmax_offset(a.offset, h)), &inv);
  Store<ET>* orow = a.o + bshd_offset(b, row, h, 0, p.seqlen_q, p.heads, p.head_dim_v);
  for (int64_t d = 0; d < p.head_dim_v; ++d) orow[d] = Element<ET>::store(acc[d] * inv);
}

template <ElementType ET>
void paged_forward(const PagedParams& p, const PagedOperands<ET>& a) {
  std::fill(a.o, a.o + p.batch * p.seqlen_q * p.heads * p.head_dim_v, Element<ET>::store(0.0f));
  std::vector<float> qf(p.head_dim), acc(p.head_dim_v);
  std::vector<float> scores(p.pages_per_seq * p.page_size);
  for (int64_t s = 0; s < p.sequences; ++s) {
    const int32_t q_len = a.q_len[s];
    if (q_len <= 0) continue;
    const int64_t b = paged_row_of(p, s);
    const int32_t q_start = paged_q_start(a.q_start, s);
    if (!paged_sequence_ok(p, a.page_table + s * p.pages_per_seq, q_start, q_len, a.kv_len[s])) {
      // Mark the queries that lie in the row (the rest of a bad range does not exist).
      const int64_t first = std::max<int64_t>(q_start, 0);
      const int64_t last = std::min<int64_t>(static_cast<int64_t>(q_start) + q_len, p.seqlen_q);
      for (int64_t row = first; row < last; ++row) {
        for (int64_t h = 0; h < p.heads; ++h) {
          fill_row<ET>(p, a.o, b, row, h, std::numeric_limits<float>::quiet_NaN());
        }
      }
      continue;
    }
    for (int32_t i = 0; i < q_len; ++i) {
      for (int64_t h = 0; h < p.heads; ++h) attend_query<ET>(p, a, s, i, h, qf, scores, acc);
    }
  }
}

ffi::Error PagedDecodeFwdImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer page_table,
                              ffi::AnyBuffer q_start, ffi::AnyBuffer q_len, ffi::AnyBuffer kv_len,
                              ffi::AnyBuffer softmax_offset, ffi::Result<ffi::AnyBuffer> o, float scale, bool causal,
                              bool bottom_right, int64_t window_left, int64_t window_right, int32_t softmax_type,
                              int64_t max_seqlen_q, int64_t max_seqlen_kv) {
  constexpr const char* kOp = "fusedattn_paged_decode_fwd (cpu)";
  PagedParams p;
  if (auto e = parse_paged_decode_call(kOp, q, k, v, page_table, q_start, q_len, kv_len, softmax_offset, o, scale,
                                       causal, bottom_right, window_left, window_right, softmax_type, max_seqlen_q,
                                       max_seqlen_kv, &p);
      e.failure()) {
    return e;
  }
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads == 0) return ffi::Error::Success();
  with_element_type(q.element_type(), [&](auto et) {
    constexpr ElementType kET = decltype(et)::value;
    paged_forward<kET>(p, {elements<kET>(q), elements<kET>(k), elements<kET>(v), page_table.typed_data<int32_t>(),
                           optional_operand<int32_t>(q_start), q_len.typed_data<int32_t>(),
                           kv_len.typed_data<int32_t>(), optional_operand<float>(softmax_offset), elements<kET>(o)});
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fusedattn

namespace ffi = xla::ffi;

FA_FFI_EXPORT(FusedattnPagedDecodeFwdHost);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnPagedDecodeFwdHost, fusedattn::PagedDecodeFwdImpl,
                              fusedattn::bind_paged_decode(ffi::Ffi::Bind()));
