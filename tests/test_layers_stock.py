"""Drop-in fidelity: stock models, stock arguments and stock checkpoints with our layers.

A small transformer per framework, written as the stock docs write it, runs with
only its attention class swapped for ours, from a checkpoint saved with the stock
class: outputs and gradients equal the stock model's. Then every stock argument of
the three layers: accepted with its stock meaning, or refused with what to do.
"""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx
from flax import serialization
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from fusedattn.layers import attention_fn, equinox, linen, nnx

from layer_helpers import B, D, F, H, S, X, Y, close, config

VOCAB = 50
TOKENS = jax.random.randint(jax.random.key(7), (B, S), 0, VOCAB)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def test_layers_reachable_after_import_fusedattn():
    code = ("import fusedattn; fusedattn.layers.linen.MultiHeadDotProductAttention; "
            "fusedattn.layers.nnx.MultiHeadAttention; fusedattn.layers.equinox.MultiheadAttention")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- stock models

class LinenBlock(nn.Module):
    attention: type

    @nn.compact
    def __call__(self, x, mask):
        x = x + self.attention(num_heads=H, qkv_features=F)(nn.LayerNorm()(x), mask=mask)
        y = nn.Dense(2 * F)(nn.LayerNorm()(x))
        return x + nn.Dense(F)(nn.gelu(y))


class LinenTransformer(nn.Module):
    attention: type = nn.MultiHeadDotProductAttention

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, F)(tokens)
        mask = nn.make_causal_mask(tokens)
        for _ in range(2):
            x = LinenBlock(self.attention)(x, mask)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


@pytest.mark.parametrize("stock_cls, ours_cls", [
    (nn.MultiHeadDotProductAttention, linen.MultiHeadDotProductAttention),
    (nn.MultiHeadAttention, linen.MultiHeadAttention)])
def test_linen_stock_model_swap(stock_cls, ours_cls):
    stock, ours = LinenTransformer(stock_cls), LinenTransformer(ours_cls)
    checkpoint = serialization.to_bytes(stock.init(jax.random.key(0), TOKENS))
    params = serialization.from_bytes(ours.init(jax.random.key(1), TOKENS), checkpoint)
    assert f"{stock_cls.__name__}_0" in params["params"]["LinenBlock_0"]
    close(ours.apply(params, TOKENS), stock.apply(params, TOKENS))
    loss = lambda model: jax.grad(lambda p: jnp.sum(jnp.sin(model.apply(p, TOKENS))))(params)
    jax.tree.map(lambda a, b: close(a, b, **GRAD_TOL), loss(ours), loss(stock))


class NnxTransformer(fnnx.Module):
    def __init__(self, attention, *, rngs: fnnx.Rngs):
        self.embed = fnnx.Embed(VOCAB, F, rngs=rngs)
        self.blocks = fnnx.List([NnxBlock(attention, rngs=rngs) for _ in range(2)])
        self.norm = fnnx.LayerNorm(F, rngs=rngs)
        self.head = fnnx.Linear(F, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = fnnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


class NnxBlock(fnnx.Module):
    def __init__(self, attention, *, rngs: fnnx.Rngs):
        self.norm1 = fnnx.LayerNorm(F, rngs=rngs)
        self.attention = attention(num_heads=H, in_features=F, decode=False, rngs=rngs)
        self.norm2 = fnnx.LayerNorm(F, rngs=rngs)
        self.up = fnnx.Linear(F, 2 * F, rngs=rngs)
        self.down = fnnx.Linear(2 * F, F, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(fnnx.gelu(self.up(self.norm2(x))))


def test_nnx_stock_model_swap():
    stock = NnxTransformer(fnnx.MultiHeadAttention, rngs=fnnx.Rngs(0))
    ours = NnxTransformer(nnx.MultiHeadAttention, rngs=fnnx.Rngs(1))
    checkpoint = fnnx.to_pure_dict(fnnx.state(stock, fnnx.Param))
    state = fnnx.state(ours, fnnx.Param)
    fnnx.replace_by_pure_dict(state, checkpoint)
    fnnx.update(ours, state)
    close(ours(TOKENS), stock(TOKENS))

    def grads(model):
        g = fnnx.grad(lambda m: jnp.sum(jnp.sin(m(TOKENS))))(model)
        return fnnx.to_pure_dict(fnnx.state(g, fnnx.Param))

    jax.tree.map(lambda a, b: close(a, b, **GRAD_TOL), grads(ours), grads(stock))


class EqxBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.Module
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, attention, key):
        akey, mkey = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(F), eqx.nn.LayerNorm(F)
        self.attention = attention(num_heads=H, query_size=F, key=akey)
        self.mlp = eqx.nn.MLP(F, F, 2 * F, 1, activation=jax.nn.gelu, key=mkey)

    def __call__(self, x, mask):
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class EqxTransformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, attention, key):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, F, key=keys[0])
        self.blocks = [EqxBlock(attention, k) for k in keys[1:3]]
        self.head = eqx.nn.Linear(F, VOCAB, key=keys[3])

    def __call__(self, tokens):  # one example: tokens [s]
        x = jax.vmap(self.embed)(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(x)


def test_equinox_stock_model_swap():
    stock = EqxTransformer(eqx.nn.MultiheadAttention, jax.random.key(0))
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, stock)
    buffer.seek(0)
    ours = eqx.tree_deserialise_leaves(
        buffer, EqxTransformer(equinox.MultiheadAttention, jax.random.key(1)))
    run = lambda model: jax.vmap(model)(TOKENS)
    close(run(ours), run(stock))
    loss = lambda model: eqx.filter_grad(lambda m: jnp.sum(jnp.sin(run(m))))(model)
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    for a, b in zip(arrays(loss(ours)), arrays(loss(stock)), strict=True):
        close(a, b, **GRAD_TOL)


