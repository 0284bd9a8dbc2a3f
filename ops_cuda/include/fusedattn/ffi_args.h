// Validation and FFI signatures of the attention op set's operands (host-side
// code, shared by the host handlers and the device handlers' host parts).
//
// Forward operands (canonical form, see fusedattn/ops/backends/base.py):
//   0 q [..., Sq, H, D]     1 k [..., Skv, Hkv, D]     2 v [..., Skv, Hkv, Dv]
//   3 q_seg  4 q_pos  5 q_diag : S32 [..., Sq]
//   6 kv_seg 7 kv_pos          : S32 [..., Skv]
//   8 softmax_offset F32 [..., H]     9 seed U32 [..., 2]
//  10 alibi_slopes F32 [..., H] (read only with the alibi attribute; see alibi.h)
//  11 bias F32 [Bb, Hb, Sq, Skv], Bb 1 or B (the product of q's leading dims), Hb 1 or H
//     (read only with bias_type 1 or 2; see bias.h; unread, any rank-4 F32 array otherwise)
// attributes: scale f32, causal bool, window_left i64, window_right i64,
//             softmax_type i32, dropout_rate f64, alibi bool,
//             bias_type i32 (0 none, 1 pre_scale, 2 post_scale)
// results: o [..., Sq, H, Dv] (q's dtype), lse F32 [..., H, Sq]
// Backward operands: the forward's twelve, then 12 o, 13 lse, 14 do;
// results: dq, dk, dv (like q, k, v), d_offset F32 [..., H] and d_slopes F32 [..., H]
// (per batch row; d_slopes is written only with the alibi attribute), d_bias F32 shaped
// like bias (the shared dims summed inside the call; zeros without a bias), or F32 with no
// element where the caller does not differentiate the bias: its gradient is then not computed.
#ifndef FUSEDATTN_FFI_ARGS_H_
#define FUSEDATTN_FFI_ARGS_H_

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fusedattn/bias.h"
#include "fusedattn/layout.h"
#include "fusedattn/philox.h"
#include "fusedattn/portability.h"
#include "fusedattn/softmax.h"
#include "xla/ffi/api/ffi.h"

// Declares an exported FFI handler symbol (looked up by ctypes). On Linux the
// build's version script exports every Fusedattn* symbol anyway; this keeps
// the intent visible and serves toolchains without version scripts.
#if defined(_WIN32)
#define FA_FFI_EXPORT(name) extern "C" __declspec(dllexport) XLA_FFI_Error* name(XLA_FFI_CallFrame* call_frame)
#else
#define FA_FFI_EXPORT(name) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame* call_frame)
#endif

namespace fusedattn {

namespace ffi = xla::ffi;

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    default: return "an unsupported dtype";
  }
}

inline std::string dims_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

inline std::string dims_string(const std::vector<int64_t>& dims) {
  return dims_string(ffi::AnyBuffer::Dimensions(dims.data(), dims.size()));
}

