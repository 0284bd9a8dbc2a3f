// The "cudnn" backend's bf16/fp16 XLA FFI handlers and the library's ctypes exports
// (loading libcudnn, checking a configuration's graphs, sizing a call's workspace), over
// cuDNN's fused SDPA through the cuDNN frontend's graph API (header-only C++), built into
// libfusedattn_cudnn. The graphs: cudnn_graphs.cc (bf16/fp16) and cudnn_fp8.cc (FP8, with
// its own handlers); the cache: cudnn_graph_cache.cc. Graphs are built once per (shapes,
// dtype, mask, bias, dropout, window, GQA, sink, determinism, FP8 format, training or
// inference forward, device) and cached; a step pays no graph build after the first. The
// workspace is a result of the call, sized at trace time by FusedattnCudnnWorkspace (which
// builds the graph).
//
//   fusedattn_cudnn_fwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink)
//       -> (o, stats, workspace)
//   fusedattn_cudnn_bwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink, o, stats, do)
//       -> (dq, dk, dv, dbias, dsink, workspace)
//
//   q [B, Sq, H, D]; k [B, Skv, Hkv, D]; v [B, Skv, Hkv, Dv] (bf16 or f16)
//   bias [Bb, Bh, Sq, Skv] in q's dtype (Bb in {1, B}, Bh in {1, H}); ignored unless has_bias
//   segments = M > 0 (padding): cuDNN's batch is the B * M segments (M per row, slot-major
//       within a row); seqlen_q / seqlen_kv S32 [B * M] are their lengths (0: unused slot)
//   ragged (needs segments): segments start anywhere in their row; offsets S32 [4, B * M + 1]
//       are the element offsets of each segment's first token in q (and dq), o (and do), k
//       (and dk) and v (and dv). Without ragged, segment i is row i from its first token.
//       max_seqlen_q / max_seqlen_kv (ragged; 0: the row length) bound every segment's
//       length: cuDNN's sequence extents, so its work scales with them, not with the row.
//   rng U32 [4]: words (0,1) are cuDNN's int64 seed and (2,3) its int64 offset; ignored
//       unless dropout_rate > 0
//   sink F32 [H]; ignored unless has_sink
//   stats F32 [B * max(M, 1), H, Sq', 1]: log-sum-exp of the scaled scores (cuDNN's Stats),
//       Sq' = max_seqlen_q when ragged and given, else Sq. With training false the forward
//       writes no stats: its stats result is a placeholder F32 [0]
//   dbias like bias; dsink like sink
//   workspace U8 [n]: at least FusedattnCudnnWorkspace's bytes for the call; scratch
// attributes: scale f32, dropout_rate f32, causal bool, bottom_right bool,
//   window_left i64, window_right i64 (inclusive, -1 unbounded), segments i64, ragged bool,
//   max_seqlen_q i64, max_seqlen_kv i64, has_bias bool, has_sink bool, alibi bool (cuDNN's
//   ALiBi: the standard slopes of H heads, under a top-left causal mask), deterministic bool,
//   training bool: the forward builds cuDNN's training graph (with stats) when true, else its
//       inference graph (set_generate_stats(false): no stats, which lets cuDNN choose other
//       engines). Dropout draws the same mask either way. The backward takes true only.
// A jax.vmap reaches these handlers folded into B by the custom_vmap rule of
// fusedattn/ops/backends/cudnn/ffi_calls.py, so every operand has exactly the ranks above.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "cudnn_common.h"

