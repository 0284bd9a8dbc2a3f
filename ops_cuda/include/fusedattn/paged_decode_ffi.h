// FFI contract of the paged decode op (fusedattn/ops/backends/decode.py), shared by
// its host handler and device handlers:
//
//   fusedattn_paged_decode_fwd(q, k_pages, v_pages, page_table, q_start, q_len, kv_len,
//                              softmax_offset) -> o
//   operands: 0 q [B, Sq, H, D]   1 k_pages [N, PS, Hkv, D]   2 v_pages [N, PS, Hkv, Dv]
//             (one dtype: F32, BF16 or F16)
//             3 page_table S32 [S, P]   4 q_start 5 q_len 6 kv_len S32 [S]  (S = B * M),
//             the caller's lengths as given: the kernels find the broken sequences (paged.h)
//             7 softmax_offset F32 [H]
//             q_start and softmax_offset may be empty ([0]): every q_start 0, every offset 0
//             (zero operands XLA would otherwise fill with a kernel of their own before each call)
//   attributes: scale f32, causal bool, bottom_right bool, window_left i64,
//               window_right i64, softmax_type i32, max_seqlen_q i64, max_seqlen_kv i64
//               (the declared bounds on a sequence's queries and keys; -1: none)
//   result: o [B, Sq, H, Dv] in q's dtype (paged.h says which rows hold what)
//   the CUDA handler (ops_cuda/cuda/paged_decode.cu) binds one more result, its
//   uint8 scratch workspace (sized by decode.py)
#ifndef FUSEDATTN_PAGED_DECODE_FFI_H_
#define FUSEDATTN_PAGED_DECODE_FFI_H_

#include <cmath>
#include <cstdint>
#include <string>

#include "fusedattn/ffi_args.h"
#include "fusedattn/paged.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {

