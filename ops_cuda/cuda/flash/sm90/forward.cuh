// The flash forward kernel for Hopper (sm_90a): the same results as the sm_80 kernel
// (../forward.cuh: o, and lse for the backward) from warpgroup matrix products.
//
// The kernel is persistent: one block per SM takes work items in turn, each kM = 128
// queries of one (batch row, head); the barriers' phases run on across items, and the
// next item's Q (two stages) and first K tile load while an item runs. A block has three
// warpgroups:
//   warpgroup 0, the producer: one warp finds the K and V tiles that the queries can see
//     (../spans.cuh; 32 tiles at a time, a lane each, one tile ahead of the loads) and one
//     thread loads, with TMA, the next item's Q tile in the middle of an item, and the K
//     and V tiles into rings of three K (two at d128) and two V stages (each pass
//     publishes tile i's K and then loads tile i - 1's V); K and V complete on mbarriers
//     of their own and are released by the consumers through "empty" mbarriers of their
//     own (K once the tile's row maxima are known). With each K it publishes the tile's
//     index, whether it is the item's last, whether every pair is visible and whether the
//     tile may hold padding keys, and for a tile that is not all visible its keys' segment
//     ids and positions (the mask reads them from shared memory; with ALiBi, kAlibi, those
//     of every tile: the term of ../alibi_tile.cuh reads the positions); an item without a
//     visible tile gets an index of -1.
//   warpgroups 1 and 2, the consumers, 64 queries each (consume): S = Q K^T by wgmma from
//     shared memory, the online softmax of ../softmax_tile.cuh in float32 registers,
//     O += P V by wgmma with P from registers and V from shared memory; tile i's S is
//     issued with tile i - 1's P V, which is waited for once tile i's row maxima are known
//     (O's rescale then runs among the exponentials). The two
//     take turns issuing (named barriers), so that one's softmax overlaps the other's
//     products; O leaves through their rows of the item's Q stage. In a tile with padding
//     keys they first zero those keys' V rows (garbage there, even NaN, reaches no output; K's
//     garbage is masked by selection).
// setmaxnreg moves registers from the producer to the consumers.
#ifndef FUSEDATTN_FLASH_SM90_FORWARD_CUH_
#define FUSEDATTN_FLASH_SM90_FORWARD_CUH_

#include "../alibi_tile.cuh"
#include "../bias_tile.cuh"
#include "../softmax_tile.cuh"
#include "primitives.cuh"
#include "tiles.cuh"
#include "trace.cuh"

