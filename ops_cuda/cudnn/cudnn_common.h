// What the cuDNN backend's sources share (libfusedattn_cudnn, ops_cuda/cudnn/*.cc):
// the static description of a call (Params, the graph cache's key), the tensor uids,
// the graph cache and the runner of a cached graph.
//
//   cudnn_load.cc         loading libcudnn, tracing (FUSEDATTN_CUDNN_TRACE=1)
//   cudnn_graph_cache.cc  cuDNN handles, building and caching graphs, running one
//   cudnn_graphs.cc       the bf16/fp16 forward and backward graphs, shared tensor helpers
//   cudnn_fp8.cc          the FP8 forward and backward graphs and their FFI handlers
//   cudnn_sdpa.cc         the bf16/fp16 FFI handlers and the ctypes exports
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "xla/ffi/api/ffi.h"

#define FA_CUDNN_EXPORT extern "C" __attribute__((visibility("default")))

namespace fusedattn_cudnn {

namespace ffi = xla::ffi;
namespace fe = cudnn_frontend;

// ---- diagnostics and loading (cudnn_load.cc) ----------------------------------

bool tracing();
void trace(const std::string& what);
// Loads libcudnn (path, or the libcudnn.so.9 already loaded when null/empty); "" or why not.
std::string load_cudnn(const char* path);
size_t cudnn_version();  // nonzero once loaded

// ---- the static description of one call ---------------------------------------

// FP8 graphs (Params::fp8): none, every tensor E4M3, or E5M2 for dO and dP (the backward).
enum Fp8 : int64_t { kNoFp8 = 0, kFp8E4m3 = 1, kFp8Hybrid = 2 };

struct Params {
  int64_t b = 0, h = 0, hkv = 0, sq = 0, skv = 0, d = 0, dv = 0;
  int64_t bf16 = 1;  // 1 bfloat16, 0 float16 (bf16/fp16 graphs)
  int64_t causal = 0, bottom_right = 0, left = -1, right = -1;
  int64_t segments = 0, ragged = 0;  // segments > 0: padding, cuDNN batch b * segments
  int64_t seg_sq = 0, seg_skv = 0;   // cuDNN's sequence extents: sq, skv unless ragged bounds
  int64_t bias_b = 0, bias_h = 0;  // 0, 0: no bias
  int64_t sink = 0, alibi = 0, deterministic = 0;
  int64_t fp8 = kNoFp8;   // Fp8: the FP8 graphs (cudnn_fp8.cc) instead of the bf16/fp16 ones
  int64_t inference = 0;  // forward only: 1 builds the graph without stats (training = false)
  float scale = 1.0f, dropout = 0.0f;

  // Everything that shapes a graph, with the device and direction: the cache key. Built
  // on every call, so plain integers (the floats by their bits), not a formatted string.
  using Key = std::array<int64_t, 27>;
  Key key(int device, bool backward) const {
    return {backward, device, b, h, hkv, sq, skv, d, dv, bf16, causal, bottom_right, left, right, segments,
            ragged, seg_sq, seg_skv, bias_b, bias_h, sink, alibi, deterministic, fp8, inference, bits(scale),
            bits(dropout)};
  }

 private:
  static int64_t bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
  }
};

// Graph tensor uids (the keys of a variant pack).
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kBias, kSeqQ, kSeqKv, kSeed, kOffset, kSink,
  kDO, kDQ, kDK, kDV, kDBias, kDSink, kOffQ, kOffO, kOffK, kOffV,
  // FP8 scalars (float32 [1]): descales (1 / scale) of the FP8 operands, scales of the FP8
  // results, and the results' amaxes.
  kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kDescaleO, kDescaleDO, kDescaleDP,
  kScaleS, kScaleO, kScaleDQ, kScaleDK, kScaleDV, kScaleDP,
  kAmaxS, kAmaxO, kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP,
};

using Tensor = std::shared_ptr<fe::graph::Tensor_attributes>;
using Pack = std::unordered_map<int64_t, void*>;

// cuDNN's batch: one entry per segment slot under padding, else one per row.
inline int64_t cudnn_batch(const Params& p) { return p.segments > 0 ? p.b * p.segments : p.b; }

// ---- graph builders (cudnn_graphs.cc, cudnn_fp8.cc) ---------------------------

