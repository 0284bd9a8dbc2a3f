"""The small_seq backend (host build on the CPU, kernels on the GPU) against the XLA backend.

The XLA backend is itself checked against a float64 NumPy reference
(test_xla_backend.py); here both run on the same inputs, so the comparison is
tight in float32 and holds every gradient, layout, padding form, GQA and the
dropout mask (both draw it from the same Philox definition).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from conftest import assert_close, make_config, poison_like, random_array, tolerance
from fusedattn.ops import _library
from fusedattn.ops import AttentionSpec, SequenceDescriptor, explain, fused_attn
from fusedattn.ops.backends import small_seq

ON_GPU = jax.devices()[0].platform == "gpu"


def small_seq_config(layout="bshd_bshd_bshd", mask="padding", max_kv=16, sequence=(),
                     **overrides):
    """A config declaring one query per segment and at most max_kv keys."""
    bounds = {"max_seqlen_q": 1, "max_seqlen_kv": max_kv, **dict(sequence)}
    return make_config(qkv_layout=layout, mask=mask, sequence=bounds, **overrides)


def run_both(qkv, config, cotangent, **kwargs):
    """(output, grads) of backend small_seq and of backend xla for the same call."""
    results = []
    for backend in ("small_seq", "xla"):
        config.backend = backend

        def attend(*arrays):
            return fused_attn(arrays, config=config, **kwargs)

        out, vjp = jax.vjp(attend, *qkv)
        results.append((out, vjp(cotangent)))
    return results


def check_against_xla(qkv, config, rng, **kwargs):
    """Output and every gradient of small_seq equal XLA's within the dtype's tolerance."""
    dtype = qkv[0].dtype
    config.backend = "xla"
    out_shape = jax.eval_shape(lambda *a: fused_attn(a, config=config, **kwargs), *qkv).shape
    cotangent = random_array(rng, out_shape, dtype)
    (out, grads), (ref_out, ref_grads) = run_both(qkv, config, cotangent, **kwargs)
    tol = tolerance(dtype)
    assert_close(out, ref_out, tol, "output")
    for name, grad, ref in zip("qkv", grads, ref_grads):
        assert_close(grad, ref, tol, f"d{name}")
    return out, grads


def bshd_inputs(rng, b, s_kv, h, h_kv, d, dtype):
    q = random_array(rng, (b, 1, h, d), dtype)
    k = random_array(rng, (b, s_kv, h_kv, d), dtype)
    v = random_array(rng, (b, s_kv, h_kv, d), dtype)
    return q, k, v


@pytest.mark.parametrize("s_kv", range(1, 17))
def test_every_key_count_with_padding(rng, s_kv):
    b = 6
    qkv = bshd_inputs(rng, b, s_kv, 4, 4, 64, jnp.float32)
    kv_len = jnp.asarray(rng.integers(0, s_kv + 1, b), jnp.int32)
    kv_len = kv_len.at[0].set(0).at[1].set(s_kv)  # an empty key set and a full one
    q_len = jnp.ones((b,), jnp.int32).at[2].set(0)  # a padded query
    sequence = SequenceDescriptor.from_seqlens(q_len, kv_len)
    out, (dq, dk, dv) = check_against_xla(qkv, small_seq_config(max_kv=s_kv), rng,
                                          sequence=sequence)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(out[2]) == 0)
    assert np.all(np.asarray(dk[0]) == 0) and np.all(np.asarray(dq[2]) == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d", small_seq.HEAD_DIMS)
def test_head_dims_and_dtypes(rng, d, dtype):
    qkv = bshd_inputs(rng, 3, 7, 2, 2, d, dtype)
    kv_len = jnp.asarray([7, 3, 5], jnp.int32)
    sequence = SequenceDescriptor.from_seqlens(jnp.ones((3,), jnp.int32), kv_len)
    check_against_xla(qkv, small_seq_config(max_kv=8), rng, sequence=sequence)


@pytest.mark.parametrize("h, h_kv", [(8, 2), (6, 1), (4, 4)])
def test_grouped_query_attention(rng, h, h_kv):
    qkv = bshd_inputs(rng, 4, 9, h, h_kv, 64, jnp.float32)
    check_against_xla(qkv, small_seq_config(mask="no_mask"), rng)


def test_sbhd_layout(rng):
    q, k, v = bshd_inputs(rng, 5, 4, 2, 2, 64, jnp.float32)
    qkv = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v))
    check_against_xla(qkv, small_seq_config(layout="sbhd_sbhd_sbhd", mask="no_mask"), rng)


def thd_offsets_descriptor():
    """Two rows, up to 3 segments each: kv segment lengths 3, 0, 16 and 16, 1 (unused -1)."""
    q_lens = jnp.asarray([[1, 1, 1], [1, 1, -1]], jnp.int32)
    kv_lens = jnp.asarray([[3, 0, 16], [16, 1, -1]], jnp.int32)
    q_offsets = jnp.asarray([[0, 1, 2, 3], [0, 1, 2, -1]], jnp.int32)
    kv_offsets = jnp.asarray([[0, 4, 4, 20], [2, 18, 19, -1]], jnp.int32)
    return SequenceDescriptor.from_seqlens_and_offsets(q_lens, kv_lens, q_offsets, kv_offsets)


def test_thd_several_segments_per_row(rng):
    q = random_array(rng, (2, 4, 4, 64))  # 4 query slots: up to 3 segments and padding
    k, v = random_array(rng, (2, 24, 2, 64)), random_array(rng, (2, 24, 2, 64))
    config = small_seq_config(layout="thd_thd_thd",
                              sequence={"max_segments_per_seq": 3, "max_seqlen_q": 1,
                                        "max_seqlen_kv": 16})
    out, (_, dk, _) = check_against_xla((q, k, v), config, rng, sequence=thd_offsets_descriptor())
    assert np.all(np.asarray(out[0, 3]) == 0)  # the padding query slot
    assert np.all(np.asarray(dk[1, :2]) == 0)  # keys before row 1's first segment


def test_thd_packed_kv_and_segment_ids(rng):
    q = random_array(rng, (2, 3, 4, 64))
    kv = random_array(rng, (2, 12, 2, 4, 64))
    q_ids = jnp.asarray([[1, 2, 0], [3, 0, 0]], jnp.int32)
    kv_ids = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0, 0, 0, 0, 0], [3] * 10 + [0, 0]], jnp.int32)
    sequence = SequenceDescriptor.from_segment_ids_and_pos(q_ids, kv_ids)
    config = small_seq_config(layout="thd_t2hd", max_kv=10,
                              sequence={"format": "segment_ids", "max_segments_per_seq": 2})
    check_against_xla((q, kv), config, rng, sequence=sequence)


def test_dropout_matches_the_xla_mask(rng):
    qkv = bshd_inputs(rng, 8, 12, 4, 2, 64, jnp.float32)
    config = small_seq_config(mask="no_mask", dropout_rate=0.3)
    key = jax.random.key(7)
    out, _ = check_against_xla(qkv, config, rng, dropout_rng=key, is_training=True)
    config.backend = "small_seq"
    again = fused_attn(qkv, config=config, dropout_rng=key, is_training=True)
    other = fused_attn(qkv, config=config, dropout_rng=jax.random.key(8), is_training=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
    assert not np.allclose(np.asarray(out), np.asarray(other))


def test_vmap_folds_into_one_kernel_call(rng):
    q, k, v = bshd_inputs(rng, 6, 5, 2, 2, 64, jnp.float32)
    config = small_seq_config(mask="no_mask", backend="small_seq")
    attend = lambda q, k, v: fused_attn((q, k, v), config=config)
    stacked = tuple(a.reshape(2, 3, *a.shape[1:]) for a in (q, k, v))
    batched = jax.vmap(attend)(*stacked)
    assert_close(batched.reshape(q.shape[0], *batched.shape[2:]), attend(q, k, v), 1e-6, "vmap")
    jaxpr = str(jax.make_jaxpr(jax.vmap(jax.grad(lambda *a: attend(*a).sum())))(*stacked))
    assert jaxpr.count(small_seq.FWD_TARGET) == 1 and jaxpr.count(small_seq.BWD_TARGET) == 1
    assert "while" not in jaxpr and "scan" not in jaxpr


def broken_bound_call(rng):
    """A call declaring max_seqlen_kv=4 whose row 1 has 6 keys."""
    qkv = bshd_inputs(rng, 3, 8, 2, 2, 64, jnp.float32)
    sequence = SequenceDescriptor.from_seqlens(jnp.ones((3,), jnp.int32),
                                               jnp.asarray([4, 6, 2], jnp.int32))
    return qkv, small_seq_config(max_kv=4, backend="small_seq"), sequence


def test_guard_raises_eagerly_naming_the_bound(rng):
    qkv, config, sequence = broken_bound_call(rng)
    with pytest.raises(ValueError, match=r"max_seqlen_kv=4"):
        fused_attn(qkv, config=config, sequence=sequence)


def test_guard_under_jit_gives_nan_never_numbers(rng):
    qkv, config, sequence = broken_bound_call(rng)
    out = jax.jit(lambda *a: fused_attn(a, config=config, sequence=sequence))(*qkv)
    out = np.asarray(out)
    assert np.all(np.isnan(out[1])), "the broken row must be NaN"
    assert np.all(np.isfinite(out[[0, 2]])), "the rows within the bound stay correct"


def test_guard_reports_through_checkify(rng):
    qkv, config, sequence = broken_bound_call(rng)
    checked = checkify.checkify(jax.jit(lambda *a: fused_attn(a, config=config, sequence=sequence)))
    error, _ = checked(*qkv)
    with pytest.raises(checkify.JaxRuntimeError, match=r"max_seqlen_kv=4"):
        error.throw()
    ok_sequence = SequenceDescriptor.from_seqlens(jnp.ones((3,), jnp.int32),
                                                  jnp.asarray([4, 3, 2], jnp.int32))
    error, out = checkify.checkify(
        jax.jit(lambda *a: fused_attn(a, config=config, sequence=ok_sequence)))(*qkv)
    assert error.get() is None and np.all(np.isfinite(np.asarray(out)))


def test_check_bounds_off_drops_the_checkify_effect_and_keeps_the_nan_marks(rng):
    qkv, config, sequence = broken_bound_call(rng)
    # A fresh function per trace: jax caches a function's trace across config changes.
    effects = lambda: jax.make_jaxpr(lambda *a: fused_attn(a, config=config, sequence=sequence))(
        *qkv).effects
    assert effects(), "the default reports through checkify"
    config.sequence.check_bounds = False
    assert not effects(), "check_bounds=False must leave no effect"
    attend = lambda *a: fused_attn(a, config=config, sequence=sequence)
    error, out = checkify.checkify(jax.jit(attend))(*qkv)
    assert error.get() is None
    out = np.asarray(out)
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[[0, 2]]))
    with pytest.raises(ValueError, match=r"max_seqlen_kv=4"):  # eager use still raises
        attend(*qkv)


@pytest.mark.parametrize("declared_keys", [None, 8])
def test_no_guard_where_no_data_can_break_the_bounds(rng, declared_keys):
    """One query token per row, the key bound at least the kv extent (8), lengths form: every
    valid descriptor fits, so the call carries no bound guard of its own; only the
    descriptor's value checks (ops/validation.py: lengths in [0, extent], one check per
    side), and none at all with config.sequence.check_bounds off (JAX's fast dispatch)."""
    qkv = bshd_inputs(rng, 3, 8, 2, 2, 64, jnp.float32)
    sequence = SequenceDescriptor.from_seqlens(jnp.asarray([1, 1, 0], jnp.int32),
                                               jnp.asarray([4, 8, 0], jnp.int32))

    def checks(config):
        jaxpr = jax.make_jaxpr(lambda *a: fused_attn(a, config=config, sequence=sequence))(*qkv)
        return [e.primitive.name for e in jaxpr.eqns].count("check")

    config = small_seq_config(max_kv=declared_keys, backend="small_seq")
    assert checks(config) == 2
    assert checks(small_seq_config(max_kv=declared_keys, backend="small_seq",
                                   sequence={"check_bounds": False})) == 0
    attend = jax.jit(lambda *a: fused_attn(a, config=config, sequence=sequence))
    out = attend(*qkv)
    config.backend = "xla"
    expected = jax.jit(lambda *a: fused_attn(a, config=config, sequence=sequence))(*qkv)
    assert_close(out, expected, 1e-5, "out")
    broken = small_seq_config(max_kv=4, backend="small_seq")  # 8 keys can exceed 4
    assert checks(broken) == 3


def test_guard_rejects_two_queries_in_one_segment(rng):
    q = random_array(rng, (1, 2, 2, 64))
    k, v = random_array(rng, (1, 4, 2, 64)), random_array(rng, (1, 4, 2, 64))
    sequence = SequenceDescriptor.from_segment_ids_and_pos(jnp.asarray([[1, 1]]),
                                                           jnp.asarray([[1, 1, 1, 0]]))
    config = small_seq_config(layout="thd_thd_thd", backend="small_seq", max_kv=4)
    with pytest.raises(ValueError, match="more than one query token"):
        fused_attn((q, k, v), config=config, sequence=sequence)


def raw_op_library():
    """Loads the op library of the default device, for tests calling the FFI ops directly."""
    assert _library.load(jax.devices()[0].platform), _library.available(jax.devices()[0].platform)


def test_forward_saves_the_log_sum_exp_of_each_query_heads_scores(rng):
    """lse [b, 1, h] (float32) is log sum_j exp(scale * q.k_j): -inf without keys, NaN when broken."""
    raw_op_library()
    b, s_kv, h, h_kv, d = 5, 6, 4, 2, 64
    q, k, v = bshd_inputs(rng, b, s_kv, h, h_kv, d, jnp.float32)
    kv_start = jnp.asarray([[0], [1], [0], [2], [0]], jnp.int32)
    kv_len = jnp.asarray([[6], [3], [0], [4], [-1]], jnp.int32)  # row 2 padding, row 4 broken
    scale = d ** -0.5
    o, lse = jax.jit(small_seq._forward_call, static_argnums=(6, 7, 8))(
        q, k, v, kv_start, kv_len, jnp.zeros((2,), jnp.uint32), scale, 0.0, s_kv)
    assert lse.shape == (b, 1, h) and lse.dtype == jnp.float32
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    lse = np.asarray(lse)
    for row in range(4):
        start, length = int(kv_start[row, 0]), int(kv_len[row, 0])
        for head in range(h):
            keys = k64[row, start:start + length, head // (h // h_kv)]
            scores = scale * keys @ q64[row, 0, head]
            expected = np.log(np.exp(scores).sum()) if length else -np.inf
            np.testing.assert_allclose(lse[row, 0, head], expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.isnan(lse[4])) and np.all(np.isnan(np.asarray(o)[4]))


def test_backward_names_an_lse_of_the_wrong_shape(rng):
    raw_op_library()
    q, k, v = bshd_inputs(rng, 2, 4, 2, 2, 64, jnp.float32)
    kv_start, kv_len = jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 4, jnp.int32)
    bad_lse = jnp.zeros((2, 2), jnp.float32)  # [b, h]: the query axis is missing
    call = functools.partial(small_seq._backward, (0.125, 0.0, 4))
    with pytest.raises(Exception, match=r"lse must have shape \[2, 1, 2\], got \[2, 2\]"):
        jax.block_until_ready(  # on the GPU the handler's error arrives with the results
            jax.jit(call)(q, k, v, kv_start, kv_len, jnp.zeros((1, 2), jnp.uint32), q, bad_lse, q))


def test_key_ranges_of_every_form():
    tokens = SequenceDescriptor.from_segment_ids_and_pos(
        jnp.asarray([[2, 1, 0]]), jnp.asarray([[1, 1, 2, 2, 2, 0, 1]])).token_info(
        AttentionSpec.from_config(small_seq_config()), 3, 7)
    start, length = small_seq.key_ranges(tokens, max_keys=16)
    # id 2 is contiguous at 2..4; id 1 occurs at 0, 1 and 6: not contiguous, so broken.
    np.testing.assert_array_equal(np.asarray(start), [[2, 0, 0]])
    np.testing.assert_array_equal(np.asarray(length), [[3, -1, 0]])


@pytest.mark.parametrize("seqlen_q,seqlen_kv", [(1, 4), (1, 20), (3, 9)])
def test_prefix_key_ranges_match_key_ranges(rng, seqlen_q, seqlen_kv):
    """The lengths-only key ranges equal key_ranges of the same descriptor's (or of no
    descriptor's) segment ids, lengths negative and past the extent included; the start may
    differ only for a query without keys, which no kernel reads."""
    from fusedattn.ops.sequence import dense_token_info

    spec = AttentionSpec.from_config(small_seq_config())
    batch, max_keys = 64, 16
    q_len = jnp.asarray(rng.integers(-1, seqlen_q + 2, batch), jnp.int32)
    kv_len = jnp.asarray(rng.integers(-1, seqlen_kv + 2, batch), jnp.int32)
    sequence = SequenceDescriptor.from_seqlens(q_len, kv_len)
    for descriptor, tokens in ((sequence, sequence.token_info(spec, seqlen_q, seqlen_kv)),
                               (None, dense_token_info(spec, batch, seqlen_q, seqlen_kv))):
        start, length = small_seq.prefix_key_ranges(descriptor, (batch, seqlen_q), seqlen_kv,
                                                    max_keys)
        expected_start, expected_length = small_seq.key_ranges(tokens, max_keys)
        np.testing.assert_array_equal(np.asarray(length), np.asarray(expected_length))
        has_keys = np.asarray(length) > 0
        np.testing.assert_array_equal(np.asarray(start)[has_keys],
                                      np.asarray(expected_start)[has_keys])
        if descriptor is not None:  # the random lengths reach every kind of query
            kinds = set(np.unique(np.sign(np.asarray(length))))
            assert kinds == ({-1, 0, 1} if seqlen_q > 1 or seqlen_kv > max_keys else {0, 1})


def test_explain_says_why(rng):
    qkv = bshd_inputs(rng, 2, 16, 2, 2, 64, jnp.bfloat16)
    sequence = SequenceDescriptor.from_seqlens(jnp.ones((2,), jnp.int32),
                                               jnp.full((2,), 16, jnp.int32))
    config = small_seq_config()
    assert "not opted in" in explain(qkv, config=config, sequence=sequence).verdicts["small_seq"]
    config.small_seq.enabled = True
    assert explain(qkv, config=config, sequence=sequence).backend == "small_seq"
    thd = small_seq_config(layout="thd_thd_thd", max_kv=32)
    thd.small_seq.enabled = True
    long_kv = bshd_inputs(rng, 2, 40, 2, 2, 64, jnp.bfloat16)
    reason = explain(long_kv, config=thd, sequence=sequence).verdicts["small_seq"]
    assert "max_seqlen_kv" in reason and "16" in reason
    causal = small_seq_config(mask="causal", backend="small_seq")
    with pytest.raises(ValueError, match="small_seq: serves masks"):
        fused_attn(qkv, config=causal)


def test_unsupported_head_dim_is_explained(rng):
    qkv = bshd_inputs(rng, 2, 4, 2, 2, 32, jnp.float32)
    with pytest.raises(ValueError, match=r"head dims must be equal and one of \(64, 128"):
        fused_attn(qkv, config=small_seq_config(mask="no_mask", backend="small_seq"))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("d", small_seq.HEAD_DIMS)
@pytest.mark.parametrize("s_kv", [1, 2, 3, 5, 8, 11, 16])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["one_head_per_kv_head", "grouped"])
def test_gpu_kernels_against_xla(rng, d, dtype, s_kv, h_kv):
    b = 37
    qkv = bshd_inputs(rng, b, s_kv, 4, h_kv, d, dtype)
    kv_len = jnp.asarray(rng.integers(0, s_kv + 1, b), jnp.int32).at[0].set(s_kv)
    sequence = SequenceDescriptor.from_seqlens(jnp.ones((b,), jnp.int32), kv_len)
    poison_like(*qkv)
    check_against_xla(qkv, small_seq_config(max_kv=s_kv), rng, sequence=sequence)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_gpu_thd_dropout_and_guard(rng):
    q = random_array(rng, (2, 4, 4, 128), jnp.bfloat16)
    k, v = (random_array(rng, (2, 24, 2, 128), jnp.bfloat16) for _ in range(2))
    config = small_seq_config(layout="thd_thd_thd", dropout_rate=0.2,
                              sequence={"max_segments_per_seq": 3, "max_seqlen_q": 1,
                                        "max_seqlen_kv": 16})
    poison_like(q, k, v)
    check_against_xla((q, k, v), config, rng, sequence=thd_offsets_descriptor(),
                      dropout_rng=jax.random.key(3), is_training=True)
    qkv, bad_config, bad_sequence = broken_bound_call(rng)
    out = jax.jit(lambda *a: fused_attn(a, config=bad_config, sequence=bad_sequence))(*qkv)
    assert np.all(np.isnan(np.asarray(out[1]))) and np.all(np.isfinite(np.asarray(out[0])))
