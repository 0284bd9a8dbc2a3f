// The "flash" op for platform "CUDA" (nvcc) and "ROCM" (hipcc, the same text over
// mfma.cuh): FFI handlers that check the call (the same contract as the host build,
// ops_cuda/host/flash_host.cc, see ffi_args.h), summarise the token rows for tile
// skipping and launch the kernels of the call's head dim. Serves bfloat16 and float16,
// head dims 64, 128 and 256 with Dv = D (those this library was built with:
// FusedattnFlashCudaHeadDims / FusedattnFlashRocmHeadDims; ROCm: 64 and 128). On CUDA the
// forward runs the sm_90a (wgmma) kernel of sm90/ on devices of compute capability 9.0
// where the library holds it (forward_kernel_of), the sm_80 kernel elsewhere; the backward
// likewise runs the sm_90a kernel (head dims 64 and 128, not with the attribute
// deterministic set: its dQ sums with atomics) or the sm_80 kernels (backward_kernel_of).
// A call whose attribute "kernel" names the sm_80 kernels (FUSEDATTN_FLASH_KERNEL=sm80 when
// fusedattn/ops/backends/flash.py traced it) runs them in both passes on every device.
// ALiBi (the attribute alibi) runs each kernel's ALiBi variant (alibi_tile.cuh); a bias
// array (bias_type 1 or 2) each kernel's bias variant (bias_tile.cuh).
// Scratch (the spans; the backward's softmax delta, the sm_90a dQ sum and ALiBi's partial
// sums) lives in a uint8 workspace result that XLA allocates, sized when the call is traced
// by fusedattn/ops/backends/flash_ffi.py through this library's own layout
// (FusedattnFlash{Cuda,Rocm}WorkspaceBytes): the handlers allocate nothing.
#include <cstdint>
#include <string>
#include <vector>

#include "fusedattn/gpu_runtime.h"
#include "bias_tile.cuh"
#include "fusedattn/ffi_args.h"
#include "launch.h"
#include "xla/ffi/api/ffi.h"
#ifdef FUSEDATTN_FLASH_SM90
#include "sm90/launch.h"
#endif

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

// The head dims of the sm_90a forward in this library (0 when built without sm_90).
constexpr int kSm90HeadDims =
#ifdef FUSEDATTN_FLASH_SM90
    kBuiltHeadDims;
#else
    0;
#endif

// The head dims of the sm_90a backward: those of the forward.
constexpr int kSm90BackwardHeadDims = kSm90HeadDims;

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

enum class ForwardKernel { kSm80, kSm90 };
enum class BackwardKernel { kSm80, kSm90 };

#ifdef FUSEDATTN_FLASH_SM90
// Whether the current device has compute capability exactly 9.0 (the sm_90a kernels' target).
ffi::Error device_is_sm90(const char* op, bool* sm90) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": could not read the device's compute capability: " +
                                cudaGetErrorString(cudaGetLastError()));
  }
  *sm90 = major == 9 && minor == 0;
  return ffi::Error::Success();
}
#endif

// The call's "kernel" attribute: 0, the device picks (forward_kernel_of); 1, the sm_80
// (mma.sync) kernels are named (FUSEDATTN_FLASH_KERNEL=sm80; tests and benchmarks).
enum NamedKernel : int32_t { kDevicePicks = 0, kSm80Named = 1 };

ffi::Error check_named_kernel(const char* op, int32_t named) {
  if (named == kDevicePicks || named == kSm80Named) return ffi::Error::Success();
  return invalid(op, "the kernel attribute must be 0 (the device picks) or 1 (the sm_80 kernels), got " +
                         std::to_string(named));
}

