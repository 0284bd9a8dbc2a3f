"""Context parallelism (config.context_parallel): the sequence sharded over a mesh axis.

Four host (CPU) devices (conftest.py sets --xla_force_host_platform_device_count=4) form
a mesh with the sequence axis "cp" (4 devices), or "data" x "cp" (2 x 2, the batch
sharded too). Every check runs the jitted sharded call (q, k, v and the cotangent in the
device layout: load-balanced when asked) and compares the output and every gradient
with the jitted unsharded call of the same backend on fresh random inputs; the
descriptor and bias arrays describe the natural order in both calls. One test repeats a
few cases on eight devices in a subprocess.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from conftest import assert_close, make_config, random_array
from fusedattn.ops import (
    SequenceDescriptor, explain, fused_attn, inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing)
from fusedattn.ops import context_parallel

HOST_MESH = jax.devices()[0].platform == "cpu" and jax.device_count() >= 4


@pytest.fixture(autouse=True)
def _host_mesh(request):
    """Every test but the GPU-marked ones runs on four host devices."""
    if request.node.get_closest_marker("gpu") is None and not HOST_MESH:
        pytest.skip("needs four host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)"
                    " as JAX's default platform")


TOL = 5e-6  # float32: the merge by log-sum-exp reorders sums


def make_mesh(shape=(4,), names=("cp",), axis_type=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


# Each case: config overrides and call shapes. GQA (4 query heads, 2 K/V heads) throughout
# unless a case says otherwise.
CASES = {
    "causal": dict(mask="causal"),
    "no_mask_mha": dict(mask="no_mask", h_kv=4),
    "bottom_right_cross": dict(mask="causal_bottom_right", sq=16, skv=32),
    "causal_window": dict(mask="causal", window_size=(5, -1)),
    "window_both_sides": dict(mask="no_mask", window_size=(3, 6), h_kv=1),
    "padding_causal": dict(mask="padding_causal", form="seqlens"),
    "packed": dict(mask="padding_causal", form="segment_ids"),
    "packed_bottom_right": dict(mask="padding_causal_bottom_right", form="segment_ids"),
    "thd_offsets_window": dict(mask="padding_causal", form="seqlens_offsets",
                               window_size=(6, -1)),
}
# Cases only the xla backend serves (dropout) or that need its sink path, and bias arrays
# (flash too: test_flash_bias_matches_unsharded).
XLA_CASES = {
    "post_scale_bias": dict(mask="causal", bias="post_scale_bias"),
    "pre_scale_bias_shared": dict(mask="padding", form="seqlens", bias="pre_scale_bias",
                                  bias_shape="shared"),
    "alibi_slopes": dict(mask="causal", bias="alibi"),
    "learnable": dict(mask="causal", softmax="learnable"),
    "off_by_one_packed": dict(mask="padding_causal", form="segment_ids", softmax="off_by_one"),
    "dropout": dict(mask="causal", dropout=0.25),
    "dropout_packed": dict(mask="padding_causal", form="segment_ids", dropout=0.25),
}
# (strategy, load_balance): every case runs the first two; the other two combinations run
# on a few cases (test_other_strategy_combinations).
STRATEGIES = [("ring", True), ("all_gather", False)]
OTHER_STRATEGIES = [("ring", False), ("all_gather", True)]


def descriptor(rng, form: str, b: int, sq: int, skv: int):
    """A random SequenceDescriptor of `form` (natural order) and config.sequence overrides."""
    if form == "seqlens":
        q_len = rng.integers(1, sq + 1, b)
        kv_len = rng.integers(1, skv + 1, b)
        return SequenceDescriptor.from_seqlens(q_len, kv_len), {"format": form}
    if form == "segment_ids":
        assert sq == skv
        ids = np.zeros((b, sq), np.int32)
        for row in range(b):
            cuts = np.sort(rng.choice(np.arange(1, sq - 2), 3, replace=False))
            ids[row] = np.searchsorted(cuts, np.arange(sq), side="right") + 1
            ids[row, sq - rng.integers(0, 4):] = 0  # padding at the end
        return (SequenceDescriptor.from_segment_ids_and_pos(ids, ids),
                {"format": form, "max_segments_per_seq": 4})
    assert form == "seqlens_offsets" and sq == skv
    lengths = np.full((b, 3), -1, np.int32)
    offsets = np.full((b, 4), -1, np.int32)
    for row in range(b):
        used = rng.multinomial(sq - rng.integers(0, 5), [1 / 3] * 3)
        used = used[used > 0]
        lengths[row, :len(used)] = used
        offsets[row, :len(used) + 1] = np.concatenate([[0], np.cumsum(used)])
    return (SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths, offsets, offsets),
            {"format": form, "max_segments_per_seq": 3})


def build(rng, backend: str, case: dict, dtype=jnp.float32):
    """(config overrides, inputs dict, argnums to differentiate) for one case."""
    b, sq, skv, h, d = 2, case.get("sq", 32), case.get("skv", case.get("sq", 32)), 4, case.get("d", 8)
    h_kv = case.get("h_kv", 2)
    overrides = dict(backend=backend, mask=case["mask"],
                     window_size=case.get("window_size", (-1, -1)),
                     bias=case.get("bias", "no_bias"), softmax=case.get("softmax", "vanilla"),
                     dropout_rate=case.get("dropout", 0.0))
    inputs = dict(q=random_array(rng, (b, sq, h, d), dtype),
                  k=random_array(rng, (b, skv, h_kv, d), dtype),
                  v=random_array(rng, (b, skv, h_kv, d), dtype),
                  w=random_array(rng, (b, sq, h, d), dtype))
    if "form" in case:
        inputs["sequence"], overrides["sequence"] = descriptor(rng, case["form"], b, sq, skv)
        if case["form"] == "seqlens_offsets":
            overrides["qkv_layout"] = "thd_thd_thd"
    if overrides["bias"] in ("post_scale_bias", "pre_scale_bias"):
        shape = (1, h, sq, skv) if case.get("bias_shape") == "shared" else (b, h, sq, skv)
        inputs["bias"] = random_array(rng, shape)
    elif overrides["bias"] == "alibi":
        inputs["bias"] = jnp.asarray(rng.uniform(0.1, 1.0, h), jnp.float32)
    if overrides["softmax"] == "learnable":
        inputs["offset"] = random_array(rng, (h,))
    if overrides["dropout_rate"]:
        inputs["key"] = jax.random.key(int(rng.integers(1 << 30)))
    return overrides, inputs


def loss_and_grads(overrides: dict, inputs: dict, context=None):
    """jit(value_and_grad) of sum(fused_attn(...) * w) w.r.t. q, k, v, bias, offset."""
    config = make_config(**overrides)
    if context is not None:
        for key, value in context.items():
            setattr(config.context_parallel, key, value)
    names = [n for n in ("q", "k", "v", "bias", "offset") if n in inputs]

    def loss(diff, rest):
        out = fused_attn((diff["q"], diff["k"], diff["v"]), config=config, bias=diff.get("bias"),
                         softmax_offset=diff.get("offset"), sequence=rest.get("sequence"),
                         dropout_rng=rest.get("key"), is_training="key" in rest)
        return jnp.sum(out.astype(jnp.float32) * rest["w"].astype(jnp.float32)), out

    diff = {n: inputs[n] for n in names}
    rest = {n: x for n, x in inputs.items() if n not in names}
    (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff, rest)
    return value, out, grads


def check_matches_unsharded(overrides, inputs, strategy, load_balance, mesh, axis="cp",
                            tol=TOL, batch_axis=None, reference=None):
    """The sharded call (device layout) equals the unsharded one, output and gradients;
    `reference` names the unsharded call's backend (default: the sharded call's)."""
    value, out, grads = loss_and_grads(
        overrides if reference is None else {**overrides, "backend": reference}, inputs)
    n = mesh.shape[axis]
    seq_arrays = ("q", "k", "v", "w")
    to_device = ((lambda x: reorder_causal_load_balancing(x, n)) if load_balance
                 else (lambda x: x))
    to_natural = ((lambda x: inverse_reorder_causal_load_balancing(np.asarray(x), n))
                  if load_balance else (lambda x: x))
    sharded = dict(inputs)
    spec = NamedSharding(mesh, P(batch_axis, axis))
    for name in seq_arrays:
        sharded[name] = jax.device_put(to_device(inputs[name]), spec)
    context = dict(axis=axis, strategy=strategy, load_balance=load_balance)
    with jax.set_mesh(mesh):
        got_value, got_out, got_grads = loss_and_grads(overrides, sharded, context)
    assert got_out.sharding.is_equivalent_to(spec, got_out.ndim), got_out.sharding
    # the loss sums terms of both signs: its rounding is relative to the sum of |terms|
    terms = jnp.sum(jnp.abs(out.astype(jnp.float32) * inputs["w"].astype(jnp.float32)))
    assert_close(got_value, value, tol, "loss", scale=float(terms))
    assert_close(to_natural(got_out), out, tol, "output")
    for name, grad in grads.items():
        got = got_grads[name]
        if name in ("q", "k", "v"):
            got = to_natural(got)
        assert_close(got, grad, tol, f"d{name}")


@pytest.mark.parametrize("strategy,load_balance", STRATEGIES)
@pytest.mark.parametrize("backend", ["xla", "flash"])
@pytest.mark.parametrize("case", CASES)
def test_matches_unsharded(rng, case, backend, strategy, load_balance):
    overrides, inputs = build(rng, backend, CASES[case])
    check_matches_unsharded(overrides, inputs, strategy, load_balance, make_mesh())


@pytest.mark.parametrize("strategy,load_balance", [("ring", True), ("all_gather", True)])
@pytest.mark.parametrize("case", XLA_CASES)
def test_xla_features_match_unsharded(rng, case, strategy, load_balance):
    overrides, inputs = build(rng, "xla", XLA_CASES[case])
    check_matches_unsharded(overrides, inputs, strategy, load_balance, make_mesh())


@pytest.mark.parametrize("strategy,load_balance", STRATEGIES)
@pytest.mark.parametrize("case", [
    XLA_CASES["post_scale_bias"], XLA_CASES["pre_scale_bias_shared"],
    dict(mask="padding_causal", form="segment_ids", bias="post_scale_bias")])
def test_flash_bias_matches_unsharded(rng, case, strategy, load_balance):
    """flash per block with the block's slice of the bias and its gradient (packed too)."""
    overrides, inputs = build(rng, "flash", case)
    check_matches_unsharded(overrides, inputs, strategy, load_balance, make_mesh())