# --------------------------------------------------------------------------- linen arguments

def test_linen_three_positional_inputs_and_keyword_forms():
    stock = nn.MultiHeadDotProductAttention(num_heads=H)
    z = jax.random.normal(jax.random.key(5), Y.shape)
    params = stock.init(jax.random.key(2), X, Y, z)
    ours = linen.MultiHeadDotProductAttention(H)
    expected = stock.apply(params, X, Y, z)
    close(ours.apply(params, X, Y, z), expected)
    close(ours.apply(params, X, inputs_k=Y, inputs_v=z), expected)
    close(ours.apply(params, X, inputs_kv=Y), stock.apply(params, X, Y))
    with pytest.raises(ValueError, match="inputs_kv: pass either inputs_kv or inputs_k"):
        ours.apply(params, X, Y, inputs_kv=Y)


def test_linen_positional_fields_and_dot_generals():
    """The stock fields in the stock order, and the projections' dot_general."""
    def doubled(lhs, rhs, *args, **kwargs):
        return 2 * jax.lax.dot_general(lhs, rhs, *args, **kwargs)

    stock = nn.MultiHeadDotProductAttention(H, jnp.float32, jnp.float32, 2 * F, F, True, 0.0,
                                            True, qkv_dot_general=doubled,
                                            out_dot_general=doubled)
    params = stock.init(jax.random.key(2), X)
    assert params["params"]["query"]["kernel"].shape == (F, H, 2 * F // H)
    ours = linen.MultiHeadDotProductAttention(H, jnp.float32, jnp.float32, 2 * F, F, True,
                                              0.0, True, force_fp32_for_softmax=True,
                                              qkv_dot_general=doubled, out_dot_general=doubled)
    close(ours.apply(params, X), stock.apply(params, X))


def test_linen_dropout_rate_sets_the_call():
    params = linen.MultiHeadDotProductAttention(H).init(jax.random.key(2), X)
    rngs = {"dropout": jax.random.key(9)}
    stock_rate = linen.MultiHeadDotProductAttention(H, dropout_rate=0.3, deterministic=False)
    config_rate = linen.MultiHeadDotProductAttention(H, config=config(mask="no_mask",
                                                                      dropout_rate=0.3),
                                                     deterministic=False)
    out = stock_rate.apply(params, X, rngs=rngs)
    close(out, config_rate.apply(params, X, rngs=rngs))
    assert not np.allclose(out, linen.MultiHeadDotProductAttention(H).apply(params, X))


def test_linen_refuses_what_the_fused_op_cannot_do():
    params = linen.MultiHeadDotProductAttention(H).init(jax.random.key(2), X)
    with pytest.raises(TypeError, match="attention_fn: this layer is the attention"):
        linen.MultiHeadDotProductAttention(H, attention_fn=nn.dot_product_attention).apply(
            params, X)
    with pytest.raises(ValueError, match="sow_weights: the fused attention never forms"):
        linen.MultiHeadDotProductAttention(H).apply(params, X, sow_weights=True)
    with pytest.raises(ValueError, match="qk_attn_weights_einsum_cls: the fused attention"):
        linen.MultiHeadDotProductAttention(H, qk_attn_weights_einsum_cls=lambda: jnp.einsum
                                           ).apply(params, X)
    with pytest.raises(ValueError, match=r"dropout_rate: expected a number in \[0, 1\)"):
        linen.MultiHeadDotProductAttention(H, dropout_rate=1.5).apply(params, X)


def test_attention_fn_refuses_einsum_dot_general_and_applies_promote_dtype():
    fn = attention_fn(config(mask="no_mask"))
    q = X.reshape(B, S, H, D)
    with pytest.raises(ValueError, match="einsum_dot_general: the fused attention"):
        fn(q, q, q, einsum_dot_general=jax.lax.dot_general)
    seen = []

    def promote(arrays, dtype=None):
        seen.append(dtype)
        return tuple(a.astype(jnp.float32) for a in arrays)

    close(fn(q.astype(jnp.bfloat16), q, q, promote_dtype=promote, deterministic=True),
          fn(q, q, q, deterministic=True), rtol=2e-2, atol=2e-2)
    assert seen == [None]


# --------------------------------------------------------------------------- nnx arguments

def test_nnx_positional_sizes_and_is_causal():
    stock = fnnx.MultiHeadAttention(H, F, 2 * F, 12, 2, 12, decode=False, rngs=fnnx.Rngs(3))
    ours = nnx.MultiHeadAttention(H, F, 2 * F, 12, 2, 12, rngs=fnnx.Rngs(4))
    params = fnnx.state(stock, fnnx.Param)
    assert jax.tree.map(jnp.shape, fnnx.state(ours, fnnx.Param)) == jax.tree.map(jnp.shape,
                                                                                params)
    fnnx.update(ours, params)
    y = jax.random.normal(jax.random.key(5), (B, S, 12))
    close(ours(X, y, is_causal=True), stock(X, y, is_causal=True))
    assert not np.allclose(ours(X, y, is_causal=True), ours(X, y))


def test_nnx_shardings_metadata_and_promote_dtypes():
    calls = []

    def promote(arrays, dtype=None, inexact=True):
        calls.append(len(arrays))
        return fnnx.nn.dtypes.promote_dtype(arrays, dtype=dtype, inexact=inexact)

    kwargs = dict(normalize_qk=True, kernel_metadata={"tag": "k"}, bias_metadata={"tag": "b"},
                  out_kernel_metadata={"tag": "ok"}, query_ln_scale_metadata={"tag": "q"},
                  qkv_promote_dtype=promote, out_promote_dtype=promote, ln_promote_dtype=promote)
    stock = fnnx.MultiHeadAttention(H, F, decode=False, rngs=fnnx.Rngs(3), **kwargs)
    ours = nnx.MultiHeadAttention(H, F, rngs=fnnx.Rngs(4), **kwargs)
    for module in (stock, ours):
        assert (module.query.kernel.get_metadata()["tag"], module.key.bias.get_metadata()["tag"],
                module.out.kernel.get_metadata()["tag"],
                module.query_ln.scale.get_metadata()["tag"]) == ("k", "b", "ok", "q")
    fnnx.update(ours, fnnx.state(stock, fnnx.Param))
    calls.clear()
    close(ours(X), stock(X))
    assert calls[:len(calls) // 2] == calls[len(calls) // 2:] and calls  # same promotions
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("d")))
        out = ours(x, out_sharding=P(None, None, "d"), qkv_sharding=P(None, None, "d"))
        assert out.sharding.spec == P(None, None, "d")
        close(out, stock(x, out_sharding=P(None, None, "d"), qkv_sharding=P(None, None, "d")))


