// Definitions of the launchers of launch.h (included by flash_d<D>.cu only).
#ifndef FUSEDATTN_FLASH_KERNELS_CUH_
#define FUSEDATTN_FLASH_KERNELS_CUH_

#include "backward.cuh"
#include "forward.cuh"
#include "launch.h"

namespace fusedattn {
namespace flash {

// Launches kernel<<<blocks, threads, shared_bytes>>>(a), raising its dynamic shared-memory limit first.
template <typename Kernel>
void launch(Kernel kernel, int64_t blocks, int threads, int shared_bytes, gpuStream_t stream, const FlashArgs& a) {
  if (blocks == 0) return;
  // Always: a kernel's static shared memory counts against the default 48 KB as well. A
  // failure here fails the launch below, which the handler reports.
  (void)gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), gpuFuncAttributeMaxDynamicSharedMemorySize,
                            shared_bytes);
  kernel<<<static_cast<unsigned>(blocks), threads, shared_bytes, stream>>>(a);
}

template <ElementType ET, int D>
void forward(gpuStream_t stream, const FlashArgs& a) {
  using T = ForwardTiles<D>;
  static_assert(T::kSharedBytes <= kMaxDynamicSharedBytes, "the forward's tiles exceed the shared memory");
  const int64_t blocks = (a.p.seqlen_q + T::kM - 1) / T::kM * a.p.heads * a.p.batch;
  launch(a.p.bias_type != kBiasNone ? forward_kernel<ET, D, false, true>
         : a.p.alibi                 ? forward_kernel<ET, D, true>
                                     : forward_kernel<ET, D, false>,
         blocks, T::kThreads, T::kSharedBytes, stream, a);
}

// What every backward runs first (the sm_80 kernels and the sm_90a one): a.delta =
// rowsum(dO o O), and a.d_offset (the learnable softmax's gradient; zeros otherwise); `zero`
// (zero_floats float32, a multiple of 4, 16-byte aligned: the sm_90a dQ accumulator) is
// cleared by the same kernel.
template <ElementType ET, int D>
void backward_prologue(gpuStream_t stream, const FlashArgs& a, float* zero = nullptr, int64_t zero_floats = 0) {
  const AttentionParams& p = a.p;
  const int64_t rows = p.batch * p.seqlen_q * p.heads;
  const int64_t rows_per_block = kDeltaThreads / (D / 8);
  const int64_t blocks = std::min((rows + rows_per_block - 1) / rows_per_block, kDeltaMaxBlocks);
  if (blocks > 0) {
    softmax_delta_kernel<ET, D><<<static_cast<unsigned>(blocks), kDeltaThreads, 0, stream>>>(
        a, reinterpret_cast<float4*>(zero), zero_floats / 4);
  }
  if (p.softmax_type == kSoftmaxLearnable) {
    launch_sink_gradient(stream, a);
  } else {
    (void)gpuMemsetAsync(a.d_offset, 0, sizeof(float) * p.batch * p.heads, stream);  // errors: launch_status
  }
}

// The backward's kernels. With a bias array whose gradient is wanted (a.bias_terms not
// null), d_bias [Bb, Hb, Sq, Skv]: a.bias_terms (clear_bias_terms first) is, unless it is
// d_bias itself (bias_gradient_direct), summed into it last.
template <ElementType ET, int D>
void backward(gpuStream_t stream, const FlashArgs& a, float* d_bias) {
  const AttentionParams& p = a.p;
  const bool bias = p.bias_type != kBiasNone;
  const bool bias_gradient = a.bias_terms != nullptr;  // wanted by the caller
  if (bias_gradient) clear_bias_terms(stream, a);
  backward_prologue<ET, D>(stream, a);
  using KV = DkDvTiles<D>;
  using Q = DqTiles<D>;
  static_assert(KV::kSharedBytes <= kMaxDynamicSharedBytes && Q::kSharedBytes <= kMaxDynamicSharedBytes,
                "the backward's tiles exceed the shared memory");
  const int64_t kv_blocks = (p.seqlen_kv + KV::kN - 1) / KV::kN * p.kv_heads * p.batch * (D / KV::kOut);
  launch(bias      ? dkdv_kernel<ET, D, false, true>
         : p.alibi ? dkdv_kernel<ET, D, true>
                   : dkdv_kernel<ET, D, false>,
         kv_blocks, KV::kThreads, KV::kSharedBytes, stream, a);
  const int64_t q_blocks = (p.seqlen_q + Q::kM - 1) / Q::kM * p.heads * p.batch;
  launch(bias      ? dq_kernel<ET, D, false, true>
         : p.alibi ? dq_kernel<ET, D, true>
                   : dq_kernel<ET, D, false>,
         q_blocks, Q::kThreads, Q::kSharedBytes, stream, a);
  if (p.alibi) launch_slope_gradient(stream, a);  // a.slope_slots: sm80_slope_slots, every slot written
  if (bias_gradient && !bias_gradient_direct(p)) launch_bias_gradient_sum(stream, a, d_bias);
}

template <int D>
void launch_forward(gpuStream_t stream, const FlashArgs& a, ElementType type) {
  if (type == ElementType::kBF16) {
    forward<ElementType::kBF16, D>(stream, a);
  } else {
    forward<ElementType::kF16, D>(stream, a);
  }
}

template <int D>
void launch_backward(gpuStream_t stream, const FlashArgs& a, ElementType type, float* d_bias) {
  if (type == ElementType::kBF16) {
    backward<ElementType::kBF16, D>(stream, a, d_bias);
  } else {
    backward<ElementType::kF16, D>(stream, a, d_bias);
  }
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_KERNELS_CUH_