namespace fusedattn_cudnn {
namespace {

// ---- FFI handlers ---------------------------------------------------------------

constexpr const char* kFwd = "fusedattn_cudnn_fwd";
constexpr const char* kBwd = "fusedattn_cudnn_bwd";

// The handlers' attributes, decoded by name into this struct (the registration by the bindings below).
struct Attrs {
  float scale;
  float dropout_rate;
  bool causal, bottom_right;
  int64_t window_left, window_right, segments;
  bool ragged;
  int64_t max_seqlen_q, max_seqlen_kv;
  bool has_bias, has_sink, alibi, deterministic;
  bool training;  // the forward's graph: with stats (true) or without (false); the backward's: true
};

// The operands both directions share.
struct Inputs {
  ffi::AnyBuffer q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink;
};

// Reads the shapes of the call into *p and checks them.
ffi::Error parse(const char* op, const Inputs& in, const Attrs& at, Params* p) {
  const auto dtype = in.q.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return invalid(op, "q must be bfloat16 or float16");
  }
  if (in.k.element_type() != dtype || in.v.element_type() != dtype) {
    return invalid(op, "q, k and v must share one dtype");
  }
  *p = Params{};
  if (auto e = read_shapes(op, in.q, in.k, in.v, p); e.failure()) return e;
  p->bf16 = dtype == ffi::DataType::BF16;
  p->scale = at.scale;
  p->dropout = at.dropout_rate;
  p->causal = at.causal;
  p->bottom_right = at.bottom_right;
  p->left = at.window_left;
  p->right = at.window_right;
  p->segments = at.segments;
  p->ragged = at.ragged;
  if ((at.max_seqlen_q || at.max_seqlen_kv) && !at.ragged) {
    return invalid(op, "max_seqlen_q and max_seqlen_kv need ragged");
  }
  if (at.max_seqlen_q < 0 || at.max_seqlen_q > p->sq || at.max_seqlen_kv < 0 || at.max_seqlen_kv > p->skv) {
    return invalid(op, "max_seqlen_q and max_seqlen_kv must be 0 or at most Sq and Skv");
  }
  p->seg_sq = at.max_seqlen_q ? at.max_seqlen_q : p->sq;
  p->seg_skv = at.max_seqlen_kv ? at.max_seqlen_kv : p->skv;
  p->sink = at.has_sink;
  p->alibi = at.alibi;
  p->deterministic = at.deterministic;
  if (at.has_bias) {
    const auto bd = in.bias.dimensions();
    if (in.bias.element_type() != dtype || bd.size() != 4 || (bd[0] != 1 && bd[0] != p->b) ||
        (bd[1] != 1 && bd[1] != p->h) || bd[2] != p->sq || bd[3] != p->skv) {
      return invalid(op, "bias must have q's dtype and shape [B or 1, H or 1, Sq, Skv]; got " +
                             dims_string(bd));
    }
    p->bias_b = bd[0];
    p->bias_h = bd[1];
  }
  if (at.segments < 0 || (at.ragged && at.segments == 0)) {
    return invalid(op, "segments must be >= 0, and > 0 with ragged");
  }
  if (at.segments > 0) {
    const int64_t batch = cudnn_batch(*p);
    if (!is_int32(in.seqlen_q, batch) || !is_int32(in.seqlen_kv, batch)) {
      return invalid(op, "seqlen_q and seqlen_kv must be int32 with one value per segment slot (" +
                             std::to_string(batch) + ")");
    }
    if (at.ragged) {
      if (!is_int32(in.offsets, 4 * (batch + 1))) {
        return invalid(op, "offsets must be int32 [4, " + std::to_string(batch + 1) + "]");
      }
      const int64_t largest = std::max(p->b * p->sq * p->h * std::max(p->d, p->dv),
                                       p->b * p->skv * p->hkv * std::max(p->d, p->dv));
      if (largest > INT32_MAX) {
        return invalid(op, "ragged offsets are int32: an operand of " + std::to_string(largest) +
                               " elements is too large; split the batch");
      }
    }
  }
  if (at.dropout_rate > 0.0f && (in.rng.element_type() != ffi::DataType::U32 || in.rng.element_count() != 4)) {
    return invalid(op, "rng must be uint32 [4]");
  }
  if (at.has_sink && (in.sink.element_type() != ffi::DataType::F32 ||
                      static_cast<int64_t>(in.sink.element_count()) != p->h)) {
    return invalid(op, "sink must be float32 [H]");
  }
  return ffi::Error::Success();
}

// The device pointers of the shared operands, by uid.
Pack common_pack(const Params& p, const Inputs& in) {
  Pack pack = {
      {kQ, in.q.untyped_data()}, {kK, in.k.untyped_data()}, {kV, in.v.untyped_data()}};
  if (p.bias_b > 0) pack[kBias] = in.bias.untyped_data();
  if (p.segments > 0) {
    pack[kSeqQ] = in.seqlen_q.untyped_data();
    pack[kSeqKv] = in.seqlen_kv.untyped_data();
  }
  if (p.ragged) {
    auto* offsets = static_cast<int32_t*>(in.offsets.untyped_data());
    const int64_t stride = cudnn_batch(p) + 1;
    pack[kOffQ] = offsets;
    pack[kOffO] = offsets + stride;
    pack[kOffK] = offsets + 2 * stride;
    pack[kOffV] = offsets + 3 * stride;
  }
  if (p.dropout > 0.0f) {
    pack[kSeed] = in.rng.untyped_data();
    pack[kOffset] = static_cast<char*>(in.rng.untyped_data()) + 8;
  }
  if (p.sink) pack[kSink] = in.sink.untyped_data();
  return pack;
}

ffi::Error ForwardImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer seqlen_q,
                       ffi::AnyBuffer seqlen_kv, ffi::AnyBuffer offsets, ffi::AnyBuffer rng, ffi::AnyBuffer sink,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> stats,
                       ffi::Result<ffi::AnyBuffer> workspace, const Attrs& at) {
  const Inputs in{q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink};
  Params p;
  if (auto e = parse(kFwd, in, at, &p); e.failure()) return e;
  p.deterministic = 0;  // the forward is deterministic anyway: one graph for both settings
  p.inference = !at.training;
  if (static_cast<int64_t>(o->element_count()) != p.b * p.sq * p.h * p.dv || o->element_type() != q.element_type() ||
      stats->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(stats->element_count()) != (at.training ? cudnn_batch(p) * p.h * p.seg_sq : 0)) {
    return invalid(kFwd, at.training ? "results must be o [B, Sq, H, Dv] in q's dtype and stats float32 "
                                       "[B * max(segments, 1), H, Sq', 1]"
                                     : "results must be o [B, Sq, H, Dv] in q's dtype and, with training "
                                       "false, a placeholder stats float32 [0]");
  }
  auto pack = common_pack(p, in);
  pack[kO] = o->untyped_data();
  if (at.training) pack[kStats] = stats->untyped_data();
  return execute(kFwd, p, false, stream, device, *workspace, pack);
}

