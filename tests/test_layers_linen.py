"""fusedattn.layers.linen.MultiHeadAttention against flax.linen.MultiHeadDotProductAttention."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedattn.ops
from fusedattn.layers import attention_fn, linen

from layer_helpers import B, D, F, H, S, X, Y, close, config

CAUSAL = nn.make_causal_mask(jnp.ones((B, S)), dtype=bool)


def stock_params(**kwargs):
    stock = nn.MultiHeadDotProductAttention(num_heads=H, **kwargs)
    return stock, stock.init(jax.random.key(2), X)


@pytest.mark.parametrize("mask_type, stock_mask", [("no_mask", None), ("causal", CAUSAL)])
def test_weight_transplant_parity_forward_and_gradients(mask_type, stock_mask):
    stock, params = stock_params()
    ours = linen.MultiHeadAttention(H, config=config(mask=mask_type))
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(3), X)) == jax.tree.map(
        jnp.shape, params)
    close(ours.apply(params, X), stock.apply(params, X, mask=stock_mask))

    def loss(module, mask):
        return jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(module.apply(p, x, mask=mask))),
                                argnums=(0, 1)))(params, X)

    ours_grads, stock_grads = loss(ours, None), loss(stock, stock_mask)
    jax.tree.map(lambda a, b: close(a, b, rtol=1e-4, atol=1e-5), ours_grads, stock_grads)


def test_cross_attention_and_explicit_mask_parity():
    stock = nn.MultiHeadDotProductAttention(num_heads=H)
    params = stock.init(jax.random.key(2), X, Y)
    assert params["params"]["key"]["kernel"].shape == (12, H, D)
    mask = jax.random.bernoulli(jax.random.key(4), 0.6, (B, H, S, 4)).at[..., 0].set(True)
    ours = linen.MultiHeadAttention(H, config=config(mask="no_mask"))
    close(ours.apply(params, X, Y, mask=mask), stock.apply(params, X, Y, mask=mask))
    close(ours.apply(params, X, inputs_k=Y, inputs_v=Y), stock.apply(params, X, Y))
    # flax's own float masks work too
    float_mask = nn.make_attention_mask(jnp.ones((B, S)), jnp.ones((B, 4)))
    close(ours.apply(params, X, Y, mask=float_mask), stock.apply(params, X, Y))


def test_extra_batch_axes_parity():
    stock, params = stock_params()
    x = X.reshape(1, B, S, F)
    ours = linen.MultiHeadAttention(H, config=config())
    close(ours.apply(params, x), stock.apply(params, x, mask=CAUSAL[None]))


def test_normalize_qk_parity():
    stock, params = stock_params(normalize_qk=True)
    assert params["params"]["query_ln"]["scale"].shape == (D,)
    params = jax.tree.map(lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
                          params)
    ours = linen.MultiHeadAttention(H, config=config(), normalize_qk=True)
    close(ours.apply(params, X), stock.apply(params, X, mask=CAUSAL))


def gqa_params(h_kv: int):
    ours = linen.MultiHeadAttention(H, config=config(), num_kv_heads=h_kv)
    params = ours.init(jax.random.key(5), X)
    return ours, params


def test_gqa_shapes_and_equivalence_to_repeated_heads():
    ours, params = gqa_params(2)
    p = params["params"]
    assert p["key"]["kernel"].shape == (F, 2, D) and p["value"]["bias"].shape == (2, D)
    assert p["query"]["kernel"].shape == (F, H, D)
    repeated = jax.tree.map(lambda a: a, params)
    for name in ("key", "value"):  # query head i uses kv head i // (H // h_kv)
        repeated["params"][name] = {k: jnp.repeat(v, H // 2, axis=-2 if k == "kernel" else 0)
                                    for k, v in p[name].items()}
    stock = nn.MultiHeadDotProductAttention(num_heads=H)
    close(ours.apply(params, X), stock.apply(repeated, X, mask=CAUSAL))


@pytest.mark.parametrize("h_kv, layout", [(H, "bs3hd"), (2, "bshd_bs2hd"), (1, "bshd_bs2hd")])
def test_fused_qkv_uses_packed_layout_and_matches_separate(monkeypatch, h_kv, layout):
    separate, params = gqa_params(h_kv)
    p = params["params"]
    fused = linen.MultiHeadAttention(H, config=config(), num_kv_heads=h_kv, fused_qkv=True)
    fused_params = fused.init(jax.random.key(6), X)
    assert set(fused_params["params"]) == {"qkv", "out"}
    assert fused_params["params"]["qkv"]["kernel"].shape == (F, H + 2 * h_kv, D)
    fused_params = {"params": {"out": p["out"], "qkv": {
        k: jnp.concatenate([p[n][k] for n in ("query", "key", "value")], axis=-2 if k == "kernel"
                           else 0) for k in ("kernel", "bias")}}}
    layouts = []
    original = fusedattn.ops.fused_attn

    def recording(qkv, **kwargs):
        layouts.append(str(fusedattn.ops.AttentionSpec.from_config(kwargs["config"]).qkv_layout))
        return original(qkv, **kwargs)

    monkeypatch.setattr(fusedattn.ops, "fused_attn", recording)
    close(fused.apply(fused_params, X), separate.apply(params, X))
    assert layouts[0] == layout
    with pytest.raises(ValueError, match="fused_qkv: the fused projection serves self-attention"):
        fused.apply(fused_params, X, Y)


def test_bf16_compute_with_float32_params():
    ours = linen.MultiHeadAttention(H, config=config(), dtype=jnp.bfloat16,
                                    normalize_qk=True, rope=True)
    params = ours.init(jax.random.key(7), X)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    out = ours.apply(params, X)
    assert out.dtype == jnp.bfloat16
    full = linen.MultiHeadAttention(H, config=config(), normalize_qk=True, rope=True)
    close(out, full.apply(params, X), rtol=5e-2, atol=5e-2)


# --------------------------------------------------------------------------- decode


def decode_steps(module, params, x, chunks):
    cache = module.init(jax.random.key(0), x)["cache"]
    assert set(cache) == {"cached_key", "cached_value", "cache_index"}
    outs, start = [], 0
    step = jax.jit(lambda c, x: module.apply({**params, "cache": c}, x, mutable=["cache"]))
    for n in chunks:
        out, variables = step(cache, x[:, start:start + n])
        cache, start = variables["cache"], start + n
        outs.append(out)
        assert int(cache["cache_index"]) == start
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("kwargs", [{}, {"num_kv_heads": 2, "rope": True},
                                    {"normalize_qk": True, "fused_qkv": True}])
def test_decode_equals_full_sequence_attention(kwargs):
    full = linen.MultiHeadAttention(H, config=config(window_size=(3, -1)), **kwargs)
    params = full.init(jax.random.key(8), X)
    expected = full.apply(params, X)
    decoder = full.clone(decode=True)
    close(decode_steps(decoder, params, X, [1] * S), expected)
    close(decode_steps(decoder, params, X, [3, 1, 2]), expected)  # chunked prefill


def test_decode_cache_overflow_raises():
    module = linen.MultiHeadAttention(H, config=config(), decode=True)
    variables = module.init(jax.random.key(0), X[:, :2])
    with pytest.raises(ValueError, match="the KV cache holds 2 positions"):
        module.apply(variables, X[:, :3], mutable=["cache"])


def test_decode_rejects_a_sequence_descriptor():
    module = linen.MultiHeadAttention(H, config=config(), decode=True)
    variables = module.init(jax.random.key(0), X)
    sequence = fusedattn.ops.SequenceDescriptor.from_seqlens(jnp.ones(B, int), jnp.ones(B, int))
    with pytest.raises(ValueError, match="decode mode builds its own descriptor"):
        module.apply(variables, X[:, :1], sequence=sequence, mutable=["cache"])


# --------------------------------------------------------------------------- dropout


def test_dropout_uses_the_dropout_stream_and_deterministic_merge():
    module = linen.MultiHeadAttention(H, config=config(dropout_rate=0.3))
    params = module.init(jax.random.key(0), X, deterministic=True)
    apply = jax.jit(lambda p, key, det: module.apply(p, X, deterministic=det,
                                                     rngs={"dropout": key}),
                    static_argnums=2)
    a = apply(params, jax.random.key(1), False)
    close(a, apply(params, jax.random.key(1), False))
    assert not np.allclose(a, apply(params, jax.random.key(2), False))
    close(apply(params, jax.random.key(1), True),
          linen.MultiHeadAttention(H, config=config()).apply(params, X))
    # an explicit dropout_rng takes precedence over the stream
    close(module.apply(params, X, deterministic=False, dropout_rng=jax.random.key(1)),
          module.apply(params, X, deterministic=False, dropout_rng=jax.random.key(1),
                       rngs={"dropout": jax.random.key(9)}))
    # the attribute form
    train = linen.MultiHeadAttention(H, config=config(dropout_rate=0.3), deterministic=False)
    close(train.apply(params, X, rngs={"dropout": jax.random.key(1)}), a)


def test_dropout_without_rng_raises():
    module = linen.MultiHeadAttention(H, config=config(dropout_rate=0.3))
    params = module.init(jax.random.key(0), X, deterministic=True)
    with pytest.raises(ValueError, match=r"dropout_rng: config.dropout_rate is 0.3 .* "
                                         r"rngs=\{'dropout': key\}"):
        module.apply(params, X, deterministic=False)
    with pytest.raises(ValueError, match='"deterministic" must be passed'):
        module.apply(params, X)


def test_mask_errors():
    module = linen.MultiHeadAttention(H, config=config())
    params = module.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"mask: expected a mask of shape broadcastable to "
                                         r"\[batch..., heads, q, kv\] = \[2, 4, 6, 6\]"):
        module.apply(params, X, mask=jnp.ones((B, 3, S, S), bool))
    with pytest.raises(TypeError, match="mask: expected a boolean array"):
        module.apply(params, X, mask=jnp.ones((S, S), jnp.complex64))


# --------------------------------------------------------------------------- attention_fn


def test_attention_fn_in_the_stock_module():
    stock, params = stock_params()
    fused = nn.MultiHeadDotProductAttention(num_heads=H,
                                            attention_fn=attention_fn(config(mask="no_mask")))
    close(fused.apply(params, X, mask=CAUSAL), stock.apply(params, X, mask=CAUSAL))
    with pytest.raises(ValueError, match="sow_weights"):
        fused.apply(params, X, sow_weights=True)
    causal = nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=attention_fn(config()))
    close(causal.apply(params, X), stock.apply(params, X, mask=CAUSAL))


def test_attention_fn_dropout_follows_the_stock_module():
    fn = attention_fn(config(mask="no_mask"))
    module = nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=fn, dropout_rate=0.4)
    params = module.init(jax.random.key(0), X, deterministic=True)
    a = module.apply(params, X, deterministic=False, rngs={"dropout": jax.random.key(1)})
    close(a, module.apply(params, X, deterministic=False, rngs={"dropout": jax.random.key(1)}))
    assert not np.allclose(a, module.apply(params, X, deterministic=True))
    ours = linen.MultiHeadAttention(H, config=config(mask="no_mask", dropout_rate=0.4))
    close(ours.apply(params, X, deterministic=False, dropout_rng=jax.random.key(1)),
          module.apply(params, X, deterministic=False, dropout_rng=jax.random.key(1)))
