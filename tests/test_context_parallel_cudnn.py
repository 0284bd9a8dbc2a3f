"""cudnn per block under context parallelism (fusedattn/ops/backends/cudnn/lse.py, and the
chunk-pair kinds of fusedattn/ops/context_parallel/blocks.py).

cuDNN reads no token positions, so each (query chunk, key chunk) pair is called with a
mask of its own: "no_mask" where wholly visible, top-left "causal" on the diagonal, or
not at all. On the CPU (four host devices; eight in a subprocess) a stand-in kernel
serves exactly such calls, over the block's own positions 0, 1, ... (it never reads the
pair's global tokens), with xla's entry points doing the arithmetic; installed as the
"cudnn" kernel (cudnn's GPU check waived), fused_attn runs the path of a cudnn call,
and every result must equal the unsharded xla call's. Also on the CPU: verdict's reasons,
and the real entry points lowered for CUDA (cuDNN faked). GPU-marked tests run cuDNN per
block over every GPU of the machine against the unsharded xla call.
"""

from __future__ import annotations

import contextlib
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import test_context_parallel as cp
from conftest import (assert_close, fake_cudnn_for_cuda_lowering, make_config, random_array,
                      tolerance)
from fusedattn.ops import AttentionSpec, context_parallel, explain, fused_attn
from fusedattn.ops.backends import cudnn, xla
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.context_parallel import blocks, plan
from fusedattn.ops.context_parallel.forward import _merge
from fusedattn.ops.enums import MaskType
from fusedattn.ops.sequence import dense_token_info


@pytest.fixture(autouse=True)
def _host_mesh(request):
    """Every test but the GPU-marked ones runs on four host devices."""
    if request.node.get_closest_marker("gpu") is None and not cp.HOST_MESH:
        pytest.skip("needs four host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)"
                    " as JAX's default platform")


# The masks cudnn serves per block, GQA (4 query heads, 2 K/V heads) unless a case says.
CASES = {
    "causal": dict(mask="causal"),
    "no_mask": dict(mask="no_mask"),
    "no_mask_mha": dict(mask="no_mask", h_kv=4),
    "no_mask_cross": dict(mask="no_mask", sq=16, skv=32),
    "bottom_right_square": dict(mask="causal_bottom_right"),
    "causal_learnable": dict(mask="causal", softmax="learnable"),
    "no_mask_off_by_one": dict(mask="no_mask", softmax="off_by_one", h_kv=1),
}
ALL_STRATEGIES = cp.STRATEGIES + cp.OTHER_STRATEGIES


class ChunkPairKernel:
    """A block kernel that, like cuDNN, reads no token positions: it serves spec.mask
    "no_mask" or top-left "causal" over the block's own positions 0, 1, ... (args.tokens
    replaced), through xla's entry points; refuses anything else. `calls`: (mask, sq, skv)
    of every traced call."""

    def __init__(self):
        self.calls = []

    def _local(self, spec: AttentionSpec, args: CanonicalArgs) -> CanonicalArgs:
        assert spec.mask in (MaskType.NO_MASK, MaskType.CAUSAL), spec.mask
        assert not spec.uses_segments and tuple(spec.window_size) == (-1, -1)
        b, sq = args.q.shape[:2]
        self.calls.append((str(spec.mask), sq, args.k.shape[1]))
        return args._replace(tokens=dense_token_info(spec, b, sq, args.k.shape[1]), bias=None)

    def attention_with_lse(self, spec, args, scale):
        o, lse = xla.attention_with_lse(spec, self._local(spec, args), scale)
        return o.astype(args.q.dtype), lse

    def attention_backward_from_lse(self, spec, args, scale, out, lse, d_out):
        dq, dk, dv, _ = xla.attention_backward_from_lse(spec, self._local(spec, args), scale,
                                                        None, out, lse, d_out)
        return dq, dk, dv, None


@contextlib.contextmanager
def chunk_pair_kernel_as_cudnn():
    """ChunkPairKernel installed as the cudnn block kernel, cudnn's own checks (a CUDA GPU)
    waived; JAX's caches cleared after, so no trace of it outlives it."""
    kernel = ChunkPairKernel()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(plan._KERNELS, "cudnn", kernel)
        patch.setattr(cudnn.BACKEND, "supports", lambda spec, shapes, platform: None)
        try:
            yield kernel
        finally:
            jax.clear_caches()