@pytest.mark.parametrize("strategy,load_balance", OTHER_STRATEGIES)
@pytest.mark.parametrize("backend,case", [("xla", "causal_window"), ("flash", "packed"),
                                          ("xla", "post_scale_bias"), ("xla", "dropout_packed")])
def test_other_strategy_combinations(rng, backend, case, strategy, load_balance):
    overrides, inputs = build(rng, backend, {**CASES, **XLA_CASES}[case])
    check_matches_unsharded(overrides, inputs, strategy, load_balance, make_mesh())


@pytest.mark.parametrize("data", [2, 1])
@pytest.mark.parametrize("backend", ["xla", "flash"])
def test_batch_sharded_over_another_axis(rng, backend, data):
    """A data x cp mesh: the batch over "data", the sequence over "cp"; a "data" axis of one
    device (the LM trainer's 1 x N mesh) once failed in the compiled ops' partitioning."""
    overrides, inputs = build(rng, backend, CASES["packed"])
    check_matches_unsharded(overrides, inputs, "ring", True,
                            make_mesh((data, 4 // data), ("data", "cp")), batch_axis="data")


@pytest.mark.parametrize("strategy,load_balance", [("ring", True), ("all_gather", False)])
@pytest.mark.parametrize("case", ["causal", "bottom_right_cross", "causal_window", "packed",
                                  "thd_offsets_window", "post_scale_bias", "alibi_slopes"])
def test_max_logit_matches_unsharded(rng, case, strategy, load_balance):
    """return_max_logit under context parallelism: the maximum over every device's blocks."""
    overrides, inputs = build(rng, "xla", {**CASES, **XLA_CASES}[case])
    config = make_config(**overrides)

    def largest(q, k, v, config):
        return fused_attn((q, k, v), config=config, bias=inputs.get("bias"),
                          sequence=inputs.get("sequence"), return_max_logit=True)[1]

    expected = jax.jit(functools.partial(largest, config=config))(
        inputs["q"], inputs["k"], inputs["v"])
    mesh = make_mesh()
    to_device = ((lambda x: reorder_causal_load_balancing(x, 4)) if load_balance
                 else (lambda x: x))
    q, k, v = (jax.device_put(to_device(inputs[n]), NamedSharding(mesh, P(None, "cp")))
               for n in ("q", "k", "v"))
    for key, value in dict(axis="cp", strategy=strategy, load_balance=load_balance).items():
        setattr(config.context_parallel, key, value)
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(largest, config=config))(q, k, v)
    assert got.shape == (4,) and np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_explicit_context_axis(rng, strategy):
    """A context axis of explicit sharding (jax.make_mesh's default): the op reshards its
    operands over it itself."""
    overrides, inputs = build(rng, "xla", CASES["packed"])
    check_matches_unsharded(overrides, inputs, strategy, True,
                            make_mesh(axis_type=AxisType.Explicit))


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_bfloat16(rng, strategy):
    overrides, inputs = build(rng, "xla", CASES["causal_window"], dtype=jnp.bfloat16)
    check_matches_unsharded(overrides, inputs, strategy, True, make_mesh(), tol=0.02)


def test_sbhd_layout(rng):
    """The canonical sequence axis of SBHD arrays is their first: sharded there."""
    overrides, inputs = build(rng, "xla", CASES["causal"])
    overrides["qkv_layout"] = "sbhd_sbhd_sbhd"
    config = make_config(**overrides)
    config.context_parallel.axis = "cp"
    q, k, v = (jnp.swapaxes(inputs[n], 0, 1) for n in ("q", "k", "v"))
    expected = fused_attn((q, k, v), config=make_config(**overrides))
    mesh = make_mesh()
    n = mesh.shape["cp"]
    spec = NamedSharding(mesh, P("cp"))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda q, k, v: fused_attn((q, k, v), config=config))(
            *(jax.device_put(reorder_causal_load_balancing(x, n, seq_axis=0), spec)
              for x in (q, k, v)))
    assert_close(inverse_reorder_causal_load_balancing(got, n, seq_axis=0), expected, TOL)


# --------------------------------------------------------------------------- structure

def compiled_hlo(overrides, inputs, strategy, mesh):
    config = make_config(**overrides)
    config.context_parallel.axis = "cp"
    config.context_parallel.strategy = strategy
    spec = NamedSharding(mesh, P(None, "cp"))
    q, k, v, w = (jax.device_put(inputs[n], spec) for n in ("q", "k", "v", "w"))

    def loss(q, k, v):
        return jnp.sum(fused_attn((q, k, v), config=config) * w)

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
        return lowered.compile()


def gathered_float_shapes(hlo: str) -> list[str]:
    """Result shapes of the floating-point all-gathers in a compiled module."""
    return [m.group(1) for m in re.finditer(r"=\s*(f32\[[\d,]*\])[^=\n]*? all-gather(?:-start)?\(",
                                            hlo)]


@pytest.mark.parametrize("backend,chunks_per_call", [("xla", 1), ("flash", 2)])
def test_load_balanced_calls_per_block(rng, monkeypatch, backend, chunks_per_call):
    """Under load balancing a device's shard is two chunks: xla, which computes every score
    it is given, gets a call per chunk pair (so that invisible pairs are skipped); the flash
    kernels skip invisible tiles themselves and get the whole shard in one call."""
    kernel = context_parallel.plan._KERNELS[backend]
    original, widths = kernel.attention_with_lse, []

    def recording(spec, args, *rest):
        widths.append((args.q.shape[1], args.k.shape[1]))
        return original(spec, args, *rest)

    monkeypatch.setattr(kernel, "attention_with_lse", recording)
    overrides, inputs = build(rng, backend, CASES["causal"])
    mesh = make_mesh()
    sharded = {name: jax.device_put(reorder_causal_load_balancing(x, 4),
                                    NamedSharding(mesh, P(None, "cp")))
               if name in ("q", "k", "v", "w") else x for name, x in inputs.items()}
    with jax.set_mesh(mesh):
        loss_and_grads(overrides, sharded, dict(axis="cp", strategy="ring", load_balance=True))
    chunk = inputs["q"].shape[1] // 8
    assert widths and set(widths) == {(chunks_per_call * chunk, chunks_per_call * chunk)}


def test_ring_never_gathers_kv_and_all_gather_does(rng):
    overrides, inputs = build(rng, "xla", CASES["causal"])
    mesh = make_mesh()
    ring = compiled_hlo(overrides, inputs, "ring", mesh).as_text()
    assert "collective-permute" in ring
    assert gathered_float_shapes(ring) == [], gathered_float_shapes(ring)
    gather = compiled_hlo(overrides, inputs, "all_gather", mesh).as_text()
    k_shape = f"f32[{','.join(map(str, inputs['k'].shape))}]"
    assert k_shape in gathered_float_shapes(gather), gathered_float_shapes(gather)
    assert "reduce-scatter" in gather


def scan_bodies(jaxpr) -> list:
    """The body jaxprs of every lax.scan in a jaxpr, at any depth."""
    bodies = []
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    if eqn.primitive.name == "scan":
                        bodies.append(inner)
                    bodies += scan_bodies(inner)
    return bodies


@pytest.mark.parametrize("n", [4, 3])
def test_ring_sends_only_what_a_step_starts_with(rng, n):
    """In the ring's scanned steps, forward and backward, every ppermute reads the step's
    loop-carried values, nothing the step computes: the K/V block and the dK/dV
    accumulators of the block before can travel while the step's attention runs."""
    overrides, inputs = build(rng, "xla", CASES["causal"])
    config = make_config(**overrides)
    config.context_parallel.axis, config.context_parallel.strategy = "cp", "ring"
    mesh = make_mesh((n,))
    spec = NamedSharding(mesh, P(None, "cp"))
    q, k, v, w = (jax.device_put(inputs[name][:, :24], spec) for name in ("q", "k", "v", "w"))

    def loss(q, k, v):
        return jnp.sum(fused_attn((q, k, v), config=config) * w)

    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    sent = [(eqn, body) for body in scan_bodies(jaxpr.jaxpr) for eqn in body.eqns
            if eqn.primitive.name == "ppermute"]
    floats = [eqn for eqn, _ in sent if jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)]
    assert len(floats) == 6, floats  # forward k, v; backward k, v and the dK, dV accumulators
    for eqn, body in sent:
        carried = set(map(id, body.invars))
        assert all(id(x) in carried for x in eqn.invars), eqn


