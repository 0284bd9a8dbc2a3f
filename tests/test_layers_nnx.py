"""fusedattn.layers.nnx.MultiHeadAttention against flax.nnx.MultiHeadAttention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx

from fusedattn.layers import attention_fn, nnx

from layer_helpers import B, D, F, H, S, X, Y, close, config

CAUSAL = fnnx.make_causal_mask(jnp.ones((B, S)), dtype=bool)


def pair(mask_type="causal", **kwargs):
    """(stock, ours) with the stock weights loaded into ours."""
    stock_kwargs = {k: v for k, v in kwargs.items() if k in ("num_kv_heads", "normalize_qk",
                                                             "in_kv_features")}
    stock = fnnx.MultiHeadAttention(H, F, decode=False, rngs=fnnx.Rngs(3), **stock_kwargs)
    ours = nnx.MultiHeadAttention(H, F, config=config(mask=mask_type), rngs=fnnx.Rngs(4),
                                  **kwargs)
    params = fnnx.state(stock, fnnx.Param)
    assert jax.tree.map(jnp.shape, fnnx.state(ours, fnnx.Param)) == jax.tree.map(jnp.shape,
                                                                                params)
    fnnx.update(ours, params)
    return stock, ours


@pytest.mark.parametrize("mask_type, stock_mask", [("no_mask", None), ("causal", CAUSAL)])
def test_weight_transplant_parity_forward_and_gradients(mask_type, stock_mask):
    stock, ours = pair(mask_type)
    close(ours(X), stock(X, mask=stock_mask))

    @fnnx.jit
    def grads(module, x, mask):
        return fnnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x, mask=mask))), argnums=(0, 1))(module, x)

    (g_ours, gx_ours), (g_stock, gx_stock) = grads(ours, X, None), grads(stock, X, stock_mask)
    close(gx_ours, gx_stock, rtol=1e-4, atol=1e-5)
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-4, atol=1e-5),
                 fnnx.state(g_ours, fnnx.Param), fnnx.state(g_stock, fnnx.Param))


def test_gqa_normalize_qk_cross_attention_parity():
    stock, ours = pair("no_mask", num_kv_heads=2, normalize_qk=True, in_kv_features=12)
    assert ours.key.kernel.shape == (12, 2, D) and ours.query_ln.scale.shape == (D,)
    fnnx.update(ours, jax.tree.map(lambda a: a + 0.1, fnnx.state(ours, fnnx.Param)))
    fnnx.update(stock, fnnx.state(ours, fnnx.Param))
    mask = jax.random.bernoulli(jax.random.key(4), 0.6, (B, 1, S, 4)).at[..., 0].set(True)
    close(ours(X, Y, mask=mask), stock(X, Y, mask=mask))


def test_fused_qkv_parameters():
    ours = nnx.MultiHeadAttention(H, F, config=config(), num_kv_heads=2, fused_qkv=True,
                                  rngs=fnnx.Rngs(0))
    assert ours.query is None and ours.qkv.kernel.shape == (F, H + 4, D)
    assert ours(X).shape == (B, S, F)


def test_bf16_compute_with_float32_params():
    _, ours = pair(dtype=jnp.bfloat16)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(fnnx.state(ours, fnnx.Param)))
    out = ours(X)
    assert out.dtype == jnp.bfloat16
    _, full = pair()
    close(out, full(X), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("kwargs", [{}, {"num_kv_heads": 2, "rope": True, "normalize_qk": True}])
def test_decode_equals_full_sequence_and_stock_decode(kwargs):
    stock_kwargs = {k: v for k, v in kwargs.items() if k in ("num_kv_heads", "normalize_qk")}
    full = nnx.MultiHeadAttention(H, F, config=config(), rngs=fnnx.Rngs(5), **kwargs)
    expected = full(X)
    full.init_cache(X.shape)
    assert full.cached_key.shape == (B, S, full.num_kv_heads, D)

    @fnnx.jit
    def step(module, x):
        return module(x, decode=True)

    close(jnp.concatenate([step(full, X[:, i:i + 1]) for i in range(S)], axis=1), expected)
    assert int(full.cache_index[...]) == S
    if not kwargs.get("rope"):  # the stock module has no RoPE
        stock = fnnx.MultiHeadAttention(H, F, decode=True, rngs=fnnx.Rngs(0), **stock_kwargs)
        fnnx.update(stock, fnnx.state(full, fnnx.Param))
        stock.init_cache(X.shape)
        close(jnp.concatenate([stock(X[:, i:i + 1]) for i in range(S)], axis=1), expected)


def test_decode_without_cache_raises():
    ours = nnx.MultiHeadAttention(H, F, config=config(), decode=True, rngs=fnnx.Rngs(0))
    with pytest.raises(ValueError, match="call layer.init_cache"):
        ours(X[:, :1])


def test_dropout_with_rngs():
    ours = nnx.MultiHeadAttention(H, F, config=config(dropout_rate=0.3), rngs=fnnx.Rngs(0))
    a = ours(X, deterministic=False, rngs=fnnx.Rngs(dropout=1))
    close(a, ours(X, deterministic=False, rngs=fnnx.Rngs(dropout=1)))
    assert not np.allclose(a, ours(X, deterministic=False, rngs=fnnx.Rngs(dropout=2)))
    kept_1, kept_2 = ours(X, deterministic=False), ours(X, deterministic=False)
    assert not np.allclose(kept_1, kept_2)  # the kept stream advances
    plain = nnx.MultiHeadAttention(H, F, config=config(), rngs=fnnx.Rngs(0))
    close(ours(X, deterministic=True), plain(X))
    with pytest.raises(ValueError, match="deterministic: config.dropout_rate is 0.3"):
        ours(X)
    close(fnnx.view(ours, deterministic=True)(X), plain(X))
    close(fnnx.view(ours, deterministic=False)(X, rngs=fnnx.Rngs(dropout=1)), a)


def test_view_decode_creates_the_cache():
    ours = nnx.MultiHeadAttention(H, F, config=config(), rngs=fnnx.Rngs(0))
    expected = ours(X)
    decoder = fnnx.view(ours, decode=True, batch_size=B, max_length=S)
    close(jnp.concatenate([decoder(X[:, i:i + 1]) for i in range(S)], axis=1), expected)


def test_dropout_without_rngs_raises():
    ours = nnx.MultiHeadAttention(H, F, config=config(dropout_rate=0.3), keep_rngs=False,
                                  rngs=fnnx.Rngs(0))
    with pytest.raises(ValueError, match=r"dropout_rng: config.dropout_rate is 0.3 .* "
                                         r"rngs=nnx.Rngs\(dropout=...\)"):
        ours(X, deterministic=False)


def test_mask_errors():
    ours = nnx.MultiHeadAttention(H, F, config=config(), rngs=fnnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mask: expected a mask of shape broadcastable"):
        ours(X, mask=jnp.ones((B, H, S, S + 1), bool))
    with pytest.raises(TypeError, match="mask: expected a boolean array"):
        ours(X, mask=jnp.ones((S, S), jnp.complex64))
    with pytest.raises(ValueError, match="inputs_q: got 12 features"):
        ours(Y)
    with pytest.raises(ValueError, match="inputs_k: must be given when inputs_v is given"):
        ours(X, inputs_v=X)


def test_attention_fn_in_the_stock_module():
    stock, _ = pair()
    fused = fnnx.MultiHeadAttention(H, F, decode=False, rngs=fnnx.Rngs(3),
                                    attention_fn=attention_fn(config(mask="no_mask")))
    close(fused(X, mask=CAUSAL), stock(X, mask=CAUSAL))
    close(fused(X, is_causal=True), stock(X, mask=CAUSAL))
