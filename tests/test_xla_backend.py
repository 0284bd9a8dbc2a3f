"""The XLA backend (the oracle) and the front end against the float64 NumPy reference.

Every feature of API.md: 9 layouts, 6 masks, bias types and broadcast shapes, ALiBi,
3 softmax variants, windows, GQA/MQA, explicit scale, Dv != D, the three descriptor
forms, zero-length sequences and fully masked rows, three dtypes, gradients, dropout,
vmap, jit, NumPy inputs, and hypothesis-drawn cases.
"""

from __future__ import annotations

import dataclasses
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from conftest import assert_close, assert_finite, make_config, random_array, tolerance
from fusedattn.ops import AttentionSpec, SequenceDescriptor, fused_attn

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
GRAD_TOL = 2e-5  # float32 gradients vs float64


# --------------------------------------------------------------------------- descriptors

def _segments(rng, extent: int, n: int, min_length: int = 0) -> list[tuple[int, int]]:
    """n contiguous (start, length) segments from token 0, then trailing padding."""
    cuts = np.sort(rng.integers(0, extent - n * min_length + 1, size=n))
    lengths = np.diff(np.concatenate([[0], cuts])) + min_length
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [(int(s), int(l)) for s, l in zip(starts, lengths)]


def seqlens_form(rng, b, sq, skv, q_lens=None, kv_lens=None) -> dict:
    return {"q_seqlens": np.asarray(rng.integers(1, sq + 1, b) if q_lens is None else q_lens,
                                    np.int32),
            "kv_seqlens": np.asarray(rng.integers(1, skv + 1, b) if kv_lens is None else kv_lens,
                                     np.int32)}


def offsets_form(rng, b, sq, skv, slots, used=None, min_length=0) -> dict:
    """THD packing: [b, slots] lengths and [b, slots + 1] offsets, unused slots -1."""
    q_len = np.full((b, slots), -1, np.int32)
    kv_len = np.full((b, slots), -1, np.int32)
    q_off = np.full((b, slots + 1), -1, np.int32)
    kv_off = np.full((b, slots + 1), -1, np.int32)
    for row in range(b):
        n = int(rng.integers(1, slots + 1)) if used is None else used[row]
        for lengths, offsets, extent in ((q_len, q_off, sq), (kv_len, kv_off, skv)):
            segs = _segments(rng, extent, n, min_length)
            for slot, (start, length) in enumerate(segs):
                lengths[row, slot], offsets[row, slot] = length, start
            offsets[row, n] = segs[-1][0] + segs[-1][1]
    return {"q_seqlens": q_len, "kv_seqlens": kv_len, "q_offsets": q_off, "kv_offsets": kv_off}


def segment_ids_form(rng, b, sq, skv, segments, with_pos=False) -> dict:
    """Contiguous segments with increasing (not necessarily consecutive) ids, 0-padded."""
    q_ids = np.zeros((b, sq), np.int32)
    kv_ids = np.zeros((b, skv), np.int32)
    q_pos = np.zeros((b, sq), np.int32)
    kv_pos = np.zeros((b, skv), np.int32)
    for row in range(b):
        n = int(rng.integers(1, min(segments, sq, skv) + 1))
        ids = np.sort(rng.choice(np.arange(1, 10), size=n, replace=False))
        for id_array, pos_array, extent in ((q_ids, q_pos, sq), (kv_ids, kv_pos, skv)):
            for segment, (start, length) in zip(ids, _segments(rng, extent, n, min_length=1)):
                id_array[row, start:start + length] = segment
                pos_array[row, start:start + length] = np.arange(length) + rng.integers(0, 3)
    out = {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids}
    if with_pos:
        out.update(q_segment_pos=q_pos, kv_segment_pos=kv_pos)
    return out


def descriptor(fields: dict | None) -> SequenceDescriptor | None:
    if fields is None:
        return None
    if "q_segment_ids" in fields:
        return SequenceDescriptor.from_segment_ids_and_pos(
            fields["q_segment_ids"], fields["kv_segment_ids"], fields.get("q_segment_pos"),
            fields.get("kv_segment_pos"))
    if "q_offsets" in fields:
        return SequenceDescriptor.from_seqlens_and_offsets(
            fields["q_seqlens"], fields["kv_seqlens"], fields["q_offsets"], fields["kv_offsets"])
    return SequenceDescriptor.from_seqlens(fields["q_seqlens"], fields["kv_seqlens"])


def make_fields(rng, form, b, sq, skv, slots=3):
    if form is None:
        return None
    if form == "seqlens":
        return seqlens_form(rng, b, sq, skv)
    if form == "seqlens_offsets":
        return offsets_form(rng, b, sq, skv, slots)
    if form == "segment_ids":
        return segment_ids_form(rng, b, sq, skv, slots)
    if form == "segment_ids_pos":
        return segment_ids_form(rng, b, sq, skv, slots, with_pos=True)
    raise ValueError(form)


# --------------------------------------------------------------------------- cases