// The rule that picks the forward kernel of a call (fusedattn/ops/backends/flash_gpu.py,
// cuda_forward_kernel, states the same): the sm_80 kernel when the call names it; else
// the sm_90a kernel on a device of compute capability exactly 9.0 when this library holds
// it for the call's head dim and there is at least one key (TMA describes no empty tensor);
// it serves every call the handler accepts otherwise (masks, windows, packing, GQA, softmax
// variants, dropout, bias arrays). The sm_80 kernel otherwise.
ffi::Error forward_kernel_of(const char* op, const AttentionParams& p, int32_t named, ForwardKernel* kernel) {
  *kernel = ForwardKernel::kSm80;
#ifdef FUSEDATTN_FLASH_SM90
  if (named == kSm80Named || !head_dim_built(p.head_dim) || p.seqlen_kv == 0) return ffi::Error::Success();
  bool sm90 = false;
  if (auto e = device_is_sm90(op, &sm90); e.failure()) return e;
  if (sm90) *kernel = ForwardKernel::kSm90;
#endif
  return ffi::Error::Success();
}

// The rule that picks the backward kernel of a call (flash_gpu.py, cuda_backward_kernel, states
// the same): the sm_80 kernels when the call names them; else the sm_90a kernel on a device
// of compute capability exactly 9.0 when this library holds it for the call's head dim
// (kSm90BackwardHeadDims), the call has queries and keys (TMA describes no empty tensor)
// and `deterministic` (config deterministic_backward) is false, since its dQ sums with
// float32 atomics in no fixed order; it serves every other call the handler accepts (masks,
// windows, packing, GQA, softmax variants, dropout, ALiBi, bias arrays). The sm_80 kernels
// otherwise (no atomics: bitwise repeatable).
ffi::Error backward_kernel_of(const char* op, const AttentionParams& p, int32_t named, bool deterministic,
                              BackwardKernel* kernel) {
  *kernel = BackwardKernel::kSm80;
#ifdef FUSEDATTN_FLASH_SM90
  const bool held = head_dim_built(p.head_dim) && (kSm90BackwardHeadDims & (p.head_dim / 64)) != 0;
  if (named == kSm80Named || !held || deterministic || p.seqlen_q == 0 || p.seqlen_kv == 0) {
    return ffi::Error::Success();
  }
  bool sm90 = false;
  if (auto e = device_is_sm90(op, &sm90); e.failure()) return e;
  if (sm90) *kernel = BackwardKernel::kSm90;
#endif
  return ffi::Error::Success();
}

// Launches the forward kernel of the call's head dim and the given kind.
ffi::Error launch_forward_kernel(const char* op, gpuStream_t stream, const FlashArgs& a, ElementType type,
                                 ForwardKernel kernel) {
  std::string error;
  with_head_dim(a.p.head_dim, [&](auto d) {
#ifdef FUSEDATTN_FLASH_SM90
    if (kernel == ForwardKernel::kSm90) {
      error = sm90::launch_forward<decltype(d)::value>(stream, a, type);
      return;
    }
#endif
    launch_forward<decltype(d)::value>(stream, a, type);
  });
  if (!error.empty()) return ffi::Error::Internal(std::string(op) + ": the sm_90a forward could not launch: " + error);
  return launch_status(op);
}

// Launches the backward kernels of the call's head dim and the given kind (dq_accum: the
// sm_90a kernel's float32 dQ sum, unused by the sm_80 kernels; d_bias: a bias array's
// gradient).
ffi::Error launch_backward_kernel(const char* op, gpuStream_t stream, const FlashArgs& a, ElementType type,
                                  BackwardKernel kernel, float* dq_accum, float* d_bias) {
  std::string error;
  with_head_dim(a.p.head_dim, [&](auto d) {
#ifdef FUSEDATTN_FLASH_SM90
    if (kernel == BackwardKernel::kSm90) {
      error = sm90::launch_backward<decltype(d)::value>(stream, a, type, dq_accum, d_bias);
      return;
    }
#endif
    launch_backward<decltype(d)::value>(stream, a, type, d_bias);
  });
  if (!error.empty()) return ffi::Error::Internal(std::string(op) + ": the sm_90a backward could not launch: " + error);
  return launch_status(op);
}