std::shared_ptr<fe::graph::Graph> forward_graph(const Params& p);
std::shared_ptr<fe::graph::Graph> backward_graph(const Params& p);
std::shared_ptr<fe::graph::Graph> fp8_forward_graph(const Params& p);
std::shared_ptr<fe::graph::Graph> fp8_backward_graph(const Params& p);

// Shared tensor helpers (cudnn_graphs.cc).
// Element offsets of the segments' first tokens in q, o, k and v (null unless ragged).
struct RaggedOffsets {
  Tensor q, o, k, v;
};
RaggedOffsets ragged_offsets(fe::graph::Graph& g, const Params& p);
// A row-major [b, s, heads, dim] operand as cuDNN's [batch, heads, s, dim] view.
Tensor bshd(fe::graph::Graph& g, const char* name, Uid uid, const Params& p, const Tensor& offsets,
            int64_t heads, int64_t s, int64_t dim);
// Marks a graph result as the output `uid` with that view.
void set_bshd(const Tensor& t, Uid uid, const Params& p, const Tensor& offsets, int64_t heads, int64_t s,
              int64_t dim);
// The q, k and v operands of a graph, created in that order.
std::array<Tensor, 3> qkv_tensors(fe::graph::Graph& g, const Params& p, const RaggedOffsets& offsets);
// The stats operand (float32 [batch, h, seg_sq, 1]) and the marking of the stats result.
Tensor stats_tensor(fe::graph::Graph& g, const Params& p);
void set_stats_output(const Tensor& stats, const Params& p);
// cuDNN's per-entry sequence lengths (int32 [cudnn_batch]) under padding.
Tensor seqlen_tensor(fe::graph::Graph& g, const char* name, Uid uid, const Params& p);
// A float32 [1] scalar operand, and the marking of a float32 [1] scalar result.
Tensor scalar_float(fe::graph::Graph& g, const char* name, Uid uid);
void set_scalar_output(const Tensor& t, Uid uid);

// Attention scale, mask, sliding window and padding: the same for every graph (a template:
// the bf16/fp16 and the FP8 attribute classes of both directions have these setters).
template <typename Attributes>
void set_mask(fe::graph::Graph& g, Attributes& a, const Params& p) {
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
    a.set_padding_mask(true)
        .set_seq_len_q(seqlen_tensor(g, "seqlen_q", kSeqQ, p))
        .set_seq_len_kv(seqlen_tensor(g, "seqlen_kv", kSeqKv, p));
  }
}

// ---- the graph cache and running a graph (cudnn_graph_cache.cc) ---------------

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;  // null when unsupported
  int64_t workspace = 0;
  std::string error;  // why the graph cannot be built
};

// The cached graph of `p` on `device` (built on first use; failures are cached too), or
// null with *error set when no handle or libcudnn.
std::shared_ptr<Entry> get_graph(const Params& p, bool backward, int device, cudnnHandle_t* handle_out,
                                 std::string* error);

// The graph a call runs, and the workspace it needs (the FFI call's workspace result).
// Where cuDNN cannot build the forward without stats, the training forward stands in,
// its stats at the start of the workspace.
struct CallPlan {
  std::shared_ptr<Entry> entry;
  cudnnHandle_t handle = nullptr;
  int64_t stats_bytes = 0;  // the stand-in's stats, then cuDNN's workspace from stats_bytes
  int64_t workspace_bytes() const { return stats_bytes + entry->workspace; }
};

// Fills *plan, or returns why the call cannot run.
std::string plan_call(const Params& p, bool backward, int device, CallPlan* plan);

// Runs the call's graph on `stream` with `workspace` (the FFI call's uint8 result, sized by
// FusedattnCudnnWorkspace) and the device pointers of `pack` (by uid).
ffi::Error execute(const char* op, const Params& p, bool backward, cudaStream_t stream, int device,
                   ffi::AnyBuffer workspace, Pack& pack);

// ---- FFI helpers (cudnn_graph_cache.cc) ----------------------------------------

ffi::Error invalid(const char* op, const std::string& message);
std::string dims_string(ffi::AnyBuffer::Dimensions dims);
bool is_int32(const ffi::AnyBuffer& x, int64_t count);
// Reads the [B, S, H, D] shapes of q, k and v into *p (the dtype is the caller's to check).
ffi::Error read_shapes(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       Params* p);

}  // namespace fusedattn_cudnn