@dataclasses.dataclass
class Case:
    layout: str = "bshd_bshd_bshd"
    mask: str = "causal"
    bias: str = "no_bias"
    bias_shape: str = "bh"      # which of b, h the bias array has ("", "b", "h", "bh")
    alibi_slopes: bool = False  # alibi with given slopes
    softmax: str = "vanilla"
    window: tuple = (-1, -1)
    scale: float | None = None
    dtype: object = F32
    b: int = 2
    sq: int = 6
    skv: int = 6
    h: int = 4
    h_kv: int = 4
    d: int = 8
    dv: int = 8
    form: str | None = None     # None: a default for masks/layouts that need a descriptor
    slots: int = 3
    fields: dict | None = None  # explicit descriptor fields
    dropout_rate: float = 0.0

    def __post_init__(self):
        if ref.num_arrays(self.layout) == 1:
            self.skv, self.h_kv, self.dv = self.sq, self.h, self.d
        elif ref.num_arrays(self.layout) == 2:
            self.dv = self.d

    @property
    def needs_sequence(self) -> bool:
        return self.mask.startswith("padding") or ref.is_thd(self.layout)

    def config(self):
        form = None if self.fields is None else ref.descriptor_form(self.fields)
        return make_config(
            backend="xla", qkv_layout=self.layout, mask=self.mask, bias=self.bias,
            softmax=self.softmax, window_size=tuple(self.window), scale=self.scale,
            dropout_rate=self.dropout_rate,
            sequence={"max_segments_per_seq": max(self.slots, 1),
                      "format": form if form and self.needs_sequence else "none"})


@dataclasses.dataclass
class Inputs:
    arrays: tuple
    config: object
    bias: object
    softmax_offset: object
    fields: dict | None
    sequence: SequenceDescriptor | None


def build(rng, case: Case) -> Inputs:
    shapes = ref.layout_shapes(case.layout, case.b, case.sq, case.skv, case.h, case.h_kv,
                               case.d, case.dv)
    arrays = tuple(random_array(rng, s, case.dtype) for s in shapes)
    if case.fields is None and case.needs_sequence:
        form = case.form or ("seqlens_offsets" if ref.is_thd(case.layout) else "seqlens")
        case.fields = make_fields(rng, form, case.b, case.sq, case.skv, case.slots)
    elif case.fields is None and case.form is not None:
        case.fields = make_fields(rng, case.form, case.b, case.sq, case.skv, case.slots)
    bias = None
    if case.bias in ("pre_scale_bias", "post_scale_bias"):
        shape = (case.b if "b" in case.bias_shape else 1, case.h if "h" in case.bias_shape else 1,
                 case.sq, case.skv)
        bias = random_array(rng, shape, F32)
    elif case.bias == "alibi" and case.alibi_slopes:
        bias = jnp.asarray(rng.uniform(0.05, 1.0, case.h), F32)
    offset = (jnp.asarray(rng.standard_normal(case.h), F32) if case.softmax == "learnable"
              else None)
    return Inputs(arrays, case.config(), bias, offset, case.fields, descriptor(case.fields))


def run_and_compare(rng, case: Case, grads: bool = True, key=None, jit: bool = True):
    """fused_attn (and its VJP) vs the reference; returns (out, reference, inputs)."""
    inputs = build(rng, case)
    training = key is not None

    def attend(arrays, bias, offset):
        return fused_attn(arrays, config=inputs.config, bias=bias, softmax_offset=offset,
                          sequence=inputs.sequence, dropout_rng=key, is_training=training)

    if grads:
        def forward_backward(arrays, bias, offset, dout):
            out, vjp = jax.vjp(attend, arrays, bias, offset)
            return out, vjp(dout)

        out_shape = jax.eval_shape(attend, inputs.arrays, inputs.bias, inputs.softmax_offset)
        dout = random_array(rng, out_shape.shape, F32).astype(out_shape.dtype)
        fn = jax.jit(forward_backward) if jit else forward_backward
        out, (g_arrays, g_bias, g_offset) = fn(inputs.arrays, inputs.bias,
                                               inputs.softmax_offset, dout)
    else:
        dout = None
        out = (jax.jit(attend) if jit else attend)(inputs.arrays, inputs.bias,
                                                  inputs.softmax_offset)
    expected = ref.reference_attention(
        inputs.arrays, inputs.config, bias=inputs.bias, softmax_offset=inputs.softmax_offset,
        sequence=inputs.fields, dropout_key=key, is_training=training, dout=dout)

    assert out.dtype == jnp.dtype(case.dtype)
    tol = tolerance(case.dtype)
    assert_close(out, expected.out, tol, "out")
    # Query tokens with no visible key give exactly zero.
    empty = ~expected.visible.any(-1)  # [b, sq]
    canonical_out = ref.from_layout_output(case.layout, np.asarray(out, np.float64))
    assert np.all(canonical_out[empty] == 0.0), "rows with no visible key must output exactly 0"
    if grads:
        grad_tol = GRAD_TOL if case.dtype == F32 else tol
        for i, (got, want) in enumerate(zip(g_arrays, expected.grads["qkv"])):
            assert_close(got, want, grad_tol, f"d qkv[{i}]")
        if inputs.bias is not None:
            assert_close(g_bias, expected.grads["bias"], grad_tol, "d bias")
        if inputs.softmax_offset is not None:
            assert_close(g_offset, expected.grads["softmax_offset"], grad_tol, "d softmax_offset")
    return out, expected, inputs


def layout_case(layout: str, mask: str, **kw) -> Case:
    """A case that uses what the layout allows: cross lengths, GQA, Dv != D."""
    defaults = dict(sq=5, skv=7, h=4, h_kv=2, d=8, dv=6)
    defaults.update(kw)
    return Case(layout=layout, mask=mask, **defaults)


# --------------------------------------------------------------------------- the reference itself

