"""The Hopper (sm_90a, wgmma) flash kernels of ops_cuda/cuda/flash/sm90 on a GPU, marked `gpu`.

On a device of compute capability 9.0 the flash backend's forward runs the sm_90a forward
(128 queries per block, key tiles of 128, or 64 at head dim 256) and, unless
config.deterministic_backward (or ALiBi at head dim 256), the sm_90a backward (128 keys per
block, 64 at head dim 256, query tiles of 64, dQ summed with float32 atomics); its lse feeds
either backward. Every case
first checks that the call is routed to them (explain and the rules of
flash_gpu.cuda_forward_kernel and cuda_backward_kernel), then compares the output and the
gradients with the float64 reference of tests/test_flash_host.py (outputs poisoned first),
or, through the public op, with the xla backend. Lengths are off the kernels' tiles:
partial query and key tiles, TMA's zero-filled rows past the end, skipped and fully
visible tiles and the masked ones between them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_config, poison_like, tolerance
from test_flash_gpu import check, compare_thd_with_xla
from test_flash_host import make_args, make_spec, reference, run_flash

from fusedattn.ops import _library, explain, fused_attn
from fusedattn.ops.backends import flash, flash_ffi, flash_gpu
from fusedattn.ops.backends.base import compute_capability

pytestmark = pytest.mark.gpu

DTYPES = (jnp.bfloat16, jnp.float16)


def needs_sm90(d: int) -> None:
    """Skips unless the sm_90a forward serves head dim d here."""
    if compute_capability() != (9, 0):
        pytest.skip(f"the sm_90a kernel runs on compute capability 9.0, not "
                    f"{compute_capability()}")
    if d not in _library.flash_sm90_head_dims("cuda"):
        pytest.skip(f"no sm_90a flash forward for head dim {d} in this build")
    assert flash_gpu.cuda_forward_kernel(d, 1) == "sm90"


def needs_sm90_backward(d: int) -> None:
    """Skips unless the sm_90a forward and backward both serve head dim d here."""
    needs_sm90(d)
    if d not in _library.flash_sm90_backward_head_dims("cuda"):
        pytest.skip(f"no sm_90a flash backward for head dim {d} in this build")
    assert flash_gpu.cuda_backward_kernel(d, 1, 1, False) == "sm90"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["causal", "causal_bottom_right"])
@pytest.mark.parametrize("sq,skv", [(1, 1), (127, 129), (129, 127), (200, 333), (384, 130)])
def test_lengths_off_the_tiles_both_corners(rng, kind, dtype, d, sq, skv):
    needs_sm90(d)
    args = make_args(rng, b=2, sq=sq, skv=skv, h=2, h_kv=1, d=d, dtype=dtype, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["padding", "padding_causal_bottom_right", "packed",
                                  "packed_bottom_right", "no_mask"])
def test_padding_and_packing(rng, kind, d):
    needs_sm90(d)
    args = make_args(rng, b=3, sq=261, skv=300, h=4, h_kv=2, d=d, dtype=jnp.bfloat16, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("window", [(0, 0), (100, 0), (130, 7), (-1, 200), (5, -1)])
@pytest.mark.parametrize("kind", ["no_mask", "causal", "causal_bottom_right"])
def test_sliding_windows(rng, window, kind):
    needs_sm90(128)
    args = make_args(rng, b=2, sq=517, skv=450, h=2, h_kv=2, d=128, dtype=jnp.float16, kind=kind)
    check(rng, make_spec(kind, window=window), args)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("h,h_kv", [(8, 1), (6, 2), (4, 4)])
@pytest.mark.parametrize("kind,dtype", [("padding_causal", jnp.bfloat16),
                                        ("padding_causal_bottom_right", jnp.float16)])
def test_grouped_query_attention(rng, d, h, h_kv, kind, dtype):
    """GQA and MQA: a forward block reads its group's K/V head; a backward block (sm_90a at
    these head dims) streams the query tiles of every head of its group, dK and dV summing them."""
    needs_sm90(d)
    args = make_args(rng, b=2, sq=300, skv=257, h=h, h_kv=h_kv, d=d, dtype=dtype, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_softmax_variants_and_dropout(rng, softmax):
    """The sink folds in at the end; dropout masks from the shared Philox, bit for bit."""
    needs_sm90(128)
    args = make_args(rng, b=2, sq=250, skv=333, h=4, h_kv=2, d=128, dtype=jnp.bfloat16,
                     kind="packed", softmax=softmax,
                     seed=rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32))
    check(rng, make_spec("packed", softmax, dropout_rate=0.2), args)


@pytest.mark.parametrize("softmax", ["vanilla", "learnable"])
@pytest.mark.parametrize("kind", ["padding_causal_bottom_right", "packed"])
def test_lse_for_the_backward_equals_the_reference(rng, softmax, kind):
    """The log-sum-exp the forward saves (+inf for a row with no visible key), directly."""
    needs_sm90(128)
    args = make_args(rng, b=3, sq=200, skv=300, h=4, h_kv=2, d=128, dtype=jnp.bfloat16, kind=kind,
                     softmax=softmax)
    spec = make_spec(kind, softmax)
    scale = 0.125
    offset = (args.softmax_offset if args.softmax_offset is not None
              else jnp.zeros((4,), jnp.float32))
    poison_like(args.q, jnp.zeros((3, 4, 200), jnp.float32))
    _, lse = jax.jit(flash_ffi.forward_call, static_argnums=0)(
        flash._static(spec, scale, spec.softmax, False), args.q, args.k, args.v, offset,
        jnp.zeros((2,), jnp.uint32), tuple(args.tokens))
    lse = np.asarray(lse, np.float64)
    want = reference(args, spec, scale, jnp.zeros(args.q.shape, args.q.dtype))["lse"]
    empty = np.isinf(want)
    assert empty.any() and (~empty).any()
    assert np.array_equal(np.isposinf(lse), empty)
    assert_close(lse[~empty], want[~empty], 1e-4, "lse")


@pytest.mark.parametrize("kind", ["padding", "packed_bottom_right"])
def test_garbage_in_padding_keys_reaches_no_output(rng, kind):
    """NaN and Inf in the keys and values of padding tokens (segment id 0): the forward's
    output and lse equal those of zeros there (padding V rows are zeroed in shared memory,
    K's garbage is masked by selection)."""
    needs_sm90(128)
    args = make_args(rng, b=3, sq=190, skv=333, h=4, h_kv=2, d=128, dtype=jnp.bfloat16, kind=kind)
    padding = (np.asarray(args.tokens.kv_seg) == 0)[:, :, None, None]
    assert padding.any()
    garbage = np.where(rng.random(args.k.shape) < 0.5, np.nan, np.inf)
    clean = args._replace(k=jnp.where(padding, 0, args.k), v=jnp.where(padding, 0, args.v))
    dirty = args._replace(k=jnp.where(padding, garbage, args.k).astype(args.k.dtype),
                          v=jnp.where(padding, -garbage, args.v).astype(args.v.dtype))
    spec = make_spec(kind)
    forward = jax.jit(flash_ffi.forward_call, static_argnums=0)
    results = []
    for case in (clean, dirty):
        poison_like(case.q, jnp.zeros((3, 4, 190), jnp.float32))
        results.append(forward(flash._static(spec, 0.1, spec.softmax, False), case.q, case.k,
                               case.v, jnp.zeros((4,), jnp.float32), jnp.zeros((2,), jnp.uint32),
                               tuple(case.tokens)))
    (o_clean, lse_clean), (o_dirty, lse_dirty) = results
    assert np.array_equal(np.asarray(o_clean), np.asarray(o_dirty))
    assert np.array_equal(np.asarray(lse_clean), np.asarray(lse_dirty))
    want = reference(clean, spec, 0.1, jnp.zeros(args.q.shape, args.q.dtype))
    assert_close(o_dirty, want["o"], tolerance(jnp.bfloat16), "o")


def test_long_causal_pipeline(rng):
    """4096 keys: many stages of the two-stage ring, skipped tiles above the diagonal."""
    needs_sm90(128)
    args = make_args(rng, b=1, sq=4096, skv=4096, h=2, h_kv=1, d=128, dtype=jnp.bfloat16,
                     kind="causal")
    check(rng, make_spec("causal"), args)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kind", ["no_mask", "causal"])
def test_many_items_per_block(rng, d, kind):
    """256 work items (more than the SMs): each persistent block runs several, its Q
    stages (one at head dim 256) taken again by later items."""
    needs_sm90(d)
    args = make_args(rng, b=2, sq=256, skv=300, h=64, h_kv=8, d=d, dtype=jnp.bfloat16, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["padding_causal", "padding_causal_bottom_right", "padding"])
def test_thd_through_fused_attn_matches_xla(rng, d, mask):
    """Packed THD rows (lengths + offsets) whose segments straddle the 128-token tiles."""
    needs_sm90(d)
    lengths_offsets = ([[130, 0, 150, -1], [10, 120, 5, 140]],
                       [[140, 8, 260, -1], [10, 0, 200, 190]],
                       [[0, 130, 130, 280, -1], [0, 10, 130, 135, 275]],
                       [[4, 144, 152, 412, -1], [0, 10, 10, 210, 400]])
    explanation = compare_thd_with_xla(rng, lengths_offsets, t_q=300, t_kv=420, h=4, h_kv=2, d=d,
                                       mask=mask, window=(200, -1))
    assert "sm90 wgmma forward" in str(explanation)
    if d in _library.flash_sm90_backward_head_dims("cuda"):
        assert "sm90 wgmma backward" in str(explanation)


def test_explain_names_the_kernels(rng):
    needs_sm90_backward(128)
    q = jnp.asarray(rng.standard_normal((1, 256, 2, 128)), jnp.bfloat16)
    text = str(explain((q, q, q), config=make_config(backend="flash")))
    assert "flash: sm90 wgmma forward, sm90 wgmma backward" in text
    text = str(explain((q, q, q), config=make_config(backend="flash", deterministic_backward=True)))
    assert "flash: sm90 wgmma forward, sm80 backward (deterministic_backward)" in text


# ---- the sm_90a backward -------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["no_mask", "causal", "causal_bottom_right", "padding",
                                  "padding_causal", "packed", "packed_bottom_right"])
