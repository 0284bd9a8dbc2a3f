// Definition of sm90::launch_forward (launch.h), included by forward_d<D>.cu only.
#ifndef FUSEDATTN_FLASH_SM90_KERNELS_CUH_
#define FUSEDATTN_FLASH_SM90_KERNELS_CUH_

#include "forward.cuh"
#include "launch.h"
#include "tensor_map.h"

namespace fusedattn {
namespace flash {
namespace sm90 {

template <ElementType ET, int D>
std::string forward(gpuStream_t stream, const FlashArgs& a) {
  using T = ForwardTiles<D>;
  const AttentionParams& p = a.p;
  ForwardArgs args;
  args.a = a;
  std::string error = encode_tile_map(&args.q_map, a.q, p.batch, p.seqlen_q, p.heads, D, T::kM);
  if (error.empty()) error = encode_tile_map(&args.k_map, a.k, p.batch, p.seqlen_kv, p.kv_heads, D, T::kN);
  if (error.empty()) error = encode_tile_map(&args.v_map, a.v, p.batch, p.seqlen_kv, p.kv_heads, D, T::kN);
  if (!error.empty()) return error;
  const int64_t blocks = (p.seqlen_q + T::kM - 1) / T::kM * p.heads * p.batch;
  if (blocks == 0) return "";
  const auto kernel = forward_kernel<ET, D>;
  gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), gpuFuncAttributeMaxDynamicSharedMemorySize,
                      T::kSharedBytes);
  kernel<<<static_cast<unsigned>(blocks), T::kThreads, T::kSharedBytes, stream>>>(args);
  return "";
}

template <int D>
std::string launch_forward(gpuStream_t stream, const FlashArgs& a, ElementType type) {
  return type == ElementType::kBF16 ? forward<ElementType::kBF16, D>(stream, a)
                                    : forward<ElementType::kF16, D>(stream, a);
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_KERNELS_CUH_
