"""The Hopper (sm_90a, wgmma) flash forward of ops_cuda/cuda/flash/sm90 on a GPU, marked `gpu`.

On a device of compute capability 9.0 the flash backend's forward runs this kernel (128
queries per block, key tiles of 128, or 64 at head dim 256); its lse feeds the sm_80
backward. Every case first checks that the call is routed to it (explain and the rule of
flash._cuda_forward_kernel), then compares the output, and the gradients that the backward
computes from the kernel's lse, with the float64 reference of tests/test_flash_host.py
(outputs poisoned first), or, through the public op, with the xla backend. Lengths are off
the kernel's tiles: partial query and key tiles, TMA's zero-filled rows past the end,
skipped and fully visible tiles and the masked ones between them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_config, poison_like, tolerance
from test_flash_gpu import check, compare_thd_with_xla
from test_flash_host import make_args, make_spec, reference

from fusedattn.ops import _library, explain
from fusedattn.ops.backends import flash
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
    assert flash._cuda_forward_kernel(d, 1) == "sm90"


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
def test_grouped_query_attention(rng, d, h, h_kv):
    needs_sm90(d)
    args = make_args(rng, b=2, sq=300, skv=257, h=h, h_kv=h_kv, d=d, dtype=jnp.bfloat16,
                     kind="padding_causal")
    check(rng, make_spec("padding_causal"), args)


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
    _, lse = jax.jit(flash._forward_call, static_argnums=0)(
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
    forward = jax.jit(flash._forward_call, static_argnums=0)
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


def test_explain_names_the_kernels(rng):
    needs_sm90(128)
    q = jnp.asarray(rng.standard_normal((1, 256, 2, 128)), jnp.bfloat16)
    text = str(explain((q, q, q), config=make_config(backend="flash")))
    assert "flash: sm90 wgmma forward, sm80 backward" in text
