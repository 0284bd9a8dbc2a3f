// The "cudnn" backend: XLA FFI handlers that run cuDNN's fused SDPA through the
// cuDNN frontend's graph API (header-only C++), built into libfusedattn_cudnn.
//
// libcudnn is loaded at run time (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): no
// link-time dependency. FusedattnCudnnLoad() dlopens the libcudnn.so.9 that
// JAX's CUDA plugin already loaded (or a path given by Python) and hands it to
// the frontend. Graphs are built once per (shapes, dtype, mask, bias, dropout,
// window, GQA, sink, determinism, training or inference forward, device) and
// cached; a step pays no graph build after the first. The workspace is a result
// of the call, sized at trace time by FusedattnCudnnWorkspace (which builds the
// graph): the handlers allocate nothing, so they declare themselves command-buffer
// compatible and XLA can trace them into its CUDA graphs with the kernels around.
//
// Operands are the canonical BSHD arrays of fusedattn/ops/backends/base.py,
// given to cuDNN as strided [b, h, s, d] views (no copies).
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
// fusedattn/ops/backends/cudnn.py, so every operand has exactly the ranks above.
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

#include "xla/ffi/api/ffi.h"

// The frontend's dynamic loader resolves every cuDNN symbol through this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

#define FA_CUDNN_EXPORT extern "C" __attribute__((visibility("default")))

