// Validation and FFI signatures of the Philox dropout ops (host-side code shared
// by the host handlers and the CUDA handlers).
//
// fusedattn_dropout_mask: the keep mask of the shared Philox dropout
// (fusedattn/philox.h), for testing it against the jnp definition in
// fusedattn/ops/philox.py bit for bit.
//   operand: seed U32 [..., 2] (leading product L dividing the batch B)
//   result:  keep PRED [..., H, Sq, Skv] (B = product of the leading dims)
//   attribute: dropout_rate f64
//
// fusedattn_philox (also for tests): the raw Philox4x32-10 words.
//   operands: counters U32 [..., 4], keys U32 [..., 2]; result U32 [..., 4]
#ifndef FUSEDATTN_DROPOUT_MASK_FFI_H_
#define FUSEDATTN_DROPOUT_MASK_FFI_H_

#include <cstdint>
#include <string>
#include <utility>

#include "fusedattn/ffi_args.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {

struct DropoutMaskShape {
  int64_t batch;            // B: the product of keep's leading dims
  int64_t heads, sq, skv;   // keep's last three dims: H, Sq, Skv
  int64_t seed_rows;        // L
};

inline ffi::Error parse_dropout_mask_call(const char* op, const ffi::AnyBuffer& seed, const ffi::AnyBuffer& keep,
                                          double dropout_rate, DropoutMaskShape* s) {
  if (keep.element_type() != ffi::DataType::PRED) {
    return invalid(op, std::string("the result must be bool, got ") + dtype_name(keep.element_type()));
  }
  const auto dims = keep.dimensions();
  if (dims.size() < 3) return invalid(op, "the result must have shape [..., H, Sq, Skv], got " + dims_string(dims));
  const size_t r = dims.size();
  s->batch = product(leading_dims(dims, 3));
  s->heads = dims[r - 3], s->sq = dims[r - 2], s->skv = dims[r - 1];
  if (auto e = check_rows(op, "seed", seed, ffi::DataType::U32, {2}, &s->seed_rows); e.failure()) return e;
  if (auto e = check_divides(op, "seed", s->seed_rows, s->batch); e.failure()) return e;
  return check_dropout_rate(op, dropout_rate);
}

// *rows receives the number of Philox calls (the leading product of counters).
inline ffi::Error parse_philox_call(const char* op, const ffi::AnyBuffer& counters, const ffi::AnyBuffer& keys,
                                    const ffi::AnyBuffer& words, int64_t* rows) {
  int64_t key_rows = 0;
  if (auto e = check_rows(op, "counters", counters, ffi::DataType::U32, {4}, rows); e.failure()) return e;
  if (auto e = check_rows(op, "keys", keys, ffi::DataType::U32, {2}, &key_rows); e.failure()) return e;
  if (key_rows != *rows) return invalid(op, "counters and keys must have the same leading dims");
  return check_exact(op, "the result", words.element_type(), words.dimensions(), ffi::DataType::U32,
                     concat(leading_dims(counters.dimensions(), 1), {4}));
}

// The ops' FFI signatures (ffi_args.h's bind_buffers).
template <typename FfiBinding>
auto bind_dropout_mask(FfiBinding&& binding) {
  return bind_attrs(bind_buffers<1, 1>(std::forward<FfiBinding>(binding)), ffi::StructMember<double>("dropout_rate"));
}

template <typename FfiBinding>
auto bind_philox(FfiBinding&& binding) {
  return bind_buffers<2, 1>(std::forward<FfiBinding>(binding));
}

}  // namespace fusedattn

#endif  // FUSEDATTN_DROPOUT_MASK_FFI_H_
