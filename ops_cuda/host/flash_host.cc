// The "flash" attention op for platform "cpu": a plain C++ implementation of
// the canonical op (forward and backward) over the shared headers. Float32
// accumulation; work is split over (batch row, k/v head) groups so that each
// dk/dv slice has exactly one writer.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "fusedattn/alibi.h"
#include "fusedattn/bias.h"
#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/mask.h"
#include "fusedattn/philox.h"
#include "fusedattn/portability.h"
#include "fusedattn/softmax.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

constexpr int kMaxThreads = 8;
// Below this many multiply-adds a call runs on the calling thread.
constexpr int64_t kMinWorkForThreads = 1 << 18;

// Runs fn(group) for group in [0, groups) on up to kMaxThreads threads.
template <typename Fn>
void parallel_for(int64_t groups, int64_t work, Fn fn) {
  int threads = static_cast<int>(std::min<int64_t>(
      {static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency())), kMaxThreads, groups}));
  if (work < kMinWorkForThreads) threads = 1;
  if (threads <= 1) {
    for (int64_t g = 0; g < groups; ++g) fn(g);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t g = next.fetch_add(1); g < groups; g = next.fetch_add(1)) fn(g);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

// Per-batch-row views of the shared operands.
struct Tokens {
  const int32_t* q_seg;
  const int32_t* q_pos;
  const int32_t* q_diag;
  const int32_t* kv_seg;
  const int32_t* kv_pos;
};

struct RowContext {
  const int32_t* q_seg;
  const int32_t* q_pos;
  const int32_t* q_diag;
  const int32_t* kv_seg;
  const int32_t* kv_pos;
  const float* offset;  // [H]
  const float* slopes;  // [H], ALiBi
  const float* bias;    // the bias array [Bb, Hb, Sq, Skv]; null without one
  uint32_t seed0, seed1;
  uint32_t philox_batch;
};

RowContext row_context(const AttentionParams& p, const Tokens& t, const float* offset, const uint32_t* seed,
                       const float* slopes, const float* bias, int64_t b) {
  RowContext c;
  const int64_t tr = broadcast_row(b, p.batch, p.token_rows);
  c.q_seg = t.q_seg + tr * p.seqlen_q;
  c.q_pos = t.q_pos + tr * p.seqlen_q;
  c.q_diag = t.q_diag + tr * p.seqlen_q;
  c.kv_seg = t.kv_seg + tr * p.seqlen_kv;
  c.kv_pos = t.kv_pos + tr * p.seqlen_kv;
  c.offset = offset + broadcast_row(b, p.batch, p.offset_rows) * p.heads;
  c.slopes = slopes + broadcast_row(b, p.batch, p.slopes_rows) * p.heads;
  c.bias = p.bias_type == kBiasNone ? nullptr : bias;
  const int64_t sr = broadcast_row(b, p.batch, p.seed_rows);
  c.seed0 = seed[2 * sr];
  c.seed1 = seed[2 * sr + 1];
  c.philox_batch = static_cast<uint32_t>(broadcast_inner(b, p.batch, p.seed_rows));
  return c;
}

// Dropout factor of key j in row (b, h, i): 0 (dropped) or 1 / (1 - rate); 1 without dropout.
struct DropoutRow {
  std::vector<float> factor;
  void fill(const AttentionParams& p, const RowContext& c, int64_t h, int64_t i) {
    factor.assign(p.seqlen_kv, 1.0f);
    if (!p.dropout) return;
    for (int64_t j0 = 0; j0 < p.seqlen_kv; j0 += kDrawsPerCounter) {
      const Philox4 draws = dropout_draws(c.seed0, c.seed1, c.philox_batch, static_cast<uint32_t>(h),
                                          static_cast<uint32_t>(i), static_cast<uint32_t>(j0 / kDrawsPerCounter));
      for (int slot = 0; slot < kDrawsPerCounter && j0 + slot < p.seqlen_kv; ++slot) {
        factor[j0 + slot] = draw16(draws, slot) >= p.dropout_threshold ? p.dropout_scale : 0.0f;
      }
    }
  }
};

template <ElementType ET>
using Store = typename Element<ET>::Storage;

