// The paged decode op for platform "CUDA" (contract: fusedattn/paged_decode_ffi.h, index
// math and broken-data rules: fusedattn/paged.h; the same semantics as the host build,
// ops_cuda/host/paged_decode_host.cc). bfloat16 and float16, head dims 64, 128, 256, Dv = D.
//
// One CTA (4 warps) per (sequence, K/V head, split) holds every query row of that K/V
// head's group (heads x queries, in query tiles of 8 rows: one tile for a GQA-4 token, two
// for four tokens; larger groups take several head chunks) and streams the sequence's
// visible keys in tiles of 64 through shared memory: 16-byte cp.async copies of whole key
// rows (eight threads per row, so a thread looks up one page-table entry per two chunks),
// kStages - 1 tiles in flight while one is computed, so each K/V byte of a sequence is read
// once per head chunk. The page-table entries of the keys streamed next sit in shared
// memory (a window of kTablePages entries, refilled by the block as the keys move past
// it), so issuing a tile's copies waits on no global load. The CTAs of one (sequence,
// split) are adjacent in the grid.
//
// Each warp takes 16 keys of a tile, and the products are transposed (keys on the 16-row
// side of mma.sync m16n8k16, queries on the 8-column side): S^T = K Q^T and O^T += V^T P^T
// on tensor cores (float32 accumulators, P rounded to the input type as in the flash
// kernels; primitives of ops_cuda/cuda/flash/mma.cuh), so a decode token's 4 rows are not
// padded to 16 and its O^T accumulators take D/4 registers a lane. Q's fragments stay in
// registers for the whole pass; P^T becomes the B operand of the second product through
// movmatrix. Each warp keeps its own online softmax; masks are applied per element only on
// a warp's 16 keys that some row of the pass does not wholly see (the last, partial tile;
// causal diagonals; windows), and the accumulators are rescaled only when a maximum grew.
// The four warps' (m, l, O) are merged through shared memory at the end.
//
// A CTA's start: the caller's lengths are checked against the call's bounds first
// (paged_lengths_ok: the q range in its row, max_seqlen_q and max_seqlen_kv, the keys within
// the table; no read depends on them failing), then the query rows and the first tiles are
// issued together (cp.async), and the sequence's page-table entries are checked while they
// are in flight; a tile never reads through an entry outside the pool (zero-filled
// instead), and a broken sequence's rows become NaN.
//
// Flash-decoding: when the CTAs of the call would not fill the GPU (its SM count times the
// kernel's resident CTAs per SM), each (sequence, head) range of keys is split over up to
// `splits` CTAs whose unnormalised partials (max m, sum l, accumulators) go to the
// workspace; a second kernel combines them by log-sum-exp and folds the softmax sink in.
// On sm_90 the combine kernel is a programmatic dependent launch: its CTAs are placed
// while the split CTAs run and start as soon as they finish (griddepcontrol), without
// a launch gap between the two kernels.
//
// Workspace (a uint8 result XLA allocates; decode.py sizes it, this file reads how many
// splits it holds from its size): int32 ok[S], float32 m[splits, rows], l[splits, rows] and
// acc[splits, rows, Dv], each part 256-byte aligned, with rows = B * Sq * H (row (b, i, h)
// = (b Sq + i) H + h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "fusedattn/gpu_runtime.h"
#include "fusedattn/ffi_args.h"
#include "fusedattn/mask.h"
#include "fusedattn/paged.h"
#include "fusedattn/paged_decode_ffi.h"
#include "fusedattn/softmax.h"
#include "flash/params.cuh"       // kLog2e, fast_exp2
#include "flash/tensor_core.cuh"  // mma.cuh: cp.async, ldmatrix, movmatrix, mma.sync and the swizzled tiles
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace paged_decode {
namespace {

namespace ffi = xla::ffi;
using flash::copy_chunk;
using flash::tile_copies_commit;
using flash::tile_copies_wait;
using flash::smem_address;
using flash::SwizzledTile;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kKeys = 16 * kWarps;   // keys per tile, 16 per warp
constexpr int kMaxQueries = 8;       // queries of a sequence per pass (decode.py's MAX_QUERIES)
constexpr int kMinSplitKeys = 256;   // fewest keys a split is given
constexpr int kCombineThreads = 128;
constexpr int kTablePages = 512;     // page-table entries a CTA holds in shared memory
constexpr int kRowThreads = 8;       // threads that copy one key row of a tile
constexpr int kCopyRows = kThreads / kRowThreads;  // key rows the block copies at once

// The most query tiles (8 query rows each: the n side of the products) a CTA holds at head
// dim D; a lane keeps D/16 * (2 + 4) registers per tile (Q fragments and O accumulators).
template <int D>
constexpr int max_query_tiles() {
  return D >= 256 ? 1 : 2;
}

// Shapes of head dim D and kQTiles query tiles: kRows query rows, kStages K/V tiles in
// shared memory. D = 256 two stages (sm_80's 163 KB), D = 128 three (two CTAs per SM),
// D = 64 four.
template <int D, int kQTiles>
struct Tiling {
  static constexpr int kRows = 8 * kQTiles;
  static constexpr int kStages = D >= 256 ? 2 : D >= 128 ? 3 : 4;
  static constexpr int kChunks = D / 8;                     // 16-byte chunks of a row
  static constexpr int kRowChunks = kChunks / kRowThreads;  // chunks of a key row one thread copies
  static constexpr int kTileBytes = kKeys * D * 2;          // one K or V tile
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kMergeStride = D + 4;  // floats from one merge-area row to the next (no bank conflicts)
  static constexpr int kMergeBytes = kWarps * kRows * kMergeStride * 4;  // the warps' O, after the loop
  static constexpr int kStatBytes = 2 * kWarps * kRows * 4;               // the warps' m and l
  static constexpr int kPageBytes = kTablePages * 4;                      // the page-table window
  static constexpr size_t kSharedBytes = kStages * 2 * kTileBytes + kQBytes + kStatBytes + kPageBytes;
  static_assert(kMergeBytes <= kStages * 2 * kTileBytes, "the merge reuses the stages");
  static_assert(kKeys % kCopyRows == 0 && kCopyRows % 8 == 0 && kChunks % kRowThreads == 0, "whole copy passes");
};

struct DecodeArgs {
  PagedParams p;
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const int32_t* page_table;
  const int32_t* q_start;  // nullptr: every q_start 0
  const int32_t* q_len;
  const int32_t* kv_len;  // as the caller gave them (paged.h)
  const float* offset;  // nullptr: every offset 0
  uint16_t* o;
  int page_shift;     // log2(page_size) when a power of two, else -1
  int heads_per_cta;  // query heads of one CTA (a chunk of a K/V head's group)
  int head_chunks;    // chunks per group
  int splits;         // CTAs per (sequence, K/V head, head chunk) along the keys
  // split > 1: the workspace's parts (see the top of this file)
  int32_t* ok;
  float* part_m;
  float* part_l;
  float* part_acc;
};

template <ElementType ET>
__device__ __forceinline__ uint16_t from_float(float x) {
  if constexpr (ET == ElementType::kBF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
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

// The shared-memory buffers of one CTA (swizzled tiles of 16-bit rows).
template <int D, int kQTiles>
struct Shared {
  using T = Tiling<D, kQTiles>;
  unsigned char* base;  // [kStages][K, V] tiles of kKeys rows; after the loop, the warps' O
  SwizzledTile<T::kChunks> q;  // kRows rows
  float* stat_m;               // [kWarps][kRows]
  float* stat_l;               // [kWarps][kRows]
  int32_t* pages;              // [kTablePages]: page-table entries window .. window + kTablePages - 1

  __device__ explicit Shared(unsigned char* raw) : base(raw) {
    q.base = smem_address(raw + T::kStages * 2 * T::kTileBytes);
    stat_m = reinterpret_cast<float*>(raw + T::kStages * 2 * T::kTileBytes + T::kQBytes);
    stat_l = stat_m + kWarps * T::kRows;
    pages = reinterpret_cast<int32_t*>(stat_l + kWarps * T::kRows);
  }
  // K (which = 0) or V (1) of `stage`, from key row `row0` on.
  __device__ SwizzledTile<T::kChunks> tile(int stage, int which, int row0 = 0) const {
    SwizzledTile<T::kChunks> t;
    t.base = smem_address(base + (stage * 2 + which) * T::kTileBytes) + row0 * T::kChunks * 16;
    return t;
  }
  // [kWarps][kRows] rows of kMergeStride floats (O of row r at r * kMergeStride + 0 .. D - 1)
  __device__ float* merge() const { return reinterpret_cast<float*>(base); }
};

// One pass of a CTA: query rows r = qi * nh + hh (query q0 + qi, head h0 + hh), r < rows,
// over keys [begin, end); leaves each row's max m, sum l and unnormalised O in `out_*`
// (merged over the warps). Block-wide.
//
// The products are transposed, keys on the 16-row side: a warp computes S^T = K Q^T for its
// 16 keys and the pass's kRows = 8 kQTiles query columns, and O^T += V^T P^T, so a row tile
// of 16 is never padded from the 4 rows of a GQA-4 token. Lane l holds query columns
// 8 nt + 2 (l % 4) + e (e = 0, 1) of both S^T and O^T: its softmax statistics are its own.
// Q's fragments stay in registers for the pass; P^T's C fragments become the B operand
// through movmatrix.
template <ElementType ET, int D, int kQTiles>
struct Pass {
  using T = Tiling<D, kQTiles>;
  static constexpr int kDTiles = D / 16;  // 16-wide slices of the head dim
  const DecodeArgs& a;
  const Shared<D, kQTiles>& sh;
  const int32_t* table;
  int g, h0, nh, q0, rows, q_len, kv_len;
  int64_t b, q_row0;

  // The keys the mask leaves visible to the lane's query columns, [lo, hi] clipped to
  // end - 1 (lo > hi for columns past `rows`), and [full_lo, full_hi], the keys every row
  // of the pass sees: a warp whose 16 keys lie inside it skips the per-element mask.
  struct Visible {
    int32_t lo[kQTiles][2], hi[kQTiles][2];
    int32_t full_lo, full_hi;
  };

  // Issues the copies of the pass's query rows into sh.q (rows past `rows` zero-filled);
  // they complete with the first tile's group (start()).
  __device__ void load_q() const {
    const PagedParams& p = a.p;
    for (int e = threadIdx.x; e < T::kRows * T::kChunks; e += kThreads) {
      const int r = e / T::kChunks, c = e % T::kChunks;
      const int64_t at = r < rows ? ((b * p.seqlen_q + q_row0 + r / nh) * p.heads + h0 + r % nh) * D + c * 8 : 0;
      copy_chunk(sh.q.row(r) + static_cast<uint32_t>((c ^ (r % 8)) * 16), a.q + at, r < rows);
    }
  }

  // The warp's B fragments of Q^T (query tile nt, 16 dims ks), once sh.q has landed.
  __device__ void load_q_fragments(uint32_t (&qb)[kQTiles][kDTiles][2]) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
      for (int kp = 0; kp < kDTiles / 2; ++kp) {
        // lanes 8i .. 8i + 7 address matrix i: chunk 4 kp + i of query rows 8 nt .. 8 nt + 7
        uint32_t r[4];
        flash::ldmatrix_x4(r, sh.q.row(8 * nt + lane % 8) +
                                  static_cast<uint32_t>(((4 * kp + lane / 8) ^ (lane % 8)) * 16));
        qb[nt][2 * kp][0] = r[0];
        qb[nt][2 * kp][1] = r[1];
        qb[nt][2 * kp + 1][0] = r[2];
        qb[nt][2 * kp + 1][1] = r[3];
      }
    }
  }

  __device__ Visible visible_keys(int32_t end) const {
    const PagedParams& p = a.p;
    const int lane = threadIdx.x % 32;
    Visible v;
    v.full_lo = std::numeric_limits<int32_t>::min();
    v.full_hi = std::numeric_limits<int32_t>::max();
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * nt + 2 * (lane % 4) + e;
        v.lo[nt][e] = std::numeric_limits<int32_t>::max();
        v.hi[nt][e] = std::numeric_limits<int32_t>::min();
        if (r < rows) {
          const QueryRange range = query_range(p.mask, paged_query_token(p, q0 + r / nh, q_len, kv_len));
          v.lo[nt][e] = range.lo;
          v.hi[nt][e] = std::min(range.hi, end - 1);
          v.full_lo = std::max(v.full_lo, v.lo[nt][e]);
          v.full_hi = std::min(v.full_hi, v.hi[nt][e]);
        }
      }
    }
#pragma unroll
    for (int mask = 1; mask <= 2; mask *= 2) {  // over the lanes of the other query columns
      v.full_lo = std::max(v.full_lo, warp_shfl_xor(v.full_lo, mask));
      v.full_hi = std::min(v.full_hi, warp_shfl_xor(v.full_hi, mask));
    }
    return v;
  }

  // The page of key `key`.
  __device__ __forceinline__ int32_t page_of(int32_t key) const {
    const uint32_t u = static_cast<uint32_t>(key);
    return static_cast<int32_t>(a.page_shift >= 0 ? u >> a.page_shift : u / static_cast<uint32_t>(a.p.page_size));
  }

  // Loads the page-table entries window .. window + kTablePages - 1 into sh.pages. Block-wide.
  __device__ void fill_pages(int32_t window) const {
    __syncthreads();  // every thread has issued its copies through the old window
    for (int i = threadIdx.x; i < kTablePages; i += kThreads) {
      sh.pages[i] = window + i < a.p.pages_per_seq ? table[window + i] : -1;
    }
    __syncthreads();
  }

  // Moves the window (a block-uniform value) so that it holds the pages of the tile of
  // keys [key0, min(key0 + kKeys, end)), end > key0. Block-wide.
  __device__ void cover(int32_t key0, int32_t end, int32_t& window) const {
    if (page_of(std::min(key0 + kKeys, end) - 1) >= window + kTablePages) {
      window = page_of(key0);
      fill_pages(window);
    }
  }

  // Issues the copies of the tile of keys [key0, key0 + kKeys) into `stage` (keys >= end
  // read as zeros), moving the page window first where needed. Block-wide.
  __device__ void load_tile(int32_t key0, int32_t end, int stage, int32_t& window) const {
    cover(key0, end, window);
    if (a.page_shift >= 0) {
      copy_rows<true>(key0, end, stage, window);
    } else {
      copy_rows<false>(key0, end, stage, window);
    }
  }

  // load_tile's copies: thread t takes chunks t % kRowThreads + kRowThreads c of key rows
  // t / kRowThreads + kCopyRows i, so it looks up one page-table entry per kRowChunks
  // chunks. A key whose page lies outside the pool reads nothing (pages_ok marks the
  // sequence broken).
  template <bool kPowerOfTwo>
  __device__ __forceinline__ void copy_rows(int32_t key0, int32_t end, int stage, int32_t window) const {
    const PagedParams& p = a.p;
    const int row = static_cast<int>(threadIdx.x) / kRowThreads, part = static_cast<int>(threadIdx.x) % kRowThreads;
    const uint32_t page_size = static_cast<uint32_t>(p.page_size);
    // paged_page_ok(entry) as one unsigned comparison: negative entries wrap past 2^31 - 1
    const uint32_t pool_pages = static_cast<uint32_t>(std::min<int64_t>(p.num_pages, int64_t{1} << 31));
    const uint64_t token_bytes = static_cast<uint64_t>(p.kv_heads) * D * 2;  // one token's row of a pool
    const char* k_first = reinterpret_cast<const char*>(a.k + g * D + part * 8);  // the thread's first chunk
    const char* v_first = reinterpret_cast<const char*>(a.v + g * D + part * 8);
    const uint32_t k_row = sh.tile(stage, 0).row(row), v_row = sh.tile(stage, 1).row(row);
#pragma unroll
    for (int i = 0; i < kKeys / kCopyRows; ++i) {
      const int32_t key = key0 + row + kCopyRows * i;
      const uint32_t u = static_cast<uint32_t>(key);
      const uint32_t page = kPowerOfTwo ? u >> a.page_shift : u / page_size;
      const uint32_t slot = u - page * page_size;
      const int32_t entry = key < end ? sh.pages[page - static_cast<uint32_t>(window)] : -1;
      const bool valid = static_cast<uint32_t>(entry) < pool_pages;
      const uint64_t token = static_cast<uint64_t>(static_cast<uint32_t>(entry)) * page_size + slot;
      const uint64_t at = valid ? token * token_bytes : 0;
      const uint32_t rows_above = static_cast<uint32_t>(kCopyRows * i * T::kChunks * 16);
#pragma unroll
      for (int c = 0; c < T::kRowChunks; ++c) {
        // (row + kCopyRows i) % 8 == row % 8: the swizzle of the row's chunk
        const uint32_t offset = rows_above + static_cast<uint32_t>(((part + kRowThreads * c) ^ (row % 8)) * 16);
        copy_chunk(k_row + offset, k_first + at + 16 * kRowThreads * c, valid);
        copy_chunk(v_row + offset, v_first + at + 16 * kRowThreads * c, valid);
      }
    }
  }

  // The warp's 16 keys of the tile in `stage` (keys key0 + 16 warp ..) folded into its
  // running (m, l, o): lane-local statistics of its query columns (l summed over the lanes
  // of a column in merge()).
  __device__ void compute(int stage, int32_t key0, const Visible& vis, const uint32_t (&qb)[kQTiles][kDTiles][2],
                          float (&m)[kQTiles][2], float (&l)[kQTiles][2], float (&o)[kDTiles][kQTiles][4]) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const SwizzledTile<T::kChunks> k_rows = sh.tile(stage, 0, 16 * warp), v_rows = sh.tile(stage, 1, 16 * warp);
    // S^T = K Q^T; A = 16 keys x 16 dims of K (ldmatrix: matrix i = keys 8 (i % 2) .., dims 8 (i / 2) ..)
    // (even and odd 16-dim steps in two accumulators: half the chain of dependent products)
    float s[kQTiles][4] = {}, s_odd[kQTiles][4] = {};
    {
      const flash::LaneChunks chunks(lane / 16);
      const uint32_t k_row = k_rows.row((lane % 8) + 8 * ((lane / 8) % 2));
#pragma unroll
      for (int ks = 0; ks < kDTiles; ++ks) {
        uint32_t ka[4];
        flash::ldmatrix_x4(ka, chunks.at(k_row, ks));
#pragma unroll
        for (int nt = 0; nt < kQTiles; ++nt) {
          flash::mma_16816<ET>(ks % 2 == 0 ? s[nt] : s_odd[nt], ka, qb[nt][ks][0], qb[nt][ks][1]);
        }
      }
    }
    // s[nt][i]: key first + lane / 4 + 8 (i / 2), query column 8 nt + 2 (lane % 4) + i % 2
    const int32_t first = key0 + 16 * warp;
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = (s[nt][i] + s_odd[nt][i]) * a.p.scale;
    }
    if (first < vis.full_lo || first + 15 > vis.full_hi) {  // warp-uniform
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int32_t key = first + lane / 4 + 8 * (i / 2);
          if (key < vis.lo[nt][i % 2] || key > vis.hi[nt][i % 2]) s[nt][i] = -INFINITY;
        }
      }
    }
    uint32_t pb[kQTiles][2];  // P^T as B fragments: keys 0-7, 8-15 of the warp
    float alpha[kQTiles][2];  // the factors of the columns' past: exactly 1 where the max stayed
    bool grew = false;
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float block_max = fmaxf(s[nt][e], s[nt][e + 2]);
        block_max = fmaxf(block_max, warp_shfl_xor(block_max, 4));
        block_max = fmaxf(block_max, warp_shfl_xor(block_max, 8));
        block_max = fmaxf(block_max, warp_shfl_xor(block_max, 16));
        const float m_new = fmaxf(m[nt][e], block_max);
        // 2^((x - m) log2 e) with m = 0 while nothing is visible: -inf scores and an
        // empty past become 0, never NaN
        const float base = (m_new == -INFINITY ? 0.0f : m_new) * flash::kLog2e;
        const bool up = m_new > m[nt][e];
        alpha[nt][e] = up ? flash::fast_exp2(fmaf(m[nt][e], flash::kLog2e, -base)) : 1.0f;
        grew |= up;
        m[nt][e] = m_new;
        s[nt][e] = flash::fast_exp2(fmaf(s[nt][e], flash::kLog2e, -base));
        s[nt][e + 2] = flash::fast_exp2(fmaf(s[nt][e + 2], flash::kLog2e, -base));
        l[nt][e] = fmaf(l[nt][e], alpha[nt][e], s[nt][e] + s[nt][e + 2]);
      }
      pb[nt][0] = flash::movmatrix_trans(flash::pack2<ET>(s[nt][0], s[nt][1]));
      pb[nt][1] = flash::movmatrix_trans(flash::pack2<ET>(s[nt][2], s[nt][3]));
    }
    if (warp_ballot(grew) != 0) {  // warp-uniform; once the maxima settle, the rescale is skipped
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
        for (int nt = 0; nt < kQTiles; ++nt) {
          o[dt][nt][0] *= alpha[nt][0];
          o[dt][nt][1] *= alpha[nt][1];
          o[dt][nt][2] *= alpha[nt][0];
          o[dt][nt][3] *= alpha[nt][1];
        }
      }
    }
    // O^T += V^T P^T; A = 16 dims x 16 keys of V^T (ldmatrix.trans: matrix i = keys 8 (i / 2) ..,
    // dims 8 (i % 2) ..)
    const flash::LaneChunks chunks((lane / 8) % 2);
    const uint32_t v_row = v_rows.row((lane % 8) + 8 * (lane / 16));
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      uint32_t va[4];
      flash::ldmatrix_x4_trans(va, chunks.at(v_row, dt));
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt) flash::mma_16816<ET>(o[dt][nt], va, pb[nt][0], pb[nt][1]);
    }
  }

  // Issues the first kStages - 1 tiles of keys [begin, end) (the first one's group also
  // closes load_q's copies), the page window filled from begin's page on. Block-wide.
  __device__ void start(int32_t begin, int32_t end, int32_t& window) const {
    const int n_tiles = end > begin ? (end - begin + kKeys - 1) / kKeys : 0;
    window = n_tiles > 0 ? page_of(begin) : 0;
    if (n_tiles > 0) fill_pages(window);
#pragma unroll 1
    for (int s = 0; s < T::kStages - 1; ++s) {
      if (s < n_tiles) load_tile(begin + s * kKeys, end, s, window);
      tile_copies_commit();
    }
  }

  // After start(begin, end, window): streams keys [begin, end) through the stages and
  // merges the warps' results into out_m, out_l [kRows] and sh.merge()'s first kRows rows.
  __device__ void run(int32_t begin, int32_t end, int32_t window, float* out_m, float* out_l) const {
    const int n_tiles = end > begin ? (end - begin + kKeys - 1) / kKeys : 0;
    float m[kQTiles][2], l[kQTiles][2], o[kDTiles][kQTiles][4];
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
      m[nt][0] = m[nt][1] = -INFINITY;
      l[nt][0] = l[nt][1] = 0.0f;
    }
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) flash::zero(o[dt]);
    const Visible vis = visible_keys(end);
    tile_copies_wait<T::kStages - 2>();
    __syncthreads();  // the query rows (the first group) have landed
    uint32_t qb[kQTiles][kDTiles][2];
    load_q_fragments(qb);
    for (int t = 0; t < n_tiles; ++t) {
      tile_copies_wait<T::kStages - 2>();
      __syncthreads();  // tile t has landed; every warp is done with the stage refilled next
      const int ahead = t + T::kStages - 1;
      if (ahead < n_tiles) load_tile(begin + ahead * kKeys, end, ahead % T::kStages, window);
      tile_copies_commit();
      compute(t % T::kStages, begin + t * kKeys, vis, qb, m, l, o);
    }
    tile_copies_wait<0>();
    __syncthreads();  // the stages are free: the merge area overlays them
    merge(m, l, o, out_m, out_l);
  }

  // The warps' (m, l, o) -> one (m, l, o) per row: out_m, out_l and sh.merge()'s row r.
  __device__ void merge(const float (&m)[kQTiles][2], const float (&l)[kQTiles][2],
                        const float (&o)[kDTiles][kQTiles][4], float* out_m, float* out_l) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* merged = sh.merge();
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * nt + 2 * (lane % 4) + e;
        float sum = l[nt][e];  // over the column's 8 lanes (keys lane / 4, lane / 4 + 8)
        sum += warp_shfl_xor(sum, 4);
        sum += warp_shfl_xor(sum, 8);
        sum += warp_shfl_xor(sum, 16);
        if (lane < 4) {
          sh.stat_m[warp * T::kRows + r] = m[nt][e];
          sh.stat_l[warp * T::kRows + r] = sum;
        }
        float* dst = merged + (warp * T::kRows + r) * T::kMergeStride + lane / 4;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          dst[16 * dt] = o[dt][nt][e];
          dst[16 * dt + 8] = o[dt][nt][e + 2];
        }
      }
    }
    __syncthreads();
    // Row r's factors exp(m_w - M) per warp; then O summed into warp 0's slot.
    for (int e = threadIdx.x; e < rows * (D / 4); e += kThreads) {
      const int r = e / (D / 4), c = e % (D / 4);
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sh.stat_m[w * T::kRows + r]);
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = sh.stat_m[w * T::kRows + r];
        if (mw == -INFINITY) continue;
        const float f = expf(mw - mx);
        const float4 x = *reinterpret_cast<const float4*>(merged + (w * T::kRows + r) * T::kMergeStride + 4 * c);
        sum.x += f * x.x;
        sum.y += f * x.y;
        sum.z += f * x.z;
        sum.w += f * x.w;
        total += f * sh.stat_l[w * T::kRows + r];
      }
      *reinterpret_cast<float4*>(merged + r * T::kMergeStride + 4 * c) = sum;  // warp 0's slot: read only here
      if (c == 0) {
        out_m[r] = mx;
        out_l[r] = total;
      }
    }
    __syncthreads();
  }
};

