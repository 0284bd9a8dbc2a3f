// The flash backward for Hopper (sm_90a): the gradients of ../backward.cuh (the same
// contract: P recomputed from the saved lse, +inf for a row without visible keys giving
// P = 0; delta = rowsum(dO o O) and the sink's gradient from the shared prologue) from
// warpgroup matrix products, in the FlashAttention-3 arrangement.
//
// A block owns kN = 128 keys of one (batch row, K/V head) and has three warpgroups (at head
// dim 256, 64 keys whose work the consumers split otherwise: consume_backward_split):
//   warpgroup 0, the producer: one thread loads the block's K and V tiles once, then, for
//     each (query head of the GQA group, query tile of kM = 64) that some of the keys can
//     see (one warp searches them, ../spans.cuh, 32 at a time), that tile's Q and dO with
//     TMA into a ring of two stages on mbarriers, with the tile's rows of lse and delta
//     (the warp's lanes), publishing the tile, whether every pair is visible and whether
//     it may hold padding queries, and for a tile that is not all visible the keys each
//     of its queries sees (the mask then reads shared memory) and, with ALiBi (kAlibi), the
//     diagonals of its queries; -1 ends the loop.
//   warpgroups 1 and 2, the consumers, 64 keys each, per query tile:
//     S^T = K Q^T and dP^T = V dO^T (wgmma, both operands in shared memory);
//     P^T = exp(scale S^T - lse) (masked elements set to 0 by selection);
//     dS^T = P^T o (dP^T - delta) (with dropout: P^T o (drop o dP^T - delta), and P^T o drop
//       for dV, the shared Philox element by element);
//     dV += P^T dO and dK += dS^T Q (wgmma, P^T and dS^T from registers), float32 registers
//       for the whole block;
//     dS to shared memory (stmatrix.trans of dS^T: [kM queries x kN keys], each consumer
//     its atom of 64 keys; two buffers), then dQ_tile^T = K^T dS^T, each consumer 64
//     head-dim columns of its part of the tile (wgmma, both operands in shared memory, the
//     queries as N: FlashAttention-3's "dQ_swapAB"), stored to shared memory in the order of
//     its registers and added to a float32 workspace by one bulk reduction of the warpgroup
//     (cp.reduce.async.bulk ... add.f32): dQ is not bitwise repeatable.
//     After the last tile (both consumers' products done) each stages its dK (times scale)
//     and dV in the element type over the Q and dO stages (stmatrix), and one of its threads
//     writes them with TMA stores.
//     With ALiBi each warp sums its part of the slope's gradient per query head into its own
//     slot (../alibi_tile.cuh; launch.h: slope_slots), added up by slope_gradient.cu. With a
//     bias array (kBias) its term joins S^T before the exponentials and each pair's term of
//     its gradient is stored from dS^T (the block is the one visitor of its pairs;
//     ../bias_tile.cuh), summed over broadcast dims by bias_gradient.cu.
// A last kernel writes dq = scale * that sum in the element type (dq_convert_kernel reads
// the workspace's order: DqAccumulator). Padding tokens (segment
// id 0) have their K, V, Q and dO rows zeroed in shared memory, so that garbage there
// (even NaN) reaches no gradient.
#ifndef FUSEDATTN_FLASH_SM90_BACKWARD_CUH_
#define FUSEDATTN_FLASH_SM90_BACKWARD_CUH_

#include <cmath>

#include "../alibi_tile.cuh"
#include "../bias_tile.cuh"
#include "../backward.cuh"
#include "launch.h"
#include "primitives.cuh"
#include "tiles.cuh"
#include "trace.cuh"