namespace fusedattn {
namespace flash {
namespace sm90 {

// The barriers and the published tiles, after the operand tiles in shared memory.
// K has more stages than V (three, two at d128 where a third does not fit beside two Q
// stages): a tile's K is read first (S = Q K^T) and V one loop pass later (its O += P V is
// issued with the next tile's S), so K's loads need the longer lead.
struct Control {
  static constexpr int kMaxKeys = 128;  // the largest tile
  static constexpr int kQueryStages = 2, kKeyStages = 3, kValueStages = 2;
  uint64_t q_full[kQueryStages];
  uint64_t q_empty[kQueryStages];  // the item's O has left the Q tile (one arrival per consumer warpgroup)
  uint64_t k_full[kKeyStages];
  uint64_t v_full[kValueStages];
  uint64_t k_empty[kKeyStages];   // released by the consumers once the tile's row maxima are known
  uint64_t v_empty[kValueStages];  // released once O += P V is done
  int32_t tile[kKeyStages];        // key tile of the K stage, -1: the item has none
  int32_t last[kKeyStages];        // the item's last tile
  int32_t full[kKeyStages];        // every (query, key) pair of the tile is visible
  int32_t padded[kKeyStages];      // the tile may hold padding keys (segment id 0) within the sequence
  // Of a tile whose key tokens are published: its keys are one segment at consecutive
  // positions (key r at key_pos[s][0] + r), all within the sequence.
  int32_t consecutive[kKeyStages];
  // Of a tile that is not full (with ALiBi: of every tile): its keys' segment ids (0 past
  // the end) and positions, for the consumers' mask (shared memory, not a global load per
  // element).
  int32_t key_seg[kKeyStages][kMaxKeys];
  int32_t key_pos[kKeyStages][kMaxKeys];
};

template <int D>
struct ForwardTiles {
  static constexpr int kM = 128;                 // queries per block
  static constexpr int kConsumerRows = 64;       // per consumer warpgroup
  // Keys per tile. Registers per consumer thread: S kN/2 floats, P kN/4, O D/2. At d256
  // S = Q K^T reads its A operand (Q) from shared memory for every 64 x kN x 16 product, so
  // a tile of 32 keys made it bound by shared-memory reads (3 KB per 16 clocks); 64 halves that.
  static constexpr int kN = D == 256 ? 64 : 128;
  // Two Q stages: the next item's Q loads while this item runs (one at d256, where a second
  // does not fit beside two K and two V stages of 64 keys: the next Q then loads once this
  // item's O has left). Beside them three K stages fit at d64; at d128 they would take
  // 233,624 bytes, so K has two there.
  static constexpr int kQueryStages = D == 256 ? 1 : Control::kQueryStages;
  static constexpr int kKeyStages = D == 64 ? Control::kKeyStages : 2;
  static constexpr int kValueStages = Control::kValueStages;
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kAtoms = D / kAtomColumns;
  static constexpr int kQBytes = kM * D * 2;
  static constexpr int kTileBytes = kN * D * 2;  // one K or V tile
  static constexpr int kKOffset = kQueryStages * kQBytes;
  static constexpr int kVOffset = kKOffset + kKeyStages * kTileBytes;
  static constexpr int kControlOffset = kVOffset + kValueStages * kTileBytes;
  // 1024: room to align the start (the swizzle atoms need 1024-byte alignment).
  static constexpr int kSharedBytes = kControlOffset + static_cast<int>(sizeof(Control)) + 1024;
  static_assert(kSharedBytes <= kMaxSharedBytes, "the tiles' shared memory exceeds a block's");
  // The producer's loop over work items needs 56 registers (with 24 it spilled); 56 x 128 + 224 x 256
  // threads fit 64K.
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 224;
  static_assert(kN <= Control::kMaxKeys && kN % 32 == 0, "the staged key tokens: whole warps");
};

// Named barriers 2 and 3: consumer warpgroup 0's and 1's turn to issue S = Q K^T. The
// turns alternate, so that one warpgroup's softmax overlaps the other's products.
constexpr int kTurnBarrier = 2;

// The kernel's arguments: the call, and TMA descriptors of q, k, v and o, each a 4-d tensor
// (head dim, heads, sequence, batch) in boxes of (64, 1, rows, 1) with 128-byte swizzling
// (rows: kM for q, kN for k and v, kConsumerRows for o). Passed as a __grid_constant__
// parameter.
struct ForwardArgs {
  CUtensorMap q_map;
  CUtensorMap k_map;
  CUtensorMap v_map;
  CUtensorMap o_map;
  FlashArgs a;
};

// A ring of kStages buffers filled and released in turn, across work items: the stage in
// use and the parity of its current fill. Waiting on an "empty" barrier with the parity
// flipped passes on a fresh barrier, so the first kStages fills do not wait.
template <int kStages>
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// A work item: kM queries of one (batch row, head), numbered by block_tile (under a
// causal mask, longest first). Persistent blocks (one per SM) take them in rounds: in
// round r the G = gridDim.x blocks take items r G .. r G + G - 1, in order on even rounds
// and reversed on odd ones, so that a block that took a long item takes a short one next
// and the blocks' totals even out (block_item).
struct QueryBlock {
  int b, h, m0;
};

template <int D>
__device__ __forceinline__ int work_items(const AttentionParams& p) {
  return static_cast<int>((p.seqlen_q + ForwardTiles<D>::kM - 1) / ForwardTiles<D>::kM * p.heads * p.batch);
}

// The block's item of round r, or -1 (past the last).
__device__ __forceinline__ int block_item(int r, int items) {
  const int g = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
  const int item = r * g + ((r & 1) ? g - 1 - c : c);
  return item < items ? item : -1;
}

template <int D>
__device__ __forceinline__ QueryBlock query_block(const AttentionParams& p, int item) {
  const int n_q_tiles = static_cast<int>((p.seqlen_q + ForwardTiles<D>::kM - 1) / ForwardTiles<D>::kM);
  const int heads = static_cast<int>(p.heads), rows = static_cast<int>(p.batch) * heads;
  const BlockTile block = block_tile(p.mask, item, n_q_tiles, rows, rows);
  // The last query tile first: under a causal mask, the longest.
  return {block.row / heads, block.row % heads, (n_q_tiles - 1 - block.tile) * ForwardTiles<D>::kM};
}

// The producer: warp 0 (lane 0 issues the copies and publishes the tiles). It loads the
// next work item's Q tile in the middle of an item (after the tiles of its first
// kQueryLead passes: they come first, and by then the O of the item before has left the
// stage that Q takes), so that Q has landed when the consumers reach the next item; the
// item boundary then waits on no load but the first K and V tiles'.
// (Issued at the boundary, behind the last V and the next first K tile, a Q load took
// 2,600-3,800 cycles to land: benchmarks/results/flash_item_boundary.json.)
constexpr int kQueryLead = 2;  // passes of an item before the next item's Q load

template <int D, bool kAlibi>
__device__ __forceinline__ void produce(const ForwardArgs& args, uint32_t base, Control* control) {
  using T = ForwardTiles<D>;
  const FlashArgs& a = args.a;
  const AttentionParams& p = a.p;
  const bool leader = threadIdx.x == 0;
  if (leader) {
    prefetch_tensor_map(&args.q_map);
    prefetch_tensor_map(&args.k_map);
    prefetch_tensor_map(&args.v_map);
  }
  Ring<T::kKeyStages> keys;
  Ring<T::kValueStages> values;
  const int n_tiles = static_cast<int>((p.seqlen_kv + T::kN - 1) / T::kN);
  const int items = work_items<D>(p);
  // Round r's Q tile into stage r % kQueryStages, once the O of round r - kQueryStages has
  // left that stage (the stage's (r / kQueryStages)-th fill).
  const auto load_query = [&](int round) {
    const int item = block_item(round, items);
    if (!leader || item < 0) return;
    const QueryBlock w = query_block<D>(p, item);
    const int q = round % T::kQueryStages;
    trace_stamp(0, round, 2);
    mbarrier_wait(smem_address(&control->q_empty[q]), ((round / T::kQueryStages) & 1) ^ 1u);
    trace_stamp(0, round, 3);
    tma_load_tile<T::kM, T::kAtoms>(base + q * T::kQBytes, &args.q_map, smem_address(&control->q_full[q]), w.h,
                                    w.m0, w.b);
  };
  load_query(0);
  for (int r = 0; r * static_cast<int>(gridDim.x) < items; ++r) {
    const int item = block_item(r, items);
    if (item < 0) continue;
    if (leader) trace_stamp(0, r, 0);
    const QueryBlock w = query_block<D>(p, item);
    const HeadContext c = head_context(a, w.b, w.h);
    const int g = static_cast<int>(kv_head_of(w.h, p.heads, p.kv_heads));
    const Span q_span = tile_span<T::kM>(c.q_spans, c.n_q_spans, w.m0);
    TileScan scan{-32, 0u, 0u, 0u};
    const auto visible_after = [&](int after) {
      return next_visible(scan, after, n_tiles, [&](int tile, bool* complete) {
        const Span kv = tile_span<T::kN>(c.kv_spans, c.n_kv_spans, static_cast<int64_t>(tile) * T::kN);
        *complete = kv.complete != 0;
        return relate(p.mask, q_span, kv);
      });
    };
    const auto load_values = [&](int tile) {
      const int v = values.stage;
      mbarrier_wait(smem_address(&control->v_empty[v]), values.phase ^ 1u);
      if (leader) {
        tma_load_tile<T::kN, T::kAtoms>(base + T::kVOffset + v * T::kTileBytes, &args.v_map,
                                        smem_address(&control->v_full[v]), g, tile * T::kN, w.b);
      }
      values.advance();
    };
    // Pass i publishes tile i's K, then loads tile i - 1's V (`previous`), so that a K load
    // never waits behind the release of a V stage. The scan runs one tile ahead, so that
    // the last tile is published as such (no stage is spent on an end marker, and the next
    // item's first K tile takes the stage a tile earlier); an item without a visible tile
    // publishes the end marker (tile -1).
    int t = visible_after(-1), previous = -1;
    for (int i = 0;; ++i) {
      const int s = keys.stage;
      const bool empty = t >= n_tiles;
      const int bit = t - scan.first;  // the tile's flags, before the scan moves past them
      const uint32_t full = empty ? 0u : (scan.full >> bit) & 1u, padded = empty ? 0u : (scan.padded >> bit) & 1u;
      const int next = empty ? n_tiles : visible_after(t);
      mbarrier_wait(smem_address(&control->k_empty[s]), keys.phase ^ 1u);
      bool consecutive = false;
      if (!empty && (kAlibi || !full)) {  // the key tokens, a lane a key
        const int64_t j0 = static_cast<int64_t>(t) * T::kN;
        bool mine = j0 + T::kN <= p.seqlen_kv;
#pragma unroll
        for (int k = 0; k < T::kN / 32; ++k) {
          const int r = static_cast<int>(threadIdx.x % 32) + 32 * k;
          const int64_t j = j0 + r;
          const int32_t seg = j < p.seqlen_kv ? c.kv_seg[j] : 0, pos = j < p.seqlen_kv ? c.kv_pos[j] : 0;
          control->key_seg[s][r] = seg;
          control->key_pos[s][r] = pos;
          mine = mine && seg == c.kv_seg[j0] && pos == c.kv_pos[j0] + r;
        }
        consecutive = __all_sync(0xffffffffu, mine);
        __syncwarp();  // before the leader's arrival publishes them
      }
      if (leader && empty) {
        control->tile[s] = -1;
        mbarrier_arrive(smem_address(&control->k_full[s]));
      } else if (leader) {
        control->tile[s] = t;
        control->full[s] = full;
        control->padded[s] = padded;
        control->consecutive[s] = consecutive;
        control->last[s] = next >= n_tiles;
        tma_load_tile<T::kN, T::kAtoms>(base + T::kKOffset + s * T::kTileBytes, &args.k_map,
                                        smem_address(&control->k_full[s]), g, t * T::kN, w.b);
        if (i == 0) trace_stamp(0, r, 1);
      }
      keys.advance();
      if (previous >= 0) load_values(previous);
      const bool done = empty || next >= n_tiles;
      if (!empty && done) load_values(t);  // the last tile's V
      // The next item's Q once this item's first tiles are on their way (or at its end; with
      // one Q stage always at its end, as the stage frees only when this item's O has left).
      if (T::kQueryStages == 1 ? done : i == kQueryLead || (done && i < kQueryLead)) load_query(r + 1);
      __syncwarp();  // the lanes stay in step (next_visible is warp-wide)
      if (done) break;
      previous = t;
      t = next;
    }
    if (leader) trace_stamp(0, r, 4);
  }
  if (leader) trace_dump(0, (items + gridDim.x - 1) / gridDim.x);
}

// Once the O store of the warpgroup's previous item has read its Q stage: the stage goes back
// to the producer (thread 0 of the warpgroup, which issued the store). Called after the next
// item's first products are issued, so that the wait is off the item boundary.
__device__ __forceinline__ void release_query_stage(Control* control, int stage, int cw, int round) {
  if (threadIdx.x % 128 != 0) return;
  bulk_wait_read();
  trace_stamp(1 + cw, round, 5);
  mbarrier_arrive(smem_address(&control->q_empty[stage]));
}

// One consumer warpgroup (index cw, 0 or 1) on one work item: queries m0 + 64 cw .. + 63.
// Tile i's S = Q K^T is issued together with tile i - 1's O += P V; its softmax runs while
// the other warpgroup's products do (this one's P V is waited for once the maxima are
// known). The first tile runs alone, so that the loop always has the same products in
// flight (the compiler then keeps them asynchronous). Every K and V stage it takes is released, and the item's Q stage once O
// has left through it. `round`: the block's item count so far (the trace's index).
template <ElementType ET, int D, bool kAlibi, bool kDropout, bool kBias = false>
__device__ __forceinline__ void consume_item(const FlashArgs& a, const CUtensorMap* o_map, uint32_t base,
                                             Control* control, const QueryBlock& w,
                                             const Ring<ForwardTiles<D>::kQueryStages>& queries,
                                             int previous_stage, int cw,
                                             Ring<ForwardTiles<D>::kKeyStages>& keys,
                                             Ring<ForwardTiles<D>::kValueStages>& values, int round) {
  using T = ForwardTiles<D>;
  const AttentionParams& p = a.p;
  const int64_t b = w.b, h = w.h, m0 = w.m0;
  const HeadContext c = head_context(a, b, h);
  const int warp = (threadIdx.x / 32) % 4;
  const FragmentCoords at{m0 + T::kConsumerRows * cw + 16 * warp, 0, static_cast<int>(threadIdx.x % 32)};
  // The keys the lane's two rows see (the mask of tiles that are not all visible).
  const QueryRange sees[2] = {query_range(p.mask, query_token(c, at.row(0), p.seqlen_q)),
                              query_range(p.mask, query_token(c, at.row(2), p.seqlen_q))};
  // With ALiBi: the lane's two rows' diagonals, and the head's slope / scale.
  const float diagonal[2] = {kAlibi ? query_diagonal(c, at.row(0), p.seqlen_q) : 0.0f,
                             kAlibi ? query_diagonal(c, at.row(2), p.seqlen_q) : 0.0f};
  const float alibi = kAlibi ? alibi_coefficient(a, b, h) : 0.0f;
  SoftmaxState state[2];
  state[0].init();
  state[1].init();
  float o[D / 8][4];
  zero(o);
  uint32_t weights[T::kN / 16][4];  // P of the previous tile, the A operand of its O += P V
  const uint32_t q_tile = base + queries.stage * T::kQBytes;  // the item's Q, then its O
  const uint32_t q_rows = q_tile + cw * T::kConsumerRows * kAtomRowBytes;
  const auto v_tile = [&](int s) { return base + T::kVOffset + s * T::kTileBytes; };

  // Waits for the next K tile; returns its index (-1: the item has none, its stage
  // released at once) and reads its stage and flags (last: the item's last tile).
  const auto next_tile = [&](int* stage, bool* full, bool* padded, bool* last) {
    const int s = keys.stage;
    mbarrier_wait(smem_address(&control->k_full[s]), keys.phase);
    keys.advance();
    *stage = s;
    *full = control->full[s] != 0;
    *padded = control->padded[s] != 0;
    *last = control->last[s] != 0;
    const int t = control->tile[s];
    if (t < 0) mbarrier_arrive(smem_address(&control->k_empty[s]));
    return t;
  };
  // Waits for the next V tile (tile index t) and zeroes its padding rows, both warpgroups
  // before either multiplies.
  const auto ready_values = [&](int t, bool padded) {
    const int s = values.stage;
    mbarrier_wait(smem_address(&control->v_full[s]), values.phase);
    if (padded) {
      zero_padding_rows<T::kN, T::kAtoms, T::kConsumerThreads>(v_tile(s), c.kv_seg, static_cast<int64_t>(t) * T::kN,
                                                               p.seqlen_kv, static_cast<int>(threadIdx.x) - 128);
      fence_proxy_async();
      named_barrier_sync(kConsumersBarrier, T::kConsumerThreads);
    }
  };
  // Takes this warpgroup's turn and issues S = Q K^T of the K tile in stage ks (one commit group).
  const auto issue_scores = [&](int ks, float (&scores)[T::kN / 8][4]) {
    const uint32_t k_tile = base + T::kKOffset + ks * T::kTileBytes;
    fence_accumulators(scores);
    fence_accumulators(o);
    named_barrier_sync(kTurnBarrier + cw, T::kConsumerThreads);
    cute::warpgroup_arrive();
    gmma_rows_times_rows<ET, T::kN, D>(q_rows, T::kM * kAtomRowBytes, k_tile, T::kN * kAtomRowBytes, scores);
    cute::warpgroup_commit_batch();
  };
  // O += P V of the V tile made ready (one commit group).
  const auto issue_values = [&] {
    const uint64_t v0 = mn_major_descriptor(v_tile(values.stage), T::kN * kAtomRowBytes);
#pragma unroll
    for (int ks = 0; ks < T::kN / 16; ++ks) gmma_rs<ET, D>(weights[ks], descriptor_plus(v0, ks * 16 * kAtomRowBytes), o);
    cute::warpgroup_commit_batch();
  };
  // Once O += P V is done: its V stage released.
  const auto release_values = [&] {
    cute::warpgroup_wait<0>();
    fence_accumulators(o);
    mbarrier_arrive(smem_address(&control->v_empty[values.stage]));
    values.advance();
  };
  // Tile t's scores (done) -> weights; its K stage s (and key tokens) released. O is
  // rescaled after `retire` has waited for the product in flight. With dropout the packed
  // weights are dropped by dropout_flags_pair's flags (the scale 1 / (1 - rate) is the
  // denominators'). Drawn here, after the exponentials: drawn before the wait for S instead,
  // the forward took 1.13-1.25x longer (session 23).
  const auto soften = [&](int s, int t, bool full, float (&scores)[T::kN / 8][4], auto retire) {
    fence_accumulators(scores);
    const FragmentCoords kv{at.row0, static_cast<int64_t>(t) * T::kN, at.lane};
    if constexpr (kAlibi) {
      add_alibi<T::kN>(scores, alibi, [&](int n, int e) {
        return alibi_distance(diagonal[e / kRowElems], static_cast<float>(control->key_pos[s][kv.col(n, e) - kv.col0]));
      });
    }
    if constexpr (kBias) {
      add_bias<T::kN>(scores, a, b, h, [&](int, int e) { return kv.row(e); }, [&](int n, int e) { return kv.col(n, e); });
    }
    if (!full && control->consecutive[s]) {
      // One segment at consecutive positions: each row sees an interval of the tile's key
      // indexes, [lo - pos0, hi - pos0] where the segments match (empty otherwise), clamped
      // to [-1, kN] so that the comparisons stay 32-bit.
      const int32_t seg0 = control->key_seg[s][0];
      const int64_t pos0 = control->key_pos[s][0];
      const auto index = [&](int32_t position) {
        const int64_t x = position - pos0;
        return static_cast<int>(x < -1 ? -1 : x > T::kN ? T::kN : x);
      };
      int first[2], last[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool same = sees[r].seg == seg0;
        first[r] = same ? index(sees[r].lo) : T::kN;
        last[r] = same ? index(sees[r].hi) : -1;
      }
      mask_fragment(scores, -INFINITY, [&](int n, int e) {
        const int col = static_cast<int>(kv.col(n, e) - kv.col0);
        return col >= first[e / kRowElems] && col <= last[e / kRowElems];
      });
    } else if (!full) {  // the mask as bits, 64 elements a word (fragment_bits keeps few registers live)
      constexpr int kWords = (T::kN + 63) / 64, kWordTiles = T::kN / 8 / kWords;
      uint32_t seen[kWords];
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        seen[w] = fragment_bits<8 * kWordTiles>([&](int n, int e) {
          const int r = static_cast<int>(kv.col(n + w * kWordTiles, e) - kv.col0);
          return in_range(sees[e / kRowElems], control->key_seg[s][r], control->key_pos[s][r]);
        });
      }
      mask_fragment(scores, -INFINITY, [&](int n, int e) {
        return ((seen[n / kWordTiles] >> (4 * (n % kWordTiles) + e)) & 1u) != 0;
      });
    }
    float factor[2];
    // Once the maxima are known: K and the key tokens are read, and the product in flight
    // (which reads the previous weights' registers) is waited for and O rescaled where a
    // row's max moved (move_stale_maxima), before the exponentials.
    softmax_weights<T::kN, false, true>(scores, state, a, c, h, kv, factor, [&](bool moved) {
      mbarrier_arrive(smem_address(&control->k_empty[s]));
      retire();
      if (moved) rescale_rows<D>(o, factor);
    });
#pragma unroll
    for (int ks = 0; ks < T::kN / 16; ++ks) {
      weights[ks][0] = pack2<ET>(scores[2 * ks][0], scores[2 * ks][1]);
      weights[ks][1] = pack2<ET>(scores[2 * ks][2], scores[2 * ks][3]);
      weights[ks][2] = pack2<ET>(scores[2 * ks + 1][0], scores[2 * ks + 1][1]);
      weights[ks][3] = pack2<ET>(scores[2 * ks + 1][2], scores[2 * ks + 1][3]);
    }
    if constexpr (kDropout) {
#pragma unroll
      for (int ks = 0; ks < T::kN / 16; ++ks) {
        const uint32_t flags = dropout_flags_pair(p, c, h, kv, 2 * ks);
#pragma unroll
        for (int j = 0; j < 4; ++j) weights[ks][j] = drop_packed(weights[ks][j], flags, at.lane, j);
      }
    }
  };

