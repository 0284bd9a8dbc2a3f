// The Hopper flash forward for head dim 128 (see kernels.cuh).
#include "kernels.cuh"

namespace fusedattn {
namespace flash {
namespace sm90 {

template std::string launch_forward<128>(gpuStream_t, const FlashArgs&, ElementType);

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn
