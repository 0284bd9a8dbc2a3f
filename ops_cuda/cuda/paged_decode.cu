// The paged decode op for platform "CUDA" (contract: fusedattn/paged_decode_ffi.h, index
// math and broken-data rules: fusedattn/paged.h; the same semantics as the host build,
// ops_cuda/host/paged_decode_host.cc). bfloat16 and float16, head dims 64, 128, 256, Dv = D.
//
// One CTA per (sequence, K/V head, split) holds every query row of that K/V head's group
// (heads x queries, at most kRows; larger groups take several head chunks) and streams the
// sequence's keys in tiles of kKeys through shared memory: 16-byte cp.async copies of whole
// key rows (the 16-byte chunks of one row go to neighbouring threads), the next tile in flight
// while the current one is computed, so each K/V byte of a sequence is read once per head
// chunk. Per tile: scores on CUDA cores in float32 (a thread per key and row lane), an online
// softmax per row (a warp per row), then P V into per-thread float32 accumulators.
//
// Flash-decoding: when the CTAs of the call would not fill the GPU (its SM count times the
// kernel's resident CTAs per SM), each (sequence, head) range of keys is split over up to
// `splits` CTAs whose unnormalised partials (running max m, sum l, accumulators) go to the
// workspace; a second kernel combines them by log-sum-exp and folds the softmax sink in.
//
// Workspace (a uint8 result XLA allocates; decode.py sizes it, this file reads how many
// splits it holds from its size): int32 ok[S], float32 m[splits, rows], l[splits, rows] and
// acc[splits, rows, Dv], each part 256-byte aligned, with rows = B * Sq * H (row (b, i, h)
// = (b Sq + i) H + h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "fusedattn/gpu_runtime.h"
#include "fusedattn/ffi_args.h"
#include "fusedattn/mask.h"
#include "fusedattn/paged.h"
#include "fusedattn/paged_decode_ffi.h"
#include "fusedattn/softmax.h"
#include "flash/mma.cuh"  // cp.async
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace paged_decode {
namespace {

namespace ffi = xla::ffi;
using flash::cp_async_16;
using flash::cp_async_commit;
using flash::cp_async_wait;
using flash::smem_address;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxQueries = 8;       // queries of a sequence per pass (decode.py's MAX_QUERIES)
constexpr int kRows = 32;            // query rows (heads x queries) per CTA
constexpr int kMinSplitKeys = 256;   // fewest keys a split is given
constexpr int kCombineThreads = 128;

// Tile shapes of head dim D: kKeys keys per tile, key rows padded by 16 bytes in shared
// memory (so the eight rows a quarter warp reads at one chunk fall in eight bank groups).
template <int D>
struct Tiling {
  static constexpr int kKeys = D >= 256 ? 32 : 64;
  static constexpr int kStages = 2;
  static constexpr int kChunks = D / 8;             // 16-byte chunks of a key row
  static constexpr int kPitch = D + 8;              // shared row pitch, elements
  static constexpr int kScoreLanes = kThreads / kKeys;
  static constexpr int kScoreRows = kRows / kScoreLanes;
  static constexpr int kCols = D / 4;               // P V phase: thread -> (4 columns, row lane)
  static constexpr int kOutLanes = kThreads / kCols;
  static constexpr int kOutRows = kRows / kOutLanes;
  static constexpr int kTileElements = kKeys * kPitch;  // one K or V tile
  static constexpr size_t kSharedBytes = sizeof(uint16_t) * kStages * 2 * kTileElements +
                                         sizeof(float) * (kRows * D + kRows * kKeys + 3 * kRows);
  static_assert(kThreads % kKeys == 0 && kRows % kScoreLanes == 0, "score phase mapping");
  static_assert(kThreads % kCols == 0 && kRows % kOutLanes == 0, "P V phase mapping");
};

struct DecodeArgs {
  PagedParams p;
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const int32_t* page_table;
  const int32_t* q_start;
  const int32_t* q_len;
  const int32_t* kv_len;
  const float* offset;
  uint16_t* o;
  int heads_per_cta;  // query heads of one CTA (a chunk of a K/V head's group)
  int head_chunks;    // chunks per group
  int splits;         // CTAs per (sequence, head chunk) along the keys
  // split > 1: the workspace's parts (see the top of this file)
  int32_t* ok;
  float* part_m;
  float* part_l;
  float* part_acc;
};

template <ElementType ET>
__device__ __forceinline__ float to_float(uint16_t x) {
  if constexpr (ET == ElementType::kBF16) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  } else {
    return __half2float(__ushort_as_half(x));
  }
}

template <ElementType ET>
__device__ __forceinline__ uint16_t from_float(float x) {
  if constexpr (ET == ElementType::kBF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

// The two 16-bit elements of `word` as floats (low first).
template <ElementType ET>
__device__ __forceinline__ void unpack2(uint32_t word, float* out) {
  out[0] = to_float<ET>(static_cast<uint16_t>(word & 0xffffu));
  out[1] = to_float<ET>(static_cast<uint16_t>(word >> 16));
}

template <ElementType ET>
__device__ __forceinline__ void unpack(uint4 raw, float (&out)[8]) {
  unpack2<ET>(raw.x, out);
  unpack2<ET>(raw.y, out + 2);
  unpack2<ET>(raw.z, out + 4);
  unpack2<ET>(raw.w, out + 6);
}

template <ElementType ET>
__device__ __forceinline__ void unpack(uint2 raw, float (&out)[4]) {
  unpack2<ET>(raw.x, out);
  unpack2<ET>(raw.y, out + 2);
}

template <ElementType ET>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return from_float<ET>(lo) | (static_cast<uint32_t>(from_float<ET>(hi)) << 16);
}

__device__ __forceinline__ int64_t o_offset(const PagedParams& p, int64_t b, int64_t row, int64_t h) {
  return ((b * p.seqlen_q + row) * p.heads + h) * p.head_dim_v;
}

// Sets rows [first, last) of q row b, heads [h0, h0 + nh), of o to `value`. Block-wide.
template <ElementType ET>
__device__ void fill_rows(const DecodeArgs& a, int64_t b, int64_t first, int64_t last, int h0, int nh,
                          float value) {
  const PagedParams& p = a.p;
  const uint16_t bits = from_float<ET>(value);
  const int64_t per_row = nh * p.head_dim_v;
  for (int64_t e = threadIdx.x; e < (last - first) * per_row; e += kThreads) {
    const int64_t row = first + e / per_row;
    const int64_t rest = e % per_row;
    a.o[o_offset(p, b, row, h0 + rest / p.head_dim_v) + rest % p.head_dim_v] = bits;
  }
}

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// The query rows' key range [lo, hi) that any mask leaves visible, clipped to [0, kv_len).
struct KeyRange {
  int32_t lo, hi;
};

__device__ __forceinline__ KeyRange visible_range(const PagedParams& p, int32_t q0, int32_t nq, int32_t q_len,
                                                  int32_t kv_len) {
  const int64_t first = paged_query_token(p, q0, q_len, kv_len).diagonal;
  const int64_t last = paged_query_token(p, q0 + nq - 1, q_len, kv_len).diagonal;
  int64_t lo = 0, hi = kv_len;
  if (p.mask.window_left >= 0) lo = std::max(lo, first - p.mask.window_left);
  if (p.mask.causal) hi = std::min(hi, last + 1);
  if (p.mask.window_right >= 0) hi = std::min(hi, last + p.mask.window_right + 1);
  lo = std::min<int64_t>(lo, kv_len);
  return {static_cast<int32_t>(lo), static_cast<int32_t>(std::max(hi, lo))};
}

// The shared-memory buffers of one CTA.
template <int D>
struct Shared {
  uint16_t* kv;     // [kStages][2 (K, V)][kKeys][kPitch]
  float* q;         // [kRows][D]
  float* scores;    // [kRows][kKeys]: scores, then probabilities
  float* row_m;     // [kRows] running max
  float* row_l;     // [kRows] running sum of exp(s - m)
  float* row_alpha; // [kRows] this tile's rescale factor

  __device__ explicit Shared(unsigned char* base) {
    using T = Tiling<D>;
    kv = reinterpret_cast<uint16_t*>(base);
    q = reinterpret_cast<float*>(kv + T::kStages * 2 * T::kTileElements);
    scores = q + kRows * D;
    row_m = scores + kRows * T::kKeys;
    row_l = row_m + kRows;
    row_alpha = row_l + kRows;
  }
  __device__ uint16_t* tile(int stage, int which) const {
    return kv + (stage * 2 + which) * Tiling<D>::kTileElements;
  }
};

// One pass of a CTA: query rows r = qi * nh + hh (query q0 + qi, head h0 + hh) over keys
// [begin, end); leaves the rows' unnormalised accumulators in `acc` (thread's rows
// r = lane_row + kOutLanes * i, columns 4 * col ..) and m, l in shared memory.
template <ElementType ET, int D>
struct Pass {
  using T = Tiling<D>;
  const DecodeArgs& a;
  const Shared<D>& sh;
  const int32_t* table;
  int g, h0, nh, q0, nq, rows, q_len, kv_len;
  int64_t b, q_row0;

  __device__ void load_q() const {
    const PagedParams& p = a.p;
    for (int e = threadIdx.x; e < rows * T::kChunks; e += kThreads) {
      const int r = e / T::kChunks, c = e % T::kChunks;
      const int64_t at = ((b * p.seqlen_q + q_row0 + r / nh) * p.heads + h0 + r % nh) * D + c * 8;
      float qf[8];
      unpack<ET>(*reinterpret_cast<const uint4*>(a.q + at), qf);
      float* dst = sh.q + r * D + c * 8;
      *reinterpret_cast<float4*>(dst) = make_float4(qf[0], qf[1], qf[2], qf[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(qf[4], qf[5], qf[6], qf[7]);
    }
    for (int r = threadIdx.x; r < kRows; r += kThreads) {
      sh.row_m[r] = -INFINITY;
      sh.row_l[r] = 0.0f;
    }
  }

  // Issues the copies of the tile of keys [key0, key0 + kKeys) (those < end; the rest zero).
  __device__ void load_tile(int32_t key0, int32_t end, int stage) const {
    const PagedParams& p = a.p;
    const uint32_t k_dst = smem_address(sh.tile(stage, 0)), v_dst = smem_address(sh.tile(stage, 1));
#pragma unroll 4
    for (int e = threadIdx.x; e < T::kKeys * T::kChunks; e += kThreads) {
      const int j = e / T::kChunks, c = e % T::kChunks;
      const int32_t key = key0 + j;
      const bool valid = key < end;
      const int64_t at = valid ? paged_kv_offset(table, key, g, c * 8, p.page_size, p.kv_heads, D) : 0;
      const uint32_t slot = static_cast<uint32_t>((j * T::kPitch + c * 8) * sizeof(uint16_t));
      cp_async_16(k_dst + slot, a.k + at, valid);
      cp_async_16(v_dst + slot, a.v + at, valid);
    }
  }

  // Scores of the tile's keys for every row (masked: -inf), scaled.
  __device__ void scores(int stage, int32_t key0, int32_t end) const {
    const PagedParams& p = a.p;
    const int j = threadIdx.x % T::kKeys, lane_row = threadIdx.x / T::kKeys;
    const uint16_t* krow = sh.tile(stage, 0) + j * T::kPitch;
    float dot[T::kScoreRows] = {};
#pragma unroll 2
    for (int c = 0; c < T::kChunks; ++c) {
      float kf[8];
      unpack<ET>(*reinterpret_cast<const uint4*>(krow + c * 8), kf);
#pragma unroll
      for (int i = 0; i < T::kScoreRows; ++i) {
        const int r = lane_row + T::kScoreLanes * i;
        if (r >= rows) break;
        const float4 qa = *reinterpret_cast<const float4*>(sh.q + r * D + c * 8);
        const float4 qb = *reinterpret_cast<const float4*>(sh.q + r * D + c * 8 + 4);
        dot[i] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                  qb.z * kf[6] + qb.w * kf[7];
      }
    }
    const int32_t key = key0 + j;
#pragma unroll
    for (int i = 0; i < T::kScoreRows; ++i) {
      const int r = lane_row + T::kScoreLanes * i;
      if (r >= rows) break;
      const QueryToken qt = paged_query_token(p, q0 + r / nh, q_len, kv_len);
      const bool seen = key < end && visible(p.mask, qt, 1, key);
      sh.scores[r * T::kKeys + j] = seen ? p.scale * dot[i] : -INFINITY;
    }
  }

  // The online softmax of the tile: scores -> exp(s - m_new), row_alpha = exp(m_old - m_new).
  __device__ void softmax() const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int kPerLane = T::kKeys / 32;
    for (int r = warp; r < rows; r += kWarps) {
      float* s = sh.scores + r * T::kKeys;
      float x[kPerLane];
      float block_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        x[u] = s[lane + 32 * u];
        block_max = fmaxf(block_max, x[u]);
      }
#pragma unroll
      for (int w = 16; w > 0; w /= 2) block_max = fmaxf(block_max, warp_shfl_xor(block_max, w));
      const float m_old = sh.row_m[r];
      const float m_new = fmaxf(m_old, block_max);
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        const float e = x[u] == -INFINITY ? 0.0f : expf(x[u] - m_new);
        s[lane + 32 * u] = e;
        sum += e;
      }
#pragma unroll
      for (int w = 16; w > 0; w /= 2) sum += warp_shfl_xor(sum, w);
      if (lane == 0) {
        const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
        sh.row_alpha[r] = alpha;
        sh.row_m[r] = m_new;
        sh.row_l[r] = sh.row_l[r] * alpha + sum;
      }
    }
  }

  // acc = acc * alpha + P V for the thread's rows and columns.
  __device__ void accumulate(int stage, float (&acc)[T::kOutRows][4]) const {
    const int col = threadIdx.x % T::kCols, lane_row = threadIdx.x / T::kCols;
#pragma unroll
    for (int i = 0; i < T::kOutRows; ++i) {
      const int r = lane_row + T::kOutLanes * i;
      if (r >= rows) break;
      const float alpha = sh.row_alpha[r];
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][c] *= alpha;
    }
    const uint16_t* vtile = sh.tile(stage, 1) + col * 4;
#pragma unroll 4
    for (int j = 0; j < T::kKeys; ++j) {
      float vf[4];
      unpack<ET>(*reinterpret_cast<const uint2*>(vtile + j * T::kPitch), vf);
#pragma unroll
      for (int i = 0; i < T::kOutRows; ++i) {
        const int r = lane_row + T::kOutLanes * i;
        if (r >= rows) break;
        const float pr = sh.scores[r * T::kKeys + j];
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] += pr * vf[c];
      }
    }
  }

  // Streams keys [begin, end) through the stages (cp.async, one tile ahead).
  __device__ void run(int32_t begin, int32_t end, float (&acc)[T::kOutRows][4]) const {
    const int n_tiles = end > begin ? (end - begin + T::kKeys - 1) / T::kKeys : 0;
#pragma unroll
    for (int s = 0; s < T::kStages - 1; ++s) {
      if (s < n_tiles) load_tile(begin + s * T::kKeys, end, s);
      cp_async_commit();
    }
    for (int t = 0; t < n_tiles; ++t) {
      cp_async_wait<T::kStages - 2>();
      __syncthreads();  // tile t has landed; every thread is done with the stage refilled next
      const int ahead = t + T::kStages - 1;
      if (ahead < n_tiles) load_tile(begin + ahead * T::kKeys, end, ahead % T::kStages);
      cp_async_commit();
      const int stage = t % T::kStages;
      const int32_t key0 = begin + t * T::kKeys;
      scores(stage, key0, end);
      __syncthreads();
      softmax();
      __syncthreads();
      accumulate(stage, acc);
    }
    cp_async_wait<0>();
    __syncthreads();
  }
};

// Whether the sequence's data can be served (paged_sequence_ok), the pages checked by all
// threads at once. Block-wide.
__device__ bool sequence_ok(const PagedParams& p, const int32_t* table, int32_t q_start, int32_t q_len,
                            int32_t kv_len) {
  if (!paged_lengths_ok(p, q_start, q_len, kv_len)) return false;  // uniform over the block
  bool bad = false;
  for (int64_t i = threadIdx.x; i * p.page_size < kv_len; i += kThreads) bad |= !paged_page_ok(p, table[i]);
  return !__syncthreads_or(bad);
}

// grid (S, Hkv * head_chunks, splits).
template <ElementType ET, int D>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(DecodeArgs a) {
  using T = Tiling<D>;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const Shared<D> sh(shared_raw);
  const PagedParams& p = a.p;
  const int64_t s = blockIdx.x;
  const int g = blockIdx.y / a.head_chunks, chunk = blockIdx.y % a.head_chunks;
  const int split = blockIdx.z;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int h0 = g * group + chunk * a.heads_per_cta;
  const int nh = std::min(a.heads_per_cta, group - chunk * a.heads_per_cta);
  const int64_t b = paged_row_of(p, s);
  const int32_t q_start = a.q_start[s], q_len = a.q_len[s], kv_len = a.kv_len[s];
  const int32_t* table = a.page_table + s * p.pages_per_seq;

  // The sequence's rows that lie in its q row; with one sequence per row (S = B) the
  // others are zero here, with several the handler zeroed o beforehand.
  const int64_t first = clamp64(q_start, 0, p.seqlen_q);
  const int64_t last = q_len > 0 ? clamp64(static_cast<int64_t>(q_start) + q_len, first, p.seqlen_q) : first;
  if (split == 0 && p.sequences == p.batch) {
    fill_rows<ET>(a, b, 0, first, h0, nh, 0.0f);
    fill_rows<ET>(a, b, last, p.seqlen_q, h0, nh, 0.0f);
  }
  if (q_len <= 0) return;
  const bool ok = sequence_ok(p, table, q_start, q_len, kv_len);
  if (a.splits > 1 && threadIdx.x == 0 && blockIdx.y == 0 && split == 0) a.ok[s] = ok;
  if (!ok) {
    if (split == 0) fill_rows<ET>(a, b, first, last, h0, nh, NAN);
    return;
  }
  const int col = threadIdx.x % T::kCols, lane_row = threadIdx.x / T::kCols;
  for (int q0 = 0; q0 < q_len; q0 += kMaxQueries) {
    const int nq = std::min(q_len - q0, int{kMaxQueries});
    const Pass<ET, D> pass{a, sh, table, g, h0, nh, q0, nq, nh * nq, q_len, kv_len, b,
                           static_cast<int64_t>(q_start) + q0};
    pass.load_q();
    const KeyRange range = visible_range(p, q0, nq, q_len, kv_len);
    int32_t begin = range.lo, end = range.hi;
    if (a.splits > 1) {
      const int32_t per = ((end - begin + a.splits - 1) / a.splits + T::kKeys - 1) / T::kKeys * T::kKeys;
      begin = std::min(end, begin + split * per);
      end = std::min(end, begin + per);
    }
    float acc[T::kOutRows][4] = {};
    __syncthreads();  // q and the row statistics are in place
    pass.run(begin, end, acc);
#pragma unroll
    for (int i = 0; i < T::kOutRows; ++i) {
      const int r = lane_row + T::kOutLanes * i;
      if (r >= pass.rows) break;
      const int64_t row = pass.q_row0 + r / nh, h = h0 + r % nh;
      const float m = sh.row_m[r], l = sh.row_l[r];
      if (a.splits > 1) {
        const int64_t at = (static_cast<int64_t>(split) * p.batch * p.seqlen_q + b * p.seqlen_q + row) * p.heads + h;
        *reinterpret_cast<float4*>(a.part_acc + at * D + col * 4) = make_float4(acc[i][0], acc[i][1], acc[i][2],
                                                                               acc[i][3]);
        if (col == 0) {
          a.part_m[at] = m;
          a.part_l[at] = l;
        }
      } else {
        SoftmaxState st{m, l, m != -INFINITY};
        float inv = 0.0f;
        st.finalize(p.softmax_type, softmax_sink_logit(p.softmax_type, a.offset[h]), &inv);
        *reinterpret_cast<uint2*>(a.o + o_offset(p, b, row, h) + col * 4) =
            make_uint2(pack2<ET>(acc[i][0] * inv, acc[i][1] * inv), pack2<ET>(acc[i][2] * inv, acc[i][3] * inv));
      }
    }
    __syncthreads();  // before the next pass overwrites q and the statistics
  }
}

// grid (S, H): the output rows of sequence s, head h, from the splits' partials.
template <ElementType ET>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(DecodeArgs a) {
  const PagedParams& p = a.p;
  const int64_t s = blockIdx.x, h = blockIdx.y;
  const int32_t q_len = a.q_len[s];
  if (q_len <= 0 || !a.ok[s]) return;
  const int64_t b = paged_row_of(p, s);
  const int64_t rows = p.batch * p.seqlen_q * p.heads;
  const float sink = softmax_sink_logit(p.softmax_type, a.offset[h]);
  for (int32_t i = 0; i < q_len; ++i) {
    const int64_t row = (b * p.seqlen_q + a.q_start[s] + i) * p.heads + h;
    float m = -INFINITY;
    for (int z = 0; z < a.splits; ++z) m = fmaxf(m, a.part_m[z * rows + row]);
    float l = 0.0f;
    for (int z = 0; z < a.splits; ++z) {
      const float mz = a.part_m[z * rows + row];
      if (mz != -INFINITY) l += a.part_l[z * rows + row] * expf(mz - m);
    }
    SoftmaxState st{m, l, m != -INFINITY};
    float inv = 0.0f;
    st.finalize(p.softmax_type, sink, &inv);
    for (int64_t d = threadIdx.x; d < p.head_dim_v; d += kCombineThreads) {
      float sum = 0.0f;
      for (int z = 0; z < a.splits; ++z) {
        const float mz = a.part_m[z * rows + row];
        if (mz != -INFINITY) sum += a.part_acc[(z * rows + row) * p.head_dim_v + d] * expf(mz - m);
      }
      a.o[row * p.head_dim_v + d] = from_float<ET>(sum * inv);
    }
  }
}

