"""Paged decoding with the layers (fusedattn.layers.paged): step by step through a paged
cache equals the full-sequence causal attention, for prompts of different lengths,
one- and multi-token steps, and a freed slot reused by a new sequence; the page
allocator's bookkeeping and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_config, tolerance
from flax import nnx

from fusedattn.layers import equinox as fa_eqx
from fusedattn.layers import linen as fa_linen
from fusedattn.layers import nnx as fa_nnx
from fusedattn.layers import paged

F, H, H_KV = 32, 4, 2


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _layer(rng, backend="auto", rope=True, softmax="vanilla"):
    config = make_config(backend=backend, mask="causal", softmax=softmax)
    layer = fa_nnx.MultiHeadAttention(H, F, config=config, num_kv_heads=H_KV, rope=rope,
                                      rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    if softmax == "learnable":
        layer.softmax_offset[...] = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return layer


class _Linen:
    """The linen layer behind the nnx calling convention: layer(x), layer(x, pages=...)."""

    def __init__(self, rng, num_pages, page_size):
        config = make_config(mask="causal")
        self.module = fa_linen.MultiHeadAttention(H, config=config, num_kv_heads=H_KV, rope=True,
                                                  num_pages=num_pages, page_size=page_size)
        x = jnp.zeros((1, 2, F), jnp.float32)
        self.params = self.module.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]
        self.cache = {}

    def __call__(self, x, pages=None):
        if pages is None:
            return self.module.apply({"params": self.params}, x)
        out, state = self.module.apply({"params": self.params, "cache": self.cache}, x,
                                       pages=pages, mutable=["cache"])
        self.cache = state["cache"]
        return out


class _Equinox:
    """The Equinox layer behind the nnx calling convention (vmapped full calls)."""

    def __init__(self, rng, num_pages, page_size):
        config = make_config(mask="causal")
        self.layer = fa_eqx.MultiheadAttention(H, F, config=config, num_kv_heads=H_KV, rope=True,
                                               normalize_qk=True,
                                               key=jax.random.key(int(rng.integers(1 << 30))))
        self.cache = paged.kv_cache(num_pages, page_size, H_KV, F // H, jnp.float32)

    def __call__(self, x, pages=None):
        if pages is None:
            return jax.vmap(lambda row: self.layer(row, row, row))(x)
        out, self.cache = self.layer.paged_step(x, self.cache, pages)
        return out


@pytest.mark.parametrize("framework", [_Linen, _Equinox])
def test_linen_and_equinox_paged_steps_equal_full_sequence_attention(rng, framework):
    S, L, page_size, num_pages = 2, 11, 4, 8
    layer = framework(rng, num_pages, page_size)
    x = jnp.asarray(rng.standard_normal((S, L, F)), jnp.float32)
    full = np.asarray(layer(x))
    pages = paged.page_table(num_pages, S, max_pages_per_seq=3)
    start = np.zeros(S, np.int64)
    for counts in ([4, 7], [1, 1], [3, 0], [1, 2]):
        out, pages = _run_step(layer, pages, x, counts, page_size)
        for s in range(S):
            assert_close(out[s, :counts[s]], full[s, start[s]:start[s] + counts[s]],
                         tolerance(jnp.float32), f"step {counts} sequence {s}")
        start += counts
        pages = paged.advance(pages)


def _tokens(x, pages, n):
    """x [S, L, F] rows at each sequence's next n positions -> [S, n, F] (zeros past L)."""
    position = np.asarray(paged.positions(pages, n))
    picked = np.take_along_axis(np.asarray(x), np.clip(position, 0, x.shape[1] - 1)[..., None],
                                axis=1)
    return jnp.asarray(np.where((position < x.shape[1])[..., None], picked, 0.0))


def _run_step(layer, pages, x, new_tokens, page_size):
    pages = paged.allocate(pages, jnp.asarray(new_tokens, jnp.int32), page_size)
    out = layer(_tokens(x, pages, max(1, int(np.max(new_tokens)))), pages=pages)
    return out, pages