def _finite_difference(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        grad[index] = (f(plus) - f(minus)) / (2 * eps)
    return grad


@pytest.mark.parametrize("bias,softmax,mask,layout", [
    ("pre_scale_bias", "learnable", "padding_causal_bottom_right", "bshd_bshd_bshd"),
    ("post_scale_bias", "off_by_one", "causal", "sbhd_sb2hd"),
    ("alibi", "learnable", "causal_bottom_right", "thd_thd_thd"),
    ("no_bias", "vanilla", "no_mask", "bs3hd"),
])
def test_reference_gradients_match_finite_differences(rng, bias, softmax, mask, layout):
    """The analytic float64 gradients of the reference equal central differences of its forward."""
    case = Case(layout=layout, mask=mask, bias=bias, bias_shape="h", alibi_slopes=True,
                softmax=softmax, b=2, sq=3, skv=4, h=2, h_kv=1, d=3, dv=2, window=(2, -1),
                slots=2, dropout_rate=0.3)
    inputs = build(rng, case)
    arrays = [np.asarray(a, np.float64) for a in inputs.arrays]
    bias_arr = None if inputs.bias is None else np.asarray(inputs.bias, np.float64)
    offset = None if inputs.softmax_offset is None else np.asarray(inputs.softmax_offset,
                                                                   np.float64)
    base = ref.reference_attention(arrays, inputs.config, bias=bias_arr, softmax_offset=offset,
                                   sequence=inputs.fields)
    keep = rng.random(base.weights.shape) > 0.3  # an arbitrary dropout mask
    dout = rng.standard_normal(base.out.shape)

    def loss(arrays, bias_arr, offset):
        out = ref.reference_attention(arrays, inputs.config, bias=bias_arr, softmax_offset=offset,
                                      sequence=inputs.fields, keep=keep).out
        return float(np.sum(out * dout))

    result = ref.reference_attention(arrays, inputs.config, bias=bias_arr, softmax_offset=offset,
                                     sequence=inputs.fields, keep=keep, dout=dout)
    for i in range(len(arrays)):
        def f(x, i=i):
            return loss(arrays[:i] + [x] + arrays[i + 1:], bias_arr, offset)
        assert_close(result.grads["qkv"][i], _finite_difference(f, arrays[i]), 1e-7, f"qkv[{i}]")
    if bias_arr is not None:
        assert_close(result.grads["bias"],
                     _finite_difference(lambda x: loss(arrays, x, offset), bias_arr), 1e-7, "bias")
    if offset is not None:
        assert_close(result.grads["softmax_offset"],
                     _finite_difference(lambda x: loss(arrays, bias_arr, x), offset), 1e-7,
                     "offset")
    assert np.abs(result.out).max() > 0  # not a vacuous case


def test_reference_alibi_slopes_known_values():
    np.testing.assert_allclose(ref.alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    np.testing.assert_allclose(ref.alibi_slopes(4), [2.0 ** -(2 * (i + 1)) for i in range(4)])
    # 6 heads: the 4-head sequence, then the first two odd-indexed terms of the 8-head one
    np.testing.assert_allclose(ref.alibi_slopes(6), [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])


def test_reference_masks_by_hand():
    """Small masks spelled out by hand (guards the reference's own mask logic)."""
    tokens = ref.describe_tokens(None, 1, 2, 4, use_sequence=False, bottom_right=True)
    vis = ref.visible_keys(tokens, causal=True, window=(-1, -1))[0]
    np.testing.assert_array_equal(vis, [[1, 1, 1, 0], [1, 1, 1, 1]])
    tokens = ref.describe_tokens(None, 1, 3, 3, use_sequence=False, bottom_right=False)
    vis = ref.visible_keys(tokens, causal=False, window=(1, 0))[0]
    np.testing.assert_array_equal(vis, [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    fields = {"q_segment_ids": np.array([[1, 1, 2, 0]]), "kv_segment_ids": np.array([[1, 2, 2, 2]])}
    tokens = ref.describe_tokens(fields, 1, 4, 4, use_sequence=True, bottom_right=True)
    vis = ref.visible_keys(tokens, causal=True, window=(-1, -1))[0]
    # segment 1: q_len 2, kv_len 1 -> shift -1; segment 2: q_len 1, kv_len 3 -> shift 2
    np.testing.assert_array_equal(vis, [[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]])


# --------------------------------------------------------------------------- feature matrix

@pytest.mark.parametrize("mask", ref.MASKS)
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_layout_and_mask(rng, layout, mask):
    run_and_compare(rng, layout_case(layout, mask))


@pytest.mark.parametrize("form", ["seqlens", "seqlens_offsets", "segment_ids", "segment_ids_pos"])
@pytest.mark.parametrize("layout,mask", [
    ("bshd_bshd_bshd", "padding_causal"), ("sbhd_sbhd_sbhd", "padding_causal_bottom_right"),
    ("thd_thd_thd", "causal"), ("thd_thd_thd", "padding_causal_bottom_right"), ("t3hd", "padding"),
])
def test_descriptor_forms(rng, layout, mask, form):
    case = layout_case(layout, mask, sq=9, skv=11, form=form, slots=3)
    run_and_compare(rng, case)


@pytest.mark.parametrize("layout,bias,shape,mask", [
    ("bshd_bshd_bshd", "pre_scale_bias", "", "causal"),
    ("thd_t2hd", "pre_scale_bias", "bh", "padding_causal_bottom_right"),
    ("bshd_bshd_bshd", "pre_scale_bias", "b", "no_mask"),
    ("thd_t2hd", "post_scale_bias", "", "padding"),
    ("bshd_bshd_bshd", "post_scale_bias", "bh", "causal"),
    ("thd_t2hd", "post_scale_bias", "h", "causal_bottom_right"),
    ("bshd_bshd_bshd", "alibi", "default", "causal"),
    ("thd_t2hd", "alibi", "default", "padding_causal_bottom_right"),
    ("thd_t2hd", "alibi", "slopes", "no_mask"),
    ("bshd_bshd_bshd", "alibi", "slopes", "causal_bottom_right"),
])
def test_bias(rng, layout, bias, shape, mask):
    h = 6 if bias == "alibi" else 4  # 6 heads: ALiBi slopes of a non-power-of-two head count
    case = layout_case(layout, mask, bias=bias, bias_shape=shape, alibi_slopes=shape == "slopes",
                       h=h, h_kv=h // 2, sq=7, skv=7 if ref.is_thd(layout) else 9)
    run_and_compare(rng, case)


@pytest.mark.parametrize("layout,mask", [("sbhd_sbhd_sbhd", "no_mask"),
                                         ("thd_thd_thd", "padding_causal"),
                                         ("bshd_bs2hd", "causal_bottom_right")])
@pytest.mark.parametrize("softmax", ref.SOFTMAXES)
def test_softmax_variants(rng, layout, softmax, mask):
    run_and_compare(rng, layout_case(layout, mask, softmax=softmax, sq=8, skv=6))


@pytest.mark.parametrize("window,mask,layout", [
    ((0, 0), "no_mask", "bshd_bshd_bshd"), ((2, 0), "causal", "sb3hd"),
    ((0, 2), "causal_bottom_right", "bshd_bs2hd"), ((3, 1), "padding_causal_bottom_right",
                                                    "thd_thd_thd"),
    ((-1, 2), "no_mask", "sbhd_sbhd_sbhd"), ((2, -1), "causal_bottom_right", "bshd_bshd_bshd"),
    ((1, 1), "padding", "thd_t2hd"), ((0, 3), "causal", "bshd_bshd_bshd"),
])
def test_window(rng, mask, layout, window):
    run_and_compare(rng, layout_case(layout, mask, window=window, sq=7, skv=10))


@pytest.mark.parametrize("h_kv", [2, 1])
@pytest.mark.parametrize("layout", ["bshd_bshd_bshd", "sbhd_sb2hd", "thd_thd_thd"])
def test_grouped_query_attention(rng, layout, h_kv):
    run_and_compare(rng, layout_case(layout, "padding_causal", h=4, h_kv=h_kv))


@pytest.mark.parametrize("scale,bias", [(0.05, "no_bias"), (2.5, "pre_scale_bias"),
                                        (1.0, "post_scale_bias"), (0.3, "alibi")])
def test_explicit_scale(rng, scale, bias):
    run_and_compare(rng, Case(mask="causal", scale=scale, bias=bias))


def test_scale_default_is_inverse_sqrt_head_dim(rng):
    case = Case(mask="no_mask", d=16, dv=5)
    inputs = build(rng, case)
    default = jax.jit(lambda a: fused_attn(a, config=inputs.config))(inputs.arrays)
    explicit = jax.jit(lambda a: fused_attn(a, config=make_config(
        backend="xla", mask="no_mask", scale=0.25)))(inputs.arrays)
    np.testing.assert_allclose(np.asarray(default), np.asarray(explicit), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout,dv", [("bshd_bshd_bshd", 3), ("sbhd_sbhd_sbhd", 16),
                                       ("thd_thd_thd", 5)])
def test_value_head_dim_differs(rng, layout, dv):
    out, _, _ = run_and_compare(rng, layout_case(layout, "padding_causal", d=8, dv=dv))
    assert out.shape[-1] == dv


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("layout,mask,extra", [
    ("bshd_bshd_bshd", "causal", {}),
    ("sb3hd", "no_mask", {"bias": "post_scale_bias"}),
    ("thd_t2hd", "padding_causal_bottom_right", {"softmax": "learnable"}),
    ("sbhd_sbhd_sbhd", "padding", {"bias": "alibi", "window": (2, 2),
                                   "softmax": "off_by_one"}),
])
def test_dtypes(rng, dtype, layout, mask, extra):
    """Forward in each dtype vs float64 on the same rounded inputs (bf16/f16 gradients loosely)."""
    case = layout_case(layout, mask, dtype=dtype, sq=8, skv=12, d=16, dv=16, **extra)
    run_and_compare(rng, case, grads=True)


# --------------------------------------------------------------------------- empty rows

@pytest.mark.parametrize("softmax,dtype", [("vanilla", F32), ("off_by_one", F32),
                                           ("learnable", F32), ("vanilla", BF16),
                                           ("learnable", F16)])
def test_zero_length_sequences(rng, softmax, dtype):
    """Rows of length 0 (q or kv) and padded queries output exactly 0 with finite gradients."""
    fields = seqlens_form(rng, 4, 6, 5, q_lens=[0, 3, 6, 2], kv_lens=[4, 0, 5, 1])
    case = Case(mask="padding_causal", softmax=softmax, dtype=dtype, b=4, sq=6, skv=5,
                fields=fields)
    out, expected, inputs = run_and_compare(rng, case)
    out = np.asarray(out, np.float64)
    assert np.all(out[0] == 0) and np.all(out[1] == 0)  # q_len 0; kv_len 0
    assert np.all(out[3, 2:] == 0)                      # padded queries
    assert np.abs(out[2]).max() > 0


def test_zero_length_gradients_vanish(rng):
    """No gradient reaches padded tokens or rows with nothing to attend to."""
    fields = seqlens_form(rng, 3, 5, 5, q_lens=[0, 3, 5], kv_lens=[5, 0, 2])
    case = Case(mask="padding", softmax="learnable", b=3, sq=5, skv=5, fields=fields)
    inputs = build(rng, case)

    def loss(arrays, offset):
        out = fused_attn(arrays, config=inputs.config, softmax_offset=offset,
                         sequence=inputs.sequence)
        return jnp.sum(out * out)

    (dq, dk, dv), d_offset = jax.jit(jax.grad(loss, argnums=(0, 1)))(inputs.arrays,
                                                                      inputs.softmax_offset)
    for g in (dq, dk, dv, d_offset):
        assert_finite(g, "gradient")
    assert np.all(np.asarray(dq)[:2] == 0)
    assert np.all(np.asarray(dk)[:2] == 0) and np.all(np.asarray(dv)[:2] == 0)
    assert np.all(np.asarray(dk)[2, 2:] == 0) and np.all(np.asarray(dv)[2, 2:] == 0)
    assert np.abs(np.asarray(dq)[2]).max() > 0


@pytest.mark.parametrize("layout", ["thd_thd_thd", "t3hd"])
def test_thd_zero_length_segments_and_unused_slots(rng, layout):
    q_len = np.array([[3, 0, 2, -1], [0, -1, -1, -1]], np.int32)
    q_off = np.array([[0, 3, 3, 5, -1], [0, 0, -1, -1, -1]], np.int32)
    kv_len = np.array([[2, 3, 0, -1], [4, -1, -1, -1]], np.int32)
    kv_off = np.array([[0, 2, 5, 5, -1], [0, 4, -1, -1, -1]], np.int32)
    if layout == "t3hd":  # one token axis for q and kv: the same segments
        kv_len, kv_off = q_len, q_off
    fields = {"q_seqlens": q_len, "kv_seqlens": kv_len, "q_offsets": q_off, "kv_offsets": kv_off}
    case = Case(layout=layout, mask="causal_bottom_right", b=2, sq=8, skv=8, slots=4,
                fields=fields, h_kv=2)
    out, expected, _ = run_and_compare(rng, case)
    out = np.asarray(out)
    assert np.all(out[1] == 0)        # row 1: only an empty segment
    assert np.all(out[0, 5:] == 0)    # trailing padding
    if layout == "thd_thd_thd":
        assert np.all(out[0, 3:5] == 0)  # segment 3 has no keys
        assert np.abs(out[0, :3]).max() > 0


@pytest.mark.parametrize("sq,skv", [(4, 0), (0, 4)])
def test_empty_sequence_axis(rng, sq, skv):
    """An array with no keys (or no queries): every query row sees nothing, so zeros, not an error.

    API.md: "A query row with no visible key outputs zeros (and zero gradients), never NaN."
    """
    q = random_array(rng, (2, sq, 2, 8))
    k = random_array(rng, (2, skv, 2, 8))
    v = random_array(rng, (2, skv, 2, 4))
    config = make_config(backend="xla", mask="no_mask")

    def loss(q, k, v):
        return jnp.sum(fused_attn((q, k, v), config=config) ** 2)

    out = fused_attn((q, k, v), config=config)
    assert out.shape == (2, sq, 2, 4)
    assert np.all(np.asarray(out) == 0)
    for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v):
        assert_finite(g, "gradient")
        assert np.all(np.asarray(g) == 0)


def test_garbage_in_padded_values_does_not_leak(rng):
    q = random_array(rng, (1, 4, 1, 8))
    v = random_array(rng, (1, 4, 1, 8)).at[0, 3].set(jnp.nan)
    sequence = SequenceDescriptor.from_seqlens(np.array([3]), np.array([3]))
    out = np.asarray(fused_attn((q, q, v), config=make_config(backend="xla", mask="padding"),
                                sequence=sequence))
    assert_finite(out[0, :3], "visible rows")
    assert np.all(out[0, 3] == 0)


def test_bottom_right_more_queries_than_keys(rng):
    """causal_bottom_right with sq > skv: the first sq - skv queries see nothing."""
    case = Case(mask="causal_bottom_right", sq=7, skv=4, h_kv=1)
    out, _, _ = run_and_compare(rng, case)
    assert np.all(np.asarray(out)[:, :3] == 0)
    assert np.all(np.abs(np.asarray(out)[:, 3:]).max(axis=(-1, -2)) > 0)


def test_window_leaves_rows_empty(rng):
    """A window right of a bottom-right diagonal past the last key leaves rows empty."""
    case = Case(mask="causal_bottom_right", sq=6, skv=3, window=(0, 0), softmax="off_by_one")
    out, expected, _ = run_and_compare(rng, case)
    assert (~expected.visible.any(-1)).any()


# --------------------------------------------------------------------------- dropout

def _dropout_case(**kw) -> Case:
    base = dict(mask="no_mask", dropout_rate=0.3, b=2, sq=8, skv=8, h=2, h_kv=2, d=8, dv=8)
    base.update(kw)
    return Case(**base)


def test_dropout_same_key_same_output_different_key_different(rng):
    inputs = build(rng, _dropout_case())

    jitted = jax.jit(lambda key: fused_attn(inputs.arrays, config=inputs.config, dropout_rng=key,
                                            is_training=True))

    def attend(key):
        return np.asarray(jitted(key))

    a, b, c = attend(jax.random.key(1)), attend(jax.random.key(1)), attend(jax.random.key(2))
    assert_finite(a)
    np.testing.assert_array_equal(a, b)
    assert np.mean(a != c) > 0.5
    raw = attend(jax.random.PRNGKey(1))  # raw uint32 keys work too
    assert_finite(raw)


def test_dropout_off_when_not_training(rng):
    inputs = build(rng, _dropout_case())
    no_dropout = jax.jit(lambda a: fused_attn(a, config=make_config(backend="xla",
                                                                    mask="no_mask")))(inputs.arrays)
    eval_out = jax.jit(lambda a: fused_attn(a, config=inputs.config, is_training=False))(
        inputs.arrays)
    eval_keyed = jax.jit(lambda a, key: fused_attn(a, config=inputs.config, dropout_rng=key))(
        inputs.arrays, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(no_dropout), np.asarray(eval_out))
    np.testing.assert_array_equal(np.asarray(no_dropout), np.asarray(eval_keyed))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_keep_rate(seed, rate):
    """With uniform weights and identity values the output is keep / ((1 - rate) skv)."""
    b, s, h = 2, 32, 4
    q = jnp.zeros((b, s, h, 8), F32)
    v = jnp.broadcast_to(jnp.eye(s, dtype=F32)[None, :, None, :], (b, s, h, s))
    config = make_config(backend="xla", mask="no_mask", dropout_rate=rate)
    key = jax.random.key(seed)
    out = np.asarray(jax.jit(lambda qkv, key: fused_attn(qkv, config=config, dropout_rng=key,
                                                         is_training=True))((q, q, v), key))
    scaled = out * (1 - rate) * s  # [b, sq, h, skv]: 1 kept, 0 dropped
    assert_finite(scaled)
    kept = scaled > 0.5
    np.testing.assert_allclose(scaled[kept], 1.0, rtol=1e-5)
    np.testing.assert_allclose(scaled[~kept], 0.0, atol=1e-6)
    n = kept.size
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(kept.mean() - (1 - rate)) < 5 * sigma, (kept.mean(), 1 - rate, sigma)
    # exactly the documented Philox mask
    expected = ref.dropout_keep(key, rate, (b, h, s, s))
    np.testing.assert_array_equal(kept.transpose(0, 2, 1, 3), expected)


def test_dropout_unbiased(seed):
    """The mean over many keys approaches the no-dropout output."""
    rng = np.random.default_rng(seed)
    case = _dropout_case(mask="padding_causal", dropout_rate=0.4, b=1, sq=6, skv=6, h=2)
    inputs = build(rng, case)
    n = 512
    keys = jax.random.split(jax.random.key(seed), n)
    outs = jax.jit(jax.vmap(lambda key: fused_attn(
        inputs.arrays, config=inputs.config, sequence=inputs.sequence, dropout_rng=key,
        is_training=True)))(keys)
    outs = np.asarray(outs, np.float64)
    assert_finite(outs)
    exact = ref.reference_attention(inputs.arrays, inputs.config, sequence=inputs.fields).out
    mean = outs.mean(0)
    stderr = outs.std(0, ddof=1) / np.sqrt(n)
    varying = stderr > 1e-6
    z = np.abs(mean - exact)[varying] / stderr[varying]
    assert varying.sum() > 10
    assert z.max() < 6 and np.mean(z ** 2) < 2.0, (z.max(), np.mean(z ** 2))
    np.testing.assert_allclose(mean[~varying], exact[~varying], atol=1e-5)


@pytest.mark.parametrize("layout,mask,extra", [
    ("bshd_bshd_bshd", "causal", {}),
    ("thd_thd_thd", "padding_causal_bottom_right", {"softmax": "learnable", "h_kv": 1}),
    ("sb3hd", "no_mask", {"bias": "post_scale_bias", "window": (2, 1)}),
])
def test_dropout_matches_reference_forward_and_backward(seed, layout, mask, extra):
    """Forward and backward use the same mask: both match the reference with that mask."""
    rng = np.random.default_rng(seed)
    case = _dropout_case(layout=layout, mask=mask, sq=7, skv=7, **extra)
    run_and_compare(rng, case, key=jax.random.key(seed))


def test_dropout_gradient_uses_forward_mask(seed):
    """Dropped weights pass no gradient to v: a value row reached only through dropped weights."""
    rng = np.random.default_rng(seed)
    case = _dropout_case(mask="no_mask", b=1, sq=1, skv=8, h=1, h_kv=1, dropout_rate=0.5)
    inputs = build(rng, case)
    key = jax.random.key(seed)
    keep = ref.dropout_keep(key, 0.5, (1, 1, 1, 8))[0, 0, 0]

    def loss(arrays):
        return jnp.sum(fused_attn(arrays, config=inputs.config, dropout_rng=key,
                                  is_training=True))

    dv = np.asarray(jax.jit(jax.grad(loss))(inputs.arrays)[2])[0, :, 0, 0]
    assert np.all(dv[~keep] == 0) and np.all(dv[keep] > 0)


# --------------------------------------------------------------------------- transforms, inputs

@pytest.mark.parametrize("layout,mask", [("bshd_bshd_bshd", "causal"),
                                         ("thd_thd_thd", "padding_causal"),
                                         ("sbhd_sb2hd", "padding")])
def test_vmap_equals_loop(rng, layout, mask):
    n = 3
    cases = [layout_case(layout, mask, bias="post_scale_bias", bias_shape="bh", b=2, sq=5, skv=6)
             for _ in range(n)]
    all_inputs = [build(rng, c) for c in cases]
    config = all_inputs[0].config

    def stack(*xs):
        return None if xs[0] is None else jnp.stack([jnp.asarray(x) for x in xs])

    arrays = tuple(stack(*xs) for xs in zip(*(i.arrays for i in all_inputs)))
    bias = stack(*(i.bias for i in all_inputs))
    seq = (None if all_inputs[0].sequence is None
           else jax.tree.map(stack, *(i.sequence for i in all_inputs)))

    @jax.jit
    def attend(arrays, bias, seq):
        return fused_attn(arrays, config=config, bias=bias, sequence=seq)

    batched = jax.jit(jax.vmap(attend))(arrays, bias, seq)
    # folded into the batch: no sequential loop in the computation
    jaxpr = str(jax.make_jaxpr(jax.vmap(attend))(arrays, bias, seq))
    assert "while" not in jaxpr and "scan" not in jaxpr
    for i, inputs in enumerate(all_inputs):
        single = attend(inputs.arrays, inputs.bias, inputs.sequence)
        assert_close(batched[i], single, 1e-6, f"vmap[{i}]")
        expected = ref.reference_attention(inputs.arrays, inputs.config, bias=inputs.bias,
                                           sequence=inputs.fields).out
        assert_close(batched[i], expected, tolerance(F32), f"vmap[{i}] vs reference")

    # gradients through vmap equal the per-example gradients
    g_batched = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(attend)(a, bias, seq) ** 2)))(arrays)
    single_grad = jax.jit(jax.grad(lambda a, b, s: jnp.sum(attend(a, b, s) ** 2)))
    for i, inputs in enumerate(all_inputs):
        g_single = single_grad(inputs.arrays, inputs.bias, inputs.sequence)
        for got, want in zip(g_batched, g_single):
            assert_close(got[i], want, 1e-5, "vmap grad")


