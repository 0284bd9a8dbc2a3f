"""ALiBi in the "flash" backend's CUDA kernels on a GPU, marked `gpu`, against the xla backend.

The cases of tests/test_flash_alibi_host.py (its `check`: output and the gradients of q, k,
v and the softmax offset, flash against xla on the same CanonicalArgs; the given slopes'
gradient against the float64 reference with the kernels' rowsum(dO * O)) at
shapes off the GPU kernels' tiles (64/128 queries, 32/64/128 keys), so that partial,
skipped and fully visible tiles all meet the term, with outputs poisoned before every call.
Every test runs with the kernels the device picks and with the sm_80 kernels named
(FUSEDATTN_FLASH_KERNEL=sm80; the `flash_kernel` fixture of tests/test_flash_gpu.py), so on
an H200 both the sm_90a kernels and the portable sm_80 text add the term and sum the
slopes' gradient.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config, poison_like
from test_flash_alibi_host import alibi_spec, run, with_slopes
from test_flash_alibi_host import check as check_with_xla
from test_flash_gpu import (DTYPES, HEAD_DIMS, _built, compare_thd_with_xla,  # noqa: F401
                            flash_kernel)  # flash_kernel: the autouse fixture
from test_flash_host import MASKS, make_args

from fusedattn.ops import explain
from fusedattn.ops.backends import flash

pytestmark = pytest.mark.gpu


def check(rng, spec, args):
    """flash against xla, on poisoned buffers."""
    d = args.q.shape[-1]
    if not _built(d):
        pytest.skip(f"head dim {d} not in this build's FUSEDATTN_FLASH_HEAD_DIMS")
    b, sq, h, _ = args.q.shape
    poison_like(args.q, args.k, args.v, args.q, jnp.zeros((b, h, sq), jnp.float32),
                jnp.zeros((b, h), jnp.float32))
    return check_with_xla(rng, spec, args, slopes_reference=True)


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS + ("packed", "packed_bottom_right"))
def test_masks_and_dtypes(rng, kind, dtype, given):
    args = make_args(rng, b=2, sq=150, skv=170, h=4, h_kv=2, d=128, dtype=dtype, kind=kind)
    check(rng, alibi_spec(kind), with_slopes(rng, args, given))


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("kind", ["causal", "packed_bottom_right"])
def test_head_dims(rng, kind, d):
    args = make_args(rng, b=2, sq=140, skv=200, h=4, h_kv=4, d=d, dtype=jnp.bfloat16, kind=kind)
    check(rng, alibi_spec(kind), with_slopes(rng, args, True))


@pytest.mark.parametrize("window", [(16, 0), (70, 5), (-1, 33)])
@pytest.mark.parametrize("kind", ["no_mask", "causal", "padding_causal_bottom_right", "packed"])
def test_windows(rng, window, kind):
    args = make_args(rng, b=2, sq=200, skv=230, h=2, h_kv=1, d=128, dtype=jnp.float16, kind=kind)
    check(rng, alibi_spec(kind, window=window), with_slopes(rng, args, True))


@pytest.mark.parametrize("h,h_kv", [(8, 1), (6, 2), (4, 4)])
def test_grouped_query_attention(rng, h, h_kv):
    """A slope per query head (six heads: the default slopes' non-power-of-two branch)."""
    args = make_args(rng, b=2, sq=130, skv=190, h=h, h_kv=h_kv, d=64, dtype=jnp.bfloat16,
                     kind="padding_causal")
    check(rng, alibi_spec("padding_causal"), args)
    check(rng, alibi_spec("padding_causal"), with_slopes(rng, args, True))


@pytest.mark.parametrize("sq,skv", [(1, 300), (300, 1), (65, 129), (513, 257)])
def test_lengths_off_the_tiles(rng, sq, skv):
    kind = "causal_bottom_right" if sq <= skv else "causal"
    args = make_args(rng, b=2, sq=sq, skv=skv, h=2, h_kv=2, d=128, dtype=jnp.bfloat16, kind=kind)
    check(rng, alibi_spec(kind), with_slopes(rng, args, True))


def test_long_distances(rng):
    """1024 tokens: many key tiles and key blocks per head (the slope gradient's slots), and
    a term that dominates the scores far from the diagonal."""
    args = make_args(rng, b=1, sq=1024, skv=1024, h=4, h_kv=2, d=128, dtype=jnp.bfloat16,
                     kind="no_mask")
    check(rng, alibi_spec("no_mask"), args)


@pytest.mark.parametrize("mask,window", [("padding_causal", (-1, -1)), ("padding", (20, 20)),
                                         ("padding_causal_bottom_right", (-1, -1))])
def test_thd_offsets_through_fused_attn(rng, mask, window):
    """The public op on a packed THD call (lengths + offsets) with given slopes: flash's
    output and gradients (the slopes' included) equal the xla backend's, and explain says
    the kernels add the term."""
    lengths_offsets = ([[30, 0, 50, -1], [10, 20, 5, 40]], [[40, 8, 60, -1], [10, 0, 40, 70]],
                       [[0, 30, 30, 80, -1], [0, 10, 30, 35, 75]],
                       [[4, 44, 52, 112, -1], [0, 10, 10, 50, 120]])
    slopes = jnp.asarray(rng.uniform(-0.3, 1.2, 4), jnp.float32)
    explanation = compare_thd_with_xla(rng, lengths_offsets, t_q=96, t_kv=128, h=4, h_kv=2,
                                       d=128, mask=mask, window=window, slopes=slopes)
    assert explanation.backend == "flash"
    assert "ALiBi in the kernels" in explanation.kernels["flash"]


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_softmax_variants(rng, softmax):
    args = make_args(rng, b=2, sq=100, skv=140, h=4, h_kv=2, d=64, dtype=jnp.bfloat16,
                     kind="packed_bottom_right", softmax=softmax)
    check(rng, alibi_spec("packed_bottom_right", softmax), with_slopes(rng, args, True))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout(rng, d):
    """Dropout and ALiBi together (the same Philox mask in both backends)."""
    args = make_args(rng, b=2, sq=97, skv=133, h=4, h_kv=2, d=d, dtype=jnp.bfloat16,
                     kind="padding_causal", seed=np.array([7, 2**32 - 5], np.uint32))
    check(rng, alibi_spec("padding_causal", dropout_rate=0.3), with_slopes(rng, args, True))


def test_deterministic_backward_is_bitwise_repeatable(rng):
    """config.deterministic_backward: every gradient, the slopes' included, the same bits
    twice. Without it the slopes' gradient is still repeatable (per-warp slots summed in a
    fixed order), though dQ of the sm_90a backward is not."""
    args = with_slopes(rng, make_args(rng, b=2, sq=300, skv=300, h=8, h_kv=2, d=128,
                                      dtype=jnp.bfloat16, kind="packed"), True)
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.bfloat16)
    spec = alibi_spec("packed")
    repeatable = dataclasses.replace(spec, deterministic_backward=True)
    first, second = (run(flash.BACKEND, repeatable, args, 0.1, do) for _ in range(2))
    for name in ("o", "dq", "dk", "dv", "d_bias"):
        assert np.array_equal(np.asarray(first[name]), np.asarray(second[name])), name
    default = [run(flash.BACKEND, spec, args, 0.1, do)["d_bias"] for _ in range(2)]
    assert np.array_equal(np.asarray(default[0]), np.asarray(default[1]))
    assert np.all(np.isfinite(np.asarray(first["d_bias"])))
    assert np.all(np.asarray(first["d_bias"]) != 0)


def test_explain_says_the_kernels_serve_alibi(rng, flash_kernel):  # noqa: F811 (the fixture)
    """Named flash serves ALiBi on the GPU, and the kernels are those the fixture asks for
    (with sm80: the portable kernels in both passes, on an H200 too)."""
    q = jnp.asarray(rng.standard_normal((2, 256, 4, 128)), jnp.bfloat16)
    config = make_config(backend="flash", mask="causal", bias="alibi", window_size=(64, 0))
    explanation = explain((q, q, q), config=config)
    assert explanation.backend == "flash"
    text = explanation.kernels["flash"]
    assert "ALiBi in the kernels" in text, text
    if flash_kernel == "sm80":
        assert text.startswith("flash: sm80 mma.sync forward and backward"), text