inline ffi::Error invalid(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// The leading dims of `dims` (all but the last `trailing`).
inline std::vector<int64_t> leading_dims(ffi::AnyBuffer::Dimensions dims, size_t trailing) {
  std::vector<int64_t> out;
  for (size_t i = 0; i + trailing < dims.size(); ++i) out.push_back(dims[i]);
  return out;
}

inline int64_t product(const std::vector<int64_t>& dims) {
  int64_t p = 1;
  for (int64_t d : dims) p *= d;
  return p;
}

// Checks `buffer` is `dtype` with trailing dims `trailing` (and at least that
// rank) and returns the product of its leading dims in *rows.
inline ffi::Error check_rows(const char* op, const char* name, const ffi::AnyBuffer& buffer,
                             ffi::DataType dtype, const std::vector<int64_t>& trailing, int64_t* rows) {
  if (buffer.element_type() != dtype) {
    return invalid(op, std::string(name) + " must be " + dtype_name(dtype) + ", got " +
                           dtype_name(buffer.element_type()));
  }
  const auto dims = buffer.dimensions();
  bool ok = dims.size() >= trailing.size();
  for (size_t i = 0; ok && i < trailing.size(); ++i) {
    ok = dims[dims.size() - trailing.size() + i] == trailing[i];
  }
  if (!ok) {
    return invalid(op, std::string(name) + " must have shape [..., " +
                           dims_string(trailing).substr(1) + ", got " + dims_string(dims));
  }
  *rows = product(leading_dims(dims, trailing.size()));
  return ffi::Error::Success();
}

// Checks a per-batch-row operand's rows divide the batch (the broadcast rule).
inline ffi::Error check_divides(const char* op, const char* name, int64_t rows, int64_t batch) {
  if ((rows == 0 && batch == 0) || (rows > 0 && batch % rows == 0)) return ffi::Error::Success();
  return invalid(op, std::string(name) + "'s leading dims hold " + std::to_string(rows) +
                         " rows, which does not divide the batch of " + std::to_string(batch) +
                         " (the product of q's leading dims)");
}

// Checks a buffer has exactly `dtype` and `dims`.
inline ffi::Error check_exact(const char* op, const char* name, ffi::DataType actual_type,
                              ffi::AnyBuffer::Dimensions actual, ffi::DataType dtype,
                              const std::vector<int64_t>& dims) {
  if (actual_type != dtype) {
    return invalid(op, std::string(name) + " must be " + dtype_name(dtype) + ", got " +
                           dtype_name(actual_type));
  }
  bool ok = actual.size() == dims.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = actual[i] == dims[i];
  if (!ok) {
    return invalid(op, std::string(name) + " must have shape " + dims_string(dims) + ", got " +
                           dims_string(actual));
  }
  return ffi::Error::Success();
}

// One buffer's expected dtype and dims, for check_all_exact.
struct ExactCheck {
  const char* name;
  ffi::DataType type;
  ffi::AnyBuffer::Dimensions dims;
  ffi::DataType want_type;
  std::vector<int64_t> want;
};

// check_exact over a list: the first mismatch's error.
inline ffi::Error check_all_exact(const char* op, std::initializer_list<ExactCheck> checks) {
  for (const ExactCheck& c : checks) {
    if (auto e = check_exact(op, c.name, c.type, c.dims, c.want_type, c.want); e.failure()) return e;
  }
  return ffi::Error::Success();
}

inline bool is_supported_float(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Checks q, k and v share one supported float dtype, q is [..., Sq, H, D] and k
// is [..., Skv, Hkv, D] with q's leading dims and head dim (v's shape is each
// op's own), and fills p's batch, seqlen_q, heads, head_dim, seqlen_kv and
// kv_heads. *lead receives q's leading dims.
template <typename Params>
ffi::Error parse_q_and_k(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                         Params* p, std::vector<int64_t>* lead) {
  const ffi::DataType dtype = q.element_type();
  if (!is_supported_float(dtype)) {
    return invalid(op, std::string("q must be float32, bfloat16 or float16, got ") + dtype_name(dtype));
  }
  if (k.element_type() != dtype || v.element_type() != dtype) {
    return invalid(op, std::string("q, k and v must share one dtype, got ") + dtype_name(dtype) + ", " +
                           dtype_name(k.element_type()) + " and " + dtype_name(v.element_type()));
  }
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() < 3) {
    return invalid(op, "q must have shape [..., Sq, H, D], got " + dims_string(qd));
  }
  *lead = leading_dims(qd, 3);
  const size_t r = qd.size();
  p->batch = product(*lead);
  p->seqlen_q = qd[r - 3];
  p->heads = qd[r - 2];
  p->head_dim = qd[r - 1];
  if (kd.size() != r || leading_dims(kd, 3) != *lead || kd[r - 1] != p->head_dim) {
    return invalid(op, "k must have shape [..., Skv, Hkv, D] with q's leading dims and head dim; q is " +
                           dims_string(qd) + ", k is " + dims_string(kd));
  }
  p->seqlen_kv = kd[r - 3];
  p->kv_heads = kd[r - 2];
  return ffi::Error::Success();
}

inline ffi::Error check_head_groups(const char* op, int64_t heads, int64_t kv_heads) {
  if (kv_heads < 1 || heads % kv_heads != 0) {
    return invalid(op, "the number of q heads (" + std::to_string(heads) +
                           ") must be a multiple of the number of k/v heads (" + std::to_string(kv_heads) + ")");
  }
  return ffi::Error::Success();
}

inline ffi::Error check_dropout_rate(const char* op, double dropout_rate) {
  if (!(dropout_rate >= 0.0 && dropout_rate < 1.0)) {
    return invalid(op, "dropout_rate must be in [0, 1), got " + std::to_string(dropout_rate));
  }
  return ffi::Error::Success();
}

// Checks dropout_rate and fills p's dropout, dropout_threshold and dropout_scale.
template <typename Params>
ffi::Error parse_dropout_rate(const char* op, double dropout_rate, Params* p) {
  if (auto e = check_dropout_rate(op, dropout_rate); e.failure()) return e;
  p->dropout = dropout_rate > 0.0;
  p->dropout_threshold = dropout_threshold(dropout_rate);
  p->dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_rate));
  return ffi::Error::Success();
}