def check_case(rng, case: dict, strategy: str, load_balance: bool, mesh, tol=cp.TOL):
    """The stand-in as cudnn per block, sharded, against the unsharded xla call."""
    overrides, inputs = cp.build(rng, "cudnn", case)
    with chunk_pair_kernel_as_cudnn() as kernel:
        cp.check_matches_unsharded(overrides, inputs, strategy, load_balance, mesh, tol=tol,
                                   reference="xla")
    assert kernel.calls, "the stand-in kernel was never called"
    return kernel


# --------------------------------------------------------------------------- CPU: pairs

@pytest.mark.parametrize("strategy,load_balance", cp.STRATEGIES)
@pytest.mark.parametrize("case", CASES)
def test_chunk_pairs_match_unsharded_xla(rng, case, strategy, load_balance):
    check_case(rng, CASES[case], strategy, load_balance, cp.make_mesh())


@pytest.mark.parametrize("strategy,load_balance", cp.OTHER_STRATEGIES)
@pytest.mark.parametrize("case", ["causal", "no_mask"])
def test_other_strategy_combinations(rng, case, strategy, load_balance):
    check_case(rng, CASES[case], strategy, load_balance, cp.make_mesh())


@pytest.mark.parametrize("load_balance", [True, False])
def test_pairs_called_with_their_masks(rng, load_balance):
    """Causal: chunk-sized calls (a device's two chunks separately under load balancing),
    "no_mask" off the diagonal and "causal" on it. no_mask: every pair is wholly visible,
    so a device's whole shard goes against a whole block in one "no_mask" call."""
    chunk = 32 // (8 if load_balance else 4)
    kernel = check_case(rng, CASES["causal"], "ring", load_balance, cp.make_mesh())
    assert set(kernel.calls) == {("no_mask", chunk, chunk), ("causal", chunk, chunk)}
    kernel = check_case(rng, CASES["no_mask"], "ring", load_balance, cp.make_mesh())
    assert set(kernel.calls) == {("no_mask", 8, 8)}


def test_wrong_pair_kinds_are_caught(rng, monkeypatch):
    """The comparison sees the pairs' kinds: with every pair called wholly visible (the
    causal future included), the causal result is wrong."""
    monkeypatch.setattr(blocks, "_pair_kind", lambda *args: jnp.int32(blocks.FULL))
    with pytest.raises(AssertionError, match=r"(loss|output): "):
        check_case(rng, CASES["causal"], "ring", True, cp.make_mesh())


def test_pair_kind():
    """Query chunk c against key chunk d: FULL below the diagonal, DIAGONAL on it, SKIP
    above, from the pairs' first natural-order tokens (chunks of 4); FULL without a causal
    mask."""
    spec = AttentionSpec.from_config(make_config(mask="causal"))
    causal = plan._Plan(spec=spec, kernel="cudnn", scale=1.0, mesh=None, size=2, pieces=2,
                        chunk_masked=True)
    kinds = [[int(blocks._pair_kind(causal, 4 * c, 4 * d, 4, 4)) for d in range(4)]
             for c in range(4)]
    F, D, S = blocks.FULL, blocks.DIAGONAL, blocks.SKIP
    assert kinds == [[D, S, S, S], [F, D, S, S], [F, F, D, S], [F, F, F, D]]
    dense = plan._Plan(spec=spec.replace(mask=MaskType.NO_MASK), kernel="cudnn", scale=1.0,
                       mesh=None, size=2, pieces=1, chunk_masked=True)
    assert int(blocks._pair_kind(dense, 0, 8, 8, 8)) == F


EIGHT_DEVICES = textwrap.dedent("""
    import numpy as np
    import test_context_parallel as cp
    import test_context_parallel_cudnn as t
    rng = np.random.default_rng({seed})
    mesh = cp.make_mesh((8,), ("cp",))
    for case, strategy, load_balance in (("causal", "ring", True), ("no_mask", "ring", False),
                                         ("causal_learnable", "all_gather", True),
                                         ("causal", "all_gather", False)):
        t.check_case(rng, t.CASES[case], strategy, load_balance, mesh)
    print("ok")
""")


def test_eight_devices(seed):
    """A few cases on an 8-device mesh."""
    cp.run_on_host_devices(EIGHT_DEVICES.format(seed=seed), 8)


# --------------------------------------------------------------------------- CPU: verdicts

def call_shapes(sq=32, skv=32, bias=False, dropout=False):
    return CallShapes(batch=2, seqlen_q=sq, seqlen_kv=skv, num_heads=4, num_kv_heads=2,
                      head_dim_qk=64, head_dim_v=64, dtype=jnp.dtype(jnp.bfloat16),
                      bias_shape=(2, 4, sq, skv) if bias else None, dropout=dropout)


