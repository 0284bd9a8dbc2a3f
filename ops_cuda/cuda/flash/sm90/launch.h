// Launchers of the Hopper (sm_90a) flash kernels (forward.cuh), one source per head dim
// (forward_d<D>.cu); built when 90 is in FUSEDATTN_CUDA_ARCHS (FUSEDATTN_FLASH_SM90).
#ifndef FUSEDATTN_FLASH_SM90_LAUNCH_H_
#define FUSEDATTN_FLASH_SM90_LAUNCH_H_

#include <string>

#include "../params.cuh"
#include "fusedattn/gpu_runtime.h"
#include "fusedattn/portability.h"

namespace fusedattn {
namespace flash {
namespace sm90 {

// Launches the forward of head dim D on a device of compute capability 9.0 (a.spans
// summarised on the same stream first). Returns "" or why it could not launch (the
// driver refused a TMA descriptor); kernel errors surface through the stream's last error.
template <int D>
std::string launch_forward(gpuStream_t stream, const FlashArgs& a, ElementType type);

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_LAUNCH_H_