// What the GPU kernels add to the op's contract: 16-bit floats, Dv = D, a built head dim.
ffi::Error check_kernel_support(const char* op, const AttentionParams& p, ffi::DataType dtype) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return invalid(op, std::string("the " FA_FFI_PLATFORM " flash kernels take bfloat16 or float16, got ") +
                           dtype_name(dtype));
  }
  if (p.head_dim_v != p.head_dim) {
    return invalid(op, "the " FA_FFI_PLATFORM " flash kernels need v's head dim equal to q's, got " +
                           std::to_string(p.head_dim_v) + " and " + std::to_string(p.head_dim));
  }
  if (!head_dim_built(p.head_dim)) {
    return invalid(op, "no " FA_FFI_PLATFORM " flash kernel for head dim " + std::to_string(p.head_dim) +
                           " in this build (built: mask " + std::to_string(kBuiltHeadDims) + " of 64/128/256)");
  }
  return ffi::Error::Success();
}

// The workspace's layout: the spans, then (backward) the softmax delta, for the sm_90a
// backward the float32 dQ accumulator [B, Sq, H, D], with ALiBi the slope gradient's
// partial sums [B, H, slots] (slots: sm80_slope_slots or sm90::slope_slots) and with a bias
// array broadcast over batch rows or heads the terms of its gradient [B, H, Sq, Skv], each
// 256-byte aligned.
int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t span_bytes(const AttentionParams& p) {
  return align256(p.token_rows * (span_count(p.seqlen_q) + span_count(p.seqlen_kv)) *
                  static_cast<int64_t>(sizeof(Span)));
}

int64_t delta_bytes(const AttentionParams& p) {
  return align256(p.batch * p.heads * p.seqlen_q * static_cast<int64_t>(sizeof(float)));
}

int64_t dq_accum_bytes(const AttentionParams& p) {
#ifdef FUSEDATTN_FLASH_SM90
  return align256(sm90::dq_accum_floats(p.batch, p.heads, p.seqlen_q, p.head_dim) * static_cast<int64_t>(sizeof(float)));
#else
  return 0;  // no sm_90a backward in this build
#endif
}

// The slope gradient's partial sums per (b, h) of the backward kernel; 0 without ALiBi.
int64_t slope_slot_count(const AttentionParams& p, BackwardKernel kernel) {
  if (!p.alibi) return 0;
#ifdef FUSEDATTN_FLASH_SM90
  if (kernel == BackwardKernel::kSm90) return sm90::slope_slots(p.seqlen_kv, p.head_dim);
#endif
  return sm80_slope_slots(p.seqlen_q);
}

// The workspace of a call (the layout above, each part 256-byte aligned): the forward's
// spans; for the backward also the delta, the sm_90a kernel's dQ accumulator, ALiBi's
// partial sums (slots per (b, h)) and a broadcast bias array's gradient terms.
struct Workspace {
  int64_t spans = 0, delta = 0, dq_accum = 0, slopes = 0, slots = 0, bias_terms = 0;
  int64_t bytes() const { return spans + delta + dq_accum + slopes + bias_terms; }
};

// bias_gradient: the call wants a bias array's gradient (bias_gradient_wanted).
Workspace workspace_of(const AttentionParams& p, bool backward, BackwardKernel kernel, bool bias_gradient) {
  Workspace w;
  w.spans = span_bytes(p);
  if (!backward) return w;
  w.delta = delta_bytes(p);
  w.dq_accum = kernel == BackwardKernel::kSm90 ? dq_accum_bytes(p) : 0;
  w.slots = slope_slot_count(p, kernel);
  w.slopes = align256(p.batch * p.heads * w.slots * static_cast<int64_t>(sizeof(float)));
  if (bias_gradient && !bias_gradient_direct(p)) {
    w.bias_terms = align256(p.batch * p.heads * p.seqlen_q * p.seqlen_kv * static_cast<int64_t>(sizeof(float)));
  }
  return w;
}

