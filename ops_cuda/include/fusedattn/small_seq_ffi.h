// Validation and FFI signatures of the small-sequence op (host-side code shared
// by the host handlers and the CUDA/HIP handlers). Contract: small_seq.h.
#ifndef FUSEDATTN_SMALL_SEQ_FFI_H_
#define FUSEDATTN_SMALL_SEQ_FFI_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fusedattn/ffi_args.h"
#include "fusedattn/small_seq.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {

inline ffi::Error parse_small_seq_call(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                       const ffi::AnyBuffer& v, const ffi::AnyBuffer& kv_start,
                                       const ffi::AnyBuffer& kv_len, const ffi::AnyBuffer& seed, float scale,
                                       double dropout_rate, int64_t max_keys, SmallSeqParams* p,
                                       std::vector<int64_t>* lead) {
  if (auto e = parse_q_and_k(op, q, k, v, p, lead); e.failure()) return e;
  const auto kd = k.dimensions(), vd = v.dimensions();
  if (vd.size() != kd.size() || leading_dims(vd, 0) != leading_dims(kd, 0)) {
    return invalid(op, "v must have k's shape " + dims_string(kd) + ", got " + dims_string(vd));
  }
  if (auto e = check_head_groups(op, p->heads, p->kv_heads); e.failure()) return e;
  int64_t rows = 0;
  if (auto e = check_rows(op, "kv_start", kv_start, ffi::DataType::S32, {p->seqlen_q}, &rows); e.failure()) {
    return e;
  }
  if (rows != p->batch) return invalid(op, "kv_start must have q's leading dims");
  if (auto e = check_rows(op, "kv_len", kv_len, ffi::DataType::S32, {p->seqlen_q}, &rows); e.failure()) {
    return e;
  }
  if (rows != p->batch) return invalid(op, "kv_len must have q's leading dims");
  if (auto e = check_rows(op, "seed", seed, ffi::DataType::U32, {2}, &p->seed_rows); e.failure()) return e;
  if (auto e = check_divides(op, "seed", p->seed_rows, p->batch); e.failure()) return e;
  if (max_keys < 1 || max_keys > kSmallSeqMaxKeys) {
    return invalid(op, "max_keys must be in [1, " + std::to_string(kSmallSeqMaxKeys) + "], got " +
                           std::to_string(max_keys));
  }
  if (!std::isfinite(scale)) return invalid(op, "the scale attribute must be finite");
  if (auto e = parse_dropout_rate(op, dropout_rate, p); e.failure()) return e;
  p->max_keys = max_keys;
  p->scale = scale;
  return ffi::Error::Success();
}

// The full shapes of a call's q-like (q, o, do, dq), k-like (k, v, dk, dv) and lse
// buffers, given q's leading dims `lead`.
struct SmallSeqDims {
  std::vector<int64_t> q, kv, lse;
  SmallSeqDims(const SmallSeqParams& p, const std::vector<int64_t>& lead)
      : q(concat(lead, {p.seqlen_q, p.heads, p.head_dim})),
        kv(concat(lead, {p.seqlen_kv, p.kv_heads, p.head_dim})),
        lse(concat(lead, {p.seqlen_q, p.heads})) {}
};

inline ffi::Error check_small_seq_forward_results(const char* op, const SmallSeqDims& want, ffi::DataType dtype,
                                                  const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse) {
  return check_all_exact(op, {{"result o", o.element_type(), o.dimensions(), dtype, want.q},
                              {"result lse", lse.element_type(), lse.dimensions(), ffi::DataType::F32, want.lse}});
}

inline ffi::Error check_small_seq_backward_buffers(const char* op, const SmallSeqDims& want, ffi::DataType dtype,
                                                   const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse,
                                                   const ffi::AnyBuffer& dout, const ffi::AnyBuffer& dq,
                                                   const ffi::AnyBuffer& dk, const ffi::AnyBuffer& dv) {
  return check_all_exact(op, {{"o", o.element_type(), o.dimensions(), dtype, want.q},
                              {"lse", lse.element_type(), lse.dimensions(), ffi::DataType::F32, want.lse},
                              {"do", dout.element_type(), dout.dimensions(), dtype, want.q},
                              {"result dq", dq.element_type(), dq.dimensions(), dtype, want.q},
                              {"result dk", dk.element_type(), dk.dimensions(), dtype, want.kv},
                              {"result dv", dv.element_type(), dv.dimensions(), dtype, want.kv}});
}

// The op's FFI signature (ffi_args.h's bind_buffers): the forward binds 6
// operands and 2 results, the backward 9 and 3 (as small_seq.h lists them).
template <Pass kPass, typename FfiBinding>
auto bind_small_seq(FfiBinding&& binding) {
  constexpr bool kForward = kPass == Pass::kForward;
  return bind_attrs(bind_buffers<kForward ? 6 : 9, kForward ? 2 : 3>(std::forward<FfiBinding>(binding)),
                    ffi::StructMember<float>("scale"), ffi::StructMember<double>("dropout_rate"),
                    ffi::StructMember<int64_t>("max_keys"));
}

}  // namespace fusedattn

#endif  // FUSEDATTN_SMALL_SEQ_FFI_H_
