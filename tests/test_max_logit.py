"""fused_attn(..., return_max_logit=True) (fusedattn/ops/max_logit.py) against float64 NumPy:
every mask, bias and ALiBi, GQA, padding and packing, paged caches, several query blocks,
the backends that serve the call on the CPU, and the errors (context parallelism:
tests/test_context_parallel.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config, random_array
from reference import alibi_slopes, describe_tokens, visible_keys
from test_paged import BSHD, THD, Case

from fusedattn.ops import SequenceDescriptor, _library, fused_attn, max_logit

MASKS = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
         "padding_causal_bottom_right")


def reference_max_logit(q, k, *, mask, bias_type="no_bias", bias=None, sequence=None,
                        packed=False, window=(-1, -1)) -> np.ndarray:
    """float64 [h]: the largest visible scale * q.k (+ bias or ALiBi) of each head."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, sq, h, d = q.shape
    skv = k.shape[1]
    tokens = describe_tokens(sequence, b, sq, skv, use_sequence=mask.startswith("padding") or packed,
                             bottom_right=mask.endswith("bottom_right"))
    visible = visible_keys(tokens, causal="causal" in mask, window=window)[:, None]
    qk = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, h // k.shape[2], axis=2))
    scale = 1.0 / math.sqrt(d)
    if bias_type == "pre_scale_bias":
        scores = (qk + np.asarray(bias, np.float64)) * scale
    elif bias_type == "post_scale_bias":
        scores = qk * scale + np.asarray(bias, np.float64)
    elif bias_type == "alibi":
        diagonal = (tokens.q_pos + tokens.q_shift)[:, None, :, None]
        distance = np.abs(tokens.kv_pos[:, None, None, :] - diagonal)
        scores = qk * scale - alibi_slopes(h)[None, :, None, None] * distance
    else:
        scores = qk * scale
    return np.max(np.where(visible, scores, -np.inf), axis=(0, 2, 3))


def _check(actual, expected):
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape and actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def _padding(b: int, sq: int, skv: int, rng):
    q_len = rng.integers(1, sq + 1, size=b)
    kv_len = np.maximum(q_len, rng.integers(1, skv + 1, size=b))
    return SequenceDescriptor.from_seqlens(jnp.asarray(q_len, jnp.int32),
                                           jnp.asarray(kv_len, jnp.int32))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias_type", ["no_bias", "post_scale_bias", "pre_scale_bias", "alibi"])
def test_matches_reference_for_every_mask_and_bias(rng, mask, bias_type):
    b, sq, skv, h, h_kv, d = 2, 24, 32, 4, 2, 16
    q, k, v = (random_array(rng, (b, s, n, d)) for s, n in ((sq, h), (skv, h_kv), (skv, h_kv)))
    sequence = _padding(b, sq, skv, rng) if mask.startswith("padding") else None
    bias = (random_array(rng, (1, h, sq, skv)) if bias_type in ("post_scale_bias",
                                                                  "pre_scale_bias") else None)
    config = make_config(mask=mask, bias=bias_type, backend="xla")
    def both(q, k, v, bias, sequence):
        kwargs = dict(config=config, bias=bias, sequence=sequence)
        return (*fused_attn((q, k, v), return_max_logit=True, **kwargs),
                fused_attn((q, k, v), **kwargs))

    out, largest, plain = jax.jit(both)(q, k, v, bias, sequence)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    _check(largest, reference_max_logit(q, k, mask=mask, bias_type=bias_type, bias=bias,
                                        sequence=sequence))


def test_packing_and_window_over_several_query_blocks(rng, monkeypatch):
    b, t, h, d = 2, 37, 2, 8
    ids = np.sort(rng.integers(0, 4, size=(b, t)), axis=1)  # 0 = padding at the front
    sequence = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray(ids, jnp.int32),
                                                           jnp.asarray(ids, jnp.int32))
    q, k, v = (random_array(rng, (b, t, h, d)) for _ in range(3))
    config = make_config(qkv_layout="thd_thd_thd", mask="padding_causal", window_size=(5, 0),
                         sequence={"max_segments_per_seq": 4}, backend="xla")
    # 2 * 2 * 8 * 37 scores per block: 8 queries a block, 5 blocks, the last one padded.
    monkeypatch.setattr(max_logit, "QUERY_BLOCK_ELEMENTS", 2 * 2 * 8 * 37)
    _, largest = fused_attn((q, k, v), config=config, sequence=sequence, return_max_logit=True)
    _check(largest, reference_max_logit(q, k, mask="padding_causal", sequence=sequence,
                                        packed=True, window=(5, 0)))


@pytest.mark.parametrize("backend", ["xla", "flash"])
def test_each_cpu_backend_reports_the_same_max_logit(rng, backend):
    if backend == "flash" and _library.available("cpu") is not None:
        pytest.skip(f"host op library unavailable: {_library.available('cpu')}")
    q, k, v = (random_array(rng, (2, 40, 4, 32), jnp.bfloat16) for _ in range(3))
    config = make_config(mask="causal", backend=backend)
    out, largest = fused_attn((q, k, v), config=config, return_max_logit=True)
    assert out.shape == q.shape
    _check(largest, reference_max_logit(q, k, mask="causal"))


@pytest.mark.parametrize("layout", [BSHD, THD])
def test_paged_caches(rng, layout):
    case = Case(rng, layout=layout, m=2 if layout == THD else 1, sq=8 if layout == THD else 4)
    config = case.config(mask="padding_causal_bottom_right", backend="xla")
    out, largest = case.run(config, return_max_logit=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(case.run(config)))
    q, k = np.asarray(case.q, np.float64), np.asarray(case.k, np.float64)
    table, page_size = np.asarray(case.table), k.shape[1]
    expected = np.full(q.shape[2], -np.inf)
    for s in range(case.b * case.m):
        q_len, kv_len, start = case.q_len[s], case.kv_len[s], case.q_start[s]
        if q_len <= 0 or kv_len <= 0:
            continue
        keys = k[[table[s, j // page_size] for j in range(kv_len)], [j % page_size
                                                                     for j in range(kv_len)]]
        row = s // case.m
        expected = np.maximum(expected, reference_max_logit(
            q[row:row + 1, start:start + q_len], keys[None], mask="causal_bottom_right"))
    _check(largest, expected)


def test_max_logit_carries_no_gradient(rng):
    q, k, v = (random_array(rng, (1, 16, 2, 8)) for _ in range(3))
    config = make_config(mask="causal")
    grads = jax.grad(lambda q, k: jnp.sum(fused_attn((q, k, v), config=config,
                                                     return_max_logit=True)[1]),
                     argnums=(0, 1))(q, k)
    for g in grads:
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_head_with_nothing_visible_reports_minus_infinity(rng):
    q, k, v = (random_array(rng, (1, 4, 2, 8)) for _ in range(3))
    sequence = SequenceDescriptor.from_seqlens(jnp.asarray([0], jnp.int32),
                                               jnp.asarray([0], jnp.int32))
    config = make_config(mask="padding", backend="xla")
    _, largest = fused_attn((q, k, v), config=config, sequence=sequence, return_max_logit=True)
    assert np.all(np.asarray(largest) == -np.inf)


def test_a_non_bool_flag_raises(rng):
    q, k, v = (random_array(rng, (1, 4, 2, 8)) for _ in range(3))
    with pytest.raises(TypeError, match="return_max_logit: expected True or False"):
        fused_attn((q, k, v), config=make_config(), return_max_logit="yes")