def test_ring_memory_per_device_scales_down(rng):
    check_memory_scales_down(rng, make_mesh())


def check_memory_scales_down(rng, mesh):
    """Compiled temporary memory of the ring's forward and backward on N devices is at
    most 1.2 / N of the unsharded call's (xla backend: the score matrix dominates)."""
    overrides = dict(backend="xla", mask="causal")
    b, s, h, d = 1, 512, 2, 16
    inputs = dict(q=random_array(rng, (b, s, h, d)), k=random_array(rng, (b, s, h, d)),
                  v=random_array(rng, (b, s, h, d)), w=random_array(rng, (b, s, h, d)))
    sharded = compiled_hlo(overrides, inputs, "ring", mesh).memory_analysis()
    config = make_config(**overrides)

    def loss(q, k, v):
        return jnp.sum(fused_attn((q, k, v), config=config) * inputs["w"])

    whole = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
        inputs["q"], inputs["k"], inputs["v"]).compile().memory_analysis()
    n = mesh.shape["cp"]
    assert sharded.temp_size_in_bytes <= 1.2 / n * whole.temp_size_in_bytes, (
        sharded.temp_size_in_bytes, whole.temp_size_in_bytes)


EIGHT_DEVICES = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import test_context_parallel as t
    rng = np.random.default_rng({seed})
    for case, strategy in (("causal_window", "ring"), ("packed", "ring"),
                           ("bottom_right_cross", "all_gather")):
        overrides, inputs = t.build(rng, "xla", t.CASES[case])
        t.check_matches_unsharded(overrides, inputs, strategy, True, t.make_mesh((8,), ("cp",)))
    t.check_memory_scales_down(rng, t.make_mesh((8,), ("cp",)))
    print("ok")
