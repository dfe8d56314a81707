"""jdls.fp8.states and replace_states: an FP8 model's state read and set in one call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_bitwise_equal
from flax import nnx

import jdls
from jdls import fp8


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(4, 8, dot_general=fp8.nnx.DotGeneral(rngs=rngs), rngs=rngs)
        self.down = nnx.Linear(8, 2, dot_general=fp8.nnx.DotGeneral(rngs=rngs), rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.tanh(self.up(x)))


def test_states_reads_an_nnx_model_by_path():
    model = _Model(nnx.Rngs(0))
    found = fp8.states(model)
    assert sorted(found) == ["down/dot_general/site", "up/dot_general/site"]
    assert_bitwise_equal(found["up/dot_general/site"], model.up.dot_general.site.get_value().value)
    assert sorted(fp8.states(nnx.state(model))) == sorted(found)


def test_replace_states_sets_an_nnx_model_through_its_state():
    model = _Model(nnx.Rngs(0))

    def half(path, state):
        scale = jnp.float32(0.5) if path.startswith("up") else state.grad.scale
        return state.replace(grad=state.grad.replace(scale=scale))

    nnx.update(model, fp8.replace_states(nnx.state(model), half))
    assert float(model.up.dot_general.site.get_value().value.grad.scale) == 0.5
    assert float(model.down.dot_general.site.get_value().value.grad.scale) == 1.0
    # and the model still runs and differentiates with the new state (nnx.grad's default
    # wrt leaves the sites out, which jdls warns about)
    with pytest.warns(jdls.SiteNotDifferentiated):
        grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 4)))))(model)
    assert jax.tree_util.tree_leaves(grads)


def test_stacked_sites_read_and_set_layer_by_layer():
    sites = {"blocks": fp8.init(fp8.DelayedScaling(4), stack=(3,))}
    (state,) = fp8.states(sites).values()
    assert state.lhs.scale.shape == (3,)

    def per_layer(path, state):
        return state.replace(lhs=state.lhs.replace(scale=jnp.array([1.0, 2.0, 4.0])))

    sites = fp8.replace_states(sites, per_layer)
    assert fp8.states(sites)["blocks"].lhs.scale.tolist() == [1.0, 2.0, 4.0]


def test_a_state_of_another_structure_says_what_to_return():
    sites = {"up": fp8.init(fp8.DelayedScaling(4))}
    with pytest.raises(ValueError, match=r"another structure for 'up'; return state.replace"):
        fp8.replace_states(sites, lambda path, state: state.grad)


def test_a_site_cast_to_float16_updates_in_float32():
    """A model cast to float16 whole (the site too): the update computes in float32, where
    an FP8 scale such as 0.027 / 57344 is a number (in float16, 57344 / 0.027 overflows and
    the scale would stay 1)."""
    site = jax.tree.map(lambda v: v.astype(jnp.float16), fp8.init(fp8.DelayedScaling(4)))
    x, w = jnp.full((2, 4), 0.01, jnp.float16), jnp.ones((4, 2), jnp.float16)

    def loss(s):
        return jnp.sum(fp8.dot_general(x, w, (((1,), (0,)), ((), ())), site=s) * 0.027)

    site = jdls.update_sites(site, jax.grad(loss)(site))
    assert site.value.grad.scale.dtype == jnp.float32
    assert float(site.value.grad.scale) == pytest.approx(
        float(np.float32(0.027) / np.float32(57344)), rel=1e-3
    )