namespace fusedattn {
namespace flash {
namespace sm90 {

// The barriers and the published query tiles, after the operand tiles in shared memory:
// kStages stages (three: a tile's loads are issued two tiles before it is needed) of kM
// queries.
template <int kStages, int kM>
struct BackwardControl {
  uint64_t kv_full;
  uint64_t full[kStages];   // Q and dO of the stage, and its published rows
  uint64_t empty[kStages];  // released by the consumers once dV and dK have read them
  int32_t head[kStages];    // the query head of the stage's tile; -1: no more
  int32_t first[kStages];   // its first query
  int32_t all_visible[kStages];
  int32_t padded[kStages];  // the query tile may hold padding queries (segment id 0)
  // Per stage and query of the tile: lse * log2(e) and delta (+inf and 0 past the end and
  // for padding queries: P = 0 and dS = 0 whatever dO holds there).
  alignas(8) float lse_log2[kStages][kM];  // (read two queries at a time)
  alignas(8) float delta[kStages][kM];
  // Of a tile that is not all visible: the keys each query sees (the consumers' mask).
  QueryRange sees[kStages][kM];
  // With ALiBi: each query's diagonal (q_pos + q_diag; 0 past the end), as float32.
  float diagonal[kStages][kM];
};

template <int D>
struct BackwardTiles {
  // Head dim 256 splits the work of a block between its consumers (consume_backward_split):
  // one consumer's dK and dV of 64 keys would alone fill its registers there.
  static constexpr bool kSplit = D == 256;
  static constexpr int kN = backward_key_tile(D);  // keys per block (64 at d256)
  static constexpr int kConsumerKeys = 64;  // the keys of a consumer's products (M): one swizzle atom of dS
  static constexpr int kM = kBackwardQueryTile;  // queries per streamed tile
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kAtoms = D / kAtomColumns;
  // The queries of a consumer's S^T and dP^T (split: half the tile each) and the head-dim
  // columns of its dK and dV (split: half each).
  static constexpr int kConsumerQueries = kSplit ? kM / 2 : kM;
  static constexpr int kConsumerDims = kSplit ? D / 2 : D;
  // dQ_tile^T in parts of 64 head-dim columns (atom part % kAtoms) x kDqQueries queries
  // (from (part / kAtoms) kDqQueries): d128, two parts, consumer cw's is part cw (every
  // query); d64, two parts, half the queries each; split, one part per atom, each consumer
  // two (those of its head-dim columns).
  static constexpr int kDqQueries = kSplit ? kM : kM * kAtoms / 2;
  static constexpr int kDqParts = kAtoms * kM / kDqQueries;
  static constexpr int kKeyBytes = kN * D * 2;    // K or V
  static constexpr int kQueryBytes = kM * D * 2;  // a Q or dO tile
  static constexpr int kDsAtomBytes = kM * kAtomRowBytes;  // dS's keys of one consumer
  static constexpr int kDsBytes = kN / kConsumerKeys * kDsAtomBytes;  // dS [kM queries x kN keys]
  static constexpr int kDqBytes = kDqQueries * kAtomColumns * 4;  // a dQ_tile^T part, float32
  using Control = BackwardControl<kStages, kM>;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKeyBytes;
  static constexpr int kQOffset = 2 * kKeyBytes;  // stage s at + s * kQueryBytes
  static constexpr int kDoOffset = kQOffset + kStages * kQueryBytes;
  // Two buffers of kDsBytes: dS of alternate tiles, or (split) P and dS of each tile.
  static constexpr int kDsOffset = kDoOffset + kStages * kQueryBytes;
  // Consumer cw's dQ part at + cw * kDqBytes (split: none, its parts go to global memory
  // by vector reductions from registers: two 32 KB buffers do not fit beside the tiles).
  static constexpr int kDqOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kControlOffset = kDqOffset + (kSplit ? 0 : 2 * kDqBytes);
  // At the block's end, consumer cw's dK and dV in the element type (kConsumerKeys rows of
  // its kConsumerDims columns, in swizzle atoms) for TMA stores: its dK at kQOffset + 2 cw
  // kGradientBytes, its dV right after, over the Q and dO stages (no product reads them then).
  static constexpr int kGradientBytes = kConsumerKeys * kConsumerDims * 2;
  static_assert(kDoOffset == kQOffset + kStages * kQueryBytes && 2 * 2 * kGradientBytes <= kStages * 2 * kQueryBytes &&
                    kGradientBytes % 1024 == 0,
                "both consumers' dK and dV fit in the Q and dO stages, in aligned swizzle atoms");
  // 1024: room to align the start (the swizzle atoms need 1024-byte alignment).
  static constexpr int kSharedBytes = kControlOffset + static_cast<int>(sizeof(Control)) + 1024;
  static_assert(kSharedBytes <= kMaxSharedBytes, "the tiles' shared memory exceeds a block's");
  // 24 + 2 x 240 = 3 x 168 (the registers at entry): setmaxnreg.inc waits until the
  // block's pool holds what it asks for, so a larger producer share would hang the block.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(kM % 32 == 0 && kDqQueries % 8 == 0 && kN == (kSplit ? 1 : 2) * kConsumerKeys &&
                    kConsumerKeys == kAtomColumns,
                "lse and delta two queries a lane; whole products of dQ^T (N = kDqQueries); a dS atom per consumer");
  static_assert(kQueryBytes % 1024 == 0 && kDsAtomBytes % 1024 == 0 && kDqOffset % 1024 == 0,
                "swizzle atoms 1024-byte aligned");
  static_assert(kConsumerThreads / 32 == kSlopeWarpsPerKeyTile, "the slope-gradient slots of launch.h");
};

// The float32 dQ accumulator's order: per (batch row, head, query tile of kM, part) a block
// of kDqQueries x 64 floats, holding a consumer warpgroup's product for that part as its
// registers hold it: float4 t of consumer thread c (dq[t][0..3]: head-dim columns r and
// r + 8 of the part's atom, r = 16 (c / 32) + c % 32 / 4, queries 2 (c % 4) + 8 t + 0..1 of
// the part) at float (t * 128 + c) * 4, so that the warps' stores are contiguous and the
// block is one bulk reduction (or, split, 16 bytes a thread).
template <int D>
struct DqAccumulator {
  static constexpr int kM = BackwardTiles<D>::kM;
  static constexpr int kParts = BackwardTiles<D>::kDqParts;
  static constexpr int kBlockFloats = BackwardTiles<D>::kDqBytes / 4;
  // The blocks of batch row b: block(h, m0, part) is that of head h, the query tile at m0
  // and the part (the row's base and the tile count computed once, outside a block's loop).
  float* base;
  int64_t tiles;
  __device__ DqAccumulator(float* accum, int64_t b, int64_t heads, int64_t seqlen_q) : tiles((seqlen_q + kM - 1) / kM) {
    base = accum + b * heads * tiles * kParts * kBlockFloats;
  }
  __device__ float* block(int64_t h, int64_t m0, int part) const {
    return base + ((h * tiles + m0 / kM) * kParts + part) * kBlockFloats;
  }
};

// The kernel's arguments: the call, the float32 dQ accumulator and TMA descriptors of q,
// dout (boxes of kM rows), k and v (kN rows), dk and dv (kConsumerKeys rows: a consumer's
// stores); a __grid_constant__ parameter.
struct BackwardArgs {
  CUtensorMap q_map;
  CUtensorMap do_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap dk_map;
  CUtensorMap dv_map;
  FlashArgs a;
  float* dq_accum;  // DqAccumulator<D>::floats, zero before the kernel
};

// The producer: warp 0 (lane 0 issues the copies and publishes the tiles).
template <int D, bool kAlibi>
__device__ __forceinline__ void produce_backward(const BackwardArgs& args, uint32_t base, typename BackwardTiles<D>::Control* control,
                                                 int64_t b, int64_t g, int64_t n0) {
  using T = BackwardTiles<D>;
  const AttentionParams& p = args.a.p;
  const int64_t group = p.heads / p.kv_heads;
  const HeadContext c = head_context(args.a, b, g * group);  // the token row: shared by the group
  const bool leader = threadIdx.x == 0;
  if (leader) {
    prefetch_tensor_map(&args.q_map);
    prefetch_tensor_map(&args.do_map);
    prefetch_tensor_map(&args.k_map);
    prefetch_tensor_map(&args.v_map);
    const uint32_t bar = smem_address(&control->kv_full);
    mbarrier_arrive_expect_tx(bar, 2 * T::kKeyBytes);
#pragma unroll
    for (int atom = 0; atom < T::kAtoms; ++atom) {
      tma_load_4d(base + T::kKOffset + atom * T::kN * kAtomRowBytes, &args.k_map, bar, atom * kAtomColumns,
                  static_cast<int>(g), static_cast<int>(n0), static_cast<int>(b));
      tma_load_4d(base + T::kVOffset + atom * T::kN * kAtomRowBytes, &args.v_map, bar, atom * kAtomColumns,
                  static_cast<int>(g), static_cast<int>(n0), static_cast<int>(b));
    }
  }
  const Span kv_span = tile_span<T::kN>(c.kv_spans, c.n_kv_spans, n0);
  const int n_q_tiles = static_cast<int>((p.seqlen_q + T::kM - 1) / T::kM);
  const int n_units = static_cast<int>(group) * n_q_tiles;
  TileScan scan{-32, 0u, 0u, 0u};
  int u = -1;
  for (int i = 0;; ++i) {
    u = next_visible(scan, u, n_units, [&](int unit, bool* complete) {
      const Span q = tile_span<T::kM>(c.q_spans, c.n_q_spans, static_cast<int64_t>(unit % n_q_tiles) * T::kM);
      *complete = q.complete != 0;
      return relate(p.mask, q, kv_span);
    });
    const int s = i % T::kStages;
    if (i >= T::kStages) mbarrier_wait(smem_address(&control->empty[s]), (i / T::kStages - 1) & 1);
    // The tile's head and first query.
    const int h = static_cast<int>(g * group) + u / n_q_tiles, m0 = (u % n_q_tiles) * T::kM;
    const uint32_t bar = smem_address(&control->full[s]);
    if (leader && u < n_units) {  // the copies first: their latency covers the loads below
      mbarrier_arrive_expect_tx(bar, 2 * T::kQueryBytes);
#pragma unroll
      for (int atom = 0; atom < T::kAtoms; ++atom) {
        const uint32_t offset = s * T::kQueryBytes + atom * T::kM * kAtomRowBytes;
        tma_load_4d(base + T::kQOffset + offset, &args.q_map, bar, atom * kAtomColumns, h, m0, static_cast<int>(b));
        tma_load_4d(base + T::kDoOffset + offset, &args.do_map, bar, atom * kAtomColumns, h, m0,
                    static_cast<int>(b));
      }
    }
    if (u < n_units) {  // the tile's rows of lse and delta, two queries a lane
      const int64_t row = (b * p.heads + h) * p.seqlen_q;
#pragma unroll
      for (int k = 0; k < T::kM / 32; ++k) {
        const int q = static_cast<int>(threadIdx.x % 32) + 32 * k;
        const bool inside = m0 + q < p.seqlen_q;
        // Loaded together (one latency), then selected: a padding query sees no key
        // (P = 0); its delta, from garbage dO, may be NaN.
        const int32_t seg = inside ? c.q_seg[m0 + q] : 0;
        const float lse = inside ? args.a.lse[row + m0 + q] : 0.0f;
        const float delta = inside ? args.a.delta[row + m0 + q] : 0.0f;
        control->lse_log2[s][q] = seg != 0 ? lse * kLog2e : INFINITY;
        control->delta[s][q] = seg != 0 ? delta : 0.0f;
        if (!((scan.full >> (u - scan.first)) & 1u)) {
          control->sees[s][q] = query_range(p.mask, query_token(c, m0 + q, p.seqlen_q));
        }
        if constexpr (kAlibi) control->diagonal[s][q] = query_diagonal(c, m0 + q, p.seqlen_q);
      }
    }
    __syncwarp();
    if (leader) {  // the stage's second arrival (the first: the copies'), after the lanes' stores
      if (u >= n_units) {
        control->head[s] = -1;
        mbarrier_arrive(bar);
      } else {
        const int bit = u - scan.first;
        control->head[s] = h;
        control->first[s] = m0;
        control->all_visible[s] = (scan.full >> bit) & 1u;
        control->padded[s] = (scan.padded >> bit) & 1u;
      }
      mbarrier_arrive(bar);
    }
    __syncwarp();  // the lanes stay in step (next_visible is warp-wide)
    if (u >= n_units) return;
  }
}

// Packs a warp's [16 x kCols] float fragments into the A operands (16 x 16 each) of a
// product from registers (mma.cuh: two adjacent C tiles make one A fragment).
template <ElementType ET, int kCols>
__device__ __forceinline__ void pack_operand(const float (&x)[kCols / 8][4], uint32_t (&a)[kCols / 16][4]) {
#pragma unroll
  for (int ks = 0; ks < kCols / 16; ++ks) {
    a[ks][0] = pack2<ET>(x[2 * ks][0], x[2 * ks][1]);
    a[ks][1] = pack2<ET>(x[2 * ks][2], x[2 * ks][3]);
    a[ks][2] = pack2<ET>(x[2 * ks + 1][0], x[2 * ks + 1][1]);
    a[ks][3] = pack2<ET>(x[2 * ks + 1][2], x[2 * ks + 1][3]);
  }
}

// Stores a warp's dS^T operands (rows: keys row0 + lane / 4 (+ 8) of its consumer's 64,
// columns: the kM queries) transposed, as rows of dS, into that consumer's swizzle atom at
// ds ([kM queries x 128 bytes]). Operand register j of 16 columns ks is the 8 x 8 matrix of
// keys 8 (j % 2) .., queries 16 ks + 8 (j / 2) ..: stmatrix.trans writes it to rows
// 16 ks + 8 (j / 2) .., chunk row0 / 8 + j % 2: matrix 2 (j % 2) + j / 2 of matrix_row_address.
template <int kM>
__device__ __forceinline__ void store_scores(uint32_t ds, int row0, int lane, const uint32_t (&a)[kM / 16][4]) {
#pragma unroll
  for (int ks = 0; ks < kM / 16; ++ks) {
    const uint32_t matrices[4] = {a[ks][0], a[ks][2], a[ks][1], a[ks][3]};
    store_matrices_x4_trans(matrix_row_address(ds, 0, 16 * ks, row0 / 8, lane), matrices);
  }
}

// With ALiBi, a consumer warp's share of the slope gradient of the query head in progress,
// for its slot of the block (launch.h: slope_slots): the heads come in order, so each is
// stored when the next begins (next_head(-1) stores the last).
struct SlopeShare {
  float partial = 0.0f;
  int64_t head = -1;
  __device__ __forceinline__ void next_head(const FlashArgs& a, int64_t b, int64_t h, int64_t slot) {
    if (h == head) return;
    if (head >= 0) store_warp_partial(partial, head_slope_slots(a, b, head) + slot);
    partial = 0.0f;
    head = h;
  }
};

// The consumers' zeroing of the padding tokens' rows of two tiles of kRows rows (K and V,
// or Q and dO; see zero_padding_rows), ordered before the products that read them.
template <int kRows, int kAtoms, int kConsumerThreads>
__device__ __forceinline__ void zero_padding_tiles(uint32_t first, uint32_t second, const int32_t* seg, int64_t row0,
                                                   int64_t seqlen, int consumer_thread) {
  zero_padding_rows<kRows, kAtoms, kConsumerThreads>(first, seg, row0, seqlen, consumer_thread);
  zero_padding_rows<kRows, kAtoms, kConsumerThreads>(second, seg, row0, seqlen, consumer_thread);
  fence_proxy_async();
  named_barrier_sync(kConsumersBarrier, kConsumerThreads);
}

// The consumers' start: the block's K and V tiles landed (`landed`: the trace's stamp), then
// their padding keys' rows zeroed where the block's keys are not one complete span.
template <typename T>
__device__ __forceinline__ void wait_keys_values(typename T::Control* control, uint32_t base, const HeadContext& c,
                                                 int64_t n0, int64_t seqlen_kv, int consumer_thread,
                                                 long long& landed) {
  mbarrier_wait(smem_address(&control->kv_full), 0);
  landed = trace_clock();
  if (!tile_span<T::kN>(c.kv_spans, c.n_kv_spans, n0).complete) {
    zero_padding_tiles<T::kN, T::kAtoms, T::kConsumerThreads>(base + T::kKOffset, base + T::kVOffset, c.kv_seg, n0,
                                                              seqlen_kv, consumer_thread);
  }
}

// Query tile i of a block, once its stage has landed: the stage, the tile's head (< 0: the
// block's end, nothing else read), first query, whether every pair is visible, whether it
// may hold padding queries, and its Q and dO tiles.
struct QueryStage {
  int s;
  int64_t h, m0;
  bool all_visible, padded;
  uint32_t q_tile, do_tile;
};

template <typename T>
__device__ __forceinline__ QueryStage wait_query_stage(typename T::Control* control, uint32_t base, int i) {
  const int s = i % T::kStages;
  mbarrier_wait(smem_address(&control->full[s]), (i / T::kStages) & 1);
  return QueryStage{s,
                    control->head[s],
                    control->first[s],
                    control->all_visible[s] != 0,
                    control->padded[s] != 0,
                    base + T::kQOffset + s * T::kQueryBytes,
                    base + T::kDoOffset + s * T::kQueryBytes};
}

// S^T = K Q^T and dP^T = V dO^T of one consumer (64 key rows from k_rows and v_rows, kCols
// query rows from q_rows and do_rows, rows kN and kM apart per atom): two commit groups.
template <ElementType ET, typename T, int kCols>
__device__ __forceinline__ void issue_scores(uint32_t k_rows, uint32_t v_rows, uint32_t q_rows, uint32_t do_rows,
                                             float (&st)[kCols / 8][4], float (&dpt)[kCols / 8][4]) {
  constexpr int kDepth = T::kAtoms * kAtomColumns;
  fence_accumulators(st);
  fence_accumulators(dpt);
  cute::warpgroup_arrive();
  gmma_rows_times_rows<ET, kCols, kDepth>(k_rows, T::kN * kAtomRowBytes, q_rows, T::kM * kAtomRowBytes, st);
  cute::warpgroup_commit_batch();
  gmma_rows_times_rows<ET, kCols, kDepth>(v_rows, T::kN * kAtomRowBytes, do_rows, T::kM * kAtomRowBytes, dpt);
  cute::warpgroup_commit_batch();
}

// A consumer's elementwise work on one query tile of stage s: from S^T and dP^T (st, dpt:
// its keys, the rows of `at`, by kCols queries from qc's first column, m0 the tile's first
// query), P^T = exp(scale S^T - lse) masked, then dS^T = P^T o (drop o dP^T - delta), packed
// as A operands: weights = (P o drop)^T, scores = dS^T; with ALiBi the slope gradient's
// share adds to slope_partial. wait_dp() waits for dP^T (without dropout P^T is packed first,
// while that product runs).
template <ElementType ET, int kCols, bool kDropout, bool kAlibi, bool kBias, typename Control, typename Context,
          typename WaitDp>
__device__ __forceinline__ void tile_operands(const FlashArgs& a, const Control* control, int s, int64_t b, int64_t h,
                                              int64_t m0, bool all_visible, const FragmentCoords& at,
                                              const FragmentCoords& qc, Context context, float (&st)[kCols / 8][4],
                                              float (&dpt)[kCols / 8][4], uint32_t (&weights)[kCols / 16][4],
                                              uint32_t (&scores)[kCols / 16][4], float& slope_partial, WaitDp wait_dp) {
  const AttentionParams& p = a.p;
  const float scale_log2 = p.scale * kLog2e;
  // + 8 n + e % 2: query column (n, e); the two of each 8 with one 8-byte load
  const int column0 = static_cast<int>(qc.col0 - m0) + 2 * (at.lane % 4);
  const float* lse_log2 = control->lse_log2[s] + column0;
  const float* delta = control->delta[s] + column0;
  const auto pair_at = [](const float* x) { return *reinterpret_cast<const float2*>(x); };
  // The lane's keys' positions read again for each tile (registers: see context()).
  const KeyRows keys_at = kAlibi ? key_rows(context(), at, p.seqlen_kv) : KeyRows{};
  const float key_pos[2] = {static_cast<float>(keys_at.pos[0]), static_cast<float>(keys_at.pos[1])};
  const auto distance = [&](int n, int e) {
    return alibi_distance(control->diagonal[s][qc.col(n, e) - m0], key_pos[e / 2]);
  };
  if constexpr (kAlibi) add_alibi<kCols>(st, alibi_coefficient(a, b, h), distance);
  [[maybe_unused]] const auto query_of = [&](int n, int e) { return qc.col(n, e); };
  [[maybe_unused]] const auto key_of = [&](int, int e) { return qc.row(e); };
  if constexpr (kBias) add_bias<kCols>(st, a, b, h, query_of, key_of);
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    const float2 lse = pair_at(lse_log2 + 8 * n);
#pragma unroll
    for (int e = 0; e < 4; ++e) st[n][e] = fast_exp2(fmaf(st[n][e], scale_log2, -(e % 2 ? lse.y : lse.x)));
  }
  if (!all_visible) {
    const KeyRows keys = key_rows(context(), at, p.seqlen_kv);
    const uint32_t seen = fragment_bits<kCols>([&](int n, int e) {
      return in_range(control->sees[s][qc.col(n, e) - m0], keys.seg[e / 2], keys.pos[e / 2]);
    });
    mask_fragment(st, 0.0f, [&](int n, int e) { return ((seen >> (4 * n + e)) & 1u) != 0; });
  }
  if constexpr (!kDropout) pack_operand<ET, kCols>(st, weights);  // P^T is final: packed while dP runs
  wait_dp();
  // st: P^T; then dS^T = P^T o (drop o dP^T - delta) into dpt, and st: (P o drop)^T
  if constexpr (kDropout) {
    const HeadContext c = context();
    uint32_t kept = 0;
    static_assert(kCols % 16 == 0, "dropout bits come two tiles at a time");
#pragma unroll
    for (int n = 0; n < kCols / 8; n += 2) kept |= dropout_kept_transposed(p, c, h, qc, n) << (4 * n);
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
      const float2 row_delta = pair_at(delta + 8 * n);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float f = ((kept >> (4 * n + e)) & 1u) != 0 ? p.dropout_scale : 0.0f;
        dpt[n][e] = st[n][e] * (f * dpt[n][e] - (e % 2 ? row_delta.y : row_delta.x));
        st[n][e] *= f;
      }
    }
    pack_operand<ET, kCols>(st, weights);
  } else {
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
      const float2 row_delta = pair_at(delta + 8 * n);
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[n][e] = st[n][e] * (dpt[n][e] - (e % 2 ? row_delta.y : row_delta.x));
    }
  }
  if constexpr (kAlibi) slope_partial += alibi_slope_partial<kCols>(dpt, distance);
  if constexpr (kBias) store_bias_terms<kCols>(dpt, a, b, h, query_of, key_of);  // this block's pairs only
  pack_operand<ET, kCols>(dpt, scores);
}

