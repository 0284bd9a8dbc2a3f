"""The compiled backends under a device mesh: batch and head axes shard without gathering.

Four host (CPU) devices (conftest.py sets --xla_force_host_platform_device_count=4)
form meshes of 2 x 2 and 4 x 1 ("data" x "model"); q, k, v shard their batch over
"data" and their heads over "model". Every check compares the jitted sharded call
with the jitted unsharded one (same backend, fresh random inputs): forward and every
gradient equal, nothing non-finite, the output sharded like q, no all-gather (or
other resharding collective) in the compiled HLO, and the kernel run on local shapes.

flash and small_seq run their host kernels. cuDNN only runs on a GPU; its op glue
(custom_vjp, the shared partitioning and folding with cuDNN's signature: a bias
shared over batch or heads, the softmax sink whose gradient cuDNN sums over the
batch, per-call dropout seed) runs here with a jax.numpy stand-in for its two FFI
calls. tests/test_cudnn.py::test_sharded_matches_unsharded checks the real calls on
a machine with two or more GPUs.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import reference
from conftest import assert_close, make_config, random_array
from fusedattn.ops import AttentionSpec, SequenceDescriptor, fused_attn
from fusedattn.ops.backends import cudnn, flash_ffi, partitioning, small_seq, xla
from fusedattn.ops.backends.cudnn import library as cudnn_library
from fusedattn.ops.backends.base import CanonicalArgs
from fusedattn.ops.sequence import dense_token_info

HOST_MESH = jax.devices()[0].platform == "cpu" and jax.device_count() >= 4


@pytest.fixture(autouse=True)
def _host_mesh(request):
    """Every test but the GPU-marked ones runs on four host devices."""
    if request.node.get_closest_marker("gpu") is None and not HOST_MESH:
        pytest.skip("needs four host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)"
                    " as JAX's default platform")

MESHES = {"2x2": (2, 2), "4x1": (4, 1)}
QKV = P("data", None, "model", None)  # [b, s, h, d]
ROWS = P("data")                       # per-row arrays: descriptors, per-example keys
TOL = 2e-6                             # float32; sums over sharded axes change order only
GATHERS = ("all-gather", "all-to-all", "collective-permute")


def make_mesh(name: str) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:4]).reshape(MESHES[name]), ("data", "model"))


def shard(mesh: Mesh, tree, specs):
    """device_put every leaf of `tree` with the PartitionSpec at the same place in `specs`."""
    return jax.tree.map(
        lambda x, spec: x if x is None else jax.device_put(x, NamedSharding(mesh, spec)),
        tree, specs, is_leaf=lambda x: x is None)


def compiled(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def kernel_shapes(hlo: str, target: str) -> list[str]:
    """The first result shape of every custom call to `target`, e.g. 'f32[2,8,2,16]'."""
    shapes = []
    for line in hlo.splitlines():
        if f'custom_call_target="{target}"' in line:
            shapes.append(re.search(r"=\s*\(?\s*(\w+\[[\d,]*\])", line).group(1))
    return shapes


def check_sharded(fn, args, specs, mesh, out_specs, exact=True):
    """fn jitted on sharded args equals fn jitted on unsharded args; returns the HLO.

    out_specs: the PartitionSpec each output leaf must come back with (None: any).
    exact: no gathering collective in the compiled module.
    """
    expected = jax.jit(fn)(*args)
    sharded = shard(mesh, args, specs)
    got = jax.jit(fn)(*sharded)
    hlo = compiled(fn, *sharded)
    leaves, expected_leaves = jax.tree.leaves(got), jax.tree.leaves(expected)
    assert len(leaves) == len(expected_leaves)
    for i, (a, e, spec) in enumerate(zip(leaves, expected_leaves, jax.tree.leaves(
            out_specs, is_leaf=lambda x: x is None or isinstance(x, P)))):
        assert_close(a, e, TOL, f"output {i}")
        if spec is not None:
            assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), (
                f"output {i}: sharded {a.sharding.spec}, expected {spec}")
    if exact:
        found = [op for op in GATHERS if op in hlo]
        assert not found, f"the compiled module reshards with {found}"
    return hlo


def local(shape, mesh: Mesh, batch_dim=0, head_dim=2) -> tuple[int, ...]:
    shape = list(shape)
    shape[batch_dim] //= mesh.shape["data"]
    shape[head_dim] //= mesh.shape["model"]
    return tuple(shape)


def hlo_shape(dtype: str, shape) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def value_and_grads(attend, argnums):
    """(output, gradients of <output, w>): a random cotangent w reaches every gradient."""
    def run(w, *args):
        out, vjp = jax.vjp(lambda *a: attend(*a), *args)
        grads = vjp(w)
        return out, tuple(grads[i] for i in argnums)
    return run


# --------------------------------------------------------------------------- flash

def flash_inputs(rng, b=4, s=8, h=4, h_kv=2, d=16):
    return (random_array(rng, (b, s, h, d)), random_array(rng, (b, s, h_kv, d)),
            random_array(rng, (b, s, h_kv, d)))


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("h_kv", [4, 2])
@pytest.mark.parametrize("mask,softmax", [("causal", "learnable"), ("no_mask", "off_by_one"),
                                          ("causal_bottom_right", "vanilla")])
def test_flash_forward_and_gradients(rng, mesh_name, h_kv, mask, softmax):
    mesh = make_mesh(mesh_name)
    config = make_config(backend="flash", mask=mask, softmax=softmax)
    q, k, v = flash_inputs(rng, h_kv=h_kv)
    offset = random_array(rng, (q.shape[2],)) if softmax == "learnable" else None
    w = random_array(rng, q.shape)

    def attend(q, k, v, offset):
        return fused_attn((q, k, v), config=config, softmax_offset=offset)

    argnums = (0, 1, 2, 3) if offset is not None else (0, 1, 2)
    run = value_and_grads(attend, argnums)
    offset_spec = P("model") if offset is not None else None
    grads_specs = (QKV, QKV, QKV, P("model"))[:len(argnums)]
    hlo = check_sharded(run, (w, q, k, v, offset), (QKV, QKV, QKV, QKV, offset_spec), mesh,
                        (QKV, grads_specs))
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]
    assert kernel_shapes(hlo, flash_ffi.BWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("given", [False, True])
def test_flash_alibi_shards_batch_and_heads(rng, mesh_name, given):
    """ALiBi slopes are per-head operands [h] (given, or the standard ones computed from the
    global head count): the heads shard with them, and the slopes' gradient comes back
    sharded over "model"."""
    mesh = make_mesh(mesh_name)
    config = make_config(backend="flash", mask="causal", bias="alibi", window_size=(5, 0))
    q, k, v = flash_inputs(rng)
    slopes = random_array(rng, (q.shape[2],)) if given else None
    w = random_array(rng, q.shape)

    def attend(q, k, v, slopes):
        return fused_attn((q, k, v), config=config, bias=slopes)

    argnums = (0, 1, 2, 3) if given else (0, 1, 2)
    run = value_and_grads(attend, argnums)
    grads_specs = (QKV, QKV, QKV, P("model"))[:len(argnums)]
    hlo = check_sharded(run, (w, q, k, v, slopes),
                        (QKV, QKV, QKV, QKV, P("model") if given else None), mesh,
                        (QKV, grads_specs))
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]
    assert kernel_shapes(hlo, flash_ffi.BWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("bias_shape", [(4, 4), (1, 4), (4, 1), (1, 1)])
def test_flash_bias_shards_and_sums_its_gradient(rng, mesh_name, bias_shape):
    """A bias array [b|1, h|1, s, s] shards like q where it has the axis; the gradient of a
    shared one, summed inside the call, is psummed across the shards."""
    mesh = make_mesh(mesh_name)
    config = make_config(backend="flash", mask="causal", bias="pre_scale_bias")
    q, k, v = flash_inputs(rng)
    bias = random_array(rng, bias_shape + (8, 8))
    bias_spec = P("data" if bias_shape[0] > 1 else None, "model" if bias_shape[1] > 1 else None)

    def attend(q, k, v, bias):
        return fused_attn((q, k, v), config=config, bias=bias)

    hlo = check_sharded(value_and_grads(attend, (0, 1, 2, 3)),
                        (random_array(rng, q.shape), q, k, v, bias),
                        (QKV, QKV, QKV, QKV, bias_spec), mesh, (QKV, (QKV, QKV, QKV, bias_spec)))
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]
    assert kernel_shapes(hlo, flash_ffi.BWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]


@pytest.mark.parametrize("form", ["segment_ids", "seqlens_offsets", "seqlens"])
def test_flash_packed_and_padded_rows_shard_with_the_batch(rng, form):
    """Descriptors are per-row operands [b, ...]: they shard along the batch, never gathered."""
    mesh = make_mesh("2x2")
    b, t, h, d = 4, 12, 4, 8
    if form == "seqlens":
        config = make_config(backend="flash", mask="padding_causal")
        lengths = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
        sequence = SequenceDescriptor.from_seqlens(lengths, lengths)
        seq_specs = SequenceDescriptor(q_seqlens=ROWS, kv_seqlens=ROWS)
    elif form == "seqlens_offsets":
        config = make_config(backend="flash", mask="padding_causal", qkv_layout="thd_thd_thd",
                             sequence={"format": form, "max_segments_per_seq": 3})
        lengths = np.asarray([[5, 4, 3], [12, -1, -1], [2, 2, -1], [6, 6, -1]], np.int32)
        offsets = np.full((b, 4), -1, np.int32)
        for row in range(b):
            used = lengths[row][lengths[row] > 0]
            offsets[row, :len(used) + 1] = np.concatenate([[0], np.cumsum(used)])
        sequence = SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths, offsets, offsets)
        seq_specs = SequenceDescriptor(q_seqlens=P("data", None), kv_seqlens=P("data", None),
                                       q_offsets=P("data", None), kv_offsets=P("data", None))
    else:
        config = make_config(backend="flash", mask="padding_causal", qkv_layout="thd_thd_thd",
                             sequence={"format": form, "max_segments_per_seq": 4})
        ids = np.sort(rng.integers(0, 4, (b, t)), axis=1).astype(np.int32)
        sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
        seq_specs = SequenceDescriptor(q_segment_ids=P("data", None),
                                       kv_segment_ids=P("data", None))
    q, k, v = flash_inputs(rng, b=b, s=t, h=h, h_kv=2, d=d)
    w = random_array(rng, q.shape)

    def attend(q, k, v, sequence):
        return fused_attn((q, k, v), config=config, sequence=sequence)

    def run(w, q, k, v, sequence):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, sequence), q, k, v)
        return out, vjp(w)

    hlo = check_sharded(run, (w, q, k, v, sequence), (QKV, QKV, QKV, QKV, seq_specs), mesh,
                        (QKV, (QKV, QKV, QKV)))
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]


def test_flash_sbhd_layout_keeps_its_sharding(rng):
    mesh = make_mesh("2x2")
    config = make_config(backend="flash", mask="causal", qkv_layout="sbhd_sbhd_sbhd")
    q, k, v = (jnp.swapaxes(x, 0, 1) for x in flash_inputs(rng))
    spec = P(None, "data", "model", None)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config)

    hlo = check_sharded(value_and_grads(attend, (0, 1, 2)), (random_array(rng, q.shape), q, k, v),
                        (spec,) * 4, mesh, (spec, (spec,) * 3))
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", (2, 8, 2, 16))]


def test_flash_kv_heads_that_do_not_split_stay_replicated(rng):
    """MQA: one K/V head cannot split over two devices, so the heads replicate (exact)."""
    mesh = make_mesh("2x2")
    config = make_config(backend="flash", mask="causal")
    q, k, v = flash_inputs(rng, h_kv=1)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config)

    kv_spec = P("data", None, None, None)
    hlo = check_sharded(value_and_grads(attend, (0, 1, 2)), (random_array(rng, q.shape), q, k, v),
                        (QKV, QKV, kv_spec, kv_spec), mesh, (None, (None, None, None)),
                        exact=False)
    # the batch still shards; the heads do not
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", (2, 8, 4, 16))]


def test_flash_vmap_under_a_mesh_folds_into_one_sharded_call(rng):
    mesh = make_mesh("2x2")
    config = make_config(backend="flash", mask="causal", softmax="learnable")
    n = 2
    q, k, v = (x.reshape((n, 2) + x.shape[1:]) for x in flash_inputs(rng))
    offset = random_array(rng, (q.shape[3],))
    spec = P("data", None, None, "model", None)

    def attend(q, k, v, offset):
        return fused_attn((q, k, v), config=config, softmax_offset=offset)

    def run(w, q, k, v, offset):
        def loss(q, k, v, offset):
            return jnp.sum(jax.vmap(attend, in_axes=(0, 0, 0, None))(q, k, v, offset) * w)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, offset)

    hlo = check_sharded(run, (random_array(rng, q.shape), q, k, v, offset),
                        (spec, spec, spec, spec, P("model")), mesh,
                        (P(), (spec, spec, spec, P("model"))))
    folded = (n * q.shape[1],) + q.shape[2:]
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", local(folded, mesh))]
    assert kernel_shapes(hlo, flash_ffi.BWD_TARGET) == [hlo_shape("f32", local(folded, mesh))]


# --------------------------------------------------------------------------- dropout

def test_flash_dropout_with_one_key_runs_unsharded(rng):
    """One key: the mask is keyed by global (batch, head) indices, so the call gathers."""
    mesh = make_mesh("2x2")
    config = make_config(backend="flash", mask="causal", dropout_rate=0.3)
    q, k, v = flash_inputs(rng)
    key = jax.random.key(3)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config, dropout_rng=key, is_training=True)

    hlo = check_sharded(value_and_grads(attend, (0, 1, 2)), (random_array(rng, q.shape), q, k, v),
                        (QKV,) * 4, mesh, (QKV, (QKV,) * 3), exact=False)
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", q.shape)]
    assert "all-gather" in hlo


@pytest.mark.parametrize("backend", ["flash", "small_seq"])
def test_dropout_with_per_example_keys_shards_the_batch(rng, backend):
    """vmap over keys (Equinox): each example's seed rows split with the batch: exact."""
    mesh = make_mesh("4x1")
    n = 8
    if backend == "flash":
        config = make_config(backend="flash", mask="causal", dropout_rate=0.3)
        q, k, v = (x[:, None] for x in flash_inputs(rng, b=n))
        target = flash_ffi.FWD_TARGET
    else:
        config = make_config(backend="small_seq", mask="no_mask", dropout_rate=0.3,
                             sequence={"max_seqlen_q": 1, "max_seqlen_kv": 16})
        q, k, v = (random_array(rng, (n, 1, 1, 4, 64)), random_array(rng, (n, 1, 6, 2, 64)),
                   random_array(rng, (n, 1, 6, 2, 64)))
        target = small_seq.FWD_TARGET
    keys = jax.random.key_data(jax.random.split(jax.random.key(5), n))
    spec = P("data", None, None, "model", None)

    def run(w, q, k, v, keys):
        def one(q, k, v, key):
            return fused_attn((q, k, v), config=config, dropout_rng=jax.random.wrap_key_data(key),
                              is_training=True)
        out, vjp = jax.vjp(lambda q, k, v: jax.vmap(one)(q, k, v, keys), q, k, v)
        return out, vjp(w)

    hlo = check_sharded(run, (random_array(rng, q.shape), q, k, v, keys),
                        (spec,) * 4 + (P("data", None),), mesh, (spec, (spec,) * 3))
    assert kernel_shapes(hlo, target) == [hlo_shape("f32", (n // 4,) + q.shape[2:])]


def test_small_seq_dropout_with_one_key_runs_unsharded(rng):
    mesh = make_mesh("2x2")
    config = make_config(backend="small_seq", mask="no_mask", dropout_rate=0.3,
                         sequence={"max_seqlen_q": 1, "max_seqlen_kv": 16})
    q, k, v = (random_array(rng, (4, 1, 4, 64)), random_array(rng, (4, 9, 2, 64)),
               random_array(rng, (4, 9, 2, 64)))

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config, dropout_rng=jax.random.key(1),
                          is_training=True)

    hlo = check_sharded(value_and_grads(attend, (0, 1, 2)), (random_array(rng, q.shape), q, k, v),
                        (QKV,) * 4, mesh, (QKV, (QKV,) * 3), exact=False)
    assert kernel_shapes(hlo, small_seq.FWD_TARGET) == [hlo_shape("f32", q.shape)]


# --------------------------------------------------------------------------- small_seq

@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("h_kv", [4, 2])
def test_small_seq_forward_and_gradients(rng, mesh_name, h_kv):
    mesh = make_mesh(mesh_name)
    b, skv, h, d = 8, 11, 4, 64
    config = make_config(backend="small_seq", mask="padding",
                         sequence={"max_seqlen_q": 1, "max_seqlen_kv": 16})
    q, k, v = (random_array(rng, (b, 1, h, d)), random_array(rng, (b, skv, h_kv, d)),
               random_array(rng, (b, skv, h_kv, d)))
    sequence = SequenceDescriptor.from_seqlens(jnp.ones((b,), jnp.int32),
                                               jnp.asarray(rng.integers(0, skv + 1, b), jnp.int32))

    def run(w, q, k, v, sequence):
        out, vjp = jax.vjp(lambda q, k, v: fused_attn((q, k, v), config=config,
                                                      sequence=sequence), q, k, v)
        return out, vjp(w)

    seq_specs = SequenceDescriptor(q_seqlens=ROWS, kv_seqlens=ROWS)
    hlo = check_sharded(run, (random_array(rng, q.shape), q, k, v, sequence),
                        (QKV,) * 4 + (seq_specs,), mesh, (QKV, (QKV,) * 3))
    assert kernel_shapes(hlo, small_seq.FWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]
    assert kernel_shapes(hlo, small_seq.BWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]


# --------------------------------------------------------------------------- cuDNN's glue

def _fake_attention(static, q, k, v, bias, sink):
    """What cuDNN computes without padding, in jax.numpy: (o, lse [b, h, sq])."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * static.scale
    if static.has_bias:
        s = s + bias
    sq, skv = s.shape[-2:]
    if static.alibi:  # as cuDNN: the slopes of the heads this call sees
        slopes = jnp.stack([jnp.float32(x) for x in xla.alibi_slopes(q.shape[2])])[:, None, None]
        s = s + slopes * (jnp.arange(skv)[None, :] - jnp.arange(sq)[:, None])
    if static.causal:
        s = jnp.where(jnp.arange(skv)[None, :] <= jnp.arange(sq)[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    if static.has_sink:
        lse = jnp.logaddexp(lse, sink[None, :, None])
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v), lse


TRACED: list[tuple[int, ...]] = []  # q shapes the stand-ins were traced with (global and shards)
BACKWARD_BIAS: list[tuple[int, ...]] = []  # bias shapes the backward stand-in was traced with
FORWARD_TRAINING: list[bool] = []  # the training flags the forward stand-in was traced with


def _fake_forward(static, q, k, v, bias, slots, rng, sink, training=True):
    """cuDNN's forward FFI call (o, stats [b, h, sq, 1]) for calls without segments; (o,)
    without stats (training=False, the call nobody differentiates)."""
    TRACED.append(q.shape)
    FORWARD_TRAINING.append(training)
    o, lse = _fake_attention(static, q, k, v, bias, sink)
    return (o.astype(q.dtype), lse[..., None]) if training else (o.astype(q.dtype),)


def _fake_backward(static, q, k, v, bias, slots, rng, sink, o, stats, do):
    """cuDNN's backward: dq, dk, dv, dbias (summed over bias's broadcast dims), dsink (over b)."""
    TRACED.append(q.shape)
    BACKWARD_BIAS.append(bias.shape)
    out, vjp = jax.vjp(lambda *a: _fake_attention(static, *a)[0], q, k, v, bias, sink)
    return vjp(do.astype(out.dtype))  # bfloat16 inputs compute in float32 here


@pytest.fixture
def fake_cudnn(monkeypatch):
    """cudnn's op with jax.numpy in place of its FFI calls; yields a call(static, ...)."""
    monkeypatch.setattr(cudnn.ffi_calls, "_forward_ffi", _fake_forward)
    monkeypatch.setattr(cudnn.ffi_calls, "_backward_ffi", _fake_backward)
    cudnn.ffi_calls._folding_op.cache_clear()
    TRACED.clear()
    BACKWARD_BIAS.clear()
    FORWARD_TRAINING.clear()
    yield cudnn.vjp._cudnn
    cudnn.ffi_calls._folding_op.cache_clear()


def cudnn_static(dropout=False, has_bias=True, causal=True, s=8, d=16):
    config = make_config(mask="causal" if causal else "no_mask", softmax="learnable",
                         bias="post_scale_bias" if has_bias else "no_bias",
                         dropout_rate=0.2 if dropout else 0.0)
    spec = AttentionSpec.from_config(config)
    return cudnn.graph_key._static(spec, 1 / math.sqrt(d), dropout, has_bias, s, s)


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("bias_shape", [(4, 4), (1, 4), (4, 1), (1, 1)])
def test_cudnn_glue_shards_and_sums_its_reductions(rng, fake_cudnn, mesh_name, bias_shape):
    """dsink and the dbias of a shared bias are summed inside the call: psummed across shards."""
    mesh = make_mesh(mesh_name)
    static = cudnn_static()
    q, k, v = flash_inputs(rng, h_kv=2)
    bias = random_array(rng, bias_shape + (8, 8))
    sink = random_array(rng, (4,))
    rng_words = jnp.zeros((4,), jnp.uint32)

    def attend(q, k, v, bias, sink):
        return fake_cudnn(static, q, k, v, bias, rng_words, sink, None)

    bias_spec = P("data" if bias_shape[0] > 1 else None, "model" if bias_shape[1] > 1 else None)
    run = value_and_grads(attend, (0, 1, 2, 3, 4))
    hlo = check_sharded(run, (random_array(rng, q.shape), q, k, v, bias, sink),
                        (QKV, QKV, QKV, QKV, bias_spec, P("model")), mesh,
                        (QKV, (QKV, QKV, QKV, bias_spec, P("model"))))
    assert local(q.shape, mesh) in TRACED  # the stand-in ran on a shard
    if mesh.shape["data"] > 1:
        assert "all-reduce" in hlo  # dsink, and dbias when shared over the batch


def test_cudnn_glue_dropout_runs_unsharded(rng, fake_cudnn):
    """cuDNN's generator numbers the elements of the whole call: no sharding under dropout."""
    mesh = make_mesh("2x2")
    static = cudnn_static(dropout=True, has_bias=False)
    q, k, v = flash_inputs(rng)

    def attend(q, k, v):
        return fake_cudnn(static, q, k, v, jnp.zeros((1, 1, 1, 1)), jnp.ones((4,), jnp.uint32),
                          jnp.zeros((4,)), None)

    check_sharded(value_and_grads(attend, (0, 1, 2)), (random_array(rng, q.shape), q, k, v),
                  (QKV,) * 4, mesh, (QKV, (QKV,) * 3), exact=False)
    assert set(TRACED) == {q.shape}  # never on a shard


def test_cudnn_glue_alibi_shards_the_batch_not_the_heads(rng, fake_cudnn):
    """cuDNN derives ALiBi's slopes from the call's head count: the heads stay whole."""
    mesh = make_mesh("2x2")
    static = cudnn_static(has_bias=False)._replace(alibi=True)
    q, k, v = flash_inputs(rng)

    def attend(q, k, v):
        return fake_cudnn(static, q, k, v, jnp.zeros((1, 1, 1, 1)), jnp.zeros((4,), jnp.uint32),
                          jnp.zeros((4,)), None)

    check_sharded(value_and_grads(attend, (0, 1, 2)), (random_array(rng, q.shape), q, k, v),
                  (QKV,) * 4, mesh, (None, (None,) * 3), exact=False)
    assert (q.shape[0] // mesh.shape["data"],) + q.shape[1:] in TRACED  # the batch split
    assert {shape[2] for shape in TRACED} == {q.shape[2]}  # the heads never


@pytest.mark.parametrize("mesh_name", MESHES)
def test_cudnn_glue_inference_forward_shards_and_folds(rng, fake_cudnn, mesh_name):
    """A call nobody differentiates runs the forward without stats (training=False: the
    placeholder stats result never reaches the partitioning): it shards like the training
    forward without gathering, a vmap folds it into one call equal to a loop, and its
    output equals the differentiated call's, whose forward keeps training=True."""
    mesh = make_mesh(mesh_name)
    static = cudnn_static()
    q, k, v = flash_inputs(rng)
    bias, sink = random_array(rng, (1, 4, 8, 8)), random_array(rng, (4,))
    rng_words = jnp.zeros((4,), jnp.uint32)

    def attend(q, k, v):
        return fake_cudnn(static, q, k, v, bias, rng_words, sink, None)

    hlo = check_sharded(attend, (q, k, v), (QKV,) * 3, mesh, QKV)
    assert "all-reduce" not in hlo  # nothing summed: no stats, no gradients
    assert local(q.shape, mesh) in TRACED and set(FORWARD_TRAINING) == {False}
    FORWARD_TRAINING.clear()
    out, _ = jax.jit(value_and_grads(attend, (0,)))(random_array(rng, q.shape), q, k, v)
    assert set(FORWARD_TRAINING) == {True}
    assert_close(out, jax.jit(attend)(q, k, v), TOL, "differentiated output")
    n = 2
    batched = tuple(x.reshape((n, -1) + x.shape[1:]) for x in (q, k, v))
    assert loops_and_kernel_calls(jax.vmap(attend), *batched) == (False, 1)
    got = jax.jit(jax.vmap(attend))(*batched)
    for i in range(n):
        assert_close(got[i], jax.jit(attend)(*(x[i] for x in batched)), TOL, f"example {i}")


def loops_and_kernel_calls(fn, *args) -> tuple[bool, int]:
    """Whether fn's jaxpr loops, and how many kernel calls it writes out."""
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    return "while" in jaxpr or "scan" in jaxpr, jaxpr.count("custom_partitioning[")


@pytest.mark.parametrize("bias_axis,sink_axis", [(None, None), (0, None), (None, 0)])
def test_cudnn_glue_vmap_folds_and_maps_per_call_operands(rng, fake_cudnn, bias_axis, sink_axis):
    """Folded into one call, with a shared bias (broadcast over the rows in the backward
    call, so its gradient comes per example) or a per-example one broadcast over the
    rows; one call per example when the sink is mapped (cuDNN takes one offset row per
    call). Every case equals a loop."""
    static = cudnn_static()
    n = 3
    q, k, v = (x.reshape((n, 2) + x.shape[1:]) for x in flash_inputs(rng, b=2 * n))
    bias = random_array(rng, (n, 1, 4, 8, 8))  # one bias row shared by an example's 2 rows
    sink = random_array(rng, (n, 4))
    bias, sink = (x if axis == 0 else x[0] for x, axis in ((bias, bias_axis), (sink, sink_axis)))
    rng_words = jnp.zeros((4,), jnp.uint32)

    def loss(q, k, v, bias, sink):
        return jnp.sum(fake_cudnn(static, q, k, v, bias, rng_words, sink, None) ** 2)

    axes = (0, 0, 0, bias_axis, sink_axis)
    total = jax.grad(lambda *a: jnp.sum(jax.vmap(loss, in_axes=axes)(*a)), argnums=(0, 1, 2, 3, 4))
    looped, calls = loops_and_kernel_calls(total, q, k, v, bias, sink)
    assert looped == (sink_axis == 0)
    if not looped:
        assert calls == 2  # one forward, one backward call
    got = jax.jit(total)(q, k, v, bias, sink)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    parts = [grad(*(x[i] if axis == 0 else x for x, axis in zip((q, k, v, bias, sink), axes)))
             for i in range(n)]
    for j, name in enumerate(["dq", "dk", "dv", "dbias", "dsink"]):
        per_example = np.stack([p[j] for p in parts])
        expected = per_example if axes[j] == 0 else per_example.sum(0)
        assert_close(got[j], expected, TOL, name)


def shared_operands_case(rng, attend, n):
    """((q, k, v) of n examples of 2 rows, bias [1, 4, 8, 8], sink [4]), and one example's
    loss through `attend` (the cuDNN glue), the bias and sink shared by every example."""
    static = cudnn_static()
    q, k, v = (x.reshape((n, 2) + x.shape[1:]) for x in flash_inputs(rng, b=2 * n))
    bias, sink = random_array(rng, (1, 4, 8, 8)), random_array(rng, (4,))
    rng_words = jnp.zeros((4,), jnp.uint32)

    def loss(q, k, v, bias, sink):
        return jnp.sum(attend(static, q, k, v, bias, rng_words, sink, None) ** 2)

    return (q, k, v, bias, sink), loss


@pytest.mark.parametrize("differentiated", ["bias_and_sink", "sink"])
def test_cudnn_glue_per_example_gradients_of_shared_operands(rng, fake_cudnn, differentiated):
    """jax.vmap(jax.grad(f)) with an unmapped softmax offset and a bias shared by the batch:
    each example gets its own dsink (from the statistics, beside the folded call) and
    dbias (the bias broadcast over the folded rows in the backward call, summed per
    example). One call each way, no loop; a bias not differentiated stays shared."""
    n = 3
    (q, k, v, bias, sink), loss = shared_operands_case(rng, fake_cudnn, n)
    names = ("dbias", "dsink") if differentiated == "bias_and_sink" else ("dsink",)
    grad = jax.grad(loss, argnums=(3, 4) if differentiated == "bias_and_sink" else (4,))
    per_example = jax.vmap(grad, in_axes=(0, 0, 0, None, None))
    assert loops_and_kernel_calls(per_example, q, k, v, bias, sink) == (False, 2)
    folded_bias = (2 * n,) + bias.shape[1:] if differentiated == "bias_and_sink" else bias.shape
    assert set(BACKWARD_BIAS) == {bias.shape, folded_bias}  # with one example's (result shapes)
    got = jax.jit(per_example)(q, k, v, bias, sink)
    for i in range(n):
        for name, a, e in zip(names, got, grad(q[i], k[i], v[i], bias, sink)):
            assert_close(a[i], e, TOL, f"{name}[{i}]")


def test_cudnn_glue_per_example_gradients_under_a_mesh(rng, fake_cudnn):
    """The per-example dsink and dbias shard with the folded batch: same numbers, no gathering."""
    mesh = make_mesh("2x2")
    args, loss = shared_operands_case(rng, fake_cudnn, 2)
    per_example = jax.vmap(jax.grad(loss, argnums=(3, 4)), in_axes=(0, 0, 0, None, None))
    spec = P("data", None, None, "model", None)
    check_sharded(per_example, args,
                  (spec, spec, spec, P(None, "model"), P("model")), mesh,
                  (P("data", None, "model"), P("data", "model")))


@pytest.mark.parametrize("shardy", [True, False])
def test_cudnn_unread_operands_shard_and_fold(rng, fake_cudnn, monkeypatch, shardy):
    """Through CudnnBackend.attention without bias, dropout or softmax offset: the operands
    the FFI calls do not read (numpy scalars, see cudnn.ffi_calls._UNREAD_INT32, and the
    [1, 1, 1, 1] bias) pass the mesh under both partitioners without gathering, and a vmap
    folds into one call each way that equals a loop."""
    from jax._src import config as jax_config

    monkeypatch.setattr(cudnn_library, "available", lambda: None)
    spec = AttentionSpec.from_config(make_config(mask="causal"))
    q, k, v = (x.astype(jnp.bfloat16) for x in flash_inputs(rng))

    def attend(q, k, v):
        return cudnn.BACKEND.attention(spec, CanonicalArgs(q=q, k=k, v=v, tokens=None), 0.25)

    mesh = make_mesh("2x2")
    with jax_config.use_shardy_partitioner(shardy):
        check_sharded(value_and_grads(attend, (0, 1, 2)),
                      (random_array(rng, q.shape).astype(jnp.bfloat16), q, k, v), (QKV,) * 4,
                      mesh, (QKV, (QKV,) * 3))
    assert local(q.shape, mesh) in TRACED  # the stand-in ran on a shard
    n = 2
    batched = tuple(x.reshape((n, -1) + x.shape[1:]) for x in (q, k, v))

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))
    assert loops_and_kernel_calls(grads, *batched) == (False, 2)
    got = jax.jit(grads)(*batched)
    one = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for i in range(n):
        for name, a, e in zip(("dq", "dk", "dv"), got, one(*(x[i] for x in batched))):
            assert_close(a[i], e, TOL, f"{name}[{i}]")