// Validates the forward operands 0-10 and the attributes but bias_type (parse_bias), filling *p.
// *lead receives q's leading dims (the batch dims of every result).
inline ffi::Error parse_attention_call(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                       const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_seg,
                                       const ffi::AnyBuffer& q_pos, const ffi::AnyBuffer& q_diag,
                                       const ffi::AnyBuffer& kv_seg, const ffi::AnyBuffer& kv_pos,
                                       const ffi::AnyBuffer& softmax_offset, const ffi::AnyBuffer& seed,
                                       const ffi::AnyBuffer& alibi_slopes, float scale, bool causal,
                                       int64_t window_left, int64_t window_right, int32_t softmax_type,
                                       double dropout_rate, bool alibi, AttentionParams* p,
                                       std::vector<int64_t>* lead) {
  if (auto e = parse_q_and_k(op, q, k, v, p, lead); e.failure()) return e;
  const auto kd = k.dimensions(), vd = v.dimensions();
  const size_t r = kd.size();
  if (vd.size() != r || leading_dims(vd, 3) != *lead || vd[r - 3] != p->seqlen_kv ||
      vd[r - 2] != p->kv_heads) {
    return invalid(op, "v must have shape [..., Skv, Hkv, Dv] matching k's leading dims, Skv and Hkv; k is " +
                           dims_string(kd) + ", v is " + dims_string(vd));
  }
  p->head_dim_v = vd[r - 1];
  if (auto e = check_head_groups(op, p->heads, p->kv_heads); e.failure()) return e;

  int64_t rows[5];
  const ffi::AnyBuffer* tokens[5] = {&q_seg, &q_pos, &q_diag, &kv_seg, &kv_pos};
  const char* token_names[5] = {"q_seg", "q_pos", "q_diag", "kv_seg", "kv_pos"};
  for (int t = 0; t < 5; ++t) {
    const int64_t len = t < 3 ? p->seqlen_q : p->seqlen_kv;
    if (auto e = check_rows(op, token_names[t], *tokens[t], ffi::DataType::S32, {len}, &rows[t]); e.failure()) {
      return e;
    }
    if (rows[t] != rows[0]) {
      return invalid(op, "the token vectors q_seg, q_pos, q_diag, kv_seg, kv_pos must share their leading dims");
    }
  }
  p->token_rows = rows[0];
  if (auto e = check_divides(op, "q_seg", p->token_rows, p->batch); e.failure()) return e;
  if (auto e = check_rows(op, "softmax_offset", softmax_offset, ffi::DataType::F32, {p->heads}, &p->offset_rows);
      e.failure()) {
    return e;
  }
  if (auto e = check_divides(op, "softmax_offset", p->offset_rows, p->batch); e.failure()) return e;
  if (auto e = check_rows(op, "seed", seed, ffi::DataType::U32, {2}, &p->seed_rows); e.failure()) return e;
  if (auto e = check_divides(op, "seed", p->seed_rows, p->batch); e.failure()) return e;
  if (auto e = check_rows(op, "alibi_slopes", alibi_slopes, ffi::DataType::F32, {p->heads}, &p->slopes_rows);
      e.failure()) {
    return e;
  }
  if (auto e = check_divides(op, "alibi_slopes", p->slopes_rows, p->batch); e.failure()) return e;

  // Positive: the kernels take each row's maximum of the unscaled scores.
  if (!std::isfinite(scale) || !(scale > 0.0f)) {
    return invalid(op, "the scale attribute must be positive and finite, got " + std::to_string(scale));
  }
  if (softmax_type < kSoftmaxVanilla || softmax_type > kSoftmaxLearnable) {
    return invalid(op, "softmax_type must be 0 (vanilla), 1 (off_by_one) or 2 (learnable), got " +
                           std::to_string(softmax_type));
  }
  if (auto e = parse_dropout_rate(op, dropout_rate, p); e.failure()) return e;
  p->scale = scale;
  p->mask.causal = causal;
  p->mask.window_left = window_left;
  p->mask.window_right = window_right;
  p->softmax_type = softmax_type;
  p->alibi = alibi;
  return ffi::Error::Success();
}

