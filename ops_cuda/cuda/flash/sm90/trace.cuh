// Clock stamps of block 0's work items in the sm90 forward, for
// benchmarks/probes/flash_item_trace.py: where an item's time goes between its phases
// (clock64 is one SM's counter, so the producer's and the consumers' stamps compare).
// Built only with -DFUSEDATTN_FLASH_TRACE (CMake: -DFUSEDATTN_FLASH_TRACE=ON); otherwise
// both functions are empty and the kernels' machine code is that of a build without them.
//   roles: 0 the producer (its leader thread), 1 and 2 the consumer warpgroups (thread 0 of each)
//   producer events: 0 item taken, 1 first K issued, 2 waits for the Q buffer, 3 Q issued,
//     4 the item's last load issued
//   consumer events: 0 item start, 1 Q landed, 2 first tile's weights done, 3 last P V
//     done, 4 O store issued, 5 O store read
#ifndef FUSEDATTN_FLASH_SM90_TRACE_CUH_
#define FUSEDATTN_FLASH_SM90_TRACE_CUH_

#include <cstdio>

namespace fusedattn {
namespace flash {
namespace sm90 {

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
#else
__device__ __forceinline__ void trace_stamp(int, int, int) {}
__device__ __forceinline__ void trace_dump(int, int) {}
#endif

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_TRACE_CUH_
