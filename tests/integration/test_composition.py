"""jdls.wrap among other optax transformations and in a Flax TrainState; finding its state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import INF, NAN, assert_bitwise_equal, loss_scale_of, random_like, run_steps
from flax.training import train_state

import jdls

PARAMS = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5])}


def grads(seed):
    return random_like(seed, PARAMS)


def bad_grads(seed, value=INF):
    g = grads(seed)
    g["w"] = g["w"].at[0].set(value)
    return g


def run(tx, seq, params=PARAMS):
    """Apply ``tx`` to a sequence of gradients under jit; return params and state."""
    return run_steps(tx, seq, params)


# --------------------------------------------------------------------------------------------
# optax.chain and optax.named_chain.
# --------------------------------------------------------------------------------------------


def test_chain_and_named_chain():
    sched = optax.linear_schedule(1.0, 0.1, 4)
    for tx in (
        optax.chain(
            jdls.clip(1.0), jdls.wrap(optax.sgd(sched), jdls.DynamicScale()), optax.scale(0.5)
        ),
        optax.named_chain(
            ("clip", jdls.clip(1.0)), ("opt", jdls.wrap(optax.sgd(sched), jdls.DynamicScale()))
        ),
    ):
        p_bad, s_bad = run(tx, [grads(0), bad_grads(1), grads(2)])
        p_ref, _ = run(tx, [grads(0), grads(2)])
        assert_bitwise_equal(p_bad, p_ref)
        assert loss_scale_of(s_bad) == 2.0**14
        assert int(jdls.stats(s_bad).skipped_steps) == 1


def test_schedule_in_a_chain_inside_wrap_does_not_advance_on_skips():
    inner = optax.chain(
        optax.scale_by_adam(), optax.scale_by_schedule(optax.cosine_decay_schedule(1.0, 5))
    )
    tx = jdls.wrap(inner, jdls.DynamicScale())
    p_bad, s_bad = run(tx, [grads(0), bad_grads(1, NAN), bad_grads(2), grads(3)])
    p_ref, s_ref = run(tx, [grads(0), grads(3)])
    assert_bitwise_equal(p_bad, p_ref)
    assert_bitwise_equal(s_bad.inner_state, s_ref.inner_state)
    assert int(s_bad.inner_state[1].count) == 2


# --------------------------------------------------------------------------------------------
# optax.MultiSteps, outside and inside the wrap.
# --------------------------------------------------------------------------------------------


def test_wrap_inside_multisteps_keeps_the_scale_over_a_window():
    tx = optax.MultiSteps(jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(64.0)), 3)
    step = jax.jit(tx.update)
    state = tx.init(PARAMS)
    seen = []
    seq = [grads(0), grads(1), grads(2), grads(3), bad_grads(4), grads(5)]
    for g in seq:
        updates, state = step(g, state, PARAMS)
        seen.append((loss_scale_of(state), int(state.inner_opt_state.scale.state.counter)))
    # The wrap sees one (averaged) gradient per window: the scale changes only at its end.
    assert seen == [(64, 0), (64, 0), (64, 1), (64, 1), (64, 1), (32, 0)]
    for u in jax.tree_util.tree_leaves(updates):  # the window with an inf was skipped
        assert np.all(np.asarray(u) == 0)
    assert bool(jdls.stats(state).skipped)
    assert int(state.gradient_step) == 2
    # The catch of this order (docs/optax.md): optax resets its accumulator by multiplying
    # it by 0, and 0 * inf is NaN, so every later window is skipped as well.
    for g in [grads(6), grads(7), grads(8)]:
        updates, state = step(g, state, PARAMS)
    assert bool(jdls.stats(state).skipped) and int(jdls.stats(state).skipped_steps) == 2


def test_multisteps_inside_wrap_skips_micro_batches():
    """A non-finite micro-batch is left out of the accumulation; the window just takes one
    more micro-batch, and the result is the one without the bad micro-batches."""
    ms = optax.MultiSteps(optax.adam(0.1), 2)
    tx = jdls.wrap(ms, jdls.DynamicScale(64.0))
    seq = [grads(0), bad_grads(1), grads(2), grads(3), bad_grads(4, NAN), grads(5)]
    p_bad, s_bad = run(tx, seq)
    p_ref, s_ref = run(ms.gradient_transformation(), [grads(0), grads(2), grads(3), grads(5)])
    assert_bitwise_equal(p_bad, p_ref)
    assert_bitwise_equal(s_bad.inner_state, s_ref)
    assert int(s_bad.inner_state.gradient_step) == 2
    assert loss_scale_of(s_bad) == 16.0  # adjusted on every micro-batch


# --------------------------------------------------------------------------------------------
# optax.inject_hyperparams, outside and inside the wrap.
# --------------------------------------------------------------------------------------------


def test_wrap_inside_inject_hyperparams():
    tx = optax.inject_hyperparams(
        lambda learning_rate: jdls.wrap(optax.sgd(learning_rate), jdls.DynamicScale())
    )(learning_rate=0.5)
    params, state = run(tx, [grads(0), bad_grads(1)])
    np.testing.assert_allclose(params["w"], PARAMS["w"] - 0.5 * grads(0)["w"], rtol=1e-6)
    assert loss_scale_of(state) == 2.0**14 and bool(jdls.stats(state).skipped)
    state.hyperparams["learning_rate"] = jnp.asarray(0.0)
    updates, _ = jax.jit(tx.update)(grads(2), state, params)
    assert float(jnp.max(jnp.abs(updates["w"]))) == 0.0


def test_inject_hyperparams_inside_wrap():
    sched = optax.exponential_decay(0.1, 1, 0.5)
    tx = jdls.wrap(optax.inject_hyperparams(optax.adam)(learning_rate=sched), jdls.DynamicScale())
    p_bad, s_bad = run(tx, [grads(0), bad_grads(1), grads(2), bad_grads(3, -INF)])
    p_ref, s_ref = run(tx, [grads(0), grads(2)])
    assert_bitwise_equal(p_bad, p_ref)
    assert_bitwise_equal(s_bad.inner_state, s_ref.inner_state)
    assert float(s_bad.inner_state.hyperparams["learning_rate"]) == float(sched(1))


# --------------------------------------------------------------------------------------------
# optax.multi_transform, outside and inside the wrap.
# --------------------------------------------------------------------------------------------


LABELS = {"w": "main", "b": "frozen"}


def test_wrap_around_multi_transform():
    inner = optax.multi_transform({"main": optax.adam(0.1), "frozen": optax.set_to_zero()}, LABELS)
    tx = jdls.wrap(inner, jdls.DynamicScale())
    # An inf in the frozen part still skips the whole step.
    frozen_bad = grads(1)
    frozen_bad["b"] = frozen_bad["b"].at[0].set(INF)
    p_bad, s_bad = run(tx, [grads(0), frozen_bad, grads(2)])
    p_ref, s_ref = run(tx, [grads(0), grads(2)])
    assert_bitwise_equal(p_bad, p_ref)
    assert_bitwise_equal(s_bad.inner_state, s_ref.inner_state)


def test_wrap_inside_multi_transform():
    tx = optax.multi_transform(
        {"main": jdls.wrap(optax.sgd(1.0), jdls.DynamicScale()), "frozen": optax.set_to_zero()},
        LABELS,
    )
    params, state = run(tx, [bad_grads(0)])
    assert_bitwise_equal(params, PARAMS)
    assert loss_scale_of(state) == 2.0**14


def test_two_wraps_are_ambiguous():
    tx = optax.multi_transform(
        {
            "main": jdls.wrap(optax.sgd(1.0), jdls.DynamicScale()),
            "frozen": jdls.wrap(optax.sgd(1.0), jdls.DynamicScale()),
        },
        LABELS,
    )
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"found 2 jdls.wrap states \(at .*'frozen'.*'main'"):
        jdls.get_scale(state)
    with pytest.raises(ValueError, match="found 2"):
        jdls.stats(state)


# --------------------------------------------------------------------------------------------
# A Flax TrainState.
# --------------------------------------------------------------------------------------------


def test_flax_train_state():
    state = train_state.TrainState.create(
        apply_fn=lambda p, x: p["w"] @ x,
        params=PARAMS,
        tx=jdls.wrap(optax.adam(0.1), jdls.DynamicScale()),
    )
    assert jdls.get_scale(state) is jdls.get_scale(state.opt_state)

    @jax.jit
    def train_step(state, g):
        return state.apply_gradients(grads=g), jdls.get_scale(state).loss_scale

    state, _ = train_step(state, grads(0))
    after_one = state.params
    state, _ = train_step(state, bad_grads(1))
    assert_bitwise_equal(state.params, after_one)
    assert bool(jdls.stats(state).skipped)
    assert loss_scale_of(state) == 2.0**14
    assert int(state.step) == 2  # Flax counts every call, taken or skipped
    assert int(state.opt_state.inner_state[0].count) == 1

    new = jdls.set_scale(state, jdls.DynamicScale(8.0))
    assert isinstance(new, train_state.TrainState) and loss_scale_of(new) == 8.0
    assert_bitwise_equal(new.params, state.params)
    new, _ = train_step(new, grads(2))
    assert loss_scale_of(new) == 8.0


# --------------------------------------------------------------------------------------------
# Finding and replacing the wrap's scale: get_scale, set_scale.
# --------------------------------------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match="found no jdls.wrap state"):
        jdls.get_scale(optax.adam(0.1).init(PARAMS))
    with pytest.raises(ValueError, match="found no jdls.wrap state"):
        jdls.set_scale({}, jdls.DynamicScale())
    state = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale()).init(PARAMS)
    with pytest.raises(TypeError, match="must be a jdls loss scale"):
        jdls.set_scale(state, 1024.0)


def test_restore_a_pytorch_scaler():
    sd = {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": 2,
    }
    tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.sgd(1.0), jdls.DynamicScale()))
    state = jdls.set_scale(tx.init(PARAMS), jdls.presets.from_pytorch_state_dict(sd))
    _, state = jax.jit(tx.update)(grads(0), state, PARAMS)
    assert loss_scale_of(state) == 2048.0  # the third finite step in a row: growth
    assert jdls.presets.to_pytorch_state_dict(jdls.get_scale(state)) == {
        **sd,
        "scale": 2048.0,
        "_growth_tracker": 0,
    }


def test_set_under_jit():
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())

    @jax.jit
    def halve(state):
        scale = jdls.get_scale(state)
        return jdls.set_scale(state, scale.replace(loss_scale=scale.loss_scale / 2))

    assert loss_scale_of(halve(tx.init(PARAMS))) == 2.0**14
