"""The layers' FP8 state (config.fp8) and max-logit outputs: linen, NNX and Equinox."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_config, random_array
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state
from test_max_logit import reference_max_logit

from fusedattn.layers import equinox as eqx_layers
from fusedattn.layers import linen, nnx as nnx_layers

FP8 = {"enabled": True}


def _linen_qk(params, x):
    q = jnp.einsum("bsf,fhd->bshd", x, params["query"]["kernel"]) + params["query"]["bias"]
    k = jnp.einsum("bsf,fhd->bshd", x, params["key"]["kernel"]) + params["key"]["bias"]
    return q, k


def test_linen_state_updates_in_a_train_step_through_apply_gradients(rng):
    x = random_array(rng, (2, 16, 32))
    model = linen.MultiHeadAttention(num_heads=4, config=make_config(fp8=FP8))
    variables = model.init(jax.random.key(0), x)
    meta = variables[OVERWRITE_WITH_GRADIENT]
    assert meta["fp8_scale"].shape == (10,) and meta["fp8_amax_history"].shape == (16, 10)
    np.testing.assert_array_equal(np.asarray(meta["fp8_amax_history"]), 0.0)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.sgd(1e-2))

    @jax.jit
    def step(state):
        grads = jax.grad(lambda v: jnp.sum(state.apply_fn(v, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    for calls in (1, 2):
        previous = state.params
        state = step(state)
        history = np.asarray(state.params[OVERWRITE_WITH_GRADIENT]["fp8_amax_history"])
        assert np.all(history[:calls] > 0) and np.all(history[calls:] == 0), history[:3]
        moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()),
                             state.params["params"], previous["params"])
        assert min(jax.tree.leaves(moved)) > 0
    q, _ = _linen_qk(previous["params"], x)  # what the last step's forward saw
    np.testing.assert_allclose(history[0, 0], float(jnp.abs(q).max()), rtol=1e-5)


def test_linen_mutable_apply_records_the_forward_and_sows_max_logit(rng):
    x = random_array(rng, (2, 12, 32))
    model = linen.MultiHeadAttention(num_heads=4, config=make_config(fp8=FP8),
                                     return_max_logit=True)
    variables = model.init(jax.random.key(1), x)
    _, updated = model.apply(variables, x, mutable=[OVERWRITE_WITH_GRADIENT, "intermediates"])
    history = np.asarray(updated[OVERWRITE_WITH_GRADIENT]["fp8_amax_history"])
    assert np.all(history[0, :5] > 0) and np.all(history[0, 5:] == 0)
    (largest,) = updated["intermediates"]["max_logit"]
    assert largest.shape == (4,)
    q, k = _linen_qk(variables["params"], x)
    # FP8 scores: within FP8 rounding of the exact ones.
    np.testing.assert_allclose(np.asarray(largest), reference_max_logit(q, k, mask="causal"),
                               rtol=0.15)


def test_linen_max_logit_without_fp8_is_exact(rng):
    x = random_array(rng, (2, 12, 32))
    model = linen.MultiHeadAttention(num_heads=4, config=make_config(mask="causal"),
                                     return_max_logit=True)
    variables = model.init(jax.random.key(2), x)
    _, sown = model.apply(variables, x, mutable=["intermediates"])
    q, k = _linen_qk(variables["params"], x)
    np.testing.assert_allclose(np.asarray(sown["intermediates"]["max_logit"][0]),
                               reference_max_logit(q, k, mask="causal"), rtol=1e-5)


def test_nnx_state_updates_through_apply_fp8_gradients(rng):
    x = random_array(rng, (2, 16, 32))
    model = nnx_layers.MultiHeadAttention(4, 32, config=make_config(fp8=FP8), decode=False,
                                          rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        diff = nnx.DiffState(0, (nnx.Param, nnx_layers.Fp8Meta))
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=diff)(model)
        optimizer.update(model, nnx.filter_state(grads, nnx.Param))
        nnx_layers.apply_fp8_gradients(model, grads)

    step(model, optimizer)
    step(model, optimizer)
    history = np.asarray(model.fp8_amax_history[...])
    assert np.all(history[:2] > 0) and np.all(history[2:] == 0), history[:3]
    scale = np.asarray(model.fp8_scale[...])
    np.testing.assert_allclose(scale[0], 448.0 / history[:, 0].max(), rtol=1e-5)


def test_nnx_max_logit_without_fp8_is_exact(rng):
    x = random_array(rng, (2, 12, 32))
    model = nnx_layers.MultiHeadAttention(4, 32, config=make_config(mask="causal"),
                                          decode=False, rngs=nnx.Rngs(3), return_max_logit=True)
    _, intermediates = nnx.capture(model, nnx.Intermediate)(x)
    (largest,) = jax.tree.leaves(intermediates["max_logit"])
    q, k = (layer(x) for layer in (model.query, model.key))
    np.testing.assert_allclose(np.asarray(largest), reference_max_logit(q, k, mask="causal"),
                               rtol=1e-5)


def test_equinox_returns_max_logit_on_request_and_refuses_fp8(rng):
    x = random_array(rng, (3, 10, 16))
    layer = eqx_layers.MultiheadAttention(2, 16, config=make_config(mask="causal"),
                                          key=jax.random.key(4))
    out, largest = jax.vmap(lambda e: layer(e, return_max_logit=True))(x)
    assert out.shape == (3, 10, 16) and largest.shape == (3, 2)
    q = jax.vmap(layer.query_proj)(x.reshape(-1, 16)).reshape(3, 10, 2, 8)
    k = jax.vmap(layer.key_proj)(x.reshape(-1, 16)).reshape(3, 10, 2, 8)
    np.testing.assert_allclose(np.asarray(largest).max(axis=0),
                               reference_max_logit(q, k, mask="causal"), rtol=1e-5)
    with pytest.raises(ValueError, match="config.fp8.enabled: the Equinox layer"):
        eqx_layers.MultiheadAttention(2, 16, config=make_config(fp8=FP8), key=jax.random.key(5))


def test_explicit_mask_with_fp8_says_to_use_the_config_mask(rng):
    x = random_array(rng, (1, 8, 16))
    model = linen.MultiHeadAttention(num_heads=2, config=make_config(fp8=FP8))
    variables = model.init(jax.random.key(6), x)
    with pytest.raises(ValueError, match="mask: an explicit mask .* FP8 attention"):
        model.apply(variables, x, mask=jnp.ones((1, 1, 8, 8), bool))