def test_backward_masks_dtypes_head_dims(rng, kind, dtype, d):
    """Gradients (q, k, v) against the float64 reference; 193 queries and 261 keys: a partial
    block of keys, a partial query tile, tiles skipped, fully visible and masked."""
    needs_sm90_backward(d)
    args = make_args(rng, b=2, sq=193, skv=261, h=4, h_kv=2, d=d, dtype=dtype, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("sq,skv", [(1, 1), (1, 300), (300, 1), (63, 129), (65, 127), (79, 200), (81, 161),
                                     (640, 384)])
@pytest.mark.parametrize("d", [128, 256])
def test_backward_lengths_off_the_tiles(rng, sq, skv, d):
    needs_sm90_backward(d)
    kind = "causal_bottom_right" if sq <= skv else "causal"
    args = make_args(rng, b=2, sq=sq, skv=skv, h=2, h_kv=1, d=d, dtype=jnp.bfloat16, kind=kind)
    check(rng, make_spec(kind), args)


@pytest.mark.parametrize("window", [(0, 0), (100, 0), (130, 7), (-1, 200), (5, -1)])
@pytest.mark.parametrize("kind", ["no_mask", "causal_bottom_right"])
@pytest.mark.parametrize("d", [128, 256])
def test_backward_sliding_windows(rng, window, kind, d):
    needs_sm90_backward(d)
    args = make_args(rng, b=2, sq=517, skv=450, h=2, h_kv=1, d=d, dtype=jnp.bfloat16, kind=kind)
    check(rng, make_spec(kind, window=window), args)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
@pytest.mark.parametrize("dropout_rate", [0.0, 0.2])
def test_backward_softmax_variants_and_dropout(rng, d, softmax, dropout_rate):
    """The sink's gradient (learnable) and dropout masks from the shared Philox, element by
    element in dK/dV and dQ: any mismatch with the reference's mask fails the comparison."""
    needs_sm90_backward(d)
    args = make_args(rng, b=2, sq=250, skv=333, h=4, h_kv=2, d=d, dtype=jnp.bfloat16,
                     kind="packed", softmax=softmax,
                     seed=rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32))
    check(rng, make_spec("packed", softmax, dropout_rate=dropout_rate), args)


