// The small_seq kernels' launchers, one translation unit per head dim
// (small_seq_d{64,128,256,512}.cu, from small_seq_kernels.cuh), called by the FFI
// handlers of small_seq.cu.
#ifndef FUSEDATTN_CUDA_SMALL_SEQ_LAUNCH_H_
#define FUSEDATTN_CUDA_SMALL_SEQ_LAUNCH_H_

#include <cstdint>

#include "fusedattn/gpu_runtime.h"
#include "fusedattn/small_seq.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {

// The operands and results of fusedattn/small_seq.h, in its order.
struct SmallSeqForwardBuffers {
  xla::ffi::AnyBuffer q, k, v, kv_start, kv_len, seed;
  xla::ffi::Result<xla::ffi::AnyBuffer> o, lse;
};

struct SmallSeqBackwardBuffers {
  xla::ffi::AnyBuffer q, k, v, kv_start, kv_len, seed, o, lse, dout;
  xla::ffi::Result<xla::ffi::AnyBuffer> dq, dk, dv;
};

// The backward's per-team staging of a block (the dS and dropped P of a group's heads) stays
// under this: blocks shrink, down to one team, until it fits.
constexpr int64_t kSmallSeqMaxStagingBytes = 48 * 1024;

// Launch the kernels of head dim D (64, 128, 256 or 512) for `dtype` (q's element type), the
// key bound p.max_keys and p.dropout; the caller reads the launch status.
template <int D>
void launch_small_seq_forward(gpuStream_t stream, const SmallSeqParams& p, xla::ffi::DataType dtype,
                              SmallSeqForwardBuffers buffers);

template <int D>
void launch_small_seq_backward(gpuStream_t stream, const SmallSeqParams& p, xla::ffi::DataType dtype,
                               SmallSeqBackwardBuffers buffers);

}  // namespace fusedattn

#endif  // FUSEDATTN_CUDA_SMALL_SEQ_LAUNCH_H_