ffi::Error BackwardImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer seqlen_q,
                        ffi::AnyBuffer seqlen_kv, ffi::AnyBuffer offsets, ffi::AnyBuffer rng, ffi::AnyBuffer sink,
                        ffi::AnyBuffer o, ffi::AnyBuffer stats, ffi::AnyBuffer d_o, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dsink,
                        ffi::Result<ffi::AnyBuffer> workspace, const Attrs& at) {
  const Inputs in{q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink};
  Params p;
  if (auto e = parse(kBwd, in, at, &p); e.failure()) return e;
  if (!at.training) return invalid(kBwd, "training must be true (the backward reads the training forward's stats)");
  if (o.element_count() != d_o.element_count() ||
      static_cast<int64_t>(o.element_count()) != p.b * p.sq * p.h * p.dv ||
      static_cast<int64_t>(stats.element_count()) != cudnn_batch(p) * p.h * p.seg_sq ||
      stats.element_type() != ffi::DataType::F32 || dq->element_count() != q.element_count() ||
      dk->element_count() != k.element_count() || dv->element_count() != v.element_count()) {
    return invalid(kBwd, "o, do, stats and the gradients must match the forward's shapes");
  }
  if (p.bias_b > 0 && dbias->element_count() != bias.element_count()) {
    return invalid(kBwd, "dbias must have bias's shape");
  }
  if (p.sink && dsink->element_count() != sink.element_count()) {
    return invalid(kBwd, "dsink must have sink's shape");
  }
  auto pack = common_pack(p, in);
  pack[kO] = o.untyped_data();
  pack[kStats] = stats.untyped_data();
  pack[kDO] = d_o.untyped_data();
  pack[kDQ] = dq->untyped_data();
  pack[kDK] = dk->untyped_data();
  pack[kDV] = dv->untyped_data();
  if (p.bias_b > 0) pack[kDBias] = dbias->untyped_data();
  if (p.sink) pack[kDSink] = dsink->untyped_data();
  return execute(kBwd, p, true, stream, device, *workspace, pack);
}

}  // namespace
}  // namespace fusedattn_cudnn