def test_vmap_over_dropout_keys_equals_loop(rng):
    inputs = build(rng, _dropout_case())
    keys = jax.random.split(jax.random.key(7), 3)

    def attend(key):
        return fused_attn(inputs.arrays, config=inputs.config, dropout_rng=key, is_training=True)

    batched = np.asarray(jax.jit(jax.vmap(attend))(keys))
    for i in range(3):
        single = np.asarray(jax.jit(attend)(keys[i]))
        assert_close(batched[i], single, 1e-6, f"vmap[{i}]")
        expected = ref.reference_attention(inputs.arrays, inputs.config, dropout_key=keys[i],
                                           is_training=True).out
        assert_close(batched[i], expected, tolerance(F32), f"vmap[{i}] vs reference")
    assert np.mean(batched[0] != batched[1]) > 0.5


def test_jit_matches_eager_and_accepts_spec(rng):
    case = Case(layout="thd_thd_thd", mask="padding_causal", softmax="learnable")
    inputs = build(rng, case)
    spec = AttentionSpec.from_config(inputs.config)
    eager = fused_attn(inputs.arrays, config=inputs.config, softmax_offset=inputs.softmax_offset,
                       sequence=inputs.sequence)
    jitted = jax.jit(functools.partial(fused_attn, config=spec))(
        inputs.arrays, softmax_offset=inputs.softmax_offset, sequence=inputs.sequence)
    static = jax.jit(fused_attn, static_argnames=("config", "is_training"))(
        inputs.arrays, config=spec, softmax_offset=inputs.softmax_offset,
        sequence=inputs.sequence)
    assert_close(jitted, eager, 1e-6, "jit")
    assert_close(static, eager, 1e-6, "jit static spec")
    expected = ref.reference_attention(inputs.arrays, inputs.config,
                                       softmax_offset=inputs.softmax_offset,
                                       sequence=inputs.fields).out
    assert_close(eager, expected, tolerance(F32), "eager vs reference")


