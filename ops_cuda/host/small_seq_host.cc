// Host build of the small-sequence op (platform "cpu"): the same arithmetic as
// ops_cuda/cuda/small_seq_kernels.cuh in plain loops, so CI runs the whole backend.
// Contract: fusedattn/small_seq.h.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fusedattn/ffi_args.h"
#include "fusedattn/layout.h"
#include "fusedattn/small_seq.h"
#include "fusedattn/small_seq_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace fusedattn {
namespace {

namespace ffi = xla::ffi;

template <ElementType ET>
struct HostTensor {
  using Storage = typename Element<ET>::Storage;
  const Storage* data;
  float at(int64_t index) const { return Element<ET>::load(data[index]); }
};

// Everything one query token (b, i) needs: its key range and Philox coordinates.
struct QueryRange {
  int64_t b, i, token, start;
  int32_t len;
  uint32_t seed0, seed1;
  int64_t philox_b;
};

QueryRange query_range(const SmallSeqParams& p, int64_t token, const int32_t* kv_start,
                       const int32_t* kv_len, const uint32_t* seed) {
  QueryRange r;
  r.token = token;
  r.b = token / p.seqlen_q;
  r.i = token % p.seqlen_q;
  r.start = kv_start[token];
  r.len = kv_len[token];
  const int64_t seed_row = broadcast_row(r.b, p.batch, p.seed_rows);
  r.seed0 = seed[2 * seed_row];
  r.seed1 = seed[2 * seed_row + 1];
  r.philox_b = broadcast_inner(r.b, p.batch, p.seed_rows);
  return r;
}

bool range_ok(const SmallSeqParams& p, const QueryRange& r) {
  return small_seq_len_ok(r.len, p.max_keys) && r.start >= 0 && r.start + r.len <= p.seqlen_kv;
}

// Scaled scores of query head h against its keys, all kSmallSeqMaxKeys slots (0 past the live ones).
template <ElementType ET>
void scores(const SmallSeqParams& p, const QueryRange& r, int64_t h, HostTensor<ET> q, HostTensor<ET> k,
            float (&s)[kSmallSeqMaxKeys]) {
  const int64_t D = p.head_dim, kvh = kv_head_of(h, p.heads, p.kv_heads);
  for (int j = 0; j < kSmallSeqMaxKeys; ++j) {
    float dot = 0.0f;
    if (j < r.len) {
      for (int64_t d = 0; d < D; ++d) {
        dot += q.at(bshd_offset(r.b, r.i, h, d, p.seqlen_q, p.heads, D)) *
               k.at(bshd_offset(r.b, r.start + j, kvh, d, p.seqlen_kv, p.kv_heads, D));
      }
    }
    s[j] = dot * p.scale;
  }
}

template <ElementType ET>
void forward(const SmallSeqParams& p, const void* q_data, const void* k_data, const void* v_data,
             const int32_t* kv_start, const int32_t* kv_len, const uint32_t* seed, void* o_data, float* lse) {
  using Storage = typename Element<ET>::Storage;
  const HostTensor<ET> q{static_cast<const Storage*>(q_data)}, k{static_cast<const Storage*>(k_data)},
      v{static_cast<const Storage*>(v_data)};
  Storage* o = static_cast<Storage*>(o_data);
  const int64_t D = p.head_dim;
  for (int64_t token = 0; token < p.batch * p.seqlen_q; ++token) {
    const QueryRange r = query_range(p, token, kv_start, kv_len, seed);
    for (int64_t h = 0; h < p.heads; ++h) {
      Storage* out = o + bshd_offset(r.b, r.i, h, 0, p.seqlen_q, p.heads, D);
      float* out_lse = lse + token * p.heads + h;
      if (!range_ok(p, r)) {
        for (int64_t d = 0; d < D; ++d) out[d] = Element<ET>::store(NAN);
        *out_lse = NAN;
        continue;
      }
      float s[kSmallSeqMaxKeys];
      scores(p, r, h, q, k, s);
      *out_lse = small_seq_softmax(s, r.len);
      const int64_t kvh = kv_head_of(h, p.heads, p.kv_heads);
      for (int j = 0; j < r.len; ++j) {
        s[j] *= small_seq_dropout_factor(p, r.seed0, r.seed1, r.philox_b, h, r.i, r.start + j);
      }
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.0f;
        for (int j = 0; j < r.len; ++j) {
          acc += s[j] * v.at(bshd_offset(r.b, r.start + j, kvh, d, p.seqlen_kv, p.kv_heads, D));
        }
        out[d] = Element<ET>::store(acc);
      }
    }
  }
}

