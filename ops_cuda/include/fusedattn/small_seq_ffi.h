// Validation of the small-sequence op's FFI operands (host-side code shared by
// the host handlers and the CUDA/HIP handlers). Contract: small_seq.h.
#ifndef FUSEDATTN_SMALL_SEQ_FFI_H_
#define FUSEDATTN_SMALL_SEQ_FFI_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fusedattn/ffi_args.h"
#include "fusedattn/small_seq.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {

inline ffi::Error parse_small_seq_call(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                       const ffi::AnyBuffer& v, const ffi::AnyBuffer& kv_start,
                                       const ffi::AnyBuffer& kv_len, const ffi::AnyBuffer& seed, float scale,
                                       double dropout_rate, int64_t max_keys, SmallSeqParams* p) {
  const ffi::DataType dtype = q.element_type();
  if (!is_supported_float(dtype)) {
    return invalid(op, std::string("q must be float32, bfloat16 or float16, got ") + dtype_name(dtype));
  }
  if (k.element_type() != dtype || v.element_type() != dtype) {
    return invalid(op, std::string("q, k and v must share one dtype, got ") + dtype_name(dtype) + ", " +
                           dtype_name(k.element_type()) + " and " + dtype_name(v.element_type()));
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 3) return invalid(op, "q must have shape [..., Sq, H, D], got " + dims_string(qd));
  const size_t r = qd.size();
  const std::vector<int64_t> lead = leading_dims(qd, 3);
  p->batch = product(lead);
  p->seqlen_q = qd[r - 3];
  p->heads = qd[r - 2];
  p->head_dim = qd[r - 1];
  if (kd.size() != r || leading_dims(kd, 3) != lead || kd[r - 1] != p->head_dim) {
    return invalid(op, "k must have shape [..., Skv, Hkv, D] with q's leading dims and head dim; q is " +
                           dims_string(qd) + ", k is " + dims_string(kd));
  }
  p->seqlen_kv = kd[r - 3];
  p->kv_heads = kd[r - 2];
  if (vd.size() != r || leading_dims(vd, 0) != leading_dims(kd, 0)) {
    return invalid(op, "v must have k's shape " + dims_string(kd) + ", got " + dims_string(vd));
  }
  if (p->kv_heads < 1 || p->heads % p->kv_heads != 0) {
    return invalid(op, "the number of q heads (" + std::to_string(p->heads) +
                           ") must be a multiple of the number of k/v heads (" + std::to_string(p->kv_heads) +
                           ")");
  }
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
  if (!(dropout_rate >= 0.0 && dropout_rate < 1.0)) {
    return invalid(op, "dropout_rate must be in [0, 1), got " + std::to_string(dropout_rate));
  }
  p->max_keys = max_keys;
  p->scale = scale;
  p->dropout = dropout_rate > 0.0;
  p->dropout_threshold = dropout_threshold(dropout_rate);
  p->dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_rate));
  return ffi::Error::Success();
}

}  // namespace fusedattn

#endif  // FUSEDATTN_SMALL_SEQ_FFI_H_