// ---------------------------------------------------------------------------- host side

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Bytes of the workspace for `splits` splits (the ok flags alone for one).
int64_t workspace_bytes(const PagedParams& p, int64_t splits) {
  const int64_t flags = align256(p.sequences * static_cast<int64_t>(sizeof(int32_t)));
  if (splits <= 1) return flags;
  const int64_t stats = splits * p.batch * p.seqlen_q * p.heads * static_cast<int64_t>(sizeof(float));
  return flags + 2 * align256(stats) + stats * p.head_dim_v;
}

ffi::Error check_kernel_support(const char* op, const PagedParams& p, ffi::DataType dtype) {
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return invalid(op, std::string("the CUDA paged decode kernel takes bfloat16 or float16, got ") +
                           dtype_name(dtype));
  }
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    return invalid(op, "the CUDA paged decode kernel serves head dims 64, 128 and 256, got " +
                           std::to_string(p.head_dim));
  }
  if (p.head_dim_v != p.head_dim) {
    return invalid(op, "the CUDA paged decode kernel needs v's head dim equal to q's, got " +
                           std::to_string(p.head_dim_v) + " and " + std::to_string(p.head_dim));
  }
  return ffi::Error::Success();
}

// How many splits to run: enough CTAs for one full wave of the GPU, no more than the
// workspace holds, and at least kMinSplitKeys keys (of the table's capacity) each.
int choose_splits(const PagedParams& p, int64_t ctas, int resident_per_sm, int64_t workspace_size) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 1;
  }
  const int64_t resident = static_cast<int64_t>(sms) * std::max(resident_per_sm, 1);
  if (ctas >= resident) return 1;
  const int64_t keys = (p.pages_per_seq * p.page_size + kMinSplitKeys - 1) / kMinSplitKeys;
  int64_t splits = std::min({resident / ctas, keys, int64_t{65535}});
  while (splits > 1 && workspace_bytes(p, splits) > workspace_size) --splits;
  return static_cast<int>(std::max<int64_t>(splits, 1));
}