""")


def test_eight_devices(seed):
    """A few cases and the memory bound on an 8-device mesh."""
    run_on_host_devices(EIGHT_DEVICES.format(seed=seed), 8)


def run_on_host_devices(script: str, count: int) -> None:
    """Runs `script` (which prints "ok" at its end) in a subprocess with `count` host
    devices (the device count is fixed when JAX starts); the tests' folder is importable."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", "")) + (
        f" --xla_force_host_platform_device_count={count}")
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, timeout=600, cwd=here)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]


# --------------------------------------------------------------------------- GPUs

GPU_CASES = ("causal", "no_mask_mha", "bottom_right_cross", "causal_window", "packed",
             "thd_offsets_window")


def on_gpus(case: dict) -> dict:
    """A case scaled to the compiled kernels: head dim 64, eight times the tokens."""
    sq = 8 * case.get("sq", 32)
    return {**case, "d": 64, "sq": sq, "skv": 8 * case.get("skv", case.get("sq", 32))}


@pytest.mark.gpu
@pytest.mark.parametrize("strategy,load_balance", STRATEGIES + OTHER_STRATEGIES[:1])
@pytest.mark.parametrize("case", GPU_CASES)
def test_flash_on_every_gpu_matches_unsharded(rng, case, strategy, load_balance):
    """The flash CUDA kernels per block over a mesh of every GPU of the machine (one GPU forms
    a mesh of one), bfloat16: output, loss and every gradient equal the unsharded call's."""
    overrides, inputs = build(rng, "flash", on_gpus(CASES[case]), jnp.bfloat16)
    mesh = make_mesh((jax.device_count(),))
    check_matches_unsharded(overrides, inputs, strategy, load_balance, mesh, tol=2e-2)


