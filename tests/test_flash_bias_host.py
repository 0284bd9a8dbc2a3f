"""Bias arrays on the "flash" backend's host build (platform "cpu") against the xla backend.

Every case draws fresh random inputs (the bias too), runs `flash.BACKEND.attention` and
`xla.BACKEND.attention` on the same CanonicalArgs (config.bias 'pre_scale_bias':
s = (q.k + bias) * scale, or 'post_scale_bias': s = q.k * scale + bias, the bias
[b|1, h|1, sq, skv]) and compares the output and the gradients of sum(o * do) w.r.t. q,
k, v, the softmax offset and the bias (the xla backend's from autodiff: dS summed over the
bias's shared dims), with test_flash_alibi_host's run/check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_config, tolerance
# The host build's skip mark and the autouse fixture that runs every case on the cpu.
from test_flash_host import _on_cpu, pytestmark  # noqa: F401
from test_flash_host import MASKS, _shapes, make_args, make_spec
from test_flash_alibi_host import check, run

from fusedattn.ops import explain, fused_attn
from fusedattn.ops.backends import flash, xla
from fusedattn.ops.enums import BiasType

BIASES = ("pre_scale_bias", "post_scale_bias")
# Which of the bias's leading dims are full (b, h) rather than shared (1).
SHAPES = {"shared": (False, False), "per_row": (True, False), "per_head": (False, True),
          "full": (True, True)}


def bias_spec(bias: str, kind: str, softmax: str = "vanilla", window=(-1, -1),
              dropout_rate: float = 0.0):
    return make_spec(kind, softmax, window, dropout_rate).replace(bias=BiasType(bias))


def with_bias(rng, args, shape: str = "full", dtype=jnp.float32):
    """args with a random bias [b|1, h|1, sq, skv] of `dtype` (both signs, order 1)."""
    b, sq, h, _ = args.q.shape
    full_b, full_h = SHAPES[shape]
    size = (b if full_b else 1, h if full_h else 1, sq, args.k.shape[1])
    return args._replace(bias=jnp.asarray(rng.normal(0.0, 1.5, size), jnp.float32).astype(dtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", BIASES)
def test_broadcast_shapes(rng, bias, shape):
    """Every broadcast form; GQA (4 heads over 2) so a shared head dim spans k/v groups."""
    args = with_bias(rng, make_args(rng, kind="padding_causal", sq=7, skv=10), shape)
    check(rng, bias_spec(bias, "padding_causal"), args)


@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("kind", MASKS + ("packed", "packed_bottom_right"))
def test_masks(rng, kind, bias):
    """Every mask, and packed segments (which cuDNN refuses with a bias)."""
    args = with_bias(rng, make_args(rng, kind=kind, sq=7, skv=11), "per_head")
    check(rng, bias_spec(bias, kind), args)


@pytest.mark.parametrize("shape", ["shared", "full"])
@pytest.mark.parametrize("window", [(2, 0), (3, 3), (-1, 2)])
@pytest.mark.parametrize("kind", ["no_mask", "causal_bottom_right", "packed"])
def test_windows(rng, window, kind, shape):
    args = with_bias(rng, make_args(rng, kind=kind, sq=8, skv=12), shape)
    check(rng, bias_spec("post_scale_bias", kind, window=window), args)


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
@pytest.mark.parametrize("kind", ["no_mask", "packed_bottom_right"])
def test_softmax_variants(rng, softmax, kind):
    args = with_bias(rng, make_args(rng, kind=kind, softmax=softmax), "per_row")
    check(rng, bias_spec("pre_scale_bias", kind, softmax), args)


@pytest.mark.parametrize("shape", ["shared", "per_head"])
@pytest.mark.parametrize("h_kv", [1, 3, 6])
def test_grouped_query_attention(rng, h_kv, shape):
    args = make_args(rng, h=6, h_kv=h_kv, kind="padding_causal", softmax="learnable")
    check(rng, bias_spec("post_scale_bias", "padding_causal", "learnable"),
          with_bias(rng, args, shape))


@pytest.mark.parametrize("bias", BIASES)
def test_dropout(rng, bias):
    """The dropout mask and the bias together (both backends draw the same Philox mask)."""
    args = with_bias(rng, make_args(rng, kind="packed", sq=9, skv=11, seed=[7, 2**32 - 5]),
                     "per_row")
    check(rng, bias_spec(bias, "packed", dropout_rate=0.3), args)


@pytest.mark.parametrize("bias_dtype", [jnp.float32, None])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(rng, dtype, bias_dtype):
    """16-bit q/k/v with a float32 bias or one of their dtype (its gradient comes back in it)."""
    args = make_args(rng, kind="packed_bottom_right", dtype=dtype, d=16)
    args = with_bias(rng, args, "per_head", bias_dtype or dtype)
    check(rng, bias_spec("pre_scale_bias", "packed_bottom_right"), args)


def test_larger_case_runs_threaded_and_is_deterministic(rng):
    """Big enough for the host kernels to split (batch, k/v head) groups over threads; a
    shared bias's gradient sums every row and head, bitwise the same on every run."""
    args = with_bias(rng, make_args(rng, b=3, sq=48, skv=80, h=4, h_kv=2, d=32,
                                    kind="padding_causal_bottom_right"), "shared")
    spec = bias_spec("post_scale_bias", "padding_causal_bottom_right", window=(40, 3))
    got, _ = check(rng, spec, args)
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.float32)
    first = run(flash.BACKEND, spec, args, 0.3, do)
    again = run(flash.BACKEND, spec, args, 0.3, do)
    for name in ("dq", "dk", "dv", "d_bias"):
        np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(again[name]), name)