// One consumer warpgroup (index cw, 0 or 1): keys n0 + 64 cw .. + 63. kDropout: p.dropout,
// kAlibi: p.alibi (template arguments, so that the loop without them carries none of their
// registers).
template <ElementType ET, int D, bool kDropout, bool kAlibi, bool kBias>
__device__ __forceinline__ void consume_backward(const BackwardArgs& args, uint32_t base, typename BackwardTiles<D>::Control* control,
                                                 int64_t b, int64_t g, int64_t n0, int cw) {
  using T = BackwardTiles<D>;
  const FlashArgs& a = args.a;
  const AttentionParams& p = a.p;
  const int64_t group = p.heads / p.kv_heads;
  // The token row and dropout key (shared by the group), derived where used (from the
  // kernel's parameters): kept in registers across the loop, they crowded the accumulators.
  const auto context = [&] { return head_context(a, b, g * group); };
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int consumer_thread = static_cast<int>(threadIdx.x) - 128;
  long long stamps[kBlockEvents] = {trace_clock()};  // the block's trace (trace.cuh)
  int tiles = 0;
  const FragmentCoords at{n0 + T::kConsumerKeys * cw + 16 * warp, 0, lane};  // rows: keys
  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);
  const uint32_t k_tile = base + T::kKOffset, v_tile = base + T::kVOffset;
  const uint32_t k_rows = k_tile + cw * T::kConsumerKeys * kAtomRowBytes;
  const uint32_t v_rows = v_tile + cw * T::kConsumerKeys * kAtomRowBytes;
  // dQ^T = K^T dS^T of this warpgroup: A = its head-dim atom of the K tile (MN-major: the
  // tile's rows are keys), B = its queries' rows of dS (K-major).
  const uint64_t k_atom = mn_major_descriptor(k_tile + (cw % T::kAtoms) * T::kN * kAtomRowBytes, T::kN * kAtomRowBytes);
  const uint32_t ds_part = (cw / T::kAtoms) * T::kDqQueries * kAtomRowBytes;

  wait_keys_values<T>(control, base, context(), n0, p.seqlen_kv, consumer_thread, stamps[1]);
  const bool dq_issuer = consumer_thread % 128 == 0;  // issues the warpgroup's dQ reductions
  const DqAccumulator<D> dq_blocks(args.dq_accum, b, p.heads, p.seqlen_q);
  SlopeShare slope;
  const int64_t slope_slot = n0 / T::kN * kSlopeWarpsPerKeyTile + 4 * cw + warp;
  for (int i = 0;; ++i) {
    const auto [s, h, m0, all_visible, padded, q_tile, do_tile] = wait_query_stage<T>(control, base, i);
    if (i == 0) stamps[2] = trace_clock();
    if constexpr (kAlibi) slope.next_head(a, b, h, slope_slot);
    if (h < 0) break;
    ++tiles;
    if (padded) {
      zero_padding_tiles<T::kM, T::kAtoms, T::kConsumerThreads>(q_tile, do_tile, context().q_seg, m0, p.seqlen_q,
                                                                consumer_thread);
    }
    float st[T::kM / 8][4], dpt[T::kM / 8][4];
    issue_scores<ET, T, T::kM>(k_rows, v_rows, q_tile, do_tile, st, dpt);
    if (i > 0) {  // the previous tile's dK (issued before these) has read its Q: that stage goes back
      cute::warpgroup_wait<2>();
      fence_accumulators(dk);
      mbarrier_arrive(smem_address(&control->empty[(i - 1) % T::kStages]));
    }

    const FragmentCoords qc{at.row0, m0, lane};  // columns: queries
    cute::warpgroup_wait<1>();
    fence_accumulators(st);
    uint32_t weights[T::kM / 16][4], scores[T::kM / 16][4];  // (P o drop)^T and dS^T as A operands
    tile_operands<ET, T::kM, kDropout, kAlibi, kBias>(a, control, s, b, h, m0, all_visible, at, qc, context, st, dpt,
                                               weights, scores, slope.partial, [&] {
                                                 cute::warpgroup_wait<0>();
                                                 fence_accumulators(dpt);
                                               });
    const uint32_t ds_tile = base + T::kDsOffset + (i % 2) * T::kDsBytes;
    store_scores<T::kM>(ds_tile + cw * T::kDsAtomBytes, 16 * warp, lane, scores);

    // dV += (P o drop)^T dO, then (both warpgroups' dS stored) dQ_tile^T = K^T dS^T, then
    // dK += dS^T Q: three commit groups. dQ's reductions run while dK's product does.
    fence_accumulators(dv);
    fence_accumulators(dk);
    cute::warpgroup_arrive();
    const uint64_t do0 = mn_major_descriptor(do_tile, T::kM * kAtomRowBytes);
#pragma unroll
    for (int ks = 0; ks < T::kM / 16; ++ks) gmma_rs<ET, D>(weights[ks], descriptor_plus(do0, ks * 16 * kAtomRowBytes), dv);
    cute::warpgroup_commit_batch();

    // The dS buffer's previous reader, two tiles back, is done: each warpgroup waits for
    // its dQ product before this barrier of the next tile. So is the previous tile's bulk
    // reduction's read of this warpgroup's dQ buffer: its issuer waits here.
    if (dq_issuer) bulk_wait_read();
    fence_proxy_async();
    named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
    // dQ_tile^T [64 head-dim columns x kDqQueries] = K^T dS^T over the kN keys (16 a product:
    // 16 rows of K's atom, 32 bytes of dS's rows, atom by atom).
    float dq[T::kDqQueries / 8][4];
    fence_accumulators(dq);
    cute::warpgroup_arrive();
    const uint64_t ds0 = k_major_descriptor(ds_tile + ds_part);
#pragma unroll
    for (int ks = 0; ks < T::kN / 16; ++ks) {
      gmma_ss_mk<ET, T::kDqQueries>(descriptor_plus(k_atom, ks * 16 * kAtomRowBytes),
                                    descriptor_plus(ds0, (ks / 4) * T::kDsAtomBytes + (ks % 4) * 32), dq, ks > 0);
    }
    cute::warpgroup_commit_batch();
    const uint64_t q0 = mn_major_descriptor(q_tile, T::kM * kAtomRowBytes);
#pragma unroll
    for (int ks = 0; ks < T::kM / 16; ++ks) gmma_rs<ET, D>(scores[ks], descriptor_plus(q0, ks * 16 * kAtomRowBytes), dk);
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // dV and dQ done (dK runs on into the next tile's products)
    fence_accumulators(dv);
    fence_accumulators(dq);
    // dQ_tile to this warpgroup's buffer (DqAccumulator's order), then one bulk reduction.
    const uint32_t dq_buffer = base + T::kDqOffset + cw * T::kDqBytes;
#pragma unroll
    for (int t = 0; t < T::kDqQueries / 8; ++t) store_shared_v4(dq_buffer + (t * 128 + consumer_thread % 128) * 16, dq[t]);
    fence_proxy_async();
    named_barrier_sync(kWarpgroupBarrier + cw, 128);
    if (dq_issuer) {
      bulk_reduce_add(dq_blocks.block(h, m0, cw), dq_buffer, T::kDqBytes);
    }
  }
  cute::warpgroup_wait<0>();  // the last dK
  fence_accumulators(dk);
  stamps[3] = trace_clock();
  if (dq_issuer) bulk_wait_read();  // the reduction completes by the kernel's end
  // dK (times scale) and dV leave through the Q and dO stages by TMA (whole 32-byte sectors,
  // where a thread's own 4-byte stores left half of each unwritten): the stages are free once
  // both warpgroups' products are done, as the producer loads nothing after publishing the
  // end. Each warpgroup stages its 64 keys' rows with stmatrix; one thread stores them (rows
  // past Skv are not written) and waits for the copies' reads before the block ends.
  named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
  const uint32_t dk_tile = base + T::kQOffset + 2 * cw * T::kGradientBytes, dv_tile = dk_tile + T::kGradientBytes;
  stage_rows<ET, D, T::kConsumerKeys>(dk, {p.scale, p.scale}, dk_tile, 16 * warp, lane);
  stage_rows<ET, D, T::kConsumerKeys>(dv, {1.0f, 1.0f}, dv_tile, 16 * warp, lane);
  fence_proxy_async();
  named_barrier_sync(kWarpgroupBarrier + cw, 128);
  if (dq_issuer) {
    const int key0 = static_cast<int>(at.row0 - 16 * warp);  // the warpgroup's first key
#pragma unroll
    for (int atom = 0; atom < T::kAtoms; ++atom) {
      const uint32_t offset = atom * T::kConsumerKeys * kAtomRowBytes;
      tma_store_4d(&args.dk_map, dk_tile + offset, atom * kAtomColumns, static_cast<int>(g), key0, static_cast<int>(b));
      tma_store_4d(&args.dv_map, dv_tile + offset, atom * kAtomColumns, static_cast<int>(g), key0, static_cast<int>(b));
    }
    bulk_wait_read();
  }
  stamps[4] = trace_clock();
  if (consumer_thread == 0) trace_block(stamps, tiles);
}