inline ffi::Error parse_paged_decode_call(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                          const ffi::AnyBuffer& v, const ffi::AnyBuffer& page_table,
                                          const ffi::AnyBuffer& q_start, const ffi::AnyBuffer& q_len,
                                          const ffi::AnyBuffer& kv_len, const ffi::AnyBuffer& softmax_offset,
                                          ffi::Result<ffi::AnyBuffer>& o, float scale, bool causal,
                                          bool bottom_right, int64_t window_left, int64_t window_right,
                                          int32_t softmax_type, int64_t max_seqlen_q, int64_t max_seqlen_kv,
                                          PagedParams* p) {
  const ffi::DataType dt = q.element_type();
  if (!is_supported_float(dt)) {
    return invalid(op, std::string("q must be float32, bfloat16 or float16, got ") + dtype_name(dt));
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return invalid(op, "q, k_pages and v_pages must be rank 4 ([B, Sq, H, D], [N, PS, Hkv, D], [N, PS, Hkv, Dv]), "
                       "got " + dims_string(qd) + ", " + dims_string(kd) + ", " + dims_string(vd));
  }
  p->batch = qd[0];
  p->seqlen_q = qd[1];
  p->heads = qd[2];
  p->head_dim = qd[3];
  p->num_pages = kd[0];
  p->page_size = kd[1];
  p->kv_heads = kd[2];
  p->head_dim_v = vd[3];
  if (kd[3] != p->head_dim || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2]) {
    return invalid(op, "k_pages must be [N, PS, Hkv, D] with q's D and v_pages [N, PS, Hkv, Dv]; q is " +
                           dims_string(qd) + ", k_pages " + dims_string(kd) + ", v_pages " + dims_string(vd));
  }
  if (p->num_pages < 1 || p->page_size < 1) return invalid(op, "the page pools need N >= 1 and PS >= 1");
  if (auto e = check_head_groups(op, p->heads, p->kv_heads); e.failure()) return e;
  if (td.size() != 2 || td[1] < 1) {
    return invalid(op, "page_table must be [S, P] with P >= 1, got " + dims_string(td));
  }
  p->sequences = td[0];
  p->pages_per_seq = td[1];
  if (p->batch > 0 ? p->sequences % p->batch != 0 : p->sequences != 0) {
    return invalid(op, "page_table's S = " + std::to_string(p->sequences) +
                           " sequences must be a multiple of q's B = " + std::to_string(p->batch));
  }
  const std::vector<int64_t> per_seq = {p->sequences};
  const bool no_q_start = q_start.dimensions().size() == 1 && q_start.dimensions()[0] == 0;
  const bool no_offset = softmax_offset.dimensions().size() == 1 && softmax_offset.dimensions()[0] == 0;
  if (auto e = check_all_exact(
          op, {{"k_pages", k.element_type(), kd, dt, {kd.begin(), kd.end()}},
               {"v_pages", v.element_type(), vd, dt, {vd.begin(), vd.end()}},
               {"page_table", page_table.element_type(), td, ffi::DataType::S32, {td.begin(), td.end()}},
               {"q_start", q_start.element_type(), q_start.dimensions(), ffi::DataType::S32,
                no_q_start ? std::vector<int64_t>{0} : per_seq},
               {"q_len", q_len.element_type(), q_len.dimensions(), ffi::DataType::S32, per_seq},
               {"kv_len", kv_len.element_type(), kv_len.dimensions(), ffi::DataType::S32, per_seq},
               {"softmax_offset", softmax_offset.element_type(), softmax_offset.dimensions(), ffi::DataType::F32,
                {no_offset ? 0 : p->heads}},
               {"result o", o->element_type(), o->dimensions(), dt, {p->batch, p->seqlen_q, p->heads, p->head_dim_v}}});
      e.failure()) {
    return e;
  }
  if (!std::isfinite(scale)) return invalid(op, "the scale attribute must be finite");
  if (softmax_type < kSoftmaxVanilla || softmax_type > kSoftmaxLearnable) {
    return invalid(op, "softmax_type must be 0 (vanilla), 1 (off_by_one) or 2 (learnable), got " +
                           std::to_string(softmax_type));
  }
  if (max_seqlen_q < -1 || max_seqlen_kv < -1) {
    return invalid(op, "max_seqlen_q and max_seqlen_kv must be bounds >= 0 or -1 (none), got " +
                           std::to_string(max_seqlen_q) + " and " + std::to_string(max_seqlen_kv));
  }
  p->max_seqlen_q = max_seqlen_q;
  p->max_seqlen_kv = max_seqlen_kv;
  p->scale = scale;
  p->mask.causal = causal;
  p->mask.window_left = window_left;
  p->mask.window_right = window_right;
  p->bottom_right = bottom_right;
  p->softmax_type = softmax_type;
  return ffi::Error::Success();
}

// The data of an operand that may be empty (q_start, softmax_offset), or nullptr when it is.
template <typename T>
const T* optional_operand(const ffi::AnyBuffer& buffer) {
  return buffer.element_count() == 0 ? nullptr : static_cast<const T*>(buffer.untyped_data());
}

// The op's FFI signature after the platform's own context: 8 operands, 1 result and
// kWorkspaces scratch results, the attributes.
template <int kWorkspaces = 0, typename FfiBinding>
auto bind_paged_decode(FfiBinding&& binding) {
  return bind_attrs(bind_buffers<8, 1 + kWorkspaces>(std::forward<FfiBinding>(binding)),
                    ffi::StructMember<float>("scale"),
                    ffi::StructMember<bool>("causal"), ffi::StructMember<bool>("bottom_right"),
                    ffi::StructMember<int64_t>("window_left"), ffi::StructMember<int64_t>("window_right"),
                    ffi::StructMember<int32_t>("softmax_type"), ffi::StructMember<int64_t>("max_seqlen_q"),
                    ffi::StructMember<int64_t>("max_seqlen_kv"));
}

}  // namespace fusedattn

#endif  // FUSEDATTN_PAGED_DECODE_FFI_H_