@pytest.mark.parametrize("case", ["dense", "seqlens", "packed"])
def test_cudnn_sink_gradient_rows_match_the_xla_backend(rng, case):
    """dsink from cuDNN's statistics: with lse the natural-log log-sum-exp of a row's scaled
    scores and the sink, laid out per segment slot as cuDNN stores it (NaN where cuDNN
    leaves it unset), -sum_q exp(sink - lse_q) * rowsum(dO * O)_q per row equals the
    XLA backend's gradient of that row alone, and their sum the float64 reference's."""
    b, s, h, d = 4, 12, 4, 8
    if case == "dense":
        config = make_config(backend="xla", mask="causal", softmax="learnable")
        sequence = None
    elif case == "seqlens":
        config = make_config(backend="xla", mask="padding_causal", softmax="learnable",
                             sequence={"format": "seqlens"})
        sequence = SequenceDescriptor.from_seqlens(np.asarray([12, 5, 0, 9], np.int32),
                                                   np.asarray([12, 7, 3, 9], np.int32))
    else:
        config = make_config(backend="xla", mask="padding_causal", softmax="learnable",
                             qkv_layout="thd_thd_thd", sequence={
                                 "format": "segment_ids", "max_segments_per_seq": 3,
                                 "max_seqlen_q": 8, "max_seqlen_kv": 8})
        ids = np.asarray([[1] * 5 + [2] * 4 + [3] * 3, [1] * 8 + [0] * 4,
                          [0] * 2 + [4] * 6 + [0] * 4, [2] * 6 + [1] * 6], np.int32)
        sequence = SequenceDescriptor.from_segment_ids_and_pos(ids, ids)
    q, k, v = (random_array(rng, (b, s, h, d)) for _ in range(3))
    offset, do = random_array(rng, (h,)), random_array(rng, (b, s, h, d))

    def offset_gradient(q, k, v, offset, sequence, do):
        out, vjp = jax.vjp(lambda offset: fused_attn(
            (q, k, v), config=config, softmax_offset=offset, sequence=sequence), offset)
        return out, vjp(do)[0]

    def row(x, r):
        return x if x is None else jax.tree.map(lambda a: a[r:r + 1], x)

    o, _ = offset_gradient(q, k, v, offset, sequence, do)
    expected = np.stack([offset_gradient(*(row(x, r) for x in (q, k, v)), offset,
                                         row(sequence, r), row(do, r))[1] for r in range(b)])

    spec = AttentionSpec.from_config(config)
    static = cudnn.graph_key._static(spec, 1 / math.sqrt(d), False, False, s, s)
    tokens = reference.describe_tokens(sequence, b, s, s, use_sequence=sequence is not None,
                                       bottom_right=False)
    visible = reference.visible_keys(tokens, causal=True, window=(-1, -1))[:, None]
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    scores = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(d)
    lse = np.log(np.sum(np.where(visible, np.exp(scores), 0.0), axis=-1)
                 + np.exp(np.asarray(offset, np.float64))[:, None])  # [b, h, sq]
    if static.segments:
        args = CanonicalArgs(q=q, k=k, v=v, tokens=sequence.token_info(spec, s, s),
                             sequence=sequence)
        slots = np.asarray(cudnn.segments._segments(static, args).slots)
        slots_per_row, positions = static.batch_per_row, static.max_seqlen_q or s
        stats = np.full((b, slots_per_row, h, positions), np.nan)
        for r, j in np.ndindex(b, slots_per_row):
            start, length = slots[r, 0, j], slots[r, 1, j]
            stats[r, j, :, :length] = lse[r, :, start:start + length]
        stats = stats.reshape(b * slots_per_row, h, positions, 1)
    else:
        slots, stats = np.zeros((b, 4, 1), np.int32), lse[..., None]
    got = cudnn.ffi_calls._sink_gradient_rows(static, offset, jnp.asarray(slots), o,
                                              jnp.asarray(stats, jnp.float32), do)
    assert_close(got, expected, 1e-5, "dsink per row")
    ref = reference.reference_attention((q, k, v), config, softmax_offset=offset,
                                        sequence=sequence, dout=do)
    assert_close(np.sum(np.asarray(got, np.float64), axis=0), ref.grads["softmax_offset"], 1e-5,
                 "dsink")


