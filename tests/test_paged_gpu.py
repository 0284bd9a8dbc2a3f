"""The "decode" backend's CUDA kernel (ops_cuda/cuda/paged_decode.cu) on a GPU, marked `gpu`.

Every case runs the kernel under jit on buffers poisoned with NaN beforehand and compares
it with the xla backend's paged path on the same inputs: tests/test_paged.py's random
calls (tables drawn with replacement, unused entries -1 or past the pool, NaN in every
pool entry no sequence reads, key lengths off the page multiples). Page sizes 16, 64 and
256; 1 to 8 queries per sequence; GQA 32/8 and MHA; every mask with and without windows;
both layouts; bf16 and fp16 at head dims 64, 128 and 256. Small batches make the kernel
split the keys over several CTAs (flash-decoding), large ones keep one CTA per sequence
and head group; rows outside every sequence must be zero and broken sequences NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, poison_like, tolerance
from test_paged import BSHD, MASKS, THD, Case, _broken_cases, check_bound_variants

from fusedattn.ops import SequenceDescriptor, explain, fused_attn

pytestmark = pytest.mark.gpu

# Pages per sequence for each page size: capacities of 640 to 768 keys.
PAGES = {16: 40, 64: 10, 256: 3}


def check(case: Case, **config):
    """The kernel's output equals the xla backend's (and is written everywhere)."""
    expected = case.run(case.config(backend="xla", **config))
    poison_like(expected)
    out = jax.jit(lambda: case.run(case.config(backend="decode", **config)))()
    assert out.dtype == case.q.dtype
    assert_close(out, expected, tolerance(case.q.dtype), "out")
    return out


@pytest.mark.parametrize("page_size", sorted(PAGES))
@pytest.mark.parametrize("sq", range(1, 9))
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa32_8", "mha8"])
def test_page_sizes_query_counts_heads(rng, page_size, sq, heads):
    h, h_kv = heads
    case = Case(rng, b=3, sq=sq, h=h, h_kv=h_kv, d=128, dv=128, page_size=page_size,
                pages=PAGES[page_size], dtype=jnp.bfloat16)
    check(case, mask="padding_causal_bottom_right")


@pytest.mark.parametrize("sq", [1, 3, 8])
def test_page_size_not_a_power_of_two_and_head_chunks(rng, sq):
    """Pages of 48 keys (the division path of the page index) and MQA 32/1, whose group
    of 32 heads times sq queries exceeds a CTA's 16 query rows (several head chunks per
    K/V head), split over many CTAs at b=2."""
    case = Case(rng, b=2, sq=sq, h=32, h_kv=1, d=128, dv=128, page_size=48, pages=20,
                dtype=jnp.bfloat16)
    check(case, mask="padding_causal_bottom_right")


@pytest.mark.parametrize("layout", [BSHD, THD])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("window", [(-1, -1), (37, 0), (100, 3)])
def test_masks_windows_layouts(rng, layout, mask, window):
    if layout == THD:
        case = Case(rng, THD, b=2, m=3, sq=12, h=8, h_kv=2, d=128, dv=128, page_size=64,
                    pages=6, dtype=jnp.bfloat16)
        bound = {"max_seqlen_q": 3}
    else:
        case = Case(rng, b=3, sq=4, h=8, h_kv=2, d=128, dv=128, page_size=64, pages=6,
                    dtype=jnp.bfloat16)
        bound = {}
    check(case, mask=mask, window_size=window, sequence=bound)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq", [1, 5])
def test_dtypes_head_dims(rng, dtype, d, sq):
    case = Case(rng, b=2, sq=sq, h=16, h_kv=4, d=d, dv=d, page_size=16, pages=24, dtype=dtype)
    check(case, mask="padding_causal_bottom_right")


@pytest.mark.parametrize("split", ["split", "no_split"])
@pytest.mark.parametrize("sq", [1, 4])
def test_splits_on_and_off(rng, split, sq):
    """b * h_kv = 8 CTAs of 4096 keys split over many; 1024 CTAs fill any GPU, no split."""
    if split == "split":
        case = Case(rng, b=1, sq=sq, h=32, h_kv=8, d=128, dv=128, page_size=64, pages=64,
                    dtype=jnp.bfloat16)
    else:
        case = Case(rng, b=128, sq=sq, h=32, h_kv=8, d=128, dv=128, page_size=16, pages=8,
                    dtype=jnp.bfloat16)
    check(case, mask="padding_causal_bottom_right")


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_softmax_variants(rng, softmax):
    case = Case(rng, b=2, sq=3, h=8, h_kv=2, d=64, dv=64, page_size=16, pages=30,
                dtype=jnp.bfloat16)
    offset = jnp.asarray(rng.standard_normal(8), jnp.float32) if softmax == "learnable" else None
    config = dict(mask="padding_causal_bottom_right", softmax=softmax)
    outs = [case.run(case.config(backend=name, **config), softmax_offset=offset)
            for name in ("xla", "decode")]
    assert_close(outs[1], outs[0], tolerance(jnp.bfloat16), "out")


@pytest.mark.parametrize("check_bounds", [True, False], ids=["checked", "unchecked"])
def test_broken_sequences_are_nan_and_other_rows_exact(rng, check_bounds):
    """Unchecked, finding the broken sequences is the kernel's alone (paged.canonical
    computes nothing before it)."""
    case = Case(rng, b=3, sq=3, h=8, h_kv=2, d=64, dv=64, page_size=16, pages=30,
                dtype=jnp.bfloat16)
    config = case.config(backend="decode", mask="padding_causal_bottom_right",
                         sequence={"check_bounds": check_bounds})
    for name, q_len, kv_len, table in _broken_cases(case):
        sequence = SequenceDescriptor.from_seqlens(q_len, kv_len)
        out = np.asarray(jax.jit(lambda s, t: fused_attn(
            (case.q, case.k, case.v), config=config, sequence=s, page_table=t))(sequence, table),
            np.float32)
        assert np.isnan(out[1, :q_len[1]]).all(), name
        assert (out[1, q_len[1]:] == 0).all(), name
        good = SequenceDescriptor.from_seqlens(case.q_len[[0, 2]], case.kv_len[[0, 2]])
        rows = np.array([0, 2])
        expected = fused_attn((case.q[rows], case.k, case.v),
                              config=case.config(backend="xla", mask="padding_causal_bottom_right"),
                              sequence=good, page_table=case.table[rows])
        assert_close(out[rows], expected, tolerance(jnp.bfloat16), name)


@pytest.mark.parametrize("check_bounds", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("shape", ["bshd_split", "bshd_one_cta", "thd_split"])
def test_kernel_finds_each_broken_sequence(rng, shape, check_bounds):
    """test_paged's bound variants (every bound broken one at a time, from the lengths as
    given) on the CUDA kernel, with the split-KV combine (few CTAs) and without."""
    if shape == "thd_split":
        case = Case(rng, THD, b=2, m=3, sq=12, h=8, h_kv=2, d=64, dv=64, page_size=16,
                    pages=30, dtype=jnp.bfloat16)
    elif shape == "bshd_split":
        case = Case(rng, b=3, sq=4, h=8, h_kv=2, d=64, dv=64, page_size=16, pages=30,
                    dtype=jnp.bfloat16, max_queries=2)
    else:
        case = Case(rng, b=128, sq=4, h=32, h_kv=8, d=128, dv=128, page_size=16, pages=8,
                    dtype=jnp.bfloat16, max_queries=2)
    check_bound_variants(case, check_bounds)


def test_auto_picks_the_cuda_kernel_for_decoding(rng):
    case = Case(rng, b=2, sq=1, h=8, h_kv=2, d=128, dv=128, page_size=16, pages=4,
                dtype=jnp.bfloat16)
    chosen = explain((case.q, case.k, case.v), config=case.config(mask="padding"),
                     sequence=case.sequence, page_table=case.table)
    assert chosen.backend == "decode", chosen
    wide = Case(rng, b=2, sq=1, h=8, h_kv=2, d=96, dv=96, page_size=16, pages=4,
                dtype=jnp.bfloat16)
    verdict = explain((wide.q, wide.k, wide.v), config=wide.config(mask="padding"),
                      sequence=wide.sequence, page_table=wide.table).verdicts["decode"]
    assert "head dims 64, 128 and 256" in verdict