# --------------------------------------------------------------------------- helpers, errors

def test_load_balance_permutation():
    assert context_parallel.load_balance_permutation(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    x = jnp.arange(2 * 24).reshape(2, 24)
    there = reorder_causal_load_balancing(x, 3)
    assert there[0, :4].tolist() == [0, 1, 2, 3] and there[0, 4:8].tolist() == [20, 21, 22, 23]
    assert (inverse_reorder_causal_load_balancing(there, 3) == x).all()
    with pytest.raises(ValueError, match="multiple of 6"):
        reorder_causal_load_balancing(x[:, :20], 3)


def test_errors_name_the_setting(rng):
    overrides, inputs = build(rng, "xla", CASES["causal"])
    config = make_config(**overrides)
    config.context_parallel.axis = "cp"
    qkv = (inputs["q"], inputs["k"], inputs["v"])
    with pytest.raises(ValueError, match=r"context_parallel.axis.*no mesh.*jax.set_mesh"):
        fused_attn(qkv, config=config)
    with jax.set_mesh(make_mesh((4,), ("seq",))):
        with pytest.raises(ValueError, match=r"'cp'.*axes \('seq',\)"):
            jax.jit(lambda *a: fused_attn(a, config=config))(*qkv)
    with jax.set_mesh(make_mesh((2, 2), ("data", "cp"), AxisType.Explicit)):
        with pytest.raises(ValueError, match=r"other axes \('data',\) are of explicit"):
            jax.jit(lambda *a: fused_attn(a, config=config))(*qkv)
    with jax.set_mesh(make_mesh()):
        with pytest.raises(ValueError, match=r"q: .*8 equal chunks.*28 tokens"):
            jax.jit(lambda *a: fused_attn(a, config=config))(*(x[:, :28] for x in qkv))


def test_backends_without_a_block_entry_point_say_why(rng):
    overrides, inputs = build(rng, "xla", CASES["causal"])
    config = make_config(**{**overrides, "backend": "auto", "dropout_rate": 0.1})
    config.context_parallel.axis = "cp"
    config.small_seq.enabled = True
    qkv = (inputs["q"], inputs["k"], inputs["v"])
    verdicts = explain(qkv, config=config, platform="cpu").verdicts
    assert "context parallelism" in verdicts["cudnn"]
    assert "context parallelism" in verdicts["small_seq"]
    assert "block-local" in verdicts["flash"]
    assert verdicts["xla"] is None
    config.backend = "flash"
    with jax.set_mesh(make_mesh()), pytest.raises(ValueError, match="block-local"):
        fused_attn(qkv, config=config, dropout_rng=jax.random.key(0), is_training=True)
    config = make_config(**{**overrides, "backend": "auto", "bias": "alibi"})
    config.context_parallel.axis = "cp"
    verdicts = explain(qkv, config=config, platform="cpu").verdicts
    assert "block entry point has no ALiBi" in verdicts["flash"]
    assert verdicts["xla"] is None


# --------------------------------------------------------------------------- layers

@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_nnx_layer_with_rope_mask_and_packing(rng, strategy):
    """The layer passes the config through: inputs and output in the device layout, RoPE
    positions and explicit-mask rows reordered to match; gradients of the parameters and
    inputs equal the unsharded layer's."""
    from flax import nnx as fnnx
    from fusedattn.layers import nnx

    b, s, features, heads = 2, 32, 16, 4
    sequence, seq_overrides = descriptor(rng, "segment_ids", b, s, s)
    config = make_config(backend="xla", mask="padding_causal", sequence=seq_overrides)
    layer = nnx.MultiHeadAttention(heads, features, config=config, num_kv_heads=2, rope=True,
                                   rngs=fnnx.Rngs(int(rng.integers(1 << 30))))
    x = random_array(rng, (b, s, features))
    w = random_array(rng, (b, s, features))
    mask = jnp.asarray(rng.random((b, 1, s, s)) < 0.8)

    def loss(layer, x, w, mask):
        return jnp.sum(layer(x, mask=mask, sequence=sequence) * w)

    grads = fnnx.jit(fnnx.grad(loss, argnums=(0, 1)))
    expected_layer, expected_x = grads(layer, x, w, mask)
    mesh = make_mesh()
    n = mesh.shape["cp"]
    config.context_parallel.axis = "cp"
    config.context_parallel.strategy = strategy
    sharded = nnx.MultiHeadAttention(heads, features, config=config, num_kv_heads=2, rope=True,
                                     rngs=fnnx.Rngs(0))
    fnnx.update(sharded, fnnx.state(layer, fnnx.Param))
    spec = NamedSharding(mesh, P(None, "cp"))
    x_cp, w_cp = (jax.device_put(reorder_causal_load_balancing(a, n), spec) for a in (x, w))
    with jax.set_mesh(mesh):
        got_layer, got_x = grads(sharded, x_cp, w_cp, mask)
        out = fnnx.jit(lambda m, x: m(x, mask=mask, sequence=sequence))(sharded, x_cp)
    assert_close(inverse_reorder_causal_load_balancing(out, n),
                 layer(x, mask=mask, sequence=sequence), TOL, "output")
    assert_close(inverse_reorder_causal_load_balancing(got_x, n), expected_x, TOL, "dx")
    jax.tree.map(lambda a, e: assert_close(a, e, TOL, "dparams"),
                 fnnx.state(got_layer, fnnx.Param), fnnx.state(expected_layer, fnnx.Param))