// Whether every page of a sequence of kv_len keys lies in the pool (with paged_lengths_ok:
// paged_sequence_ok), checked by all threads at once. Block-wide.
__device__ bool pages_ok(const PagedParams& p, const int32_t* table, int32_t kv_len) {
  bool bad = false;
  for (int64_t i = threadIdx.x; i * p.page_size < kv_len; i += kThreads) bad |= !paged_page_ok(p, table[i]);
  return !__syncthreads_or(bad);
}

// grid (S * splits * Hkv * head_chunks): CTA ((s * splits + split) * Hkv + g) * head_chunks
// + chunk, so the CTAs reading one sequence's keys of one split run side by side.
template <ElementType ET, int D, int kQTiles>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(DecodeArgs a) {
  using T = Tiling<D, kQTiles>;
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the combine kernel may be placed
#endif
  extern __shared__ __align__(128) unsigned char shared_raw[];
  __shared__ float row_m[T::kRows], row_l[T::kRows];
  const Shared<D, kQTiles> sh(shared_raw);
  const PagedParams& p = a.p;
  const int head_ctas = static_cast<int>(p.kv_heads) * a.head_chunks;
  const int head_cta = static_cast<int>(blockIdx.x % head_ctas);
  const int64_t s = blockIdx.x / head_ctas / a.splits;
  const int split = static_cast<int>(blockIdx.x / head_ctas % a.splits);
  const int g = head_cta / a.head_chunks, chunk = head_cta % a.head_chunks;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int h0 = g * group + chunk * a.heads_per_cta;
  const int nh = std::min(a.heads_per_cta, group - chunk * a.heads_per_cta);
  const int64_t b = paged_row_of(p, s);
  const int32_t q_start = paged_q_start(a.q_start, s), q_len = a.q_len[s], kv_len = a.kv_len[s];
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
  // Broken data (paged.h): lengths are checked before any read, the pages while the first
  // tiles are in flight (key_offset reads nothing through a page outside the pool).
  bool ok = paged_lengths_ok(p, q_start, q_len, kv_len);  // uniform over the block
  for (int q0 = 0; ok && q0 < q_len; q0 += kMaxQueries) {
    const int nq = std::min(q_len - q0, int{kMaxQueries});
    const Pass<ET, D, kQTiles> pass{a, sh, table, g, h0, nh, q0, nh * nq, q_len, kv_len, b,
                           static_cast<int64_t>(q_start) + q0};
    const KeyRange range = visible_range(p, q0, nq, q_len, kv_len);
    int32_t begin = range.lo, end = range.hi;
    if (a.splits > 1) {
      const int32_t per = ((end - begin + a.splits - 1) / a.splits + kKeys - 1) / kKeys * kKeys;
      begin = std::min(end, begin + split * per);
      end = std::min(end, begin + per);
    }
    pass.load_q();
    int32_t window = 0;  // the page-table window's first page
    pass.start(begin, end, window);
    if (q0 == 0) {
      ok = pages_ok(p, table, kv_len);
      if (!ok) {
        tile_copies_wait<0>();  // nothing lands in shared memory after the CTA exits
        break;
      }
    }
    pass.run(begin, end, window, row_m, row_l);
    const float* merged = sh.merge();
    for (int e = threadIdx.x; e < pass.rows * (D / 4); e += kThreads) {
      const int r = e / (D / 4), c = e % (D / 4);
      const int64_t row = pass.q_row0 + r / nh, h = h0 + r % nh;
      const float4 x = *reinterpret_cast<const float4*>(merged + r * T::kMergeStride + 4 * c);
      if (a.splits > 1) {
        const int64_t at = (static_cast<int64_t>(split) * p.batch * p.seqlen_q + b * p.seqlen_q + row) * p.heads + h;
        *reinterpret_cast<float4*>(a.part_acc + at * D + 4 * c) = x;
        if (c == 0) {
          a.part_m[at] = row_m[r];
          a.part_l[at] = row_l[r];
        }
      } else {
        SoftmaxState st{row_m[r], row_l[r], row_m[r] != -INFINITY};
        float inv = 0.0f;
        st.finalize(p.softmax_type, softmax_sink_logit(p.softmax_type, paged_softmax_offset(a.offset, h)), &inv);
        *reinterpret_cast<uint2*>(a.o + o_offset(p, b, row, h) + 4 * c) =
            make_uint2(flash::pack2<ET>(x.x * inv, x.y * inv), flash::pack2<ET>(x.z * inv, x.w * inv));
      }
    }
    __syncthreads();  // before the next pass overwrites q, the merge area and the statistics
  }
  if (a.splits > 1 && threadIdx.x == 0 && head_cta == 0 && split == 0) a.ok[s] = ok;
  if (!ok && split == 0) fill_rows<ET>(a, b, first, last, h0, nh, NAN);
}