template <ElementType ET, int D>
ffi::Error launch(const char* op, gpuStream_t stream, DecodeArgs a, ffi::Result<ffi::AnyBuffer>& workspace) {
  using T = Tiling<D>;
  const PagedParams& p = a.p;
  auto* kernel = paged_decode_kernel<ET, D>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(T::kSharedBytes)) != cudaSuccess) {
    return launch_status(op);
  }
  int resident_per_sm = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident_per_sm, kernel, kThreads, T::kSharedBytes) !=
      cudaSuccess) {
    return launch_status(op);
  }
  const int64_t group = p.heads / p.kv_heads;
  const int64_t queries = std::min<int64_t>(p.seqlen_q, kMaxQueries);
  a.heads_per_cta = static_cast<int>(std::min<int64_t>(group, kRows / queries));
  a.head_chunks = static_cast<int>((group + a.heads_per_cta - 1) / a.heads_per_cta);
  const int64_t ctas = p.sequences * p.kv_heads * a.head_chunks;
  a.splits = choose_splits(p, ctas, resident_per_sm, workspace->dimensions()[0]);
  if (a.splits > 1) {
    char* base = static_cast<char*>(workspace->untyped_data());
    const int64_t flags = workspace_bytes(p, 1);
    const int64_t stats = align256(a.splits * p.batch * p.seqlen_q * p.heads * static_cast<int64_t>(sizeof(float)));
    a.ok = reinterpret_cast<int32_t*>(base);
    a.part_m = reinterpret_cast<float*>(base + flags);
    a.part_l = reinterpret_cast<float*>(base + flags + stats);
    a.part_acc = reinterpret_cast<float*>(base + flags + 2 * stats);
  }
  if (p.sequences != p.batch &&
      gpuMemsetAsync(a.o, 0, p.batch * p.seqlen_q * p.heads * p.head_dim_v * sizeof(uint16_t), stream) !=
          gpuSuccess) {
    return launch_status(op);
  }
  const dim3 grid(static_cast<unsigned>(p.sequences), static_cast<unsigned>(p.kv_heads * a.head_chunks),
                  static_cast<unsigned>(a.splits));
  kernel<<<grid, kThreads, T::kSharedBytes, stream>>>(a);
  if (a.splits > 1) {
    combine_kernel<ET><<<dim3(static_cast<unsigned>(p.sequences), static_cast<unsigned>(p.heads)),
                         kCombineThreads, 0, stream>>>(a);
  }
  return launch_status(op);
}

