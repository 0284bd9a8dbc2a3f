// The bf16/fp16 SDPA graphs (forward with or without stats, backward) and the tensor
// helpers every graph uses. Operands are the canonical BSHD arrays of
// fusedattn/ops/backends/base.py, given to cuDNN as strided [b, h, s, d] views (no copies).
#include "cudnn_common.h"

namespace fusedattn_cudnn {

RaggedOffsets ragged_offsets(fe::graph::Graph& g, const Params& p) {
  if (!p.ragged) return {};
  auto offsets = [&](const char* name, Uid uid) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({cudnn_batch(p) + 1, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  };
  return {offsets("offsets_q", kOffQ), offsets("offsets_o", kOffO), offsets("offsets_k", kOffK),
          offsets("offsets_v", kOffV)};
}

namespace {

// Shapes [batch, heads, s, dim] and strides of a row-major [b, s, heads, dim] array;
// ragged segments take their start from `offsets` instead of the batch stride.
void shape_bshd(fe::graph::Tensor_attributes& t, const Params& p, const Tensor& offsets, int64_t heads,
                int64_t s, int64_t dim) {
  t.set_dim({cudnn_batch(p), heads, s, dim}).set_stride({s * heads * dim, dim, heads * dim, 1});
  if (offsets) t.set_ragged_offset(offsets);
}

std::vector<int64_t> bias_dims(const Params& p) { return {p.bias_b, p.bias_h, p.sq, p.skv}; }
std::vector<int64_t> bias_strides(const Params& p) { return {p.bias_h * p.sq * p.skv, p.sq * p.skv, p.skv, 1}; }
std::vector<int64_t> stats_dims(const Params& p) { return {cudnn_batch(p), p.h, p.seg_sq, 1}; }
std::vector<int64_t> stats_strides(const Params& p) { return {p.h * p.seg_sq, p.seg_sq, 1, 1}; }

Tensor scalar_int64(fe::graph::Graph& g, const char* name, Uid uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT64));
}

// Bias, ALiBi, dropout and sink (the bf16/fp16 graphs only): the same for both directions.
template <typename Attributes>
void set_extras(fe::graph::Graph& g, Attributes& a, const Params& p) {
  if (p.bias_b > 0) {
    a.set_bias(g.tensor(fe::graph::Tensor_attributes()
                            .set_name("bias")
                            .set_uid(kBias)
                            .set_dim(bias_dims(p))
                            .set_stride(bias_strides(p))));
  }
  if (p.alibi) a.set_alibi_mask(true);
  if (p.dropout > 0.0f) {
    a.set_dropout(p.dropout, scalar_int64(g, "seed", kSeed), scalar_int64(g, "offset", kOffset));
  }
  if (p.sink) {
    a.set_sink_token(g.tensor(fe::graph::Tensor_attributes()
                                  .set_name("sink")
                                  .set_uid(kSink)
                                  .set_dim({1, p.h, 1, 1})
                                  .set_stride({p.h, 1, 1, 1})
                                  .set_data_type(fe::DataType_t::FLOAT)));
  }
}

std::shared_ptr<fe::graph::Graph> new_graph(const Params& p) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

}  // namespace

Tensor bshd(fe::graph::Graph& g, const char* name, Uid uid, const Params& p, const Tensor& offsets,
            int64_t heads, int64_t s, int64_t dim) {
  fe::graph::Tensor_attributes t;
  t.set_name(name).set_uid(uid);
  shape_bshd(t, p, offsets, heads, s, dim);
  return g.tensor(t);
}

void set_bshd(const Tensor& t, Uid uid, const Params& p, const Tensor& offsets, int64_t heads, int64_t s,
              int64_t dim) {
  t->set_output(true).set_uid(uid);
  shape_bshd(*t, p, offsets, heads, s, dim);
}

std::array<Tensor, 3> qkv_tensors(fe::graph::Graph& g, const Params& p, const RaggedOffsets& offsets) {
  return {bshd(g, "q", kQ, p, offsets.q, p.h, p.seg_sq, p.d), bshd(g, "k", kK, p, offsets.k, p.hkv, p.seg_skv, p.d),
          bshd(g, "v", kV, p, offsets.v, p.hkv, p.seg_skv, p.dv)};
}