// grid (S, slices): a warp per output row (query i of sequence s, head h), the sequence's
// rows r = i H + h taken by its warps in turn. A row costs two rounds of loads whatever its
// number of splits: the lanes read 32 splits' (m, l) at once (lane z: split z) and reduce
// them by shuffles, then each lane sums its 4 columns of those splits' accumulators, every
// load of the round issued before the sums. A split that saw no key (m = -inf) holds zeros
// and gets the factor 0.
template <ElementType ET>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(DecodeArgs a) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the split kernel has finished, its writes visible
#endif
  const PagedParams& p = a.p;
  const int64_t s = blockIdx.x;
  const int32_t q_len = a.q_len[s];
  if (q_len <= 0 || !a.ok[s]) return;
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.batch * p.seqlen_q * p.heads;
  const int64_t q_row0 = paged_row_of(p, s) * p.seqlen_q + paged_q_start(a.q_start, s);
  // 32-bit row indices (launch() bounds seqlen_q * heads): no 64-bit division in the loop
  const uint32_t heads = static_cast<uint32_t>(p.heads), warps = kCombineThreads / 32 * gridDim.y;
  for (uint32_t r = blockIdx.y * (kCombineThreads / 32) + threadIdx.x / 32; r < q_len * heads; r += warps) {
    const int64_t h = r % heads;
    const int64_t row = (q_row0 + r / heads) * p.heads + h;
    float m = -INFINITY;
    for (int z = lane; z < a.splits; z += 32) m = fmaxf(m, a.part_m[z * rows + row]);
#pragma unroll
    for (int mask = 16; mask >= 1; mask /= 2) m = fmaxf(m, warp_shfl_xor(m, mask));
    float l = 0.0f;
    for (int z = lane; z < a.splits; z += 32) {
      const float mz = a.part_m[z * rows + row];
      if (mz != -INFINITY) l += a.part_l[z * rows + row] * expf(mz - m);
    }
#pragma unroll
    for (int mask = 16; mask >= 1; mask /= 2) l += warp_shfl_xor(l, mask);
    SoftmaxState st{m, l, m != -INFINITY};
    float inv = 0.0f;
    st.finalize(p.softmax_type, softmax_sink_logit(p.softmax_type, paged_softmax_offset(a.offset, h)), &inv);
    for (int64_t c = 4 * lane; c < p.head_dim_v; c += 4 * 32) {
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int z0 = 0; z0 < a.splits; z0 += 32) {
        const float mz = z0 + lane < a.splits ? a.part_m[(z0 + lane) * rows + row] : -INFINITY;
        const float factor = mz == -INFINITY ? 0.0f : expf(mz - m);  // of split z0 + lane
        const int n = std::min(a.splits - z0, 32);
#pragma unroll 4
        for (int z = 0; z < n; ++z) {
          const float f = warp_shfl(factor, z);
          const float4 x = *reinterpret_cast<const float4*>(a.part_acc + ((z0 + z) * rows + row) * p.head_dim_v + c);
          sum.x += f * x.x;
          sum.y += f * x.y;
          sum.z += f * x.z;
          sum.w += f * x.w;
        }
      }
      *reinterpret_cast<uint2*>(a.o + row * p.head_dim_v + c) =
          make_uint2(flash::pack2<ET>(sum.x * inv, sum.y * inv), flash::pack2<ET>(sum.z * inv, sum.w * inv));
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

// Launches combine_kernel after the split kernel on `stream`: on sm_90 and newer as a
// programmatic dependent launch (it waits in griddepcontrol.wait), else in stream order.
template <ElementType ET>
cudaError_t launch_combine(gpuStream_t stream, const DecodeArgs& a) {
  int device = 0, major = 0;
  const bool dependent = cudaGetDevice(&device) == cudaSuccess &&
                         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                         major >= 9;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  // enough warps for a row each at up to kMaxQueries queries a sequence (more loop)
  const int64_t slices = (std::min<int64_t>(a.p.seqlen_q, kMaxQueries) * a.p.heads + kCombineThreads / 32 - 1) /
                         (kCombineThreads / 32);
  config.gridDim = dim3(static_cast<unsigned>(a.p.sequences), static_cast<unsigned>(std::min<int64_t>(slices, 65535)));
  config.blockDim = dim3(kCombineThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = dependent ? &attribute : nullptr;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, combine_kernel<ET>, a);
}

template <ElementType ET, int D, int kQTiles>
ffi::Error launch(const char* op, gpuStream_t stream, DecodeArgs a, ffi::Result<ffi::AnyBuffer>& workspace) {
  using T = Tiling<D, kQTiles>;
  const PagedParams& p = a.p;
  auto* kernel = paged_decode_kernel<ET, D, kQTiles>;
  // The largest shared-memory carveout, so that as many CTAs fit per SM as the occupancy
  // query below counts.
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(T::kSharedBytes)) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
    return launch_status(op);
  }
  int resident_per_sm = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident_per_sm, kernel, kThreads, T::kSharedBytes) !=
      cudaSuccess) {
    return launch_status(op);
  }
  if (p.seqlen_q * p.heads > std::numeric_limits<uint32_t>::max()) {
    return invalid(op, "the CUDA paged decode kernel takes at most 2^32 - 1 query rows x heads per q row, got " +
                           std::to_string(p.seqlen_q) + " x " + std::to_string(p.heads) +
                           "; pass fewer query rows per call (split the queries into chunks)");
  }
  const int64_t group = p.heads / p.kv_heads;
  const int64_t queries = std::min<int64_t>(p.seqlen_q, kMaxQueries);
  a.heads_per_cta = static_cast<int>(std::min<int64_t>(group, T::kRows / queries));
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
  const int64_t grid = ctas * a.splits;
  if (grid > std::numeric_limits<int32_t>::max()) {
    return invalid(op, "the CUDA paged decode kernel launches at most 2^31 - 1 CTAs (sequences x K/V heads x "
                       "head chunks x splits), got " + std::to_string(grid) + "; decode fewer sequences per call");
  }
  kernel<<<static_cast<unsigned>(grid), kThreads, T::kSharedBytes, stream>>>(a);
  if (a.splits > 1 && launch_combine<ET>(stream, a) != cudaSuccess) return launch_status(op);
  return launch_status(op);
}

