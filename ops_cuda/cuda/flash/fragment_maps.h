// The lane maps of the flash kernels' matrix-core fragments, as constexpr functions that
// compile for the host as well (tests/test_flash_fragment_maps.py builds them into a host
// program and checks them without a GPU); the device headers mma.cuh (NVIDIA) and mfma.cuh
// (AMD) take every lane -> (row, column) index of their operands and accumulators from here.
//
// The kernels' shared text (softmax, masking, dropout, the backward's dS, the stores) sees
// a warp's accumulators as float acc[t][e]: tiles t of kWarpRows rows x 8 columns, four
// elements e per lane and tile, the elements of one row adjacent columns:
//
//   NVIDIA (mma.sync m16n8k16, 32 lanes): 16 x 8 tiles; lane l holds rows l/4 and l/4 + 8,
//     columns 2 (l % 4) and 2 (l % 4) + 1 of each: e / 2 picks the row, e % 2 the column.
//   AMD (MFMA 32x32x8, wave64): 32 x 8 tiles; lane l holds row l % 32, columns
//     4 (l / 32) .. 4 (l / 32) + 3: one row, e the column.
//
// On AMD a warp's product X Y^T (rows of X: the fragment's rows) is issued as the MFMA
// C = Y X^T, whose lane l holds column l % 32 of C, i.e. row l % 32 of the product: MFMA
// item r (0 .. 15) of 32-column block `block` is fragment tile 4 block + r / 4, element
// r % 4. The same fragment, packed to 16 bits, is the B operand (k = 4 (l / 32) + i) of
// the next product with the fragment's columns as its depth (P V, dS K, ...).
#ifndef FUSEDATTN_FLASH_FRAGMENT_MAPS_H_
#define FUSEDATTN_FLASH_FRAGMENT_MAPS_H_

#include "fusedattn/portability.h"

namespace fusedattn {
namespace flash {

// NVIDIA mma.sync.m16n8k16 (PTX ISA "Matrix Fragments for mma.m16n8k16"), 32 lanes.
namespace mma_sync_map {

constexpr int kLanes = 32;
constexpr int kWarpRows = 16;  // rows of a warp's fragment
constexpr int kLaneRows = 2;   // rows a lane holds in a tile
// Lanes holding the same fragment row: lane ^ m for m in [kRowLaneMaskLow, kRowLaneMaskHigh] (powers of 2).
constexpr int kRowLaneMaskLow = 1, kRowLaneMaskHigh = 2;
constexpr int kRowLaneStride = 4;  // lane + 4 holds the next row (c_row: lane / 4)

// Accumulator C/D (16 x 8): element e (0 .. 3) of lane l.
FA_HOST_DEVICE constexpr int c_row(int lane, int e) { return lane / 4 + 8 * (e / 2); }
FA_HOST_DEVICE constexpr int c_col(int lane, int e) { return 2 * (lane % 4) + e % 2; }

// A (16 x 16, rows x depth): 16-bit half h (0 low, 1 high) of register r (0 .. 3); the row
// does not depend on h, nor B's column on r or h.
FA_HOST_DEVICE constexpr int a_row(int lane, int r) { return lane / 4 + 8 * (r % 2); }
FA_HOST_DEVICE constexpr int a_depth(int lane, int r, int h) { return 2 * (lane % 4) + h + 8 * (r / 2); }

// B (16 x 8, depth x columns): half h of register r (0 .. 1).
FA_HOST_DEVICE constexpr int b_depth(int lane, int r, int h) { return 2 * (lane % 4) + h + 8 * r; }
FA_HOST_DEVICE constexpr int b_col(int lane) { return lane / 4; }

}  // namespace mma_sync_map

// AMD MFMA v_mfma_f32_32x32x8{bf16_1k,f16} (CDNA2/CDNA3 ISA, one block), 64 lanes.
namespace mfma_map {

constexpr int kLanes = 64;
constexpr int kWarpRows = 32;
constexpr int kLaneRows = 1;
constexpr int kRowLaneMaskLow = 32, kRowLaneMaskHigh = 32;
constexpr int kRowLaneStride = 1;  // lane + 1 holds the next row (frag_row: lane % 32)
constexpr int kBlock = 32;  // rows and columns of one MFMA
constexpr int kDepth = 8;   // depth of one MFMA
constexpr int kItems = 16;  // accumulator floats per lane of one MFMA

// The instruction's operands: A (32 x 8, m x k) element i (0 .. 3), B (8 x 32, k x n)
// element i, C/D (32 x 32, m x n) item r (0 .. 15).
FA_HOST_DEVICE constexpr int a_row(int lane) { return lane % 32; }
FA_HOST_DEVICE constexpr int a_depth(int lane, int i) { return 4 * (lane / 32) + i; }
FA_HOST_DEVICE constexpr int b_depth(int lane, int i) { return 4 * (lane / 32) + i; }
FA_HOST_DEVICE constexpr int b_col(int lane) { return lane % 32; }
FA_HOST_DEVICE constexpr int c_row(int lane, int r) { return 8 * (r / 4) + 4 * (lane / 32) + r % 4; }
FA_HOST_DEVICE constexpr int c_col(int lane) { return lane % 32; }

// The kernels' fragment (see the top): element e of a lane's 32 x 8 tile.
FA_HOST_DEVICE constexpr int frag_row(int lane) { return lane % 32; }
FA_HOST_DEVICE constexpr int frag_col(int lane, int e) { return 4 * (lane / 32) + e; }

// Where item r of the MFMA that computes 32-column block `block` of a fragment lands.
FA_HOST_DEVICE constexpr int item_tile(int block, int r) { return 4 * block + r / 4; }
FA_HOST_DEVICE constexpr int item_element(int r) { return r % 4; }

}  // namespace mfma_map

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_FRAGMENT_MAPS_H_
