"""The "flash" backend on platform "cpu" (the host build of the compiled op set).

Every case calls `fusedattn.ops.backends.flash.BACKEND.attention` on a
CanonicalArgs built here and compares the output and the gradients (q, k, v,
softmax_offset) with a float64 NumPy reference of the canonical semantics
(base.py's mask predicate, the softmax sink, Philox dropout from the jnp
definition) written in this file.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, poison_like, tolerance

from fusedattn.ops import _library, philox
from fusedattn.ops.backends import flash, flash_ffi
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, TokenInfo
from fusedattn.ops.spec import AttentionSpec

pytestmark = pytest.mark.skipif(
    _library.available("cpu") is not None,
    reason=f"host op library unavailable: {_library.available('cpu')}")

@pytest.fixture(autouse=True)
def _on_cpu():
    """The host build serves platform "cpu"; run there also on machines with a GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


MASKS = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
         "padding_causal_bottom_right")


# --------------------------------------------------------------------------- inputs

def make_tokens(kind: str, b: int, sq: int, skv: int, rng: np.random.Generator) -> TokenInfo:
    """Per-token vectors for a mask kind; padding and packing leave some rows empty.

    kinds: the six mask names, and "packed" / "packed_bottom_right" (segment ids
    with a segment that has queries but no keys, and trailing padding).
    """
    q_seg = np.ones((b, sq), np.int32)
    kv_seg = np.ones((b, skv), np.int32)
    q_pos = np.broadcast_to(np.arange(sq, dtype=np.int32), (b, sq)).copy()
    kv_pos = np.broadcast_to(np.arange(skv, dtype=np.int32), (b, skv)).copy()
    q_diag = np.zeros((b, sq), np.int32)
    if kind.startswith("padding"):
        # row 0 full-ish, row 1 with padded queries, row 2 with queries but no keys
        q_len = [sq, max(sq - 2, 1), 2][:b] + [sq] * max(0, b - 3)
        kv_len = [skv - 1, skv, 0][:b] + [skv] * max(0, b - 3)
        for row in range(b):
            q_seg[row, q_len[row]:] = 0
            kv_seg[row, kv_len[row]:] = 0
            if kind.endswith("bottom_right"):
                q_diag[row] = kv_len[row] - q_len[row]
    elif kind.endswith("bottom_right"):
        q_diag[:] = skv - sq
    if kind.startswith("packed"):
        q_seg[:] = 0
        kv_seg[:] = 0
        for row in range(b):
            # segment 1 and 2 in both, segment 3 only among the queries
            q_lens = [2, sq - 5, 1]
            kv_lens = [3, skv - 6, 0]
            qs = ks = 0
            for segment, (nq, nk) in enumerate(zip(q_lens, kv_lens), start=1):
                q_seg[row, qs:qs + nq] = segment
                q_pos[row, qs:qs + nq] = np.arange(nq)
                kv_seg[row, ks:ks + nk] = segment
                kv_pos[row, ks:ks + nk] = np.arange(nk)
                if kind.endswith("bottom_right"):
                    q_diag[row, qs:qs + nq] = nk - nq
                qs += nq
                ks += nk
            q_pos[row, qs:] = 0
            kv_pos[row, ks:] = 0
            # shuffle the order of keys within the row: the predicate is position-based
            perm = rng.permutation(skv)
            kv_seg[row], kv_pos[row] = kv_seg[row][perm], kv_pos[row][perm]
    return TokenInfo(*(jnp.asarray(x, jnp.int32) for x in (q_seg, q_pos, q_diag, kv_seg, kv_pos)))


def is_causal(kind: str) -> bool:
    return "causal" in kind or kind == "packed_bottom_right"


def make_spec(kind: str, softmax: str = "vanilla", window=(-1, -1), dropout_rate: float = 0.0):
    mask = kind if kind in MASKS else ("causal" if is_causal(kind) else "no_mask")
    return AttentionSpec.from_config(dict(mask=mask, softmax=softmax, window_size=window,
                                          dropout_rate=dropout_rate))