// Checks the bias operand (11) and the bias_type attribute, filling p's bias_type,
// bias_batch and bias_heads. Call after parse_attention_call.
inline ffi::Error parse_bias(const char* op, const ffi::AnyBuffer& bias, int32_t bias_type, AttentionParams* p) {
  if (bias_type < kBiasNone || bias_type > kBiasPostScale) {
    return invalid(op, "bias_type must be 0 (none), 1 (pre_scale) or 2 (post_scale), got " +
                           std::to_string(bias_type));
  }
  if (bias.element_type() != ffi::DataType::F32) {
    return invalid(op, std::string("bias must be float32, got ") + dtype_name(bias.element_type()));
  }
  const auto d = bias.dimensions();
  const std::string want = "[" + std::to_string(p->batch) + " or 1, " + std::to_string(p->heads) + " or 1, " +
                           std::to_string(p->seqlen_q) + ", " + std::to_string(p->seqlen_kv) + "]";
  if (d.size() != 4) return invalid(op, "bias must have shape " + want + ", got " + dims_string(d));
  p->bias_type = bias_type;
  p->bias_batch = d[0];
  p->bias_heads = d[1];
  if (bias_type == kBiasNone) return ffi::Error::Success();
  if ((d[0] != 1 && d[0] != p->batch) || (d[1] != 1 && d[1] != p->heads) || d[2] != p->seqlen_q ||
      d[3] != p->seqlen_kv) {
    return invalid(op, "bias must have shape " + want + ", got " + dims_string(d));
  }
  return ffi::Error::Success();
}

// Checks the backward's d_bias result: F32 shaped like the bias operand, or F32 without an
// element (the bias's gradient not wanted: bias_gradient_wanted).
inline ffi::Error check_bias_gradient(const char* op, const ffi::AnyBuffer& bias,
                                      ffi::Result<ffi::AnyBuffer>& d_bias) {
  if (d_bias->element_type() == ffi::DataType::F32 && d_bias->element_count() == 0) return ffi::Error::Success();
  const auto d = bias.dimensions();
  return check_exact(op, "result d_bias", d_bias->element_type(), d_bias->dimensions(), ffi::DataType::F32,
                     std::vector<int64_t>(d.begin(), d.end()));
}

// Whether the caller wants the bias's gradient (a d_bias result with elements) for a call
// with a bias array.
inline bool bias_gradient_wanted(const AttentionParams& p, ffi::Result<ffi::AnyBuffer>& d_bias) {
  return p.bias_type != kBiasNone && d_bias->element_count() > 0;
}

// Checks the forward's results against the parsed call: o [..., Sq, H, Dv] in q's dtype,
// lse F32 [..., H, Sq].
inline ffi::Error check_forward_results(const char* op, const AttentionParams& p, const std::vector<int64_t>& lead,
                                        ffi::DataType dtype, ffi::Result<ffi::AnyBuffer>& o,
                                        ffi::Result<ffi::AnyBuffer>& lse) {
  return check_all_exact(
      op, {{"result o", o->element_type(), o->dimensions(), dtype, concat(lead, {p.seqlen_q, p.heads, p.head_dim_v})},
           {"result lse", lse->element_type(), lse->dimensions(), ffi::DataType::F32,
            concat(lead, {p.heads, p.seqlen_q})}});
}

// Checks the backward's extra operands (o, lse, do) and its results (dq, dk, dv like q, k, v;
// d_offset and d_slopes F32 [..., H]) against the parsed call.
inline ffi::Error check_backward_buffers(const char* op, const AttentionParams& p, const std::vector<int64_t>& lead,
                                         ffi::DataType dtype, const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse,
                                         const ffi::AnyBuffer& dout, ffi::Result<ffi::AnyBuffer>& dq,
                                         ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                                         ffi::Result<ffi::AnyBuffer>& d_offset,
                                         ffi::Result<ffi::AnyBuffer>& d_slopes) {
  const auto o_dims = concat(lead, {p.seqlen_q, p.heads, p.head_dim_v});
  constexpr ffi::DataType kF32 = ffi::DataType::F32;
  return check_all_exact(
      op, {{"o", o.element_type(), o.dimensions(), dtype, o_dims},
           {"lse", lse.element_type(), lse.dimensions(), kF32, concat(lead, {p.heads, p.seqlen_q})},
           {"do", dout.element_type(), dout.dimensions(), dtype, o_dims},
           {"result dq", dq->element_type(), dq->dimensions(), dtype, concat(lead, {p.seqlen_q, p.heads, p.head_dim})},
           {"result dk", dk->element_type(), dk->dimensions(), dtype,
            concat(lead, {p.seqlen_kv, p.kv_heads, p.head_dim})},
           {"result dv", dv->element_type(), dv->dimensions(), dtype,
            concat(lead, {p.seqlen_kv, p.kv_heads, p.head_dim_v})},
           {"result d_offset", d_offset->element_type(), d_offset->dimensions(), kF32, concat(lead, {p.heads})},
           {"result d_slopes", d_slopes->element_type(), d_slopes->dimensions(), kF32, concat(lead, {p.heads})}});
}

