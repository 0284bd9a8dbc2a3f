"""The cudnn backend (cuDNN SDPA through the cuDNN frontend) against the XLA backend.

GPU tests (marked `gpu`) run the same call through backend "cudnn" and
backend "xla" and compare the output and every gradient within the dtype's
tolerance. Dropout cannot match the XLA backend (cuDNN draws its own Philox
stream), so it is tested by statistics, by agreement of the forward and
backward masks, and by per-key determinism. A call nobody differentiates runs
cuDNN's forward without stats (training=false): GPU tests compare it with the
training forward. CPU tests check the reasons `supports` gives, and what the
calls lower to for CUDA (the training attribute included).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (FAKE_CUDNN_WORKSPACE_BYTES, assert_close, fake_cudnn_for_cuda_lowering,
                      make_config, poison_like, random_array, tolerance)
from fusedattn.ops import AttentionSpec, SequenceDescriptor, explain, fused_attn, registry
from fusedattn.ops.backends import cudnn
from fusedattn.ops.backends.cudnn import library as cudnn_library
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, TokenInfo, visible_mask

ON_GPU = jax.devices()[0].platform == "gpu"


def shapes(b=2, sq=64, skv=64, h=4, h_kv=4, d=64, dv=None, dtype=jnp.bfloat16, bias=False,
           dropout=False, alibi_slopes=False):
    """The CallShapes of a call; `bias` True for a [b, h, sq, skv] bias, or its shape."""
    bias_shape = (b, h, sq, skv) if bias is True else (tuple(bias) if bias else None)
    return CallShapes(batch=b, seqlen_q=sq, seqlen_kv=skv, num_heads=h, num_kv_heads=h_kv,
                      head_dim_qk=d, head_dim_v=dv or d, dtype=jnp.dtype(dtype),
                      bias_shape=bias_shape, dropout=dropout, alibi_slopes=alibi_slopes)


def spec(**overrides):
    return AttentionSpec.from_config(make_config(**overrides))


# ---- reasons (any machine) -------------------------------------------------------------

def test_needs_a_cuda_gpu():
    for platform in ("cpu", "rocm"):
        assert (cudnn.BACKEND.supports(spec(), shapes(), platform)
                == f"cudnn: needs a CUDA GPU; this computation runs on {platform}")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-only verdict")
def test_explain_on_cpu_and_named_backend_error():
    q = jnp.zeros((2, 16, 2, 64), jnp.bfloat16)
    e = explain((q, q, q), config=make_config())
    assert e.verdicts["cudnn"] == "cudnn: needs a CUDA GPU; this computation runs on cpu"
    assert e.backend != "cudnn"
    with pytest.raises(ValueError, match="cudnn: needs a CUDA GPU; this computation runs on cpu"):
        fused_attn((q, q, q), config=make_config(backend="cudnn"))


@pytest.mark.parametrize("overrides, call, expected", [
    (dict(bias="alibi", mask="no_mask"), {},
     "ALiBi is served under masks 'causal' and 'padding_causal' only"),
    (dict(bias="alibi", mask="causal_bottom_right"), {}, "got 'causal_bottom_right'"),
    (dict(bias="alibi", mask="causal"), dict(alibi_slopes=True), "ALiBi with given slopes"),
    (dict(mask="padding", sequence={"format": "segment_ids"}, bias="post_scale_bias"),
     dict(bias=True), "packed segments (segment ids, offsets) with config.bias 'post_scale_bias'"),
    (dict(qkv_layout="thd_thd_thd", mask="causal", bias="pre_scale_bias",
          sequence={"format": "seqlens_offsets"}),
     dict(bias=True), "packed segments (segment ids, offsets) with config.bias 'pre_scale_bias'"),
    ({}, dict(dtype=jnp.float32), "needs bfloat16 or float16 inputs, got float32"),
    ({}, dict(d=72 + 4), "head dim must be a multiple of 8"),
    ({}, dict(d=320), "at most 256"),
    ({}, dict(d=64, dv=20), "the v head dim"),
])
def test_static_reasons(overrides, call, expected):
    reason = cudnn.BACKEND.supports(spec(**overrides), shapes(**call), "cuda")
    assert reason is not None and reason.startswith("cudnn: ")
    assert expected in reason, reason


@pytest.mark.skipif(ON_GPU, reason="checks the verdict without a CUDA backend")
def test_no_cuda_backend_reason():
    reason = cudnn.BACKEND.supports(spec(), shapes(), "cuda")
    assert reason == "cudnn: jax has no CUDA backend in this process"


@pytest.mark.parametrize("overrides", [
    dict(mask="padding_causal", sequence={"format": "seqlens"}),
    dict(mask="padding_causal", sequence={"format": "segment_ids", "max_segments_per_seq": 4}),
    dict(qkv_layout="thd_thd_thd", mask="padding", sequence={"format": "seqlens_offsets"}),
    dict(mask="causal", bias="alibi"),
    dict(mask="padding_causal", bias="alibi", sequence={"format": "segment_ids",
                                                         "max_segments_per_seq": 4}),
])
def test_padding_and_packing_pass_the_static_checks(overrides):
    reason = cudnn.BACKEND.supports(spec(**overrides), shapes(), "cuda")
    assert reason is None or "jax has no CUDA backend" in reason, reason


def test_ragged_offsets_must_fit_int32():
    reason = cudnn.BACKEND.supports(
        spec(mask="padding", sequence={"format": "segment_ids"}),
        shapes(b=1024, sq=4096, skv=4096, h=16, h_kv=16, d=128), "cuda")
    assert "int32 element offsets" in reason, reason


@pytest.fixture
def lowering_for_cuda(monkeypatch, request):
    """Lowers cuDNN calls for CUDA without a GPU (conftest.fake_cudnn_for_cuda_lowering)."""
    fake_cudnn_for_cuda_lowering(monkeypatch, request)


def lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("with_backward", [False, True])
def test_dense_call_lowers_to_the_ffi_calls_and_constants(lowering_for_cuda, mask, with_backward):
    """Without padding, dropout, bias or softmax offset, the module lowered for CUDA holds
    cuDNN's calls and constants only: no segment or length math, casts or transposes,
    and the operands the calls do not read are constants, not zero-filled arrays
    (broadcasts XLA would run on every call, a fixed cost of short calls)."""
    config = make_config(backend="cudnn", mask=mask)
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config)

    def attend_and_vjp(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    fn, args = (attend_and_vjp, (q,) * 4) if with_backward else (attend, (q,) * 3)
    text = lowered_for_cuda(fn, *args)
    ops = re.findall(r"=\s*\"?([a-z_]+\.[a-z_.]+)", text)
    targets = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    assert targets == ([cudnn_library.FWD_TARGET, cudnn_library.BWD_TARGET] if with_backward
                       else [cudnn_library.FWD_TARGET])
    assert set(ops) == {"stablehlo.custom_call", "stablehlo.constant"}, sorted(set(ops))


@pytest.mark.parametrize("bias_shape", [(2, 4, 64, 96), (1, 4, 64, 96), (2, 1, 64, 96),
                                        (1, 1, 64, 96)])
def test_supports_checks_the_graph_the_call_builds(lowering_for_cuda, monkeypatch, bias_shape):
    """supports() asks cuDNN about the very graph the forward call then builds, a broadcast
    bias's [1, h] or [b, 1] included: a check of another graph could pass while the call's
    own graph fails, and then "auto" would not move on to a backend that can serve it."""
    checked, built = [], []
    monkeypatch.setattr(cudnn_library, "check", lambda params, *rest: checked.append(params))
    monkeypatch.setattr(cudnn_library, "workspace_bytes",
                        lambda params, *rest: built.append(params) or FAKE_CUDNN_WORKSPACE_BYTES)
    config = make_config(backend="cudnn", mask="causal", bias="post_scale_bias")
    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 96, 4, 64), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct(bias_shape, jnp.bfloat16)
    lowered_for_cuda(lambda q, k, v, bias: fused_attn((q, k, v), config=config, bias=bias),
                     q, kv, kv, bias)
    assert len(set(checked)) == 1 and set(built) == set(checked), (checked, built)


def cudnn_calls(text: str) -> list[tuple[str, bool, list[str]]]:
    """(target, its training attribute, its result types) of every custom call in `text`."""
    calls = []
    for line in text.splitlines():
        target = re.search(r"stablehlo\.custom_call @(\w+)\(", line)
        if target:
            training = re.search(r"\btraining = (true|false)\b", line).group(1) == "true"
            calls.append((target.group(1), training,
                          re.findall(r"tensor<([^>]*)>", line.rsplit("->", 1)[1])))
    return calls


@pytest.mark.parametrize("case", ["dense", "dropout", "seqlens", "packed", "vmap"])
def test_forward_writes_no_stats_unless_differentiated(lowering_for_cuda, case):
    """A call nobody differentiates (the custom_vjp's primal) lowers to cuDNN's forward with
    training=false and a float32 [0] placeholder for the stats, which cuDNN's graph without
    stats does not write; the forward of a differentiated call, and the backward, have
    training=true and the real stats [b * slots, h, sq, 1]. Dense rows, rows with lengths and
    ragged rows (packed segments) alike. Every call's last result is its uint8 workspace."""
    b, s, h, d = 2, 128, 4, 64
    overrides = dict(dropout=dict(dropout_rate=0.1),
                     seqlens=dict(mask="padding_causal", sequence={"format": "seqlens"}),
                     packed=dict(mask="padding_causal", sequence={"format": "segment_ids",
                                                                  "max_segments_per_seq": 2}))
    config = make_config(**{"backend": "cudnn", "mask": "causal", **overrides.get(case, {})})
    kw = dict(dropout_rng=jax.random.key(0), is_training=True) if case == "dropout" else {}
    if case == "seqlens":
        lengths = np.array([s, s // 2], np.int32)
        kw = dict(sequence=SequenceDescriptor.from_seqlens(lengths, lengths))
    if case == "packed":
        ids = np.repeat(np.array([[1, 2]], np.int32), s // 2, axis=1).repeat(b, 0)
        kw = dict(sequence=SequenceDescriptor.from_segment_ids_and_pos(ids, ids))

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config, **kw)

    n = 3 if case == "vmap" else 1  # vmap: the examples fold into cuDNN's batch
    if case == "vmap":
        attend = jax.vmap(attend)
    q = jax.ShapeDtypeStruct((b, s, h, d) if n == 1 else (n, b, s, h, d), jnp.bfloat16)

    def attend_and_vjp(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    # A descriptor's values are checked under jit (issue 27: negative lengths, lengths past
    # the array, ...), a checkify effect; calls without a descriptor carry none.
    assert bool(jax.make_jaxpr(attend)(q, q, q).effects) == (case in ("packed", "seqlens"))
    o = f"{n * b}x{s}x{h}x{d}xbf16"
    stats = f"{n * b * (2 if case == 'packed' else 1)}x{h}x{s}x1xf32"
    workspace = f"{FAKE_CUDNN_WORKSPACE_BYTES}xui8"
    assert cudnn_calls(lowered_for_cuda(attend, q, q, q)) == [
        (cudnn_library.FWD_TARGET, False, [o, "0xf32", workspace])]
    forward, backward = cudnn_calls(lowered_for_cuda(attend_and_vjp, q, q, q, q))
    assert forward == (cudnn_library.FWD_TARGET, True, [o, stats, workspace])
    assert backward[:2] == (cudnn_library.BWD_TARGET, True)
    assert backward[2][-1] == workspace


def segments_of(static, tokens, sequence=None):
    b, sq = tokens.q_seg.shape
    skv = tokens.kv_seg.shape[1]
    args = CanonicalArgs(q=jnp.zeros((b, sq, 1, 8)), k=jnp.zeros((b, skv, 1, 8)),
                         v=jnp.zeros((b, skv, 1, 8)), tokens=tokens, sequence=sequence)
    return cudnn.segments._segments(static, args)


def test_segments_pair_runs_by_id_and_flag_broken_rows():
    static = cudnn.graph_key._static(
        spec(mask="padding_causal", sequence={"format": "segment_ids", "max_segments_per_seq": 2}),
        0.125, dropout=False, has_bias=False, seqlen_q=6, seqlen_kv=6)
    q_seg = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 1, 1]], jnp.int32)
    kv_seg = jnp.array([[2, 2, 1, 1, 1, 1], [1, 2, 2, 2, 3, 0], [1, 1, 2, 2, 1, 1]], jnp.int32)
    pos = jnp.array([0, 1, 0, 1, 2, 0], jnp.int32)
    tokens = TokenInfo(q_seg=q_seg, q_pos=jnp.broadcast_to(pos, (3, 6)),
                       q_diag=jnp.zeros((3, 6), jnp.int32), kv_seg=kv_seg,
                       kv_pos=jnp.array([[0, 1, 0, 1, 2, 3]] * 3, jnp.int32))
    segments = segments_of(static, tokens)
    # row 0: q segment 1 (tokens 0-1) pairs with kv run 1 (tokens 2-5), q segment 2 with kv run 0
    np.testing.assert_array_equal(segments.slots[0], [[0, 2], [2, 3], [2, 0], [4, 2]])
    # row 1 has three segments (> 2 slots); row 2 repeats id 1 in two runs
    np.testing.assert_array_equal(segments.broken, [False, True, True])
    assert segments.q_keys[0].tolist() == [True] * 5 + [False]
    assert segments.kv_used[0].tolist() == [True] * 6


def thd_descriptor_and_ids(rng, b, s, slots):
    """One packing two ways: lengths + offsets [b, slots] (unused -1) and segment ids [b, s]."""
    lengths = np.full((b, slots), -1, np.int32)
    offsets = np.full((b, slots + 1), -1, np.int32)
    ids = np.zeros((b, s), np.int32)
    for row in range(b):
        n = rng.integers(1, slots + 1)
        cuts = np.sort(rng.choice(np.arange(1, s), size=n, replace=False))
        starts = np.append(0, cuts[:-1])
        for i, (start, end) in enumerate(zip(starts, cuts)):
            lengths[row, i], offsets[row, i] = end - start, start
            ids[row, start:end] = i + 1
        offsets[row, n] = cuts[-1]
    return lengths, offsets, ids


def test_declared_slots_of_transformer_engine_widths():
    """TransformerEngine's descriptors: q and kv arrays of different widths, wider than
    max_segments_per_seq; a row that uses a slot past it is broken (NaN and an error)."""
    the_spec = spec(qkv_layout="thd_thd_thd", mask="padding",
                    sequence={"format": "seqlens_offsets", "max_segments_per_seq": 2})
    static = cudnn.graph_key._static(the_spec, 0.125, dropout=False, has_bias=False, seqlen_q=8,
                                     seqlen_kv=8)
    sequence = SequenceDescriptor.from_seqlens_and_offsets(
        np.array([[3, 5, -1, -1], [2, 2, 4, -1]], np.int32),   # row 1 uses a third slot
        np.array([[4, 4, -1], [1, 3, 4]], np.int32),
        np.array([[0, 3, 8, -1, -1], [0, 2, 4, 8, -1]], np.int32),
        np.array([[0, 4, 8, -1], [0, 1, 4, 8]], np.int32))
    assert sequence.q_seqlens.shape == sequence.kv_seqlens.shape == (2, 4)
    segments = segments_of(static, sequence.token_info(the_spec, 8, 8), sequence)
    np.testing.assert_array_equal(segments.slots[0], [[0, 3], [3, 5], [0, 4], [4, 4]])
    np.testing.assert_array_equal(segments.broken, [False, True])


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("bound", [None, 24])
def test_declared_slots_equal_the_per_token_reading(rng, mask, bound):
    b, s, slots = 6, 64, 4
    lengths, offsets, ids = thd_descriptor_and_ids(rng, b, s, slots)
    # kv segment i: [2 * start, 2 * start + up to 2 * length) of a row twice as long
    kv_lengths = np.where(lengths > 0, rng.integers(0, 2 * np.maximum(lengths, 0) + 1), -1)
    kv_lengths = kv_lengths.astype(np.int32)
    kv_offsets = np.where(offsets >= 0, 2 * offsets, -1).astype(np.int32)
    kv_ids = np.zeros((b, 2 * s), np.int32)
    for row, i in zip(*np.nonzero(kv_lengths > 0)):
        kv_ids[row, kv_offsets[row, i]:kv_offsets[row, i] + kv_lengths[row, i]] = i + 1
    last = np.sum(lengths > 0, axis=1) - 1
    lengths[0, last[0]] = s - offsets[0, last[0]] + 5  # past the row's end: both cut it there
    ids[0, offsets[0, last[0]]:] = last[0] + 1
    thd = SequenceDescriptor.from_seqlens_and_offsets(lengths, kv_lengths, offsets, kv_offsets)
    by_ids = SequenceDescriptor.from_segment_ids_and_pos(ids, kv_ids)
    results = []
    for sequence, fmt in ((thd, "seqlens_offsets"), (by_ids, "segment_ids")):
        the_spec = spec(qkv_layout="thd_thd_thd", mask=mask, sequence={
            "format": fmt, "max_segments_per_seq": slots, "max_seqlen_q": bound,
            "max_seqlen_kv": bound})
        static = cudnn.graph_key._static(the_spec, 0.125, dropout=False, has_bias=False,
                                         seqlen_q=s, seqlen_kv=2 * s)
        tokens = sequence.token_info(the_spec, s, 2 * s)
        results.append(segments_of(static, tokens, sequence))
    declared, per_token = results
    visible = np.asarray(visible_mask(the_spec, tokens))[:, 0]  # [b, sq, skv]
    np.testing.assert_array_equal(declared.q_keys, visible.any(axis=-1))
    paired = [np.isin(kv_ids[r], ids[r]) & (kv_ids[r] > 0) for r in range(b)]
    np.testing.assert_array_equal(declared.kv_used, np.stack(paired))
    for name in ("q_keys", "kv_used"):
        np.testing.assert_array_equal(getattr(declared, name), getattr(per_token, name), name)
    longest = [max(np.bincount(row)[1:].max(initial=0) for row in (ids[r], kv_ids[r]))
               for r in range(b)]
    if bound is None:  # the lengths form cannot break anything: no flags, no guard
        assert declared.broken is None and not np.any(per_token.broken)
    else:
        np.testing.assert_array_equal(declared.broken, per_token.broken)
        np.testing.assert_array_equal(declared.broken, np.array(longest) > bound)
    assert np.any(declared.q_keys)
    used = np.asarray(declared.slots[:, 1] > 0)  # the per-token reading lists only used slots
    for row in range(b):
        np.testing.assert_array_equal(np.asarray(declared.slots[row])[:, used[row]],
                                      np.asarray(per_token.slots[row])[:, :used[row].sum()])


# ---- GPU: against the XLA backend -------------------------------------------------------

def run(config, qkv, *, bias=None, softmax_offset=None, sequence=None, cotangent=None, **kw):
    """(output, grads of the qkv arrays[, bias][, softmax_offset]) of one fused_attn call."""
    n = len(qkv)
    diff = list(qkv)
    if bias is not None:
        diff.append(bias)
    if softmax_offset is not None:
        diff.append(softmax_offset)

    def attend(*arrays):
        rest = list(arrays[n:])
        b = rest.pop(0) if bias is not None else None
        o = rest.pop(0) if softmax_offset is not None else None
        return fused_attn(tuple(arrays[:n]), config=config, bias=b, softmax_offset=o,
                          sequence=sequence, **kw)

    out, vjp = jax.vjp(jax.jit(attend), *diff)
    if cotangent is None:
        return out, None
    return out, vjp(cotangent)


def compare(config, qkv, rng, *, tol_factor=1.0, **kw):
    """cudnn's output and gradients equal xla's within tolerance; returns cudnn's."""
    dtype = qkv[0].dtype
    config.backend = "cudnn"
    reason = explain(qkv, config=config, bias=kw.get("bias"), sequence=kw.get("sequence")
                     ).verdicts["cudnn"]
    assert reason is None, reason
    out_shape = jax.eval_shape(lambda *a: fused_attn(a, config=config, **kw), *qkv).shape
    cotangent = random_array(rng, out_shape, dtype)
    poison_like(*qkv, cotangent)  # an output element cuDNN (or our masking) leaves unset reads NaN
    out, grads = run(config, qkv, cotangent=cotangent, **kw)
    config.backend = "xla"
    ref_out, ref_grads = run(config, qkv, cotangent=cotangent, **kw)
    config.backend = "cudnn"
    tol = tolerance(dtype) * tol_factor
    assert_close(out, ref_out, tol, "output")
    names = ["dq", "dk", "dv"][:len(qkv)] + (["dbias"] if kw.get("bias") is not None else []) + (
        ["dsoftmax_offset"] if kw.get("softmax_offset") is not None else [])
    for name, grad, ref in zip(names, grads, ref_grads):
        assert_close(grad, ref, tol, name)
    return out, grads


def inputs(rng, b, sq, skv, h, h_kv, d, dtype, dv=None):
    return (random_array(rng, (b, sq, h, d), dtype), random_array(rng, (b, skv, h_kv, d), dtype),
            random_array(rng, (b, skv, h_kv, dv or d), dtype))


def skip_if_cudnn_refuses(config, qkv, **kw):
    """Skips (with cuDNN's reason) a feature this cuDNN/GPU cannot run."""
    config.backend = "auto"
    reason = explain(qkv, config=config, **kw).verdicts["cudnn"]
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right"])
def test_matches_xla(rng, dtype, d, mask):
    qkv = inputs(rng, 2, 128, 128, 4, 4, d, dtype)
    compare(make_config(mask=mask), qkv, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("sq, skv", [(37, 37), (61, 203), (129, 130), (1, 77)])
def test_odd_lengths(rng, mask, sq, skv):
    qkv = inputs(rng, 3, sq, skv, 4, 4, 64, jnp.bfloat16)
    config = make_config(mask=mask)
    skip_if_cudnn_refuses(config, qkv)
    compare(config, qkv, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("h, h_kv", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_gqa(rng, h, h_kv, mask):
    qkv = inputs(rng, 2, 96, 160, h, h_kv, 64, jnp.bfloat16)
    compare(make_config(mask=mask), qkv, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dim_256(rng, dtype):
    qkv = inputs(rng, 2, 128, 128, 2, 2, 256, dtype)
    config = make_config(mask="causal")
    skip_if_cudnn_refuses(config, qkv)
    compare(config, qkv, rng)


@pytest.mark.gpu
def test_other_layouts_and_scale(rng):
    q, k, v = inputs(rng, 2, 64, 64, 4, 4, 64, jnp.bfloat16)
    config = make_config(mask="causal", qkv_layout="sbhd_sb2hd", scale=0.3)
    qs = jnp.swapaxes(q, 0, 1)
    kv = jnp.stack([jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)], axis=2)
    compare(config, (qs, kv), rng)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_padding(rng, mask):
    b, sq, skv = 4, 80, 96
    qkv = inputs(rng, b, sq, skv, 4, 2, 64, jnp.bfloat16)
    q_len = np.array([80, 33, 1, 50], np.int32)
    kv_len = np.array([96, 40, 17, 20], np.int32)  # row 3: more queries than keys
    sequence = SequenceDescriptor.from_seqlens(q_len, kv_len)
    config = make_config(mask=mask, sequence={"format": "seqlens"})
    out, grads = compare(config, qkv, rng, sequence=sequence)
    out = np.asarray(out, np.float32)
    assert np.all(out[1, 33:] == 0) and np.all(out[2, 1:] == 0)
    dk = np.asarray(grads[1], np.float32)
    assert np.all(dk[1, 40:] == 0) and np.all(dk[3, 20:] == 0)


@pytest.mark.gpu
def test_padding_with_empty_rows(rng):
    qkv = inputs(rng, 3, 64, 64, 2, 2, 64, jnp.bfloat16)
    sequence = SequenceDescriptor.from_seqlens(np.array([64, 0, 10], np.int32),
                                               np.array([0, 64, 64], np.int32))
    config = make_config(mask="padding", sequence={"format": "seqlens"})
    out, grads = compare(config, qkv, rng, sequence=sequence)
    assert np.all(np.asarray(out[0], np.float32) == 0)
    assert np.all(np.asarray(grads[0][0], np.float32) == 0)


def packed_segment_ids(rng, b, s, max_segments):
    """Segment ids [b, s]: each row packs 1..max_segments documents of random lengths."""
    ids = np.zeros((b, s), np.int32)
    for row in range(b):
        n = rng.integers(1, max_segments + 1)
        cuts = np.sort(rng.choice(np.arange(1, s), size=n, replace=False))
        ends = np.append(cuts[1:], s) if n > 1 else np.array([cuts[0]])
        starts = np.append(0, cuts[:-1]) if n > 1 else np.array([0])
        for i, (a, e) in enumerate(zip(starts, ends)):
            ids[row, a:e] = i + 1  # the tail after the last cut stays padding when n == 1
    return ids


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_packed_segment_ids(rng, mask):
    b, s = 3, 160
    qkv = inputs(rng, b, s, s, 4, 2, 64, jnp.bfloat16)
    ids = packed_segment_ids(rng, b, s, max_segments=5)
    sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
    config = make_config(mask=mask, sequence={"format": "segment_ids", "max_segments_per_seq": 5})
    out, grads = compare(config, qkv, rng, sequence=sequence)
    pad = ids == 0
    assert np.all(np.asarray(out, np.float32)[pad] == 0)
    assert np.all(np.asarray(grads[1], np.float32)[pad] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["padding", "padding_causal_bottom_right"])
def test_thd_with_offsets_and_cross_lengths(rng, mask):
    b, t_q, t_kv = 2, 96, 128
    q_len = np.array([[30, 0, 50, -1], [10, 20, 5, 40]], np.int32)
    kv_len = np.array([[40, 8, 60, -1], [10, 0, 40, 70]], np.int32)
    q_off = np.array([[0, 30, 30, 80, -1], [0, 10, 30, 35, 75]], np.int32)
    kv_off = np.array([[4, 44, 52, 112, -1], [0, 10, 10, 50, 120]], np.int32)
    sequence = SequenceDescriptor.from_seqlens_and_offsets(q_len, kv_len, q_off, kv_off)
    qkv = inputs(rng, b, t_q, t_kv, 4, 4, 64, jnp.bfloat16)
    config = make_config(qkv_layout="thd_thd_thd", mask=mask,
                         sequence={"format": "seqlens_offsets", "max_segments_per_seq": 4})
    compare(config, qkv, rng, sequence=sequence)


@pytest.mark.gpu
def test_packing_guard_raises_eagerly_and_gives_nan_under_jit(rng):
    b, s = 2, 64
    qkv = inputs(rng, b, s, s, 2, 2, 64, jnp.bfloat16)
    ids = np.repeat(np.arange(1, 5, dtype=np.int32), 16)[None].repeat(b, 0)  # 4 segments per row
    sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
    config = make_config(mask="padding", backend="cudnn",
                         sequence={"format": "segment_ids", "max_segments_per_seq": 3})
    with pytest.raises(ValueError, match="max_segments_per_seq=3"):
        fused_attn(qkv, config=config, sequence=sequence)
    out = jax.jit(lambda *a: fused_attn(a, config=config, sequence=sequence))(*qkv)
    assert np.all(np.isnan(np.asarray(out, np.float32)))


@pytest.mark.gpu
def test_declared_segment_length_bounds(rng):
    b, s, bound = 2, 128, 40
    qkv = inputs(rng, b, s, s, 2, 2, 64, jnp.bfloat16)
    ids = np.repeat(np.arange(1, 5, dtype=np.int32), 32)[None].repeat(b, 0)  # 4 x 32 tokens
    sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
    config = make_config(mask="padding_causal", sequence={
        "format": "segment_ids", "max_segments_per_seq": 4, "max_seqlen_q": bound,
        "max_seqlen_kv": bound})
    compare(config, qkv, rng, sequence=sequence)
    longer = ids.copy()
    longer[:, 32:40] = 1  # segment 1 now spans 40 tokens, segment 2 keeps 24: still fits
    longer[1, :] = np.repeat(np.arange(1, 3, dtype=np.int32), 64)  # row 1: 64 > bound
    config.backend = "cudnn"
    with pytest.raises(ValueError, match="max_seqlen_q=40"):
        fused_attn(qkv, config=config,
                   sequence=SequenceDescriptor.from_segment_ids_and_pos(longer, longer))


@pytest.mark.gpu
def test_vmap_of_packed_rows_equals_the_batched_call(rng):
    b, s = 4, 96
    q, k, v = inputs(rng, b, s, s, 4, 4, 64, jnp.bfloat16)
    ids = packed_segment_ids(rng, b, s, max_segments=3)
    config = make_config(mask="padding_causal", backend="cudnn",
                         sequence={"format": "segment_ids", "max_segments_per_seq": 3})

    def one(q, k, v, ids):
        sequence = SequenceDescriptor.from_segment_ids_and_pos(ids[None], ids[None])
        return fused_attn((q[None], k[None], v[None]), config=config, sequence=sequence)[0]

    batched = jax.jit(jax.vmap(one))(q, k, v, ids)
    direct = fused_attn((q, k, v), config=config,
                        sequence=SequenceDescriptor.from_segment_ids_and_pos(ids, ids))
    np.testing.assert_array_equal(np.asarray(batched, np.float32), np.asarray(direct, np.float32))


@pytest.mark.gpu
def test_vmap_over_learnable_offsets_uses_each_examples_offsets(rng):
    q, k, v = inputs(rng, 2, 64, 64, 4, 4, 64, jnp.bfloat16)
    offsets = jnp.asarray(rng.standard_normal((3, 4)) * 2, jnp.float32)
    config = make_config(mask="causal", softmax="learnable", backend="cudnn")
    skip_if_cudnn_refuses(config, (q, k, v))
    config.backend = "cudnn"

    def attend(offset):
        return fused_attn((q, k, v), config=config, softmax_offset=offset)

    batched = jax.jit(jax.vmap(attend))(offsets)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i], np.float32),
                                      np.asarray(attend(offsets[i]), np.float32))
    grads = jax.vmap(jax.grad(lambda o: jnp.sum(attend(o).astype(jnp.float32))))(offsets)
    for i in range(3):
        expected = jax.grad(lambda o: jnp.sum(attend(o).astype(jnp.float32)))(offsets[i])
        assert_close(grads[i], expected, 1e-3, f"dsoftmax_offset[{i}]")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bias_and_offset", "padded_offset", "packed_offset"])
def test_vmap_of_grad_gives_per_example_gradients_of_shared_operands(rng, case):
    """jax.vmap(jax.grad(f)) with the softmax offset (and a bias [1, h, sq, skv]) unmapped:
    one folded call each way, and each example's dsink (from cuDNN's statistics, in its
    per-slot layout when padded or packed) and dbias equal the XLA backend's for that
    example alone. Also jax.grad(jax.vmap(f)): their sum."""
    n, b, s, h = 3, 2, 64, 4
    q, k, v = (x.reshape((n, b) + x.shape[1:])
               for x in inputs(rng, n * b, s, s, h, h, 64, jnp.bfloat16))
    w = random_array(rng, q.shape, jnp.bfloat16)
    offset = jnp.asarray(rng.standard_normal(h), jnp.float32)
    bias, lengths = None, None
    if case == "bias_and_offset":
        config = make_config(mask="causal", softmax="learnable", bias="post_scale_bias")
        bias = random_array(rng, (1, h, s, s), jnp.bfloat16)
    elif case == "padded_offset":
        config = make_config(mask="padding_causal", softmax="learnable",
                             sequence={"format": "seqlens"})
        lengths = jnp.asarray(rng.integers(1, s + 1, (n, b)), jnp.int32)
    else:
        config = make_config(mask="padding_causal", softmax="learnable",
                             qkv_layout="thd_thd_thd",
                             sequence={"format": "seqlens_offsets", "max_segments_per_seq": 2})
        lengths = jnp.asarray(np.broadcast_to([[40, 24]], (n, b, 2)), jnp.int32)

    def sequence_of(lengths):
        if case == "padded_offset":
            return SequenceDescriptor.from_seqlens(lengths, lengths)
        offsets = jnp.concatenate([jnp.zeros_like(lengths[:, :1]), jnp.cumsum(lengths, 1)], 1)
        return SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths, offsets, offsets)

    def loss(q, k, v, w, lengths, offset, *bias):
        out = fused_attn((q, k, v), config=config, softmax_offset=offset,
                         bias=bias[0] if bias else None,
                         sequence=None if lengths is None else sequence_of(lengths))
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))

    shared = (offset,) if bias is None else (offset, bias)
    skip_if_cudnn_refuses(config, (q[0], k[0], v[0]), bias=bias,
                          sequence=None if lengths is None else sequence_of(lengths[0]))
    grad = jax.grad(loss, argnums=tuple(range(5, 5 + len(shared))))
    axes = (0, 0, 0, 0, None if lengths is None else 0) + (None,) * len(shared)
    config.backend = "cudnn"
    per_example = jax.jit(jax.vmap(grad, in_axes=axes))
    jaxpr = str(jax.make_jaxpr(per_example)(q, k, v, w, lengths, *shared))
    assert "while" not in jaxpr and "scan" not in jaxpr
    got = per_example(q, k, v, w, lengths, *shared)
    summed = jax.jit(jax.grad(lambda *a: jnp.sum(jax.vmap(loss, in_axes=axes)(*a)),
                              argnums=tuple(range(5, 5 + len(shared)))))(
        q, k, v, w, lengths, *shared)
    config.backend = "xla"
    expected = [grad(q[i], k[i], v[i], w[i], None if lengths is None else lengths[i], *shared)
                for i in range(n)]
    tol = tolerance(jnp.bfloat16)
    for j, name in enumerate(["dsoftmax_offset", "dbias"][:len(shared)]):
        for i in range(n):
            assert_close(got[j][i], expected[i][j], tol, f"{name}[{i}]")
        assert_close(summed[j], sum(np.asarray(e[j], np.float32) for e in expected), tol, name)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("bias_shape", [(1, 4, 64, 96), (2, 4, 64, 96), (1, 1, 64, 96)])
