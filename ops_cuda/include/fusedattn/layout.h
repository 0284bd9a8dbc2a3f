// Index math of the canonical call (fusedattn/ops/backends/base.py): row-major
// BSHD arrays, grouped-query head mapping, and the "leading dims" broadcast
// rule that lets jax.vmap fold mapped axes into the kernel's batch.
//
//   q  [B, Sq,  H,   D ]     o   [B, Sq, H, Dv]     lse [B, H, Sq]
//   k  [B, Skv, Hkv, D ]     q_seg/q_pos/q_diag [B, Sq]
//   v  [B, Skv, Hkv, Dv]     kv_seg/kv_pos      [B, Skv]
//
// B is the product of all leading dims (vmap prepends axes). A per-batch-row
// operand with leading product L (L divides B), e.g. softmax_offset [..., H]
// or the dropout seed [..., 2], serves batch row b with its row b / (B / L):
// under vmap(method="broadcast_all") every operand carries the same mapped
// axes, so each mapped example keeps its own offset and seed. The Philox batch
// coordinate of row b is b % (B / L_seed), its index within its seed's group,
// so a vmapped call draws exactly the masks of the unbatched calls.
#ifndef FUSEDATTN_LAYOUT_H_
#define FUSEDATTN_LAYOUT_H_

#include <cstdint>

#include "fusedattn/mask.h"
#include "fusedattn/portability.h"

namespace fusedattn {

// Offset of element (b, s, h, d) of a row-major [B, S, H, D] array.
FA_HOST_DEVICE FA_INLINE int64_t bshd_offset(int64_t b, int64_t s, int64_t h, int64_t d, int64_t S,
                                             int64_t H, int64_t D) {
  return ((b * S + s) * H + h) * D + d;
}

// Offset of element (b, h, s) of a row-major [B, H, S] array (the lse layout).
FA_HOST_DEVICE FA_INLINE int64_t bhs_offset(int64_t b, int64_t h, int64_t s, int64_t H, int64_t S) {
  return (b * H + h) * S + s;
}

// Grouped-query attention: the K/V head that query head h reads.
FA_HOST_DEVICE FA_INLINE int64_t kv_head_of(int64_t h, int64_t H, int64_t Hkv) { return h / (H / Hkv); }

// Leading-dims broadcast: the row of an operand with L rows that batch row b uses.
FA_HOST_DEVICE FA_INLINE int64_t broadcast_row(int64_t b, int64_t B, int64_t L) { return b / (B / L); }

// The index of batch row b within its group of B / L rows (the Philox batch coordinate).
FA_HOST_DEVICE FA_INLINE int64_t broadcast_inner(int64_t b, int64_t B, int64_t L) { return b % (B / L); }

// Everything static (and the broadcast extents) of one canonical call.
struct AttentionParams {
  int64_t batch;       // B
  int64_t seqlen_q;    // Sq
  int64_t seqlen_kv;   // Skv
  int64_t heads;       // H
  int64_t kv_heads;    // Hkv (divides H)
  int64_t head_dim;    // D
  int64_t head_dim_v;  // Dv
  int64_t token_rows;  // L of the token vectors (q_seg ... kv_pos)
  int64_t offset_rows; // L of softmax_offset
  int64_t seed_rows;   // L of the dropout seed
  int64_t slopes_rows; // L of alibi_slopes
  float scale;
  MaskParams mask;
  int32_t softmax_type;
  bool alibi;  // scores gain the ALiBi term of alibi.h
  int32_t bias_type;   // bias.h's BiasKind: none, or a bias array before or after the scale
  int64_t bias_batch;  // Bb of the bias array [Bb, Hb, Sq, Skv]: 1 or B
  int64_t bias_heads;  // Hb: 1 or H
  bool dropout;
  uint32_t dropout_threshold;
  float dropout_scale;  // 1 / (1 - rate)
};

}  // namespace fusedattn

#endif  // FUSEDATTN_LAYOUT_H_
