"""Every user mistake raises before any kernel runs, with the type and argument API.md names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_config
from fusedattn.ops import SequenceDescriptor, explain, fused_attn

B, S, H, D = 2, 4, 4, 8


def zeros(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def bshd(b=B, s=S, h=H, d=D, dtype=jnp.float32):
    return zeros(b, s, h, d, dtype=dtype)


def seqlens(b=B, n=S):
    return SequenceDescriptor.from_seqlens(np.full(b, n, np.int32), np.full(b, n, np.int32))


def both_entry_points(qkv, config, **kw):
    """Yields a thunk calling fused_attn and one calling explain (where explain takes the args)."""
    explain_kw = {k: v for k, v in kw.items() if k in ("bias", "sequence")}
    yield lambda: fused_attn(qkv, config=config, **kw)
    yield lambda: explain(qkv, config=config, **explain_kw)


def raises_both(exc, match, qkv, config, **kw):
    for call in both_entry_points(qkv, config, **kw):
        with pytest.raises(exc, match=match):
            call()


# --------------------------------------------------------------------------- arrays vs layout

@pytest.mark.parametrize("layout,qkv", [
    ("bs3hd", (bshd(), bshd(), bshd())),
    ("bs3hd", (zeros(B, S, 3, H, D), bshd())),
    ("bshd_bs2hd", (bshd(),)),
    ("bshd_bs2hd", (bshd(), bshd(), bshd())),
    ("bshd_bshd_bshd", (bshd(), bshd())),
    ("sbhd_sbhd_sbhd", (bshd(),)),
    ("thd_thd_thd", (bshd(), bshd(), bshd(), bshd())),
    ("t3hd", ()),
])
def test_wrong_number_of_arrays(layout, qkv):
    config = make_config(backend="xla", qkv_layout=layout, mask="no_mask")
    raises_both(ValueError, rf"qkv: layout '{layout}' takes \d array", qkv, config)


def test_single_packed_array_need_not_be_a_tuple():
    config = make_config(backend="xla", qkv_layout="bs3hd", mask="no_mask")
    out = fused_attn(zeros(B, S, 3, H, D), config=config)
    assert out.shape == (B, S, H, D) and np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("layout,qkv,name", [
    ("bshd_bshd_bshd", (zeros(B, S, H), bshd(), bshd()), "q"),
    ("bshd_bshd_bshd", (bshd(), zeros(B, S, H, D, 1), bshd()), "k"),
    ("sbhd_sbhd_sbhd", (bshd(), bshd(), zeros(S, H, D)), "v"),
    ("bs3hd", (zeros(B, S, 3, H),), "qkv"),
    ("bshd_bs2hd", (bshd(), bshd()), "kv"),
    ("thd_thd_thd", (zeros(S, H, D), bshd(), bshd()), "q"),
])
def test_wrong_ndim(layout, qkv, name):
    config = make_config(backend="xla", qkv_layout=layout, mask="no_mask")
    raises_both(ValueError, rf"qkv: {name} must have shape", qkv, config)


@pytest.mark.parametrize("layout,qkv,name,size", [
    ("bs3hd", (zeros(B, S, 2, H, D),), "qkv", 3),
    ("sb3hd", (zeros(S, B, 4, H, D),), "qkv", 3),
    ("t3hd", (zeros(B, S, 1, H, D),), "qkv", 3),
    ("bshd_bs2hd", (bshd(), zeros(B, S, 3, H, D)), "kv", 2),
    ("thd_t2hd", (bshd(), zeros(B, S, 1, H, D)), "kv", 2),
])
def test_wrong_packed_axis_size(layout, qkv, name, size):
    config = make_config(backend="xla", qkv_layout=layout, mask="no_mask")
    raises_both(ValueError, rf"qkv: {name} must have size {size} on axis 2", qkv, config)


@pytest.mark.parametrize("dtypes", [
    (jnp.float32, jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32, jnp.float32),
])
def test_mixed_dtypes(dtypes):
    qkv = tuple(bshd(dtype=dt) for dt in dtypes)
    config = make_config(backend="xla", mask="no_mask")
    raises_both(TypeError, r"qkv: q, k, v must share one dtype", qkv, config)


def test_mixed_dtypes_packed_kv():
    qkv = (bshd(dtype=jnp.float16), zeros(B, S, 2, H, D, dtype=jnp.float32))
    config = make_config(backend="xla", qkv_layout="bshd_bs2hd", mask="no_mask")
    raises_both(TypeError, r"qkv: q, kv must share one dtype", qkv, config)


@pytest.mark.parametrize("dtype,name", [(jnp.int32, "q"), (jnp.int8, "k"), (jnp.bool_, "v"),
                                        (jnp.uint8, "q")])
def test_unsupported_dtype(dtype, name):
    qkv = [bshd(), bshd(), bshd()]
    qkv["qkv".index(name)] = bshd(dtype=dtype)
    config = make_config(backend="xla", mask="no_mask")
    raises_both(TypeError, rf"qkv: {name} has dtype .*expected bfloat16, float16 or float32",
                tuple(qkv), config)


def test_not_an_array_in_explain():
    config = make_config(backend="xla", mask="no_mask")
    with pytest.raises(TypeError, match=r"qkv: k must be an array, got str"):
        explain((bshd(), "k", bshd()), config=config)


@pytest.mark.parametrize("bad", ["k", None, object()])
def test_not_an_array_in_fused_attn(bad):
    """fused_attn names the argument too (not only JAX's own conversion error), like explain."""
    config = make_config(backend="xla", mask="no_mask")
    with pytest.raises((TypeError, ValueError), match=r"qkv"):
        fused_attn((bshd(), bad, bshd()), config=config)


def test_head_dim_mismatch():
    config = make_config(backend="xla", mask="no_mask")
    raises_both(ValueError, r"qkv: q head dim 8 differs from k head dim 4",
                (bshd(), bshd(d=4), bshd(d=4)), config)


def test_value_head_dim_may_differ():
    config = make_config(backend="xla", mask="no_mask")
    out = fused_attn((bshd(), bshd(), bshd(d=3)), config=config)
    assert out.shape == (B, S, H, 3)


@pytest.mark.parametrize("h,h_kv", [(4, 3), (3, 2), (2, 4)])
def test_heads_not_a_multiple(h, h_kv):
    config = make_config(backend="xla", mask="no_mask")
    raises_both(ValueError, rf"qkv: q has {h} heads and k/v {h_kv}.*multiple",
                (bshd(h=h), bshd(h=h_kv), bshd(h=h_kv)), config)


def test_batch_mismatch():
    config = make_config(backend="xla", mask="no_mask")
    raises_both(ValueError, r"qkv: batch sizes differ: q 2, k 3, v 3",
                (bshd(), bshd(b=3), bshd(b=3)), config)


@pytest.mark.parametrize("k,v", [(bshd(s=5), bshd(s=6)), (bshd(h=2), bshd(h=4))])
def test_key_value_disagree(k, v):
    config = make_config(backend="xla", mask="no_mask")
    raises_both(ValueError, r"qkv: k .* and v .* must agree", (bshd(), k, v), config)


# --------------------------------------------------------------------------- bias, offset

QKV = (bshd(), bshd(), bshd())


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
def test_missing_bias(bias_type):
    config = make_config(backend="xla", mask="no_mask", bias=bias_type)
    raises_both(ValueError, rf"bias: config.bias is '{bias_type}', which needs a bias array",
                QKV, config)


@pytest.mark.parametrize("bias", [zeros(1, 1, S, S), zeros(H)])
def test_unexpected_bias(bias):
    config = make_config(backend="xla", mask="no_mask")
    raises_both(ValueError, r"bias: config.bias is 'no_bias' but a bias array was passed",
                QKV, config, bias=bias)


@pytest.mark.parametrize("shape", [(H, S, S), (3, H, S, S), (B, 2, S, S), (1, 1, S, S + 1),
                                   (1, 1, S + 1, S), (1, 1, 1, S, S), (S, S)])
@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias"])
def test_bad_bias_shape(bias_type, shape):
    config = make_config(backend="xla", mask="no_mask", bias=bias_type)
    raises_both(ValueError, r"bias: expected shape \[b or 1, h or 1, sq, skv\]", QKV, config,
                bias=zeros(*shape))


@pytest.mark.parametrize("shape", [(H + 1,), (1, H), (1, H, S, S)])
def test_bad_alibi_slopes_shape(shape):
    config = make_config(backend="xla", mask="no_mask", bias="alibi")
    raises_both(ValueError, r"bias: with config.bias 'alibi' .*slopes of shape \[h\]", QKV,
                config, bias=zeros(*shape))


def test_integer_bias():
    config = make_config(backend="xla", mask="no_mask", bias="post_scale_bias")
    raises_both(TypeError, r"bias: expected a floating-point array", QKV, config,
                bias=jnp.zeros((1, 1, S, S), jnp.int32))


def test_missing_softmax_offset():
    config = make_config(backend="xla", mask="no_mask", softmax="learnable")
    with pytest.raises(ValueError, match=r"softmax_offset: config.softmax 'learnable' needs"):
        fused_attn(QKV, config=config)


@pytest.mark.parametrize("softmax", ["vanilla", "off_by_one"])
def test_unexpected_softmax_offset(softmax):
    config = make_config(backend="xla", mask="no_mask", softmax=softmax)
    with pytest.raises(ValueError, match=r"softmax_offset: only used with config.softmax"):
        fused_attn(QKV, config=config, softmax_offset=zeros(H))


@pytest.mark.parametrize("offset", [zeros(H + 1), zeros(1, H), jnp.zeros((H,), jnp.int32)])
def test_bad_softmax_offset(offset):
    config = make_config(backend="xla", mask="no_mask", softmax="learnable")
    with pytest.raises(ValueError, match=r"softmax_offset: expected a float32 array of shape"):
        fused_attn(QKV, config=config, softmax_offset=offset)


# --------------------------------------------------------------------------- descriptors

@pytest.mark.parametrize("layout,mask,why", [
    ("bshd_bshd_bshd", "padding", "padding masks"),
    ("sbhd_sbhd_sbhd", "padding_causal_bottom_right", "padding masks"),
    ("thd_thd_thd", "causal", "THD layouts"),
    ("t3hd", "no_mask", "THD layouts"),
])
def test_missing_descriptor(layout, mask, why):
    config = make_config(backend="xla", qkv_layout=layout, mask=mask)
    qkv = (zeros(B, S, 3, H, D),) if layout == "t3hd" else QKV
    raises_both(ValueError, rf"sequence: .*needs a SequenceDescriptor \({why}", qkv, config)


@pytest.mark.parametrize("sequence", [{"q_seqlens": [1, 2]}, (np.ones(B), np.ones(B)),
                                      np.ones(B, np.int32)])
def test_wrong_descriptor_type(sequence):
    config = make_config(backend="xla", mask="padding")
    raises_both(TypeError, r"sequence: expected a fusedattn.ops.SequenceDescriptor", QKV, config,
                sequence=sequence)


@pytest.mark.parametrize("make", [
    lambda: seqlens(b=3),
    lambda: SequenceDescriptor.from_segment_ids_and_pos(np.ones((1, S), np.int32),
                                                        np.ones((1, S), np.int32)),
    lambda: SequenceDescriptor.from_seqlens_and_offsets(
        np.ones((3, 1), np.int32), np.ones((3, 1), np.int32), np.zeros((3, 2), np.int32),
        np.zeros((3, 2), np.int32)),
])
def test_descriptor_batch_mismatch(make):
    config = make_config(backend="xla", mask="padding")
    raises_both(ValueError, r"sequence: descriptor batch \d differs from the q batch 2", QKV,
                config, sequence=make())


def test_segment_ids_length_mismatch():
    config = make_config(backend="xla", mask="padding")
    sequence = SequenceDescriptor.from_segment_ids_and_pos(np.ones((B, S + 1), np.int32),
                                                           np.ones((B, S), np.int32))
    raises_both(ValueError, r"sequence: segment ids cover 5 query and 4 key tokens", QKV, config,
                sequence=sequence)


@pytest.mark.parametrize("offsets_shape", [(B, 2), (B, 4), (B + 1, 3), (B,)])
def test_offsets_shape(offsets_shape):
    lengths = np.ones((B, 2), np.int32)
    with pytest.raises(ValueError, match=r"q_offsets: expected shape \[b, max_segments \+ 1\]"):
        SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths,
                                                    np.zeros(offsets_shape, np.int32),
                                                    np.zeros(offsets_shape, np.int32))


