"""The "flash" backend's CUDA kernels (ops_cuda/cuda/flash) on a GPU, marked `gpu`.

Each case runs the kernels forward and backward under jit and compares the output and
the gradients (q, k, v, softmax_offset) with the float64 NumPy reference of
tests/test_flash_host.py (the canonical semantics: the mask predicate over the token
vectors, the softmax sink, Philox dropout from the jnp definition, so dropout masks must
match bit for bit to pass), with outputs poisoned before every call. Shapes are chosen
off the kernels' tile sizes (64 queries, 32/64 keys) so that partial tiles, skipped
tiles and the span summaries' edges are all exercised.

Every test runs twice: with the kernels the device picks ("device": on an H100/H200 the
sm_90a forward where built) and with the sm_80 (mma.sync) kernels named through
FUSEDATTN_FLASH_KERNEL=sm80 ("sm80"), so that the whole matrix covers the portable
kernels' NVIDIA text on a Hopper GPU too (on older GPUs "sm80" is what "device" runs, and
skips).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_config, poison_like, tolerance
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_flash_host import MASKS, make_args, make_spec, reference, run_flash

from fusedattn.ops import SequenceDescriptor, _library, explain, fused_attn
from fusedattn.ops.backends import flash, flash_gpu
from fusedattn.ops.backends.base import CallShapes

pytestmark = pytest.mark.gpu

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128, 256)


@pytest.fixture(autouse=True, params=["device", "sm80"])
def flash_kernel(request, monkeypatch):
    """The kernels a test runs: those the device picks, or the sm_80 ones named."""
    if request.param == "device":
        monkeypatch.delenv(flash_gpu.KERNEL_VARIABLE, raising=False)
    elif (flash_gpu.compute_capability() != (9, 0)
          or not flash_gpu._library.flash_sm90_head_dims("cuda")):
        pytest.skip("this device and build run the sm_80 kernels already")
    else:
        monkeypatch.setenv(flash_gpu.KERNEL_VARIABLE, "sm80")
    return request.param


def _built(d: int) -> bool:
    return d in _library.flash_head_dims("cuda")


def check(rng, spec, args, *, scale=None):
    """Runs the kernels on poisoned buffers and compares everything with the reference."""
    d = args.q.shape[-1]
    if not _built(d):
        pytest.skip(f"head dim {d} not in this build's FUSEDATTN_FLASH_HEAD_DIMS")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    b, sq, h, _ = args.q.shape
    do = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.float32).astype(args.q.dtype)
    poison_like(args.q, args.k, args.v, args.q, jnp.zeros((b, h, sq), jnp.float32))
    got = run_flash(spec, args, scale, do)
    want = reference(args, spec, scale, do)
    tol = tolerance(args.q.dtype)
    for name in ("o", "dq", "dk", "dv"):
        assert got[name].dtype == args.q.dtype, name
        assert_close(got[name], want[name], tol, name)
    empty = want["empty"]
    assert np.all(np.asarray(got["o"], np.float64)[empty] == 0.0)
    assert np.all(np.asarray(got["dq"], np.float64)[empty] == 0.0)
    if want["d_offset"] is not None:
        assert_close(got["d_offset"], want["d_offset"], tol, "d_offset")
    return got


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS + ("packed", "packed_bottom_right"))
def test_masks_dtypes_head_dims(rng, kind, dtype, d):
    args = make_args(rng, b=3, sq=150, skv=170, h=4, h_kv=2, d=d, dtype=dtype, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("sq,skv", [(1, 1), (1, 300), (300, 1), (64, 64), (65, 129), (513, 257)])
def test_lengths_off_the_tiles(rng, sq, skv):
    kind = "causal_bottom_right" if sq <= skv else "causal"
    args = make_args(rng, b=2, sq=sq, skv=skv, h=2, h_kv=2, d=128, dtype=jnp.bfloat16, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
@pytest.mark.parametrize("kind", ["causal", "padding", "packed"])
def test_softmax_variants(rng, softmax, kind):
    args = make_args(rng, b=2, sq=100, skv=140, h=4, h_kv=4, d=64, dtype=jnp.bfloat16, kind=kind,
                     softmax=softmax)
    check(rng, make_spec(kind, softmax), args)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["no_mask", "causal", "padding_causal"])
@pytest.mark.parametrize("steep", [False, True])
def test_running_max_rising_over_the_keys(rng, steep, kind, dtype, d):
    """Key norms grow along the sequence, so each row's maximum rises from tile to tile:
    gently (it stays within the kernels' stale-max margin of 8 ln 2 for several tiles, and
    weights up to 2^8 are accumulated against the old max) or steeply (it moves by more at
    every tile, and O is rescaled). Random inputs alone move it only at the first tile."""
    args = make_args(rng, b=2, sq=300, skv=1000, h=2, h_kv=1, d=d, dtype=dtype, kind=kind)
    growth = 1.0 + 3.0 * np.arange(1000) / 1000
    k = (np.asarray(args.k, np.float32) * growth[None, :, None, None]).astype(args.k.dtype)
    args = args._replace(k=jnp.asarray(k))
    check(rng, make_spec(kind), args, scale=(6.0 if steep else 1.0) / math.sqrt(d))


@pytest.mark.parametrize("window", [(0, 0), (16, 0), (70, 5), (-1, 33), (3, -1)])
@pytest.mark.parametrize("kind", ["no_mask", "causal", "packed_bottom_right"])
def test_windows(rng, window, kind):
    args = make_args(rng, b=2, sq=200, skv=230, h=2, h_kv=1, d=128, dtype=jnp.float16, kind=kind)
    check(rng, make_spec(kind, window=window), args)


@pytest.mark.parametrize("h,h_kv", [(8, 1), (8, 2), (6, 3), (4, 4)])
def test_grouped_query_attention(rng, h, h_kv):
    args = make_args(rng, b=2, sq=130, skv=190, h=h, h_kv=h_kv, d=128, dtype=jnp.bfloat16,
                     kind="padding_causal")
    check(rng, make_spec("padding_causal"), args)


@pytest.mark.parametrize("rate", [0.3, 0.7])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("kind,window", [("causal", (-1, -1)), ("packed", (-1, -1)),
                                         ("no_mask", (40, 7))])
def test_dropout_masks_match_the_shared_philox(rng, d, kind, window, rate):
    """The reference draws its mask with the jnp Philox; a single differing key fails. A rate
    above 0.5 puts the 16-bit threshold's top bit on (kept_top_bits' other case)."""
    args = make_args(rng, b=2, sq=97, skv=133, h=4, h_kv=2, d=d, dtype=jnp.bfloat16, kind=kind,
                     seed=rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32),
                     softmax="learnable")
    check(rng, make_spec(kind, "learnable", window, dropout_rate=rate), args)


def test_backward_is_bitwise_deterministic_on_request(rng):
    """config.deterministic_backward: the sm_80 backward (no atomics) on every device, the
    same bits twice. Without it an sm_90 device runs the sm_90a backward, whose dQ sums with
    atomics: equal within rounding, not bitwise."""
    args = make_args(rng, b=2, sq=300, skv=300, h=8, h_kv=2, d=128, dtype=jnp.bfloat16,
                     kind="packed", seed=np.array([7, 11], np.uint32))
    spec = make_spec("packed", dropout_rate=0.1)
    repeatable = dataclasses.replace(spec, deterministic_backward=True)
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.bfloat16)
    first = run_flash(repeatable, args, 0.1, do)
    second = run_flash(repeatable, args, 0.1, do)
    for name in ("o", "dq", "dk", "dv"):
        assert np.array_equal(np.asarray(first[name]), np.asarray(second[name])), name
    default = run_flash(spec, args, 0.1, do)
    for name in ("o", "dq", "dk", "dv"):
        assert_close(default[name], first[name], tolerance(jnp.bfloat16), name)


def test_long_causal_skips_tiles_exactly(rng):
    """2048 tokens: most key tiles of early query tiles are skipped, the diagonal ones masked."""
    args = make_args(rng, b=1, sq=2048, skv=2048, h=2, h_kv=1, d=128, dtype=jnp.bfloat16,
                     kind="causal")
    check(rng, make_spec("causal"), args)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_shapes(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    kind = data.draw(st.sampled_from(MASKS + ("packed", "packed_bottom_right")))
    h_kv = data.draw(st.sampled_from([1, 2]))
    args = make_args(rng, b=data.draw(st.integers(1, 3)), sq=data.draw(st.integers(6, 260)),
                     skv=data.draw(st.integers(7, 260)), h=2 * h_kv, h_kv=h_kv,
                     d=data.draw(st.sampled_from(HEAD_DIMS)),
                     dtype=data.draw(st.sampled_from(DTYPES)), kind=kind)
    check(rng, make_spec(kind), args)


def compare_thd_with_xla(rng, lengths_offsets, t_q, t_kv, h, h_kv, d, mask, window=(-1, -1),
                         slopes=None):
    """The public op on a packed THD call (lengths + offsets as in
    SequenceDescriptor.from_seqlens_and_offsets): flash's output and gradients equal the xla
    backend's (each run on poisoned buffers); with `slopes` (float32 [h]) under ALiBi with
    those slopes, their gradient compared too. Returns the flash explanation."""
    q_len, kv_len, q_off, kv_off = (np.array(x, np.int32) for x in lengths_offsets)
    sequence = SequenceDescriptor.from_seqlens_and_offsets(q_len, kv_len, q_off, kv_off)
    sequence_config = {"format": "seqlens_offsets", "max_segments_per_seq": q_len.shape[1]}
    b = q_len.shape[0]
    q = jnp.asarray(rng.standard_normal((b, t_q, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, t_kv, h_kv, d)), jnp.bfloat16) for _ in range(2))
    bias = "no_bias" if slopes is None else "alibi"
    wrt = (0, 1, 2) if slopes is None else (0, 1, 2, 3)
    results = {}
    for backend in ("flash", "xla"):
        config = make_config(backend=backend, qkv_layout="thd_thd_thd", mask=mask,
                             window_size=window, sequence=sequence_config, bias=bias)

        def loss(q, k, v, s, config=config):
            out = fused_attn((q, k, v), config=config, sequence=sequence, bias=s)
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        poison_like(q, q)
        (_, out), grads = jax.jit(jax.value_and_grad(loss, wrt, has_aux=True))(q, k, v, slopes)
        results[backend] = (out,) + tuple(grads)
    for name, got, want in zip(("out", "dq", "dk", "dv", "d_slopes"), results["flash"],
                               results["xla"]):
        assert_close(got, want, tolerance(jnp.bfloat16), name)
    config = make_config(backend="flash", qkv_layout="thd_thd_thd", mask=mask, window_size=window,
                         sequence=sequence_config, bias=bias)
    return explain((q, k, v), config=config, sequence=sequence, bias=slopes)


def test_through_fused_attn_with_thd_offsets_matches_xla(rng):
    """The public op with a packed THD call (lengths + offsets): flash equals the xla backend."""
    lengths_offsets = ([[30, 0, 50, -1], [10, 20, 5, 40]], [[40, 8, 60, -1], [10, 0, 40, 70]],
                       [[0, 30, 30, 80, -1], [0, 10, 30, 35, 75]],
                       [[4, 44, 52, 112, -1], [0, 10, 10, 50, 120]])
    compare_thd_with_xla(rng, lengths_offsets, t_q=96, t_kv=128, h=4, h_kv=4, d=128,
                         mask="padding_causal")


def _shapes(**kw):
    base = dict(batch=2, seqlen_q=128, seqlen_kv=128, num_heads=4, num_kv_heads=4, head_dim_qk=128,
                head_dim_v=128, dtype=jnp.dtype(jnp.bfloat16), bias_shape=None, dropout=False)
    base.update(kw)
    return CallShapes(**base)


def test_supports_on_cuda():
    spec = make_spec("causal")
    assert flash.BACKEND.supports(spec, _shapes(), "cuda") is None
    reason = flash.BACKEND.supports(spec, _shapes(dtype=jnp.dtype(jnp.float32)), "cuda")
    assert "bfloat16 or float16" in reason and "float32" in reason
    reason = flash.BACKEND.supports(spec, _shapes(head_dim_qk=96, head_dim_v=96), "cuda")
    assert "head dim 96" in reason
    reason = flash.BACKEND.supports(spec, _shapes(head_dim_v=64), "cuda")
    assert "v's head dim" in reason


def test_explain_names_flash_on_the_gpu(rng, flash_kernel):
    q = jnp.asarray(rng.standard_normal((2, 128, 4, 128)), jnp.bfloat16)
    config = make_config(backend="flash", mask="causal")
    explanation = explain((q, q, q), config=config)
    assert explanation.backend == "flash"
    if flash_kernel == "sm80":
        assert explanation.kernels["flash"] == (
            "flash: sm80 mma.sync forward and backward (named by FUSEDATTN_FLASH_KERNEL=sm80)")
    config = make_config(backend="flash", mask="causal")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        fused_attn((q.astype(jnp.float32),) * 3, config=config)