def test_numpy_inputs(rng):
    case = Case(layout="bshd_bs2hd", mask="padding_causal", bias="pre_scale_bias",
                softmax="learnable", form="segment_ids")
    inputs = build(rng, case)
    np_arrays = tuple(np.asarray(a) for a in inputs.arrays)
    np_fields = {k: np.asarray(v) for k, v in inputs.fields.items()}
    out = fused_attn(np_arrays, config=inputs.config, bias=np.asarray(inputs.bias),
                     softmax_offset=np.asarray(inputs.softmax_offset),
                     sequence=descriptor(np_fields))
    assert isinstance(out, jax.Array)
    expected = ref.reference_attention(np_arrays, inputs.config, bias=np.asarray(inputs.bias),
                                       softmax_offset=np.asarray(inputs.softmax_offset),
                                       sequence=np_fields).out
    assert_close(out, expected, tolerance(F32), "numpy inputs")
    listed = fused_attn(list(np_arrays), config=inputs.config, bias=np.asarray(inputs.bias),
                        softmax_offset=np.asarray(inputs.softmax_offset),
                        sequence=descriptor(np_fields))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(listed))


def test_plain_mapping_config(rng):
    """A plain dict with the config's keys (or a subset) works like the ConfigDict."""
    case = Case(mask="causal_bottom_right", sq=4, skv=6)
    inputs = build(rng, case)
    out = fused_attn(inputs.arrays, config={"backend": "xla", "mask": "causal_bottom_right"})
    expected = ref.reference_attention(inputs.arrays, inputs.config).out
    assert_close(out, expected, tolerance(F32), "mapping config")