def test_kv_offsets_shape_differs():
    lengths = np.ones((B, 2), np.int32)
    with pytest.raises(ValueError, match=r"kv_offsets: expected shape \[b, max_segments \+ 1\] "
                                         r"= \(2, 3\) to match kv_seqlens"):
        SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths, np.zeros((B, 3), np.int32),
                                                    np.zeros((B, 4), np.int32))


@pytest.mark.parametrize("fmt,sequence,form", [
    ("seqlens", SequenceDescriptor.from_segment_ids_and_pos(np.ones((B, S), np.int32),
                                                            np.ones((B, S), np.int32)),
     "segment_ids"),
    ("segment_ids", seqlens(), "seqlens"),
    ("seqlens_offsets", seqlens(), "seqlens"),
    ("seqlens", SequenceDescriptor.from_seqlens_and_offsets(
        np.ones((B, 1), np.int32), np.ones((B, 1), np.int32), np.zeros((B, 2), np.int32),
        np.zeros((B, 2), np.int32)), "seqlens_offsets"),
])
def test_sequence_format_mismatch(fmt, sequence, form):
    config = make_config(backend="xla", mask="padding", sequence={"format": fmt})
    raises_both(ValueError, rf"sequence: config.sequence.format is '{fmt}' but the descriptor is "
                rf"of form '{form}'", QKV, config, sequence=sequence)