# --------------------------------------------------------------------------- the mechanism

def test_gspmd_partitioner_shards_too(rng):
    """With Shardy off, the GSPMD callbacks (infer_sharding_from_operands) give the same."""
    from jax._src import config as jax_config

    mesh = make_mesh("2x2")
    config = make_config(backend="flash", mask="causal")
    q, k, v = flash_inputs(rng)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config)

    with jax_config.use_shardy_partitioner(False):
        hlo = check_sharded(value_and_grads(attend, (0, 1, 2)),
                            (random_array(rng, q.shape), q, k, v), (QKV,) * 4, mesh,
                            (QKV, (QKV,) * 3))
    assert kernel_shapes(hlo, flash_ffi.FWD_TARGET) == [hlo_shape("f32", local(q.shape, mesh))]


def test_shardings_without_a_mesh_replicate(rng):
    """Inputs sharded by a bare HLO sharding (no mesh to name axes by): gathered, exact."""
    from jax._src.sharding_impls import GSPMDSharding

    mesh = make_mesh("2x2")
    config = make_config(backend="flash", mask="causal")
    q, k, v = flash_inputs(rng)
    hlo_sharding = GSPMDSharding(tuple(mesh.devices.flat),
                                 NamedSharding(mesh, QKV)._to_xla_hlo_sharding(4))
    attend = jax.jit(lambda q, k, v: fused_attn((q, k, v), config=config))
    got = attend(*(jax.device_put(x, hlo_sharding) for x in (q, k, v)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(attend(q, k, v)))


def test_signature_is_checked():
    with pytest.raises(ValueError, match="unknown roles"):
        partitioning.Signature(("b.h.", "bx"), ("b.h.",))
    with pytest.raises(ValueError, match="operand 0 must be q"):
        partitioning.Signature(("b...",), ("b.h.",))
    with pytest.raises(ValueError, match="batch sum"):
        partitioning.Signature(("b.h.", "h"), ("b.h.", "h"))
    with pytest.raises(ValueError, match="dropout_rows"):
        partitioning.Signature(("b.h.", "."), ("b.h.",), dropout_rows=1)
    with pytest.raises(ValueError, match="unread names results"):
        partitioning.Signature(("b.h.",), ("b.h.",), unread=frozenset({1}))
    with pytest.raises(ValueError, match="batch sums need batch_sum_rows"):
        partitioning.op(lambda q: q, partitioning.Signature(("b.h.",), ("h",),
                                                            batch_sums=frozenset({0})))


# --------------------------------------------------------------------------- cuDNN on GPUs

@pytest.mark.gpu
@pytest.mark.parametrize("split", ["batch", "heads"])
@pytest.mark.parametrize("case", ["bias_and_sink", "packed", "dropout"])
def test_cudnn_sharded_over_gpus_matches_unsharded(rng, split, case):
    """The real cuDNN calls over 2 (or 4) GPUs, batch or heads split: psummed dsink and
    shared-bias dbias, ragged offsets computed per shard, and dropout left unsharded."""
    gpus = jax.devices()
    if len(gpus) < 2:
        pytest.skip("needs two or more GPUs")
    n = 4 if len(gpus) >= 4 else 2
    mesh = Mesh(np.asarray(gpus[:n]).reshape((n, 1) if split == "batch" else (1, n)),
                ("data", "model"))
    b, s, h, h_kv, d = 4, 128, 8, 4, 64
    dtype = jnp.bfloat16
    q, k, v = (random_array(rng, (b, s, heads, d), dtype) for heads in (h, h_kv, h_kv))
    offset = random_array(rng, (h,))
    kwargs, extra, extra_specs = {}, (), ()
    if case == "bias_and_sink":
        config = make_config(backend="cudnn", mask="causal", softmax="learnable",
                             bias="post_scale_bias")
        extra, extra_specs = (random_array(rng, (1, h, s, s), dtype),), (P(None, "model"),)
    elif case == "packed":
        # vanilla softmax: cuDNN < 9.26 has no ragged backward with a sink token
        config = make_config(backend="cudnn", mask="padding_causal", qkv_layout="thd_thd_thd",
                             sequence={"format": "seqlens_offsets", "max_segments_per_seq": 3})
        offset = None
        lengths = np.asarray([[60, 40, 28], [128, -1, -1], [10, 20, -1], [64, 64, -1]], np.int32)
        offsets = np.full((b, 4), -1, np.int32)
        for row in range(b):
            used = lengths[row][lengths[row] > 0]
            offsets[row, :len(used) + 1] = np.concatenate([[0], np.cumsum(used)])
        kwargs["sequence"] = SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths,
                                                                         offsets, offsets)
    else:
        config = make_config(backend="cudnn", mask="causal", softmax="learnable",
                             dropout_rate=0.2)
        kwargs.update(dropout_rng=jax.random.key(2), is_training=True)

    def attend(q, k, v, offset, *bias):
        return fused_attn((q, k, v), config=config, softmax_offset=offset,
                          bias=bias[0] if bias else None, **kwargs)

    argnums = tuple(range(3 + (offset is not None) + len(extra)))
    run = value_and_grads(attend, argnums)
    args = (random_array(rng, q.shape, dtype), q, k, v, offset) + extra
    specs = (QKV,) * 4 + (P("model") if offset is not None else None,) + extra_specs
    expected = jax.jit(run)(*args)
    sharded = shard(mesh, args, specs)
    got = jax.jit(run)(*sharded)
    for i, (a, e) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(expected))):
        assert_close(a, e, 0.02, f"output {i}")
    hlo = compiled(run, *sharded)
    assert ("all-gather" in hlo) == (case == "dropout")
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, QKV), 4)


