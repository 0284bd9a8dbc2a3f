"""The XLA backend: every feature in plain jax.numpy, float32 softmax; the oracle.

It is differentiated by JAX itself, so every gradient (q, k, v, bias,
softmax_offset) comes from the same code as the forward. Memory is that of the
unfused algorithm: the [b, h, sq, skv] scores, with the mask built as
[b, 1, sq, skv] from per-token vectors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops import paged, philox
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, visible_mask
from fusedattn.ops.enums import BiasType, SoftmaxType
from fusedattn.ops.spec import AttentionSpec


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's geometric slopes for `num_heads` heads, float32 [h]."""
    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, np.float32)


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _matmul_operands(*arrays: jax.Array) -> tuple[tuple[jax.Array, ...], object]:
    """The einsums' operands and precision: float32 operands at HIGHEST precision, or the
    half-precision ones (bfloat16, float16) with XLA's default, summed in float32.

    On the CPU, half-precision operands are widened to float32 first: XLA:CPU has no
    BF16 x BF16 = F32 dot for some operand layouts (a transposed view of v, under jit,
    fails with "UNIMPLEMENTED: Unsupported element type for DotThunk::Execute"). The
    numbers are the same: a product of two bfloat16 or float16 values is exact in
    float32, and the sums are float32 either way. GPUs keep the half-precision operands.
    """
    if arrays[0].dtype in _HALF and jax.devices()[0].platform == "cpu":
        arrays = tuple(a.astype(jnp.float32) for a in arrays)
    precision = jax.lax.Precision.HIGHEST if arrays[0].dtype == jnp.float32 else None
    return arrays, precision


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [b, sq, h, d] . k [b, skv, h_kv, d] -> float32 [b, h, sq, skv] (GQA by grouping)."""
    b, sq, h, d = q.shape
    h_kv = k.shape[2]
    (grouped, k), precision = _matmul_operands(q.reshape(b, sq, h_kv, h // h_kv, d), k)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, precision=precision,
                        preferred_element_type=jnp.float32)
    return scores.reshape(b, h, sq, k.shape[1])


def _weighted_values(weights: jax.Array, v: jax.Array, dtype=None) -> jax.Array:
    """weights float32 [b, h, sq, skv] . v [b, skv, h_kv, dv] -> [b, sq, h, dv] in `dtype`
    (default v's dtype).

    The weights are rounded to v's dtype first (bfloat16 or float16 inputs)."""
    b, h, sq, skv = weights.shape
    h_kv = v.shape[2]
    grouped = weights.reshape(b, h_kv, h // h_kv, sq, skv).astype(v.dtype)
    (grouped, values), precision = _matmul_operands(grouped, v)
    out = jnp.einsum("bkgqs,bskd->bqkgd", grouped, values, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, sq, h, v.shape[-1]).astype(dtype or v.dtype)


def _alibi_bias(spec: AttentionSpec, args: CanonicalArgs, num_heads: int) -> jax.Array:
    slopes = alibi_slopes(num_heads) if args.bias is None else args.bias.astype(jnp.float32)
    tokens = args.tokens
    query_diagonal = (tokens.q_pos + tokens.q_diag)[:, None, :, None]
    distance = jnp.abs(tokens.kv_pos[:, None, None, :] - query_diagonal).astype(jnp.float32)
    return -jnp.asarray(slopes)[None, :, None, None] * distance


def scores_and_visible(spec: AttentionSpec, args: CanonicalArgs, scale: float
                       ) -> tuple[jax.Array, jax.Array]:
    """Scaled scores with the bias, float32 [b, h, sq, skv], and the mask [b, 1, sq, skv]."""
    h = args.q.shape[2]
    scores = _scores(args.q, args.k)
    if spec.bias == BiasType.PRE_SCALE_BIAS:
        scores = (scores + args.bias.astype(jnp.float32)) * scale
    else:
        scores = scores * scale
    if spec.bias == BiasType.POST_SCALE_BIAS:
        scores = scores + args.bias.astype(jnp.float32)
    elif spec.bias == BiasType.ALIBI:
        scores = scores + _alibi_bias(spec, args, h)
    return scores, visible_mask(spec, args.tokens)


def _softmax(scores: jax.Array, visible: jax.Array, sink: jax.Array | None
             ) -> tuple[jax.Array, jax.Array]:
    """Masked softmax weights [b, h, sq, skv] and log-sum-exp [b, h, sq] (-inf: nothing
    visible and no sink); `sink` [1, h, 1, 1] adds exp(sink) to the denominator."""
    row_max = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, keepdims=True,
                      initial=-jnp.inf)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    exps = jnp.exp(jnp.where(visible, scores - row_max, -jnp.inf))
    denominator = jnp.sum(exps, axis=-1, keepdims=True)
    if sink is not None:
        denominator = denominator + jnp.exp(sink - row_max)
    weights = exps / jnp.where(denominator > 0, denominator, 1.0)
    lse = jnp.where(denominator > 0, row_max + jnp.log(jnp.where(denominator > 0, denominator,
                                                                  1.0)), -jnp.inf)
    return weights, lse[..., 0]


def _dropped(spec: AttentionSpec, weights: jax.Array, keep: jax.Array | None) -> jax.Array:
    if keep is None:
        return weights
    return jnp.where(keep, weights / (1.0 - spec.dropout_rate), 0.0)


def attention_weights(spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
    """Softmax weights float32 [b, h, sq, skv] after mask, bias, sink and dropout."""
    h = args.q.shape[2]
    scores, visible = scores_and_visible(spec, args, scale)
    sink = None
    if spec.softmax != SoftmaxType.VANILLA:
        offset = (jnp.zeros((h,), jnp.float32) if args.softmax_offset is None
                  else args.softmax_offset.astype(jnp.float32))
        sink = offset[None, :, None, None]
    weights, _ = _softmax(scores, visible, sink)
    keep = None
    if args.dropout_seed is not None and spec.dropout_rate > 0:
        keep = philox.dropout_keep_mask(args.dropout_seed, spec.dropout_rate, weights.shape)
    return _dropped(spec, weights, keep)


def _real_keys_only(args: CanonicalArgs) -> CanonicalArgs:
    """Zeroes padding keys and values: garbage there (even NaN) reaches no output or gradient,
    as in kernels that never read them."""
    real_key = (args.tokens.kv_seg != 0)[:, :, None, None]
    return args._replace(k=jnp.where(real_key, args.k, 0), v=jnp.where(real_key, args.v, 0))


def attention_with_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float,
                       keep: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One block of a larger attention (context parallelism): vanilla softmax, no sink.

    keep: None, or the boolean [b, h, sq, skv] dropout mask of this block.
    Returns the float32 output [b, sq, h, dv] and log-sum-exp [b, h, sq] (-inf for a
    query with no visible key, whose output is 0). Not differentiated: the gradient is
    `attention_backward_from_lse`.
    """
    args = _real_keys_only(args)
    scores, visible = scores_and_visible(spec, args, scale)
    weights, lse = _softmax(scores, visible, None)
    return _weighted_values(_dropped(spec, weights, keep), args.v, jnp.float32), lse


def attention_backward_from_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float,
                                keep: jax.Array | None, out: jax.Array, lse: jax.Array,
                                d_out: jax.Array):
    """This block's share of the gradients of an attention whose softmax spans many blocks.

    out [b, sq, h, dv] and lse [b, h, sq] are the whole attention's output and
    log-sum-exp (sink included; -inf for a query that sees nothing), d_out its cotangent.
    Returns (dq, dk, dv, dbias) for the block's q, k, v and bias (None without one), float32.

    With the weights P = exp(s - lse) of the block's scores s, the block's terms are
    dS = P * (dO . v_dropped - dO . out): the vector-Jacobian product of
    sum_j P_ij (v_dropped_j - out_i), which autodiff gives through the score function
    (bias, ALiBi slopes and GQA included).
    """
    args = _real_keys_only(args)
    lse = jax.lax.stop_gradient(jnp.where(jnp.isfinite(lse), lse, 0.0))[..., None]
    out = out.astype(jnp.float32)

    def share(q, k, v, bias):
        scores, visible = scores_and_visible(spec, args._replace(q=q, k=k, v=v, bias=bias), scale)
        weights = jnp.exp(jnp.where(visible, scores - lse, -jnp.inf))
        values = _weighted_values(_dropped(spec, weights, keep), v, jnp.float32)
        return values - jnp.sum(weights, axis=-1).transpose(0, 2, 1)[..., None] * out

    _, vjp = jax.vjp(share, args.q, args.k, args.v, args.bias)
    return vjp(d_out.astype(jnp.float32))


class XlaBackend:
    """Serves every call on every platform."""

    name = "xla"

    def masked_values_exact(self, spec: AttentionSpec, platform: str) -> bool:
        return True  # see attention() below

    def supports(self, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
        return None

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        # Masked keys contribute nothing, even when they hold NaN or Inf: a matmul would
        # form 0 x NaN = NaN, so non-finite k/v entries are selected out (where, not
        # multiplied) and only rows that can see such a key are marked NaN.
        visible = visible_mask(spec, args.tokens)                  # [b, 1, sq, skv]
        k_bad = _non_finite_keys(args.k)                           # [b, skv, h_kv]
        v_bad = _non_finite_keys(args.v)
        args = args._replace(k=jnp.where(jnp.isfinite(args.k), args.k, 0),
                             v=jnp.where(jnp.isfinite(args.v), args.v, 0))
        out = _weighted_values(attention_weights(spec, args, scale), args.v)
        poisoned = _sees(visible, k_bad | v_bad, args.q.shape[2])  # [b, sq, h, 1]
        return jnp.where(poisoned, jnp.asarray(jnp.nan, out.dtype), out)

    # FP8 (config.fp8.enabled): the recipe emulated in float32 (xla_fp8.py), the oracle
    # of FP8 kernels and the FP8 path on every platform.
    serves_fp8 = True

    def fp8_attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float, state):
        """(out [b, sq, h, dv], the new Fp8State, max_logit float32 [h]); see xla_fp8."""
        from fusedattn.ops.backends import xla_fp8  # here: xla_fp8 builds on this module

        return xla_fp8.attention(spec, args, scale, state)

    # Paged layouts: every sequence's pages gathered into contiguous K/V, then the
    # contiguous path above. Differentiable like it (the gather's gradient scatter-adds
    # into the page pools, summing over table entries that share a page).
    serves_paged = True

    def paged_attention(self, spec: AttentionSpec, args: paged.PagedArgs,
                        scale: float) -> jax.Array:
        """The [b, sq, h, dv] output of a paged call; NaN rows for broken sequences."""
        dense, broken = paged.dense_view(spec, args)
        out = self.attention(spec, dense, scale)
        return jnp.where(broken[:, :, None, None], jnp.asarray(jnp.nan, out.dtype), out)


def _non_finite_keys(x: jax.Array) -> jax.Array:
    """bool [b, skv, h_kv]: whether a key/value row [b, skv, h_kv, d] holds NaN or Inf."""
    return jnp.any(~jnp.isfinite(x), axis=-1)


def _sees(visible: jax.Array, bad: jax.Array, num_heads: int) -> jax.Array:
    """bool [b, sq, h, 1]: whether query (b, i) of head h sees a key marked in bad [b, skv, h_kv]."""
    h_kv = bad.shape[-1]
    hits = jnp.einsum("bqs,bsk->bqk", visible[:, 0].astype(jnp.float32),
                      bad.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.repeat(hits > 0, num_heads // h_kv, axis=-1)[..., None]


BACKEND = XlaBackend()
