"""config.guard_masked_values: masked keys contribute nothing, even holding NaN or Inf.

A fused kernel multiplies the masked probabilities (exactly 0) with the values of the keys
in a tile, so a NaN or Inf in k/v at a masked position (a future token under causal masks,
a key outside the window) turns 0 x NaN into NaN in query rows that never see that key;
the backward leaks the same way through dS. cuDNN and the CUDA flash kernels do this; the
xla backend and the host kernels select masked keys out instead.

With the config key set, fused_attn passes each dense, non-FP8 call whose backend would
leak (Backend.masked_values_exact; `applies` decides, `explain_line` tells explain()) through
`guarded`, which keeps the xla backend's rule at the cost of one reduction over the output
(and one over dQ in the backward):

  fast path   out = attention(args), and its gradients; taken when out (forward) and dQ
              (backward) hold no NaN: every leak of a masked non-finite key or value puts
              a NaN in one of them, so a clean result is the exact rule's.
  exact path  when out holds a NaN: attention over k/v with every non-finite entry
              replaced by 0, and NaN over the query rows that give a non-finite key or
              value a nonzero weight (found by one more call with the indicator of the
              bad keys as values, dropout off); the backward differentiates that path.

The branch is a lax.cond on a scalar that stays unbatched under jax.vmap (a custom vmap
rule ORs it over the mapped axis), so a mapped call does not pay for both branches.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from fusedattn.ops.backends.base import Backend, CanonicalArgs
from fusedattn.ops.spec import AttentionSpec

Attention = Callable[[CanonicalArgs], jax.Array]

_COST = ("a NaN check of the output (and of dQ in the backward) and a conditional, "
         "a host round trip on GPUs: docs/backends.md")


def applies(spec: AttentionSpec, backend: Backend, platform: str) -> bool:
    """Whether fused_attn wraps a call in `guarded`: config.guard_masked_values is set, the
    call is dense and not FP8 (the paths the guard wraps), and `backend`'s kernels would let
    a masked NaN/Inf key or value reach other rows on `platform`."""
    return (spec.guard_masked_values and not spec.qkv_layout.is_paged and not spec.fp8_enabled
            and not backend.masked_values_exact(spec, platform))


def explain_line(spec: AttentionSpec, backend: Backend, platform: str) -> str | None:
    """explain()'s line on config.guard_masked_values for a call `backend` serves: whether
    the guard wraps it and what that costs, or why it is not needed; None where there is
    nothing to say (the guard off and the backend exact)."""
    where = f"mask {str(spec.mask)!r}" + (
        f" and window {tuple(spec.window_size)}" if tuple(spec.window_size) != (-1, -1) else "")
    if spec.qkv_layout.is_paged or spec.fp8_enabled:
        if not spec.guard_masked_values:
            return None
        return ("guard_masked_values: on, but this call is not guarded: the guard wraps dense "
                "calls without FP8 only")
    if backend.masked_values_exact(spec, platform):
        if not spec.guard_masked_values:
            return None
        return (f"guard_masked_values: on, not needed: {backend.name} excludes masked keys "
                f"exactly under {where} on {platform}; the call runs unguarded")
    if spec.guard_masked_values:
        return (f"guard_masked_values: on; {backend.name} would let a masked NaN/Inf key or "
                f"value reach other rows under {where} on {platform}, so the call is guarded: "
                f"{_COST}")
    return (f"guard_masked_values: off; {backend.name} can let a masked NaN/Inf key or value "
            f"reach other rows under {where} on {platform}; set it to True to exclude them, "
            f"at the cost of {_COST}")


def guarded(attention: Attention, args: CanonicalArgs) -> jax.Array:
    """attention(args) [b, sq, h, dv] with masked non-finite keys/values excluded.

    attention: a differentiable function of the call's arrays (a backend's attention with
    its spec and scale bound); args: the call (q [b, sq, h, d], k/v [b, skv, h_kv, d|dv]).
    """
    leaves, treedef = jax.tree.flatten(args)
    inexact = tuple(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)
    layout = _Layout(treedef, inexact)
    floats = tuple(x for x, f in zip(leaves, inexact) if f)
    others = tuple(x for x, f in zip(leaves, inexact) if not f)
    return _guarded(attention, layout, floats, others)


class _Layout(NamedTuple):
    """Where the differentiable (inexact) leaves of a CanonicalArgs sit; static."""

    treedef: Any
    inexact: tuple[bool, ...]

    def args(self, floats, others) -> CanonicalArgs:
        floats, others = iter(floats), iter(others)
        return jax.tree.unflatten(self.treedef,
                                  [next(floats) if f else next(others) for f in self.inexact])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _guarded(attention: Attention, layout: _Layout, floats, others):
    out = attention(layout.args(floats, others))
    return jax.lax.cond(_holds_nan(out), lambda: _exact(attention, layout.args(floats, others)),
                        lambda: out)


def _guarded_fwd(attention, layout, floats, others):
    out, fast_vjp = jax.vjp(lambda f: attention(layout.args(f, others)), floats)
    leaked = _holds_nan(out)
    out = jax.lax.cond(leaked, lambda: _exact(attention, layout.args(floats, others)),
                       lambda: out)
    return out, (floats, others, fast_vjp, leaked)


def _guarded_bwd(attention, layout, residuals, g):
    floats, others, fast_vjp, leaked = residuals
    d_floats, = fast_vjp(g)
    # A masked non-finite key or value leaks into dS at masked positions even where the
    # forward stayed clean (0 x NaN in dQ = dS K); every such dS entry reaches dQ, the
    # gradient of q, the first leaf of CanonicalArgs.
    redo = leaked | _holds_nan(d_floats[0])

    def exact_vjp(g):
        return jax.vjp(lambda f: _exact(attention, layout.args(f, others)), floats)[1](g)[0]

    return jax.lax.cond(redo, exact_vjp, lambda g: d_floats, g), None


_guarded.defvjp(_guarded_fwd, _guarded_bwd)


def _exact(attention: Attention, args: CanonicalArgs) -> jax.Array:
    """The xla backend's rule through any backend: non-finite k/v entries selected out,
    NaN over the query rows that see such a key."""
    bad = _non_finite_rows(args.k) | _non_finite_rows(args.v)              # [b, skv, h_kv]
    clean = args._replace(k=_finite_or_zero(args.k), v=_finite_or_zero(args.v))
    out = attention(clean)
    indicator = jnp.broadcast_to(bad[..., None], args.v.shape).astype(args.v.dtype)
    weight_on_bad = jax.lax.stop_gradient(
        attention(clean._replace(v=indicator, dropout_seed=None))[..., :1])  # [b, sq, h, 1]
    return jnp.where(weight_on_bad > 0, jnp.asarray(jnp.nan, out.dtype), out)


def _non_finite_rows(x: jax.Array) -> jax.Array:
    """bool [b, skv, h_kv]: whether a key/value row [b, skv, h_kv, d] holds NaN or Inf."""
    return jnp.any(~jnp.isfinite(x), axis=-1)


def _finite_or_zero(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


@custom_vmap
def _holds_nan(out: jax.Array) -> jax.Array:
    """bool []: whether out holds a NaN."""
    return jnp.isnan(out).any()


@_holds_nan.def_vmap
def _holds_nan_vmap(axis_size, in_batched, out):
    # One flag for the whole mapped batch: the exact path is right for every example,
    # and an unbatched predicate keeps lax.cond a branch (a batched one runs both).
    return jnp.isnan(out).any(), False
