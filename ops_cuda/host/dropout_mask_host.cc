// fusedattn_dropout_mask and fusedattn_philox for platform "cpu". Contract:
// fusedattn/dropout_mask_ffi.h.
#include <cstdint>

#include "fusedattn/dropout_mask_ffi.h"
#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/philox.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

ffi::Error DropoutMaskImpl(ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> keep, double dropout_rate) {
  DropoutMaskShape s;
  if (auto e = parse_dropout_mask_call("fusedattn_dropout_mask (cpu)", seed, *keep, dropout_rate, &s);
      e.failure()) {
    return e;
  }
  const uint32_t threshold = dropout_threshold(dropout_rate);
  const uint32_t* seeds = seed.typed_data<uint32_t>();
  bool* out = keep->typed_data<bool>();
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t row = broadcast_row(b, s.batch, s.seed_rows);
    const uint32_t pb = static_cast<uint32_t>(broadcast_inner(b, s.batch, s.seed_rows));
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.sq; ++i) {
        bool* dst = out + ((b * s.heads + h) * s.sq + i) * s.skv;
        for (int64_t j = 0; j < s.skv; ++j) {
          dst[j] = dropout_keep(seeds[2 * row], seeds[2 * row + 1], threshold, pb, static_cast<uint32_t>(h),
                                static_cast<uint32_t>(i), static_cast<uint32_t>(j));
        }
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error PhiloxImpl(ffi::AnyBuffer counters, ffi::AnyBuffer keys, ffi::Result<ffi::AnyBuffer> words) {
  int64_t n = 0;
  if (auto e = parse_philox_call("fusedattn_philox (cpu)", counters, keys, *words, &n); e.failure()) return e;
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
                              fusedattn::bind_dropout_mask(xla::ffi::Ffi::Bind()));

FA_FFI_EXPORT(FusedattnPhiloxHost);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnPhiloxHost, fusedattn::PhiloxImpl,
                              fusedattn::bind_philox(xla::ffi::Ffi::Bind()));
