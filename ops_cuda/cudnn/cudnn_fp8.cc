// cuDNN's FP8 SDPA graphs (the frontend's sdpa_fp8 / sdpa_fp8_backward, per-tensor scales)
// and their XLA FFI handlers, for the FP8 recipe of fusedattn/ops/fp8.py:
//
//   fusedattn_cudnn_fp8_fwd(q, k, v, seqlen_q, seqlen_kv,
//                           descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)
//       -> (o, stats, amax_s, amax_o, workspace)
//   fusedattn_cudnn_fp8_bwd(q, k, v, o, do, stats, seqlen_q, seqlen_kv,
//                           descale_q, descale_k, descale_v, descale_o, descale_do, descale_s,
//                           descale_dp, scale_s, scale_dq, scale_dk, scale_dv, scale_dp)
//       -> (dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp, workspace)
//
//   q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], o [B, Sq, H, Dv]: float8_e4m3fn,
//       x8 = saturate(x * scale_x), read back as x8 * descale_x (descale = 1 / scale)
//   do like o, float8_e4m3fn or float8_e5m2 (the "hybrid" format: dP is then E5M2 too)
//   dq, dk, dv float8_e4m3fn like q, k, v, stored with scale_dq, scale_dk, scale_dv
//   seqlen_q, seqlen_kv S32 [B] (segments = 1: padding, one sequence per row); else unread
//   stats F32 [B, H, Sq, 1] (cuDNN's log-sum-exp); with training false a placeholder F32 [0]
//   every scale, descale and amax: F32 [1]. amax_s is max P (before its scale), amax_o
//       max |O|, amax_dq/dk/dv of the gradients, amax_dp of cuDNN's dS = scale * P * (dP -
//       rowsum(dO * O)) (attn scale included) before scale_dp
//   workspace U8 [n]: FusedattnCudnnWorkspace's bytes for the call
// attributes: scale f32, causal bool, bottom_right bool, segments i64 (0 or 1),
//   deterministic bool (backward), training bool (forward: with stats or without)
//
// What cuDNN serves (its frontend refuses the rest with the reason, which the Python side
// reports): Hopper (sm_90) or newer; head dims multiples of 16 up to 256 forward and 128
// exactly backward on Hopper; O, dQ, dK, dV in FP8 (bf16 results need Blackwell); bottom-right
// causal masks on Blackwell only; no bias, ALiBi, dropout or sink here.
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "cudnn_common.h"

namespace fusedattn_cudnn {
namespace {

constexpr const char* kFp8Fwd = "fusedattn_cudnn_fp8_fwd";
constexpr const char* kFp8Bwd = "fusedattn_cudnn_fp8_bwd";

// The scalar operands of each direction, in operand order after the arrays.
constexpr Uid kFwdScalars[] = {kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO};
constexpr Uid kBwdScalars[] = {kDescaleQ, kDescaleK, kDescaleV, kDescaleO, kDescaleDO, kDescaleS,
                               kDescaleDP, kScaleS,  kScaleDQ,  kScaleDK,  kScaleDV,   kScaleDP};
// ... and the amax results after the FP8 arrays.
constexpr Uid kFwdAmaxes[] = {kAmaxS, kAmaxO};
constexpr Uid kBwdAmaxes[] = {kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP};

std::shared_ptr<fe::graph::Graph> new_fp8_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::FP8_E4M3)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

fe::DataType_t gradient_type(const Params& p) {
  return p.fp8 == kFp8Hybrid ? fe::DataType_t::FP8_E5M2 : fe::DataType_t::FP8_E4M3;
}

}  // namespace