@pytest.mark.parametrize("fmt", ["none", "seqlens"])
def test_sequence_format_match_or_none_accepted(fmt):
    config = make_config(backend="xla", mask="padding", sequence={"format": fmt})
    out = fused_attn(QKV, config=config, sequence=seqlens())
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("call,match,exc", [
    (lambda: SequenceDescriptor.from_seqlens(np.ones(B, np.float32), np.ones(B, np.int32)),
     r"q_seqlens: expected an integer array", TypeError),
    (lambda: SequenceDescriptor.from_seqlens(np.ones(B, np.int32), [1.5, 2.0]),
     r"kv_seqlens: expected an integer array", TypeError),
    (lambda: SequenceDescriptor.from_seqlens(np.ones((B, 1), np.int32), np.ones((B, 1), np.int32)),
     r"q_seqlens: expected shape \[b\]", ValueError),
    (lambda: SequenceDescriptor.from_seqlens(np.ones(B, np.int32), np.ones(B + 1, np.int32)),
     r"kv_seqlens: expected the shape of q_seqlens", ValueError),
    (lambda: SequenceDescriptor.from_seqlens_and_offsets(
        np.ones(B, np.int32), np.ones(B, np.int32), np.zeros((B, 2), np.int32),
        np.zeros((B, 2), np.int32)), r"q_seqlens: expected shape \[b, max_segments\]", ValueError),
    (lambda: SequenceDescriptor.from_seqlens_and_offsets(
        np.ones((B, 2), np.int32), np.ones((B, 3), np.int32), np.zeros((B, 3), np.int32),
        np.zeros((B, 3), np.int32)), r"kv_offsets: expected shape \[b, max_segments \+ 1\] = "
        r"\(2, 4\) to match kv_seqlens", ValueError),
    (lambda: SequenceDescriptor.from_seqlens_and_offsets(
        np.ones((B, 2), np.int32), np.ones((B + 1, 2), np.int32), np.zeros((B, 3), np.int32),
        np.zeros((B + 1, 3), np.int32)), r"kv_seqlens: batch 3 differs from q_seqlens batch 2",
        ValueError),
    (lambda: SequenceDescriptor.from_seqlens_and_offsets(
        np.ones((B, 2), np.int32), np.ones((B, 2), np.int32), np.zeros((B, 3), np.float32),
        np.zeros((B, 3), np.int32)), r"q_offsets: expected an integer array", TypeError),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(np.ones(S, np.int32),
                                                         np.ones((B, S), np.int32)),
     r"q_segment_ids: expected shape \[b, sq\]", ValueError),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(np.ones((B, S), np.int32),
                                                         np.ones((B, S, 1), np.int32)),
     r"kv_segment_ids: expected shape \[b, skv\]", ValueError),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(np.ones((B, S), np.int32),
                                                         np.ones((B + 1, S), np.int32)),
     r"kv_segment_ids: batch 3 differs", ValueError),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(np.ones((B, S), np.bool_),
                                                         np.ones((B, S), np.int32)),
     r"q_segment_ids: expected an integer array", TypeError),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(
        np.ones((B, S), np.int32), np.ones((B, S), np.int32), np.ones((B, S + 1), np.int32)),
     r"q_segment_pos: expected the shape of q_segment_ids", ValueError),
    (lambda: SequenceDescriptor.from_segment_ids_and_pos(
        np.ones((B, S), np.int32), np.ones((B, S), np.int32), None, np.ones((B, 1), np.int32)),
     r"kv_segment_pos: expected the shape of kv_segment_ids", ValueError),
])
def test_descriptor_constructor_errors(call, match, exc):
    with pytest.raises(exc, match=match):
        call()