# --------------------------------------------------------------------------- property-based

@st.composite
def _cases(draw):
    layout = draw(st.sampled_from(ref.LAYOUTS))
    mask = draw(st.sampled_from(ref.MASKS))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 8]))
    sq = draw(st.integers(1, 9))
    skv = draw(st.integers(1, 9))
    left = draw(st.sampled_from([-1, -1, 0, 1, 3]))
    right = draw(st.sampled_from([-1, -1, 0, 2]))
    needs = mask.startswith("padding") or layout.startswith("t")
    forms = ["seqlens", "seqlens_offsets", "segment_ids", "segment_ids_pos"]
    form = draw(st.sampled_from(forms)) if needs else None
    bias = draw(st.sampled_from(ref.BIASES))
    case = Case(layout=layout, mask=mask, bias=bias, bias_shape=draw(st.sampled_from(["", "bh"])),
                alibi_slopes=draw(st.booleans()), softmax=draw(st.sampled_from(ref.SOFTMAXES)),
                window=(left, right), b=draw(st.integers(1, 3)), sq=sq, skv=skv, h=h, h_kv=h_kv,
                d=d, dv=draw(st.sampled_from([d, 4, 6])), form=form,
                slots=draw(st.integers(1, 3)))
    return case, draw(st.integers(0, 2**31 - 1))


