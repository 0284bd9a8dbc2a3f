// cuDNN handles (one per device), the graph cache (one graph per Params::Key, built on
// first use, failures cached too) and running a cached graph with the workspace XLA
// allocated: the handlers allocate nothing, so they declare themselves command-buffer
// compatible and XLA can trace them into its CUDA graphs with the kernels around.
#include <map>
#include <mutex>

#include "cudnn_common.h"

namespace fusedattn_cudnn {
namespace {

std::string key_string(const Params::Key& key) {
  std::string s;
  for (int64_t x : key) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

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

std::mutex g_cache_mutex;
std::map<Params::Key, std::shared_ptr<Entry>> g_cache;

std::string fe_error(const char* stage, fe::error_t e) { return std::string(stage) + ": " + e.get_message(); }

std::shared_ptr<fe::graph::Graph> make_graph(const Params& p, bool backward) {
  if (p.fp8 != kNoFp8) return backward ? fp8_backward_graph(p) : fp8_forward_graph(p);
  return backward ? backward_graph(p) : forward_graph(p);
}

std::shared_ptr<Entry> build(const Params& p, bool backward, cudnnHandle_t handle) {
  auto entry = std::make_shared<Entry>();
  try {
    trace(std::string("building ") + (backward ? "backward" : "forward") + " graph " + key_string(p.key(-1, backward)));
    auto g = make_graph(p, backward);
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

}  // namespace

std::shared_ptr<Entry> get_graph(const Params& params, bool backward, int device, cudnnHandle_t* handle_out,
                                 std::string* error) {
  if (cudnn_version() == 0) {
    *error = "libcudnn is not loaded (FusedattnCudnnLoad was not called or failed)";
    return nullptr;
  }
  cudnnHandle_t handle = nullptr;
  if (std::string e = get_handle(device, &handle); !e.empty()) {
    *error = e;
    return nullptr;
  }
  *handle_out = handle;
  Params p = params;
  if (!backward && p.fp8 != kNoFp8) p.fp8 = kFp8E4m3;  // the FP8 forward is E4M3 in both formats
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

ffi::Error invalid(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

std::string dims_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool is_int32(const ffi::AnyBuffer& x, int64_t count) {
  return x.element_type() == ffi::DataType::S32 && static_cast<int64_t>(x.element_count()) == count;
}

ffi::Error read_shapes(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       Params* p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return invalid(op, "q, k and v must have shape [B, S, H, D]; got " + dims_string(qd) + ", " +
                           dims_string(kd) + ", " + dims_string(vd));
  }
  p->b = qd[0], p->sq = qd[1], p->h = qd[2], p->d = qd[3];
  p->skv = kd[1], p->hkv = kd[2], p->dv = vd[3];
  if (kd[0] != p->b || vd[0] != p->b || kd[3] != p->d || vd[1] != p->skv || vd[2] != p->hkv || p->hkv < 1 ||
      p->h % p->hkv != 0) {
    return invalid(op, "inconsistent q/k/v shapes " + dims_string(qd) + ", " + dims_string(kd) + ", " +
                           dims_string(vd));
  }
  p->seg_sq = p->sq;
  p->seg_skv = p->skv;
  return ffi::Error::Success();
}

ffi::Error execute(const char* op, const Params& p, bool backward, cudaStream_t stream, int device,
                   ffi::AnyBuffer workspace, Pack& pack) {
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

}  // namespace fusedattn_cudnn