def test_bias_gradient_is_zero_where_masked_and_applied_elsewhere(rng):
    """The bias changes the output; its gradient is exactly 0 at masked (query, key) pairs
    and at queries that see no key, nonzero at visible ones."""
    args = with_bias(rng, make_args(rng, kind="padding_causal", sq=9, skv=9), "full")
    spec = bias_spec("post_scale_bias", "padding_causal")
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.float32)
    got = run(flash.BACKEND, spec, args, 0.5, do)
    plain = run(flash.BACKEND, make_spec("padding_causal"), args._replace(bias=None), 0.5, do)
    assert np.abs(np.asarray(got["o"]) - np.asarray(plain["o"])).max() > 1e-2
    t = args.tokens
    visible = np.asarray((t.q_seg[:, :, None] != 0) & (t.kv_seg[:, None, :] != 0)
                         & (t.kv_pos[:, None, :] <= t.q_pos[:, :, None]))[:, None]
    visible = np.broadcast_to(visible, got["d_bias"].shape)
    d_bias = np.asarray(got["d_bias"])
    assert np.all(d_bias[~visible] == 0)
    # a query with one visible key has dS = 0 there (its weight is 1 whatever the score)
    several = np.broadcast_to(visible.sum(-1, keepdims=True) > 1, visible.shape) & visible
    assert np.all(d_bias[several] != 0)


def _per_example_loss(spec, args, scale):
    """sum(o * w) of one example (b = 1 rows of args) as a function of q and the bias."""
    def loss(q, k, v, tokens, bias, w, backend):
        a = args._replace(q=q[None], k=k[None], v=v[None],
                          tokens=type(args.tokens)(*(t[None] for t in tokens)), bias=bias)
        return jnp.sum(backend.attention(spec, a, scale)[0] * w)
    return loss


@pytest.mark.parametrize("mapped", [True, False])
def test_vmap_per_example_gradients(rng, mapped):
    """jax.vmap(jax.grad): a mapped bias reaches each example's rows; an unmapped one
    shared by the examples gets each example's own gradient (not their sum)."""
    spec = bias_spec("pre_scale_bias", "packed")
    args = make_args(rng, kind="packed", sq=9, skv=11)
    w = jnp.asarray(rng.standard_normal(args.q.shape), jnp.float32)
    shape = (3, 1, 4, 9, 11) if mapped else (1, 1, 9, 11)
    bias = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    loss = _per_example_loss(spec, args, 0.4)
    grad = jax.grad(loss, argnums=(0, 4))
    axes = (0, 0, 0, 0, 0 if mapped else None, 0, None)
    results = {backend.name: jax.jit(jax.vmap(grad, in_axes=axes), static_argnums=6)(
        args.q, args.k, args.v, args.tokens, bias, w, backend)
        for backend in (flash.BACKEND, xla.BACKEND)}
    for i, name in enumerate(("dq", "d_bias")):
        got, want = results["flash"][i], results["xla"][i]
        assert got.shape == want.shape == ((3, 9, 4, 8) if i == 0 else (3,) + shape[-4:])
        assert_close(got, want, 1e-5, name)


def test_through_fused_attn(rng):
    """The public op: named flash serves a bias on the cpu under packing (segment ids),
    explain says so, the loss and every gradient match backend xla."""
    b, s, h, d = 2, 12, 4, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, h, s, s)), jnp.bfloat16)
    ids = np.repeat(np.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * 8 + [2] * 4]), 1, 0)
    from fusedattn.ops import SequenceDescriptor
    sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
    results = {}
    for backend in ("flash", "xla"):
        config = make_config(backend=backend, mask="padding_causal", bias="post_scale_bias",
                             sequence={"format": "segment_ids", "max_segments_per_seq": 2})

        def loss(q, k, v, bias, config=config):
            out = fused_attn((q, k, v), config=config, bias=bias, sequence=sequence)
            return jnp.sum(out * jnp.cos(out))

        results[backend] = jax.value_and_grad(loss, (0, 1, 2, 3))(q, k, v, bias)
        if backend == "flash":
            assert explain((q, k, v), config=config, bias=bias,
                           sequence=sequence).backend == "flash"
    assert_close(results["flash"][0], results["xla"][0], 1e-5, "loss")
    for i, name in enumerate(("dq", "dk", "dv", "d_bias")):
        assert results["flash"][1][i].dtype == results["xla"][1][i].dtype, name
        assert_close(results["flash"][1][i], results["xla"][1][i],
                     tolerance(jnp.bfloat16) if name == "d_bias" else 1e-5, name)


