"""jdls.fp8 with gradient accumulation: a step's amax is the largest of its micro-batches'."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls
from jdls import fp8

DN = (((1,), (0,)), ((), ()))
SCALES = jnp.array([1.0, 30.0, 2.0])  # the second micro-batch has the largest inputs


def _loss(variables, batch):
    y = fp8.dot_general(batch["x"], variables["w"], DN, site=variables["site"])
    return jnp.mean((y - batch["t"]) ** 2)


def _micro_batches():
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (3, 4, 8)) * SCALES[:, None, None]
    return {"x": x, "t": jax.random.normal(k[1], (3, 4, 2))}


def _variables():
    return {"w": jnp.ones((8, 2)) * 0.1, "site": fp8.init(fp8.DelayedScaling(4))}


@pytest.mark.full
def test_accumulate_takes_the_maximum_of_the_micro_batches_measurements():
    variables, batches = _variables(), _micro_batches()
    _, grads, info = jdls.accumulate(_loss, jdls.StaticScale(1.0), variables, batches)
    assert int(info.kept) == 3
    meter = grads["site"].value.meter
    amaxes = [float(jnp.max(jnp.abs(batches["x"][i]))) for i in range(3)]
    assert float(meter.lhs.amax) == max(amaxes)
    # the parameters' gradient is still the mean over the micro-batches
    each = [
        jax.grad(_loss)(variables, jax.tree.map(lambda b, i=i: b[i], batches)) for i in range(3)
    ]
    np.testing.assert_allclose(grads["w"], sum(g["w"] for g in each) / 3, rtol=1e-6)
    site = jdls.update_sites(variables["site"], grads["site"])
    assert site.value.lhs.history.tolist() == [max(amaxes), 0.0, 0.0, 0.0]


@pytest.mark.full  # about 5 s; MultiSteps one micro-batch at a time stays in the quick run
def test_multisteps_one_micro_batch_at_a_time_gives_the_same_state_as_accumulate():
    variables, batches = _variables(), _micro_batches()
    _, grads, _ = jdls.accumulate(_loss, jdls.StaticScale(1.0), variables, batches)
    expected = jdls.update_sites(variables["site"], grads["site"])

    tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=3), jdls.StaticScale(1.0))
    params, site = {"w": variables["w"]}, variables["site"]
    opt_state = tx.init(params)
    for i in range(3):
        batch = jax.tree.map(lambda b, i=i: b[i], batches)
        g = jax.grad(_loss)({"w": params["w"], "site": site}, batch)
        _, opt_state = tx.update({"w": g["w"]}, opt_state, params)
        site = jdls.update_sites(site, g["site"], fp8.step_applied(opt_state))
        if i < 2:  # before the step is applied, the state waits
            assert_bitwise_equal(site.value.lhs.history, expected.value.lhs.history * 0)
    for role in ("lhs", "rhs"):
        assert_bitwise_equal(getattr(site.value, role), getattr(expected.value, role))
    assert float(site.value.pending.lhs.amax) == -np.inf


@pytest.mark.full  # about 3 s
def test_a_skipped_step_carries_its_finite_measurements_to_the_next():
    recipe = fp8.DelayedScaling(4)
    site = fp8.init(recipe)
    x = jnp.full((2, 8), 5.0)

    def grads_of(x, ct):
        _, vjp = jax.vjp(lambda s: fp8.dot_general(x, jnp.ones((8, 2)), DN, site=s), site)
        return vjp(ct)[0]

    # a step whose output gradient overflowed: skipped; the input amax 5 waits
    site = jdls.update_sites(site, grads_of(x, jnp.full((2, 2), jnp.inf)), False)
    assert site.value.lhs.history.tolist() == [0.0] * 4
    assert float(site.value.pending.lhs.amax) == 5.0
    assert float(site.value.pending.grad.amax) == -np.inf  # the inf never waits
    # the next (applied) step records the larger of the two
    site = jdls.update_sites(site, grads_of(x * 0.5, jnp.ones((2, 2))), True)
    assert site.value.lhs.history.tolist() == [5.0, 0.0, 0.0, 0.0]
    assert site.value.grad.history.tolist() == [1.0, 0.0, 0.0, 0.0]


def _four_micro_batches():
    k = jax.random.split(jax.random.key(1), 2)
    scales = jnp.array([1.0, 30.0, 7.0, 2.0])  # steps: max of (1, 30), max of (7, 2)
    x = jax.random.normal(k[0], (4, 4, 8)) * scales[:, None, None]
    return {"x": x, "t": jax.random.normal(k[1], (4, 4, 2))}


def _expected_history(batches):
    amax = [float(jnp.max(jnp.abs(batches["x"][i]))) for i in range(4)]
    return sorted([max(amax[0], amax[1]), max(amax[2], amax[3])])


@with_and_without_jit
@pytest.mark.full  # about 7 s; the wrap with MultiSteps stays in the quick run
def test_train_state_with_multisteps_records_one_amax_per_applied_step(jit):
    """jdls.linen.TrainState with jdls.wrap(optax.MultiSteps(..., 2)): the site is updated with
    "the step was applied", so each applied step enters the history once, as the maximum of
    its micro-batches."""
    batches = _four_micro_batches()
    tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), jdls.StaticScale(1.0))
    state = jdls.linen.TrainState.create(
        apply_fn=None,
        params={"w": jnp.ones((8, 2)) * 0.1},
        tx=tx,
        sites={"site": fp8.init(fp8.DelayedScaling(4))},
    )

    def loss_fn(variables, batch):
        return _loss({"w": variables["params"]["w"], "site": variables["jdls"]["site"]}, batch)

    def step(state, batch):
        _, grads = state.value_and_grad(loss_fn)(state.variables, batch)
        return state.apply_gradients(grads=grads)

    step = jax.jit(step) if jit else step
    histories = []
    for i in range(4):
        state = step(state, jax.tree.map(lambda b, i=i: b[i], batches))
        histories.append(state.sites["site"].value.lhs.history)
    recorded = [np.count_nonzero(np.asarray(h)) for h in histories]
    assert recorded == [0, 1, 1, 2]  # one entry per applied step, none per micro-batch
    history = np.asarray(histories[-1])
    assert sorted(history[history != 0].tolist()) == _expected_history(batches)


@pytest.mark.full  # about 3 s; the MultiSteps-in-the-wrap test stays quick
def test_a_hand_written_step_with_multisteps_records_one_amax_per_applied_step():
    """The hand-written step of docs/fp8.md: sites kept apart from the parameters and
    updated with ``jdls.fp8.step_applied(opt_state)``, right with and without MultiSteps
    (``jdls.stats(opt_state).finite`` would record every micro-batch)."""
    batches = _four_micro_batches()
    tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), jdls.StaticScale(1.0))
    params, sites = {"w": jnp.ones((8, 2)) * 0.1}, {"site": fp8.init(fp8.DelayedScaling(4))}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, sites, opt_state, batch):
        loss_fn = lambda p, s: _loss({"w": p["w"], "site": s["site"]}, batch)  # noqa: E731
        grads, measured = jax.grad(loss_fn, argnums=(0, 1))(params, sites)
        updates, opt_state = tx.update(grads, opt_state, params)
        sites = jdls.update_sites(sites, measured, jdls.fp8.step_applied(opt_state))
        return optax.apply_updates(params, updates), sites, opt_state

    recorded = []
    for i in range(4):
        params, sites, opt_state = step(
            params, sites, opt_state, jax.tree.map(lambda b, i=i: b[i], batches)
        )
        recorded.append(np.count_nonzero(np.asarray(sites["site"].value.lhs.history)))
    assert recorded == [0, 1, 1, 2]
    history = np.asarray(sites["site"].value.lhs.history)
    assert sorted(history[history != 0].tolist()) == _expected_history(batches)


@pytest.mark.full  # 5 s; accumulation with FP8 sites is quick in test_accumulate_with_a_dropped_micro_batch_records_the_kept_ones
def test_wrap_with_multisteps_updates_sites_in_params_once_per_applied_step():
    """The site among the parameters given to jdls.wrap(optax.MultiSteps(...)) (the Equinox
    path): the wrap updates it with "the step was applied"."""
    batches = _four_micro_batches()
    tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), jdls.StaticScale(1.0))
    params = _variables()
    opt_state = tx.init(params)
    counts = []
    for i in range(4):
        grads = jax.grad(_loss)(params, jax.tree.map(lambda b, i=i: b[i], batches))
        updates, opt_state = tx.update(grads, opt_state, params)
        assert bool(jdls.fp8.step_applied(opt_state)) == (i % 2 == 1)
        params = jdls.apply_updates(params, updates, opt_state)
        counts.append(np.count_nonzero(np.asarray(params["site"].value.lhs.history)))
    assert counts == [0, 1, 1, 2]
    history = np.asarray(params["site"].value.lhs.history)
    assert sorted(history[history != 0].tolist()) == _expected_history(batches)


@with_and_without_jit
def test_accumulate_with_a_dropped_micro_batch_records_the_kept_ones(jit):
    """One micro-batch overflows (an inf in its input) and is dropped, the step is applied
    (max_dropped=1): the input's history records the largest amax of the kept micro-batches,
    as the same micro-batches through optax.MultiSteps one at a time do; the meter still
    shows the inf."""
    x = jax.random.normal(jax.random.key(0), (3, 2, 8)).at[1, 0, 0].set(jnp.inf)
    params = {"w": jnp.ones((8, 2)) * 0.1, "site": fp8.init(fp8.DelayedScaling(4))}
    tx = jdls.wrap(optax.sgd(0.0))

    def loss_fn(p, x):
        return jnp.mean(fp8.dot_general(x, p["w"], DN, site=p["site"]) ** 2)

    def step(params, opt_state):
        scale = jdls.get_scale(opt_state)
        _, grads, info = jdls.accumulate(loss_fn, scale, params, x, max_dropped=1)
        _, opt_state = tx.update({"w": grads["w"]}, opt_state, {"w": params["w"]})
        site = jdls.update_sites(params["site"], grads["site"], fp8.step_applied(opt_state))
        return site, info

    site, info = maybe_jit(step, jit)(params, tx.init({"w": params["w"]}))
    assert int(info.dropped) == 1
    kept = float(jnp.max(jnp.abs(x[jnp.array([0, 2])])))
    assert float(site.value.lhs.history[0]) == kept
    assert float(site.value.meter.lhs.amax) == np.inf
