// Definitions of sm90::launch_forward and sm90::launch_backward (launch.h), included by
// forward_d<D>.cu and backward_d<D>.cu only.
#ifndef FUSEDATTN_FLASH_SM90_KERNELS_CUH_
#define FUSEDATTN_FLASH_SM90_KERNELS_CUH_

#include "../kernels.cuh"
#include "backward.cuh"
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
  if (error.empty()) error = encode_tile_map(&args.o_map, a.o, p.batch, p.seqlen_q, p.heads, D, T::kConsumerRows);
  if (!error.empty()) return error;
  // Persistent: at most one block per SM (one fits), each taking work items in turn.
  const int64_t items = (p.seqlen_q + T::kM - 1) / T::kM * p.heads * p.batch;
  if (items == 0) return "";
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    return "the flash forward could not read the device's SM count";
  }
  const int64_t blocks = std::min<int64_t>(items, sms);
  // An instance per (ALiBi or a bias array, dropout): the loop without dropout has no branch
  // after its exponentials, so that packing the weights interleaves with them.
  const bool bias = p.bias_type != kBiasNone;
  const auto kernel = bias      ? (p.dropout ? forward_kernel<ET, D, false, true, true> : forward_kernel<ET, D, false, false, true>)
                      : p.alibi ? (p.dropout ? forward_kernel<ET, D, true, true> : forward_kernel<ET, D, true, false>)
                                : (p.dropout ? forward_kernel<ET, D, false, true> : forward_kernel<ET, D, false, false>);
  gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), gpuFuncAttributeMaxDynamicSharedMemorySize,
                      T::kSharedBytes);
  kernel<<<static_cast<unsigned>(blocks), T::kThreads, T::kSharedBytes, stream>>>(args);
  return "";
}

template <int D>
std::string launch_forward(gpuStream_t stream, const FlashArgs& a, ElementType type) {
  return type == ElementType::kBF16 ? sm90::forward<ElementType::kBF16, D>(stream, a)
                                    : sm90::forward<ElementType::kF16, D>(stream, a);
}

// With a bias array whose gradient is wanted (a.bias_terms not null), d_bias [Bb, Hb, Sq, Skv]:
// a.bias_terms (clear_bias_terms first) is, unless it is d_bias itself, summed into it last.
template <ElementType ET, int D>
std::string backward(gpuStream_t stream, const FlashArgs& a, float* dq_accum, float* d_bias) {
  using T = BackwardTiles<D>;
  const AttentionParams& p = a.p;
  BackwardArgs args;
  args.a = a;
  args.dq_accum = dq_accum;
  std::string error = encode_tile_map(&args.q_map, a.q, p.batch, p.seqlen_q, p.heads, D, T::kM);
  if (error.empty()) error = encode_tile_map(&args.do_map, a.dout, p.batch, p.seqlen_q, p.heads, D, T::kM);
  if (error.empty()) error = encode_tile_map(&args.k_map, a.k, p.batch, p.seqlen_kv, p.kv_heads, D, T::kN);
  if (error.empty()) error = encode_tile_map(&args.v_map, a.v, p.batch, p.seqlen_kv, p.kv_heads, D, T::kN);
  if (error.empty()) {
    error = encode_tile_map(&args.dk_map, a.dk, p.batch, p.seqlen_kv, p.kv_heads, D, T::kConsumerKeys);
  }
  if (error.empty()) {
    error = encode_tile_map(&args.dv_map, a.dv, p.batch, p.seqlen_kv, p.kv_heads, D, T::kConsumerKeys);
  }
  if (!error.empty()) return error;
  const int64_t floats = dq_accum_floats(p.batch, p.heads, p.seqlen_q, D);
  flash::backward_prologue<ET, D>(stream, a, dq_accum, floats);  // also clears dq_accum
  // A query head that no query tile of a key block reaches leaves that block's slots unwritten.
  if (p.alibi) gpuMemsetAsync(a.slope_partials, 0, sizeof(float) * p.batch * p.heads * a.slope_slots, stream);
  const bool bias = p.bias_type != kBiasNone;
  const bool bias_gradient = a.bias_terms != nullptr;  // wanted by the caller
  if (bias_gradient) clear_bias_terms(stream, a);
  const int64_t blocks = (p.seqlen_kv + T::kN - 1) / T::kN * p.kv_heads * p.batch;
  if (blocks > 0) {
    const auto kernel =
        bias      ? (p.dropout ? backward_kernel<ET, D, true, false, true> : backward_kernel<ET, D, false, false, true>)
        : p.alibi ? (p.dropout ? backward_kernel<ET, D, true, true> : backward_kernel<ET, D, false, true>)
                  : (p.dropout ? backward_kernel<ET, D, true, false> : backward_kernel<ET, D, false, false>);
    gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), gpuFuncAttributeMaxDynamicSharedMemorySize,
                        T::kSharedBytes);
    kernel<<<static_cast<unsigned>(blocks), T::kThreads, T::kSharedBytes, stream>>>(args);
  }
  if (p.alibi) flash::launch_slope_gradient(stream, a);  // a.slope_slots: slope_slots(Skv, D)
  if (bias_gradient && !bias_gradient_direct(p)) launch_bias_gradient_sum(stream, a, d_bias);
  const int64_t convert_blocks = std::min<int64_t>(floats / DqAccumulator<D>::kBlockFloats, 65536);
  if (convert_blocks > 0) {
    dq_convert_kernel<ET, D><<<static_cast<unsigned>(convert_blocks), 256, 0, stream>>>(dq_accum, a.dq, p);
  }
  return "";
}

template <int D>
std::string launch_backward(gpuStream_t stream, const FlashArgs& a, ElementType type, float* dq_accum,
                            float* d_bias) {
  return type == ElementType::kBF16 ? sm90::backward<ElementType::kBF16, D>(stream, a, dq_accum, d_bias)
                                    : sm90::backward<ElementType::kF16, D>(stream, a, dq_accum, d_bias);
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_KERNELS_CUH_
