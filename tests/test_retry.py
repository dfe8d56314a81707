"""``jdls.wrap(..., retries=N)`` with ``value_fn``: an overflowing step is recomputed at lower
scales inside the compiled step; forward NaNs are never retried; stats say why a step was
skipped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls

F16_MAX = 65504.0


def loss_fn(params, c):
    """``sum(w * c)`` in float16: the scaled backward is ``c * scale`` in float16, so it
    overflows at scale ``2**15`` when ``c >= 2`` and at ``2**14`` only when ``c >= 4``."""
    w = params["w"].astype(jnp.float16)
    return jnp.sum((w * c.astype(jnp.float16)).astype(jnp.float32))


def make_step(tx, jit=True):
    def step(params, opt_state, c):
        scale = jdls.get_scale(opt_state)
        _, grads = scale.value_and_grad(loss_fn)(params, c)
        updates, opt_state = tx.update(grads, opt_state, params, value_fn=lambda p: loss_fn(p, c))
        return optax.apply_updates(params, updates), opt_state

    return maybe_jit(step, jit)


def reference_step(params, opt_state, inner, scale, c):
    """The inner optimizer's step from this batch's gradients at ``scale``."""
    _, grads = scale.value_and_grad(loss_fn)(params, c)
    updates, inner_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), inner_state


@with_and_without_jit
def test_finite_step_is_unchanged_by_retries(jit):
    params = {"w": jnp.ones(3)}
    c = jnp.array([0.5, 1.0, 1.5])
    plain = jdls.wrap(optax.adam(0.1), jdls.DynamicScale())
    retrying = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(), retries=2)
    p1, s1 = make_step(plain, jit)(params, plain.init(params), c)
    p2, s2 = make_step(retrying, jit)(params, retrying.init(params), c)
    assert_bitwise_equal(p1, p2)
    assert_bitwise_equal(s1, s2)
    assert int(jdls.stats(s2).retries) == 0 and int(jdls.stats(s2).cause) == 0


@with_and_without_jit
def test_scale_caused_overflow_is_retried_and_applied_at_the_settled_scale(jit):
    params = {"w": jnp.ones(3)}
    c = jnp.array([3.0, 1.0, 0.5])  # overflows at 2**15, not at 2**14
    # sgd: adam's update can differ by an ulp between two XLA fusion contexts (docs/optax.md)
    inner = optax.sgd(0.1, momentum=0.9)
    tx = jdls.wrap(inner, jdls.DynamicScale(2.0**15, growth_interval=100), retries=2)
    state = tx.init(params)
    new_params, state = make_step(tx, jit)(params, state, c)

    stats = jdls.stats(state)
    assert bool(stats.finite) and int(stats.retries) == 1 and int(stats.retried_steps) == 1
    assert int(stats.cause) == jdls.SkipCause.NONE and int(stats.skipped_steps) == 0
    # The scale: one overflow (backoff to 2**14), then one finite step (counter 1).
    scale = jdls.get_scale(state)
    assert float(scale.loss_scale) == 2.0**14 and int(scale.state.counter) == 1
    # The update is, bit for bit, the inner step from the gradients at 2**14.
    settled = jdls.DynamicScale(2.0**14, growth_interval=100)
    ref_params, ref_inner = maybe_jit(lambda p, s: reference_step(p, s, inner, settled, c), jit)(
        params, inner.init(params)
    )
    assert_bitwise_equal(new_params, ref_params)
    assert_bitwise_equal(state.inner_state, ref_inner)


@with_and_without_jit
def test_overflow_left_after_the_retries_is_skipped_as_backward(jit):
    params = {"w": jnp.ones(3)}
    c = jnp.array([60000.0, 1.0, 1.0])  # overflows at every scale >= 2
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**15), retries=2)
    state = tx.init(params)
    new_params, new_state = make_step(tx, jit)(params, state, c)
    stats = jdls.stats(new_state)
    assert not bool(stats.finite) and int(stats.retries) == 2
    assert int(stats.cause) == jdls.SkipCause.BACKWARD
    assert_bitwise_equal(new_params, params)
    # Three overflowing feeds: 2**15 -> 2**14 -> 2**13 (the retries) -> 2**12.
    assert float(jdls.get_scale(new_state).loss_scale) == 2.0**12


@with_and_without_jit
def test_forward_nan_is_never_retried(jit):
    params = {"w": jnp.ones(3)}
    c = jnp.array([jnp.nan, 1.0, 1.0])
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**15), retries=3)
    state = tx.init(params)
    new_params, new_state = make_step(tx, jit)(params, state, c)
    stats = jdls.stats(new_state)
    assert not bool(stats.finite) and int(stats.retries) == 0
    assert int(stats.cause) == jdls.SkipCause.FORWARD and int(stats.retried_steps) == 0
    assert_bitwise_equal(new_params, params)
    assert float(jdls.get_scale(new_state).loss_scale) == 2.0**14  # one skipped step


@with_and_without_jit
def test_causes_without_value_fn(jit):
    params = {"w": jnp.ones(2)}
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), retries=2)
    state = tx.init(params)
    update = maybe_jit(tx.update, jit)
    _, s = update({"w": jnp.array([jnp.inf, 0.0])}, state, params)
    assert int(jdls.stats(s).cause) == jdls.SkipCause.GRADIENTS
    _, s = update({"w": jnp.ones(2)}, state, params, value=jnp.float32(jnp.nan))
    assert int(jdls.stats(s).cause) == jdls.SkipCause.FORWARD


def test_value_fn_with_aux():
    params = {"w": jnp.ones(3)}
    c = jnp.array([3.0, 1.0, 0.5])
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**15, growth_interval=100), retries=1)
    state = tx.init(params)
    _, state = jax.jit(
        lambda p, s: tx.update(
            jdls.get_scale(s).value_and_grad(loss_fn)(p, c)[1],
            s,
            p,
            value_fn=lambda q: (loss_fn(q, c), {"aux": jnp.ones(2)}),
        )
    )(params, state)
    assert bool(jdls.stats(state).finite) and int(jdls.stats(state).retries) == 1


def test_retries_need_a_dynamic_scale():
    with pytest.raises(ValueError, match="retries=2 needs a scale that backs off"):
        jdls.wrap(optax.sgd(0.1), jdls.StaticScale(8.0), retries=2)
    with pytest.raises(ValueError, match="retries must be >= 0, got -1"):
        jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(), retries=-1)


def _run(tx, cs, params, *, scan):
    def body(carry, c):
        p, s = carry
        scale = jdls.get_scale(s)
        _, grads = scale.value_and_grad(loss_fn)(p, c)
        updates, s = tx.update(grads, s, p, value_fn=lambda q: loss_fn(q, c))
        return (optax.apply_updates(p, updates), s), jdls.stats(s).finite

    carry = (params, tx.init(params))
    if scan:
        return jax.lax.scan(body, carry, cs)
    step = jax.jit(body)
    kept = []
    for c in cs:
        carry, finite = step(carry, c)
        kept.append(finite)
    return carry, jnp.stack(kept)


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_zero_dropped_batches_with_injected_scale_caused_overflows(scan):
    """Overflows that the current scale causes (not half of it) at random steps: with
    retries=2 no batch is dropped and the schedule follows the data; without, batches drop."""
    rng = np.random.default_rng(0)
    steps = 60
    cs = np.full((steps, 3), 0.25, np.float32)
    cs[:, 1] = rng.uniform(0.1, 0.9, steps)
    bad = rng.choice(steps, 12, replace=False)
    cs[bad, 0] = 3.0  # overflows at 2**15, fine at 2**14 (the scale grows back every 4 steps)
    cs = jnp.asarray(cs)
    params = {"w": jnp.ones(3)}
    schedule = optax.linear_schedule(0.1, 0.0, steps)

    def make(retries):
        scale = jdls.DynamicScale(2.0**15, growth_interval=4, max_loss_scale=2.0**15)
        return jdls.wrap(optax.adam(schedule), scale, retries=retries)

    (_, state), finite = _run(make(2), cs, params, scan=scan)
    assert bool(jnp.all(finite)), "a batch was dropped"
    assert int(jdls.stats(state).skipped_steps) == 0
    assert int(jdls.stats(state).retried_steps) >= 1
    count = state.inner_state[0].count  # adam's step count = the schedule's step
    assert int(count) == steps

    (_, state), finite = _run(make(0), cs, params, scan=scan)
    dropped = int(jdls.stats(state).skipped_steps)
    assert dropped >= 1 and int(state.inner_state[0].count) == steps - dropped


def test_retries_agree_across_devices_under_pmap():
    n = 4
    tx = jdls.wrap(
        optax.sgd(0.1), jdls.DynamicScale(2.0**15, growth_interval=100), axis_name="d", retries=2
    )

    def step(params, opt_state, c):
        scale = jdls.get_scale(opt_state)
        _, grads = scale.value_and_grad(loss_fn)(params, c)
        grads = jax.lax.pmean(grads, "d")
        updates, opt_state = tx.update(grads, opt_state, params, value_fn=lambda p: loss_fn(p, c))
        return optax.apply_updates(params, updates), opt_state

    params = jax.tree.map(lambda x: jnp.stack([x] * n), {"w": jnp.ones(3)})
    state = jax.pmap(tx.init)(params)
    cs = np.full((n, 3), 0.5, np.float32)
    cs[n - 1, 0] = 3.0  # only the last device's batch overflows at 2**15
    new_params, new_state = jax.pmap(step, axis_name="d")(params, state, jnp.asarray(cs))
    stats = jdls.stats(new_state)
    assert np.all(np.asarray(stats.finite)) and np.all(np.asarray(stats.retries) == 1)
    assert np.all(np.asarray(jdls.get_scale(new_state).loss_scale) == 2.0**14)
    w = np.asarray(new_params["w"])
    assert all(np.array_equal(w[0], w[i]) for i in range(n))  # replicas stay identical
    # The update is the mean gradient at 2**14: sgd(0.1) of mean(c).
    expected = 1.0 - 0.1 * np.float32(cs.mean(axis=0).astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(w[0], expected, rtol=1e-3)
