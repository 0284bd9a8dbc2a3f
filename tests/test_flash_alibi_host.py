"""ALiBi on the "flash" backend's host build (platform "cpu") against the xla backend.

Every case draws fresh random inputs, runs `flash.BACKEND.attention` and
`xla.BACKEND.attention` on the same CanonicalArgs (config.bias 'alibi', default or
given slopes), and compares the output and the gradients of sum(o * do) w.r.t. q, k,
v, the softmax offset and the given slopes (the xla backend's come from autodiff of
scale * q.k - slope[h] * |kv_pos - (q_pos + q_diag)|).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, make_config, tolerance
# The host build's skip mark and the autouse fixture that runs every case on the cpu.
from test_flash_host import _on_cpu, pytestmark  # noqa: F401
from test_flash_host import MASKS, _shapes, make_args, make_spec, reference

from fusedattn.ops import explain, fused_attn
from fusedattn.ops.backends import flash, xla
from fusedattn.ops.enums import BiasType

# The slopes' gradient against the float64 reference (check's slopes_reference): float32
# sums of many terms, relative to the largest |d_slope|.
SLOPES_TOLERANCE = 2e-3
SLOPES_NOISE = 2e-6


def alibi_spec(kind: str, softmax: str = "vanilla", window=(-1, -1), dropout_rate: float = 0.0):
    return make_spec(kind, softmax, window, dropout_rate).replace(bias=BiasType.ALIBI)


def given_slopes(rng, h: int) -> jax.Array:
    """Slopes of both signs and varied size (the xla backend takes any float32 [h])."""
    return jnp.asarray(rng.uniform(-0.3, 1.2, h), jnp.float32)


def run(backend, spec, args, scale, do):
    """Output and the gradients of sum(o * do): q, k, v, offset and args.bias (the given
    ALiBi slopes or a bias array; None where not given)."""
    with_offset = args.softmax_offset is not None
    with_bias = args.bias is not None
    h = args.q.shape[2]

    def f(q, k, v, offset, bias):
        a = args._replace(q=q, k=k, v=v, softmax_offset=offset if with_offset else None,
                          bias=bias if with_bias else None)
        return backend.attention(spec, a, scale)

    offset = args.softmax_offset if with_offset else jnp.zeros((h,), jnp.float32)
    bias = args.bias if with_bias else jnp.zeros((h,), jnp.float32)

    @jax.jit
    def fwd_bwd(q, k, v, offset, bias, do):
        o, vjp = jax.vjp(f, q, k, v, offset, bias)
        return o, vjp(do)

    o, (dq, dk, dv, d_offset, d_bias) = fwd_bwd(args.q, args.k, args.v, offset, bias, do)
    return dict(o=o, dq=dq, dk=dk, dv=dv, d_offset=d_offset if with_offset else None,
                d_bias=d_bias if with_bias else None)


def check(rng, spec, args, scale=None, slopes_reference: bool = False):
    """flash against xla (output, and every gradient: q, k, v, the learnable offset and
    args.bias where given); returns both results. slopes_reference: the given ALiBi slopes'
    gradient against the float64 reference with rowsum(dO * O) from flash's own output
    instead (the kernels' definition: at half precision and long rows the rounding of O
    moves that sum, and the slopes' gradient, a sum over all pairs with weights |distance|
    that do not average out, moves with it by a few percent from the xla backend's exact
    one)."""
    scale = 1.0 / math.sqrt(args.q.shape[-1]) if scale is None else scale
    b, sq, h, _ = args.q.shape
    do = jnp.asarray(rng.standard_normal((b, sq, h, args.v.shape[-1])),
                     jnp.float32).astype(args.q.dtype)
    got = run(flash.BACKEND, spec, args, scale, do)
    want = run(xla.BACKEND, spec, args, scale, do)
    tol = tolerance(args.q.dtype)
    for name in ("o", "dq", "dk", "dv"):
        assert got[name].dtype == args.q.dtype, name
        assert_close(got[name], want[name], tol, name)
    if str(spec.softmax) == "learnable":  # off_by_one's sink is the constant 0
        assert_close(got["d_offset"], want["d_offset"], max(tol, 1e-5), "d_offset")
    if want["d_bias"] is not None:
        assert got["d_bias"].dtype == args.bias.dtype, "d_bias"
    if want["d_bias"] is not None and slopes_reference:
        exact = reference(args, spec, scale, do, slopes=args.bias, delta_from=got["o"])
        assert_slopes_close(got["d_bias"], exact)
    elif want["d_bias"] is not None:
        assert_close(got["d_bias"], want["d_bias"], max(tol, 1e-5), "d_bias")
    return got, want


def assert_slopes_close(got, exact):
    """The slopes' gradient against the float64 reference: within SLOPES_TOLERANCE of the
    largest |d_slope|, plus per head SLOPES_NOISE times the root sum of squares of the parts
    that cancel in it (float32 products and sums carry about 2e-7 of each part; the margin is
    10x), so that a head whose gradient is zero in exact arithmetic (every row sees one key)
    is held to its rounding noise, not to zero."""
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "d_slopes: not finite"
    bound = (SLOPES_TOLERANCE * np.max(np.abs(exact["d_slopes"]))
             + SLOPES_NOISE * exact["d_slopes_noise"])
    error = np.abs(got - exact["d_slopes"])
    assert np.all(error <= bound), f"d_slopes: |error| {error} over {bound} (got {got}, exact {exact['d_slopes']})"


def with_slopes(rng, args, given: bool):
    return args._replace(bias=given_slopes(rng, args.q.shape[2]) if given else None)


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("kind", MASKS + ("packed", "packed_bottom_right"))
def test_masks(rng, kind, given):
    args = with_slopes(rng, make_args(rng, kind=kind, sq=7, skv=11), given)
    check(rng, alibi_spec(kind), args)


@pytest.mark.parametrize("window", [(2, 0), (3, 3), (-1, 2)])
@pytest.mark.parametrize("kind", ["no_mask", "causal", "padding_causal_bottom_right", "packed"])
def test_windows(rng, window, kind):
    args = with_slopes(rng, make_args(rng, kind=kind, sq=8, skv=12), True)
    check(rng, alibi_spec(kind, window=window), args)


@pytest.mark.parametrize("softmax", ["off_by_one", "learnable"])
@pytest.mark.parametrize("kind", ["no_mask", "packed_bottom_right"])
def test_softmax_variants(rng, softmax, kind):
    args = with_slopes(rng, make_args(rng, kind=kind, softmax=softmax), True)
    check(rng, alibi_spec(kind, softmax), args)


@pytest.mark.parametrize("h_kv", [1, 2, 6])
def test_grouped_query_attention(rng, h_kv):
    """Six heads: the default slopes' non-power-of-two branch."""
    args = make_args(rng, h=6, h_kv=h_kv, kind="padding_causal", softmax="learnable")
    check(rng, alibi_spec("padding_causal", "learnable"), args)
    check(rng, alibi_spec("padding_causal", "learnable"), with_slopes(rng, args, True))


