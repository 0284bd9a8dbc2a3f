// The Hopper flash backward for head dim 64 (see kernels.cuh).
#include "kernels.cuh"

namespace fusedattn {
namespace flash {
namespace sm90 {

template std::string launch_backward<64>(gpuStream_t, const FlashArgs&, ElementType, float*, float*);

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn
