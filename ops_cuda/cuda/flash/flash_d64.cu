// The flash kernels for head dim 64 (see kernels.cuh).
#include "kernels.cuh"

namespace fusedattn {
namespace flash {

template void launch_forward<64>(gpuStream_t, const FlashArgs&, ElementType);
template void launch_backward<64>(gpuStream_t, const FlashArgs&, ElementType, float*);

}  // namespace flash
}  // namespace fusedattn
