"""Shared inputs and checks of the layer tests (test_layers_*.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.configs import attention_config

B, S, F, H = 2, 6, 16, 4  # batch, sequence, features, heads
D = F // H
X = jax.random.normal(jax.random.key(0), (B, S, F), jnp.float32)
Y = jax.random.normal(jax.random.key(1), (B, 4, 12), jnp.float32)  # a cross-attention source
TOL = dict(rtol=2e-5, atol=2e-5)


def config(**changes):
    """attention_config() with top-level keys changed."""
    c = attention_config()
    for key, value in changes.items():
        c[key] = value
    return c


def close(a, b, **tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               **(tol or TOL))