// ---- exports ----------------------------------------------------------------------

// Copies `error` into msg (truncated to msg_len) for the Python side.
static void report(const std::string& error, char* msg, int64_t msg_len) {
  if (msg != nullptr && msg_len > 0) {
    std::strncpy(msg, error.c_str(), static_cast<size_t>(msg_len - 1));
    msg[msg_len - 1] = '\0';
  }
}

// Loads libcudnn (path, or the already-loaded libcudnn.so.9 when path is null or empty).
// Returns cuDNN's version (e.g. 91000) or 0, with the reason in msg.
FA_CUDNN_EXPORT int64_t FusedattnCudnnLoad(const char* path, char* msg, int64_t msg_len) {
  const std::string error = fusedattn_cudnn::load_cudnn(path);
  if (!error.empty()) {
    report(error, msg, msg_len);
    return 0;
  }
  return static_cast<int64_t>(fusedattn_cudnn::cudnn_version());
}

// The graph parameters of the exports: b, h, hkv, sq, skv, d, dv, bf16, causal, bottom_right,
// left, right, segments, ragged, seg_sq, seg_skv, bias_b, bias_h, sink, alibi, deterministic,
// fp8 (22 values, the Params fields the handlers read off their operands and attributes;
// fp8: fusedattn_cudnn::Fp8, the FP8 graphs of cudnn_fp8.cc when nonzero).
static std::string read_params(const int64_t* params, int64_t n, float scale, float dropout,
                               fusedattn_cudnn::Params* p) {
  constexpr int kCount = 22;
  if (n != kCount) {
    return "expected " + std::to_string(kCount) + " graph parameters, got " + std::to_string(n);
  }
  int64_t* fields[kCount] = {&p->b,      &p->h,     &p->hkv,    &p->sq,     &p->skv,    &p->d,
                             &p->dv,     &p->bf16,  &p->causal, &p->bottom_right,       &p->left,
                             &p->right,  &p->segments,          &p->ragged, &p->seg_sq, &p->seg_skv,
                             &p->bias_b, &p->bias_h,            &p->sink,   &p->alibi,  &p->deterministic,
                             &p->fp8};
  for (int i = 0; i < kCount; ++i) *fields[i] = params[i];
  p->scale = scale;
  p->dropout = dropout;
  return "";
}

// Builds (and caches) the training forward and the backward graphs of a call on `device`
// without running them (params: read_params). Returns 1 when both build, else 0 with
// cuDNN's reason in msg. The inference forward (training false) is built when
// FusedattnCudnnWorkspace sizes its call, and where cuDNN cannot build it the call runs the
// training forward instead: it never serves less than this check promises.
FA_CUDNN_EXPORT int64_t FusedattnCudnnCheck(const int64_t* params, int64_t n, float scale, float dropout,
                                            int64_t device, char* msg, int64_t msg_len) {
  fusedattn_cudnn::Params p;
  std::string error = read_params(params, n, scale, dropout, &p);
  for (bool backward : {false, true}) {
    if (!error.empty()) break;
    fusedattn_cudnn::Params q = p;
    if (!backward) q.deterministic = 0;
    cudnnHandle_t handle = nullptr;
    auto entry = fusedattn_cudnn::get_graph(q, backward, static_cast<int>(device), &handle, &error);
    if (entry && !entry->graph) error = std::string(backward ? "backward: " : "forward: ") + entry->error;
  }
  if (error.empty()) return 1;
  report(error, msg, msg_len);
  return 0;
}

