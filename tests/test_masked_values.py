"""Masked keys holding NaN/Inf contribute nothing on every backend (fusedattn.ops.masked_values).

On the CPU the guard wraps a deliberately leaky attention (masked probabilities multiplied
with the values, as fused kernels do), also as a registered backend, against which explain's
line on the guard is checked; on a GPU the cudnn, flash and small_seq backends run
with NaN/Inf at masked positions and must agree with the xla backend, forward and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (assert_close, fake_cudnn_for_cuda_lowering, make_config, random_array,
                      tolerance)
from fusedattn.ops import SequenceDescriptor, explain, fused_attn, masked_values, registry
from fusedattn.ops.backends.base import CanonicalArgs
from fusedattn.ops.sequence import dense_token_info
from fusedattn.ops.spec import AttentionSpec

B, S, H, D = 2, 12, 2, 16


def leaky_causal(args: CanonicalArgs) -> jax.Array:
    """Causal attention the way a fused kernel computes it: P (exactly 0 where masked) times
    V, so a NaN value at a future key turns earlier rows NaN."""
    s = jnp.einsum("bqhd,bkhd->bhqk", args.q, args.k) / np.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), args.v)


def call_args(q, k, v) -> CanonicalArgs:
    spec = AttentionSpec.from_config(make_config(mask="causal"))
    return CanonicalArgs(q=q, k=k, v=v, tokens=dense_token_info(spec, B, S, S))


def exact_causal(q, k, v):
    return fused_attn((q, k, v), config=make_config(backend="xla", mask="causal"))


def qkv(rng, shape=(B, S, H, D), dtype=jnp.float32):
    return tuple(random_array(rng, shape, dtype) for _ in range(3))


def guarded(q, k, v):
    return masked_values.guarded(leaky_causal, call_args(q, k, v))


def loss_of_rows(fn, rows):
    return lambda *a: jnp.sum(fn(*a)[:, rows] ** 2)


@pytest.mark.parametrize("poisoned", ["k", "v"])
@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_guard_excludes_masked_non_finite_keys(rng, poisoned, value):
    q, k, v = qkv(rng)
    arrays = {"q": q, "k": k, "v": v}
    arrays[poisoned] = arrays[poisoned].at[:, 7].set(value)   # key 7: seen by queries 7..11
    bad = (arrays["q"], arrays["k"], arrays["v"])
    leaky = jax.grad(loss_of_rows(lambda *a: leaky_causal(call_args(*a)), slice(0, 7)))(*bad)
    assert np.isnan(np.asarray(leaky)).any()              # the leak exists (dQ = dS K)
    out = np.asarray(jax.jit(guarded)(*bad))
    assert_close(out[:, :7], np.asarray(exact_causal(q, k, v))[:, :7], 1e-5)
    assert np.isnan(out[:, 7:]).all()
    grads = jax.grad(loss_of_rows(guarded, slice(0, 7)), argnums=(0, 1, 2))(*bad)
    expected = jax.grad(loss_of_rows(exact_causal, slice(0, 7)), argnums=(0, 1, 2))(*bad)
    for name, grad, want in zip("qkv", grads, expected):
        assert np.isfinite(np.asarray(grad)).all(), name
        assert_close(grad, want, 1e-5)


def test_guard_keeps_the_fast_path_value_and_gradients(rng):
    q, k, v = qkv(rng)
    cotangent = random_array(rng, (B, S, H, D))
    out, vjp = jax.vjp(guarded, q, k, v)
    fast_out, fast_vjp = jax.vjp(lambda *a: leaky_causal(call_args(*a)), q, k, v)
    np.testing.assert_array_equal(out, fast_out)
    for grad, fast in zip(vjp(cotangent), fast_vjp(cotangent)):
        np.testing.assert_array_equal(grad, fast)


def test_guard_branches_once_under_vmap(rng):
    """Mapped calls share one flag: the guard stays a branch (a cond, not a select of both
    paths), and each example gets the exact result."""
    q, k, v = qkv(rng)
    v = v.at[1, 9].set(jnp.nan)
    mapped = jax.vmap(lambda q, k, v: guarded(q[None], k[None], v[None])[0])
    jaxpr = str(jax.make_jaxpr(mapped)(q, k, v))
    assert "cond[" in jaxpr  # a batched predicate would turn the cond into a select_n
    out = np.asarray(mapped(q, k, v))
    want = np.asarray(exact_causal(q, k, jnp.where(jnp.isfinite(v), v, 0)))
    assert_close(out[0], want[0], 1e-5)       # the clean example
    assert_close(out[1, :9], want[1, :9], 1e-5)
    assert np.isnan(out[1, 9:]).all()


def test_which_calls_are_guarded():
    from fusedattn.ops.backends import cudnn, flash, xla

    def exact(backend, platform="cuda", **config):
        return backend.masked_values_exact(AttentionSpec.from_config(make_config(**config)),
                                           platform)

    assert exact(xla.BACKEND, mask="causal") and exact(xla.BACKEND, "cpu", mask="causal")
    assert exact(flash.BACKEND, "cpu", mask="causal")
    assert not exact(flash.BACKEND, mask="padding")
    assert exact(cudnn.BACKEND, mask="padding") and exact(cudnn.BACKEND, mask="no_mask")
    assert not exact(cudnn.BACKEND, mask="causal")
    assert not exact(cudnn.BACKEND, mask="no_mask", window_size=(4, 0))


class LeakyBackend:
    """Registered as "cudnn": serves every call with leaky_causal, on any platform, and says
    its kernels leak (masked_values_exact False), as the CUDA ones do."""

    name = "cudnn"

    def masked_values_exact(self, spec, platform):
        return False

    def supports(self, spec, shapes, platform):
        return None

    def attention(self, spec, args, scale):
        return leaky_causal(args)


@pytest.mark.parametrize("guard", [True, False])
def test_explain_says_whether_the_guard_wraps_a_leaky_backend(monkeypatch, rng, guard):
    """explain's line and fused_attn agree: guarded, the rows before a NaN value are exact;
    unguarded, the leak explain warns of reaches them."""
    monkeypatch.setitem(registry.BACKENDS, "cudnn", LeakyBackend())
    q, k, v = qkv(rng)
    bad_v = v.at[:, 7].set(jnp.nan)                      # key 7: seen by queries 7..11
    config = make_config(mask="causal", guard_masked_values=guard)
    explanation = explain((q, k, bad_v), config=config, platform="cpu")
    assert explanation.backend == "cudnn"
    assert str(explanation).splitlines()[-1] == explanation.guard
    out = np.asarray(fused_attn((q, k, bad_v), config=config))
    if guard:
        assert explanation.guard == (
            "guard_masked_values: on; cudnn would let a masked NaN/Inf key or value reach "
            "other rows under mask 'causal' on cpu, so the call is guarded: a NaN check of the "
            "output (and of dQ in the backward) and a conditional, a host round trip on GPUs: "
            "docs/backends.md")
        assert_close(out[:, :7], np.asarray(exact_causal(q, k, v))[:, :7], 1e-5)
        assert np.isnan(out[:, 7:]).all()
    else:
        assert explanation.guard.startswith(
            "guard_masked_values: off; cudnn can let a masked NaN/Inf key or value reach other "
            "rows under mask 'causal' on cpu; set it to True to exclude them, at the cost of a "
            "NaN check")
        assert np.isnan(out[:, :7]).all()               # the leak


@pytest.mark.parametrize("backend", ["xla", "flash"])
def test_explain_says_exact_backends_need_no_guard(rng, backend):
    q, k, v = qkv(rng)
    config = make_config(backend=backend, mask="causal", window_size=(3, 0),
                         guard_masked_values=True)
    explanation = explain((q, k, v), config=config, platform="cpu")
    assert explanation.guard == (
        f"guard_masked_values: on, not needed: {backend} excludes masked keys exactly under "
        "mask 'causal' and window (3, 0) on cpu; the call runs unguarded")
    assert str(explanation).splitlines()[-1] == explanation.guard
    config.guard_masked_values = False
    unguarded = explain((q, k, v), config=config, platform="cpu")
    assert unguarded.guard is None
    assert "guard_masked_values" not in str(unguarded)


@pytest.mark.parametrize("mask,window,guarded", [
    ("causal", (-1, -1), True), ("no_mask", (4, 0), True), ("no_mask", (-1, -1), False),
])
def test_explain_of_cudnn_follows_its_mask(monkeypatch, request, rng, mask, window, guarded):
    """cuDNN leaks under causal and window masks only (Backend.masked_values_exact)."""
    fake_cudnn_for_cuda_lowering(monkeypatch, request)
    q, k, v = qkv(rng, (B, 64, H, 64), jnp.bfloat16)
    config = make_config(mask=mask, window_size=window, guard_masked_values=True)
    explanation = explain((q, k, v), config=config, platform="cuda")
    assert explanation.backend == "cudnn"
    assert ("so the call is guarded" in explanation.guard) is guarded
    assert ("not needed: cudnn excludes masked keys" in explanation.guard) is not guarded
    assert f"mask {mask!r}" in explanation.guard and "on cuda" in explanation.guard


def test_explain_says_fp8_calls_are_not_guarded(rng):
    q, k, v = qkv(rng)
    config = make_config(mask="causal", guard_masked_values=True, fp8={"enabled": True})
    assert explain((q, k, v), config=config, platform="cpu").guard == (
        "guard_masked_values: on, but this call is not guarded: the guard wraps dense calls "
        "without FP8 only")
    config.guard_masked_values = False
    assert explain((q, k, v), config=config, platform="cpu").guard is None


# --------------------------------------------------------------------------- GPU backends

WINDOW = 8
GPU_CASES = [
    ("flash", "causal", {}), ("flash", "causal_bottom_right", {}),
    ("flash", "no_mask", {"window_size": (WINDOW, 0)}),
    ("cudnn", "causal", {}), ("cudnn", "no_mask", {"window_size": (WINDOW, 0)}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mask,extra", GPU_CASES)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_gpu_backends_exclude_masked_non_finite_values(rng, backend, mask, extra, value):
    b, s, h, d = 2, 200, 4, 64
    q, k, v = qkv(rng, (b, s, h, d), jnp.bfloat16)
    late = 150                                      # rows before it never see key 150
    seen_by = slice(late, late + WINDOW + 1) if "window_size" in extra else slice(late, None)
    bad_v = v.at[:, late].set(value)
    config = make_config(backend=backend, mask=mask, guard_masked_values=True, **extra)
    reference = make_config(backend="xla", mask=mask, **extra)

    def attend(config):
        return lambda q, k, v: fused_attn((q, k, v), config=config)

    out = np.asarray(jax.jit(attend(config))(q, k, bad_v), np.float32)
    want = np.asarray(attend(reference)(q, k, bad_v), np.float32)
    assert np.array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[:, seen_by]).all() and not np.isnan(out[:, :late]).any()
    assert_close(out[:, :late], want[:, :late], tolerance(jnp.bfloat16))
    rows = slice(0, late)
    grads = jax.jit(jax.grad(loss_of_rows(attend(config), rows), argnums=(0, 1, 2)))(q, k, bad_v)
    expected = jax.grad(loss_of_rows(attend(reference), rows), argnums=(0, 1, 2))(q, k, bad_v)
    for name, grad, want in zip("qkv", grads, expected):
        grad = np.asarray(grad, np.float32)
        assert np.isfinite(grad).all(), name
        assert_close(grad, np.asarray(want, np.float32), 4 * tolerance(jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["small_seq", "cudnn", "flash"])
def test_gpu_backends_ignore_non_finite_padding(rng, backend):
    b, s, h, d = 2, 16, 4, 64
    q, k, v = qkv(rng, (b, s, h, d), jnp.bfloat16)
    lengths = np.array([10, 16], np.int32)
    q_lengths = np.array([1, 1], np.int32) if backend == "small_seq" else lengths
    sequence = SequenceDescriptor.from_seqlens(q_lengths, lengths)
    bounds = {"max_seqlen_q": 1, "max_seqlen_kv": s} if backend == "small_seq" else {}
    bad_k, bad_v = k.at[0, 10:].set(jnp.nan), v.at[0, 10:].set(jnp.inf)

    def run(name):
        config = make_config(backend=name, mask="padding", sequence=bounds,
                             guard_masked_values=True)
        return np.asarray(fused_attn((q, bad_k, bad_v), config=config, sequence=sequence),
                          np.float32)

    out, want = run(backend), run("xla")
    assert not np.isnan(out[0, :q_lengths[0]]).any()
    assert_close(out[0, :q_lengths[0]], want[0, :q_lengths[0]], tolerance(jnp.bfloat16))