ffi::Error PagedDecodeFwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer page_table, ffi::AnyBuffer q_start, ffi::AnyBuffer q_len,
                              ffi::AnyBuffer kv_len, ffi::AnyBuffer softmax_offset, ffi::Result<ffi::AnyBuffer> o,
                              ffi::Result<ffi::AnyBuffer> workspace, float scale, bool causal, bool bottom_right,
                              int64_t window_left, int64_t window_right, int32_t softmax_type) {
  constexpr const char* kOp = "fusedattn_paged_decode_fwd (CUDA)";
  PagedParams p;
  if (auto e = parse_paged_decode_call(kOp, q, k, v, page_table, q_start, q_len, kv_len, softmax_offset, o, scale,
                                       causal, bottom_right, window_left, window_right, softmax_type, &p);
      e.failure()) {
    return e;
  }
  if (auto e = check_kernel_support(kOp, p, q.element_type()); e.failure()) return e;
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1 ||
      workspace->dimensions()[0] < workspace_bytes(p, 1)) {
    return invalid(kOp, "the workspace result must be uint8 [>= " + std::to_string(workspace_bytes(p, 1)) + "], got " +
                            dtype_name(workspace->element_type()) + " " + dims_string(workspace->dimensions()));
  }
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads == 0) return ffi::Error::Success();
  DecodeArgs a{};
  a.p = p;
  a.q = static_cast<const uint16_t*>(q.untyped_data());
  a.k = static_cast<const uint16_t*>(k.untyped_data());
  a.v = static_cast<const uint16_t*>(v.untyped_data());
  a.page_table = page_table.typed_data<int32_t>();
  a.q_start = q_start.typed_data<int32_t>();
  a.q_len = q_len.typed_data<int32_t>();
  a.kv_len = kv_len.typed_data<int32_t>();
  a.offset = softmax_offset.typed_data<float>();
  a.o = static_cast<uint16_t*>(o->untyped_data());
  const ElementType et = element_type_of(q.element_type());
  auto by_dim = [&](auto et_constant) -> ffi::Error {
    constexpr ElementType kET = decltype(et_constant)::value;
    switch (p.head_dim) {
      case 64: return launch<kET, 64>(kOp, stream, a, workspace);
      case 128: return launch<kET, 128>(kOp, stream, a, workspace);
      default: return launch<kET, 256>(kOp, stream, a, workspace);
    }
  };
  return et == ElementType::kBF16 ? by_dim(std::integral_constant<ElementType, ElementType::kBF16>{})
                                  : by_dim(std::integral_constant<ElementType, ElementType::kF16>{});
}

}  // namespace
}  // namespace paged_decode
}  // namespace fusedattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnPagedDecodeFwdCuda, fusedattn::paged_decode::PagedDecodeFwdImpl,
                              fusedattn::bind_paged_decode<1>(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<gpuStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