# --------------------------------------------------------------------------- jax.shard_map

SHARD_MAP_CONFIGS = {
    "xla": dict(backend="xla", mask="causal", softmax="learnable"),
    "flash": dict(backend="flash", mask="causal", softmax="learnable"),
    "small_seq": dict(backend="small_seq", mask="no_mask",
                      sequence={"max_seqlen_q": 1, "max_seqlen_kv": 16}),
    "auto": dict(mask="causal"),  # the default config: flash on the CPU
}


def check_grad_in_shard_map(mesh, attend, args, in_specs, tol=TOL):
    """jax.grad of sum(attend(*args[:-1]) * args[-1]) w.r.t. every float arg but the last,
    taken inside jax.shard_map over `in_specs`, equals the gradient of the unsharded call.

    Inputs replicated over a mesh axis get the sum of every device's gradient, as JAX
    gives for a replicated input; so their gradient equals the unsharded one too.
    """
    argnums = tuple(range(len(args) - 1))
    grad = jax.grad(lambda *a: jnp.sum(attend(*a[:-1]).astype(jnp.float32) * a[-1]),
                    argnums=argnums)
    expected = jax.jit(grad)(*args)
    sharded = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=in_specs,
                                    out_specs=in_specs[:-1]))(*shard(mesh, args, in_specs))
    for i, (got, want) in enumerate(zip(sharded, expected)):
        assert_close(got, want, tol, f"d arg {i}")


