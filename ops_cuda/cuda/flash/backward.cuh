// The flash backward kernels (CUDA sm_80 and later; AMD CDNA through mfma.cuh),
// deterministic by construction
// (every gradient element has one writer, no atomics):
//
//   softmax_delta_kernel   delta_i = rowsum(dO_i * O_i)                    [B, H, Sq]
//   sink_gradient_kernel   d_offset[b, h] = -sum_i exp(sink - lse_i) delta_i   (learnable softmax)
//   dkdv_kernel            a block owns 64 keys of one K/V head (kWarpRows per warp) and a range of
//                          output columns, and streams the (query head, query tile) pairs of its
//                          GQA group: S^T = K Q^T, dP^T = V dO^T, dV += (P o drop)^T dO,
//                          dK += dS^T Q with dS = P o (drop o dP - delta)
//   dq_kernel              a block owns 64 queries of one head and streams the key tiles:
//                          dQ += dS K (with ALiBi also each warp's part of the slope's gradient,
//                          alibi_tile.cuh, summed by slope_gradient.cu; with a bias array the
//                          terms of its gradient, bias_tile.cuh)
//
// P is recomputed from the saved lse (+inf for rows without visible keys: P = 0).
#ifndef FUSEDATTN_FLASH_BACKWARD_CUH_
#define FUSEDATTN_FLASH_BACKWARD_CUH_

#include <cmath>

#include "alibi_tile.cuh"
#include "bias_tile.cuh"
#include "launch.h"
#include "params.cuh"
#include "pipeline.cuh"

