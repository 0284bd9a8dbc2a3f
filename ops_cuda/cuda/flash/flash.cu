// The "flash" op for platform "CUDA": FFI handlers that check the call (the same
// contract as the host build, ops_cuda/host/flash_host.cc, see ffi_args.h),
// summarise the token rows for tile skipping and launch the kernels of the
// call's head dim. Serves bfloat16 and float16, head dims 64, 128 and 256 with
// Dv = D (those this library was built with: FusedattnFlashCudaHeadDims).
// Workspaces (the spans; the backward's softmax delta) come from XLA's scratch
// allocator.
#include <cstdint>
#include <string>
#include <vector>

#include "fusedattn/gpu_runtime.h"
#include "fusedattn/ffi_args.h"
#include "launch.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace flash {
namespace {

namespace ffi = xla::ffi;

// The head dims this library holds kernels for, as a bit mask of D / 64.
constexpr int kBuiltHeadDims = 0
#ifdef FUSEDATTN_FLASH_D64
                               | 1
#endif
#ifdef FUSEDATTN_FLASH_D128
                               | 2
#endif
#ifdef FUSEDATTN_FLASH_D256
                               | 4
#endif
    ;

bool head_dim_built(int64_t d) { return (d == 64 || d == 128 || d == 256) && (kBuiltHeadDims & (d / 64)); }

// Calls f(head dim as a compile-time constant) for a built head dim.
template <typename F>
void with_head_dim(int64_t d, F&& f) {
#ifdef FUSEDATTN_FLASH_D64
  if (d == 64) f(std::integral_constant<int, 64>{});
#endif
#ifdef FUSEDATTN_FLASH_D128
  if (d == 128) f(std::integral_constant<int, 128>{});
#endif
#ifdef FUSEDATTN_FLASH_D256
  if (d == 256) f(std::integral_constant<int, 256>{});
#endif
}

// What the CUDA kernels add to the op's contract: 16-bit floats, Dv = D, a built head dim.
ffi::Error check_kernel_support(const char* op, const AttentionParams& p, ffi::DataType dtype) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return invalid(op, std::string("the CUDA flash kernels take bfloat16 or float16, got ") + dtype_name(dtype));
  }
  if (p.head_dim_v != p.head_dim) {
    return invalid(op, "the CUDA flash kernels need v's head dim equal to q's, got " +
                           std::to_string(p.head_dim_v) + " and " + std::to_string(p.head_dim));
  }
  if (!head_dim_built(p.head_dim)) {
    return invalid(op, "no CUDA flash kernel for head dim " + std::to_string(p.head_dim) +
                           " in this build (built: mask " + std::to_string(kBuiltHeadDims) + " of 64/128/256)");
  }
  return ffi::Error::Success();
}

// Allocates `count` elements of T from XLA's scratch space into *out.
template <typename T>
ffi::Error scratch(const char* op, ffi::ScratchAllocator& allocator, int64_t count, T** out) {
  const auto memory = allocator.Allocate(sizeof(T) * std::max<int64_t>(count, 1), 256);
  if (!memory.has_value()) return ffi::Error::Internal(std::string(op) + ": could not allocate a workspace");
  *out = static_cast<T*>(*memory);
  return ffi::Error::Success();
}

FlashArgs common_args(const AttentionParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                      const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_seg, const ffi::AnyBuffer& q_pos,
                      const ffi::AnyBuffer& q_diag, const ffi::AnyBuffer& kv_seg, const ffi::AnyBuffer& kv_pos,
                      const ffi::AnyBuffer& softmax_offset, const ffi::AnyBuffer& seed) {
  FlashArgs a{};
  a.p = p;
  a.q = static_cast<const uint16_t*>(q.untyped_data());
  a.k = static_cast<const uint16_t*>(k.untyped_data());
  a.v = static_cast<const uint16_t*>(v.untyped_data());
  a.q_seg = q_seg.typed_data<int32_t>();
  a.q_pos = q_pos.typed_data<int32_t>();
  a.q_diag = q_diag.typed_data<int32_t>();
  a.kv_seg = kv_seg.typed_data<int32_t>();
  a.kv_pos = kv_pos.typed_data<int32_t>();
  a.offset = softmax_offset.typed_data<float>();
  a.seed = seed.typed_data<uint32_t>();
  return a;
}

// Allocates and fills a.spans.
ffi::Error summarise(const char* op, gpuStream_t stream, ffi::ScratchAllocator& allocator, FlashArgs* a) {
  const AttentionParams& p = a->p;
  Span* spans = nullptr;
  if (auto e = scratch(op, allocator, p.token_rows * (span_count(p.seqlen_q) + span_count(p.seqlen_kv)), &spans);
      e.failure()) {
    return e;
  }
  launch_summarise_spans(stream, a->q_seg, a->q_pos, a->q_diag, a->kv_seg, a->kv_pos, p.token_rows, p.seqlen_q,
                         p.seqlen_kv, spans);
  a->spans = spans;
  return ffi::Error::Success();
}