// One consumer warpgroup (index cw) of the split arrangement (head dim 256, T::kSplit):
// both consumers take the block's kN = 64 keys, consumer cw the S^T and dP^T of queries
// kConsumerQueries cw .. of each tile and dK and dV of head-dim columns kConsumerDims cw ..
// (64 keys' dK and dV of 256 columns would alone fill a consumer's registers). So P^T and
// dS^T pass through shared memory, stored query-major (stmatrix.trans) into two buffers:
// dV += (P o drop)^T dO and dK += dS^T Q read both operands there (MN-major), and dQ_tile^T =
// K^T dS^T for the consumer's two head-dim atoms (dQ parts atom0, atom0 + 1) is added to the
// float32 workspace from registers by 16-byte vector reductions. Two barriers of both
// consumers a tile: the buffers free (both consumers' products of the previous tile done),
// then written. With ALiBi each warp's slope share covers its 16 keys and its consumer's queries.
template <ElementType ET, int D, bool kDropout, bool kAlibi, bool kBias>
__device__ __forceinline__ void consume_backward_split(const BackwardArgs& args, uint32_t base,
                                                       typename BackwardTiles<D>::Control* control, int64_t b,
                                                       int64_t g, int64_t n0, int cw) {
  using T = BackwardTiles<D>;
  static_assert(T::kSplit && T::kDqQueries == T::kM && T::kConsumerDims == 2 * kAtomColumns,
                "two dQ parts of every query per consumer");
  const FlashArgs& a = args.a;
  const AttentionParams& p = a.p;
  const int64_t group = p.heads / p.kv_heads;
  const auto context = [&] { return head_context(a, b, g * group); };
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int consumer_thread = static_cast<int>(threadIdx.x) - 128;
  long long stamps[kBlockEvents] = {trace_clock()};  // the block's trace (trace.cuh)
  int tiles = 0;
  const FragmentCoords at{n0 + 16 * warp, 0, lane};  // rows: the block's keys
  float dk[T::kConsumerDims / 8][4], dv[T::kConsumerDims / 8][4];
  zero(dk);
  zero(dv);
  const uint32_t k_tile = base + T::kKOffset, v_tile = base + T::kVOffset;
  const uint32_t weights_tile = base + T::kDsOffset, scores_tile = weights_tile + T::kDsBytes;  // P, dS [kM x kN]
  const int atom0 = cw * T::kConsumerDims / kAtomColumns;  // the consumer's first head-dim atom
  const uint32_t query_rows = cw * T::kConsumerQueries * kAtomRowBytes;  // its queries' first row in a tile
  // dQ_tile^T of atom atom0 + j = K^T dS^T: A = that atom of the K tile (MN-major), B = dS (K-major).
  const uint64_t k_atoms[2] = {mn_major_descriptor(k_tile + atom0 * T::kN * kAtomRowBytes, T::kN * kAtomRowBytes),
                               mn_major_descriptor(k_tile + (atom0 + 1) * T::kN * kAtomRowBytes, T::kN * kAtomRowBytes)};
  const uint64_t scores_k = k_major_descriptor(scores_tile);
  const uint64_t weights_mn = mn_major_descriptor(weights_tile, T::kDsAtomBytes);
  const uint64_t scores_mn = mn_major_descriptor(scores_tile, T::kDsAtomBytes);

  wait_keys_values<T>(control, base, context(), n0, p.seqlen_kv, consumer_thread, stamps[1]);
  const DqAccumulator<D> dq_blocks(args.dq_accum, b, p.heads, p.seqlen_q);
  SlopeShare slope;
  const int64_t slope_slot = n0 / T::kN * kSlopeWarpsPerKeyTile + 4 * cw + warp;
  for (int i = 0;; ++i) {
    const auto [s, h, m0, all_visible, padded, q_tile, do_tile] = wait_query_stage<T>(control, base, i);
    if (i == 0) stamps[2] = trace_clock();
    if constexpr (kAlibi) slope.next_head(a, b, h, slope_slot);
    if (h < 0) break;
    ++tiles;
    if (padded) {
      zero_padding_tiles<T::kM, T::kAtoms, T::kConsumerThreads>(q_tile, do_tile, context().q_seg, m0, p.seqlen_q,
                                                                consumer_thread);
    }
    // S^T and dP^T of the consumer's queries
    float st[T::kConsumerQueries / 8][4], dpt[T::kConsumerQueries / 8][4];
    issue_scores<ET, T, T::kConsumerQueries>(k_tile, v_tile, q_tile + query_rows, do_tile + query_rows, st, dpt);
    const FragmentCoords qc{at.row0, m0 + cw * T::kConsumerQueries, lane};  // columns: queries
    cute::warpgroup_wait<1>();
    fence_accumulators(st);
    uint32_t weights[T::kConsumerQueries / 16][4], scores[T::kConsumerQueries / 16][4];
    tile_operands<ET, T::kConsumerQueries, kDropout, kAlibi, kBias>(a, control, s, b, h, m0, all_visible, at, qc, context,
                                                             st, dpt, weights, scores, slope.partial, [&] {
                                                              cute::warpgroup_wait<0>();
                                                              fence_accumulators(dpt);
                                                            });
    named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);  // the buffers' last readers are done
    store_scores<T::kConsumerQueries>(weights_tile + query_rows, 16 * warp, lane, weights);
    store_scores<T::kConsumerQueries>(scores_tile + query_rows, 16 * warp, lane, scores);
    fence_proxy_async();
    named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);

    // dQ_tile^T of the consumer's two atoms, then dV += (P o drop)^T dO and dK += dS^T Q over
    // its head-dim columns: two commit groups, so that dQ's vector reductions (the load-store
    // queue's busiest stretch) are issued while dV's and dK's products run.
    float dq[2][T::kDqQueries / 8][4];
    fence_accumulators(dq[0]);
    fence_accumulators(dq[1]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int ks = 0; ks < T::kN / 16; ++ks) {  // 16 keys: rows of K's atom, 32 bytes of dS's rows
        gmma_ss_mk<ET, T::kDqQueries>(descriptor_plus(k_atoms[j], ks * 16 * kAtomRowBytes),
                                      descriptor_plus(scores_k, ks * 32), dq[j], ks > 0);
      }
    }
    cute::warpgroup_commit_batch();
    fence_accumulators(dv);
    fence_accumulators(dk);
    const uint64_t do0 = mn_major_descriptor(do_tile + atom0 * T::kM * kAtomRowBytes, T::kM * kAtomRowBytes);
    const uint64_t q0 = mn_major_descriptor(q_tile + atom0 * T::kM * kAtomRowBytes, T::kM * kAtomRowBytes);