// The kernel with the fewest query tiles that hold a K/V head's group times the call's
// queries per pass (up to max_query_tiles; a larger group takes several head chunks).
template <ElementType ET, int D>
ffi::Error launch_for_group(const char* op, gpuStream_t stream, const DecodeArgs& a,
                            ffi::Result<ffi::AnyBuffer>& workspace) {
  const int64_t rows = a.p.heads / a.p.kv_heads * std::min<int64_t>(a.p.seqlen_q, kMaxQueries);
  if constexpr (max_query_tiles<D>() >= 2) {
    if (rows > 8) return launch<ET, D, 2>(op, stream, a, workspace);
  }
  return launch<ET, D, 1>(op, stream, a, workspace);
}

ffi::Error PagedDecodeFwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer page_table, ffi::AnyBuffer q_start, ffi::AnyBuffer q_len,
                              ffi::AnyBuffer kv_len, ffi::AnyBuffer softmax_offset, ffi::Result<ffi::AnyBuffer> o,
                              ffi::Result<ffi::AnyBuffer> workspace, float scale, bool causal, bool bottom_right,
                              int64_t window_left, int64_t window_right, int32_t softmax_type,
                              int64_t max_seqlen_q, int64_t max_seqlen_kv) {
  constexpr const char* kOp = "fusedattn_paged_decode_fwd (CUDA)";
  PagedParams p;
  if (auto e = parse_paged_decode_call(kOp, q, k, v, page_table, q_start, q_len, kv_len, softmax_offset, o, scale,
                                       causal, bottom_right, window_left, window_right, softmax_type, max_seqlen_q,
                                       max_seqlen_kv, &p);
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
  a.page_shift = (p.page_size & (p.page_size - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(p.page_size)) : -1;
  a.q = static_cast<const uint16_t*>(q.untyped_data());
  a.k = static_cast<const uint16_t*>(k.untyped_data());
  a.v = static_cast<const uint16_t*>(v.untyped_data());
  a.page_table = page_table.typed_data<int32_t>();
  a.q_start = optional_operand<int32_t>(q_start);
  a.q_len = q_len.typed_data<int32_t>();
  a.kv_len = kv_len.typed_data<int32_t>();
  a.offset = optional_operand<float>(softmax_offset);
  a.o = static_cast<uint16_t*>(o->untyped_data());
  const ElementType et = element_type_of(q.element_type());
  auto by_dim = [&](auto et_constant) -> ffi::Error {
    constexpr ElementType kET = decltype(et_constant)::value;
    switch (p.head_dim) {
      case 64: return launch_for_group<kET, 64>(kOp, stream, a, workspace);
      case 128: return launch_for_group<kET, 128>(kOp, stream, a, workspace);
      default: return launch_for_group<kET, 256>(kOp, stream, a, workspace);
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