ffi::Error FlashFwdImpl(gpuStream_t stream, ffi::ScratchAllocator allocator, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer q_seg, ffi::AnyBuffer q_pos, ffi::AnyBuffer q_diag,
                        ffi::AnyBuffer kv_seg, ffi::AnyBuffer kv_pos, ffi::AnyBuffer softmax_offset,
                        ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        float scale, bool causal, int64_t window_left, int64_t window_right, int32_t softmax_type,
                        double dropout_rate) {
  constexpr const char* kOp = "fusedattn_flash_fwd (CUDA)";
  AttentionParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_attention_call(kOp, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed, scale,
                                    causal, window_left, window_right, softmax_type, dropout_rate, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = check_kernel_support(kOp, p, q.element_type()); e.failure()) return e;
  if (auto e = check_all_exact(
          kOp, {{"result o", o->element_type(), o->dimensions(), q.element_type(),
                 concat(lead, {p.seqlen_q, p.heads, p.head_dim_v})},
                {"result lse", lse->element_type(), lse->dimensions(), ffi::DataType::F32,
                 concat(lead, {p.heads, p.seqlen_q})}});
      e.failure()) {
    return e;
  }
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return ffi::Error::Success();
  FlashArgs a = common_args(p, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed);
  a.o = static_cast<uint16_t*>(o->untyped_data());
  a.lse = lse->typed_data<float>();
  if (auto e = summarise(kOp, stream, allocator, &a); e.failure()) return e;
  with_head_dim(p.head_dim, [&](auto d) { launch_forward<decltype(d)::value>(stream, a, element_type_of(q.element_type())); });
  return launch_status(kOp);
}

ffi::Error FlashBwdImpl(gpuStream_t stream, ffi::ScratchAllocator allocator, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer q_seg, ffi::AnyBuffer q_pos, ffi::AnyBuffer q_diag,
                        ffi::AnyBuffer kv_seg, ffi::AnyBuffer kv_pos, ffi::AnyBuffer softmax_offset,
                        ffi::AnyBuffer seed, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> d_offset, float scale,
                        bool causal, int64_t window_left, int64_t window_right, int32_t softmax_type,
                        double dropout_rate) {
  constexpr const char* kOp = "fusedattn_flash_bwd (CUDA)";
  AttentionParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_attention_call(kOp, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed, scale,
                                    causal, window_left, window_right, softmax_type, dropout_rate, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = check_kernel_support(kOp, p, q.element_type()); e.failure()) return e;
  const ffi::DataType dt = q.element_type();
  const auto o_dims = concat(lead, {p.seqlen_q, p.heads, p.head_dim_v});
  constexpr ffi::DataType kF32 = ffi::DataType::F32;
  if (auto e = check_all_exact(
          kOp, {{"o", o.element_type(), o.dimensions(), dt, o_dims},
                {"lse", lse.element_type(), lse.dimensions(), kF32, concat(lead, {p.heads, p.seqlen_q})},
                {"do", dout.element_type(), dout.dimensions(), dt, o_dims},
                {"result dq", dq->element_type(), dq->dimensions(), dt, concat(lead, {p.seqlen_q, p.heads, p.head_dim})},
                {"result dk", dk->element_type(), dk->dimensions(), dt,
                 concat(lead, {p.seqlen_kv, p.kv_heads, p.head_dim})},
                {"result dv", dv->element_type(), dv->dimensions(), dt,
                 concat(lead, {p.seqlen_kv, p.kv_heads, p.head_dim_v})},
                {"result d_offset", d_offset->element_type(), d_offset->dimensions(), kF32, concat(lead, {p.heads})}});
      e.failure()) {
    return e;
  }
  if (p.batch == 0 || p.heads == 0) return ffi::Error::Success();
  FlashArgs a = common_args(p, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed);
  a.o = static_cast<uint16_t*>(const_cast<void*>(o.untyped_data()));
  a.lse = const_cast<float*>(lse.typed_data<float>());
  a.dout = static_cast<const uint16_t*>(dout.untyped_data());
  a.dq = static_cast<uint16_t*>(dq->untyped_data());
  a.dk = static_cast<uint16_t*>(dk->untyped_data());
  a.dv = static_cast<uint16_t*>(dv->untyped_data());
  a.d_offset = d_offset->typed_data<float>();
  if (auto e = summarise(kOp, stream, allocator, &a); e.failure()) return e;
  if (auto e = scratch(kOp, allocator, p.batch * p.heads * p.seqlen_q, &a.delta); e.failure()) return e;
  with_head_dim(p.head_dim, [&](auto d) { launch_backward<decltype(d)::value>(stream, a, element_type_of(dt)); });
  return launch_status(kOp);
}

}  // namespace
}  // namespace flash
}  // namespace fusedattn

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FusedattnFlashFwdCuda, fusedattn::flash::FlashFwdImpl,
    fusedattn::bind_attention<fusedattn::Pass::kForward>(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>().Ctx<ffi::ScratchAllocator>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FusedattnFlashBwdCuda, fusedattn::flash::FlashBwdImpl,
    fusedattn::bind_attention<fusedattn::Pass::kBackward>(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>().Ctx<ffi::ScratchAllocator>()));

// The head dims the flash kernels of this library serve, as a bit mask of D / 64 (1: 64,
// 2: 128, 4: 256); read by fusedattn/ops/backends/flash.py.
extern "C" __attribute__((visibility("default"))) int FusedattnFlashCudaHeadDims() {
  return fusedattn::flash::kBuiltHeadDims;
}
