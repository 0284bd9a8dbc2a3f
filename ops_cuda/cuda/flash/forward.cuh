// The flash forward kernel (CUDA, sm_80 and later): o = softmax(scale * q k^T + mask) v
// with the softmax sink, dropout and lse of fusedattn/softmax.h, for one head dim D.
//
// A block owns kM = 64 queries of one (batch row, head), 16 per warp, and streams the
// key/value tiles that its queries can see (spans.cuh) through two stages. Scores stay
// in registers: S = Q K^T, online softmax in float32, O += P V with P packed from S's
// accumulators.
#ifndef FUSEDATTN_FLASH_FORWARD_CUH_
#define FUSEDATTN_FLASH_FORWARD_CUH_

#include <cmath>

#include "params.cuh"
#include "pipeline.cuh"

namespace fusedattn {
namespace flash {

template <int D>
struct ForwardTiles {
  static constexpr int kM = 64;                  // queries per block
  static constexpr int kN = D == 256 ? 32 : 64;  // keys per tile (registers: O holds D/2 floats a lane)
  static constexpr int kThreads = 128;
  static constexpr int kChunks = D / 8;
  static constexpr int kSharedBytes = (kM + 4 * kN) * D * 2;  // Q, then two stages of K and V
};

template <ElementType ET, int D>
__global__ void __launch_bounds__(ForwardTiles<D>::kThreads) forward_kernel(const FlashArgs a) {
  using T = ForwardTiles<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const AttentionParams& p = a.p;
  const int64_t n_q_tiles = (p.seqlen_q + T::kM - 1) / T::kM;
  const int64_t bh = blockIdx.x / n_q_tiles;
  const int64_t m0 = (n_q_tiles - 1 - blockIdx.x % n_q_tiles) * T::kM;  // causal: longest rows first
  const int64_t h = bh % p.heads, b = bh / p.heads, g = kv_head_of(h, p.heads, p.kv_heads);
  const HeadContext c = head_context(a, b, h);
  const int warp = threadIdx.x / 32;

  const uint32_t base = smem_address(smem);
  const SwizzledTile<T::kChunks> q_tile{base};
  const auto k_tile = [&](int s) { return SwizzledTile<T::kChunks>{base + (T::kM + 2 * s * T::kN) * D * 2}; };
  const auto v_tile = [&](int s) { return SwizzledTile<T::kChunks>{base + (T::kM + (2 * s + 1) * T::kN) * D * 2}; };

  const int64_t q_stride = p.heads * D, kv_stride = p.kv_heads * D;
  const int64_t q_offset = (b * p.seqlen_q * p.heads + h) * D;
  const int64_t kv_offset = (b * p.seqlen_kv * p.kv_heads + g) * D;
  load_tile_async<T::kM, T::kChunks, T::kThreads>(q_tile, a.q + q_offset, q_stride, m0, p.seqlen_q);
  cp_async_commit();

  const FragmentCoords at{m0 + 16 * warp, 0, static_cast<int>(threadIdx.x % 32)};
  const QueryToken query[2] = {query_token(c, at.row(0), p.seqlen_q), query_token(c, at.row(2), p.seqlen_q)};
  SoftmaxState state[2];
  state[0].init();
  state[1].init();
  float o[D / 8][4];
  zero(o);

  const Span q_span = tile_span(c.q_spans, c.n_q_spans, m0, T::kM);
  const int n_kv_tiles = static_cast<int>((p.seqlen_kv + T::kN - 1) / T::kN);
  const auto relation = [&](int t) {
    return relate(p.mask, q_span, tile_span(c.kv_spans, c.n_kv_spans, static_cast<int64_t>(t) * T::kN, T::kN));
  };
  const auto load = [&](int t, int s) {
    const int64_t j0 = static_cast<int64_t>(t) * T::kN;
    load_tile_async<T::kN, T::kChunks, T::kThreads>(k_tile(s), a.k + kv_offset, kv_stride, j0, p.seqlen_kv);
    load_tile_async<T::kN, T::kChunks, T::kThreads>(v_tile(s), a.v + kv_offset, kv_stride, j0, p.seqlen_kv);
  };
  const auto compute = [&](int t, int s, bool full) {
    float scores[T::kN / 8][4];
    zero(scores);
    warp_rows_times_rows<ET, D, T::kN>(scores, q_tile, 16 * warp, k_tile(s));
    const FragmentCoords kv{at.row0, static_cast<int64_t>(t) * T::kN, at.lane};
#pragma unroll
    for (int n = 0; n < T::kN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) scores[n][e] *= p.scale;
    }
    if (!full) {
      mask_fragment(scores, -INFINITY, [&](int n, int e) {
        return key_visible(p.mask, c, query[e / 2], kv.col(n, e), p.seqlen_kv);
      });
    }
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < T::kN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) block_max[e / 2] = fmaxf(block_max[e / 2], scores[n][e]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 1));
      block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 2));
      const float factor = state[r].rescale(block_max[r]);
      state[r].any |= block_max[r] > -INFINITY;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        o[d][2 * r] *= factor;
        o[d][2 * r + 1] *= factor;
      }
    }
    // exp(x - m) as exp2(x log2(e) - m log2(e)); masked x = -inf gives 0 (a row without a
    // visible key so far has m = -inf and every weight masked).
    const float m_log2[2] = {state[0].any ? state[0].m * kLog2e : 0.0f, state[1].any ? state[1].m * kLog2e : 0.0f};
#pragma unroll
    for (int n = 0; n < T::kN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float w = exp2f(scores[n][e] * kLog2e - m_log2[e / 2]);
        state[e / 2].l += w;
        scores[n][e] = w;
      }
    }
    if (p.dropout) {
#pragma unroll
      for (int n = 0; n < T::kN / 8; ++n) {
        float f[4];
        dropout_fragment(p, c, h, kv.row(0), kv.col(n, 0), f);
#pragma unroll
        for (int e = 0; e < 4; ++e) scores[n][e] *= f[e];
      }
    }
    warp_regs_times_rows<ET, T::kN, D>(o, scores, v_tile(s), 0);
  };
  stream_tiles<T::kThreads>(n_kv_tiles, relation, load, compute);

  float inverse[2];
  float lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    state[r].l += __shfl_xor_sync(0xffffffffu, state[r].l, 1);
    state[r].l += __shfl_xor_sync(0xffffffffu, state[r].l, 2);
    lse[r] = state[r].finalize(p.softmax_type, c.sink, &inverse[r]);
  }
  store_rows<ET>(o, inverse, a.o + q_offset, q_stride, at, p.seqlen_q);
  if (at.lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = at.row(2 * r);
      if (i < p.seqlen_q) a.lse[(b * p.heads + h) * p.seqlen_q + i] = lse[r];
    }
  }
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_FORWARD_CUH_