namespace fusedattn {
namespace flash {

// The block size of softmax_delta_kernel, and its most blocks (each strides over the rows:
// a block per few rows made the launch of blocks, not the bytes, its limit).
constexpr int kDeltaThreads = 256;
constexpr int64_t kDeltaMaxBlocks = 1024;

// rows of 16-bit elements: kLanes = D / 8 lanes per row, each one 16-byte load of O and
// of dO, summed over the lanes of the row by shuffles. Then `zero` (zero_count float4s, the
// sm_90a backward's float32 dQ accumulator, or none) is cleared, so that no memset of its
// own runs between this kernel and the backward's.
template <ElementType ET, int D>
__global__ void __launch_bounds__(kDeltaThreads) softmax_delta_kernel(const FlashArgs a, float4* zero, int64_t zero_count) {
  constexpr int kLanes = D / 8, kRowsPerPass = kDeltaThreads / kLanes;
  static_assert(kLanes <= kWarpSize && kWarpSize % kLanes == 0, "a row within one warp");
  const AttentionParams& p = a.p;
  const int64_t rows = p.batch * p.seqlen_q * p.heads;  // (b, i, h) in memory order
  const int lane = threadIdx.x % kLanes;
  // The loop runs while the warp's first row is in range, so that its lanes shuffle together.
  const int warp_row = static_cast<int>(threadIdx.x % kWarpSize) / kLanes;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerPass + (threadIdx.x - threadIdx.x % kWarpSize) / kLanes;
       first < rows; first += static_cast<int64_t>(gridDim.x) * kRowsPerPass) {
    const int64_t row = first + warp_row;
    float sum = 0.0f;
    if (row < rows) {
      const uint4 o8 = *reinterpret_cast<const uint4*>(a.o + row * D + 8 * lane);
      const uint4 g8 = *reinterpret_cast<const uint4*>(a.dout + row * D + 8 * lane);
      const uint32_t o[4] = {o8.x, o8.y, o8.z, o8.w}, g[4] = {g8.x, g8.y, g8.z, g8.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        sum += Element<ET>::load(static_cast<uint16_t>(o[k])) * Element<ET>::load(static_cast<uint16_t>(g[k]));
        sum += Element<ET>::load(static_cast<uint16_t>(o[k] >> 16)) * Element<ET>::load(static_cast<uint16_t>(g[k] >> 16));
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) sum += warp_shfl_xor(sum, offset);
    if (lane == 0 && row < rows) {
      const int64_t h = row % p.heads, bi = row / p.heads;
      const int64_t i = bi % p.seqlen_q, b = bi / p.seqlen_q;
      a.delta[(b * p.heads + h) * p.seqlen_q + i] = sum;
    }
  }
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < zero_count; i += threads) {
    zero[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// The segment ids and positions of a lane's fragment rows (those of `at`) where the rows
// are keys (0 past the end: no query sees them).
struct KeyRows {
  int32_t seg[kLaneRows], pos[kLaneRows];
};

__device__ __forceinline__ KeyRows key_rows(const HeadContext& c, const FragmentCoords& at, int64_t seqlen_kv) {
  KeyRows k;
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    const int64_t j = at.row(kRowElems * r);
    k.seg[r] = j < seqlen_kv ? c.kv_seg[j] : 0;
    k.pos[r] = j < seqlen_kv ? c.kv_pos[j] : 0;
  }
  return k;
}

// d_offset[b, h] for the learnable softmax (sink_gradient.cu); needs a.delta.
void launch_sink_gradient(gpuStream_t stream, const FlashArgs& a);

template <int D>
struct DkDvTiles {
  static constexpr int kN = 64;                   // keys per block
  // queries per tile (registers: dK, dV and S^T, dP^T; on AMD d=64 spilled with 64)
  static constexpr int kM = D == 64 && kWarpSize == 32 ? 64 : 32;
  // output columns per block (registers: dK and dV hold kOut floats a lane; on AMD the d=128 kernel
  // spilled with all 128 columns, so it takes 64 per block)
  static constexpr int kOut = D == 256 || (kWarpSize == 64 && D == 128) ? D / 2 : D;
  static constexpr int kThreads = 128;
  static constexpr int kChunks = D / 8;
  static constexpr int kSharedBytes = (2 * kN + 2 * kPipelineStages * kM) * D * 2;  // K, V, then the stages of Q and dO
  static_assert(kN == kThreads / kWarpSize * kWarpRows, "one fragment of rows per warp");
  static_assert(kM % 16 == 0, "dropout bits come two query tiles at a time");
};

template <ElementType ET, int D, bool kAlibi, bool kBias = false>
__global__ void __launch_bounds__(DkDvTiles<D>::kThreads) dkdv_kernel(const FlashArgs a) {
  using T = DkDvTiles<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const AttentionParams& p = a.p;
  constexpr int kColumnBlocks = D / T::kOut;
  // Key tiles from the first (causal: the longest); a tile's column blocks side by side.
  const int rows = static_cast<int>(p.batch * p.kv_heads) * kColumnBlocks;
  const BlockTile block = block_tile(p.mask, blockIdx.x, static_cast<int>((p.seqlen_kv + T::kN - 1) / T::kN), rows, rows);
  const int64_t column_block = block.row % kColumnBlocks;
  const int64_t n0 = static_cast<int64_t>(block.tile) * T::kN;
  const int64_t bg = block.row / kColumnBlocks, g = bg % p.kv_heads, b = bg / p.kv_heads;
  const int64_t group = p.heads / p.kv_heads;
  const int warp = threadIdx.x / kWarpSize;

  const SharedAddress base = smem_address(smem);
  const SwizzledTile<T::kChunks> k_tile{base}, v_tile{base + T::kN * D * 2};
  const auto q_tile = [&](int s) { return SwizzledTile<T::kChunks>{base + (2 * T::kN + 2 * s * T::kM) * D * 2}; };
  const auto do_tile = [&](int s) {
    return SwizzledTile<T::kChunks>{base + (2 * T::kN + (2 * s + 1) * T::kM) * D * 2};
  };

  const int64_t q_stride = p.heads * D, kv_stride = p.kv_heads * D;
  const int64_t kv_offset = (b * p.seqlen_kv * p.kv_heads + g) * D;
  load_tile<T::kN, T::kChunks, T::kThreads>(k_tile, a.k + kv_offset, kv_stride, n0, p.seqlen_kv);
  load_tile<T::kN, T::kChunks, T::kThreads>(v_tile, a.v + kv_offset, kv_stride, n0, p.seqlen_kv);
  tile_copies_commit();

  const HeadContext c0 = head_context(a, b, g * group);  // token vectors and spans: shared by the group
  const FragmentCoords at{n0 + kWarpRows * warp, 0, static_cast<int>(threadIdx.x % kWarpSize)};
  const KeyRows keys = key_rows(c0, at, p.seqlen_kv);
  float dk[T::kOut / 8][4], dv[T::kOut / 8][4];
  zero(dk);
  zero(dv);

  const Span kv_span = tile_span<T::kN>(c0.kv_spans, c0.n_kv_spans, n0);
  const int n_q_tiles = static_cast<int>((p.seqlen_q + T::kM - 1) / T::kM);
  // tile u: query head g * group + u / n_q_tiles, query tile u % n_q_tiles
  const auto relation = [&](int u) {
    const int64_t m0 = static_cast<int64_t>(u % n_q_tiles) * T::kM;
    return relate(p.mask, tile_span<T::kM>(c0.q_spans, c0.n_q_spans, m0), kv_span);
  };
  const auto q_offset = [&](int u) { return (b * p.seqlen_q * p.heads + g * group + u / n_q_tiles) * D; };
  const auto load = [&](int u, int s) {
    const int64_t m0 = static_cast<int64_t>(u % n_q_tiles) * T::kM;
    load_tile<T::kM, T::kChunks, T::kThreads>(q_tile(s), a.q + q_offset(u), q_stride, m0, p.seqlen_q);
    load_tile<T::kM, T::kChunks, T::kThreads>(do_tile(s), a.dout + q_offset(u), q_stride, m0, p.seqlen_q);
  };
  const auto compute = [&](int u, int s, bool full) {
    const int64_t h = g * group + u / n_q_tiles;
    const HeadContext c = head_context(a, b, h);
    const float* lse = a.lse + (b * p.heads + h) * p.seqlen_q;
    const float* delta = a.delta + (b * p.heads + h) * p.seqlen_q;
    float st[T::kM / 8][4], dpt[T::kM / 8][4];  // S^T and dP^T: rows are keys, columns queries
    zero(st);
    zero(dpt);
    warp_rows_times_rows<ET, D, T::kM>(st, k_tile, kWarpRows * warp, q_tile(s));
    warp_rows_times_rows<ET, D, T::kM>(dpt, v_tile, kWarpRows * warp, do_tile(s));
    const FragmentCoords qc{at.row0, static_cast<int64_t>(u % n_q_tiles) * T::kM, at.lane};
    if constexpr (kAlibi) {
      add_alibi<T::kM>(st, alibi_coefficient(a, b, h), [&](int n, int e) {
        return alibi_distance(query_diagonal(c, qc.col(n, e), p.seqlen_q),
                              static_cast<float>(keys.pos[e / kRowElems]));
      });
    }
    if constexpr (kBias) {
      add_bias<T::kM>(st, a, b, h, [&](int n, int e) { return qc.col(n, e); }, [&](int, int e) { return qc.row(e); });
    }
    float lse_scaled[T::kM / 8][kRowElems], delta_of[T::kM / 8][kRowElems];  // the lane's query columns
#pragma unroll
    for (int n = 0; n < T::kM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < kRowElems; ++e) {
        const int64_t i = qc.col(n, e);
        lse_scaled[n][e] = i < p.seqlen_q ? lse[i] * kLog2e : INFINITY;
        delta_of[n][e] = i < p.seqlen_q ? delta[i] : 0.0f;
      }
    }
    const float scale_log2 = p.scale * kLog2e;
#pragma unroll
    for (int n = 0; n < T::kM / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = fast_exp2(fmaf(st[n][e], scale_log2, -lse_scaled[n][e % kRowElems]));
    }
    if (!full) {
      mask_fragment(st, 0.0f, [&](int n, int e) {
        return visible(p.mask, query_token(c, qc.col(n, e), p.seqlen_q), keys.seg[e / kRowElems],
                       keys.pos[e / kRowElems]);
      });
    }
    // st: P^T; then dS^T = P^T o (drop o dP^T - delta) into dpt, and st: (P o drop)^T
    if (p.dropout) {
#pragma unroll
      for (int n = 0; n < T::kM / 8; n += 2) {
        const uint32_t kept = dropout_kept_transposed(p, c, h, qc, n);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int t = n + k / 4, e = k % 4;
          const float f = (kept >> k) & 1u ? p.dropout_scale : 0.0f;
          dpt[t][e] = st[t][e] * (f * dpt[t][e] - delta_of[t][e % kRowElems]);
          st[t][e] *= f;
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < T::kM / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[n][e] = st[n][e] * (dpt[n][e] - delta_of[n][e % kRowElems]);
      }
    }
    warp_regs_times_rows<ET, T::kM, T::kOut>(dv, st, do_tile(s), column_block * (T::kOut / 8));
    warp_regs_times_rows<ET, T::kM, T::kOut>(dk, dpt, q_tile(s), column_block * (T::kOut / 8));
  };
  stream_tiles<T::kThreads>(static_cast<int>(group) * n_q_tiles, relation, load, compute);

  const FragmentCoords out{at.row0, column_block * T::kOut, at.lane};
  store_rows<ET>(dk, p.scale, a.dk + kv_offset, kv_stride, out, p.seqlen_kv);
  store_rows<ET>(dv, 1.0f, a.dv + kv_offset, kv_stride, out, p.seqlen_kv);
}

template <int D>
struct DqTiles {
  static constexpr int kM = 64;  // queries per block
  // keys per tile (registers; AMD D=128: Q, dO, K and V within the 64 KB of LDS)
  static constexpr int kN = D == 256 || (kWarpSize == 64 && D == 128) ? 32 : 64;
  static constexpr int kThreads = 128;
  static constexpr int kChunks = D / 8;
  static constexpr int kSharedBytes = (2 * kM + 2 * kPipelineStages * kN) * D * 2;  // Q, dO, then the stages of K and V
  static_assert(kM == kThreads / kWarpSize * kWarpRows, "one fragment of rows per warp");
  static_assert(kN % 16 == 0, "dropout bits come two key tiles at a time");
};

template <ElementType ET, int D, bool kAlibi, bool kBias = false>
__global__ void __launch_bounds__(DqTiles<D>::kThreads) dq_kernel(const FlashArgs a) {
  using T = DqTiles<D>;
  static_assert(T::kM == kSlopeQueryTile && T::kThreads / kWarpSize == kSlopeWarpsPerQueryTile,
                "the slope-gradient slots of launch.h: a warp's each per query tile");
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
  const SwizzledTile<T::kChunks> q_tile{base}, do_tile{base + T::kM * D * 2};
  const auto k_tile = [&](int s) { return SwizzledTile<T::kChunks>{base + (2 * T::kM + 2 * s * T::kN) * D * 2}; };
  const auto v_tile = [&](int s) {
    return SwizzledTile<T::kChunks>{base + (2 * T::kM + (2 * s + 1) * T::kN) * D * 2};
  };

  const int64_t q_stride = p.heads * D, kv_stride = p.kv_heads * D;
  const int64_t q_offset = (b * p.seqlen_q * p.heads + h) * D;
  const int64_t kv_offset = (b * p.seqlen_kv * p.kv_heads + g) * D;
  load_tile<T::kM, T::kChunks, T::kThreads>(q_tile, a.q + q_offset, q_stride, m0, p.seqlen_q);
  load_tile<T::kM, T::kChunks, T::kThreads>(do_tile, a.dout + q_offset, q_stride, m0, p.seqlen_q);
  tile_copies_commit();

  const FragmentCoords at{m0 + kWarpRows * warp, 0, static_cast<int>(threadIdx.x % kWarpSize)};
  QueryToken query[kLaneRows];
  float lse_scaled[kLaneRows], delta[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    const int64_t i = at.row(kRowElems * r);
    query[r] = query_token(c, i, p.seqlen_q);
    lse_scaled[r] = (i < p.seqlen_q ? a.lse[(b * p.heads + h) * p.seqlen_q + i] : INFINITY) * kLog2e;
    delta[r] = i < p.seqlen_q ? a.delta[(b * p.heads + h) * p.seqlen_q + i] : 0.0f;
  }
  float dq[D / 8][4];
  zero(dq);

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
  const float scale_log2 = p.scale * kLog2e;
  const float alibi = kAlibi ? alibi_coefficient(a, b, h) : 0.0f;
  float diagonal[kLaneRows];  // with ALiBi: the lane's rows' diagonals
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) diagonal[r] = kAlibi ? query_diagonal(c, at.row(kRowElems * r), p.seqlen_q) : 0.0f;
  float slope_partial = 0.0f;  // with ALiBi: the lane's part of the slope's gradient
  const auto compute = [&](int t, int s, bool full) {
    float sc[T::kN / 8][4], dp[T::kN / 8][4];
    zero(sc);
    zero(dp);
    warp_rows_times_rows<ET, D, T::kN>(sc, q_tile, kWarpRows * warp, k_tile(s));
    warp_rows_times_rows<ET, D, T::kN>(dp, do_tile, kWarpRows * warp, v_tile(s));
    const FragmentCoords kv{at.row0, static_cast<int64_t>(t) * T::kN, at.lane};
    const auto distance = [&](int n, int e) {
      return alibi_distance(diagonal[e / kRowElems], key_position(c, kv.col(n, e), p.seqlen_kv));
    };
    if constexpr (kAlibi) add_alibi<T::kN>(sc, alibi, distance);
    [[maybe_unused]] const auto query_of = [&](int, int e) { return kv.row(e); };
    [[maybe_unused]] const auto key_of = [&](int n, int e) { return kv.col(n, e); };
    if constexpr (kBias) add_bias<T::kN>(sc, a, b, h, query_of, key_of);
#pragma unroll
    for (int n = 0; n < T::kN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[n][e] = fast_exp2(fmaf(sc[n][e], scale_log2, -lse_scaled[e / kRowElems]));
    }
    if (!full) {
      mask_fragment(sc, 0.0f, [&](int n, int e) {
        return key_visible(p.mask, c, query[e / kRowElems], kv.col(n, e), p.seqlen_kv);
      });
    }
    // sc: P; then dS = P o (drop o dP - delta)
    if (p.dropout) {
#pragma unroll
      for (int n = 0; n < T::kN / 8; n += 2) {
        const uint32_t kept = dropout_kept_pair(p, c, h, kv, n);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int t = n + k / 4, e = k % 4;
          const float f = (kept >> k) & 1u ? p.dropout_scale : 0.0f;
          sc[t][e] *= f * dp[t][e] - delta[e / kRowElems];
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < T::kN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[n][e] *= dp[n][e] - delta[e / kRowElems];
      }
    }
    if constexpr (kAlibi) slope_partial += alibi_slope_partial<T::kN>(sc, distance);
    if constexpr (kBias) store_bias_terms<T::kN>(sc, a, b, h, query_of, key_of);
    warp_regs_times_rows<ET, T::kN, D>(dq, sc, k_tile(s), 0);
  };
  stream_tiles<T::kThreads>(n_kv_tiles, relation, load, compute);

  store_rows<ET>(dq, p.scale, a.dq + q_offset, q_stride, at, p.seqlen_q);
  if constexpr (kAlibi) {
    store_warp_partial(slope_partial, head_slope_slots(a, b, h) + m0 / T::kM * kSlopeWarpsPerQueryTile + warp);
  }
}

}  // namespace flash
}  // namespace fusedattn

#endif  // FUSEDATTN_FLASH_BACKWARD_CUH_