@pytest.mark.parametrize("kind", ["padding_causal_bottom_right", "packed"])
@pytest.mark.parametrize("d", [128, 256])
def test_backward_rows_without_visible_keys(rng, kind, d):
    """Queries that see no key (lse = +inf): output and dQ exactly 0, every gradient finite."""
    needs_sm90_backward(d)
    args = make_args(rng, b=3, sq=300, skv=140, h=4, h_kv=2, d=d, dtype=jnp.bfloat16, kind=kind)
    got = check(rng, make_spec(kind), args)
    assert reference(args, make_spec(kind), 1.0 / np.sqrt(d),
                     jnp.zeros(args.q.shape, args.q.dtype))["empty"].any()
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(np.asarray(got[name], np.float32)).all(), name


@pytest.mark.parametrize("kind", ["padding", "packed_bottom_right"])
@pytest.mark.parametrize("d", [128, 256])
def test_backward_garbage_in_padding_tokens_reaches_no_gradient(rng, kind, d):
    """NaN and Inf in q, k, v and dO at padding tokens (segment id 0): every gradient equals
    that of zeros there (the sm_90a backward zeroes those rows in shared memory)."""
    needs_sm90_backward(d)
    args = make_args(rng, b=3, sq=190, skv=333, h=4, h_kv=2, d=d, dtype=jnp.bfloat16, kind=kind)
    q_pad = (np.asarray(args.tokens.q_seg) == 0)[:, :, None, None]
    kv_pad = (np.asarray(args.tokens.kv_seg) == 0)[:, :, None, None]
    assert q_pad.any() and kv_pad.any()
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.float32).astype(args.q.dtype)
    garbage_q = np.where(rng.random(args.q.shape) < 0.5, np.nan, np.inf)
    garbage_kv = np.where(rng.random(args.k.shape) < 0.5, np.nan, -np.inf)
    clean = args._replace(q=jnp.where(q_pad, 0, args.q), k=jnp.where(kv_pad, 0, args.k),
                          v=jnp.where(kv_pad, 0, args.v))
    dirty = args._replace(q=jnp.where(q_pad, garbage_q, args.q).astype(args.q.dtype),
                          k=jnp.where(kv_pad, garbage_kv, args.k).astype(args.k.dtype),
                          v=jnp.where(kv_pad, -garbage_kv, args.v).astype(args.v.dtype))
    # dO at padding queries: the forward's output there is 0 and dO meets it only in delta.
    clean_do = jnp.where(q_pad, 0, do).astype(do.dtype)
    dirty_do = jnp.where(q_pad, garbage_q, do).astype(do.dtype)
    spec = make_spec(kind)
    got_clean = run_flash(spec, clean, 0.1, clean_do)
    got_dirty = run_flash(spec, dirty, 0.1, dirty_do)
    for name in ("dq", "dk", "dv"):
        dirty_grad = np.asarray(got_dirty[name], np.float32)
        padding = q_pad if name == "dq" else kv_pad
        real = np.broadcast_to(~padding, dirty_grad.shape)
        assert np.isfinite(dirty_grad[real]).all(), name
        assert_close(dirty_grad[real], np.asarray(got_clean[name], np.float32)[real],
                     tolerance(jnp.bfloat16), name)
    want = reference(clean, spec, 0.1, clean_do)
    assert_close(got_dirty["dk"], want["dk"], tolerance(jnp.bfloat16), "dk")