// Loads the [S, Dx] slice (b, :, head, :) of a [B, S, Hx, Dx] array into float.
template <ElementType ET>
void load_slice(const Store<ET>* x, int64_t b, int64_t head, int64_t S, int64_t Hx, int64_t Dx, float* out) {
  for (int64_t s = 0; s < S; ++s) {
    const Store<ET>* row = x + bshd_offset(b, s, head, 0, S, Hx, Dx);
    for (int64_t d = 0; d < Dx; ++d) out[s * Dx + d] = Element<ET>::load(row[d]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

// Row (b, h, i) of the bias array (bias.h), null without one.
inline const float* bias_row(const AttentionParams& p, const RowContext& c, int64_t b, int64_t h, int64_t i) {
  return c.bias ? c.bias + bias_row_offset(b, h, i, p.bias_batch, p.bias_heads, p.seqlen_q, p.seqlen_kv) : nullptr;
}

// The score the softmax sees of key j: scale * q.k with the bias array's term (brow: its
// row, or null) and the ALiBi term where the call has them.
inline float score(const AttentionParams& p, float qk, float slope, const float* brow, int64_t j,
                   const QueryToken& qt, int32_t kv_pos) {
  const float s = brow ? biased_score(p.bias_type, p.scale, qk, brow[j]) : p.scale * qk;
  return p.alibi ? s + alibi_term(slope, qt.diagonal, kv_pos) : s;
}

// The operands both directions read.
template <ElementType ET>
struct Inputs {
  const Store<ET>* q;
  const Store<ET>* k;
  const Store<ET>* v;
  Tokens tokens;
  const float* offset;
  const uint32_t* seed;
  const float* slopes;
  const float* bias;
};

// Runs fn(b, g, c, kf, vf) for every group (batch row b, k/v head g) on the
// pool: c is row b's context, kf and vf the group's K [Skv, D] and V [Skv, Dv]
// as floats.
template <ElementType ET, typename Fn>
void for_each_kv_group(const AttentionParams& p, const Inputs<ET>& a, int64_t work, Fn fn) {
  parallel_for(p.batch * p.kv_heads, work, [&](int64_t group) {
    const int64_t b = group / p.kv_heads, g = group % p.kv_heads;
    const RowContext c = row_context(p, a.tokens, a.offset, a.seed, a.slopes, a.bias, b);
    std::vector<float> kf(p.seqlen_kv * p.head_dim), vf(p.seqlen_kv * p.head_dim_v);
    load_slice<ET>(a.k, b, g, p.seqlen_kv, p.kv_heads, p.head_dim, kf.data());
    load_slice<ET>(a.v, b, g, p.seqlen_kv, p.kv_heads, p.head_dim_v, vf.data());
    fn(b, g, c, kf, vf);
  });
}

template <ElementType ET>
struct FwdArgs : Inputs<ET> {
  Store<ET>* o;
  float* lse;
};

template <ElementType ET>
void forward(const AttentionParams& p, const FwdArgs<ET>& a) {
  const int64_t group_size = p.heads / p.kv_heads;
  const int64_t work = p.batch * p.heads * p.seqlen_q * p.seqlen_kv * (p.head_dim + p.head_dim_v);
  for_each_kv_group(p, a, work, [&](int64_t b, int64_t g, const RowContext& c, const auto& kf, const auto& vf) {
    std::vector<float> qf(p.head_dim), s(p.seqlen_kv), acc(p.head_dim_v);
    std::vector<char> vis(p.seqlen_kv);
    DropoutRow drop;
    for (int64_t h = g * group_size; h < (g + 1) * group_size; ++h) {
      const float sink = softmax_sink_logit(p.softmax_type, c.offset[h]);
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        const Store<ET>* qrow = a.q + bshd_offset(b, i, h, 0, p.seqlen_q, p.heads, p.head_dim);
        for (int64_t d = 0; d < p.head_dim; ++d) qf[d] = Element<ET>::load(qrow[d]);
        const QueryToken qt = make_query_token(c.q_seg[i], c.q_pos[i], c.q_diag[i]);
        const float* brow = bias_row(p, c, b, h, i);
        SoftmaxState st;
        st.init();
        float row_max = -INFINITY;
        bool any = false;
        for (int64_t j = 0; j < p.seqlen_kv; ++j) {
          vis[j] = visible(p.mask, qt, c.kv_seg[j], c.kv_pos[j]);
          if (!vis[j]) continue;
          s[j] = score(p, dot(qf.data(), kf.data() + j * p.head_dim, p.head_dim), c.slopes[h], brow, j, qt,
                       c.kv_pos[j]);
          row_max = any ? std::max(row_max, s[j]) : s[j];
          any = true;
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        if (any) {
          st.rescale(row_max);
          drop.fill(p, c, h, i);
          for (int64_t j = 0; j < p.seqlen_kv; ++j) {
            if (!vis[j]) continue;
            const float e = st.add(s[j]);
            const float w = e * drop.factor[j];
            if (w == 0.0f) continue;
            const float* vrow = vf.data() + j * p.head_dim_v;
            for (int64_t d = 0; d < p.head_dim_v; ++d) acc[d] += w * vrow[d];
          }
        }
        float inv = 0.0f;
        const float lse = st.finalize(p.softmax_type, sink, &inv);
        Store<ET>* orow = a.o + bshd_offset(b, i, h, 0, p.seqlen_q, p.heads, p.head_dim_v);
        for (int64_t d = 0; d < p.head_dim_v; ++d) orow[d] = Element<ET>::store(acc[d] * inv);
        a.lse[bhs_offset(b, h, i, p.heads, p.seqlen_q)] = lse;
      }
    }
  });
}

template <ElementType ET>
struct BwdArgs : Inputs<ET> {
  const Store<ET>* o;
  const float* lse;
  const Store<ET>* dout;
  Store<ET>* dq;
  Store<ET>* dk;
  Store<ET>* dv;
  float* d_offset;
  float* d_slopes;
  float* d_bias;  // shaped like the bias array; null: its gradient not wanted
};

// Where the backward writes dS's bias terms (bias_gradient) of every (b, h, i, j), float32
// [B, H, Sq, Skv]: d_bias itself when the bias has every batch row and head, else scratch
// that reduce() sums over the shared dims into d_bias in a fixed order (deterministic).
// d_bias null: the gradient is not wanted (nor computed).
class BiasGradient {
 public:
  BiasGradient(const AttentionParams& p, float* d_bias) : p_(p), d_bias_(d_bias) {
    if (!wanted()) return;
    const int64_t n = p.batch * p.heads * p.seqlen_q * p.seqlen_kv;
    if (!direct()) scratch_.assign(n, 0.0f);
  }
  // Row (b, h, i) of the terms, null without a bias or where its gradient is not wanted.
  float* row(int64_t b, int64_t h, int64_t i) {
    if (!wanted()) return nullptr;
    float* base = direct() ? d_bias_ : scratch_.data();
    return base + (bhs_offset(b, h, i, p_.heads, p_.seqlen_q)) * p_.seqlen_kv;
  }
  void reduce() {
    if (!wanted() || direct()) return;
    const int64_t area = p_.seqlen_q * p_.seqlen_kv;
    for (int64_t b = 0; b < p_.batch; ++b) {
      for (int64_t h = 0; h < p_.heads; ++h) {
        float* out = d_bias_ + bias_row_offset(b, h, 0, p_.bias_batch, p_.bias_heads, p_.seqlen_q, p_.seqlen_kv);
        const float* in = scratch_.data() + (b * p_.heads + h) * area;
        for (int64_t x = 0; x < area; ++x) out[x] += in[x];
      }
    }
  }

 private:
  bool wanted() const { return p_.bias_type != kBiasNone && d_bias_ != nullptr; }
  bool direct() const { return p_.bias_batch == p_.batch && p_.bias_heads == p_.heads; }
  const AttentionParams& p_;
  float* d_bias_;
  std::vector<float> scratch_;
};

template <ElementType ET>
void backward(const AttentionParams& p, const BwdArgs<ET>& a) {
  const int64_t group_size = p.heads / p.kv_heads;
  const int64_t work = 2 * p.batch * p.heads * p.seqlen_q * p.seqlen_kv * (p.head_dim + p.head_dim_v);
  BiasGradient d_bias(p, a.d_bias);
  for_each_kv_group(p, a, work, [&](int64_t b, int64_t g, const RowContext& c, const auto& kf, const auto& vf) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    std::vector<float> dk_acc(p.seqlen_kv * D, 0.0f), dv_acc(p.seqlen_kv * Dv, 0.0f);
    std::vector<float> qf(D), dof(Dv), dq_acc(D);
    DropoutRow drop;
    for (int64_t h = g * group_size; h < (g + 1) * group_size; ++h) {
      const float sink = softmax_sink_logit(p.softmax_type, c.offset[h]);
      float d_sink = 0.0f;
      float d_slope = 0.0f;  // sum of dS * (-|distance|)
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        std::fill(dq_acc.begin(), dq_acc.end(), 0.0f);
        const float lse = a.lse[bhs_offset(b, h, i, p.heads, p.seqlen_q)];
        const QueryToken qt = make_query_token(c.q_seg[i], c.q_pos[i], c.q_diag[i]);
        const float* brow = bias_row(p, c, b, h, i);
        float* d_brow = d_bias.row(b, h, i);
        if (std::isfinite(lse)) {  // +inf marks a row with no visible key: all gradients 0
          const Store<ET>* qrow = a.q + bshd_offset(b, i, h, 0, p.seqlen_q, p.heads, D);
          const Store<ET>* orow = a.o + bshd_offset(b, i, h, 0, p.seqlen_q, p.heads, Dv);
          const Store<ET>* dorow = a.dout + bshd_offset(b, i, h, 0, p.seqlen_q, p.heads, Dv);
          float delta = 0.0f;  // D_i = rowsum(dO * O)
          for (int64_t d = 0; d < D; ++d) qf[d] = Element<ET>::load(qrow[d]);
          for (int64_t d = 0; d < Dv; ++d) {
            dof[d] = Element<ET>::load(dorow[d]);
            delta += dof[d] * Element<ET>::load(orow[d]);
          }
          drop.fill(p, c, h, i);
          for (int64_t j = 0; j < p.seqlen_kv; ++j) {
            if (!visible(p.mask, qt, c.kv_seg[j], c.kv_pos[j])) continue;
            const float* krow = kf.data() + j * D;
            const float* vrow = vf.data() + j * Dv;
            const float s = score(p, dot(qf.data(), krow, D), c.slopes[h], brow, j, qt, c.kv_pos[j]);
            const float prob = softmax_weight(s, lse);
            const float f = drop.factor[j];
            const float dp = f == 0.0f ? 0.0f : f * dot(dof.data(), vrow, Dv);
            const float ds = prob * (dp - delta);
            const float pd = prob * f;
            if (p.alibi) d_slope -= ds * alibi_distance(qt.diagonal, c.kv_pos[j]);
            if (d_brow) d_brow[j] = bias_gradient(p.bias_type, p.scale, ds);
            float* dk_row = dk_acc.data() + j * D;
            float* dv_row = dv_acc.data() + j * Dv;
            for (int64_t d = 0; d < D; ++d) {
              dq_acc[d] += ds * krow[d];
              dk_row[d] += ds * qf[d];
            }
            if (pd != 0.0f) {
              for (int64_t d = 0; d < Dv; ++d) dv_row[d] += pd * dof[d];
            }
          }
          d_sink -= softmax_sink_weight(p.softmax_type, sink, lse) * delta;
        }
        Store<ET>* dqrow = a.dq + bshd_offset(b, i, h, 0, p.seqlen_q, p.heads, D);
        for (int64_t d = 0; d < D; ++d) dqrow[d] = Element<ET>::store(p.scale * dq_acc[d]);
      }
      a.d_offset[b * p.heads + h] = p.softmax_type == kSoftmaxLearnable ? d_sink : 0.0f;
      a.d_slopes[b * p.heads + h] = d_slope;
    }
    for (int64_t j = 0; j < p.seqlen_kv; ++j) {
      Store<ET>* dkrow = a.dk + bshd_offset(b, j, g, 0, p.seqlen_kv, p.kv_heads, D);
      Store<ET>* dvrow = a.dv + bshd_offset(b, j, g, 0, p.seqlen_kv, p.kv_heads, Dv);
      for (int64_t d = 0; d < D; ++d) dkrow[d] = Element<ET>::store(p.scale * dk_acc[j * D + d]);
      for (int64_t d = 0; d < Dv; ++d) dvrow[d] = Element<ET>::store(dv_acc[j * Dv + d]);
    }
  });
  d_bias.reduce();
}

template <ElementType ET>
Inputs<ET> inputs_of(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const ffi::AnyBuffer& q_seg, const ffi::AnyBuffer& q_pos, const ffi::AnyBuffer& q_diag,
                     const ffi::AnyBuffer& kv_seg, const ffi::AnyBuffer& kv_pos, const ffi::AnyBuffer& softmax_offset,
                     const ffi::AnyBuffer& seed, const ffi::AnyBuffer& alibi_slopes, const ffi::AnyBuffer& bias) {
  const Tokens tokens{q_seg.typed_data<int32_t>(), q_pos.typed_data<int32_t>(), q_diag.typed_data<int32_t>(),
                      kv_seg.typed_data<int32_t>(), kv_pos.typed_data<int32_t>()};
  return {elements<ET>(q), elements<ET>(k), elements<ET>(v), tokens, softmax_offset.typed_data<float>(),
          seed.typed_data<uint32_t>(), alibi_slopes.typed_data<float>(), bias.typed_data<float>()};
}

ffi::Error FlashFwdImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_seg,
                        ffi::AnyBuffer q_pos, ffi::AnyBuffer q_diag, ffi::AnyBuffer kv_seg, ffi::AnyBuffer kv_pos,
                        ffi::AnyBuffer softmax_offset, ffi::AnyBuffer seed, ffi::AnyBuffer alibi_slopes,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale, bool causal,
                        int64_t window_left, int64_t window_right, int32_t softmax_type, double dropout_rate,
                        bool alibi, int32_t bias_type) {
  constexpr const char* kOp = "fusedattn_flash_fwd (cpu)";
  AttentionParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_attention_call(kOp, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed,
                                    alibi_slopes, scale, causal, window_left, window_right, softmax_type,
                                    dropout_rate, alibi, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = parse_bias(kOp, bias, bias_type, &p); e.failure()) return e;
  if (auto e = check_forward_results(kOp, p, lead, q.element_type(), o, lse); e.failure()) return e;
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return ffi::Error::Success();
  with_element_type(q.element_type(), [&](auto et) {
    constexpr ElementType kET = decltype(et)::value;
    forward<kET>(p, {inputs_of<kET>(q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed, alibi_slopes,
                                     bias),
                     elements<kET>(o), lse->typed_data<float>()});
  });
  return ffi::Error::Success();
}

