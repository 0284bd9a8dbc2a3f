"""Config knobs reach the op from all three layers; shared mask/bias/RoPE logic.

Each knob test compares the layer with a reference that projects with the
layer's own weights and calls fusedattn.ops.fused_attn directly with the same
config, and checks the knob changes the result (so an ignored knob fails).
"""

from __future__ import annotations

import collections
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

import fusedattn.ops
from fusedattn import ops
from fusedattn.configs import attention_config
from fusedattn.layers import attention_fn, common, equinox, linen, nnx
from fusedattn.ops import AttentionSpec, SequenceDescriptor
from fusedattn.ops.backends.cudnn import library as cudnn_library

from conftest import fake_cudnn_for_cuda_lowering

B, S, F, H = 2, 6, 16, 4
D = F // H
X = jax.random.normal(jax.random.key(0), (B, S, F), jnp.float32)
TOL = dict(rtol=2e-5, atol=2e-5)


def make_config(**changes):
    config = attention_config()
    for key, value in changes.items():
        target = config
        *path, leaf = key.split(".")
        for part in path:
            target = target[part]
        target[leaf] = value
    return config


# --------------------------------------------------------------------------- adapters


class LinenAdapter:
    name = "linen"

    def __init__(self, config, init_kwargs=None, **kwargs):
        self.module = linen.MultiHeadAttention(H, config=config, **kwargs)
        init_kwargs = {"deterministic": True, **(init_kwargs or {})}
        self.params = self.module.init(jax.random.key(1), X, **init_kwargs)

    def __call__(self, x, *, mask=None, bias=None, sequence=None, train=False, rng=None):
        rngs = {} if rng is None else {"dropout": rng}
        return self.module.apply(self.params, x, mask=mask, bias=bias, sequence=sequence,
                                 deterministic=not train, rngs=rngs)

    def project(self, x):
        p = self.params["params"]
        return tuple(jnp.einsum("bsf,fhd->bshd", x, p[n]["kernel"]) + p[n]["bias"]
                     for n in ("query", "key", "value"))

    def output(self, o):
        p = self.params["params"]["out"]
        return jnp.einsum("bshd,hdf->bsf", o, p["kernel"]) + p["bias"]

    def set_offset(self, value):
        self.params = jax.tree.map(lambda a: a, self.params)
        self.params["params"]["softmax_offset"] = value

    def offset(self):
        return self.params["params"]["softmax_offset"]


class NnxAdapter:
    name = "nnx"

    def __init__(self, config, init_kwargs=None, **kwargs):
        self.module = nnx.MultiHeadAttention(H, F, config=config, rngs=flax_nnx.Rngs(1),
                                             **kwargs)

    def __call__(self, x, *, mask=None, bias=None, sequence=None, train=False, rng=None):
        rngs = None if rng is None else flax_nnx.Rngs(dropout=rng)
        return self.module(x, mask=mask, bias=bias, sequence=sequence,
                           deterministic=not train, rngs=rngs)

    def project(self, x):
        m = self.module
        return m.query(x), m.key(x), m.value(x)

    def output(self, o):
        return self.module.out(o)

    def set_offset(self, value):
        self.module.softmax_offset[...] = value

    def offset(self):
        return self.module.softmax_offset[...]


class EqxAdapter:
    name = "equinox"

    def __init__(self, config, init_kwargs=None, **kwargs):
        self.module = equinox.MultiheadAttention(H, F, config=config, use_query_bias=True,
                                                 use_output_bias=True, key=jax.random.key(1),
                                                 **kwargs)

    def __call__(self, x, *, mask=None, bias=None, sequence=None, train=False, rng=None):
        keys = None if rng is None else jax.random.split(rng, x.shape[0])
        unbatched_bias = None if bias is None else (bias if bias.ndim == 1 else bias[0])

        def one(x, mask, sequence, key):
            return self.module(x, x, x, mask, bias=unbatched_bias, sequence=sequence, key=key,
                               inference=not train)

        return jax.vmap(one)(x, mask, sequence, keys)

    def project(self, x):
        m = self.module

        def proj(linear, heads):
            y = x @ linear.weight.T
            if linear.bias is not None:
                y = y + linear.bias
            return y.reshape(*x.shape[:-1], heads, -1)

        h_kv = m.num_kv_heads
        return proj(m.query_proj, H), proj(m.key_proj, h_kv), proj(m.value_proj, h_kv)

    def output(self, o):
        p = self.module.output_proj
        return o.reshape(*o.shape[:2], -1) @ p.weight.T + p.bias

    def set_offset(self, value):
        self.module = eqx.tree_at(lambda m: m.softmax_offset, self.module, value)

    def offset(self):
        return self.module.softmax_offset


