// The Hopper flash backward for head dim 128 (see kernels.cuh).
#include "kernels.cuh"

namespace fusedattn {
namespace flash {
namespace sm90 {

template std::string launch_backward<128>(gpuStream_t, const FlashArgs&, ElementType, float*, float*);

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn
