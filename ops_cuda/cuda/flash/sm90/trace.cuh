// Clock stamps of the sm90 kernels, for benchmarks/probes/flash_item_trace.py: where the
// time goes between the phases of the forward's work items (block 0's) and of the backward's
// blocks (those of SMs 0 and 1). clock64 is one SM's counter, so stamps of one SM compare.
// Built only with -DFUSEDATTN_FLASH_TRACE (CMake: -DFUSEDATTN_FLASH_TRACE=ON); otherwise
// the functions are empty and the kernels' machine code is that of a build without them.
// Forward (trace_stamp, trace_dump):
//   roles: 0 the producer (its leader thread), 1 and 2 the consumer warpgroups (thread 0 of each)
//   producer events: 0 item taken, 1 first K issued, 2 waits for the Q buffer, 3 Q issued,
//     4 the item's last load issued
//   consumer events: 0 item start, 1 Q landed, 2 first tile's weights done, 3 last P V
//     done, 4 O store issued, 5 O store read
// Backward (trace_clock, trace_block; consumer thread 0 of the block):
//   events: 0 consumers start, 1 K and V landed, 2 first query tile landed, 3 last dK
//     product done, 4 dK and dV stored (consumer 0's TMA stores have read shared memory)
#ifndef FUSEDATTN_FLASH_SM90_TRACE_CUH_
#define FUSEDATTN_FLASH_SM90_TRACE_CUH_

#include <cstdio>

namespace fusedattn {
namespace flash {
namespace sm90 {

constexpr int kBlockEvents = 5;  // the backward's stamps per block

#ifdef FUSEDATTN_FLASH_TRACE
constexpr int kTraceRoles = 3, kTraceItems = 16, kTraceEvents = 6;
__device__ long long g_item_trace[kTraceRoles][kTraceItems][kTraceEvents];

__device__ __forceinline__ void trace_stamp(int role, int item, int event) {
  if (blockIdx.x == 0 && item < kTraceItems) g_item_trace[role][item][event] = clock64();
}

// Prints the role's stamps of the block's first `items` items (one line each) as the role ends.
__device__ __forceinline__ void trace_dump(int role, int items) {
  if (blockIdx.x != 0) return;
  for (int i = 0; i < items && i < kTraceItems; ++i) {
    const long long* e = g_item_trace[role][i];
    printf("fusedattn-trace role=%d item=%d %lld %lld %lld %lld %lld %lld\n", role, i, e[0], e[1], e[2], e[3], e[4],
           e[5]);
  }
}

__device__ __forceinline__ long long trace_clock() { return clock64(); }

// Prints one backward block's stamps and query tiles where it ran on SM 0 or 1.
__device__ __forceinline__ void trace_block(const long long (&e)[kBlockEvents], int tiles) {
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (sm < 2) {
    printf("fusedattn-btrace sm=%u block=%d tiles=%d %lld %lld %lld %lld %lld\n", sm, static_cast<int>(blockIdx.x),
           tiles, e[0], e[1], e[2], e[3], e[4]);
  }
}
#else
__device__ __forceinline__ void trace_stamp(int, int, int) {}
__device__ __forceinline__ void trace_dump(int, int) {}
__device__ __forceinline__ long long trace_clock() { return 0; }
__device__ __forceinline__ void trace_block(const long long (&)[kBlockEvents], int) {}
#endif

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_TRACE_CUH_