def test_supports_and_explain():
    """Bias arrays on cpu; on CUDA and ROCm the sm_80 kernels' text serves them, so no
    verdict there is about the bias (where the GPU library is missing, the verdict says that)."""
    for bias in BIASES:
        spec = bias_spec(bias, "causal")
        assert flash.BACKEND.supports(spec, _shapes(bias_shape=(1, 2, 4, 4)), "cpu") is None
        for platform in ("cuda", "rocm"):
            reason = flash.BACKEND.supports(spec, _shapes(bias_shape=(2, 1, 4, 4)), platform)
            assert reason is None or "bias" not in reason, reason
    q = jax.ShapeDtypeStruct((2, 4, 2, 8), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((2, 2, 4, 4), jnp.float32)
    config = make_config(backend="auto", mask="causal", bias="post_scale_bias")
    verdict = explain((q, q, q), config=config, bias=bias, platform="cuda").verdicts["flash"]
    assert verdict is None or "bias" not in verdict, verdict


def test_missing_bias_raises(rng):
    with pytest.raises(ValueError, match="bias: config.bias 'pre_scale_bias' needs a bias array"):
        flash.BACKEND.attention(bias_spec("pre_scale_bias", "causal"),
                                make_args(rng, kind="causal"), 0.5)


@pytest.mark.parametrize("shape", [(2, 3, 6, 6), (1, 1, 6, 5), (4, 6, 6)])
def test_public_op_names_the_bias_argument(rng, shape):
    q = jnp.asarray(rng.standard_normal((2, 6, 4, 8)), jnp.float32)
    config = make_config(backend="flash", mask="causal", bias="post_scale_bias")
    with pytest.raises(ValueError, match=r"bias: expected shape \[b or 1, h or 1, sq, skv\] = "
                                         r"\[2 or 1, 4 or 1, 6, 6\]"):
        fused_attn((q, q, q), config=config, bias=jnp.ones(shape, jnp.float32))


def _backward_d_bias_shapes(spec, args, argnums):
    """The d_bias result shapes of the flash backward calls in jax.grad's program over
    `argnums` of (q, k, v, bias)."""
    def loss(q, k, v, bias):
        return jnp.sum(flash.BACKEND.attention(spec, args._replace(q=q, k=k, v=v, bias=bias), 0.5))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums))(args.q, args.k, args.v, args.bias)
    shapes = []

    def visit(eqns):
        for eqn in eqns:
            if eqn.params.get("target_name") == "fusedattn_flash_bwd":
                shapes.append(tuple(eqn.outvars[5].aval.shape))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None:
                        visit(getattr(inner, "eqns", []) or getattr(getattr(inner, "jaxpr", None), "eqns", []))
    visit(jaxpr.eqns)
    return shapes


@pytest.mark.parametrize("bias", BIASES)
def test_a_bias_nobody_differentiates_gets_no_gradient_computed(rng, bias):
    """A bias that is not differentiated (a mask given as a bias, a fixed one): the backward
    call asks for an empty d_bias (the kernels skip its terms), and the other gradients
    equal those of a call that differentiates the bias, and the xla backend's."""
    spec = bias_spec(bias, "padding_causal")
    args = with_bias(rng, make_args(rng, kind="padding_causal", sq=9, skv=12), "shared")
    assert _backward_d_bias_shapes(spec, args, (0, 1, 2)) == [(1, 1, 0, 0)]
    assert _backward_d_bias_shapes(spec, args, (0, 3)) == [tuple(args.bias.shape)]

    def grads(backend, argnums):
        def loss(q, k, v, b):
            o = backend.attention(spec, args._replace(q=q, k=k, v=v, bias=b), 0.5)
            return jnp.sum(o * jnp.cos(o))
        return jax.jit(jax.grad(loss, argnums))(args.q, args.k, args.v, args.bias)

    without = grads(flash.BACKEND, (0, 1, 2))
    with_d_bias = grads(flash.BACKEND, (0, 1, 2, 3))
    want = grads(xla.BACKEND, (0, 1, 2))
    for name, got, full, ref in zip(("dq", "dk", "dv"), without, with_d_bias, want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(full), name)
        assert_close(got, ref, tolerance(args.q.dtype), name)