std::shared_ptr<fe::graph::Graph> fp8_forward_graph(const Params& p) {
  auto g = new_fp8_graph();
  auto [q, k, v] = qkv_tensors(*g, p, RaggedOffsets{});
  fe::graph::SDPA_fp8_attributes a;
  a.set_name("fusedattn_sdpa_fp8").set_generate_stats(!p.inference);
  set_mask(*g, a, p);
  auto [o, stats, amax_s, amax_o] =
      g->sdpa_fp8(q, k, v, scalar_float(*g, "descale_q", kDescaleQ), scalar_float(*g, "descale_k", kDescaleK),
                  scalar_float(*g, "descale_v", kDescaleV), scalar_float(*g, "descale_s", kDescaleS),
                  scalar_float(*g, "scale_s", kScaleS), scalar_float(*g, "scale_o", kScaleO), a);
  set_bshd(o, kO, p, nullptr, p.h, p.seg_sq, p.dv);
  o->set_data_type(fe::DataType_t::FP8_E4M3);
  set_scalar_output(amax_s, kAmaxS);
  set_scalar_output(amax_o, kAmaxO);
  if (!p.inference) set_stats_output(stats, p);
  return g;
}

std::shared_ptr<fe::graph::Graph> fp8_backward_graph(const Params& p) {
  auto g = new_fp8_graph();
  auto [q, k, v] = qkv_tensors(*g, p, RaggedOffsets{});
  auto o = bshd(*g, "o", kO, p, nullptr, p.h, p.seg_sq, p.dv);
  auto d_o = bshd(*g, "do", kDO, p, nullptr, p.h, p.seg_sq, p.dv);
  d_o->set_data_type(gradient_type(p));
  auto stats = stats_tensor(*g, p);
  fe::graph::SDPA_fp8_backward_attributes a;
  a.set_name("fusedattn_sdpa_fp8_backward");
  set_mask(*g, a, p);
  if (p.deterministic) a.set_deterministic_algorithm(true);
  auto scalar = [&](const char* name, Uid uid) { return scalar_float(*g, name, uid); };
  auto [dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp] = g->sdpa_fp8_backward(
      q, k, v, o, d_o, stats, scalar("descale_q", kDescaleQ), scalar("descale_k", kDescaleK),
      scalar("descale_v", kDescaleV), scalar("descale_o", kDescaleO), scalar("descale_do", kDescaleDO),
      scalar("descale_s", kDescaleS), scalar("descale_dp", kDescaleDP), scalar("scale_s", kScaleS),
      scalar("scale_dq", kScaleDQ), scalar("scale_dk", kScaleDK), scalar("scale_dv", kScaleDV),
      scalar("scale_dp", kScaleDP), a);
  set_bshd(dq, kDQ, p, nullptr, p.h, p.seg_sq, p.d);
  set_bshd(dk, kDK, p, nullptr, p.hkv, p.seg_skv, p.d);
  set_bshd(dv, kDV, p, nullptr, p.hkv, p.seg_skv, p.dv);
  for (const auto& t : {dq, dk, dv}) t->set_data_type(fe::DataType_t::FP8_E4M3);
  set_scalar_output(amax_dq, kAmaxDQ);
  set_scalar_output(amax_dk, kAmaxDK);
  set_scalar_output(amax_dv, kAmaxDV);
  set_scalar_output(amax_dp, kAmaxDP);
  return g;
}

// The FP8 handlers' attributes, decoded by name (the registration below).
struct Fp8Attrs {
  float scale;
  bool causal, bottom_right;
  int64_t segments;
  bool deterministic, training;
};

