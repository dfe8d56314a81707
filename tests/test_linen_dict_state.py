"""A linen step with a train state of the user's own (a dict): jdls.linen.value_and_grad and
jdls.linen.apply_gradients do exactly what jdls.linen.TrainState does, sites included."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import maybe_jit, with_and_without_jit
from flax.core import FrozenDict
from test_linen_sites import Scanned

import jdls


def _x(bad: bool = False):
    x = jax.random.normal(jax.random.key(1), (16, 4))
    return x.at[0, 0].set(jnp.inf) if bad else x


def _models():
    return {
        "probes": jdls.linen.probes(Scanned()),
        "layer_scales": jdls.linen.layer_scales(Scanned(), jdls.AdaptiveScale(2.0**8)),
        "both": jdls.linen.probes(jdls.linen.layer_scales(Scanned(), jdls.AdaptiveScale(2.0**8))),
        "fp8": nn.Dense(
            3, dot_general_cls=lambda: jdls.fp8.linen.DotGeneral(jdls.fp8.DelayedScaling(4))
        ),
    }


def _same(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@with_and_without_jit
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("both", marks=pytest.mark.full),
        pytest.param("probes", marks=pytest.mark.full),
        pytest.param("layer_scales", marks=pytest.mark.full),  # about 6 s
        pytest.param("fp8", marks=pytest.mark.full),
    ],
)
def test_a_dict_state_trains_as_the_train_state(name: str, jit: bool) -> None:
    """Three steps, the second with an inf in the batch (skipped): parameters, sites and
    optimizer state bit for bit those of jdls.linen.TrainState."""
    model = _models()[name]
    variables = model.init(jax.random.key(0), _x())
    tx = jdls.wrap(optax.adam(1e-2), jdls.DynamicScale(2.0**10, growth_interval=2))
    state = {"variables": variables, "opt_state": tx.init(variables["params"]), "step": 0}
    ts = jdls.linen.TrainState.create(
        apply_fn=model.apply, params=variables["params"], sites=variables["jdls"], tx=tx
    )

    def loss_fn(v, x):
        return jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2)

    def dict_step(state, x):
        scale = jdls.get_scale(state["opt_state"])
        loss, grads = jdls.linen.value_and_grad(loss_fn, scale)(state["variables"], x)
        variables, opt_state = jdls.linen.apply_gradients(
            tx, state["variables"], grads, state["opt_state"]
        )
        return {"variables": variables, "opt_state": opt_state, "step": state["step"] + 1}, loss

    def ts_step(ts, x):
        loss, grads = ts.value_and_grad(loss_fn)(ts.variables, x)
        return ts.apply_gradients(grads=grads), loss

    dict_step, ts_step = maybe_jit(dict_step, jit), maybe_jit(ts_step, jit)
    for bad in (False, True, False):
        state, loss = dict_step(state, _x(bad))
        ts, ts_loss = ts_step(ts, _x(bad))
        np.testing.assert_array_equal(loss, ts_loss)
        _same(state["variables"]["params"], ts.params)
        _same(state["variables"]["jdls"], ts.sites)
        _same(state["opt_state"], ts.opt_state)
        assert bool(jdls.stats(state["opt_state"]).finite) is not bad
    assert int(jdls.stats(state["opt_state"]).skipped_steps) == 1


def test_without_sites_the_gradients_are_the_parameters_or_the_variables() -> None:
    model = nn.Dense(2)
    variables = FrozenDict(model.init(jax.random.key(0), jnp.ones((4, 3))))
    tx = jdls.wrap(optax.sgd(0.5), jdls.StaticScale(8.0))
    opt_state = tx.init(variables["params"])

    def loss_fn(v):
        return jnp.sum(model.apply(v, jnp.ones((4, 3))) ** 2)

    loss, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(variables)
    ref_loss, ref = jax.value_and_grad(loss_fn)(variables)
    assert float(loss) == float(ref_loss)
    _same(grads, ref)
    new, _ = jdls.linen.apply_gradients(tx, variables, grads, opt_state)
    assert isinstance(new, FrozenDict)  # the type given comes back
    bare, _ = jdls.linen.apply_gradients(tx, variables, grads["params"], opt_state)
    _same(new, bare)  # {"params": ...} or the parameters' gradients: one step
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, variables["params"], ref["params"])
    _same(new["params"], expected)


@pytest.mark.full  # about 3 s
def test_a_nan_loss_is_told_from_an_overflow_when_the_loss_is_passed() -> None:
    """apply_gradients(..., value=loss) and TrainState.apply_gradients(value=loss): a NaN
    batch is FORWARD (a loop's guard stops), an overflow of the scaled gradients GRADIENTS
    (handled)."""
    model = jdls.linen.probes(nn.Sequential([nn.Dense(4), nn.Dense(1)]))
    x = jnp.ones((2, 3))
    variables = model.init(jax.random.key(0), x)
    tx = jdls.wrap(optax.sgd(0.1), jdls.StaticScale(2.0**15))
    opt_state = tx.init(variables["params"])
    ts = jdls.linen.TrainState.create(
        apply_fn=model.apply, params=variables["params"], sites=variables["jdls"], tx=tx
    )

    def loss_fn(v, x, weight):
        return jnp.sum(model.apply(v, x).astype(jnp.float16) * weight).astype(jnp.float32)

    for x_, weight, cause in ((x.at[0, 0].set(jnp.nan), 1.0, "FORWARD"), (x, 1e4, "GRADIENTS")):
        loss, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(
            variables, x_, weight
        )
        _, new_state = jdls.linen.apply_gradients(tx, variables, grads, opt_state, value=loss)
        assert jdls.skip_cause(new_state).name == cause
        assert jdls.skip_cause(new_state).handled is (cause == "GRADIENTS")
        loss, grads = ts.value_and_grad(loss_fn)(ts.variables, x_, weight)
        assert jdls.skip_cause(ts.apply_gradients(grads=grads, value=loss)).name == cause


@pytest.mark.full  # about 5 s
def test_other_collections_are_held_fixed_from_init_to_the_update() -> None:
    """The variables as model.init returns them, batch_stats included: value_and_grad
    differentiates params and sites only, apply_gradients passes batch_stats through."""

    class Norm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=True)(nn.Dense(3)(x)))

    model = jdls.linen.probes(Norm())
    x = jnp.arange(12.0).reshape(4, 3)
    variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params", "jdls", "batch_stats"}
    tx = jdls.wrap(optax.sgd(0.1))
    opt_state = tx.init(variables["params"])

    def loss_fn(v):
        return jnp.sum(model.apply(v, x) ** 2)

    _, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(variables)
    assert set(grads) == {"params", "jdls"}
    ref = jax.grad(loss_fn)(variables)["params"]
    _same(grads["params"], ref)
    new, _ = jdls.linen.apply_gradients(tx, variables, grads, opt_state)
    _same(new["batch_stats"], variables["batch_stats"])


@pytest.mark.full  # about 4 s
def test_other_collections_pass_through_and_can_be_kept_on_a_skipped_step() -> None:
    class Norm(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(1)(x)

    model = jdls.linen.probes(Norm())
    x = jnp.arange(12.0).reshape(4, 3)
    variables = model.init(jax.random.key(0), x)
    tx = jdls.wrap(optax.sgd(0.1))
    opt_state = tx.init(variables["params"])
    trained = {k: variables[k] for k in ("params", "jdls")}

    def loss_fn(v, stats, x):
        out, new = model.apply({**v, "batch_stats": stats}, x, mutable=["batch_stats"])
        return jnp.sum(out**2), new["batch_stats"]

    (_, stats), grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state), has_aux=True)(
        trained, variables["batch_stats"], x.at[0, 0].set(jnp.nan)
    )
    new, opt_state = jdls.linen.apply_gradients(tx, {**variables, **trained}, grads, opt_state)
    _same(new["batch_stats"], variables["batch_stats"])  # passed through as given
    kept = jdls.keep_if_skipped(opt_state, stats, variables["batch_stats"])
    _same(kept, variables["batch_stats"])  # skipped: the old statistics are kept
    _same(new["params"], variables["params"])


def test_mistakes_name_the_fix() -> None:
    model = jdls.linen.probes(nn.Sequential([nn.Dense(4), nn.Dense(1)]))
    variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
    tx = jdls.wrap(optax.sgd(0.1))
    opt_state = tx.init(variables["params"])
    grads = jax.tree.map(jnp.zeros_like, variables["params"])
    with pytest.raises(ValueError, match=r"jdls.linen.value_and_grad.*got \['params'\]"):
        jdls.linen.apply_gradients(tx, variables, {"params": grads}, opt_state)
    with pytest.raises(TypeError, match="model.init returns them"):
        jdls.linen.apply_gradients(tx, variables["params"], grads, opt_state)
    with pytest.raises(TypeError, match="argnum"):
        jdls.linen.value_and_grad(lambda v: 0.0, jdls.get_scale(opt_state), argnum=(0, 1))
    with pytest.raises(TypeError, match="argument 1 of the loss function"):
        jdls.linen.value_and_grad(lambda x, v: 0.0, jdls.get_scale(opt_state), argnum=1)(variables)


@with_and_without_jit
@pytest.mark.parametrize(
    "name",
    [pytest.param("probes", marks=pytest.mark.full), pytest.param("fp8", marks=pytest.mark.full)],
)  # about 4 s
def test_an_optimizer_initialised_on_the_variables_steps_as_on_the_parameters(name, jit):
    """``tx.init(variables)`` (the wrap keeps the sites apart) and ``tx.init(variables
    ["params"])`` give one training, bit for bit, over three steps with a skipped one; the
    guard's norm of all the gradients is the parameters' (the measurements count nothing)."""
    model = _models()[name]
    variables = model.init(jax.random.key(0), _x())
    tx = jdls.wrap(optax.adam(1e-2), jdls.DynamicScale(2.0**10, growth_interval=2))

    def step(variables, opt_state, x):
        loss_fn = lambda v: jnp.sum(model.apply(v, x) ** 2)  # noqa: E731
        loss, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(variables)
        norms = (optax.tree.norm(grads), optax.tree.norm(grads["params"]))
        variables, opt_state = jdls.linen.apply_gradients(
            tx, variables, grads, opt_state, value=loss
        )
        return variables, opt_state, norms

    step = maybe_jit(step, jit)
    runs = []
    for init_on in (variables["params"], variables):
        v, opt_state = variables, tx.init(init_on)
        for bad in (False, True, False):
            v, opt_state, (norm, param_norm) = step(v, opt_state, _x(bad))
            if not bad:
                assert float(norm) == float(param_norm)
        runs.append((v, jdls.stats(opt_state)))
    _same(runs[0], runs[1])
    assert int(runs[0][1].skipped_steps) == 1


class _WithNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.BatchNorm(use_running_average=True)(nn.Dense(4)(x)))


@pytest.mark.parametrize(
    "case",
    [
        # about 14 s; the no_sites case and the probes case of
        # test_an_optimizer_initialised_on_the_variables_steps_as_on_the_parameters stay quick
        pytest.param("frozen", marks=pytest.mark.full),
        "no_sites",
    ],
)
def test_the_variables_optimizer_takes_a_frozendict_and_a_model_without_sites(case):
    """``tx.init(variables)`` of a ``FrozenDict``, and of a model without sites
    (``{"params": ...}``), steps as ``tx.init(variables["params"])``, bit for bit."""
    model = jdls.linen.probes(Scanned()) if case == "frozen" else nn.Dense(3)
    variables = model.init(jax.random.key(0), _x())
    if case == "frozen":
        variables = FrozenDict(variables)
    tx = jdls.wrap(optax.adam(1e-2))
    runs = []
    for init_on in (variables["params"], variables):
        v, opt_state = variables, tx.init(init_on)
        for _ in range(2):
            loss_fn = lambda v: jnp.sum(model.apply(v, _x()) ** 2)  # noqa: E731
            loss, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(v)
            v, opt_state = jdls.linen.apply_gradients(tx, v, grads, opt_state, value=loss)
        assert type(v) is type(variables)
        runs.append(v)
    _same(runs[0], runs[1])


def test_an_optimizer_initialised_on_the_batch_stats_too_is_refused():
    model = jdls.linen.probes(_WithNorm())
    variables = model.init(jax.random.key(0), _x())
    tx = jdls.wrap(optax.adam(1e-2))
    opt_state = tx.init(variables)  # batch_stats included: the optimizer would train them
    loss_fn = lambda v: jnp.sum(model.apply(v, _x()) ** 2)  # noqa: E731
    _, grads = jdls.linen.value_and_grad(loss_fn, jdls.get_scale(opt_state))(variables)
    with pytest.raises(
        ValueError, match=r"\['batch_stats'\] included.*tx.init\(variables\['params'\]\)"
    ):
        jdls.linen.apply_gradients(tx, variables, grads, opt_state)