ADAPTERS = [LinenAdapter, NnxAdapter, EqxAdapter]
adapters = pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.name)


def reference(layer, x, config, **op_kwargs):
    q, k, v = layer.project(x)
    return layer.output(ops.fused_attn((q, k, v), config=config, **op_kwargs))


def assert_close(a, b, **tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               **(tol or TOL))


def assert_differs(a, b):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) > 1e-4


@pytest.fixture
def captured(monkeypatch):
    """Records (arrays, spec) of every fused_attn call the layers make."""
    calls = []
    original = fusedattn.ops.fused_attn

    def recording(qkv, **kwargs):
        calls.append((tuple(qkv), AttentionSpec.from_config(kwargs["config"])))
        return original(qkv, **kwargs)

    monkeypatch.setattr(fusedattn.ops, "fused_attn", recording)
    return calls


# --------------------------------------------------------------------------- knobs, numerically


@adapters
@pytest.mark.parametrize("changes, baseline", [
    ({"mask": "causal"}, {"mask": "no_mask"}),
    ({"mask": "no_mask", "softmax": "off_by_one"}, {"mask": "no_mask"}),
    ({"scale": 0.9}, {}),
    ({"window_size": (1, -1)}, {}),
    ({"mask": "no_mask", "window_size": (1, 1)}, {"mask": "no_mask"}),
    ({"mask": "causal_bottom_right", "bias": "alibi"}, {"mask": "causal_bottom_right"}),
], ids=["mask", "softmax_off_by_one", "scale", "window_causal", "window_no_mask", "alibi"])
def test_knob_reaches_op(adapter, changes, baseline):
    config = make_config(**changes)
    layer = adapter(config)
    out = layer(X)
    assert_close(out, reference(layer, X, config))
    assert_differs(out, reference(layer, X, make_config(**baseline)))


@adapters
@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
def test_bias_knob(adapter, bias_type):
    config = make_config(bias=bias_type)
    bias = jax.random.normal(jax.random.key(3), (1, H, S, S))
    layer = adapter(config, init_kwargs={"bias": bias})
    out = layer(X, bias=bias)
    assert_close(out, reference(layer, X, config, bias=bias))
    other = "pre_scale_bias" if bias_type == "post_scale_bias" else "post_scale_bias"
    assert_differs(out, reference(layer, X, make_config(bias=other), bias=bias))


@adapters
def test_learnable_softmax_offset_is_a_parameter(adapter):
    config = make_config(softmax="learnable")
    layer = adapter(config)
    offset = layer.offset()
    assert offset.shape == (H,) and offset.dtype == jnp.float32
    np.testing.assert_array_equal(offset, 0.0)
    value = jnp.arange(1.0, H + 1.0, dtype=jnp.float32)
    before = layer(X)
    layer.set_offset(value)
    out = layer(X)
    assert_close(out, reference(layer, X, config, softmax_offset=value))
    assert_differs(out, before)


@adapters
def test_dropout_rate_knob(adapter):
    layer = adapter(make_config(dropout_rate=0.5))
    key = jax.random.key(7)
    train = layer(X, train=True, rng=key)
    assert_close(train, layer(X, train=True, rng=key))          # same key, same output
    assert_differs(train, layer(X, train=True, rng=jax.random.key(8)))
    evaluation = layer(X, train=False)
    assert_close(evaluation, reference(layer, X, make_config()))  # deterministic: no dropout
    assert_differs(train, evaluation)


@adapters
def test_padding_mask_with_sequence_descriptor(adapter):
    config = make_config(mask="padding_causal")
    sequence = SequenceDescriptor.from_seqlens(jnp.array([4, 6]), jnp.array([4, 6]))
    layer = adapter(config, init_kwargs={"sequence": sequence})
    out = layer(X, sequence=sequence)
    assert_close(out, reference(layer, X, config, sequence=sequence))
    assert_differs(out, reference(layer, X, make_config()))


@adapters
def test_sequence_format_mismatch_raises(adapter):
    config = make_config(mask="padding", **{"sequence.format": "seqlens"})
    ids = jnp.array([[1, 1, 1, 2, 2, 0]] * B)
    sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
    with pytest.raises(ValueError, match="config.sequence.format is 'seqlens'"):
        adapter(config, init_kwargs={"sequence": sequence})(X, sequence=sequence)


