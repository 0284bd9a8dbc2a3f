// TMA descriptors (tensor_map.h), encoded through the driver entry point that the CUDA
// runtime hands out, so that the library does not link the driver library itself.
#include "tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

namespace fusedattn {
namespace flash {
namespace sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder(std::string* error) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  if (fn == nullptr) *error = "the CUDA driver offers no cuTensorMapEncodeTiled (driver older than CUDA 12.0?)";
  return fn;
}

}  // namespace

std::string encode_tile_map(CUtensorMap* map, const uint16_t* data, int64_t batch, int64_t seqlen, int64_t heads,
                            int64_t head_dim, int rows) {
  std::string error;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder(&error);
  if (encode == nullptr) return error;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seqlen), static_cast<cuuint64_t>(batch)};
  const cuuint64_t element = 2;
  const cuuint64_t strides[3] = {head_dim * element, heads * head_dim * element, seqlen * heads * head_dim * element};
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<uint16_t*>(data), dims, strides, box,
                            unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return "cuTensorMapEncodeTiled refused [" + std::to_string(batch) + ", " + std::to_string(seqlen) + ", " +
           std::to_string(heads) + ", " + std::to_string(head_dim) + "] at " +
           std::to_string(reinterpret_cast<uintptr_t>(data)) + " (CUresult " + std::to_string(static_cast<int>(r)) +
           "; the operands must be 16-byte aligned)";
  }
  return "";
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn
