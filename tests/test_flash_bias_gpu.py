"""Bias arrays in the CUDA flash kernels, marked `gpu`: the kernels the device picks (the
sm_90a forward and backward on compute capability 9.0; bias_tile.cuh), every test both with
the device's kernels and with the sm_80 kernels named (FUSEDATTN_FLASH_KERNEL=sm80, test_flash_gpu's fixture), and each case compares flash with the xla backend (config.bias 'pre_scale_bias':
s = (q.k + bias) * scale, or 'post_scale_bias': s = q.k * scale + bias, the bias
[b|1, h|1, sq, skv]): the output and the gradients of sum(o * do) w.r.t. q, k, v, the softmax
offset and the bias (summed over the bias's shared dims, in a fixed order), with every output
poisoned first. Lengths are off the kernels' tiles (64 queries, 32/64 keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config, poison_like
from test_flash_alibi_host import check, run
from test_flash_bias_host import BIASES, SHAPES, bias_spec, with_bias
from test_flash_gpu import flash_kernel  # noqa: F401  (autouse: the device's forward, then sm80)
from test_flash_host import make_args

from fusedattn.ops import _library, explain
from fusedattn.ops.backends import flash, flash_gpu

pytestmark = pytest.mark.gpu


def checked(rng, spec, args, scale=None):
    """check() (flash against xla, every gradient) on poisoned output buffers."""
    d = args.q.shape[-1]
    if d not in _library.flash_head_dims("cuda"):
        pytest.skip(f"head dim {d} not in this build's FUSEDATTN_FLASH_HEAD_DIMS")
    b, sq, h, _ = args.q.shape
    poison_like(args.q, args.k, args.v, args.bias.astype(jnp.float32),
                jnp.zeros((b, h, sq), jnp.float32))
    return check(rng, spec, args, scale)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_broadcast_shapes_and_head_dims(rng, d, bias, shape):
    """Every broadcast form of the bias (its gradient summed over the shared dims by
    bias_gradient.cu, or written in place when full), GQA (4 heads over 2)."""
    args = make_args(rng, b=2, sq=150, skv=170, h=4, h_kv=2, d=d, dtype=jnp.bfloat16,
                     kind="padding_causal")
    checked(rng, bias_spec(bias, "padding_causal"), with_bias(rng, args, shape))


@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("kind", ["no_mask", "causal", "causal_bottom_right", "padding",
                                  "packed", "packed_bottom_right"])
def test_masks_and_packing(rng, kind, bias):
    """Every mask, and packed segments (which cuDNN refuses with a bias)."""
    args = make_args(rng, b=3, sq=130, skv=197, h=4, h_kv=4, d=128, dtype=jnp.float16, kind=kind)
    checked(rng, bias_spec(bias, kind), with_bias(rng, args, "per_head"))


@pytest.mark.parametrize("window", [(16, 0), (70, 5), (-1, 33)])
def test_windows(rng, window):
    args = make_args(rng, b=2, sq=200, skv=230, h=2, h_kv=1, d=64, dtype=jnp.bfloat16,
                     kind="causal")
    checked(rng, bias_spec("post_scale_bias", "causal", window=window),
            with_bias(rng, args, "shared"))


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_softmax_variants_and_dropout(rng, softmax):
    """The sink, the Philox dropout mask (bit-identical to the xla backend's) and a bias."""
    args = make_args(rng, b=2, sq=97, skv=133, h=4, h_kv=2, d=128, dtype=jnp.bfloat16,
                     kind="packed", softmax=softmax,
                     seed=rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32))
    checked(rng, bias_spec("pre_scale_bias", "packed", softmax, dropout_rate=0.2),
            with_bias(rng, args, "per_row"))


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_bias_of_the_inputs_dtype(rng, bias_dtype):
    """A bias of q's 16-bit dtype is cast to float32 for the kernels; its gradient comes back
    in its own dtype."""
    args = make_args(rng, b=2, sq=70, skv=90, h=4, h_kv=2, d=64, dtype=jnp.bfloat16,
                     kind="causal_bottom_right")
    checked(rng, bias_spec("post_scale_bias", "causal_bottom_right"),
            with_bias(rng, args, "full", bias_dtype))


def test_gradient_is_bitwise_repeatable_and_zero_where_masked(rng):
    """A shared bias's gradient sums every row and head in a fixed order: bitwise the same on
    every run (as o, dK and dV; dQ too where the backward is the sm_80 one: the sm_90a one
    sums dQ with reductions in no fixed order); exactly 0 at the pairs that no query sees
    (skipped tiles included)."""
    args = with_bias(rng, make_args(rng, b=2, sq=300, skv=300, h=4, h_kv=2, d=128,
                                    dtype=jnp.bfloat16, kind="causal"), "shared")
    spec = bias_spec("post_scale_bias", "causal")
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.float32).astype(args.q.dtype)
    first = run(flash.BACKEND, spec, args, 0.1, do)
    again = run(flash.BACKEND, spec, args, 0.1, do)
    sm90 = flash_gpu.cuda_backward_kernel(128, 300, 300, False) == "sm90"
    for name in ("o", "dk", "dv", "d_bias") + (() if sm90 else ("dq",)):
        np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(again[name]), name)
    d_bias = np.asarray(first["d_bias"])[0, 0]
    future = np.triu(np.ones((300, 300), bool), k=1)
    assert np.all(d_bias[future] == 0)
    assert np.count_nonzero(d_bias[~future]) > 0.9 * np.count_nonzero(~future)


def test_explain_names_the_kernels(rng):
    q = jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 4, 300, 300), jnp.float32)
    config = make_config(backend="flash", mask="causal", bias="pre_scale_bias")
    text = str(explain((q, q, q), config=config, bias=bias))
    backward = "sm90 wgmma" if flash_gpu.cuda_backward_kernel(128, 300, 300, False) == "sm90" else "sm80"
    assert f"{backward} backward, the bias array in the kernels" in text or \
        "sm80 mma.sync forward and backward, the bias array in the kernels" in text, text
