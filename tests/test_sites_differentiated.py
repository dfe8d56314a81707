"""A site differentiated through without its own state drops its measurement: jdls says so
(``jdls.SiteNotDifferentiated``, while tracing), and a plain ``nnx.Optimizer``, which would
drop the measurements that ``jdls.nnx.value_and_grad`` returns, meets an error naming
``jdls.nnx.Optimizer``. jdls's own steps differentiate every site and warn nothing."""

from __future__ import annotations

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from _helpers import maybe_jit, with_and_without_jit
from flax import nnx

import jdls
import jdls.nnx
from jdls import fp8


def _caught(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [w for w in caught if issubclass(w.category, jdls.SiteNotDifferentiated)]


def _probe_loss(w, site):
    return jnp.sum(jdls.apply_site(jnp.tanh(w * 2.0), site) ** 2)


@with_and_without_jit
def test_a_probe_closed_over_warns_and_a_differentiated_one_does_not(jit):
    site = jdls.Site(jdls.Probe())
    w = jnp.array([0.5, -1.0])
    closed = maybe_jit(jax.grad(functools.partial(_probe_loss, site=site)), jit)
    grads, caught = _caught(closed, w)
    assert len(caught) == 1
    assert "a Probe site is differentiated through, but not with respect to its own state" in str(
        caught[0].message
    )
    assert "jdls.nnx.value_and_grad" in str(caught[0].message)
    both = maybe_jit(jax.grad(_probe_loss, (0, 1)), jit)
    (grads_both, measured), caught = _caught(both, w, site)
    assert caught == []
    assert float(jdls.Telemetry.of({"p": measured}).uses[0]) == 1.0
    assert jnp.array_equal(grads, grads_both)  # the watch changes no gradient


def test_an_evaluation_and_a_gradient_of_the_inputs_alone_are_not_a_step():
    """No differentiation, no warning; the warning is silenced as any warning is."""
    site = jdls.Site(jdls.Probe())
    _, caught = _caught(_probe_loss, jnp.ones(2), site)
    assert caught == []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=jdls.SiteNotDifferentiated)
        warnings.filterwarnings("ignore", category=jdls.SiteNotDifferentiated)
        jax.grad(_probe_loss)(jnp.ones(2), site)


class _Nnx(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 16, dot_general=fp8.nnx.DotGeneral(fp8.DelayedScaling(4)), rngs=rngs)

    def __call__(self, x):
        return self.a(x)


def _x():
    return jnp.full((4, 8), 3.0)


def _history(model):
    return model.a.dot_general.site.get_value().value.lhs.history[:2].tolist()


def test_nnx_grad_of_the_params_alone_warns_on_an_fp8_model():
    """nnx.grad's default (nnx.Param) leaves the FP8 sites out: the scale would never move."""
    model = _Nnx(nnx.Rngs(0))
    _, caught = _caught(nnx.grad(lambda m: jnp.mean(m(_x()) ** 2)), model)
    assert len(caught) == 1
    assert "an FP8 site" in str(caught[0].message)
    assert "jdls.nnx.Optimizer" in str(caught[0].message)


@pytest.mark.full  # about 5 s
def test_a_plain_nnx_optimizer_refuses_the_measurements_naming_jdls_nnx_optimizer():
    """nnx.Optimizer filters the gradients by nnx.Param: the measurements, SiteMeasurements
    (an nnx.Param too), reach the wrap with parameters that hold no sites, and the wrap's
    error names jdls.nnx.Optimizer, which takes them apart and updates the sites."""
    model = _Nnx(nnx.Rngs(0))
    plain = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    loss = lambda m: jnp.mean(m(_x()) ** 2)  # noqa: E731
    _, grads = jdls.nnx.value_and_grad(loss, jdls.get_scale(plain))(model)
    assert type(grads["a"]["dot_general"]["site"]) is jdls.nnx.SiteMeasurement
    with pytest.raises(ValueError, match=re.escape("use jdls.nnx.Optimizer(model, tx")):
        plain.update(model, grads)
    assert _history(model) == [0.0, 0.0]

    optimizer = jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        _, grads = jdls.nnx.value_and_grad(loss, jdls.get_scale(optimizer))(model)
        optimizer.update(model, grads)

    _, caught = _caught(step, model, optimizer)
    assert caught == []
    assert _history(model) == [3.0, 0.0]  # the input's amax, recorded
    # the parameters' gradients alone (for logging) would leave the sites as they are
    _, grads = jdls.nnx.value_and_grad(loss, jdls.get_scale(optimizer))(model)
    with pytest.raises(ValueError, match="hold none of their measurements"):
        optimizer.update(model, nnx.state(grads, nnx.Not(jdls.nnx.SiteVariable)))


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, dot_general_cls=functools.partial(fp8.linen.DotGeneral))(x)


def test_linen_grad_of_the_params_alone_warns_and_the_train_state_does_not():
    model = _Linen()
    variables = model.init(jax.random.key(0), _x())
    params, sites = variables["params"], variables["jdls"]

    def loss(variables):
        return jnp.mean(model.apply(variables, _x()) ** 2)

    _, caught = _caught(jax.grad(lambda p: loss({"params": p, "jdls": sites})), params)
    assert len(caught) == 1 and "an FP8 site" in str(caught[0].message)
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply, params=params, tx=jdls.wrap(optax.sgd(0.1)), sites=sites
    )

    def step(state):
        grads = state.value_and_grad(loss)(state.variables)[1]
        return state.apply_gradients(grads=grads)

    _, caught = _caught(jax.jit(step), state)
    assert caught == []