@pytest.mark.parametrize("kv", ["sharded", "replicated"])
@pytest.mark.parametrize("backend", SHARD_MAP_CONFIGS)
def test_grad_inside_shard_map(rng, backend, kv):
    """Each device differentiates its own batch and head shard; k/v either sharded like q or
    replicated over the head devices (one k/v head: MQA)."""
    mesh = make_mesh("2x2")
    config = make_config(**SHARD_MAP_CONFIGS[backend])
    learnable = config.softmax == "learnable"
    sq, h_kv = (1 if backend == "small_seq" else 8), (4 if kv == "sharded" else 1)
    q = random_array(rng, (4, sq, 4, 64))
    k, v = (random_array(rng, (4, 8, h_kv, 64)) for _ in range(2))
    kv_spec = QKV if kv == "sharded" else P("data")
    args, specs = [q, k, v], [QKV, kv_spec, kv_spec]
    if learnable:
        args.append(random_array(rng, (4,)))
        specs.append(P("model"))

    def attend(q, k, v, offset=None):
        return fused_attn((q, k, v), config=config, softmax_offset=offset)

    check_grad_in_shard_map(mesh, attend, (*args, random_array(rng, q.shape)),
                            (*specs, QKV))


def _typed_like_an_ffi_call(fake):
    """The stand-in computing on its operands' local values with results that, as an FFI
    call's, carry no shard_map varying axes (no implicit sums over devices inside)."""
    def strip(x):
        return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def call(static, *operands, **kwargs):
        operands = tuple(strip(x) if hasattr(x, "shape") else x for x in operands)
        return tuple(strip(x) for x in fake(static, *operands, **kwargs))
    return call


