// fusedattn_dropout_mask for platform "cpu": the keep mask of the shared
// Philox dropout (fusedattn/philox.h), for testing it against the jnp
// definition in fusedattn/ops/philox.py bit for bit.
//
// operand: seed U32 [..., 2] (leading product L dividing the batch B)
// result:  keep PRED [..., H, Sq, Skv] (B = product of the leading dims)
// attribute: dropout_rate f64
//
// fusedattn_philox (also for tests): the raw Philox4x32-10 words.
// operands: counters U32 [..., 4], keys U32 [..., 2]; result U32 [..., 4]
#include <cstdint>
#include <string>
#include <vector>

#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/philox.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

ffi::Error DropoutMaskImpl(ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> keep, double dropout_rate) {
  constexpr const char* kOp = "fusedattn_dropout_mask (cpu)";
  if (keep->element_type() != ffi::DataType::PRED) {
    return invalid(kOp, std::string("the result must be bool, got ") + dtype_name(keep->element_type()));
  }
  const auto dims = keep->dimensions();
  if (dims.size() < 3) return invalid(kOp, "the result must have shape [..., H, Sq, Skv], got " + dims_string(dims));
  const size_t r = dims.size();
  const int64_t batch = product(leading_dims(dims, 3));
  const int64_t heads = dims[r - 3], sq = dims[r - 2], skv = dims[r - 1];
  int64_t seed_rows = 0;
  if (auto e = check_rows(kOp, "seed", seed, ffi::DataType::U32, {2}, &seed_rows); e.failure()) return e;
  if (auto e = check_divides(kOp, "seed", seed_rows, batch); e.failure()) return e;
  if (!(dropout_rate >= 0.0 && dropout_rate < 1.0)) {
    return invalid(kOp, "dropout_rate must be in [0, 1), got " + std::to_string(dropout_rate));
  }
  const uint32_t threshold = dropout_threshold(dropout_rate);
  const uint32_t* s = seed.typed_data<uint32_t>();
  bool* out = keep->typed_data<bool>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t row = broadcast_row(b, batch, seed_rows);
    const uint32_t pb = static_cast<uint32_t>(broadcast_inner(b, batch, seed_rows));
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < sq; ++i) {
        bool* dst = out + ((b * heads + h) * sq + i) * skv;
        for (int64_t j = 0; j < skv; ++j) {
          dst[j] = dropout_keep(s[2 * row], s[2 * row + 1], threshold, pb, static_cast<uint32_t>(h),
                                static_cast<uint32_t>(i), static_cast<uint32_t>(j));
        }
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error PhiloxImpl(ffi::AnyBuffer counters, ffi::AnyBuffer keys, ffi::Result<ffi::AnyBuffer> words) {
  constexpr const char* kOp = "fusedattn_philox (cpu)";
  int64_t n = 0, n_keys = 0;
  if (auto e = check_rows(kOp, "counters", counters, ffi::DataType::U32, {4}, &n); e.failure()) return e;
  if (auto e = check_rows(kOp, "keys", keys, ffi::DataType::U32, {2}, &n_keys); e.failure()) return e;
  if (n_keys != n) return invalid(kOp, "counters and keys must have the same leading dims");
  if (auto e = check_exact(kOp, "the result", words->element_type(), words->dimensions(), ffi::DataType::U32,
                           concat(leading_dims(counters.dimensions(), 1), {4}));
      e.failure()) {
    return e;
  }
  const uint32_t* c = counters.typed_data<uint32_t>();
  const uint32_t* k = keys.typed_data<uint32_t>();
  uint32_t* out = words->typed_data<uint32_t>();
  for (int64_t r = 0; r < n; ++r) {
    const Philox4 x = philox4x32_10(c[4 * r], c[4 * r + 1], c[4 * r + 2], c[4 * r + 3], k[2 * r], k[2 * r + 1]);
    for (int w = 0; w < 4; ++w) out[4 * r + w] = x.x[w];
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fusedattn

FA_FFI_EXPORT(FusedattnDropoutMaskHost);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnDropoutMaskHost, fusedattn::DropoutMaskImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // seed
                                  .Ret<xla::ffi::AnyBuffer>()  // keep
                                  .Attr<double>("dropout_rate"));

FA_FFI_EXPORT(FusedattnPhiloxHost);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnPhiloxHost, fusedattn::PhiloxImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // counters
                                  .Arg<xla::ffi::AnyBuffer>()  // keys
                                  .Ret<xla::ffi::AnyBuffer>());  // words