@hypothesis.settings(max_examples=20, deadline=None, derandomize=False,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(_cases())
def test_property_matches_reference(drawn):
    case, seed = drawn
    run_and_compare(np.random.default_rng(seed), case, grads=True)


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)),
                                   min_size=1, max_size=3),
                  mask=st.sampled_from(["padding", "padding_causal", "padding_causal_bottom_right"]),
                  seed=st.integers(0, 2**31 - 1))
def test_property_seqlens_any_lengths(lengths, mask, seed):
    """Any lengths in [0, s], zero included: output matches, empty rows are exactly 0."""
    q_lens, kv_lens = zip(*lengths)
    fields = seqlens_form(None, len(lengths), 6, 6, q_lens=q_lens, kv_lens=kv_lens)
    case = Case(mask=mask, b=len(lengths), sq=6, skv=6, h=2, h_kv=1, fields=fields)
    run_and_compare(np.random.default_rng(seed), case, grads=True)


@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_bf16_transposed_views_under_jit(rng, layout):
    """bfloat16 q/k/v that are transposed views of the stored arrays (e.g. [b, h, s, d]
    swapped to [b, s, h, d] inside jit, as models that keep heads first hand them over)
    run on every platform and equal the reference, forward and gradients (XLA:CPU has no
    BF16 x BF16 = F32 dot for the layouts these views give the grouped einsums)."""
    case = layout_case(layout, "causal", dtype=BF16, h_kv=4, dv=8)  # GQA groups of one
    inputs = build(rng, case)
    swap = lambda arrays: tuple(jnp.swapaxes(a, 1, -2) for a in arrays)
    stored = swap(inputs.arrays)  # the views below give back inputs.arrays

    def attend(stored):
        return fused_attn(swap(stored), config=inputs.config, sequence=inputs.sequence)

    out_shape = jax.eval_shape(attend, stored)
    dout = random_array(rng, out_shape.shape, F32).astype(BF16)
    out, vjp = jax.jit(lambda s: jax.vjp(attend, s))(stored)
    (grads,) = jax.jit(vjp)(dout)
    expected = ref.reference_attention(inputs.arrays, inputs.config, sequence=inputs.fields,
                                       dout=dout)
    assert_close(out, expected.out, tolerance(BF16), "out")
    for i, (got, want) in enumerate(zip(swap(grads), expected.grads["qkv"])):
        assert_close(got, want, tolerance(BF16), f"d qkv[{i}]")


