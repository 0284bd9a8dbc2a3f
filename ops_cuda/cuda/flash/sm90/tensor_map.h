// TMA descriptors of the kernels' BSHD operands (host side).
#ifndef FUSEDATTN_FLASH_SM90_TENSOR_MAP_H_
#define FUSEDATTN_FLASH_SM90_TENSOR_MAP_H_

#include <cuda.h>

#include <cstdint>
#include <string>

namespace fusedattn {
namespace flash {
namespace sm90 {

// Describes data [batch, seqlen, heads, head_dim] of 16-bit elements as a 4-d tensor
// (head_dim, heads, seqlen, batch) read in boxes of (64, 1, rows, 1), 128-byte swizzled,
// elements outside the tensor read as zero. Returns "" or the driver's refusal.
std::string encode_tile_map(CUtensorMap* map, const uint16_t* data, int64_t batch, int64_t seqlen, int64_t heads,
                            int64_t head_dim, int rows);

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_TENSOR_MAP_H_