#pragma unroll
    for (int ks = 0; ks < T::kM / 16; ++ks) {
      const uint32_t rows = ks * 16 * kAtomRowBytes;  // 16 queries
      gmma_ss_mn<ET, T::kConsumerDims>(descriptor_plus(weights_mn, rows), descriptor_plus(do0, rows), dv, true);
      gmma_ss_mn<ET, T::kConsumerDims>(descriptor_plus(scores_mn, rows), descriptor_plus(q0, rows), dk, true);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();
    fence_accumulators(dq[0]);
    fence_accumulators(dq[1]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float* block = dq_blocks.block(h, m0, atom0 + j) + (consumer_thread % 128) * 4;
#pragma unroll
      for (int t = 0; t < T::kDqQueries / 8; ++t) reduce_add_v4(block + t * 128 * 4, dq[j][t]);
    }
    cute::warpgroup_wait<0>();
    fence_accumulators(dv);
    fence_accumulators(dk);
    mbarrier_arrive(smem_address(&control->empty[s]));  // Q and dO read: the stage goes back
  }
  stamps[3] = trace_clock();
  // dK (times scale) and dV leave through the Q and dO stages by TMA, as in consume_backward.
  named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
  const uint32_t dk_tile = base + T::kQOffset + 2 * cw * T::kGradientBytes, dv_tile = dk_tile + T::kGradientBytes;
  stage_rows<ET, T::kConsumerDims, T::kConsumerKeys>(dk, {p.scale, p.scale}, dk_tile, 16 * warp, lane);
  stage_rows<ET, T::kConsumerDims, T::kConsumerKeys>(dv, {1.0f, 1.0f}, dv_tile, 16 * warp, lane);
  fence_proxy_async();
  named_barrier_sync(kWarpgroupBarrier + cw, 128);
  if (consumer_thread % 128 == 0) {
#pragma unroll
    for (int atom = 0; atom < T::kConsumerDims / kAtomColumns; ++atom) {
      const uint32_t offset = atom * T::kConsumerKeys * kAtomRowBytes;
      const int column = (atom0 + atom) * kAtomColumns;
      tma_store_4d(&args.dk_map, dk_tile + offset, column, static_cast<int>(g), static_cast<int>(n0), static_cast<int>(b));
      tma_store_4d(&args.dv_map, dv_tile + offset, column, static_cast<int>(g), static_cast<int>(n0), static_cast<int>(b));
    }
    bulk_wait_read();
  }
  stamps[4] = trace_clock();
  if (consumer_thread == 0) trace_block(stamps, tiles);
}