@pytest.mark.parametrize("backend,softmax", [("auto", "vanilla"), ("xla", "learnable")])
def test_paged_steps_equal_full_sequence_attention(rng, backend, softmax):
    layer = _layer(rng, backend=backend, softmax=softmax)
    S, L, page_size = 3, 14, 4
    x = jnp.asarray(rng.standard_normal((S, L, F)), jnp.float32)
    full = np.asarray(layer(x))  # causal: position t sees tokens <= t of its row
    layer.init_paged_cache(num_pages=16, page_size=page_size)
    pages = paged.page_table(num_pages=16, max_seqs=S, max_pages_per_seq=4)
    prompts = np.array([3, 6, 1])
    out, pages = _run_step(layer, pages, x, prompts, page_size)  # prefill, different lengths
    for s in range(S):
        assert_close(out[s, :prompts[s]], full[s, :prompts[s]], tolerance(jnp.float32), "prefill")
        assert np.all(np.asarray(out[s, prompts[s]:]) == 0)
    pages = paged.advance(pages)
    for counts in ([1, 1, 1], [2, 1, 0], [1, 3, 2], [1, 1, 1]):  # decode, speculative steps
        start = np.asarray(pages.lengths)
        out, pages = _run_step(layer, pages, x, counts, page_size)
        for s in range(S):
            got = out[s, :counts[s]]
            assert_close(got, full[s, start[s]:start[s] + counts[s]], tolerance(jnp.float32),
                         f"step {counts} sequence {s}")
        pages = paged.advance(pages)
    assert list(np.asarray(pages.lengths)) == [3 + 5, 6 + 6, 1 + 4]


def test_freed_slot_is_reused_by_a_new_sequence(rng):
    layer = _layer(rng)
    S, L, page_size = 2, 9, 3
    x = jnp.asarray(rng.standard_normal((S, L, F)), jnp.float32)
    layer.init_paged_cache(num_pages=6, page_size=page_size)
    pages = paged.page_table(num_pages=6, max_seqs=S, max_pages_per_seq=3)
    _, pages = _run_step(layer, pages, x, [9, 4], page_size)
    pages = paged.free(paged.advance(pages), jnp.array([True, False]))
    assert int(jnp.sum(pages.free)) == 6 - 2 and int(pages.lengths[0]) == 0
    other = jnp.asarray(rng.standard_normal((S, L, F)), jnp.float32)
    fresh = jnp.stack([other[0], x[1]])
    full = np.asarray(layer(fresh))
    out, pages = _run_step(layer, pages, fresh, [5, 2], page_size)
    assert_close(out[0, :5], full[0, :5], tolerance(jnp.float32), "new sequence")
    assert_close(out[1, :2], full[1, 4:6], tolerance(jnp.float32), "kept sequence")


def test_allocate_hands_out_distinct_free_pages(rng):
    pages = paged.page_table(num_pages=10, max_seqs=3, max_pages_per_seq=4)
    pages = paged.advance(paged.allocate(pages, jnp.array([5, 0, 9]), 4))
    table = np.asarray(pages.table)
    held = table[table >= 0]
    assert sorted(held) == list(range(5)) and (table[1] == -1).all()
    pages = paged.allocate(pages, jnp.array([4, 1, 0]), 4)  # 9 tokens -> 3 pages; 1 -> 1
    table = np.asarray(pages.table)
    held = table[table >= 0]
    assert len(set(held)) == len(held) == 7
    assert int(jnp.sum(pages.free)) == 3
    assert not np.asarray(pages.free)[held].any()


def test_allocator_errors():
    pages = paged.page_table(num_pages=3, max_seqs=2, max_pages_per_seq=2)
    with pytest.raises(ValueError, match="holds 2 per sequence"):
        paged.allocate(pages, jnp.array([9, 0]), 4)
    with pytest.raises(ValueError, match="needs 4 new pages but only 3 are free"):
        paged.allocate(pages, jnp.array([8, 5]), 4)
    with pytest.raises(ValueError, match=r"new_tokens: expected shape \[max_seqs\]"):
        paged.allocate(pages, jnp.array([1, 1, 1]), 4)
    with pytest.raises(ValueError, match="max_pages_per_seq: expected an int >= 1"):
        paged.page_table(4, 2, 0)


def test_layer_errors(rng):
    layer = _layer(rng)
    pages = paged.allocate(paged.page_table(4, 2, 2), jnp.array([1, 1]), 4)
    x = jnp.asarray(rng.standard_normal((2, 1, F)), jnp.float32)
    with pytest.raises(ValueError, match="init_paged_cache"):
        layer(x, pages=pages)
    layer.init_paged_cache(4, 4)
    with pytest.raises(ValueError, match=r"\[max_seqs, n, features\] = \[2, n, features\]"):
        layer(x[:1], pages=pages)
    with pytest.raises(ValueError, match="mask: a paged step takes none"):
        layer(x, pages=pages, mask=jnp.ones((2, 1, 1, 1), bool))
    with pytest.raises(TypeError, match="expected a fusedattn.layers.paged.PageTable"):
        layer(x, pages=tuple(pages))