ffi::Error FlashBwdImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_seg,
                        ffi::AnyBuffer q_pos, ffi::AnyBuffer q_diag, ffi::AnyBuffer kv_seg, ffi::AnyBuffer kv_pos,
                        ffi::AnyBuffer softmax_offset, ffi::AnyBuffer seed, ffi::AnyBuffer alibi_slopes,
                        ffi::AnyBuffer bias, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> d_offset, ffi::Result<ffi::AnyBuffer> d_slopes,
                        ffi::Result<ffi::AnyBuffer> d_bias, float scale, bool causal, int64_t window_left,
                        int64_t window_right, int32_t softmax_type, double dropout_rate, bool alibi,
                        int32_t bias_type, bool /*deterministic: the host backward always is*/) {
  constexpr const char* kOp = "fusedattn_flash_bwd (cpu)";
  AttentionParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_attention_call(kOp, q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed,
                                    alibi_slopes, scale, causal, window_left, window_right, softmax_type,
                                    dropout_rate, alibi, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = parse_bias(kOp, bias, bias_type, &p); e.failure()) return e;
  const ffi::DataType dt = q.element_type();
  if (auto e = check_backward_buffers(kOp, p, lead, dt, o, lse, dout, dq, dk, dv, d_offset, d_slopes); e.failure()) return e;
  if (auto e = check_bias_gradient(kOp, bias, d_bias); e.failure()) return e;
  std::fill_n(d_bias->typed_data<float>(), d_bias->element_count(), 0.0f);
  if (p.batch == 0 || p.heads == 0) return ffi::Error::Success();
  with_element_type(dt, [&](auto et) {
    constexpr ElementType kET = decltype(et)::value;
    backward<kET>(p, {inputs_of<kET>(q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos, softmax_offset, seed, alibi_slopes,
                                      bias),
                      elements<kET>(o), lse.typed_data<float>(), elements<kET>(dout), elements<kET>(dq),
                      elements<kET>(dk), elements<kET>(dv), d_offset->typed_data<float>(),
                      d_slopes->typed_data<float>(),
                      bias_gradient_wanted(p, d_bias) ? d_bias->typed_data<float>() : nullptr});
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fusedattn

namespace ffi = xla::ffi;

FA_FFI_EXPORT(FusedattnFlashFwdHost);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnFlashFwdHost, fusedattn::FlashFwdImpl,
                              fusedattn::bind_attention<fusedattn::Pass::kForward>(ffi::Ffi::Bind()));

FA_FFI_EXPORT(FusedattnFlashBwdHost);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnFlashBwdHost, fusedattn::FlashBwdImpl,
                              fusedattn::bind_attention<fusedattn::Pass::kBackward>(ffi::Ffi::Bind()));