// The workspace bytes of one FFI call (params: read_params; inference: the forward with
// training false; backward: the backward), building its graph on `device` if not cached.
// Returns -1 with the reason in msg when the call cannot run.
FA_CUDNN_EXPORT int64_t FusedattnCudnnWorkspace(const int64_t* params, int64_t n, float scale, float dropout,
                                                int64_t inference, int64_t backward, int64_t device, char* msg,
                                                int64_t msg_len) {
  fusedattn_cudnn::Params p;
  std::string error = read_params(params, n, scale, dropout, &p);
  if (error.empty()) {
    if (!backward) p.deterministic = 0;  // as the forward handler: one graph for both settings
    p.inference = backward ? 0 : inference;
    fusedattn_cudnn::CallPlan plan;
    error = fusedattn_cudnn::plan_call(p, backward != 0, static_cast<int>(device), &plan);
    if (error.empty()) return plan.workspace_bytes();
  }
  report(error, msg, msg_len);
  return -1;
}

// The operands both directions share, in order.
#define FA_CUDNN_INPUTS(binding)                     \
  binding.Ctx<xla::ffi::PlatformStream<cudaStream_t>>() \
      .Ctx<xla::ffi::DeviceOrdinal>()                \
      .Arg<xla::ffi::AnyBuffer>() /* q */            \
      .Arg<xla::ffi::AnyBuffer>() /* k */            \
      .Arg<xla::ffi::AnyBuffer>() /* v */            \
      .Arg<xla::ffi::AnyBuffer>() /* bias */         \
      .Arg<xla::ffi::AnyBuffer>() /* seqlen_q */     \
      .Arg<xla::ffi::AnyBuffer>() /* seqlen_kv */    \
      .Arg<xla::ffi::AnyBuffer>() /* offsets */      \
      .Arg<xla::ffi::AnyBuffer>() /* rng */          \
      .Arg<xla::ffi::AnyBuffer>() /* sink */

// The attributes both directions share, in Attrs's member order.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fusedattn_cudnn::Attrs, StructMember<float>("scale"),
                                      StructMember<float>("dropout_rate"), StructMember<bool>("causal"),
                                      StructMember<bool>("bottom_right"), StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"), StructMember<int64_t>("segments"),
                                      StructMember<bool>("ragged"), StructMember<int64_t>("max_seqlen_q"),
                                      StructMember<int64_t>("max_seqlen_kv"), StructMember<bool>("has_bias"),
                                      StructMember<bool>("has_sink"), StructMember<bool>("alibi"),
                                      StructMember<bool>("deterministic"),
                                      StructMember<bool>("training"));

FA_CUDNN_EXPORT XLA_FFI_Error* FusedattnCudnnFwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnCudnnFwd, fusedattn_cudnn::ForwardImpl,
                              FA_CUDNN_INPUTS(xla::ffi::Ffi::Bind())
                                  .Ret<xla::ffi::AnyBuffer>()  // o
                                  .Ret<xla::ffi::AnyBuffer>()  // stats
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .Attrs<fusedattn_cudnn::Attrs>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

FA_CUDNN_EXPORT XLA_FFI_Error* FusedattnCudnnBwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnCudnnBwd, fusedattn_cudnn::BackwardImpl,
                              FA_CUDNN_INPUTS(xla::ffi::Ffi::Bind())
                                  .Arg<xla::ffi::AnyBuffer>()  // o
                                  .Arg<xla::ffi::AnyBuffer>()  // stats
                                  .Arg<xla::ffi::AnyBuffer>()  // do
                                  .Ret<xla::ffi::AnyBuffer>()  // dq
                                  .Ret<xla::ffi::AnyBuffer>()  // dk
                                  .Ret<xla::ffi::AnyBuffer>()  // dv
                                  .Ret<xla::ffi::AnyBuffer>()  // dbias
                                  .Ret<xla::ffi::AnyBuffer>()  // dsink
                                  .Ret<xla::ffi::AnyBuffer>()  // workspace
                                  .Attrs<fusedattn_cudnn::Attrs>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