@pytest.mark.parametrize("backend", ["xla", "flash"])
def test_transformer_engine_descriptor_widths(rng, backend):
    """Lengths + offsets as TransformerEngine accepts them: q and kv arrays of different
    widths (unused slots -1), wider than config.sequence.max_segments_per_seq; the call
    equals the same packing given by segment ids. On the CPU device (flash: the host build;
    the GPU kernels take head dims 64-256 in 16-bit types)."""
    with jax.default_device(jax.devices("cpu")[0]):
        _check_transformer_engine_descriptor_widths(rng, backend)


def _check_transformer_engine_descriptor_widths(rng, backend):
    b, s = 2, 9
    q_lengths = np.array([[4, 5, -1, -1], [2, 7, -1, -1]], np.int32)
    q_offsets = np.array([[0, 4, 9, -1, -1], [0, 2, 9, -1, -1]], np.int32)
    kv_lengths = np.array([[3, 6, -1], [5, 4, -1]], np.int32)
    kv_offsets = np.array([[0, 3, 9, -1], [0, 5, 9, -1]], np.int32)
    ids = lambda lengths: np.stack([np.repeat(np.arange(1, 3), row[:2]) for row in lengths])
    te = SequenceDescriptor.from_seqlens_and_offsets(q_lengths, kv_lengths, q_offsets,
                                                     kv_offsets)
    by_ids = SequenceDescriptor.from_segment_ids_and_pos(ids(q_lengths), ids(kv_lengths))
    q, k, v = (random_array(rng, (b, s, 2, 8)) for _ in range(3))
    outs = []
    for sequence, form in ((te, "seqlens_offsets"), (by_ids, "segment_ids")):
        config = make_config(backend=backend, qkv_layout="thd_thd_thd", mask="padding_causal",
                             sequence={"format": form, "max_segments_per_seq": 2})
        outs.append(jax.jit(lambda q, k, v, seq, c=config: fused_attn(
            (q, k, v), config=c, sequence=seq))(q, k, v, sequence))
    assert_finite(outs[0])
    assert np.abs(np.asarray(outs[0])).max() > 0
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), rtol=1e-6, atol=1e-6)


def test_segment_id_positions_and_counts_without_a_while_loop(rng):
    """Positions a descriptor derives from segment ids count each id's tokens in row order
    (ids interleaved, in any order, with padding), the bottom-right diagonal counts each id's
    keys; and the derivation lowers without a while loop (a GPU while loop syncs with the host
    at every trip)."""
    ids_q = rng.integers(0, 4, size=(3, 37)).astype(np.int32)
    ids_kv = rng.integers(0, 4, size=(3, 45)).astype(np.int32)
    spec = AttentionSpec.from_config(make_config(mask="padding_causal_bottom_right"))
    sequence = SequenceDescriptor.from_segment_ids_and_pos(ids_q, ids_kv)
    tokens = jax.jit(lambda s: s.token_info(spec, 37, 45))(sequence)
    for ids, got in ((ids_q, tokens.q_pos), (ids_kv, tokens.kv_pos)):
        want = [[int(np.sum(row[:t] == row[t])) for t in range(row.size)] for row in ids]
        np.testing.assert_array_equal(np.asarray(got), want)
    kv_count = [[np.sum(kv == i) for i in q] for q, kv in zip(ids_q, ids_kv)]
    q_count = [[np.sum(q == i) for i in q] for q in ids_q]
    np.testing.assert_array_equal(np.asarray(tokens.q_diag), np.subtract(kv_count, q_count))
    hlo = jax.jit(lambda s: s.token_info(spec, 37, 45)).lower(sequence).as_text()
    assert "stablehlo.while" not in hlo