namespace {

// The call's operands (RemainingArgs) or results (RemainingRets), `count` buffers.
template <typename Buffers>
ffi::Error collect(const char* op, const char* what, const Buffers& buffers, size_t count,
                   std::vector<ffi::AnyBuffer>* out) {
  if (buffers.size() != count) {
    return invalid(op, "expected " + std::to_string(count) + " " + what + ", got " + std::to_string(buffers.size()));
  }
  for (size_t i = 0; i < count; ++i) {
    auto x = buffers.template get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if constexpr (std::is_same_v<Buffers, ffi::RemainingRets>) {
      out->push_back(**x);
    } else {
      out->push_back(*x);
    }
  }
  return ffi::Error::Success();
}

bool is_scalar_f32(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::DataType::F32 && x.element_count() == 1;
}

// Reads the call's Params off q, k, v (float8_e4m3fn) and the attributes; checks the
// lengths (padding) and the float32 [1] scalars.
ffi::Error parse_fp8(const char* op, const std::vector<ffi::AnyBuffer>& in, size_t lengths_at, size_t scalars_at,
                     const Fp8Attrs& at, Params* p) {
  for (int i = 0; i < 3; ++i) {
    if (in[i].element_type() != ffi::DataType::F8E4M3FN) return invalid(op, "q, k and v must be float8_e4m3fn");
  }
  *p = Params{};
  if (auto e = read_shapes(op, in[0], in[1], in[2], p); e.failure()) return e;
  p->bf16 = 0;
  p->fp8 = kFp8E4m3;
  p->scale = at.scale;
  p->causal = at.causal;
  p->bottom_right = at.bottom_right;
  if (at.segments != 0 && at.segments != 1) return invalid(op, "segments must be 0 or 1 (one sequence per row)");
  p->segments = at.segments;
  if (p->segments && (!is_int32(in[lengths_at], p->b) || !is_int32(in[lengths_at + 1], p->b))) {
    return invalid(op, "seqlen_q and seqlen_kv must be int32 [B]");
  }
  for (size_t i = scalars_at; i < in.size(); ++i) {
    if (!is_scalar_f32(in[i])) return invalid(op, "every scale and descale must be float32 [1]");
  }
  return ffi::Error::Success();
}

// The pack of the arrays (uids `arrays`, then the lengths under padding), the scalars
// (`scalars`) and the results.
void pack_operands(const Params& p, const std::vector<ffi::AnyBuffer>& in, const std::vector<Uid>& arrays,
                   const Uid* scalars, size_t scalars_at, Pack* pack) {
  for (size_t i = 0; i < arrays.size(); ++i) (*pack)[arrays[i]] = in[i].untyped_data();
  if (p.segments) {
    (*pack)[kSeqQ] = in[arrays.size()].untyped_data();
    (*pack)[kSeqKv] = in[arrays.size() + 1].untyped_data();
  }
  for (size_t i = scalars_at; i < in.size(); ++i) (*pack)[scalars[i - scalars_at]] = in[i].untyped_data();
}

ffi::Error check_results(const char* op, const std::vector<ffi::AnyBuffer>& out, size_t amaxes_at, size_t count) {
  for (size_t i = amaxes_at; i < amaxes_at + count; ++i) {
    if (!is_scalar_f32(out[i])) return invalid(op, "every amax result must be float32 [1]");
  }
  return ffi::Error::Success();
}

constexpr size_t kFwdArrays = 3, kBwdArrays = 6;  // q, k, v (, o, do, stats)

ffi::Error Fp8ForwardImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                          const Fp8Attrs& at) {
  std::vector<ffi::AnyBuffer> in, out;
  constexpr size_t scalars_at = kFwdArrays + 2;
  if (auto e = collect(kFp8Fwd, "operands", args, scalars_at + std::size(kFwdScalars), &in); e.failure()) return e;
  if (auto e = collect(kFp8Fwd, "results", rets, 5, &out); e.failure()) return e;
  Params p;
  if (auto e = parse_fp8(kFp8Fwd, in, kFwdArrays, scalars_at, at, &p); e.failure()) return e;
  p.inference = !at.training;
  const int64_t stats_count = at.training ? cudnn_batch(p) * p.h * p.seg_sq : 0;
  if (static_cast<int64_t>(out[0].element_count()) != p.b * p.sq * p.h * p.dv ||
      out[0].element_type() != ffi::DataType::F8E4M3FN || out[1].element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(out[1].element_count()) != stats_count) {
    return invalid(kFp8Fwd, "results must be o float8_e4m3fn [B, Sq, H, Dv] and stats float32 [B, H, Sq, 1] "
                            "(with training false a placeholder float32 [0])");
  }
  if (auto e = check_results(kFp8Fwd, out, 2, std::size(kFwdAmaxes)); e.failure()) return e;
  Pack pack;
  pack_operands(p, in, {kQ, kK, kV}, kFwdScalars, scalars_at, &pack);
  pack[kO] = out[0].untyped_data();
  if (at.training) pack[kStats] = out[1].untyped_data();
  for (size_t i = 0; i < std::size(kFwdAmaxes); ++i) pack[kFwdAmaxes[i]] = out[2 + i].untyped_data();
  return execute(kFp8Fwd, p, false, stream, device, out[4], pack);
}