def test_nnx_dropout_rate_and_refusals():
    layer = nnx.MultiHeadAttention(H, F, dropout_rate=0.2, rngs=fnnx.Rngs(0, dropout=1))
    assert layer.spec.dropout_rate == 0.2 and layer.rngs is not None
    assert not np.allclose(layer(X, deterministic=False), layer(X, deterministic=True))
    with pytest.raises(TypeError, match="attention_fn: this layer is the attention"):
        nnx.MultiHeadAttention(H, F, attention_fn=fnnx.dot_product_attention, rngs=fnnx.Rngs(0))
    with pytest.raises(ValueError, match="sow_weights: the fused attention never forms"):
        layer(X, deterministic=True, sow_weights=True)


# --------------------------------------------------------------------------- equinox arguments

def test_equinox_positional_arguments_and_process_heads():
    args = (H, F, 12, 12, 8, 6, 6, True, True, True, True, 0.0, False, jnp.float32)
    stock = eqx.nn.MultiheadAttention(*args, key=jax.random.key(3))
    ours = equinox.MultiheadAttention(*args, key=jax.random.key(4))
    assert jax.tree.structure(jax.tree.leaves(stock)) == jax.tree.structure(jax.tree.leaves(ours))
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, stock)
    buffer.seek(0)
    ours = eqx.tree_deserialise_leaves(buffer, ours)

    def process(q, k, v):  # any change of the heads, e.g. a rotation by position
        return jnp.flip(q, axis=-1), k * 2, v + 1

    y = Y[0]
    close(ours(X[0], y, y, process_heads=process), stock(X[0], y, y, process_heads=process))
    with pytest.raises(ValueError, match="process_heads: must return q, k, v of the shapes"):
        ours(X[0], y, y, process_heads=lambda q, k, v: (q[:1], k, v))


def test_equinox_dropout_p_inference_and_deprecated_deterministic():
    ours = equinox.MultiheadAttention(H, F, dropout_p=0.4, key=jax.random.key(4))
    assert ours.dropout.p == 0.4 and ours.spec.dropout_rate == 0.4
    plain = eqx.tree_at(lambda m: m.dropout, ours, eqx.nn.Dropout(0.0))
    with pytest.raises(ValueError, match=r"dropout.p: 0.0 differs from the layer's dropout rate"):
        plain(X[0])
    key = jax.random.key(1)
    dropped = ours(X[0], key=key)
    assert not np.allclose(dropped, ours(X[0], key=key, inference=True))
    with pytest.warns(DeprecationWarning, match="deterministic=.... is deprecated"):
        close(ours(X[0], key=key, deterministic=True), ours(X[0], inference=True))
    close(eqx.nn.inference_mode(ours)(X[0], key=key), ours(X[0], inference=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(ours(X[0], key=key, inference=False), dropped)