namespace fusedattn_cudnn {
namespace {

namespace ffi = xla::ffi;
namespace fe = cudnn_frontend;

// ---- diagnostics (FUSEDATTN_CUDNN_TRACE=1) -----------------------------------------

bool tracing() {
  static const bool on = [] {
    const char* v = std::getenv("FUSEDATTN_CUDNN_TRACE");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

void trace(const std::string& what) {
  if (tracing()) std::fprintf(stderr, "[fusedattn_cudnn] %s\n", what.c_str());
}

// With tracing on, a crash prints the native stack (file + offset per frame) before dying.
void crash_handler(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  std::fprintf(stderr, "[fusedattn_cudnn] signal %d; native stack:\n", sig);
  for (int i = 0; i < n; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) && info.dli_fname) {
      std::fprintf(stderr, "  #%d %s+0x%lx %s\n", i, info.dli_fname,
                   static_cast<unsigned long>(static_cast<char*>(frames[i]) - static_cast<char*>(info.dli_fbase)),
                   info.dli_sname ? info.dli_sname : "");
    } else {
      std::fprintf(stderr, "  #%d %p\n", i, frames[i]);
    }
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

// ---- loading libcudnn ---------------------------------------------------------

std::mutex g_load_mutex;
size_t g_cudnn_version = 0;  // nonzero once loaded

std::string load_cudnn(const char* path) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (g_cudnn_version != 0) return "";
  void* handle = nullptr;
  std::string tried;
  if (path != nullptr && path[0] != '\0') {
    handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    tried = path;
  } else {
    // The copy JAX's CUDA plugin already loaded, if any; else the loader's search path.
    handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    tried = "libcudnn.so.9";
  }
  if (handle == nullptr) {
    const char* error = dlerror();
    return "could not load " + tried + ": " + (error ? error : "unknown dlopen error");
  }
  using GetVersion = size_t (*)();
  auto get_version = reinterpret_cast<GetVersion>(dlsym(handle, "cudnnGetVersion"));
  if (get_version == nullptr) return tried + " has no cudnnGetVersion symbol; is it libcudnn?";
  const size_t version = get_version();
  if (version < 90000) {
    return "cuDNN 9 is needed, but " + tried + " is version " + std::to_string(version);
  }
  fe::cudnn_dlhandle = handle;
  g_cudnn_version = version;
  if (tracing()) {
    signal(SIGSEGV, crash_handler);
    signal(SIGABRT, crash_handler);
    trace("loaded " + tried + " version " + std::to_string(version));
  }
  return "";
}

// ---- the static description of one call ---------------------------------------

struct Params {
  int64_t b = 0, h = 0, hkv = 0, sq = 0, skv = 0, d = 0, dv = 0;
  int64_t bf16 = 1;  // 1 bfloat16, 0 float16
  int64_t causal = 0, bottom_right = 0, left = -1, right = -1;
  int64_t segments = 0, ragged = 0;  // segments > 0: padding, cuDNN batch b * segments
  int64_t seg_sq = 0, seg_skv = 0;   // cuDNN's sequence extents: sq, skv unless ragged bounds
  int64_t bias_b = 0, bias_h = 0;  // 0, 0: no bias
  int64_t sink = 0, alibi = 0, deterministic = 0;
  int64_t inference = 0;  // forward only: 1 builds the graph without stats (training = false)
  float scale = 1.0f, dropout = 0.0f;

  // Everything that shapes a graph, with the device and direction: the cache key. Built
  // on every call, so plain integers (the floats by their bits), not a formatted string.
  using Key = std::array<int64_t, 26>;
  Key key(int device, bool backward) const {
    return {backward, device, b, h, hkv, sq, skv, d, dv, bf16, causal, bottom_right, left, right, segments,
            ragged, seg_sq, seg_skv, bias_b, bias_h, sink, alibi, deterministic, inference, bits(scale),
            bits(dropout)};
  }

 private:
  static int64_t bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
  }
};

std::string key_string(const Params::Key& key) {
  std::string s;
  for (int64_t x : key) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kBias, kSeqQ, kSeqKv, kSeed, kOffset, kSink,
  kDO, kDQ, kDK, kDV, kDBias, kDSink, kOffQ, kOffO, kOffK, kOffV,
};

// cuDNN's batch: one entry per segment slot under padding, else one per row.
int64_t cudnn_batch(const Params& p) { return p.segments > 0 ? p.b * p.segments : p.b; }

using Tensor = std::shared_ptr<fe::graph::Tensor_attributes>;

// Element offsets of the segments' first tokens in q, o, k and v (null unless ragged);
// each gradient shares the offsets of its operand.
struct RaggedOffsets {
  Tensor q, o, k, v;
};

RaggedOffsets ragged_offsets(fe::graph::Graph& g, const Params& p) {
  if (!p.ragged) return {};
  auto offsets = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({cudnn_batch(p) + 1, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  };
  return {offsets("offsets_q", kOffQ), offsets("offsets_o", kOffO), offsets("offsets_k", kOffK),
          offsets("offsets_v", kOffV)};
}

// Shapes [batch, heads, s, dim] and strides of a row-major [b, s, heads, dim] array;
// ragged segments take their start from `offsets` instead of the batch stride.
void shape_bshd(fe::graph::Tensor_attributes& t, const Params& p, const Tensor& offsets, int64_t heads,
                int64_t s, int64_t dim) {
  t.set_dim({cudnn_batch(p), heads, s, dim}).set_stride({s * heads * dim, dim, heads * dim, 1});
  if (offsets) t.set_ragged_offset(offsets);
}

Tensor bshd(fe::graph::Graph& g, const char* name, Uid uid, const Params& p, const Tensor& offsets,
            int64_t heads, int64_t s, int64_t dim) {
  fe::graph::Tensor_attributes t;
  t.set_name(name).set_uid(uid);
  shape_bshd(t, p, offsets, heads, s, dim);
  return g.tensor(t);
}

void set_bshd(const Tensor& t, Uid uid, const Params& p, const Tensor& offsets, int64_t heads, int64_t s,
              int64_t dim) {
  t->set_output(true).set_uid(uid);
  shape_bshd(*t, p, offsets, heads, s, dim);
}

std::vector<int64_t> bias_dims(const Params& p) { return {p.bias_b, p.bias_h, p.sq, p.skv}; }
std::vector<int64_t> bias_strides(const Params& p) { return {p.bias_h * p.sq * p.skv, p.sq * p.skv, p.skv, 1}; }

Tensor scalar_int64(fe::graph::Graph& g, const char* name, Uid uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT64));
}

// Mask, window, padding, bias, ALiBi, dropout and sink: the same for both directions.
template <typename Attributes>
void set_common(fe::graph::Graph& g, Attributes& a, const Params& p) {
  a.set_attn_scale(p.scale);
  const bool has_right = p.causal || p.right >= 0;
  if (has_right) a.set_diagonal_band_right_bound(static_cast<int>(p.causal ? 0 : p.right));
  // cuDNN keeps key j when j + left_bound > diagonal: our inclusive left window L is L + 1.
  if (p.left >= 0) a.set_diagonal_band_left_bound(static_cast<int>(p.left + 1));
  if (has_right || p.left >= 0) {
    a.set_diagonal_alignment(p.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                            : fe::DiagonalAlignment_t::TOP_LEFT);
  }
  if (p.segments > 0) {
    auto lengths = [&](const char* name, Uid uid) {
      return g.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({cudnn_batch(p), 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
    };
    a.set_padding_mask(true).set_seq_len_q(lengths("seqlen_q", kSeqQ)).set_seq_len_kv(lengths("seqlen_kv", kSeqKv));
  }
  if (p.bias_b > 0) {
    a.set_bias(g.tensor(fe::graph::Tensor_attributes()
                            .set_name("bias")
                            .set_uid(kBias)
                            .set_dim(bias_dims(p))
                            .set_stride(bias_strides(p))));
  }
  if (p.alibi) a.set_alibi_mask(true);
  if (p.dropout > 0.0f) {
    a.set_dropout(p.dropout, scalar_int64(g, "seed", kSeed), scalar_int64(g, "offset", kOffset));
  }
  if (p.sink) {
    a.set_sink_token(g.tensor(fe::graph::Tensor_attributes()
                                  .set_name("sink")
                                  .set_uid(kSink)
                                  .set_dim({1, p.h, 1, 1})
                                  .set_stride({p.h, 1, 1, 1})
                                  .set_data_type(fe::DataType_t::FLOAT)));
  }
}

std::shared_ptr<fe::graph::Graph> new_graph(const Params& p) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// The q, k and v operands of a graph, created in that order.
std::array<Tensor, 3> qkv_tensors(fe::graph::Graph& g, const Params& p, const RaggedOffsets& offsets) {
  return {bshd(g, "q", kQ, p, offsets.q, p.h, p.seg_sq, p.d), bshd(g, "k", kK, p, offsets.k, p.hkv, p.seg_skv, p.d),
          bshd(g, "v", kV, p, offsets.v, p.hkv, p.seg_skv, p.dv)};
}

std::vector<int64_t> stats_dims(const Params& p) { return {cudnn_batch(p), p.h, p.seg_sq, 1}; }
std::vector<int64_t> stats_strides(const Params& p) { return {p.h * p.seg_sq, p.seg_sq, 1, 1}; }

Tensor stats_tensor(fe::graph::Graph& g, const Params& p) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("stats")
                      .set_uid(kStats)
                      .set_dim(stats_dims(p))
                      .set_stride(stats_strides(p))
                      .set_data_type(fe::DataType_t::FLOAT));
}

// The training forward writes the stats the backward reads; the inference forward
// (p.inference) does not, so cuDNN may pick another engine (and skip the stats' stores).
std::shared_ptr<fe::graph::Graph> forward_graph(const Params& p) {
  auto g = new_graph(p);
  const RaggedOffsets offsets = ragged_offsets(*g, p);
  auto [q, k, v] = qkv_tensors(*g, p, offsets);
  fe::graph::SDPA_attributes a;
  a.set_name("fusedattn_sdpa").set_generate_stats(!p.inference);
#if CUDNN_FRONTEND_VERSION >= 11400
  // With dropout, cuDNN's unified SDPA node serves only graphs without stats, so the
  // frontend would pick it for the inference forward alone; the composite node, which the
  // training forward and the backward use, keeps the dropout mask the same for the same
  // seed whether or not the call is differentiated. (Frontends before 1.14 have no other.)
  if (p.inference && p.dropout > 0.0f) a.set_implementation(fe::AttentionImplementation_t::COMPOSITE);
#endif
  set_common(*g, a, p);
  auto [o, stats] = g->sdpa(q, k, v, a);
  set_bshd(o, kO, p, offsets.o, p.h, p.seg_sq, p.dv);
  if (!p.inference) {
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dims(p))
        .set_stride(stats_strides(p));
  }
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const Params& p) {
  auto g = new_graph(p);
  const RaggedOffsets offsets = ragged_offsets(*g, p);
  auto [q, k, v] = qkv_tensors(*g, p, offsets);
  auto o = bshd(*g, "o", kO, p, offsets.o, p.h, p.seg_sq, p.dv);
  auto d_o = bshd(*g, "do", kDO, p, offsets.o, p.h, p.seg_sq, p.dv);
  auto stats = stats_tensor(*g, p);
  fe::graph::SDPA_backward_attributes a;
  a.set_name("fusedattn_sdpa_backward");
  set_common(*g, a, p);
  if (p.bias_b > 0) {
    a.set_dbias(g->tensor(fe::graph::Tensor_attributes()
                              .set_name("dbias")
                              .set_uid(kDBias)
                              .set_dim(bias_dims(p))
                              .set_stride(bias_strides(p))
                              .set_output(true)));
  }
  if (p.sink) {
    a.set_dsink_token(g->tensor(fe::graph::Tensor_attributes()
                                    .set_name("dsink")
                                    .set_uid(kDSink)
                                    .set_dim({1, p.h, 1, 1})
                                    .set_stride({p.h, 1, 1, 1})
                                    .set_data_type(fe::DataType_t::FLOAT)
                                    .set_output(true)));
  }
  if (p.deterministic) a.set_deterministic_algorithm(true);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, a);
  set_bshd(dq, kDQ, p, offsets.q, p.h, p.seg_sq, p.d);
  set_bshd(dk, kDK, p, offsets.k, p.hkv, p.seg_skv, p.d);
  set_bshd(dv, kDV, p, offsets.v, p.hkv, p.seg_skv, p.dv);
  return g;
}

