// Device build of the small-sequence op (CUDA, and HIP from the same source):
// one query token per segment, at most 16 keys, a huge batch. Contract and
// semantics: fusedattn/small_seq.h; the host build in ops_cuda/host does the
// same arithmetic in plain loops. This file holds the FFI handlers: they check
// the call and launch the kernels of its head dim (small_seq_kernels.cuh,
// compiled once per head dim in small_seq_d*.cu).
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "fusedattn/gpu_runtime.h"  // first: the HIP runtime declares the device intrinsics
#include "fusedattn/ffi_args.h"
#include "fusedattn/small_seq.h"
#include "fusedattn/small_seq_ffi.h"
#include "small_seq_launch.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

// Calls f(head dim as a compile-time constant); false for a head dim without kernels.
template <typename F>
bool with_head_dim(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{}), true;
    case 128: return f(std::integral_constant<int, 128>{}), true;
    case 256: return f(std::integral_constant<int, 256>{}), true;
    case 512: return f(std::integral_constant<int, 512>{}), true;
    default: return false;
  }
}

ffi::Error unsupported_head_dim(const char* op, int64_t d) {
  return invalid(op, "head dim must be 64, 128, 256 or 512, got " + std::to_string(d));
}

ffi::Error SmallSeqFwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer kv_start, ffi::AnyBuffer kv_len, ffi::AnyBuffer seed,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                           double dropout_rate, int64_t max_keys) {
  constexpr const char* kOp = "fusedattn_small_seq_fwd (" FA_FFI_PLATFORM ")";
  SmallSeqParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_small_seq_call(kOp, q, k, v, kv_start, kv_len, seed, scale, dropout_rate, max_keys, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = check_small_seq_forward_results(kOp, SmallSeqDims(p, lead), q.element_type(), *o, *lse);
      e.failure()) {
    return e;
  }
  const bool known = with_head_dim(p.head_dim, [&](auto d) {
    launch_small_seq_forward<decltype(d)::value>(stream, p, q.element_type(),
                                                 {q, k, v, kv_start, kv_len, seed, o, lse});
  });
  if (!known) return unsupported_head_dim(kOp, p.head_dim);
  return launch_status(kOp);
}

ffi::Error SmallSeqBwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer kv_start, ffi::AnyBuffer kv_len, ffi::AnyBuffer seed, ffi::AnyBuffer o,
                           ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq,
                           ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv, float scale,
                           double dropout_rate, int64_t max_keys) {
  constexpr const char* kOp = "fusedattn_small_seq_bwd (" FA_FFI_PLATFORM ")";
  SmallSeqParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_small_seq_call(kOp, q, k, v, kv_start, kv_len, seed, scale, dropout_rate, max_keys, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = check_small_seq_backward_buffers(kOp, SmallSeqDims(p, lead), q.element_type(), o, lse, dout, *dq,
                                                *dk, *dv);
      e.failure()) {
    return e;
  }
  const int64_t group = p.heads / p.kv_heads;
  // Each team's staging (BackwardPlan::team_shared_bytes) fits one block: one team always does.
  constexpr int64_t kMaxGroup = kSmallSeqMaxStagingBytes / (2 * kSmallSeqMaxKeys * sizeof(float));
  if (group > kMaxGroup) {
    return invalid(kOp, "at most " + std::to_string(kMaxGroup) + " query heads per K/V head, got " +
                            std::to_string(group));
  }
  if (p.seqlen_q != 1) {  // keys between segments belong to no query: zero them up front
    for (auto* buffer : {&dk, &dv}) {
      if (gpuMemsetAsync((*buffer)->untyped_data(), 0, (*buffer)->size_bytes(), stream) != gpuSuccess) {
        return launch_status(kOp);
      }
    }
  }
  const bool known = with_head_dim(p.head_dim, [&](auto d) {
    launch_small_seq_backward<decltype(d)::value>(stream, p, q.element_type(),
                                                  {q, k, v, kv_start, kv_len, seed, o, lse, dout, dq, dk, dv});
  });
  if (!known) return unsupported_head_dim(kOp, p.head_dim);
  return launch_status(kOp);
}

}  // namespace
}  // namespace fusedattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqFwdGpu, fusedattn::SmallSeqFwdImpl,
                              fusedattn::bind_small_seq<fusedattn::Pass::kForward>(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<gpuStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqBwdGpu, fusedattn::SmallSeqBwdImpl,
                              fusedattn::bind_small_seq<fusedattn::Pass::kBackward>(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<gpuStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