Tensor stats_tensor(fe::graph::Graph& g, const Params& p) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("stats")
                      .set_uid(kStats)
                      .set_dim(stats_dims(p))
                      .set_stride(stats_strides(p))
                      .set_data_type(fe::DataType_t::FLOAT));
}

void set_stats_output(const Tensor& stats, const Params& p) {
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dims(p))
      .set_stride(stats_strides(p));
}

Tensor seqlen_tensor(fe::graph::Graph& g, const char* name, Uid uid, const Params& p) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({cudnn_batch(p), 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

Tensor scalar_float(fe::graph::Graph& g, const char* name, Uid uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::FLOAT));
}

void set_scalar_output(const Tensor& t, Uid uid) {
  t->set_output(true).set_uid(uid).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(
      fe::DataType_t::FLOAT);
}

// The training forward writes the stats the backward reads; the inference forward
// (p.inference) does not, so cuDNN may pick another engine (and skip the stats' stores).
std::shared_ptr<fe::graph::Graph> forward_graph(const Params& p) {
  auto g = new_graph(p);
  const RaggedOffsets offsets = ragged_offsets(*g, p);
  auto [q, k, v] = qkv_tensors(*g, p, offsets);
  fe::graph::SDPA_attributes a;
  a.set_name("fusedattn_sdpa").set_generate_stats(!p.inference);
#if CUDNN_FRONTEND_VERSION >= 11400
  // With dropout, cuDNN's unified SDPA node serves only graphs without stats, so the
  // frontend would pick it for the inference forward alone; the composite node, which the
  // training forward and the backward use, keeps the dropout mask the same for the same
  // seed whether or not the call is differentiated. (Frontends before 1.14 have no other.)
  if (p.inference && p.dropout > 0.0f) a.set_implementation(fe::AttentionImplementation_t::COMPOSITE);
#endif
  set_mask(*g, a, p);
  set_extras(*g, a, p);
  auto [o, stats] = g->sdpa(q, k, v, a);
  set_bshd(o, kO, p, offsets.o, p.h, p.seg_sq, p.dv);
  if (!p.inference) set_stats_output(stats, p);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const Params& p) {
  auto g = new_graph(p);
  const RaggedOffsets offsets = ragged_offsets(*g, p);
  auto [q, k, v] = qkv_tensors(*g, p, offsets);
  auto o = bshd(*g, "o", kO, p, offsets.o, p.h, p.seg_sq, p.dv);
  auto d_o = bshd(*g, "do", kDO, p, offsets.o, p.h, p.seg_sq, p.dv);
  auto stats = stats_tensor(*g, p);
  fe::graph::SDPA_backward_attributes a;
  a.set_name("fusedattn_sdpa_backward");
  set_mask(*g, a, p);
  set_extras(*g, a, p);
  if (p.bias_b > 0) {
    a.set_dbias(g->tensor(fe::graph::Tensor_attributes()
                              .set_name("dbias")
                              .set_uid(kDBias)
                              .set_dim(bias_dims(p))
                              .set_stride(bias_strides(p))
                              .set_output(true)));
  }
  if (p.sink) {
    a.set_dsink_token(g->tensor(fe::graph::Tensor_attributes()
                                    .set_name("dsink")
                                    .set_uid(kDSink)
                                    .set_dim({1, p.h, 1, 1})
                                    .set_stride({p.h, 1, 1, 1})
                                    .set_data_type(fe::DataType_t::FLOAT)
                                    .set_output(true)));
  }
  if (p.deterministic) a.set_deterministic_algorithm(true);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, a);
  set_bshd(dq, kDQ, p, offsets.q, p.h, p.seg_sq, p.d);
  set_bshd(dk, kDK, p, offsets.k, p.hkv, p.seg_skv, p.d);
  set_bshd(dv, kDV, p, offsets.v, p.hkv, p.seg_skv, p.dv);
  return g;
}

}  // namespace fusedattn_cudnn
