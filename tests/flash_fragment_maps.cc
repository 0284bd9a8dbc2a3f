// Prints the lane maps of ops_cuda/cuda/flash/fragment_maps.h (the ones the NVIDIA and AMD
// tensor-core layers of the flash kernels index their fragments with), one entry a line,
// for tests/test_flash_fragment_maps.py; built there with the host C++ compiler.
#include <cstdio>

#include "fragment_maps.h"

using namespace fusedattn::flash;

int main() {
  namespace nv = mma_sync_map;
  namespace amd = mfma_map;
  std::printf("nv const %d %d %d %d %d\n", nv::kLanes, nv::kWarpRows, nv::kLaneRows, nv::kRowLaneMaskLow,
              nv::kRowLaneMaskHigh);
  std::printf("nv stride %d\n", nv::kRowLaneStride);
  for (int lane = 0; lane < nv::kLanes; ++lane) {
    for (int e = 0; e < 4; ++e) std::printf("nv c %d %d %d %d\n", lane, e, nv::c_row(lane, e), nv::c_col(lane, e));
    for (int r = 0; r < 4; ++r) {
      for (int h = 0; h < 2; ++h) {
        std::printf("nv a %d %d %d %d %d\n", lane, r, h, nv::a_row(lane, r), nv::a_depth(lane, r, h));
      }
    }
    for (int r = 0; r < 2; ++r) {
      for (int h = 0; h < 2; ++h) {
        std::printf("nv b %d %d %d %d %d\n", lane, r, h, nv::b_depth(lane, r, h), nv::b_col(lane));
      }
    }
  }
  std::printf("amd const %d %d %d %d %d %d %d %d\n", amd::kLanes, amd::kWarpRows, amd::kLaneRows,
              amd::kRowLaneMaskLow, amd::kRowLaneMaskHigh, amd::kBlock, amd::kDepth, amd::kItems);
  std::printf("amd stride %d\n", amd::kRowLaneStride);
  for (int lane = 0; lane < amd::kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      std::printf("amd a %d %d %d %d\n", lane, i, amd::a_row(lane), amd::a_depth(lane, i));
      std::printf("amd b %d %d %d %d\n", lane, i, amd::b_depth(lane, i), amd::b_col(lane));
    }
    for (int r = 0; r < amd::kItems; ++r) std::printf("amd c %d %d %d %d\n", lane, r, amd::c_row(lane, r), amd::c_col(lane));
    for (int e = 0; e < 4; ++e) std::printf("amd frag %d %d %d %d\n", lane, e, amd::frag_row(lane), amd::frag_col(lane, e));
  }
  for (int block = 0; block < 4; ++block) {
    for (int r = 0; r < amd::kItems; ++r) {
      std::printf("amd item %d %d %d %d\n", block, r, amd::item_tile(block, r), amd::item_element(r));
    }
  }
  return 0;
}