@adapters
def test_cudnn_backend_raises_on_cpu(adapter):
    if jax.devices()[0].platform != "cpu":
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ValueError, match="cudnn: needs a CUDA GPU"):
        adapter(make_config(backend="cudnn"))(X)


@adapters
def test_small_seq_backend_named_gives_its_reason(adapter):
    with pytest.raises(ValueError, match="small_seq"):
        adapter(make_config(backend="small_seq"))(X)


@adapters
def test_static_knobs_reach_the_op(adapter, captured):
    config = make_config(deterministic_backward=True, **{
        "small_seq.enabled": True, "sequence.max_seqlen_q": S, "sequence.max_seqlen_kv": S,
        "sequence.max_segments_per_seq": 2, "backend": "xla"})
    adapter(config)(X)
    _, spec = captured[-1]
    assert spec.deterministic_backward and spec.small_seq_enabled
    assert (spec.max_seqlen_q, spec.max_seqlen_kv, spec.max_segments_per_seq) == (S, S, 2)
    assert spec.backend == "xla"


@adapters
@pytest.mark.parametrize("layout, shapes", [
    ("sbhd_sbhd_sbhd", [(S, "b", H, D)] * 3),
    ("bs3hd", [("b", S, 3, H, D)]),
    ("bshd_bs2hd", [("b", S, H, D), ("b", S, 2, H, D)]),
    ("sb3hd", [(S, "b", 3, H, D)]),
])
def test_layout_family_and_packing_reach_the_op(adapter, captured, layout, shapes):
    layer = adapter(make_config(qkv_layout=layout))
    out = layer(X)
    arrays, spec = captured[-1]
    assert str(spec.qkv_layout) == layout
    batch = 1 if adapter is EqxAdapter else B  # Equinox: traced inside jax.vmap, one example
    shapes = [tuple(batch if n == "b" else n for n in shape) for shape in shapes]
    assert [tuple(a.shape) for a in arrays] == shapes
    assert_close(out, reference(layer, X, make_config()))


# --------------------------------------------------------------------------- explicit masks


@adapters
def test_explicit_mask_is_anded_with_config_mask(adapter):
    mask = jax.random.bernoulli(jax.random.key(4), 0.7, (B, 1, S, S))
    causal = jnp.tril(jnp.ones((S, S), bool))
    causal_layer = adapter(make_config(mask="causal"))
    plain_layer = adapter(make_config(mask="no_mask"))
    assert_close(causal_layer(X, mask=mask), plain_layer(X, mask=mask & causal))
    assert_differs(causal_layer(X, mask=mask), plain_layer(X, mask=mask))


@adapters
def test_rows_without_visible_keys_are_zero(adapter):
    mask = jnp.ones((B, 1, S, S), bool).at[:, :, 2, :].set(False)
    layer = adapter(make_config())
    out = layer(X, mask=mask)
    assert not np.any(np.isnan(out))
    empty_row = layer.output(jnp.zeros((B, S, H, D)))[:, 2]  # the output bias alone
    np.testing.assert_allclose(out[:, 2], empty_row, atol=1e-6)
    # a row whose only mask-visible key is hidden by the causal config mask is empty too
    only_future = jnp.ones((B, 1, S, S), bool).at[:, :, 1, :].set(
        jnp.arange(S) == S - 1)
    np.testing.assert_allclose(layer(X, mask=only_future)[:, 1], empty_row, atol=1e-6)


def test_mask_errors_name_the_problem():
    with pytest.raises(TypeError, match="mask: expected a boolean array"):
        common.broadcast_mask(jnp.ones((S, S), jnp.complex64), (B,), H, S, S)
    with pytest.raises(ValueError, match=r"mask: expected a mask of shape broadcastable to "
                                         r"\[batch..., heads, q, kv\]"):
        common.broadcast_mask(jnp.ones((B, 3, S, S), bool), (B,), H, S, S)
    with pytest.raises(ValueError, match="got \\(5, 6\\)"):
        common.broadcast_mask(jnp.ones((5, S), bool), (B,), H, S, S)


def test_masks_broadcast_over_batch_and_heads():
    mask = jnp.tril(jnp.ones((S, S), bool))
    assert common.broadcast_mask(mask, (B,), H, S, S).shape == (1, 1, S, S)
    assert common.broadcast_mask(jnp.ones((B, H, S, S)), (B,), H, S, S).dtype == jnp.bool_
    assert common.broadcast_mask(jnp.ones((3, 1, 1, 1, S), bool), (3, B), H, S, S).shape == (
        3 * B, 1, S, S)