ffi::Error check_workspace(const char* op, ffi::Result<ffi::AnyBuffer>& workspace, int64_t bytes) {
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1 ||
      workspace->dimensions()[0] < bytes) {
    return invalid(op, "the workspace result must be uint8 [>= " + std::to_string(bytes) + "], got " +
                           dtype_name(workspace->element_type()) + " " + dims_string(workspace->dimensions()));
  }
  return ffi::Error::Success();
}

FlashArgs common_args(const AttentionParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                      const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_seg, const ffi::AnyBuffer& q_pos,
                      const ffi::AnyBuffer& q_diag, const ffi::AnyBuffer& kv_seg, const ffi::AnyBuffer& kv_pos,
                      const ffi::AnyBuffer& softmax_offset, const ffi::AnyBuffer& seed,
                      const ffi::AnyBuffer& alibi_slopes, const ffi::AnyBuffer& bias) {
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
  a.slopes = alibi_slopes.typed_data<float>();
  a.bias = p.bias_type != kBiasNone ? bias.typed_data<float>() : nullptr;
  return a;
}

// Fills a.spans, at the start of the workspace.
void summarise(gpuStream_t stream, void* workspace, FlashArgs* a) {
  a->spans = static_cast<Span*>(workspace);
  launch_summarise_spans(stream, a->q_seg, a->q_pos, a->q_diag, a->kv_seg, a->kv_pos, a->p.token_rows,
                         a->p.seqlen_q, a->p.seqlen_kv, const_cast<Span*>(a->spans));
}

ffi::Error FlashFwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer q_seg, ffi::AnyBuffer q_pos, ffi::AnyBuffer q_diag,
                        ffi::AnyBuffer kv_seg, ffi::AnyBuffer kv_pos, ffi::AnyBuffer softmax_offset,
                        ffi::AnyBuffer seed, ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace, float scale,
                        bool causal, int64_t window_left, int64_t window_right, int32_t softmax_type,
                        double dropout_rate, bool alibi, int32_t bias_type, int32_t named_kernel) {
  constexpr const char* kOp = "fusedattn_flash_fwd (" FA_FFI_PLATFORM ")";
  AttentionParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_attention_call(kOp, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed,
                                    alibi_slopes, scale, causal, window_left, window_right, softmax_type,
                                    dropout_rate, alibi, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = parse_bias(kOp, bias, bias_type, &p); e.failure()) return e;
  if (auto e = check_kernel_support(kOp, p, q.element_type()); e.failure()) return e;
  if (auto e = check_named_kernel(kOp, named_kernel); e.failure()) return e;
  if (auto e = check_forward_results(kOp, p, lead, q.element_type(), o, lse); e.failure()) return e;
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return ffi::Error::Success();
  if (auto e = check_workspace(kOp, workspace, workspace_of(p, false, BackwardKernel::kSm80, false).bytes()); e.failure()) {
    return e;
  }
  FlashArgs a = common_args(p, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed, alibi_slopes, bias);
  a.o = static_cast<uint16_t*>(o->untyped_data());
  a.lse = lse->typed_data<float>();
  ForwardKernel kernel;
  if (auto e = forward_kernel_of(kOp, p, named_kernel, &kernel); e.failure()) return e;
  summarise(stream, workspace->untyped_data(), &a);
  return launch_forward_kernel(kOp, stream, a, element_type_of(q.element_type()), kernel);
}

