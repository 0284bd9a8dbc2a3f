// Loading libcudnn at run time (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: no link-time
// dependency): FusedattnCudnnLoad() dlopens the libcudnn.so.9 that JAX's CUDA plugin
// already loaded (or a path given by Python) and hands it to the frontend. Also the
// diagnostics: FUSEDATTN_CUDNN_TRACE=1 traces graph builds and prints the native stack
// of a crash.
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "cudnn_common.h"

// The frontend's dynamic loader resolves every cuDNN symbol through this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace fusedattn_cudnn {

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

namespace {

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

std::mutex g_load_mutex;
size_t g_cudnn_version = 0;  // nonzero once loaded

}  // namespace

size_t cudnn_version() { return g_cudnn_version; }

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

}  // namespace fusedattn_cudnn