def test_mask_with_alibi_raises():
    with pytest.raises(ValueError, match="config.bias is 'alibi'"):
        LinenAdapter(make_config(bias="alibi"))(X, mask=jnp.ones((S, S), bool))


def test_explain_shows_the_verdict_for_the_mask_bias():
    spec = common.spec_with_mask(make_config())
    assert spec.bias == "post_scale_bias"
    q = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)
    explanation = ops.explain((q, q, q), config=spec,
                              bias=jax.ShapeDtypeStruct((B, 1, S, S), jnp.float32))
    assert explanation.backend is not None
    assert explanation.verdicts["xla"] is None


# --------------------------------------------------------------------------- RoPE and packing


def test_rope_rotates_pairs_by_position():
    x = jax.random.normal(jax.random.key(5), (1, 3, 2, 8))
    positions = jnp.array([[0, 1, 5]])
    out = common.apply_rope(x, positions, 10000.0)
    np.testing.assert_allclose(out[:, 0], x[:, 0], rtol=1e-6)  # position 0: identity
    np.testing.assert_allclose(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    # relative: <rope(q, m), rope(k, n)> depends on m - n only
    q, k = x[:, :1, :1], x[:, 1:2, :1]
    dot = lambda m, n: jnp.sum(common.apply_rope(q, jnp.array([[m]]), 1e4)
                               * common.apply_rope(k, jnp.array([[n]]), 1e4))
    np.testing.assert_allclose(dot(3, 1), dot(7, 5), rtol=1e-5)


PACKINGS = {
    "segment_ids": (
        {"mask": "padding_causal", "sequence.format": "segment_ids"},
        lambda: SequenceDescriptor.from_segment_ids_and_pos(
            *[jnp.array([[1] * 4 + [2] * 2] * B)] * 2)),
    "thd_offsets": (
        {"mask": "padding_causal", "qkv_layout": "thd_thd_thd",
         "sequence.format": "seqlens_offsets", "sequence.max_segments_per_seq": 2},
        lambda: SequenceDescriptor.from_seqlens_and_offsets(
            *[jnp.array([[4, 2]] * B)] * 2, *[jnp.array([[0, 4, 6]] * B)] * 2)),
}


@adapters
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_packed_sequences_with_rope_equal_separate_sequences(adapter, packing, captured):
    """Two sequences packed in one row = each alone (RoPE positions restart per segment)."""
    changes, make_sequence = PACKINGS[packing]
    sequence = make_sequence()
    layer = adapter(make_config(**changes), init_kwargs={"sequence": sequence}, rope=True)
    packed = layer(X, sequence=sequence)
    assert str(captured[-1][1].qkv_layout) == changes.get("qkv_layout", "bshd_bshd_bshd")
    alone = adapter(make_config(), rope=True)  # same init key: same weights
    first = alone(X[:, :4])
    second = alone(X[:, 4:])
    assert_close(packed, jnp.concatenate([first, second], axis=1))


# --------------------------------------------------------------------------- attention_fn


def test_attention_fn_rejects_learnable_softmax():
    with pytest.raises(ValueError, match="'learnable' needs a per-head softmax_offset"):
        attention_fn(make_config(softmax="learnable"))


def test_attention_fn_reads_the_config():
    fn = attention_fn(make_config(mask="causal", scale=0.7))
    q, k, v = (jax.random.normal(jax.random.key(i), (B, S, H, D)) for i in range(3))
    assert_close(fn(q, k, v), ops.fused_attn((q, k, v), config=make_config(scale=0.7)))
    # no batch axis, and several
    assert_close(fn(q[0], k[0], v[0]), fn(q, k, v)[0])
    assert_close(fn(q[None], k[None], v[None])[0], fn(q, k, v))


def test_attention_fn_dropout_rate_must_agree_with_config():
    fn = attention_fn(make_config(dropout_rate=0.1))
    q = jnp.ones((B, S, H, D))
    with pytest.raises(ValueError, match="config.dropout_rate is 0.1 but the module's "
                                         "dropout_rate is 0.0"):
        fn(q, q, q, dropout_rate=0.0, deterministic=True)
    with pytest.raises(ValueError, match="the module passes 0.2 but config.dropout_rate is 0.1"):
        fn(q, q, q, dropout_rate=0.2, deterministic=True)
    with pytest.raises(ValueError, match="dropout_rng: config.dropout_rate is 0.1"):
        fn(q, q, q, dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="sow_weights"):
        attention_fn(make_config())(q, q, q, module=object())


def test_packed_layout_the_arrays_cannot_take_raises():
    module = linen.MultiHeadAttention(H, config=make_config(qkv_layout="bs3hd"))
    y = jnp.ones((B, 4, F))
    with pytest.raises(ValueError, match="config.qkv_layout: 'bs3hd' packs q, k and v into one "
                                         "array, which needs self-attention"):
        module.init(jax.random.key(0), X, y)
    gqa = linen.MultiHeadAttention(H, config=make_config(qkv_layout="sbhd_sb2hd"), num_kv_heads=2)
    assert gqa.apply(gqa.init(jax.random.key(0), X, y), X, y).shape == (B, S, F)


# --------------------------------------------------------------------------- lowered programs


def _lowered_step_ops(apply, params, x) -> collections.Counter:
    """Op histogram of jit(vjp of apply w.r.t. (params, x)), lowered for CUDA: the
    benchmarks/layers.py step (the forward output itself is not returned)."""

    def step(params, x, cotangent):
        out, vjp = jax.vjp(apply, params, x)
        return vjp(cotangent.astype(out.dtype))

    lowered = jax.jit(step).trace(params, x, x).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    ops = collections.Counter(re.findall(r"=\s*\"?([a-z_]+\.[a-z_.]+)", text))
    ops.update(f"target:{t}" for t in re.findall(r"stablehlo\.custom_call @(\w+)", text))
    return ops


def test_linen_and_nnx_lower_to_the_same_cuda_program(monkeypatch, request):
    """Issue 4: linen timed 8% slower than nnx on the H200 in benchmarks/layers.py. The
    fwd+bwd step of the two layers (bf16 compute, float32 params, causal, cuDNN), lowered
    for CUDA, is the same program op for op, with no dropout RNG or mask construction, so
    a gap between them is not in the layers. Equinox (vmapped) adds only reshapes and
    transposes. Lowered without a GPU (conftest.fake_cudnn_for_cuda_lowering)."""
    b, s, f, h = 2, 128, 256, 2  # head dim 128
    config = make_config(mask="causal")
    x = jax.random.normal(jax.random.key(0), (b, s, f), jnp.bfloat16)
    lin = linen.MultiHeadAttention(h, config=config, dtype=jnp.bfloat16)
    lin_params = lin.init(jax.random.key(1), x)  # runs on the CPU backend, before the fakes
    graphdef, state = flax_nnx.split(nnx.MultiHeadAttention(
        h, f, config=config, dtype=jnp.bfloat16, rngs=flax_nnx.Rngs(0)))
    eqx_params, eqx_static = eqx.partition(
        equinox.MultiheadAttention(h, f, config=config, compute_dtype=jnp.bfloat16,
                                   key=jax.random.key(2)), eqx.is_array)
    fake_cudnn_for_cuda_lowering(monkeypatch, request)

    def eqx_apply(params, x):
        layer = eqx.combine(params, eqx_static)
        return jax.vmap(lambda row: layer(row, row, row))(x)

    lin_ops = _lowered_step_ops(lambda p, x: lin.apply(p, x), lin_params, x)
    nnx_ops = _lowered_step_ops(lambda st, x: flax_nnx.merge(graphdef, st)(x), state, x)
    eqx_ops = _lowered_step_ops(eqx_apply, eqx_params, x)
    targets = {f"target:{cudnn_library.FWD_TARGET}": 1, f"target:{cudnn_library.BWD_TARGET}": 1}
    for ops_ in (lin_ops, nnx_ops, eqx_ops):
        assert {k: v for k, v in ops_.items() if k.startswith("target:")} == targets, ops_
        # 3 projections + 2 for the output projection's grads + 2 per q/k/v projection's grads
        assert ops_["stablehlo.dot_general"] == 11, ops_
        extra = {"stablehlo.rng_bit_generator", "stablehlo.iota", "stablehlo.compare",
                 "stablehlo.select", "stablehlo.while", "func.call"} & set(ops_)
        assert not extra, (extra, ops_)
    assert lin_ops == nnx_ops, {k: (lin_ops[k], nnx_ops[k]) for k in lin_ops | nnx_ops
                                if lin_ops[k] != nnx_ops[k]}
    layout_ops = {"stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim"}
    assert all(eqx_ops[k] <= nnx_ops[k] for k in nnx_ops | eqx_ops if k not in layout_ops), (
        eqx_ops, nnx_ops)
