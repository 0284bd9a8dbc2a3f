"""Bad data never gives plausible numbers: descriptor values, masked NaN, exact masks, decode.

- impossible descriptor values raise eagerly (naming field, row, value) and under jit
  mark the rows NaN and report through checkify;
- a descriptor with a mask that does not read it raises;
- masked keys contribute nothing even when k or v hold NaN/Inf (xla backend);
- an explicit layer mask is exact at any logit size, in every dtype;
- decoding past the cache's max_len raises eagerly, gives NaN (and checkify) under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx
from jax.experimental import checkify

from conftest import assert_close, make_config, random_array, tolerance
from fusedattn.layers import equinox, linen, nnx
from fusedattn.ops import SequenceDescriptor, fused_attn
from reference import reference_attention

B, S, H, D = 2, 8, 2, 16


def qkv(rng, b=B, s=S, dtype=jnp.float32):
    return tuple(random_array(rng, (b, s, H, D), dtype) for _ in range(3))


def offsets(q_len, q_off, kv_len=None, kv_off=None):
    kv_len = q_len if kv_len is None else kv_len
    kv_off = q_off if kv_off is None else kv_off
    return SequenceDescriptor.from_seqlens_and_offsets(
        *(np.asarray(a, np.int32) for a in (q_len, kv_len, q_off, kv_off)))


GOOD_OFFSETS = ([[3, 4, -1], [8, -1, -1]], [[0, 3, 7, 7], [0, 8, 8, 8]])

# (descriptor, layout, message): each breaks one rule in row 1 (row 0 is valid).
BAD = [
    (SequenceDescriptor.from_seqlens(np.array([5, -2], np.int32), np.array([5, 3], np.int32)),
     "bshd_bshd_bshd", r"sequence.q_seqlens: row 1 holds -2; expected a length in \[0, 8\]"),
    (SequenceDescriptor.from_seqlens(np.array([5, 3], np.int32), np.array([5, 9], np.int32)),
     "bshd_bshd_bshd", r"sequence.kv_seqlens: row 1 holds 9; expected a length in \[0, 8\]"),
    (offsets([[3, 4, -1], [2, -3, -1]], GOOD_OFFSETS[1]), "thd_thd_thd",
     r"sequence.q_seqlens: row 1, entry 1 holds -3; expected a length >= 0, or -1"),
    (offsets([[3, 4, -1], [2, 3, -1]], [[0, 3, 7, 7], [0, -1, 5, 5]]), "thd_thd_thd",
     r"sequence.q_offsets: row 1, entry 1 holds -1; expected an offset >= 0"),
    (offsets([[3, 4, -1], [2, 3, -1]], [[0, 3, 7, 7], [0, 6, 9, 9]]), "thd_thd_thd",
     r"sequence.q_seqlens: row 1, entry 1 holds 3; expected offset \+ length <= 8"),
    (offsets([[3, 4, -1], [4, 3, -1]], [[0, 3, 7, 7], [0, 2, 5, 5]]), "thd_thd_thd",
     r"sequence.q_offsets: row 1, entry 1 holds 2; expected offsets of used slots in "
     r"increasing order"),
    (offsets([[3, 4, -1], [2, 3, -1]], [[0, 3, 7, 7], [5, 0, 8, 8]]), "thd_thd_thd",
     r"sequence.q_offsets: row 1, entry 1 holds 0; expected offsets of used slots in "
     r"increasing order"),
    (offsets([[3, 4, -1], [4, 2, -1]], [[0, 3, 7, 7], [0, 4, 5, 5]]), "thd_thd_thd",
     r"sequence.q_offsets: row 1, entry 1 holds 4; expected offsets\[i \+ 1\] >= "
     r"offsets\[i\] \+ lengths\[i\]"),
    (SequenceDescriptor.from_segment_ids_and_pos(
        np.array([[1, 1, 2, 2, 0, 0, 0, 0], [1, 1, -1, -1, 0, 0, 0, 0]], np.int32),
        np.array([[1, 1, 2, 2, 0, 0, 0, 0], [1, 1, 2, 2, 0, 0, 0, 0]], np.int32)),
     "bshd_bshd_bshd", r"sequence.q_segment_ids: row 1, entry 2 holds -1; expected ids >= 0"),
    (SequenceDescriptor.from_segment_ids_and_pos(
        np.ones((B, S), np.int32), np.ones((B, S), np.int32), None,
        np.array([[0] * S, [0, 1, 2, -4, 4, 5, 6, 7]], np.int32)),
     "bshd_bshd_bshd", r"sequence.kv_segment_pos: row 1, entry 3 holds -4; expected positions"),
]


@pytest.mark.parametrize("sequence,layout,message", BAD)
def test_impossible_descriptor_raises_eagerly(rng, sequence, layout, message):
    config = make_config(backend="xla", mask="padding", qkv_layout=layout,
                         sequence={"max_segments_per_seq": 3})
    with pytest.raises(ValueError, match=message):
        fused_attn(qkv(rng), config=config, sequence=sequence)


@pytest.mark.parametrize("sequence,layout,message", BAD)
def test_impossible_descriptor_under_jit_marks_rows_and_checkifies(rng, sequence, layout, message):
    config = make_config(backend="xla", mask="padding", qkv_layout=layout,
                         sequence={"max_segments_per_seq": 3})
    arrays = qkv(rng)
    call = jax.jit(lambda s: fused_attn(arrays, config=config, sequence=s))
    out = np.asarray(call(sequence))
    assert np.isnan(out[1]).all()            # the broken row: no numbers
    assert np.isfinite(out[0]).all()         # the valid row is untouched
    error, _ = checkify.checkify(call)(sequence)
    field = message.split(":")[0]
    assert field in (error.get() or "")


def test_valid_offsets_with_gaps_and_unused_slots_pass(rng):
    config = make_config(backend="xla", mask="padding", qkv_layout="thd_thd_thd",
                         sequence={"max_segments_per_seq": 3})
    sequence = offsets([[3, 0, 2], [5, -1, -1]], [[0, 4, 4, 8], [1, 6, -1, -1]])
    arrays = qkv(rng)
    expected = reference_attention(arrays, config, sequence=sequence).out
    assert_close(fused_attn(arrays, config=config, sequence=sequence), expected, 1e-5)


@pytest.mark.parametrize("mask,wanted", [("causal", "padding_causal"), ("no_mask", "padding"),
                                         ("causal_bottom_right", "padding_causal_bottom_right")])
def test_descriptor_with_a_mask_that_ignores_it_raises(rng, mask, wanted):
    sequence = SequenceDescriptor.from_seqlens(np.array([5, 3], np.int32),
                                               np.array([5, 3], np.int32))
    with pytest.raises(ValueError, match=rf"sequence: config mask '{mask}' .* does not read a "
                       rf"SequenceDescriptor.*use mask '{wanted}'"):
        fused_attn(qkv(rng), config=make_config(mask=mask), sequence=sequence)


# --------------------------------------------------------------------------- masked NaN


@pytest.mark.parametrize("poisoned", ["k", "v"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_masked_non_finite_keys_and_values_contribute_nothing(rng, poisoned, value):
    """The last token holds NaN/Inf; under causal masking no earlier query sees it."""
    config = make_config(backend="xla", mask="causal")
    q, k, v = qkv(rng)
    arrays = {"q": q, "k": k, "v": v}
    arrays[poisoned] = arrays[poisoned].at[:, -1].set(value)
    clean = reference_attention((q, k, v), config).out
    fn = lambda q, k, v: fused_attn((q, k, v), config=config)  # noqa: E731
    out = np.asarray(fn(arrays["q"], arrays["k"], arrays["v"]))
    assert_close(out[:, :-1], clean[:, :-1], 1e-5)
    assert np.isnan(out[:, -1]).all()        # the query that sees it: no numbers
    grads = jax.grad(lambda *a: jnp.sum(fn(*a)[:, :-1] ** 2), argnums=(0, 1, 2))(
        arrays["q"], arrays["k"], arrays["v"])
    for name, grad in zip("qkv", grads):
        assert np.isfinite(np.asarray(grad)[:, :-1]).all(), name


def test_padding_key_nan_does_not_leak_into_real_rows(rng):
    config = make_config(backend="xla", mask="padding")
    q, k, v = qkv(rng)
    sequence = SequenceDescriptor.from_seqlens(np.array([5, 8], np.int32),
                                               np.array([5, 8], np.int32))
    poisoned_v = v.at[0, 5:].set(jnp.nan)
    out = fused_attn((q, k, poisoned_v), config=config, sequence=sequence)
    assert_close(out, reference_attention((q, k, v), config, sequence=sequence).out, 1e-5)


# --------------------------------------------------------------------------- exact masks


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_explicit_mask_is_exact_at_huge_logits(rng, dtype, framework):
    """Scaled scores of 48000 and 96000: the masked key's lead (48000) is beyond float16's
    old mask bias (-32752), yet it must never win."""
    b, f, h = 1, 8, 1
    config = make_config(backend="xla", mask="no_mask", scale=1.0)
    x = jnp.asarray(np.concatenate([np.ones((b, 1, f)), rng.uniform(1.9, 2.1, (b, 1, f))], 1),
                    dtype)
    mask = jnp.array([[True, False], [True, True]])[None, None]  # query 0 may not see key 1
    kernel = np.eye(f, dtype=np.float32)[:, None, :] * 0        # query/key -> [f, h, d]
    kernel[:, 0, :] = np.eye(f) * np.sqrt(48000 / f)  # q0.k0 = 48000, q0.k1 about 96000
    if framework == "linen":
        layer = linen.MultiHeadAttention(h, config=config, dtype=dtype, use_bias=False)
        params = layer.init(jax.random.key(0), x)
        for name in ("query", "key"):
            params["params"][name]["kernel"] = jnp.asarray(kernel)
        out = layer.apply(params, x, mask=mask)
        value = lambda t: t @ params["params"]["value"]["kernel"].reshape(f, f)  # noqa: E731
        proj = params["params"]["out"]["kernel"].reshape(f, f)
    else:
        layer = nnx.MultiHeadAttention(h, f, config=config, dtype=dtype, use_bias=False,
                                       rngs=fnnx.Rngs(0))
        layer.query.kernel[...] = jnp.asarray(kernel)
        layer.key.kernel[...] = jnp.asarray(kernel)
        out = layer(x, mask=mask)
        value = lambda t: t @ layer.value.kernel[...].reshape(f, f)  # noqa: E731
        proj = layer.out.kernel[...].reshape(f, f)
    # Query 0 sees only key 0: its output is token 0's projected value, exactly.
    expected = np.asarray(value(x[:, 0].astype(jnp.float32)) @ proj, np.float32)
    assert_close(np.asarray(out[:, 0], np.float32), expected, 4 * tolerance(dtype))


def test_fully_masked_rows_of_an_explicit_mask_give_zeros_and_finite_grads(rng):
    layer = nnx.MultiHeadAttention(H, 16, config=make_config(backend="xla", mask="causal"),
                                   rngs=fnnx.Rngs(1))
    x = random_array(rng, (B, S, 16))
    mask = jnp.ones((B, 1, S, S), bool).at[:, :, 2].set(False)   # query 2 sees nothing
    out = layer(x, mask=mask)
    assert np.all(np.asarray(out[:, 2]) == 0) and np.isfinite(np.asarray(out)).all()
    grad = jax.grad(lambda x: jnp.sum(layer(x, mask=mask) ** 2))(x)
    assert np.isfinite(np.asarray(grad)).all()


# --------------------------------------------------------------------------- decode


def test_nnx_decode_past_max_len_raises_eagerly_and_marks_nan_under_jit(rng):
    layer = nnx.MultiHeadAttention(H, 16, config=make_config(), rngs=fnnx.Rngs(0))
    x = random_array(rng, (B, 4, 16))
    layer.init_cache(x.shape)
    for i in range(4):
        layer(x[:, i:i + 1], decode=True)
    with pytest.raises(ValueError, match="the KV cache holds 4 positions, 4 are used"):
        layer(x[:, :1], decode=True)

    layer.init_cache(x.shape)
    step = fnnx.jit(lambda m, t: m(t, decode=True))
    outs = [np.asarray(step(layer, x[:, i % 4:i % 4 + 1])) for i in range(5)]
    assert all(np.isfinite(o).all() for o in outs[:4]) and np.isnan(outs[4]).all()

    layer.init_cache(x.shape)
    graph, state = fnnx.split(layer)

    def pure(state, t):
        module = fnnx.merge(graph, state)
        return module(t, decode=True), fnnx.state(module)

    checked = checkify.checkify(jax.jit(pure))
    for i in range(4):
        error, (_, state) = checked(state, x[:, i:i + 1])
        assert error.get() is None
    error, _ = checked(state, x[:, :1])
    assert "decode: the KV cache holds 4 positions" in error.get()


def test_linen_decode_past_max_len_marks_nan_under_jit(rng):
    module = linen.MultiHeadAttention(H, config=make_config(), decode=True)
    x = random_array(rng, (B, 2, 16))
    variables = module.init(jax.random.key(0), x)
    step = jax.jit(lambda v, t: module.apply(v, t, mutable=["cache"]))
    cache = variables["cache"]
    for i in range(2):
        out, new = step({**variables, "cache": cache}, x[:, i:i + 1])
        cache = new["cache"]
        assert np.isfinite(np.asarray(out)).all()
    out, _ = step({**variables, "cache": cache}, x[:, :1])
    assert np.isnan(np.asarray(out)).all()


# --------------------------------------------------------------------------- limits, messages


@pytest.mark.parametrize("make", [
    lambda: nnx.MultiHeadAttention(0, 16, config=make_config(), rngs=fnnx.Rngs(0)),
    lambda: linen.MultiHeadAttention(0, config=make_config()).init(
        jax.random.key(0), jnp.ones((1, 2, 16))),
    lambda: equinox.MultiheadAttention(0, 16, config=make_config(), key=jax.random.key(0)),
], ids=["nnx", "linen", "equinox"])
def test_zero_heads_is_an_error_not_a_division(make):
    with pytest.raises(ValueError, match=r"num_heads: expected an int >= 1, got 0"):
        make()


def test_zero_head_dim_is_an_error():
    with pytest.raises(ValueError, match=r"head dim: the q/k head dim is 0"):
        equinox.MultiheadAttention(4, 16, qk_size=0, config=make_config(), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"head dim: the q/k head dim is 0"):
        equinox.MultiheadAttention(32, 16, config=make_config(), key=jax.random.key(0))


def test_explicit_mask_with_a_backend_without_bias_says_how_masks_travel(rng):
    layer = nnx.MultiHeadAttention(H, 16, config=make_config(backend="small_seq"),
                                   rngs=fnnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mask: an explicit mask travels to the op as a bias "
                       r"array .* config.backend 'small_seq' cannot serve it: small_seq: .*"
                       r"Backends that serve this call: .*xla"):
        layer(random_array(rng, (B, S, 16)), mask=jnp.ones((B, 1, S, S), bool))


def test_nnx_rngs_without_a_dropout_stream_names_it(rng):
    layer = nnx.MultiHeadAttention(H, 16, config=make_config(dropout_rate=0.1),
                                   rngs=fnnx.Rngs(0))
    with pytest.raises(ValueError, match=r"dropout_rng: .* rngs=nnx.Rngs\(dropout=...\).* "
                       r"without a 'dropout' stream"):
        layer(random_array(rng, (B, S, 16)), deterministic=False, rngs=fnnx.Rngs(params=1))
