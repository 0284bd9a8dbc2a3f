"""fusedattn.layers.equinox.MultiheadAttention against equinox.nn.MultiheadAttention."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn.ops
from fusedattn.layers import equinox
from fusedattn.ops import SequenceDescriptor

from layer_helpers import B, D, F, H, S, X, Y, close, config

CAUSAL = jnp.tril(jnp.ones((S, S), bool))
PROJECTIONS = lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj)


def pair(mask_type="causal", key_size=None, **kwargs):
    bias = dict(use_query_bias=True, use_key_bias=True, use_value_bias=True,
                use_output_bias=True)
    stock = eqx.nn.MultiheadAttention(H, F, key_size=key_size, value_size=key_size,
                                      key=jax.random.key(3), **bias)
    ours = equinox.MultiheadAttention(H, F, config=config(mask=mask_type), key_size=key_size,
                                      value_size=key_size, key=jax.random.key(4), **bias,
                                      **kwargs)
    assert jax.tree.map(jnp.shape, PROJECTIONS(ours)) == jax.tree.map(jnp.shape,
                                                                      PROJECTIONS(stock))
    return stock, eqx.tree_at(PROJECTIONS, ours, PROJECTIONS(stock))


@pytest.mark.parametrize("mask_type, stock_mask", [("no_mask", None), ("causal", CAUSAL)])
def test_weight_transplant_parity_forward_and_gradients(mask_type, stock_mask):
    stock, ours = pair(mask_type)
    run = lambda m, x, mask: jax.vmap(lambda x: m(x, x, x, mask=mask))(x)
    close(run(ours, X, None), run(stock, X, stock_mask))

    @eqx.filter_jit
    def grads(module, x, mask):
        return eqx.filter_grad(lambda m, x: jnp.sum(jnp.sin(run(m, x, mask))))(module, x)

    jax.tree.map(lambda a, b: close(a, b, rtol=1e-4, atol=1e-5),
                 PROJECTIONS(grads(ours, X, None)), PROJECTIONS(grads(stock, X, stock_mask)))


def test_cross_attention_per_head_mask_parity():
    stock, ours = pair("no_mask", key_size=12)
    mask = jax.random.bernoulli(jax.random.key(4), 0.6, (B, H, S, 4)).at[..., 0].set(True)
    run = lambda m: jax.vmap(lambda x, y, mask: m(x, y, y, mask))(X, Y, mask)
    close(run(ours), run(stock))


def test_vmap_reaches_fused_attn_once_without_loops(monkeypatch):
    calls = []
    original = fusedattn.ops.fused_attn

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(fusedattn.ops, "fused_attn", counting)
    _, ours = pair(normalize_qk=True, rope=True)
    batched = lambda m, x, mask: jax.vmap(lambda x, mask: m(x, x, x, mask))(x, mask)
    mask = jnp.ones((B, S, S), bool)
    jaxpr = jax.make_jaxpr(lambda x, mask: batched(ours, x, mask))(X, mask)
    assert len(calls) == 1
    text = str(jaxpr)
    assert "scan" not in text and "while" not in text
    calls.clear()
    eqx.filter_jit(batched)(ours, X, mask)
    assert len(calls) == 1


def test_jit_and_grad_idioms_agree_with_eager():
    _, ours = pair()
    loss = lambda m, x: jnp.sum(jax.vmap(lambda x: m(x, x, x))(x) ** 2)
    close(eqx.filter_jit(loss)(ours, X), loss(ours, X), rtol=1e-5)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(ours, X)
    assert grads.query_proj.weight.shape == (F, F) and np.all(np.isfinite(
        grads.query_proj.weight))


def test_gqa_and_fused_qkv_parameters():
    ours = equinox.MultiheadAttention(H, F, config=config(), num_kv_heads=2,
                                      key=jax.random.key(0))
    assert ours.key_proj.weight.shape == (2 * D, F) and ours.query_proj.weight.shape == (F, F)
    fused = equinox.MultiheadAttention(H, F, config=config(), num_kv_heads=2, fused_qkv=True,
                                       use_query_bias=True, key=jax.random.key(0))
    assert fused.query_proj is None and fused.qkv_proj.weight.shape == ((H + 4) * D, F)
    qkv = eqx.tree_at(lambda m: (m.qkv_proj.weight, m.qkv_proj.bias, m.output_proj), fused, (
        jnp.concatenate([ours.query_proj.weight, ours.key_proj.weight, ours.value_proj.weight]),
        jnp.zeros((H + 4) * D), ours.output_proj))
    close(jax.vmap(lambda x: qkv(x))(X), jax.vmap(lambda x: ours(x, x, x))(X))
    close(jax.vmap(lambda x: qkv(x, x, x))(X), jax.vmap(lambda x: ours(x, x, x))(X))
    with pytest.raises(ValueError, match="fused_qkv: the fused projection serves self-attention"):
        jax.vmap(qkv)(X, X, X)  # separate tracers: cannot be told to be the same array
    with pytest.raises(ValueError, match="key_: must be given when value is given"):
        ours(X[0], value=X[0])


def test_sequence_descriptor_is_per_example_under_vmap():
    _, ours = pair("padding_causal")
    sequence = SequenceDescriptor.from_seqlens(jnp.array([4, 6]), jnp.array([4, 6]))
    out = jax.vmap(lambda x, s: ours(x, x, x, sequence=s))(X, sequence)
    causal = pair("causal")[1]
    close(out[0, :4], causal(X[0, :4], X[0, :4], X[0, :4]))
    close(out[1], causal(X[1], X[1], X[1]))
    one = SequenceDescriptor.from_seqlens(jnp.array([4]), jnp.array([4]))  # batch axis 1
    close(ours(X[0], X[0], X[0], sequence=one)[:4], out[0, :4])


def test_compute_dtype_bf16_with_float32_params():
    _, ours = pair(compute_dtype=jnp.bfloat16)
    assert ours.query_proj.weight.dtype == jnp.float32
    out = jax.vmap(lambda x: ours(x, x, x))(X)
    assert out.dtype == jnp.bfloat16
    _, full = pair()
    close(out, jax.vmap(lambda x: full(x, x, x))(X), rtol=5e-2, atol=5e-2)


def test_dropout_key_and_inference():
    _, ours = pair(mask_type="no_mask")
    ours = equinox.MultiheadAttention(H, F, config=config(mask="no_mask", dropout_rate=0.4),
                                      key=jax.random.key(4))
    run = lambda m, key, **kw: jax.vmap(lambda x, k: m(x, x, x, key=k, **kw))(
        X, jax.random.split(key, B))
    a = run(ours, jax.random.key(1))
    close(a, run(ours, jax.random.key(1)))
    assert not np.allclose(a, run(ours, jax.random.key(2)))
    plain = equinox.MultiheadAttention(H, F, config=config(mask="no_mask"),
                                       key=jax.random.key(4))
    expected = jax.vmap(lambda x: plain(x, x, x))(X)
    close(run(ours, jax.random.key(1), inference=True), expected)
    close(run(eqx.nn.inference_mode(ours), jax.random.key(1)), expected)
    close(jax.vmap(lambda x: eqx.nn.inference_mode(ours)(x, x, x))(X), expected)
    with pytest.raises(ValueError, match=r"dropout_rng: config.dropout_rate is 0.4 .* "
                                         r"pass key=jax.random.key"):
        jax.vmap(lambda x: ours(x, x, x))(X)


def test_error_paths():
    _, ours = pair()
    with pytest.raises(ValueError, match=r"mask: expected a mask of shape broadcastable"):
        ours(X[0], X[0], X[0], mask=jnp.ones((3, S, S), bool))
    with pytest.raises(TypeError, match="mask: expected a boolean array"):
        ours(X[0], X[0], X[0], mask=jnp.ones((S, S), jnp.complex64))
    with pytest.raises(ValueError, match="query: expected one example"):
        ours(X, X, X)
    with pytest.raises(ValueError, match="key_, value: must have equal sequence lengths"):
        ours(X[0], X[0], X[0, :3])
    with pytest.raises(TypeError, match="sequence: expected a fusedattn.ops.SequenceDescriptor"):
        ours(X[0], X[0], X[0], sequence=jnp.ones(3))
    with pytest.raises(ValueError, match="num_kv_heads: got 3"):
        equinox.MultiheadAttention(H, F, config=config(), num_kv_heads=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="config.mask: got 'diagonal'"):
        equinox.MultiheadAttention(H, F, config={"mask": "diagonal"}, key=jax.random.key(0))