template <ElementType ET, int D, bool kDropout, bool kAlibi, bool kBias = false>
__global__ void __launch_bounds__(BackwardTiles<D>::kThreads, 1)
    backward_kernel(const __grid_constant__ BackwardArgs args) {
  using T = BackwardTiles<D>;
  extern __shared__ unsigned char smem[];
  const AttentionParams& p = args.a.p;
  const uint32_t unaligned = smem_address(smem);
  const uint32_t base = (unaligned + 1023) & ~1023u;
  auto* control = reinterpret_cast<typename T::Control*>(smem + (base - unaligned) + T::kControlOffset);
  // Key tiles from the first: under a causal mask, the longest; in sections of K/V heads
  // whose queries' Q and dO fit in L2.
  const int rows = static_cast<int>(p.batch * p.kv_heads);
  const BlockTile block =
      block_tile(p.mask, blockIdx.x, static_cast<int>((p.seqlen_kv + T::kN - 1) / T::kN), rows,
                 l2_section(rows, p.seqlen_q * (p.head_dim + p.head_dim_v) * 2 * (p.heads / p.kv_heads)));
  const int64_t bg = block.row, n0 = static_cast<int64_t>(block.tile) * T::kN;
  const int64_t g = bg % p.kv_heads, b = bg / p.kv_heads;

  if (threadIdx.x == 0) {
    mbarrier_init(smem_address(&control->kv_full), 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbarrier_init(smem_address(&control->full[s]), 2);  // the copies' and the published rows'
      mbarrier_init(smem_address(&control->empty[s]), T::kConsumerThreads);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  const int warpgroup = warpgroup_index();
  if (warpgroup == 0) {
    registers_decrease<T::kProducerRegisters>();
    if (threadIdx.x < 32) produce_backward<D, kAlibi>(args, base, control, b, g, n0);
  } else {
    registers_increase<T::kConsumerRegisters>();
    if constexpr (T::kSplit) {
      consume_backward_split<ET, D, kDropout, kAlibi, kBias>(args, base, control, b, g, n0, warpgroup - 1);
    } else {
      consume_backward<ET, D, kDropout, kAlibi, kBias>(args, base, control, b, g, n0, warpgroup - 1);
    }
  }
}

// dq [B, Sq, H, D] = scale * the dQ accumulator, in the element type. A block converts one
// accumulator block at a time (kDqQueries queries x 64 head-dim columns, in DqAccumulator's
// register order): coalesced float4 loads into shared memory in query order, then 16-byte
// stores of 8 columns of a query (a store per 4 bytes made the writes the limit).
template <ElementType ET, int D>
__global__ void __launch_bounds__(256) dq_convert_kernel(const float* dq_accum, uint16_t* dq, AttentionParams p) {
  using A = DqAccumulator<D>;
  using T = BackwardTiles<D>;
  // Shared rows of 64 + 4 floats: a warp's stores (8 columns x 4 query pairs) then fall on
  // 32 different banks.
  __shared__ float rows[T::kDqQueries][kAtomColumns + 4];
  constexpr int kChunks = kAtomColumns / 8;  // 16-byte stores per query
  const int64_t tiles = (p.seqlen_q + A::kM - 1) / A::kM, blocks = p.batch * p.heads * tiles * A::kParts;
  for (int64_t block = blockIdx.x; block < blocks; block += gridDim.x) {
    const float4* src = reinterpret_cast<const float4*>(dq_accum + block * A::kBlockFloats);
    for (int i = threadIdx.x; i < A::kBlockFloats / 4; i += blockDim.x) {
      const float4 x = src[i];  // float4 t of consumer thread c at 128 t + c
      const int c = i % 128, t = i / 128, lane = c % 32;
      const int column = 16 * (c / 32) + lane / 4, query = 8 * t + 2 * (lane % 4);
      rows[query][column] = x.x;
      rows[query + 1][column] = x.y;
      rows[query][column + 8] = x.z;
      rows[query + 1][column + 8] = x.w;
    }
    __syncthreads();
    const int part = static_cast<int>(block % A::kParts);
    const int64_t tile = block / A::kParts % tiles, bh = block / A::kParts / tiles;
    const int64_t q0 = tile * A::kM + part / T::kAtoms * T::kDqQueries, d0 = part % T::kAtoms * kAtomColumns;
    for (int i = threadIdx.x; i < T::kDqQueries * kChunks; i += blockDim.x) {
      const int row = i / kChunks, chunk = i % kChunks;
      const int64_t query = q0 + row;
      if (query < p.seqlen_q) {
        const float* x = &rows[row][8 * chunk];
        uint4 packed;
        packed.x = pack2<ET>(x[0] * p.scale, x[1] * p.scale);
        packed.y = pack2<ET>(x[2] * p.scale, x[3] * p.scale);
        packed.z = pack2<ET>(x[4] * p.scale, x[5] * p.scale);
        packed.w = pack2<ET>(x[6] * p.scale, x[7] * p.scale);
        const int64_t element = ((bh / p.heads * p.seqlen_q + query) * p.heads + bh % p.heads) * D + d0;
        *reinterpret_cast<uint4*>(dq + element + 8 * chunk) = packed;
      }
    }
    __syncthreads();  // before the next block's rows overwrite these
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_BACKWARD_CUH_
