// A plain CUDA streaming kernel: reads R blocks and writes W blocks of n 16-byte vectors,
// every input vector read once and every output vector written once, all R loads of an
// index issued before any is used. It measures the HBM rate a kernel can reach with a
// given read:write mix (benchmarks/probes/hbm_stream.py builds and runs it).
//   usage: hbm_stream BLOCK_BYTES READS WRITES
//   prints one line per launch shape: blocks_per_sm ms
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 40;  // reads or writes

struct Blocks {
  const uint4* in[kMaxBlocks];
  uint4* out[kMaxBlocks];
};

template <int R, int W>
__global__ void __launch_bounds__(kThreads) stream(Blocks b, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    uint4 v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = __ldcs(b.in[r] + i);  // streamed: not kept in L2
    uint4 acc = v[0];
#pragma unroll
    for (int r = 1; r < R; ++r) acc = {acc.x ^ v[r].x, acc.y ^ v[r].y, acc.z ^ v[r].z, acc.w ^ v[r].w};
#pragma unroll
    for (int w = 0; w < W; ++w) __stcs(b.out[w] + i, uint4{acc.x + w, acc.y, acc.z, acc.w});
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

using Launch = void (*)(dim3, Blocks, long long);
template <int R, int W>
void launch(dim3 grid, Blocks b, long long n) {
  stream<R, W><<<grid, kThreads>>>(b, n);
}

// The (reads, writes) pairs benchmarks/probes/hbm_stream.py asks for: the small-seq forward
// (1 + 2N, 1) and backward (3 + 2N, 1 + 2N) for N = 2, 4, 6, 8, 12, 16.
Launch find(int r, int w) {
#define FA_PAIR(R, W) \
  if (r == R && w == W) return launch<R, W>;
  FA_PAIR(5, 1) FA_PAIR(9, 1) FA_PAIR(13, 1) FA_PAIR(17, 1) FA_PAIR(25, 1) FA_PAIR(33, 1)
  FA_PAIR(7, 5) FA_PAIR(11, 9) FA_PAIR(15, 13) FA_PAIR(19, 17) FA_PAIR(27, 25) FA_PAIR(35, 33)
#undef FA_PAIR
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s BLOCK_BYTES READS WRITES\n", argv[0]);
    return 2;
  }
  const long long bytes = std::atoll(argv[1]);
  const int reads = std::atoi(argv[2]), writes = std::atoi(argv[3]);
  const Launch run = find(reads, writes);
  if (run == nullptr || bytes % 16 != 0) {
    std::fprintf(stderr, "no kernel for %d reads, %d writes of %lld bytes\n", reads, writes, bytes);
    return 2;
  }
  const long long n = bytes / 16;
  Blocks b{};
  for (int r = 0; r < reads; ++r) {
    void* p;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    check(cudaMemset(p, r + 1, bytes), "cudaMemset");  // not zero: nothing to compress
    b.in[r] = static_cast<const uint4*>(p);
  }
  for (int w = 0; w < writes; ++w) {
    void* p;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    b.out[w] = static_cast<uint4*>(p);
  }
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  for (int per_sm : {2, 4, 8}) {
    const dim3 grid(sms * per_sm);
    for (int i = 0; i < 3; ++i) run(grid, b, n);
    check(cudaDeviceSynchronize(), "warm-up");
    std::vector<float> times;
    for (int repeat = 0; repeat < 7; ++repeat) {
      constexpr int kIters = 10;
      check(cudaEventRecord(start), "record");
      for (int i = 0; i < kIters; ++i) run(grid, b, n);
      check(cudaEventRecord(stop), "record");
      check(cudaEventSynchronize(stop), "sync");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      times.push_back(ms / kIters);
    }
    std::sort(times.begin(), times.end());
    std::printf("%d %.5f\n", per_sm, times[times.size() / 2]);
  }
  return 0;
}