// ---- handles and the graph cache ----------------------------------------------

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorString(e);
}

// While alive, this thread may make CUDA calls that stream capture forbids (cudnnCreate
// and graph builds allocate and load kernels): a handler traced into an XLA command buffer
// whose graph is not yet cached builds it outside the capture instead of failing.
class CaptureRelaxed {
 public:
  CaptureRelaxed() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~CaptureRelaxed() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  CaptureRelaxed(const CaptureRelaxed&) = delete;
  CaptureRelaxed& operator=(const CaptureRelaxed&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

std::mutex g_handle_mutex;
std::unordered_map<int, cudnnHandle_t> g_handles;

// The cuDNN handle of `device` (created on first use, kept for the process).
std::string get_handle(int device, cudnnHandle_t* out) {
  std::lock_guard<std::mutex> lock(g_handle_mutex);
  auto it = g_handles.find(device);
  if (it != g_handles.end()) {
    *out = it->second;
    return "";
  }
  int previous = -1;
  trace("cudaGetDevice");
  if (cudaError_t e = cudaGetDevice(&previous); e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  if (previous != device) {
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return cuda_error("cudaSetDevice", e);
  }
  cudnnHandle_t handle = nullptr;
  const CaptureRelaxed relaxed;
  trace("cudnnCreate on device " + std::to_string(device));
  const cudnnStatus_t status = fe::detail::create_handle(&handle);
  trace("cudnnCreate done");
  if (previous != device) cudaSetDevice(previous);
  if (status != CUDNN_STATUS_SUCCESS) {
    return std::string("cudnnCreate failed: ") + fe::detail::get_error_string(status);
  }
  g_handles[device] = handle;
  *out = handle;
  return "";
}

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;  // null when unsupported
  int64_t workspace = 0;
  std::string error;  // why the graph cannot be built
};

std::mutex g_cache_mutex;
std::map<Params::Key, std::shared_ptr<Entry>> g_cache;

std::string fe_error(const char* stage, fe::error_t e) { return std::string(stage) + ": " + e.get_message(); }

std::shared_ptr<Entry> build(const Params& p, bool backward, cudnnHandle_t handle) {
  auto entry = std::make_shared<Entry>();
  try {
    trace(std::string("building ") + (backward ? "backward" : "forward") + " graph " + key_string(p.key(-1, backward)));
    auto g = backward ? backward_graph(p) : forward_graph(p);
    trace("validate");
    fe::error_t e = g->validate();
    if (e.is_bad()) { entry->error = fe_error("validate", e); return entry; }
    trace("build_operation_graph");
    e = g->build_operation_graph(handle);
    if (e.is_bad()) { entry->error = fe_error("build_operation_graph", e); return entry; }
    trace("create_execution_plans");
    e = g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (e.is_bad()) { entry->error = fe_error("create_execution_plans", e); return entry; }
    trace("check_support");
    e = g->check_support(handle);
    if (e.is_bad()) { entry->error = fe_error("check_support", e); return entry; }
    trace("build_plans");
    e = g->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
    if (e.is_bad()) { entry->error = fe_error("build_plans", e); return entry; }
    int64_t workspace = 0;
    e = g->get_workspace_size(workspace);
    if (e.is_bad()) { entry->error = fe_error("get_workspace_size", e); return entry; }
    entry->graph = std::move(g);
    entry->workspace = workspace;
  } catch (const std::exception& x) {
    entry->error = std::string("exception: ") + x.what();
  } catch (...) {
    entry->error = "unknown exception";
  }
  return entry;
}

// The cached graph of `p` on `device` (built on first use). Failures are cached too.
std::shared_ptr<Entry> get_graph(const Params& p, bool backward, int device, cudnnHandle_t* handle_out,
                                 std::string* error) {
  if (g_cudnn_version == 0) {
    *error = "libcudnn is not loaded (FusedattnCudnnLoad was not called or failed)";
    return nullptr;
  }
  cudnnHandle_t handle = nullptr;
  if (std::string e = get_handle(device, &handle); !e.empty()) {
    *error = e;
    return nullptr;
  }
  *handle_out = handle;
  const Params::Key key = p.key(device, backward);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto it = g_cache.find(key);
  if (it != g_cache.end()) return it->second;
  int previous = -1;
  cudaGetDevice(&previous);
  if (previous != device) cudaSetDevice(device);
  const CaptureRelaxed relaxed;
  auto entry = build(p, backward, handle);
  if (previous != device && previous >= 0) cudaSetDevice(previous);
  g_cache.emplace(key, entry);
  return entry;
}

// The graph a call runs, and the workspace it needs (the FFI call's workspace result).
// Where cuDNN cannot build the forward without stats, the training forward stands in,
// its stats at the start of the workspace.
struct CallPlan {
  std::shared_ptr<Entry> entry;
  cudnnHandle_t handle = nullptr;
  int64_t stats_bytes = 0;  // the stand-in's stats, then cuDNN's workspace from stats_bytes
  int64_t workspace_bytes() const { return stats_bytes + entry->workspace; }
};

// Fills *plan, or returns why the call cannot run (the build's failure is cached).
std::string plan_call(const Params& p, bool backward, int device, CallPlan* plan) {
  std::string error;
  plan->entry = get_graph(p, backward, device, &plan->handle, &error);
  if (plan->entry && !plan->entry->graph && p.inference) {
    trace("no inference forward (" + plan->entry->error + "); running the training forward");
    Params training = p;
    training.inference = 0;
    plan->entry = get_graph(training, backward, device, &plan->handle, &error);
    // 256-byte aligned, so cuDNN's workspace after it stays aligned.
    plan->stats_bytes = (cudnn_batch(p) * p.h * p.seg_sq * static_cast<int64_t>(sizeof(float)) + 255) / 256 * 256;
  }
  if (!plan->entry) return error;
  if (!plan->entry->graph) return "cuDNN cannot run this attention call: " + plan->entry->error;
  return "";
}

// ---- FFI handlers ---------------------------------------------------------------

constexpr const char* kFwd = "fusedattn_cudnn_fwd";
constexpr const char* kBwd = "fusedattn_cudnn_bwd";

ffi::Error invalid(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

std::string dims_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

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

bool is_int32(const ffi::AnyBuffer& x, int64_t count) {
  return x.element_type() == ffi::DataType::S32 && static_cast<int64_t>(x.element_count()) == count;
}

// Reads the shapes of the call into *p and checks them.
ffi::Error parse(const char* op, const Inputs& in, const Attrs& at, Params* p) {
  const auto dtype = in.q.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return invalid(op, "q must be bfloat16 or float16");
  }
  if (in.k.element_type() != dtype || in.v.element_type() != dtype) {
    return invalid(op, "q, k and v must share one dtype");
  }
  const auto qd = in.q.dimensions(), kd = in.k.dimensions(), vd = in.v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return invalid(op, "q, k and v must have shape [B, S, H, D]; got " + dims_string(qd) + ", " +
                           dims_string(kd) + ", " + dims_string(vd));
  }
  *p = Params{};
  p->b = qd[0], p->sq = qd[1], p->h = qd[2], p->d = qd[3];
  p->skv = kd[1], p->hkv = kd[2], p->dv = vd[3];
  if (kd[0] != p->b || vd[0] != p->b || kd[3] != p->d || vd[1] != p->skv || vd[2] != p->hkv || p->hkv < 1 ||
      p->h % p->hkv != 0) {
    return invalid(op, "inconsistent q/k/v shapes " + dims_string(qd) + ", " + dims_string(kd) + ", " +
                           dims_string(vd));
  }
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
std::unordered_map<int64_t, void*> common_pack(const Params& p, const Inputs& in) {
  std::unordered_map<int64_t, void*> pack = {
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

// Runs the call's graph with `workspace` (the FFI call's uint8 result, sized by
// FusedattnCudnnWorkspace): no allocation at run time, so XLA may trace the handler into a
// command buffer.
ffi::Error execute(const char* op, const Params& p, bool backward, cudaStream_t stream, int device,
                   ffi::AnyBuffer workspace, std::unordered_map<int64_t, void*>& pack) {
  if (p.b == 0 || p.sq == 0 || p.skv == 0 || p.h == 0) return ffi::Error::Success();
  CallPlan plan;
  if (std::string error = plan_call(p, backward, device, &plan); !error.empty()) {
    const bool unsupported = plan.entry != nullptr;
    return ffi::Error(unsupported ? ffi::ErrorCode::kUnimplemented : ffi::ErrorCode::kInternal,
                      std::string(op) + ": " + error);
  }
  if (workspace.element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(workspace.size_bytes()) < plan.workspace_bytes()) {
    return invalid(op, "the workspace result must be uint8 of at least " + std::to_string(plan.workspace_bytes()) +
                           " bytes (FusedattnCudnnWorkspace), got " + std::to_string(workspace.size_bytes()));
  }
  char* base = static_cast<char*>(workspace.untyped_data());
  if (plan.stats_bytes > 0) pack[kStats] = base;
  try {
    std::lock_guard<std::mutex> lock(g_handle_mutex);  // one stream per handle at a time
    const cudnnStatus_t status = fe::detail::set_stream(plan.handle, stream);
    if (status != CUDNN_STATUS_SUCCESS) {
      return ffi::Error::Internal(std::string(op) + ": cudnnSetStream failed: " +
                                  fe::detail::get_error_string(status));
    }
    void* cudnn_workspace = plan.entry->workspace > 0 ? base + plan.stats_bytes : nullptr;
    fe::error_t e = plan.entry->graph->execute(plan.handle, pack, cudnn_workspace);
    if (e.is_bad()) return ffi::Error::Internal(std::string(op) + ": cuDNN execute failed: " + e.get_message());
  } catch (const std::exception& x) {
    return ffi::Error::Internal(std::string(op) + ": cuDNN execute threw: " + x.what());
  }
  return ffi::Error::Success();
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
  return static_cast<int64_t>(fusedattn_cudnn::g_cudnn_version);
}

// The graph parameters of the exports: b, h, hkv, sq, skv, d, dv, bf16, causal, bottom_right,
// left, right, segments, ragged, seg_sq, seg_skv, bias_b, bias_h, sink, alibi, deterministic
// (21 values, the Params fields the handlers read off their operands and attributes).
static std::string read_params(const int64_t* params, int64_t n, float scale, float dropout,
                               fusedattn_cudnn::Params* p) {
  constexpr int kCount = 21;
  if (n != kCount) {
    return "expected " + std::to_string(kCount) + " graph parameters, got " + std::to_string(n);
  }
  int64_t* fields[kCount] = {&p->b,      &p->h,     &p->hkv,    &p->sq,     &p->skv,    &p->d,
                             &p->dv,     &p->bf16,  &p->causal, &p->bottom_right,       &p->left,
                             &p->right,  &p->segments,          &p->ragged, &p->seg_sq, &p->seg_skv,
                             &p->bias_b, &p->bias_h,            &p->sink,   &p->alibi,  &p->deterministic};
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