def test_descriptor_ignored_for_bshd_without_padding_is_still_not_required():
    config = make_config(backend="xla", mask="causal")
    out = fused_attn(QKV, config=config)
    assert np.all(np.isfinite(np.asarray(out)))


# --------------------------------------------------------------------------- dropout, backends

def test_dropout_without_rng():
    config = make_config(backend="xla", mask="no_mask", dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"dropout_rng: config.dropout_rate is 0.1 and "
                                         r"is_training=True"):
        fused_attn(QKV, config=config, is_training=True)


def test_dropout_without_rng_fine_when_not_training():
    config = make_config(backend="xla", mask="no_mask", dropout_rate=0.1)
    out = fused_attn(QKV, config=config)
    assert np.all(np.isfinite(np.asarray(out)))


def test_named_backend_cudnn_on_cpu():
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the message is about running on cpu")
    config = make_config(backend="cudnn", mask="no_mask")
    with pytest.raises(ValueError, match=r"config.backend='cudnn' cannot serve this call") as info:
        fused_attn(QKV, config=config)
    assert "cudnn: needs a CUDA GPU; this computation runs on cpu" in str(info.value)


def test_named_backend_small_seq_not_eligible():
    config = make_config(backend="small_seq", mask="no_mask")
    with pytest.raises(ValueError, match=r"config.backend='small_seq' cannot serve") as info:
        fused_attn(QKV, config=config)
    assert "small_seq:" in str(info.value)