template <ElementType ET>
void backward(const SmallSeqParams& p, const void* q_data, const void* k_data, const void* v_data,
              const int32_t* kv_start, const int32_t* kv_len, const uint32_t* seed, const void* o_data,
              const float* lse, const void* do_data, void* dq_data, void* dk_data, void* dv_data) {
  using Storage = typename Element<ET>::Storage;
  const HostTensor<ET> q{static_cast<const Storage*>(q_data)}, k{static_cast<const Storage*>(k_data)},
      v{static_cast<const Storage*>(v_data)}, o{static_cast<const Storage*>(o_data)},
      dout{static_cast<const Storage*>(do_data)};
  Storage* dq = static_cast<Storage*>(dq_data);
  Storage* dk = static_cast<Storage*>(dk_data);
  Storage* dv = static_cast<Storage*>(dv_data);
  const int64_t D = p.head_dim;
  const int64_t kv_elements = p.batch * p.seqlen_kv * p.kv_heads * D;
  // float accumulators for dk/dv: the query heads of a group add into one key row.
  std::vector<float> dk_acc(kv_elements, 0.0f), dv_acc(kv_elements, 0.0f);
  for (int64_t token = 0; token < p.batch * p.seqlen_q; ++token) {
    const QueryRange r = query_range(p, token, kv_start, kv_len, seed);
    for (int64_t h = 0; h < p.heads; ++h) {
      Storage* dq_row = dq + bshd_offset(r.b, r.i, h, 0, p.seqlen_q, p.heads, D);
      if (!range_ok(p, r)) {
        for (int64_t d = 0; d < D; ++d) dq_row[d] = Element<ET>::store(NAN);
        continue;
      }
      const int64_t kvh = kv_head_of(h, p.heads, p.kv_heads);
      auto q_at = [&](int64_t d) { return q.at(bshd_offset(r.b, r.i, h, d, p.seqlen_q, p.heads, D)); };
      auto do_at = [&](int64_t d) { return dout.at(bshd_offset(r.b, r.i, h, d, p.seqlen_q, p.heads, D)); };
      auto kv_index = [&](int j, int64_t d) {
        return bshd_offset(r.b, r.start + j, kvh, d, p.seqlen_kv, p.kv_heads, D);
      };
      float s[kSmallSeqMaxKeys];
      scores(p, r, h, q, k, s);
      const float row_lse = lse[token * p.heads + h];
      for (int j = 0; j < r.len; ++j) s[j] = small_seq_weight(s[j], row_lse);
      float delta = 0.0f;  // rowsum(dO * O)
      for (int64_t d = 0; d < D; ++d) {
        delta += do_at(d) * o.at(bshd_offset(r.b, r.i, h, d, p.seqlen_q, p.heads, D));
      }
      float ds[kSmallSeqMaxKeys];
      for (int j = 0; j < r.len; ++j) {
        const float factor = small_seq_dropout_factor(p, r.seed0, r.seed1, r.philox_b, h, r.i, r.start + j);
        float dp = 0.0f;
        for (int64_t d = 0; d < D; ++d) dp += do_at(d) * v.at(kv_index(j, d));
        dp *= factor;
        ds[j] = s[j] * (dp - delta) * p.scale;
        for (int64_t d = 0; d < D; ++d) {
          dv_acc[kv_index(j, d)] += s[j] * factor * do_at(d);
          dk_acc[kv_index(j, d)] += ds[j] * q_at(d);
        }
      }
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.0f;
        for (int j = 0; j < r.len; ++j) acc += ds[j] * k.at(kv_index(j, d));
        dq_row[d] = Element<ET>::store(acc);
      }
    }
  }
  for (int64_t e = 0; e < kv_elements; ++e) {
    dk[e] = Element<ET>::store(dk_acc[e]);
    dv[e] = Element<ET>::store(dv_acc[e]);
  }
}

ffi::Error SmallSeqFwdHostImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer kv_start,
                               ffi::AnyBuffer kv_len, ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> o,
                               ffi::Result<ffi::AnyBuffer> lse, float scale, double dropout_rate, int64_t max_keys) {
  constexpr const char* kOp = "fusedattn_small_seq_fwd (cpu)";
  SmallSeqParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_small_seq_call(kOp, q, k, v, kv_start, kv_len, seed, scale, dropout_rate, max_keys, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = check_small_seq_forward_results(kOp, SmallSeqDims(p, lead), q.element_type(), *o, *lse); e.failure()) return e;
  with_element_type(q.element_type(), [&](auto et) {
    forward<decltype(et)::value>(p, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                                 kv_start.typed_data<int32_t>(), kv_len.typed_data<int32_t>(),
                                 seed.typed_data<uint32_t>(), o->untyped_data(), lse->typed_data<float>());
  });
  return ffi::Error::Success();
}

ffi::Error SmallSeqBwdHostImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer kv_start,
                               ffi::AnyBuffer kv_len, ffi::AnyBuffer seed, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                               ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                               ffi::Result<ffi::AnyBuffer> dv, float scale, double dropout_rate, int64_t max_keys) {
  constexpr const char* kOp = "fusedattn_small_seq_bwd (cpu)";
  SmallSeqParams p;
  std::vector<int64_t> lead;
  if (auto e = parse_small_seq_call(kOp, q, k, v, kv_start, kv_len, seed, scale, dropout_rate, max_keys, &p, &lead);
      e.failure()) {
    return e;
  }
  if (auto e = check_small_seq_backward_buffers(kOp, SmallSeqDims(p, lead), q.element_type(), o, lse, dout, *dq, *dk,
                                                         *dv);
      e.failure()) {
    return e;
  }
  with_element_type(q.element_type(), [&](auto et) {
    backward<decltype(et)::value>(p, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                                  kv_start.typed_data<int32_t>(), kv_len.typed_data<int32_t>(),
                                  seed.typed_data<uint32_t>(), o.untyped_data(), lse.typed_data<float>(),
                                  dout.untyped_data(), dq->untyped_data(), dk->untyped_data(), dv->untyped_data());
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fusedattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqFwdHost, fusedattn::SmallSeqFwdHostImpl,
                              fusedattn::bind_small_seq<fusedattn::Pass::kForward>(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedattnSmallSeqBwdHost, fusedattn::SmallSeqBwdHostImpl,
                              fusedattn::bind_small_seq<fusedattn::Pass::kBackward>(xla::ffi::Ffi::Bind()));
