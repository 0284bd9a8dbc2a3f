"""The CUDA flash handlers and bias arrays, marked `gpu`: the kernels do not read a bias yet,
so the handlers refuse one with the reason (supports() refuses it first on the public path:
tests/test_flash_bias_host.py), and the calls without one run with the bias operand's
unread placeholder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from test_flash_host import make_args, make_spec

from fusedattn.ops.backends import flash, flash_ffi, xla

pytestmark = pytest.mark.gpu


def _call(rng, bias_type: int):
    """The forward and backward FFI calls of a causal bf16 d=64 call, past supports()."""
    args = make_args(rng, b=2, sq=70, skv=70, h=4, h_kv=2, d=64, dtype=jnp.bfloat16,
                     kind="causal")
    spec = make_spec("causal")
    static = flash._static(spec, 0.125, spec.softmax, False)._replace(bias_type=bias_type)
    bias = (jnp.asarray(rng.standard_normal((1, 4, 70, 70)), jnp.float32) if bias_type
            else None)
    h = args.q.shape[2]
    offset, seed = jnp.zeros((h,), jnp.float32), jnp.zeros((2,), jnp.uint32)
    return static, args, spec, offset, seed, bias


@pytest.mark.parametrize("bias_type", [1, 2])
def test_handlers_refuse_a_bias_with_the_reason(rng, bias_type):
    static, args, _, offset, seed, bias = _call(rng, bias_type)
    reason = (rf"bias arrays \(bias_type {bias_type}\) are not yet in the CUDA flash kernels "
              r"\(the host build serves them\)")
    with pytest.raises(Exception, match=reason):
        jax.block_until_ready(flash_ffi.forward_call(static, args.q, args.k, args.v, offset, seed,
                                                  tuple(args.tokens), bias=bias))
    o = jnp.zeros(args.q.shape, args.q.dtype)
    lse = jnp.zeros((2, 4, 70), jnp.float32)
    with pytest.raises(Exception, match=reason):
        jax.block_until_ready(flash_ffi.op(static, True)(
            args.q, args.k, args.v, *args.tokens, *flash_ffi.row_operands(offset, seed, offset),
            bias, o, lse, o))


def test_calls_without_a_bias_run(rng):
    """The unread placeholder passes the handlers' checks; the output matches xla."""
    static, args, spec, offset, seed, _ = _call(rng, 0)
    o, _ = flash_ffi.forward_call(static, args.q, args.k, args.v, offset, seed, tuple(args.tokens))
    want = xla.BACKEND.attention(spec, args, 0.125)
    assert_close(np.asarray(o, np.float32), np.asarray(want, np.float32), 2e-2, "o")