def test_cudnn_glue_grad_inside_shard_map(rng, fake_cudnn, monkeypatch):
    """cuDNN's custom_vjp and partitioning glue (with jax.numpy for its FFI calls) under
    jax.grad inside jax.shard_map: bias and sink gradients too, k/v replicated over heads."""
    monkeypatch.setattr(cudnn_library, "available", lambda: None)
    monkeypatch.setattr(cudnn.ffi_calls, "_forward_ffi", _typed_like_an_ffi_call(_fake_forward))
    monkeypatch.setattr(cudnn.ffi_calls, "_backward_ffi", _typed_like_an_ffi_call(_fake_backward))
    cudnn.ffi_calls._folding_op.cache_clear()
    mesh = make_mesh("2x2")
    spec = AttentionSpec.from_config(make_config(backend="cudnn", mask="causal",
                                                 softmax="learnable", bias="post_scale_bias"))
    q = random_array(rng, (4, 8, 4, 16), jnp.bfloat16)
    k, v = (random_array(rng, (4, 8, 1, 16), jnp.bfloat16) for _ in range(2))
    bias = random_array(rng, (1, 4, 8, 8))
    sink = random_array(rng, (4,))

    def attend(q, k, v, bias, sink):
        tokens = dense_token_info(spec, q.shape[0], q.shape[1], k.shape[1])
        args = CanonicalArgs(q=q, k=k, v=v, tokens=tokens, bias=bias, softmax_offset=sink)
        return cudnn.BACKEND.attention(spec, args, 0.25)

    check_grad_in_shard_map(mesh, attend, (q, k, v, bias, sink, random_array(rng, q.shape)),
                            (QKV, P("data"), P("data"), P(None, "model"), P("model"), QKV),
                            tol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["sharded", "replicated"])
def test_cudnn_grad_inside_shard_map_on_gpus(rng, kv):
    """The real cuDNN calls under jax.grad inside jax.shard_map over every GPU; one GPU
    makes a mesh of one, where JAX checks the varying-axes types all the same."""
    n = len(jax.devices())
    shape = (1, n) if 4 % n == 0 else (n, 1)
    mesh = Mesh(np.asarray(jax.devices()).reshape(shape), ("data", "model"))
    config = make_config(backend="cudnn", mask="causal", softmax="learnable")
    q = random_array(rng, (8, 128, 4, 64), jnp.bfloat16)
    h_kv = 4 if kv == "sharded" else 1
    k, v = (random_array(rng, (8, 128, h_kv, 64), jnp.bfloat16) for _ in range(2))
    kv_spec = QKV if kv == "sharded" else P("data")

    def attend(q, k, v, offset):
        return fused_attn((q, k, v), config=config, softmax_offset=offset)

    check_grad_in_shard_map(mesh, attend, (q, k, v, random_array(rng, (4,)),
                                           random_array(rng, q.shape)),
                            (QKV, kv_spec, kv_spec, P("model"), QKV), tol=0.04)