def make_args(rng, *, b=3, sq=7, skv=9, h=4, h_kv=2, d=8, dv=None, dtype=jnp.float32,
              kind="causal", softmax="vanilla", seed=None) -> CanonicalArgs:
    dv = d if dv is None else dv
    q = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.float32).astype(dtype)
    k = jnp.asarray(rng.standard_normal((b, skv, h_kv, d)), jnp.float32).astype(dtype)
    v = jnp.asarray(rng.standard_normal((b, skv, h_kv, dv)), jnp.float32).astype(dtype)
    if softmax == "learnable":
        offset = jnp.asarray(rng.standard_normal(h), jnp.float32)
    elif softmax == "off_by_one":
        offset = jnp.zeros((h,), jnp.float32)
    else:
        offset = None
    return CanonicalArgs(q=q, k=k, v=v, tokens=make_tokens(kind, b, sq, skv, rng),
                         softmax_offset=offset,
                         dropout_seed=None if seed is None else jnp.asarray(seed, jnp.uint32))


# --------------------------------------------------------------------------- reference

def reference(args: CanonicalArgs, spec: AttentionSpec, scale: float, do, slopes=None,
              delta_from=None) -> dict:
    """float64: output, lse, visibility and gradients of sum(o * do). With `slopes` ([h])
    the scores gain the ALiBi term -slope[h] |kv_pos - (q_pos + q_diag)| and the slopes'
    gradient is returned as d_slopes; with `delta_from` (an output [b, sq, h, dv]) the
    gradients take rowsum(dO * O) from that output, as the kernels do from their own
    rounded one."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (args.q, args.k, args.v))
    b, sq, h, d = q.shape
    skv, h_kv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = h // h_kv
    kh, vh = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    q_seg, q_pos, q_diag, kv_seg, kv_pos = (np.asarray(x, np.int64) for x in args.tokens)

    diagonal = (q_pos + q_diag)[:, :, None]
    key = kv_pos[:, None, :]
    visible = (q_seg[:, :, None] != 0) & (q_seg[:, :, None] == kv_seg[:, None, :])
    if spec.mask.is_causal:
        visible &= key <= diagonal
    left, right = spec.window_size
    if left >= 0:
        visible &= key >= diagonal - left
    if right >= 0:
        visible &= key <= diagonal + right
    vis = visible[:, None]  # [b, 1, sq, skv]

    scores = scale * np.einsum("bihd,bjhd->bhij", q, kh)
    distance = np.abs(key - diagonal)[:, None].astype(np.float64)  # [b, 1, sq, skv]
    if slopes is not None:
        scores = scores - np.asarray(slopes, np.float64).reshape(1, h, 1, 1) * distance
    if str(spec.softmax) == "vanilla":
        sink = None
    elif str(spec.softmax) == "off_by_one":
        sink = np.zeros((1, h, 1, 1))
    else:
        sink = np.asarray(args.softmax_offset, np.float64).reshape(1, h, 1, 1)
    m = np.max(np.where(vis, scores, -np.inf), axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    exps = np.where(vis, np.exp(np.where(vis, scores, 0.0) - m), 0.0)
    sink_exp = 0.0 if sink is None else np.exp(sink - m)
    den = exps.sum(-1, keepdims=True) + sink_exp
    empty = ~vis.any(-1, keepdims=True)  # [b, 1, sq, 1]
    probs = np.where(empty, 0.0, exps / np.where(den > 0, den, 1.0))
    sink_prob = np.where(empty, 0.0, sink_exp / np.where(den > 0, den, 1.0))
    lse = np.where(empty, np.inf, m + np.log(np.where(den > 0, den, 1.0)))[..., 0]

    rate = spec.dropout_rate
    if args.dropout_seed is not None and rate > 0:
        keep = np.asarray(jax.jit(philox.dropout_keep_mask, static_argnums=(1, 2))(
            args.dropout_seed, rate, (b, h, sq, skv)))
        multiplier = np.where(keep, 1.0 / (1.0 - rate), 0.0)
    else:
        multiplier = 1.0
    weights = probs * multiplier
    out = np.einsum("bhij,bjhe->bihe", weights, vh)

    g_out = np.asarray(do).astype(np.float64)
    g_probs = np.einsum("bihe,bjhe->bhij", g_out, vh) * multiplier
    row_dot = np.sum(probs * g_probs, axis=-1, keepdims=True)  # = rowsum(dO * O)
    if delta_from is not None:
        o_used = np.asarray(delta_from).astype(np.float64)
        row_dot = np.einsum("bihe,bihe->bhi", g_out, o_used)[..., None]
    d_scores = probs * (g_probs - row_dot)  # the gradient of the scaled scores
    g_scores = d_scores * scale
    dq = np.einsum("bhij,bjhd->bihd", g_scores, kh)
    dk = np.einsum("bhij,bihd->bjhd", g_scores, q).reshape(b, skv, h_kv, group, d).sum(3)
    dv_ = np.einsum("bhij,bihe->bjhe", weights, g_out).reshape(b, skv, h_kv, group, dv).sum(3)
    d_offset = -np.sum(sink_prob * row_dot, axis=(0, 2, 3))
    # The slopes' gradient sums d_scores * distance, whose parts P dP and P delta cancel
    # (exactly, where a row sees one key): per head the root sum of squares of those parts,
    # the scale of a float32 kernel's rounding noise in that sum.
    slope_terms = probs * (np.abs(g_probs) + np.abs(row_dot)) * distance
    return dict(o=out, lse=lse, empty=empty[:, 0, :, 0], dq=dq, dk=dk, dv=dv_,
                d_offset=d_offset if str(spec.softmax) == "learnable" else None,
                d_slopes=None if slopes is None else -np.sum(d_scores * distance, axis=(0, 2, 3)),
                d_slopes_noise=None if slopes is None else np.sqrt(np.sum(slope_terms ** 2,
                                                                          axis=(0, 2, 3))))


# --------------------------------------------------------------------------- running

def run_flash(spec: AttentionSpec, args: CanonicalArgs, scale: float, do, jit: bool = True):
    """Output and the gradients of sum(o * do) w.r.t. q, k, v (and the offset)."""
    with_offset = args.softmax_offset is not None

    def fwd(q, k, v, offset, tokens, seed, do):
        def f(q, k, v, offset):
            a = args._replace(q=q, k=k, v=v, tokens=tokens, dropout_seed=seed,
                              softmax_offset=offset if with_offset else None)
            return flash.BACKEND.attention(spec, a, scale)

        o, vjp = jax.vjp(f, q, k, v, offset)
        return o, vjp(do)

    fn = jax.jit(fwd) if jit else fwd
    offset = args.softmax_offset if with_offset else jnp.zeros((args.q.shape[2],), jnp.float32)
    o, (dq, dk, dv, d_offset) = fn(args.q, args.k, args.v, offset, args.tokens,
                                   args.dropout_seed, do)
    return dict(o=o, dq=dq, dk=dk, dv=dv, d_offset=d_offset if with_offset else None)


def check_case(rng, spec, args, scale=None, dtype_tol=None, check_offset=True):
    scale = 1.0 / math.sqrt(args.q.shape[-1]) if scale is None else scale
    b, sq, h, _ = args.q.shape
    do = jnp.asarray(rng.standard_normal((b, sq, h, args.v.shape[-1])),
                     jnp.float32).astype(args.q.dtype)
    got = run_flash(spec, args, scale, do)
    want = reference(args, spec, scale, do)
    tol = tolerance(args.q.dtype) if dtype_tol is None else dtype_tol
    for name in ("o", "dq", "dk", "dv"):
        assert got[name].dtype == args.q.dtype, name
        assert_close(got[name], want[name], tol, name)
    # rows without a visible key: exactly zero output and query gradient
    empty = want["empty"]  # [b, sq]
    assert np.all(np.asarray(got["o"], np.float64)[empty] == 0.0)
    assert np.all(np.asarray(got["dq"], np.float64)[empty] == 0.0)
    if check_offset and want["d_offset"] is not None:
        assert_close(got["d_offset"], want["d_offset"], max(tol, 1e-5), "d_offset")
    if str(spec.softmax) == "off_by_one":
        assert np.all(np.asarray(got["d_offset"]) == 0.0)
    return got, want


# --------------------------------------------------------------------------- tests

@pytest.mark.parametrize("kind", MASKS + ("packed", "packed_bottom_right"))
def test_masks(rng, kind):
    args = make_args(rng, kind=kind)
    _, want = check_case(rng, make_spec(kind), args)
    if kind.startswith("padding") or kind.startswith("packed"):
        assert want["empty"].any()  # the case really has rows without keys


def test_bottom_right_more_queries_than_keys(rng):
    args = make_args(rng, sq=9, skv=5, kind="causal_bottom_right")
    _, want = check_case(rng, make_spec("causal_bottom_right"), args)
    assert want["empty"][:, :4].all() and not want["empty"][:, 4:].any()


@pytest.mark.parametrize("softmax", ["vanilla", "off_by_one", "learnable"])
@pytest.mark.parametrize("kind", ["no_mask", "padding_causal", "packed_bottom_right"])
def test_softmax_variants(rng, softmax, kind):
    args = make_args(rng, kind=kind, softmax=softmax)
    check_case(rng, make_spec(kind, softmax), args)


def test_learnable_offset_dominates(rng):
    """A large sink takes almost all the weight; the output shrinks towards 0."""
    args = make_args(rng, kind="no_mask", softmax="learnable")
    args = args._replace(softmax_offset=jnp.full((4,), 30.0, jnp.float32))
    got, _ = check_case(rng, make_spec("no_mask", "learnable"), args)
    assert np.abs(np.asarray(got["o"])).max() < 1e-6


@pytest.mark.parametrize("window", [(2, 0), (1, 1), (0, 0), (-1, 2), (3, -1)])
@pytest.mark.parametrize("kind", ["no_mask", "causal", "padding_causal_bottom_right"])
def test_windows(rng, window, kind):
    args = make_args(rng, kind=kind, sq=8, skv=10)
    check_case(rng, make_spec(kind, window=window), args)


@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_grouped_query_attention(rng, h_kv):
    args = make_args(rng, h=4, h_kv=h_kv, kind="padding_causal", softmax="learnable")
    check_case(rng, make_spec("padding_causal", "learnable"), args)


@pytest.mark.parametrize("d,dv", [(8, 12), (16, 4), (3, 5)])
def test_value_head_dim_differs(rng, d, dv):
    args = make_args(rng, d=d, dv=dv, kind="causal")
    check_case(rng, make_spec("causal"), args)


def test_larger_case_runs_threaded(rng):
    """Big enough for the kernels to split (batch, k/v head) groups over threads."""
    args = make_args(rng, b=2, sq=48, skv=64, h=4, h_kv=2, d=32, kind="padding_causal",
                     softmax="learnable", seed=[11, 12])
    check_case(rng, make_spec("padding_causal", "learnable", dropout_rate=0.1), args)


def test_explicit_scale(rng):
    args = make_args(rng, kind="no_mask")
    check_case(rng, make_spec("no_mask"), args, scale=0.7)


@pytest.mark.parametrize("softmax", ["vanilla", "learnable"])
@pytest.mark.parametrize("kind,window", [("no_mask", (-1, -1)), ("padding_causal", (-1, -1)),
                                         ("packed_bottom_right", (2, 0))])
def test_dropout_matches_reference(rng, softmax, kind, window):
    """Same Philox mask as fusedattn.ops.philox, in forward and backward."""
    args = make_args(rng, kind=kind, softmax=softmax, sq=6, skv=11, seed=[17, 2**32 - 3])
    check_case(rng, make_spec(kind, softmax, window=window, dropout_rate=0.3), args)


def test_dropout_seed_changes_output_and_rate_zero_is_off(rng):
    args = make_args(rng, kind="no_mask", seed=[1, 2])
    spec = make_spec("no_mask", dropout_rate=0.5)
    scale = 0.3
    a = flash.BACKEND.attention(spec, args, scale)
    b = flash.BACKEND.attention(spec, args._replace(dropout_seed=jnp.asarray([1, 3], jnp.uint32)),
                                scale)
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    no_seed = flash.BACKEND.attention(spec, args._replace(dropout_seed=None), scale)
    no_rate = flash.BACKEND.attention(make_spec("no_mask"), args, scale)
    np.testing.assert_array_equal(np.asarray(no_seed), np.asarray(no_rate))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("kind,softmax,seed", [
    ("padding_causal", "vanilla", None),
    ("packed_bottom_right", "learnable", [5, 6]),
    ("no_mask", "off_by_one", None),
])
def test_low_precision(rng, dtype, kind, softmax, seed):
    args = make_args(rng, kind=kind, softmax=softmax, dtype=dtype, seed=seed, d=16, dv=16)
    spec = make_spec(kind, softmax, dropout_rate=0.2 if seed is not None else 0.0)
    check_case(rng, spec, args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_rounds_to_nearest(rng, dtype):
    """Stores round to nearest even: nearly every output equals the rounded reference
    (float32 accumulation differs from float64 only next to rounding ties)."""
    args = make_args(rng, kind="no_mask", dtype=dtype, b=2, sq=16, skv=16, d=32)
    spec = make_spec("no_mask")
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.float32).astype(dtype)
    got = run_flash(spec, args, 0.25, do)
    want = reference(args, spec, 0.25, do)
    for name in ("o", "dv"):
        rounded = want[name].astype(np.float32).astype(dtype)
        agree = np.mean(np.asarray(got[name]) == rounded)
        assert agree > 0.95, f"{name}: only {agree:.3f} of the entries round like the reference"


def test_matches_xla_backend(rng):
    """Cross-check with the pure-JAX reference backend (autodiff gradients)."""
    from fusedattn.ops.backends import xla

    spec = make_spec("packed_bottom_right", "learnable", window=(3, 1), dropout_rate=0.25)
    args = make_args(rng, kind="packed_bottom_right", softmax="learnable", seed=[9, 10])
    scale = 0.4

    def loss(backend, q, k, v, offset):
        o = backend.attention(spec, args._replace(q=q, k=k, v=v, softmax_offset=offset), scale)
        return jnp.sum(o * jnp.cos(o)), o

    grads = {}
    for name, backend in (("flash", flash.BACKEND), ("xla", xla.BACKEND)):
        grads[name] = jax.jit(jax.grad(lambda *a: loss(backend, *a), argnums=(0, 1, 2, 3),
                                       has_aux=True))(args.q, args.k, args.v, args.softmax_offset)
    (g_f, o_f), (g_x, o_x) = grads["flash"], grads["xla"]
    assert_close(o_f, o_x, 1e-5, "o")
    for name, a, b in zip(("dq", "dk", "dv", "d_offset"), g_f, g_x):
        assert_close(a, b, 1e-5, name)


def test_lse_and_empty_rows(rng):
    """lse is the float32 log-sum-exp with the sink; +inf marks rows with no key."""
    args = make_args(rng, kind="padding_causal", softmax="learnable")
    spec = make_spec("padding_causal", "learnable")
    static = flash_ffi.Static(0.35, True, -1, -1, 2, 0.0, False)
    o, lse = jax.jit(flash_ffi.forward_call, static_argnums=0)(
        static, args.q, args.k, args.v, args.softmax_offset, jnp.zeros((2,), jnp.uint32),
        tuple(args.tokens))
    want = reference(args, spec, 0.35, jnp.zeros(o.shape))
    lse = np.asarray(lse)
    assert lse.shape == (3, 4, 7)
    empty = np.broadcast_to(want["empty"][:, None, :], lse.shape)
    assert np.all(np.isposinf(lse[empty]))
    assert_close(lse[~empty], want["lse"][~empty], 1e-5, "lse")
    assert_close(o, want["o"], 1e-5, "o")


def test_every_output_written(rng):
    """Outputs are fully written: exact zeros (never stale memory) in empty rows.

    Output buffers are allocated right after NaN-filled buffers of the same size
    are freed, so an unwritten element would most likely read back as NaN.
    """
    args = make_args(rng, kind="padding", b=3, sq=6, skv=6, softmax="off_by_one")
    spec = make_spec("padding", "off_by_one")
    scale = 0.5
    do = jnp.ones(args.q.shape[:3] + (args.v.shape[-1],), jnp.float32)
    fn = jax.jit(lambda q, k, v: jax.vjp(
        lambda q, k, v: flash.BACKEND.attention(spec, args._replace(q=q, k=k, v=v), scale),
        q, k, v)[1](do) + (flash.BACKEND.attention(spec, args._replace(q=q, k=k, v=v), scale),))
    fn(args.q, args.k, args.v)  # compile
    want = reference(args, spec, scale, do)
    for _ in range(3):
        poison_like(args.q, args.k, args.v)
        dq, dk, dv, o = fn(args.q, args.k, args.v)
        for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert_close(x, want[name], 1e-5, name)
        assert np.all(np.asarray(o)[want["empty"]] == 0.0)
        assert np.all(np.asarray(dq)[want["empty"]] == 0.0)
    # keys that no query sees get exactly zero dk/dv (row 2 has no visible keys at all)
    assert np.all(np.asarray(dk)[2] == 0.0) and np.all(np.asarray(dv)[2] == 0.0)


def test_fully_masked_call_is_zero_not_nan(rng):
    args = make_args(rng, kind="padding", b=1, softmax="learnable")
    tokens = args.tokens._replace(q_seg=jnp.zeros_like(args.tokens.q_seg))
    args = args._replace(tokens=tokens)
    got = run_flash(make_spec("padding", "learnable"), args, 0.5,
                    jnp.ones(args.q.shape[:3] + (args.v.shape[-1],)))
    for name in ("o", "dq", "dk", "dv", "d_offset"):
        assert np.all(np.asarray(got[name]) == 0.0), name


def test_eager_equals_jit(rng):
    args = make_args(rng, kind="padding_causal", softmax="learnable", seed=[3, 4])
    spec = make_spec("padding_causal", "learnable", dropout_rate=0.1)
    do = jnp.ones(args.q.shape[:3] + (args.v.shape[-1],))
    a = run_flash(spec, args, 0.3, do, jit=False)
    b = run_flash(spec, args, 0.3, do, jit=True)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


# --------------------------------------------------------------------------- vmap

def _loss_fn(spec, scale, tokens):
    def loss(q, k, v, offset, seed):
        args = CanonicalArgs(q=q, k=k, v=v, tokens=tokens, softmax_offset=offset,
                             dropout_seed=seed)
        o = flash.BACKEND.attention(spec, args, scale)
        return jnp.sum(o * o), o
    return loss


def test_vmap_folds_into_batch_and_matches_loop(rng):
    """vmap over examples, with an unbatched softmax_offset and per-example seeds."""
    n, b, sq, skv, h, h_kv, d = 3, 2, 5, 6, 4, 2, 8
    spec = make_spec("causal", "learnable", dropout_rate=0.3)
    tokens = make_tokens("causal", b, sq, skv, rng)
    q = jnp.asarray(rng.standard_normal((n, b, sq, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((n, b, skv, h_kv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, b, skv, h_kv, d)), jnp.float32)
    offset = jnp.asarray(rng.standard_normal(h), jnp.float32)
    seeds = jnp.asarray([[1, 2], [3, 4], [1, 2]], jnp.uint32)
    loss = _loss_fn(spec, 0.4, tokens)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

    # The mapped axis reaches the kernel as a batch of n * b rows: one ffi call, no loop.
    jaxpr = str(jax.make_jaxpr(jax.vmap(loss, in_axes=(0, 0, 0, None, 0)))(q, k, v, offset, seeds))
    assert jaxpr.count("ffi_call") == 1 and "while" not in jaxpr and "scan" not in jaxpr

    (gq, gk, gv, goff), o = jax.jit(jax.vmap(grad, in_axes=(0, 0, 0, None, 0)))(
        q, k, v, offset, seeds)
    for i in range(n):
        (lq, lk, lv, loff), lo = grad(q[i], k[i], v[i], offset, seeds[i])
        for name, a, b_ in (("o", o[i], lo), ("dq", gq[i], lq), ("dk", gk[i], lk),
                            ("dv", gv[i], lv), ("d_offset", goff[i], loff)):
            assert_close(a, b_, 1e-6, f"{name}[{i}]")

    # the gradient of a summed loss w.r.t. the unbatched offset sums over examples
    total = jax.jit(jax.grad(lambda off: jnp.sum(jax.vmap(
        lambda q, k, v, s: loss(q, k, v, off, s)[0])(q, k, v, seeds))))(offset)
    assert_close(total, np.sum(np.asarray(goff), axis=0), 1e-5, "summed d_offset")


def test_vmap_unbatched_seed_and_nested_vmap(rng):
    n1, n2, b, sq, skv, h, d = 2, 2, 1, 4, 5, 2, 4
    spec = make_spec("padding_causal", "vanilla", dropout_rate=0.4)
    tokens = make_tokens("padding_causal", b, sq, skv, rng)
    q = jnp.asarray(rng.standard_normal((n1, n2, b, sq, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((n1, n2, b, skv, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n1, n2, b, skv, h, d)), jnp.float32)
    seed = jnp.asarray([7, 8], jnp.uint32)
    loss = _loss_fn(spec, 0.5, tokens)
    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    inner = jax.vmap(grad, in_axes=(0, 0, 0, None, None))
    (gq, gk, gv), o = jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, None, None)))(
        q, k, v, None, seed)
    for i in range(n1):
        for j in range(n2):
            (lq, lk, lv), lo = grad(q[i, j], k[i, j], v[i, j], None, seed)
            for name, a, b_ in (("o", o[i, j], lo), ("dq", gq[i, j], lq), ("dk", gk[i, j], lk),
                                ("dv", gv[i, j], lv)):
                assert_close(a, b_, 1e-6, f"{name}[{i},{j}]")


def test_vmap_per_example_tokens(rng):
    """Batched token vectors (different padding per example) under vmap."""
    n, b, sq, skv, h, d = 3, 2, 5, 5, 2, 4
    spec = make_spec("padding", "off_by_one")
    toks = [make_tokens("padding" if i % 2 else "no_mask", b, sq, skv, rng) for i in range(n)]
    tokens = TokenInfo(*(jnp.stack(x) for x in zip(*toks)))
    q = jnp.asarray(rng.standard_normal((n, b, sq, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((n, b, skv, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, b, skv, h, d)), jnp.float32)
    offset = jnp.zeros((h,), jnp.float32)

    def f(q, k, v, tokens):
        return flash.BACKEND.attention(spec, CanonicalArgs(q, k, v, tokens, softmax_offset=offset),
                                       0.5)

    out = jax.vmap(f)(q, k, v, tokens)
    for i in range(n):
        one = CanonicalArgs(q[i], k[i], v[i], TokenInfo(*(t[i] for t in tokens)),
                            softmax_offset=offset)
        assert_close(out[i], reference(one, spec, 0.5, jnp.zeros(out[i].shape))["o"], 1e-5, "o")


# --------------------------------------------------------------------------- contract and errors

def _shapes(**kw):
    base = dict(batch=2, seqlen_q=4, seqlen_kv=4, num_heads=2, num_kv_heads=2, head_dim_qk=8,
                head_dim_v=8, dtype=jnp.dtype(jnp.float32), bias_shape=None, dropout=False)
    base.update(kw)
    return CallShapes(**base)


def test_supports():
    spec = make_spec("causal")
    assert flash.BACKEND.name == "flash"
    assert flash.BACKEND.supports(spec, _shapes(), "cpu") is None
    if jax.devices()[0].platform != "gpu":
        for platform in ("gpu", "cuda"):
            reason = flash.BACKEND.supports(spec, _shapes(), platform)
            assert reason == "flash: jax has no CUDA backend in this process", reason
        reason = flash.BACKEND.supports(spec, _shapes(), "rocm")
        assert reason == "flash: jax has no ROCM backend in this process", reason
    for bias in ("post_scale_bias", "pre_scale_bias"):  # tests/test_flash_bias_host.py
        assert flash.BACKEND.supports(spec.replace(bias=type(spec.bias)(bias)),
                                      _shapes(bias_shape=(2, 2, 4, 4)), "cpu") is None
    reason = flash.BACKEND.supports(spec, _shapes(dtype=jnp.dtype(jnp.int8)), "cpu")
    assert reason.startswith("flash: dtype int8")
    assert flash.BACKEND.supports(make_spec("packed", "learnable", (3, 0), 0.5),
                                  _shapes(dropout=True), "cpu") is None


def test_python_errors(rng):
    args = make_args(rng, kind="causal")
    with pytest.raises(ValueError, match="softmax_offset"):
        flash.BACKEND.attention(make_spec("causal", "learnable"), args, 0.5)
    with pytest.raises(ValueError, match="share one dtype"):
        flash.BACKEND.attention(make_spec("causal"), args._replace(k=args.k.astype(jnp.bfloat16)),
                                0.5)
    with pytest.raises(ValueError, match="share one dtype"):
        flash.BACKEND.attention(make_spec("causal"), args._replace(
            q=args.q.astype(jnp.int32), k=args.k.astype(jnp.int32), v=args.v.astype(jnp.int32)), 0.5)


def _raw_forward(q, k, v, tokens, offset, seed, slopes=None, out_shapes=None, bias=None,
                 **attrs):
    b, sq, h, _ = q.shape
    slopes = jnp.zeros((h,), jnp.float32) if slopes is None else slopes
    bias = jnp.zeros((1, 1, 0, 0), jnp.float32) if bias is None else bias
    attributes = dict(scale=np.float32(0.5), causal=False, window_left=np.int64(-1),
                      window_right=np.int64(-1), softmax_type=np.int32(0),
                      dropout_rate=np.float64(0.0), alibi=False, bias_type=np.int32(0))
    attributes.update(attrs)
    out_shapes = out_shapes or (jax.ShapeDtypeStruct((b, sq, h, v.shape[-1]), q.dtype),
                                jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    call = jax.ffi.ffi_call(flash_ffi.FWD_TARGET, out_shapes)
    return jax.block_until_ready(call(q, k, v, *tokens, offset, seed, slopes, bias,
                                      **attributes))


@pytest.mark.parametrize("change,message", [
    (dict(q=lambda a: a.q.astype(jnp.int32)), "q must be float32, bfloat16 or float16, got int32"),
    (dict(k=lambda a: a.k.astype(jnp.float16)), "q, k and v must share one dtype"),
    (dict(tokens=lambda a: a.tokens._replace(q_pos=a.tokens.q_pos.astype(jnp.uint32))),
     "q_pos must be int32, got uint32"),
    (dict(tokens=lambda a: a.tokens._replace(kv_seg=a.tokens.kv_seg[:, :-1])),
     "kv_seg must have shape"),
    (dict(k=lambda a: a.k[:, :, :, :-1]), "k must have shape"),
    (dict(v=lambda a: a.v[:, :-1]), "v must have shape"),
    (dict(k=lambda a: jnp.concatenate([a.k, a.k[:, :, :1]], axis=2),
          v=lambda a: jnp.concatenate([a.v, a.v[:, :, :1]], axis=2)), "must be a multiple"),
    (dict(offset=lambda a: jnp.zeros((2, 4), jnp.float32)), "does not divide the batch"),
    (dict(offset=lambda a: jnp.zeros((3,), jnp.float32)), "softmax_offset must have shape"),
    (dict(seed=lambda a: jnp.zeros((2,), jnp.int32)), "seed must be uint32"),
    (dict(slopes=lambda a: jnp.zeros((5,), jnp.float32)), "alibi_slopes must have shape"),
    (dict(slopes=lambda a: jnp.zeros((4,), jnp.float16)), "alibi_slopes must be float32"),
    (dict(slopes=lambda a: jnp.zeros((2, 4), jnp.float32)), "alibi_slopes's leading dims"),
    (dict(attrs=dict(softmax_type=np.int32(7))), "softmax_type must be"),
    (dict(attrs=dict(dropout_rate=np.float64(1.5))), "dropout_rate must be in"),
    (dict(attrs=dict(bias_type=np.int32(3))), "bias_type must be 0"),
    (dict(bias=lambda a: jnp.zeros((1, 1, 7, 9), jnp.bfloat16), attrs=dict(bias_type=np.int32(2))),
     "bias must be float32, got bfloat16"),
    (dict(bias=lambda a: jnp.zeros((2, 4, 7, 9), jnp.float32), attrs=dict(bias_type=np.int32(1))),
     r"bias must have shape \[3 or 1, 4 or 1, 7, 9\], got \[2, 4, 7, 9\]"),
    (dict(bias=lambda a: jnp.zeros((1, 1, 7, 8), jnp.float32), attrs=dict(bias_type=np.int32(2))),
     r"bias must have shape \[3 or 1, 4 or 1, 7, 9\], got \[1, 1, 7, 8\]"),
    (dict(bias=lambda a: jnp.zeros((7, 9), jnp.float32)), "bias must have shape"),
])
def test_ffi_errors(rng, change, message):
    """Bad operands come back as errors with a clear message, never a crash."""
    args = make_args(rng, kind="causal")
    parts = dict(q=args.q, k=args.k, v=args.v, tokens=args.tokens,
                 offset=jnp.zeros((4,), jnp.float32), seed=jnp.zeros((2,), jnp.uint32),
                 slopes=jnp.zeros((4,), jnp.float32), bias=None)
    attrs = change.pop("attrs", {})
    for key, fn in change.items():
        parts[key] = fn(args)
    with pytest.raises(Exception, match=message):
        _raw_forward(parts["q"], parts["k"], parts["v"], tuple(parts["tokens"]), parts["offset"],
                     parts["seed"], parts["slopes"], bias=parts["bias"], **attrs)


def test_ffi_error_on_wrong_result_shape(rng):
    args = make_args(rng, kind="causal")
    b, sq, h, d = args.q.shape
    bad = (jax.ShapeDtypeStruct((b, sq, h, d), jnp.bfloat16),
           jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    with pytest.raises(Exception, match="result o must be float32"):
        _raw_forward(args.q, args.k, args.v, tuple(args.tokens), jnp.zeros((4,), jnp.float32),
                     jnp.zeros((2,), jnp.uint32), out_shapes=bad)


def test_through_fused_attn(rng):
    """The public op with backend='flash' equals backend='xla' (padding descriptor, GQA)."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the public op picks backends for the default device, which is not the cpu")
    try:
        from fusedattn.ops import SequenceDescriptor, fused_attn
        from conftest import make_config
    except ImportError as error:  # the front end is written concurrently
        pytest.skip(f"front end not importable: {error}")
    b, s, h, h_kv, d = 2, 6, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, h_kv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, h_kv, d)), jnp.float32)
    seq = SequenceDescriptor.from_seqlens(jnp.asarray([6, 3], jnp.int32),
                                          jnp.asarray([5, 6], jnp.int32))
    outs = {}
    for backend in ("flash", "xla"):
        config = make_config(backend=backend, mask="padding_causal_bottom_right",
                             softmax="learnable")
        offset = jnp.asarray([0.1, -0.2, 0.3, 0.0], jnp.float32)
        f = lambda q, k, v, off: jnp.sum(fused_attn((q, k, v), config=config, sequence=seq,
                                                    softmax_offset=off) ** 2)
        outs[backend] = jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, offset)
    for a, b_ in zip(outs["flash"], outs["xla"]):
        assert_close(a, b_, 1e-5)