REFUSED = {  # config overrides, call shapes -> what the reason must say
    "padding": (dict(mask="padding_causal", sequence={"format": "seqlens"}), {},
                r"cannot apply padding or packed segments.*'flash' or 'xla'"),
    "thd": (dict(mask="causal", qkv_layout="thd_thd_thd",
                 sequence={"format": "seqlens_offsets"}), {},
            r"padding or packed segments.*'thd_thd_thd'.*'flash' or 'xla'"),
    "window": (dict(mask="causal", window_size=(8, -1)), {},
               r"sliding window.*\(8, -1\).*'flash' or 'xla'"),
    "causal_cross": (dict(mask="causal"), dict(sq=16, skv=32),
                     r"causal mask needs as many query as key tokens.*sq=16, skv=32.*'flash' or "
                     r"'xla'"),
    "bottom_right_cross": (dict(mask="causal_bottom_right"), dict(sq=16, skv=32),
                           r"as many query as key tokens"),
    "bias": (dict(mask="causal", bias="post_scale_bias"), dict(bias=True),
             r"no bias array \(config.bias 'post_scale_bias'\); use backend='flash'"),
    "alibi": (dict(mask="causal", bias="alibi"), {},
              r"ALiBi term would be taken from block-local positions; use backend='xla'"),
    "dropout": (dict(mask="causal", dropout_rate=0.1), dict(dropout=True),
                r"dropout masks would come from cuDNN's own generator.*use backend='xla'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_verdict_says_why_cudnn_cannot_serve(case):
    overrides, shapes, expected = REFUSED[case]
    spec = AttentionSpec.from_config(make_config(backend="cudnn", **overrides))
    spec = spec.replace(context_axis="cp")
    reason = context_parallel.verdict("cudnn", spec, call_shapes(**shapes))
    assert reason is not None and reason.startswith("cudnn: "), reason
    assert re.search(expected, reason), reason
    assert context_parallel.verdict("xla", spec, call_shapes(**shapes)) is None


@pytest.mark.parametrize("case", CASES)
def test_verdict_serves_dense_masks(case):
    """Under context parallelism verdict passes the masks cudnn's pairs express; cudnn's
    own checks still apply (on the CPU: no CUDA GPU)."""
    c = CASES[case]
    spec = AttentionSpec.from_config(make_config(backend="cudnn", mask=c["mask"],
                                                 softmax=c.get("softmax", "vanilla")))
    shapes = call_shapes(c.get("sq", 32), c.get("skv", c.get("sq", 32)))
    assert context_parallel.verdict("cudnn", spec.replace(context_axis="cp"), shapes) is None
    overrides, inputs = cp.build(np.random.default_rng(0), "cudnn", c)
    config = make_config(**overrides)
    config.context_parallel.axis = "cp"
    qkv = (inputs["q"], inputs["k"], inputs["v"])
    reason = explain(qkv, config=config, platform="cpu").verdicts["cudnn"]
    assert reason == "cudnn: needs a CUDA GPU; this computation runs on cpu"


def test_named_cudnn_raises_the_reason(rng):
    """No silent fallback: backend='cudnn' with a mask its pairs cannot express raises the
    verdict (also with cudnn's own checks waived), and 'auto' takes another backend."""
    overrides, inputs = cp.build(rng, "cudnn", dict(mask="causal", window_size=(5, -1)))
    config = make_config(**overrides)
    config.context_parallel.axis = "cp"
    qkv = (inputs["q"], inputs["k"], inputs["v"])
    with jax.set_mesh(cp.make_mesh()), chunk_pair_kernel_as_cudnn() as kernel:
        with pytest.raises(ValueError, match=r"cudnn: .*sliding window"):
            jax.jit(lambda *a: fused_attn(a, config=config))(*qkv)
    assert kernel.calls == []
    config.backend = "auto"
    assert explain(qkv, config=config, platform="cpu").backend in ("flash", "xla")


# --------------------------------------------------------------------------- CPU: lowering

def test_entry_points_lower_for_cuda(monkeypatch, request):
    """The real cudnn entry points under the ring, lowered for CUDA (cuDNN faked): in each
    copy of a ring step a training forward with stats [b, h, chunk, 1] and a backward per
    visible pair kind, the diagonal's causal, the other's not."""
    fake_cudnn_for_cuda_lowering(monkeypatch, request)
    b, s, h, h_kv, d = 2, 64, 4, 2, 64
    config = make_config(backend="cudnn", mask="causal")
    config.context_parallel.axis = "cp"
    mesh = cp.make_mesh()
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "cp")))
    kv = jax.ShapeDtypeStruct((b, s, h_kv, d), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(None, "cp")))

    def loss(q, k, v):
        return jnp.sum(fused_attn((q, k, v), config=config).astype(jnp.float32))

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(fusedattn_cudnn_\w+)\((.*)", text)
    forward = [line for name, line in calls if name == "fusedattn_cudnn_fwd"]
    backward = [line for name, line in calls if name == "fusedattn_cudnn_bwd"]
    assert forward and backward, text
    chunk = s // 8
    for lines in (forward, backward):  # each copy of a ring step: a switch of two calls
        causal = [line for line in lines if "causal = true" in line]
        assert len(lines) == 2 * len(causal), lines
        assert all("training = true" in line for line in lines), lines
    assert all(f"tensor<{b}x{h}x{chunk}x1xf32>" in line for line in forward + backward), forward


# --------------------------------------------------------------------------- GPUs

GPU_CASES = ("causal", "no_mask", "no_mask_mha", "bottom_right_square", "causal_learnable")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy,load_balance", ALL_STRATEGIES)
@pytest.mark.parametrize("case", GPU_CASES)
def test_cudnn_on_every_gpu_matches_unsharded_xla(rng, case, strategy, load_balance):
    """cuDNN per block over a mesh of every GPU of the machine (one GPU forms a mesh of
    one), bfloat16: output, loss and every gradient equal the unsharded xla call's."""
    overrides, inputs = cp.build(rng, "cudnn", cp.on_gpus(CASES[case]), jnp.bfloat16)
    config = make_config(**overrides)
    config.context_parallel.axis = "cp"
    reason = explain((inputs["q"], inputs["k"], inputs["v"]), config=config).verdicts["cudnn"]
    if reason is not None and "softmax" in CASES[case]:
        pytest.skip(f"cuDNN's own check refuses the softmax sink here: {reason}")
    assert reason is None, reason
    mesh = cp.make_mesh((jax.device_count(),))
    cp.check_matches_unsharded(overrides, inputs, strategy, load_balance, mesh,
                               tol=tolerance(jnp.bfloat16), reference="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_cudnn_entry_points_match_xla(rng, mask):
    """One block on its own: o and the log-sum-exp (cuDNN's stats [b, h, sq, 1] as
    [b, h, sq], natural log), and the gradients from a whole attention's out and lse over
    the block's keys and as many more (so the stats cuDNN gets are not the block's own)."""
    b, s, h, h_kv, d = 2, 128, 4, 2, 64
    spec = AttentionSpec.from_config(make_config(backend="cudnn", mask=mask))
    q, k, v, d_out = (random_array(rng, (b, s, heads, d), jnp.bfloat16)
                      for heads in (h, h_kv, h_kv, h))
    block = CanonicalArgs(q=q, k=k, v=v, tokens=dense_token_info(spec, b, s, s))
    scale = d ** -0.5
    tol = tolerance(jnp.bfloat16)
    o, lse = jax.jit(lambda a: cudnn.attention_with_lse(spec, a, scale))(block)
    o_ref, lse_ref = xla.attention_with_lse(spec, block, scale)
    assert o.dtype == q.dtype and lse.dtype == jnp.float32 and lse.shape == (b, h, s)
    assert_close(o, o_ref, tol, "o")
    assert_close(lse, lse_ref, tol, "lse")
    # The whole attention: the block's keys and as many more, all visible to every query.
    k_more, v_more = (random_array(rng, (b, s, h_kv, d), jnp.bfloat16) for _ in range(2))
    dense = spec.replace(mask=MaskType.NO_MASK)
    rest = CanonicalArgs(q=q, k=k_more, v=v_more, tokens=dense_token_info(dense, b, s, s))
    out, whole_lse = _merge(o_ref, lse_ref, *xla.attention_with_lse(dense, rest, scale))
    out = out.astype(q.dtype)
    got = jax.jit(lambda a, o, l, g: cudnn.attention_backward_from_lse(spec, a, scale, o, l, g))(
        block, out, whole_lse, d_out)
    expected = xla.attention_backward_from_lse(spec, block, scale, None, out, whole_lse, d_out)
    assert got[3] is None
    for name, g, e in zip(("dq", "dk", "dv"), got[:3], expected[:3]):
        assert_close(g, e, tol, name)