def test_named_backend_flash_with_unsupported_feature():
    """flash has no FP8 path: naming flash for an FP8 call raises with its reason, it never
    falls back silently."""
    from fusedattn.ops import registry
    from fusedattn.ops.backends.base import CallShapes
    from fusedattn.ops.spec import AttentionSpec

    config = make_config(backend="flash", mask="no_mask", fp8={"enabled": True})
    shapes = CallShapes(batch=1, seqlen_q=S, seqlen_kv=S, num_heads=2, num_kv_heads=2,
                        head_dim_qk=64, head_dim_v=64, dtype=jnp.dtype(jnp.bfloat16),
                        bias_shape=None, dropout=False)
    with pytest.raises(ValueError, match=r"config.backend='flash' cannot serve") as info:
        registry.select(AttentionSpec.from_config(config), shapes, "cuda")
    assert "flash: no FP8 path yet (config.fp8.enabled)" in str(info.value)


def test_bad_config_value_raises_from_fused_attn():
    config = make_config(backend="xla")
    config.mask = "casual"
    with pytest.raises(ValueError, match=r"config.mask: got 'casual'"):
        fused_attn(QKV, config=config)
    with pytest.raises(ValueError, match=r"config.mask: got 'casual'"):
        explain(QKV, config=config)


def test_errors_raise_under_jit():
    config = make_config(backend="xla", mask="no_mask")

    @jax.jit
    def f(q, k, v):
        return fused_attn((q, k, v), config=config)

    with pytest.raises(ValueError, match=r"qkv: q head dim"):
        f(bshd(), bshd(d=4), bshd(d=4))


# --------------------------------------------------------------------------- limits (issue 30)


@pytest.mark.parametrize("key,value,match", [
    ("window_size", (2**31, -1), r"config.window_size: got \(2147483648, -1\); .* each in "
     r"\[0, 1073741823\]"),
    ("window_size", (-1, 2**30), r"config.window_size: got \(-1, 1073741824\)"),
    ("scale", float("inf"), r"config.scale: got inf; expected a positive finite number"),
    ("scale", float("nan"), r"config.scale: got nan; expected a positive finite number"),
])
def test_values_a_backend_cannot_represent_are_config_errors(key, value, match):
    with pytest.raises(ValueError, match=match):
        fused_attn(QKV, config=make_config(**{key: value}))


def test_head_dim_zero_is_an_error_not_a_division():
    empty = zeros(B, S, H, 0)
    with pytest.raises(ValueError, match=r"qkv: head dims must be >= 1, got q/k 0 and v 0"):
        fused_attn((empty, empty, empty), config=make_config(backend="xla"))


@pytest.mark.parametrize("key", [3, np.ones(2, np.float32), np.ones(3, np.uint32),
                                 "split"])
def test_a_bad_dropout_key_names_dropout_rng(key):
    if isinstance(key, str):
        key = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(TypeError, match=r"dropout_rng: expected one JAX PRNG key .* jax.vmap "
                       r"the call over the keys.*'dropout' RNG stream"):
        fused_attn(QKV, config=make_config(backend="xla", dropout_rate=0.1), dropout_rng=key,
                   is_training=True)
