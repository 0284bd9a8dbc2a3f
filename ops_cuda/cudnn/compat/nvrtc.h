// A minimal stand-in for NVRTC's nvrtc.h, used only when the CUDA toolkit at
// build time has no nvrtc.h (CMake adds this directory to the include path
// then, and only then).
//
// The cuDNN frontend includes <nvrtc.h> for an experimental Blackwell engine
// that this project never uses. Built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING,
// the frontend calls NVRTC only through dlsym'd pointers typed by these
// declarations, so nothing here is linked. Prototypes copied from CUDA 13's
// nvrtc.h.
#ifndef FUSEDATTN_COMPAT_NVRTC_H_
#define FUSEDATTN_COMPAT_NVRTC_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  NVRTC_SUCCESS = 0,
  NVRTC_ERROR_OUT_OF_MEMORY = 1,
  NVRTC_ERROR_PROGRAM_CREATION_FAILURE = 2,
  NVRTC_ERROR_INVALID_INPUT = 3,
  NVRTC_ERROR_INVALID_PROGRAM = 4,
  NVRTC_ERROR_INVALID_OPTION = 5,
  NVRTC_ERROR_COMPILATION = 6,
  NVRTC_ERROR_BUILTIN_OPERATION_FAILURE = 7,
  NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION = 8,
  NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION = 9,
  NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID = 10,
  NVRTC_ERROR_INTERNAL_ERROR = 11
} nvrtcResult;

typedef struct _nvrtcProgram *nvrtcProgram;

const char *nvrtcGetErrorString(nvrtcResult result);
nvrtcResult nvrtcVersion(int *major, int *minor);
nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src, const char *name, int numHeaders,
                               const char *const *headers, const char *const *includeNames);
nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog);
nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int numOptions, const char *const *options);
nvrtcResult nvrtcGetPTXSize(nvrtcProgram prog, size_t *ptxSizeRet);
nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char *ptx);
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t *cubinSizeRet);
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin);
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t *logSizeRet);
nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char *log);

#ifdef __cplusplus
}
#endif

#endif  // FUSEDATTN_COMPAT_NVRTC_H_