def test_dropout(rng):
    """The dropout mask and ALiBi together (both backends draw the same Philox mask)."""
    args = with_slopes(rng, make_args(rng, kind="padding_causal", sq=6, skv=11,
                                      seed=[7, 2**32 - 5]), True)
    check(rng, alibi_spec("padding_causal", dropout_rate=0.3), args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(rng, dtype):
    args = with_slopes(rng, make_args(rng, kind="packed_bottom_right", dtype=dtype, d=16), True)
    check(rng, alibi_spec("packed_bottom_right"), args)


def test_larger_case_runs_threaded(rng):
    """Big enough for the host kernels to split (batch, k/v head) groups over threads; long
    distances make the ALiBi term dominate the scores."""
    args = with_slopes(rng, make_args(rng, b=2, sq=48, skv=80, h=4, h_kv=2, d=32,
                                      kind="padding_causal_bottom_right"), True)
    check(rng, alibi_spec("padding_causal_bottom_right", window=(40, 3)), args)


def test_alibi_changes_the_result(rng):
    """The term is applied: the output differs from plain attention, and the slopes'
    gradient is nonzero."""
    args = with_slopes(rng, make_args(rng, kind="causal", sq=9, skv=9), True)
    do = jnp.asarray(rng.standard_normal(args.q.shape), jnp.float32)
    got = run(flash.BACKEND, alibi_spec("causal"), args, 0.5, do)
    plain = run(flash.BACKEND, make_spec("causal"), args._replace(bias=None), 0.5, do)
    assert np.abs(np.asarray(got["o"]) - np.asarray(plain["o"])).max() > 1e-2
    assert np.all(np.abs(np.asarray(got["d_bias"])) > 0)


def test_vmap_with_mapped_slopes(rng):
    """Slopes mapped under jax.vmap reach each example's own rows."""
    spec = alibi_spec("padding_causal")
    args = make_args(rng, kind="padding_causal")
    slopes = jnp.stack([given_slopes(rng, 4) for _ in range(3)])  # one per batch row

    def one(q, k, v, tokens, s):
        a = args._replace(q=q[None], k=k[None], v=v[None],
                          tokens=type(args.tokens)(*(t[None] for t in tokens)), bias=s)
        return flash.BACKEND.attention(spec, a, 0.4)[0]

    got = jax.vmap(one)(args.q, args.k, args.v, args.tokens, slopes)
    for row in range(3):
        a = args._replace(q=args.q[row:row + 1], k=args.k[row:row + 1], v=args.v[row:row + 1],
                          tokens=type(args.tokens)(*(t[row:row + 1] for t in args.tokens)),
                          bias=slopes[row])
        assert_close(got[row], xla.BACKEND.attention(spec, a, 0.4)[0], 1e-5, f"row {row}")


def test_through_fused_attn(rng):
    """The public op: named flash serves ALiBi on the cpu, explain says so, the output and
    the slopes' gradient match backend xla."""
    q, k, v = (jnp.asarray(rng.standard_normal((2, 10, 4, 8)), jnp.float32) for _ in range(3))
    slopes = given_slopes(rng, 4)
    results = {}
    for backend in ("flash", "xla"):
        config = make_config(backend=backend, mask="causal", bias="alibi", window_size=(5, 0))

        def loss(q, s, config=config):
            return jnp.sum(fused_attn((q, k, v), config=config, bias=s) ** 2)

        results[backend] = jax.value_and_grad(loss, (0, 1))(q, slopes)
    assert_close(results["flash"][0], results["xla"][0], 1e-5, "loss")
    for i, name in enumerate(("dq", "d_slopes")):
        assert_close(results["flash"][1][i], results["xla"][1][i], 1e-5, name)
    config = make_config(backend="flash", mask="causal", bias="alibi")
    assert explain((q, k, v), config=config).backend == "flash"


def test_supports(monkeypatch):
    """ALiBi (default or given slopes) on cpu, and on CUDA and ROCm wherever their kernels
    serve the call otherwise (tests/test_flash_alibi_gpu.py runs them)."""
    spec = alibi_spec("causal")
    assert flash.BACKEND.supports(spec, _shapes(), "cpu") is None
    assert flash.BACKEND.supports(spec, _shapes(alibi_slopes=True), "cpu") is None
    monkeypatch.setattr(flash.flash_gpu, "gpu_reason", lambda shapes, platform: None)
    for platform in ("cuda", "rocm"):
        assert flash.BACKEND.supports(spec, _shapes(alibi_slopes=True), platform) is None


def test_wrong_slopes_shape_raises(rng):
    args = make_args(rng, kind="causal")._replace(bias=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match=r"bias: ALiBi slopes must have shape \[h\] = \(4,\)"):
        flash.BACKEND.attention(alibi_spec("causal"), args, 0.5)