  const bool tracer = threadIdx.x % 128 == 0;  // the warpgroup's trace stamps (trace.cuh)
  if (tracer) trace_stamp(1 + cw, round, 0);
  mbarrier_wait(smem_address(&control->q_full[queries.stage]), queries.phase);
  if (tracer) trace_stamp(1 + cw, round, 1);
  bool full, padded, last;
  int ks;
  int t = next_tile(&ks, &full, &padded, &last);
  const auto release_previous = [&] {
    if (previous_stage >= 0) release_query_stage(control, previous_stage, cw, round - 1);
  };
  if (t < 0) release_previous();
  if (t >= 0) {
    float scores[T::kN / 8][4];
    issue_scores(ks, scores);
    named_barrier_arrive(kTurnBarrier + 1 - cw, T::kConsumerThreads);  // the other's turn
    release_previous();  // after the turn passes, so that its wait does not hold the other back
    cute::warpgroup_wait<0>();
    soften(ks, t, full, scores, [] {});
    if (tracer) trace_stamp(1 + cw, round, 2);
  }
  while (t >= 0) {
    ready_values(t, padded);
    if (last) break;  // the item's last tile, whose O += P V follows
    t = next_tile(&ks, &full, &padded, &last);
    float scores[T::kN / 8][4];
    issue_scores(ks, scores);
    issue_values();
    // The other warpgroup's turn (after an item's last tile, warpgroup 1's turn passes to
    // warpgroup 0's first of the next item).
    named_barrier_arrive(kTurnBarrier + 1 - cw, T::kConsumerThreads);
    cute::warpgroup_wait<1>();
    soften(ks, t, full, scores, release_values);
  }
  if (t >= 0) {  // the last tile's O += P V (its V made ready at the loop's last pass)
    fence_accumulators(o);
    cute::warpgroup_arrive();
    issue_values();
    release_values();
    if (tracer) trace_stamp(1 + cw, round, 3);
  }
  // O / denominator through this warpgroup's rows of the Q tile, then TMA stores (rows past
  // the end are not written); the copies must have read shared memory before the block ends.
  float inverse[kLaneRows];
  finish_statistics(state, p, c.sink, at, a.lse + (b * p.heads + h) * p.seqlen_q, inverse);
  if constexpr (kDropout) {
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) inverse[r] *= p.dropout_scale;
  }
  stage_rows<ET, D, T::kM>(o, inverse, q_tile, T::kConsumerRows * cw + 16 * warp, at.lane);
  fence_proxy_async();
  named_barrier_sync(kWarpgroupBarrier + cw, 128);
  if (threadIdx.x % 128 == 0) {
#pragma unroll
    for (int atom = 0; atom < T::kAtoms; ++atom) {
      tma_store_4d(o_map, q_rows + atom * T::kM * kAtomRowBytes, atom * kAtomColumns, static_cast<int>(h),
                   static_cast<int>(m0) + T::kConsumerRows * cw, static_cast<int>(b));
    }
    trace_stamp(1 + cw, round, 4);
  }
}


// One consumer warpgroup over the block's work items.
template <ElementType ET, int D, bool kAlibi, bool kDropout, bool kBias = false>
__device__ __forceinline__ void consume(const ForwardArgs& args, uint32_t base, Control* control, int cw) {
  using T = ForwardTiles<D>;
  const AttentionParams& p = args.a.p;
  Ring<T::kKeyStages> keys;
  Ring<T::kValueStages> values;
  if (cw == 1) named_barrier_arrive(kTurnBarrier, T::kConsumerThreads);  // warpgroup 0 starts
  Ring<T::kQueryStages> queries;
  int previous_stage = -1;  // the Q stage of the warpgroup's previous item, not yet released
  const int items = work_items<D>(p);
  for (int r = 0; r * static_cast<int>(gridDim.x) < items; ++r) {
    const int item = block_item(r, items);
    if (item < 0) continue;
    consume_item<ET, D, kAlibi, kDropout, kBias>(args.a, &args.o_map, base, control, query_block<D>(p, item), queries,
                                          previous_stage, cw, keys, values, r);
    if (T::kQueryStages == 1) {
      release_query_stage(control, queries.stage, cw, r);  // the next item's Q loads into it
    } else {
      previous_stage = queries.stage;
    }
    queries.advance();
  }
  if (threadIdx.x % 128 == 0) bulk_wait_read();  // the last O store has read shared memory
  if (threadIdx.x % 128 == 0) trace_dump(1 + cw, (items + gridDim.x - 1) / gridDim.x);
}

template <ElementType ET, int D, bool kAlibi, bool kDropout, bool kBias = false>
__global__ void __launch_bounds__(ForwardTiles<D>::kThreads, 1) forward_kernel(const __grid_constant__ ForwardArgs args) {
  using T = ForwardTiles<D>;
  extern __shared__ unsigned char smem[];
  const uint32_t unaligned = smem_address(smem);
  const uint32_t base = (unaligned + 1023) & ~1023u;
  Control* control = reinterpret_cast<Control*>(smem + (base - unaligned) + T::kControlOffset);

  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kQueryStages; ++s) {
      mbarrier_init(smem_address(&control->q_full[s]), 1);
      mbarrier_init(smem_address(&control->q_empty[s]), 2);
    }
    for (int s = 0; s < T::kKeyStages; ++s) {
      mbarrier_init(smem_address(&control->k_full[s]), 1);
      mbarrier_init(smem_address(&control->k_empty[s]), T::kConsumerThreads);
    }
    for (int s = 0; s < T::kValueStages; ++s) {
      mbarrier_init(smem_address(&control->v_full[s]), 1);
      mbarrier_init(smem_address(&control->v_empty[s]), T::kConsumerThreads);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  const int warpgroup = warpgroup_index();
  if (warpgroup == 0) {
    registers_decrease<T::kProducerRegisters>();
    if (threadIdx.x < 32) produce<D, kAlibi>(args, base, control);
  } else {
    registers_increase<T::kConsumerRegisters>();
    consume<ET, D, kAlibi, kDropout, kBias>(args, base, control, warpgroup - 1);
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_SM90_FORWARD_CUH_