ffi::Error FlashBwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer q_seg, ffi::AnyBuffer q_pos, ffi::AnyBuffer q_diag,
                        ffi::AnyBuffer kv_seg, ffi::AnyBuffer kv_pos, ffi::AnyBuffer softmax_offset,
                        ffi::AnyBuffer seed, ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer bias,
                        ffi::AnyBuffer o, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> d_offset,
                        ffi::Result<ffi::AnyBuffer> d_slopes, ffi::Result<ffi::AnyBuffer> d_bias,
                        ffi::Result<ffi::AnyBuffer> workspace, float scale,
                        bool causal, int64_t window_left, int64_t window_right, int32_t softmax_type,
                        double dropout_rate, bool alibi, int32_t bias_type, bool deterministic,
                        int32_t named_kernel) {
  constexpr const char* kOp = "fusedattn_flash_bwd (" FA_FFI_PLATFORM ")";
  AttentionParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_attention_call(kOp, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed,
                                    alibi_slopes, scale, causal, window_left, window_right, softmax_type,
                                    dropout_rate, alibi, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = parse_bias(kOp, bias, bias_type, &p); e.failure()) return e;
  if (auto e = check_bias_gradient(kOp, bias, d_bias); e.failure()) return e;
  if (auto e = check_kernel_support(kOp, p, q.element_type()); e.failure()) return e;
  if (auto e = check_named_kernel(kOp, named_kernel); e.failure()) return e;
  const ffi::DataType dt = q.element_type();
  if (auto e = check_backward_buffers(kOp, p, lead, dt, o, lse, dout, dq, dk, dv, d_offset, d_slopes); e.failure()) return e;
  if (p.batch == 0 || p.heads == 0) return ffi::Error::Success();
  BackwardKernel kernel;
  if (auto e = backward_kernel_of(kOp, p, named_kernel, deterministic, &kernel); e.failure()) return e;
  const bool bias_gradient = bias_gradient_wanted(p, d_bias);
  const Workspace w = workspace_of(p, true, kernel, bias_gradient);
  if (auto e = check_workspace(kOp, workspace, w.bytes()); e.failure()) return e;
  FlashArgs a = common_args(p, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed, alibi_slopes, bias);
  a.o = static_cast<uint16_t*>(const_cast<void*>(o.untyped_data()));
  a.lse = const_cast<float*>(lse.typed_data<float>());
  a.dout = static_cast<const uint16_t*>(dout.untyped_data());
  a.dq = static_cast<uint16_t*>(dq->untyped_data());
  a.dk = static_cast<uint16_t*>(dk->untyped_data());
  a.dv = static_cast<uint16_t*>(dv->untyped_data());
  a.d_offset = d_offset->typed_data<float>();
  a.d_slopes = d_slopes->typed_data<float>();
  summarise(stream, workspace->untyped_data(), &a);
  char* const scratch = static_cast<char*>(workspace->untyped_data());
  a.delta = reinterpret_cast<float*>(scratch + w.spans);
  a.slope_partials = reinterpret_cast<float*>(scratch + w.spans + w.delta + w.dq_accum);
  a.slope_slots = w.slots;
  float* const d_bias_data = d_bias->typed_data<float>();
  a.bias_terms = !bias_gradient    ? nullptr  // the kernels then store no terms
                 : w.bias_terms > 0 ? reinterpret_cast<float*>(scratch + w.spans + w.delta + w.dq_accum + w.slopes)
                                    : d_bias_data;
  return launch_backward_kernel(kOp, stream, a, element_type_of(dt), kernel,
                                reinterpret_cast<float*>(scratch + w.spans + w.delta), d_bias_data);
}

}  // namespace

// A handler's binding: the stream, the op's operands and results, then the workspace; the
// op's attributes, then "kernel" (NamedKernel).
template <Pass kPass>
auto binding() {
  return bind_attention<kPass, 1>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>())
      .template Attr<int32_t>("kernel");
}

}  // namespace flash
}  // namespace fusedattn

namespace ffi = xla::ffi;

