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

from fusedattn.ops import philox
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


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [b, sq, h, d] . k [b, skv, h_kv, d] -> float32 [b, h, sq, skv] (GQA by grouping)."""
    b, sq, h, d = q.shape
    h_kv = k.shape[2]
    grouped = q.reshape(b, sq, h_kv, h // h_kv, d)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, precision=precision,
                        preferred_element_type=jnp.float32)
    return scores.reshape(b, h, sq, k.shape[1])


def _weighted_values(weights: jax.Array, v: jax.Array) -> jax.Array:
    """weights float32 [b, h, sq, skv] . v [b, skv, h_kv, dv] -> [b, sq, h, dv] in v's dtype."""
    b, h, sq, skv = weights.shape
    h_kv = v.shape[2]
    grouped = weights.reshape(b, h_kv, h // h_kv, sq, skv).astype(
        jnp.float32 if v.dtype == jnp.float32 else v.dtype)
    precision = jax.lax.Precision.HIGHEST if v.dtype == jnp.float32 else None
    out = jnp.einsum("bkgqs,bskd->bqkgd", grouped, v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, sq, h, v.shape[-1]).astype(v.dtype)


def _alibi_bias(spec: AttentionSpec, args: CanonicalArgs, num_heads: int) -> jax.Array:
    slopes = alibi_slopes(num_heads) if args.bias is None else args.bias.astype(jnp.float32)
    tokens = args.tokens
    query_diagonal = (tokens.q_pos + tokens.q_diag)[:, None, :, None]
    distance = jnp.abs(tokens.kv_pos[:, None, None, :] - query_diagonal).astype(jnp.float32)
    return -jnp.asarray(slopes)[None, :, None, None] * distance


def attention_weights(spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
    """Softmax weights float32 [b, h, sq, skv] after mask, bias, sink and dropout."""
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

    visible = visible_mask(spec, args.tokens)
    row_max = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, keepdims=True,
                      initial=-jnp.inf)
    sink = None
    if spec.softmax != SoftmaxType.VANILLA:
        offset = (jnp.zeros((h,), jnp.float32) if args.softmax_offset is None
                  else args.softmax_offset.astype(jnp.float32))
        sink = offset[None, :, None, None]
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    exps = jnp.exp(jnp.where(visible, scores - row_max, -jnp.inf))
    denominator = jnp.sum(exps, axis=-1, keepdims=True)
    if sink is not None:
        denominator = denominator + jnp.exp(sink - row_max)
    weights = exps / jnp.where(denominator > 0, denominator, 1.0)

    if args.dropout_seed is not None and spec.dropout_rate > 0:
        keep = philox.dropout_keep_mask(args.dropout_seed, spec.dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - spec.dropout_rate), 0.0)
    return weights


class XlaBackend:
    """Serves every call on every platform."""

    name = "xla"

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