@pytest.mark.parametrize("d", [128, 256])
def test_backward_long_causal(rng, d):
    """4096 queries and keys: many query tiles through the two-stage ring, blocks of keys
    that see few of them (the last) and many (the first)."""
    needs_sm90_backward(d)
    args = make_args(rng, b=1, sq=4096, skv=4096, h=4, h_kv=2, d=d, dtype=jnp.bfloat16,
                     kind="causal")
    check(rng, make_spec("causal"), args)


def test_deterministic_backward_is_the_sm80_one_and_bitwise_repeatable(rng):
    """config.deterministic_backward: the sm_80 kernels (no atomics), the same bits twice; the
    default (sm_90a, atomics) agrees with them within rounding."""
    needs_sm90_backward(128)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 333, 4, 128)), jnp.bfloat16) for _ in range(3))

    def grads(config):
        def loss(q, k, v):
            return jnp.sum(fused_attn((q, k, v), config=config).astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)

    repeatable = make_config(backend="flash", mask="causal", deterministic_backward=True)
    assert "sm80 backward (deterministic_backward)" in str(explain((q, k, v), config=repeatable))
    first, second = grads(repeatable), grads(repeatable)
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    fast = grads(make_config(backend="flash", mask="causal"))
    for name, a, b in zip(("dq", "dk", "dv"), fast, first):
        assert_close(a, b, tolerance(jnp.bfloat16), name)