def test_bias(rng, kind, bias_shape):
    qkv = inputs(rng, 2, 64, 96, 4, 4, 64, jnp.bfloat16)
    bias = random_array(rng, bias_shape, jnp.bfloat16)
    config = make_config(mask="causal", bias=kind)
    skip_if_cudnn_refuses(config, qkv, bias=bias)
    compare(config, qkv, rng, bias=bias, tol_factor=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
def test_softmax_sink(rng, softmax):
    qkv = inputs(rng, 2, 64, 64, 4, 4, 64, jnp.bfloat16)
    config = make_config(mask="causal", softmax=softmax)
    offset = jnp.asarray(rng.standard_normal(4), jnp.float32)
    skip_if_cudnn_refuses(config, qkv)
    kw = dict(softmax_offset=offset) if softmax == "learnable" else {}
    compare(config, qkv, rng, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("mask, window", [("causal", (16, 0)), ("causal", (0, 0)),
                                          ("no_mask", (8, 8)), ("causal_bottom_right", (20, -1)),
                                          ("no_mask", (-1, 4))])
def test_sliding_window(rng, mask, window):
    qkv = inputs(rng, 2, 128, 128, 4, 4, 64, jnp.bfloat16)
    config = make_config(mask=mask, window_size=window)
    skip_if_cudnn_refuses(config, qkv)
    compare(config, qkv, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("bias_shape", [(3, 4), (1, 4), (3, 1), (1, 1)])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_bias_with_padding(rng, kind, bias_shape, mask):
    """A bias over the padded rows of the seqlens form (one sequence per row), gradient
    included: zero at padded positions, per row or summed over the rows sharing it."""
    b, sq, skv = 3, 80, 96
    qkv = inputs(rng, b, sq, skv, 4, 2, 64, jnp.bfloat16)
    sequence = SequenceDescriptor.from_seqlens(np.array([80, 33, 0], np.int32),
                                               np.array([96, 40, 17], np.int32))
    config = make_config(mask=mask, bias=kind, sequence={"format": "seqlens"})
    bias = random_array(rng, bias_shape + (sq, skv), jnp.bfloat16)
    _, grads = compare(config, qkv, rng, bias=bias, sequence=sequence, tol_factor=1.5)
    if bias_shape[0] == b:
        dbias = np.asarray(grads[3], np.float32)
        assert np.all(dbias[1, :, 33:] == 0) and np.all(dbias[1, :, :, 40:] == 0)
        assert np.all(dbias[2] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gqa_6_heads", "cross", "window", "padding", "packed", "thd"])
def test_alibi(rng, case):
    """cuDNN's ALiBi (its own slopes, under top-left causal masks) equals the XLA backend's,
    with 6 query heads (slopes past the largest power of two) and per segment."""
    b, sq, skv, h, h_kv = 2, 96, 96, 4, 4
    if case == "gqa_6_heads":
        h, h_kv = 6, 3
    if case == "cross":
        skv = 160
    mask = "padding_causal" if case in ("padding", "packed", "thd") else "causal"
    overrides = dict(mask=mask, bias="alibi", window_size=(24, 0) if case == "window" else (-1, -1))
    sequence = None
    if case == "padding":
        sequence = SequenceDescriptor.from_seqlens(np.array([96, 41], np.int32),
                                                   np.array([70, 96], np.int32))
        overrides["sequence"] = {"format": "seqlens"}
    elif case == "packed":
        ids = packed_segment_ids(rng, b, sq, max_segments=4)
        sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
        overrides["sequence"] = {"format": "segment_ids", "max_segments_per_seq": 4}
    elif case == "thd":
        q_len = np.array([[30, 50, -1], [10, 20, 40]], np.int32)
        q_off = np.array([[0, 30, 80, -1], [0, 10, 30, 70]], np.int32)
        sequence = SequenceDescriptor.from_seqlens_and_offsets(q_len, q_len, q_off, q_off)
        overrides.update(qkv_layout="thd_thd_thd",
                         sequence={"format": "seqlens_offsets", "max_segments_per_seq": 3})
    qkv = inputs(rng, b, sq, skv, h, h_kv, 64, jnp.bfloat16)
    config = make_config(**overrides)
    out, grads = compare(config, qkv, rng, sequence=sequence)
    again, _ = run(config, qkv, sequence=sequence)  # the slopes are copied in on every call
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


@pytest.mark.gpu
def test_vmap_folds_into_the_batch(rng):
    q, k, v = inputs(rng, 6, 64, 64, 4, 4, 64, jnp.bfloat16)
    config = make_config(mask="causal", backend="cudnn")

    def one(q, k, v):
        return fused_attn((q[None], k[None], v[None]), config=config)[0]

    batched = jax.jit(jax.vmap(one))(q, k, v)
    direct = fused_attn((q, k, v), config=config)
    np.testing.assert_array_equal(np.asarray(batched, np.float32), np.asarray(direct, np.float32))
    jaxpr = str(jax.make_jaxpr(jax.vmap(one))(q, k, v))
    assert "while" not in jaxpr


@pytest.mark.gpu
def test_deterministic_backward_is_bitwise_repeatable(rng):
    qkv = inputs(rng, 2, 512, 512, 8, 2, 64, jnp.bfloat16)
    config = make_config(mask="causal", backend="cudnn", deterministic_backward=True)
    cotangent = random_array(rng, qkv[0].shape, jnp.bfloat16)
    _, first = run(config, qkv, cotangent=cotangent)
    for _ in range(3):
        _, again = run(config, qkv, cotangent=cotangent)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    compare(config, qkv, rng)


# ---- GPU: the forward without stats (training=false) --------------------------------------

def inference_case(rng, case):
    """(config, qkv, fused_attn keywords) of one configuration of the inference forward."""
    kw = {}
    if case == "issue_shape":  # issue 5's small shape, where the forward lagged JAX's
        return make_config(mask="causal"), inputs(rng, 16, 512, 512, 16, 16, 64, jnp.bfloat16), kw
    if case == "gqa_window":
        return (make_config(mask="causal", window_size=(32, 0)),
                inputs(rng, 2, 128, 128, 8, 2, 64, jnp.bfloat16), kw)
    if case == "padding":
        kw["sequence"] = SequenceDescriptor.from_seqlens(np.array([80, 33, 1, 50], np.int32),
                                                         np.array([96, 40, 17, 20], np.int32))
        return (make_config(mask="padding_causal", sequence={"format": "seqlens"}),
                inputs(rng, 4, 80, 96, 4, 2, 64, jnp.bfloat16), kw)
    if case == "packed":
        ids = packed_segment_ids(rng, 3, 160, max_segments=5)
        kw["sequence"] = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
        return (make_config(mask="padding_causal",
                            sequence={"format": "segment_ids", "max_segments_per_seq": 5}),
                inputs(rng, 3, 160, 160, 4, 2, 64, jnp.bfloat16), kw)
    if case == "bias":
        kw["bias"] = random_array(rng, (1, 4, 64, 96), jnp.bfloat16)
        return (make_config(mask="causal", bias="post_scale_bias"),
                inputs(rng, 2, 64, 96, 4, 4, 64, jnp.bfloat16), kw)
    assert case == "learnable_sink", case
    kw["softmax_offset"] = jnp.asarray(rng.standard_normal(4), jnp.float32)
    return (make_config(mask="causal", softmax="learnable"),
            inputs(rng, 2, 64, 64, 4, 4, 64, jnp.bfloat16), kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["issue_shape", "gqa_window", "padding", "packed", "bias",
                                  "learnable_sink"])
def test_inference_forward_equals_the_training_forward(rng, case):
    """The forward of a call nobody differentiates (cuDNN's graph without stats, possibly
    another engine) gives the differentiated call's output: within the dtype's tolerance,
    of it and of the xla backend (the comparisons against xla elsewhere differentiate, so
    they run the training forward only)."""
    config, qkv, kw = inference_case(rng, case)
    skip_if_cudnn_refuses(config, qkv, **{k: v for k, v in kw.items() if k != "softmax_offset"})

    def attention(backend):  # a new function per backend: jit caches traces per function
        def attend(*qkv):
            return fused_attn(qkv, config=config, **kw)
        config.backend = backend
        return jax.jit(attend)

    attend = attention("cudnn")
    inference = attend(*qkv)
    training, _ = jax.vjp(attend, *qkv)
    tol = tolerance(jnp.bfloat16)
    assert_close(inference, training, tol, "inference forward against the training forward")
    assert_close(inference, attention("xla")(*qkv), tol * 1.5, "inference forward against xla")


@pytest.mark.gpu
def test_inference_forward_draws_the_training_forwards_dropout_mask():
    """With dropout (is_training=True), a call nobody differentiates draws the same mask
    from the same key as the differentiated call: cuDNN's graph without stats keeps the
    composite implementation whose mask the training forward and the backward share."""
    rate = 0.3
    config, (q, k, v) = dropout_probe(rate)
    key = jax.random.key(11)

    def attend(v):
        return fused_attn((q, k, v), config=config, dropout_rng=key, is_training=True)

    inference = np.asarray(jax.jit(attend)(v), np.float32)
    training, _ = jax.vjp(jax.jit(attend), v)
    training = np.asarray(training, np.float32)
    s = q.shape[1]
    np.testing.assert_array_equal(np.round(inference * (1 - rate) * s),
                                  np.round(training * (1 - rate) * s))
    np.testing.assert_allclose(inference, training, rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
def test_forward_and_backward_check_the_training_attribute(rng):
    """The FFI calls themselves: with training=false the forward's stats result must be the
    float32 [0] placeholder, the backward refuses training=false, and a workspace result
    smaller than the library's size for the call is refused."""
    assert cudnn_library.available() is None
    q, k, v = inputs(rng, 2, 64, 64, 4, 4, 64, jnp.bfloat16)
    static = cudnn.graph_key._static(spec(mask="causal"), 0.125, False, False, 64, 64)
    bias = np.zeros((1, 1, 1, 1), q.dtype)
    # bias, seqlen_q, seqlen_kv, offsets, rng, sink: none read by a dense call
    calls = cudnn.ffi_calls
    unread = (bias,) + (calls._UNREAD_INT32,) * 3 + (calls._UNREAD_UINT32, calls._UNREAD_FLOAT32)

    def run(target, results, training, *arrays):
        """The call's results but the last, its workspace."""
        call = jax.ffi.ffi_call(target, tuple(jax.ShapeDtypeStruct(*r) for r in results))
        return jax.block_until_ready(jax.jit(lambda q, k, v, *more: call(
            q, k, v, *unread, *more, **static.attributes(training)))(q, k, v, *arrays))[:-1]

    def workspace(backward, training=True, short=0):
        size = cudnn.ffi_calls._workspace(static, q, k, v, bias, backward, training).shape[0]
        assert size >= short
        return (size - short,), jnp.uint8

    def forward(training, stats_shape):
        return run(cudnn_library.FWD_TARGET, ((q.shape, q.dtype), (stats_shape, jnp.float32),
                                      workspace(False, training)), training)

    def backward(training, o, stats, short=0):
        results = ([(x.shape, x.dtype) for x in (q, k, v, bias)] + [((), jnp.float32)]
                   + [workspace(True, short=short)])
        return run(cudnn_library.BWD_TARGET, results, training, o, stats, o)

    o, _ = forward(False, (0,))
    o_training, stats = forward(True, (2, 4, 64, 1))
    assert_close(o, o_training, tolerance(jnp.bfloat16), "o")
    with pytest.raises(Exception, match=r"with training false, a placeholder stats float32 \[0\]"):
        forward(False, (2, 4, 64, 1))
    with pytest.raises(Exception, match=r"stats float32 \[B \* max\(segments, 1\), H, Sq', 1\]"):
        forward(True, (0,))
    backward(True, o_training, stats)
    with pytest.raises(Exception, match="training must be true"):
        backward(False, o_training, stats)
    with pytest.raises(Exception, match=r"the workspace result must be uint8 of at least \d+ bytes"):
        backward(True, o_training, stats, short=1)


# ---- GPU: dropout -------------------------------------------------------------------------

def dropout_probe(rate, b=2, h=4, s=128):
    """With q = 0 every weight is 1/s; v = identity reads the kept mask out of the output:
    out[b, i, h, j] = keep(b, h, i, j) / ((1 - rate) s)."""
    q = jnp.zeros((b, s, h, s), jnp.bfloat16)
    k = jnp.zeros((b, s, h, s), jnp.bfloat16)
    v = jnp.broadcast_to(jnp.eye(s, dtype=jnp.bfloat16)[None, :, None, :], (b, s, h, s))
    config = make_config(mask="no_mask", backend="cudnn", dropout_rate=rate)
    return config, (q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_statistics_and_determinism(rate):
    config, qkv = dropout_probe(rate)
    s = qkv[0].shape[1]
    attend = jax.jit(lambda key: fused_attn(qkv, config=config, dropout_rng=key, is_training=True))
    out = np.asarray(attend(jax.random.key(1)), np.float32) * (1 - rate) * s
    keep = np.round(out)
    np.testing.assert_allclose(out, keep, atol=0.02)  # every weight kept (scaled) or dropped
    assert set(np.unique(keep)) <= {0.0, 1.0}
    n = keep.size
    kept = keep.mean()
    assert abs(kept - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n), kept
    # per-row kept counts are binomial: the mask is not constant along rows or heads
    assert keep.std(axis=(1, 3)).max() > 0
    again = np.asarray(attend(jax.random.key(1)), np.float32) * (1 - rate) * s
    np.testing.assert_array_equal(out, again)
    other = np.asarray(attend(jax.random.key(2)), np.float32) * (1 - rate) * s
    assert np.mean(np.round(other) != keep) > rate * (1 - rate)


@pytest.mark.gpu
def test_dropout_backward_uses_the_forward_mask(rng):
    rate = 0.2
    config, (q, k, v) = dropout_probe(rate)
    b, s, h, _ = q.shape
    key = jax.random.key(7)

    def attend(v):
        return fused_attn((q, k, v), config=config, dropout_rng=key, is_training=True)

    out, vjp = jax.vjp(jax.jit(attend), v)
    do = random_array(rng, out.shape, jnp.bfloat16)
    (dv,) = vjp(do)
    weights = np.asarray(out, np.float32)  # [b, i, h, j]: dropped-and-scaled weights
    expected = np.einsum("bihj,bihc->bjhc", weights, np.asarray(do, np.float32))
    assert_close(dv, expected, tolerance(jnp.bfloat16), "dv")


@pytest.mark.gpu
def test_dropout_off_when_not_training(rng):
    qkv = inputs(rng, 2, 64, 64, 4, 4, 64, jnp.bfloat16)
    config = make_config(mask="causal", dropout_rate=0.3)
    compare(config, qkv, rng, dropout_rng=jax.random.key(0), is_training=False)


# ---- GPU: selection -------------------------------------------------------------------------

@pytest.mark.gpu
def test_auto_picks_cudnn_and_explains_refusals():
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    assert explain((q, q, q), config=make_config()).backend == "cudnn"
    f32 = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.float32)
    e = explain((f32, f32, f32), config=make_config())
    assert e.backend != "cudnn" and "float32" in e.verdicts["cudnn"]
    big = jax.ShapeDtypeStruct((2, 128, 4, 512), jnp.bfloat16)
    assert "at most 256" in explain((big, big, big), config=make_config()).verdicts["cudnn"]