// The handlers' and head-dim queries' names: ...Cuda in the CUDA library, ...Rocm in the
// ROCm one (fusedattn/ops/_library.py registers each under its platform).
#if defined(__HIPCC__)
#define FA_FLASH_FWD_SYMBOL FusedattnFlashFwdRocm
#define FA_FLASH_BWD_SYMBOL FusedattnFlashBwdRocm
#define FA_FLASH_HEAD_DIMS_SYMBOL FusedattnFlashRocmHeadDims
#define FA_FLASH_WORKSPACE_SYMBOL FusedattnFlashRocmWorkspaceBytes
#else
#define FA_FLASH_FWD_SYMBOL FusedattnFlashFwdCuda
#define FA_FLASH_BWD_SYMBOL FusedattnFlashBwdCuda
#define FA_FLASH_HEAD_DIMS_SYMBOL FusedattnFlashCudaHeadDims
#define FA_FLASH_WORKSPACE_SYMBOL FusedattnFlashCudaWorkspaceBytes
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(FA_FLASH_FWD_SYMBOL, fusedattn::flash::FlashFwdImpl,
                              fusedattn::flash::binding<fusedattn::Pass::kForward>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FA_FLASH_BWD_SYMBOL, fusedattn::flash::FlashBwdImpl,
                              fusedattn::flash::binding<fusedattn::Pass::kBackward>(),
                              {ffi::Traits::kCmdBufferCompatible});

// The head dims the flash kernels of this library serve, as a bit mask of D / 64 (1: 64,
// 2: 128, 4: 256); read by fusedattn/ops/_library.py.
extern "C" __attribute__((visibility("default"))) int FA_FLASH_HEAD_DIMS_SYMBOL() {
  return fusedattn::flash::kBuiltHeadDims;
}

// The bytes of the workspace result a call needs (its handler checks the same), for
// fusedattn/ops/backends/flash_ffi.py, which sizes that result when the call is traced:
// token_rows (L of the token vectors), B, H, Sq, Skv, D; backward: of the backward pass;
// sm90_backward: the backward runs the sm_90a kernel (backward_kernel_of); alibi: the call
// has ALiBi; bias_batch, bias_heads: the leading dims of a bias array whose gradient the
// call wants (0, 0 without one, or where its gradient is not wanted).
extern "C" __attribute__((visibility("default"))) int64_t FA_FLASH_WORKSPACE_SYMBOL(
    int64_t token_rows, int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_kv, int64_t head_dim,
    int32_t backward, int32_t sm90_backward, int32_t alibi, int64_t bias_batch, int64_t bias_heads) {
  fusedattn::AttentionParams p{};
  p.token_rows = token_rows;
  p.batch = batch;
  p.heads = heads;
  p.seqlen_q = seqlen_q;
  p.seqlen_kv = seqlen_kv;
  p.head_dim = p.head_dim_v = head_dim;
  p.alibi = alibi != 0;
  p.bias_type = bias_batch > 0 ? fusedattn::kBiasPreScale : fusedattn::kBiasNone;  // either type: the same layout
  p.bias_batch = bias_batch;
  p.bias_heads = bias_heads;
  using fusedattn::flash::BackwardKernel;
  return fusedattn::flash::workspace_of(p, backward != 0, sm90_backward ? BackwardKernel::kSm90 : BackwardKernel::kSm80,
                                       bias_batch > 0)
      .bytes();
}

#if !defined(__HIPCC__)
// The head dims of the sm_90a forward kernel in this library (the same bit mask; 0 when it
// was built without sm_90); read by fusedattn/ops/_library.py.
extern "C" __attribute__((visibility("default"))) int FusedattnFlashCudaSm90HeadDims() {
  return fusedattn::flash::kSm90HeadDims;
}

// The head dims of the sm_90a backward kernel in this library (the same bit mask; 0 when it
// was built without sm_90); read by fusedattn/ops/_library.py.
extern "C" __attribute__((visibility("default"))) int FusedattnFlashCudaSm90BackwardHeadDims() {
  return fusedattn::flash::kSm90BackwardHeadDims;
}
#endif