inline ElementType element_type_of(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? ElementType::kBF16
         : t == ffi::DataType::F16 ? ElementType::kF16
                                   : ElementType::kF32;
}

// Returns f(std::integral_constant<ElementType, element_type_of(t)>{}): code
// instantiated per element type, chosen at run time.
template <typename F>
auto with_element_type(ffi::DataType t, F&& f) {
  switch (element_type_of(t)) {
    case ElementType::kBF16: return f(std::integral_constant<ElementType, ElementType::kBF16>{});
    case ElementType::kF16: return f(std::integral_constant<ElementType, ElementType::kF16>{});
    case ElementType::kF32: break;
  }
  return f(std::integral_constant<ElementType, ElementType::kF32>{});
}

// The elements of an operand or a result, as element type ET stores them.
template <ElementType ET>
const typename Element<ET>::Storage* elements(const ffi::AnyBuffer& x) {
  return static_cast<const typename Element<ET>::Storage*>(x.untyped_data());
}

template <ElementType ET>
typename Element<ET>::Storage* elements(ffi::Result<ffi::AnyBuffer>& x) {
  return static_cast<typename Element<ET>::Storage*>(x->untyped_data());
}

// An op's FFI signature, after whatever context the platform's handler binds
// first, is bind_buffers (its operands, then its results, all AnyBuffer, in the
// order its header lists them) and then, where it has any, bind_attrs.
template <int kArgs, int kRets, typename FfiBinding>
auto bind_buffers(FfiBinding&& binding) {
  static_assert(kArgs >= 0 && kRets >= 1, "every op has a result");
  if constexpr (kArgs > 0) {
    return bind_buffers<kArgs - 1, kRets>(std::forward<FfiBinding>(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (kRets > 1) {
    return bind_buffers<0, kRets - 1>(std::forward<FfiBinding>(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::forward<FfiBinding>(binding).template Ret<ffi::AnyBuffer>();
  }
}

// Appends the attributes, each an ffi::StructMember<type>("name"), in order.
template <typename FfiBinding, typename Member, typename... Members>
auto bind_attrs(FfiBinding&& binding, Member attr, Members... rest) {
  if constexpr (sizeof...(Members) == 0) {
    return std::forward<FfiBinding>(binding).template Attr<typename Member::Type>(std::string(attr.name));
  } else {
    return bind_attrs(bind_attrs(std::forward<FfiBinding>(binding), attr), rest...);
  }
}

enum class Pass { kForward, kBackward };

// The flash op's attributes, in order, then `extra` ones.
template <typename FfiBinding, typename... Extra>
auto bind_attention_attrs(FfiBinding&& binding, Extra... extra) {
  return bind_attrs(std::forward<FfiBinding>(binding), ffi::StructMember<float>("scale"),
                    ffi::StructMember<bool>("causal"), ffi::StructMember<int64_t>("window_left"),
                    ffi::StructMember<int64_t>("window_right"), ffi::StructMember<int32_t>("softmax_type"),
                    ffi::StructMember<double>("dropout_rate"), ffi::StructMember<bool>("alibi"),
                    ffi::StructMember<int32_t>("bias_type"), extra...);
}

// The flash op's FFI signature: the forward binds 12 operands and 2 results,
// the backward 15 and 6 (as listed above), each followed by kWorkspaces results that
// serve the handler as scratch (the CUDA handlers' one uint8 workspace). The backward
// binds one attribute more, last: deterministic (bool, config deterministic_backward).
template <Pass kPass, int kWorkspaces = 0, typename FfiBinding>
auto bind_attention(FfiBinding&& binding) {
  if constexpr (kPass == Pass::kForward) {
    return bind_attention_attrs(bind_buffers<12, 2 + kWorkspaces>(std::forward<FfiBinding>(binding)));
  } else {
    return bind_attention_attrs(bind_buffers<15, 6 + kWorkspaces>(std::forward<FfiBinding>(binding)),
                                ffi::StructMember<bool>("deterministic"));
  }
}

}  // namespace fusedattn

#endif  // FUSEDATTN_FFI_ARGS_H_