ffi::Error Fp8BackwardImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           const Fp8Attrs& at) {
  std::vector<ffi::AnyBuffer> in, out;
  constexpr size_t scalars_at = kBwdArrays + 2;
  if (auto e = collect(kFp8Bwd, "operands", args, scalars_at + std::size(kBwdScalars), &in); e.failure()) return e;
  if (auto e = collect(kFp8Bwd, "results", rets, 8, &out); e.failure()) return e;
  Params p;
  // q, k, v, o, do, stats, then the lengths at kBwdArrays.
  if (auto e = parse_fp8(kFp8Bwd, in, kBwdArrays, scalars_at, at, &p); e.failure()) return e;
  if (!at.training) return invalid(kFp8Bwd, "training must be true (the backward reads the forward's stats)");
  p.deterministic = at.deterministic;
  const auto do_type = in[4].element_type();
  if (do_type != ffi::DataType::F8E4M3FN && do_type != ffi::DataType::F8E5M2) {
    return invalid(kFp8Bwd, "do must be float8_e4m3fn or float8_e5m2 (hybrid)");
  }
  p.fp8 = do_type == ffi::DataType::F8E5M2 ? kFp8Hybrid : kFp8E4m3;
  const int64_t o_count = p.b * p.sq * p.h * p.dv;
  if (in[3].element_type() != ffi::DataType::F8E4M3FN || static_cast<int64_t>(in[3].element_count()) != o_count ||
      static_cast<int64_t>(in[4].element_count()) != o_count || in[5].element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(in[5].element_count()) != cudnn_batch(p) * p.h * p.seg_sq) {
    return invalid(kFp8Bwd, "o (float8_e4m3fn), do and stats (float32) must match the forward's shapes");
  }
  for (int i = 0; i < 3; ++i) {
    if (out[i].element_type() != ffi::DataType::F8E4M3FN || out[i].element_count() != in[i].element_count()) {
      return invalid(kFp8Bwd, "dq, dk and dv must be float8_e4m3fn with the shapes of q, k and v");
    }
  }
  if (auto e = check_results(kFp8Bwd, out, 3, std::size(kBwdAmaxes)); e.failure()) return e;
  Pack pack;
  pack_operands(p, in, {kQ, kK, kV, kO, kDO, kStats}, kBwdScalars, scalars_at, &pack);
  pack[kDQ] = out[0].untyped_data();
  pack[kDK] = out[1].untyped_data();
  pack[kDV] = out[2].untyped_data();
  for (size_t i = 0; i < std::size(kBwdAmaxes); ++i) pack[kBwdAmaxes[i]] = out[3 + i].untyped_data();
  return execute(kFp8Bwd, p, true, stream, device, out[7], pack);
}

}  // namespace
}  // namespace fusedattn_cudnn

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fusedattn_cudnn::Fp8Attrs, StructMember<float>("scale"),
                                      StructMember<bool>("causal"), StructMember<bool>("bottom_right"),
                                      StructMember<int64_t>("segments"), StructMember<bool>("deterministic"),
                                      StructMember<bool>("training"));

FA_CUDNN_EXPORT XLA_FFI_Error* FusedattnCudnnFp8Fwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnCudnnFp8Fwd, fusedattn_cudnn::Fp8ForwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs<fusedattn_cudnn::Fp8Attrs>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

FA_CUDNN_EXPORT XLA_FFI_Error* FusedattnCudnnFp8Bwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnCudnnFp8Bwd, fusedattn_cudnn::Fp8BackwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs<fusedattn_cudnn::Fp8Attrs>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
