// The flash forward kernel (CUDA sm_80 and later; AMD CDNA through mfma.cuh):
// o = softmax(scale * q k^T (+ ALiBi) + mask) v with the softmax sink, dropout and lse of
// fusedattn/softmax.h, for one head dim D; kAlibi: the call has ALiBi (alibi_tile.cuh);
// kBias: a bias array (bias_tile.cuh).
//
// A block owns kM = 64 queries of one (batch row, head), kWarpRows per warp (NVIDIA: 16 for
// each of 4 warps; AMD: 32 for each of 2 wavefronts), and streams the key/value tiles that
// its queries can see (spans.cuh) through kPipelineStages stages. Scores stay in registers:
// S = Q K^T, online softmax in float32, O += P V with P packed from S's accumulators.
#ifndef FUSEDATTN_FLASH_FORWARD_CUH_
#define FUSEDATTN_FLASH_FORWARD_CUH_

#include "alibi_tile.cuh"
#include "bias_tile.cuh"
#include "params.cuh"
#include "pipeline.cuh"
#include "softmax_tile.cuh"

namespace fusedattn {
namespace flash {

template <int D>
struct ForwardTiles {
  static constexpr int kM = 64;                  // queries per block
  // keys per tile (registers: O holds D/2 floats a lane; on AMD d=128 spilled with 64 on gfx940)
  static constexpr int kN = D == 256 || (kWarpSize == 64 && D == 128) ? 32 : 64;
  static constexpr int kThreads = 128;
  static constexpr int kChunks = D / 8;
  static constexpr int kSharedBytes = (kM + 2 * kPipelineStages * kN) * D * 2;  // Q, then the stages of K and V
  static_assert(kM == kThreads / kWarpSize * kWarpRows, "one fragment of rows per warp");
};

template <ElementType ET, int D, bool kAlibi, bool kBias = false>
__global__ void __launch_bounds__(ForwardTiles<D>::kThreads) forward_kernel(const FlashArgs a) {
  using T = ForwardTiles<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const AttentionParams& p = a.p;
  const int64_t n_q_tiles = (p.seqlen_q + T::kM - 1) / T::kM;
  const int rows = static_cast<int>(p.batch * p.heads);
  const BlockTile block = block_tile(p.mask, blockIdx.x, static_cast<int>(n_q_tiles), rows, rows);
  const int64_t m0 = (n_q_tiles - 1 - block.tile) * T::kM;  // the last query tile first: causal, the longest
  const int64_t h = block.row % p.heads, b = block.row / p.heads, g = kv_head_of(h, p.heads, p.kv_heads);
  const HeadContext c = head_context(a, b, h);
  const int warp = threadIdx.x / kWarpSize;

  const SharedAddress base = smem_address(smem);
  const SwizzledTile<T::kChunks> q_tile{base};
  const auto k_tile = [&](int s) { return SwizzledTile<T::kChunks>{base + (T::kM + 2 * s * T::kN) * D * 2}; };
  const auto v_tile = [&](int s) { return SwizzledTile<T::kChunks>{base + (T::kM + (2 * s + 1) * T::kN) * D * 2}; };

  const int64_t q_stride = p.heads * D, kv_stride = p.kv_heads * D;
  const int64_t q_offset = (b * p.seqlen_q * p.heads + h) * D;
  const int64_t kv_offset = (b * p.seqlen_kv * p.kv_heads + g) * D;
  load_tile<T::kM, T::kChunks, T::kThreads>(q_tile, a.q + q_offset, q_stride, m0, p.seqlen_q);
  tile_copies_commit();

  const FragmentCoords at{m0 + kWarpRows * warp, 0, static_cast<int>(threadIdx.x % kWarpSize)};
  QueryToken query[kLaneRows];
  SoftmaxState state[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    query[r] = query_token(c, at.row(kRowElems * r), p.seqlen_q);
    state[r].init();
  }
  float o[D / 8][4];
  zero(o);

  const Span q_span = tile_span<T::kM>(c.q_spans, c.n_q_spans, m0);
  const int n_kv_tiles = static_cast<int>((p.seqlen_kv + T::kN - 1) / T::kN);
  const auto relation = [&](int t) {
    return relate(p.mask, q_span, tile_span<T::kN>(c.kv_spans, c.n_kv_spans, static_cast<int64_t>(t) * T::kN));
  };
  const auto load = [&](int t, int s) {
    const int64_t j0 = static_cast<int64_t>(t) * T::kN;
    load_tile<T::kN, T::kChunks, T::kThreads>(k_tile(s), a.k + kv_offset, kv_stride, j0, p.seqlen_kv);
    load_tile<T::kN, T::kChunks, T::kThreads>(v_tile(s), a.v + kv_offset, kv_stride, j0, p.seqlen_kv);
  };
  const float alibi = kAlibi ? alibi_coefficient(a, b, h) : 0.0f;
  float diagonal[kLaneRows];  // with ALiBi: the lane's rows' diagonals
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) diagonal[r] = kAlibi ? query_diagonal(c, at.row(kRowElems * r), p.seqlen_q) : 0.0f;
  const auto compute = [&](int t, int s, bool full) {
    float scores[T::kN / 8][4];
    zero(scores);
    warp_rows_times_rows<ET, D, T::kN>(scores, q_tile, kWarpRows * warp, k_tile(s));
    const FragmentCoords kv{at.row0, static_cast<int64_t>(t) * T::kN, at.lane};
    if constexpr (kAlibi) {
      add_alibi<T::kN>(scores, alibi, [&](int n, int e) {
        return alibi_distance(diagonal[e / kRowElems], key_position(c, kv.col(n, e), p.seqlen_kv));
      });
    }
    if constexpr (kBias) {
      add_bias<T::kN>(scores, a, b, h, [&](int, int e) { return kv.row(e); }, [&](int n, int e) { return kv.col(n, e); });
    }
    softmax_tile<T::kN, D>(scores, o, state, a, c, query, h, kv, full);
    warp_regs_times_rows<ET, T::kN, D>(o, scores, v_tile(s), 0);
  };
  stream_tiles<T::kThreads>(n_kv_tiles, relation, load, compute);

  finish_rows<ET, D>(o, state, p, c.sink, a.o + q_offset, q_stride, at,
                     a.lse + (b * p.heads + h) * p.seqlen_q);
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_FORWARD_CUH_
