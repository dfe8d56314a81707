"""The default scale skips no more steps than the classic rule off the usual path: clipping in
front of the wrap, all-zero gradient phases, a float16 loss value; and ``Stats.grad_norm`` in a
chain is the norm before clipping.

Each run trains a small float16 MLP (float32 master weights) with ``jdls.wrap(optax.adam)``,
jitted, and counts the skipped steps of ``jdls.AdaptiveScale()`` (the default) and of
``jdls.DynamicScale()`` (the classic rule).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import maybe_jit, with_and_without_jit
from jax import lax

import jdls

F16 = jnp.float16


def init_params() -> dict[str, jax.Array]:
    key = jax.random.key(0)
    return {
        "w1": jax.random.normal(key, (16, 32)) * 0.5,
        "w2": jax.random.normal(jax.random.fold_in(key, 1), (32, 4)) * 0.5,
    }


def loss_fn(params, x, weight, loss_dtype=jnp.float32):
    """A float16 forward and backward pass; the loss in ``loss_dtype``, times ``weight``."""
    h = jax.nn.relu(x.astype(F16) @ params["w1"].astype(F16)) @ params["w2"].astype(F16)
    return weight.astype(loss_dtype) * jnp.sum(h.astype(loss_dtype) ** 2)


def train(tx, steps, weights, *, x_scale=1.0, loss_dtype=jnp.float32, grad_fn=None):
    """Skipped steps, the scales used (log2) and the last step's statistics."""
    params = init_params()
    state = tx.init(params)

    def value_and_grad(params, state, x, weight):
        scale = jdls.get_scale(state)
        return scale.value_and_grad(lambda p: loss_fn(p, x, weight, loss_dtype))(params)

    @jax.jit
    def step(params, state, x, weight):
        _, grads = (grad_fn or value_and_grad)(params, state, x, weight)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    key = jax.random.key(1)
    used = []
    for k in range(steps):
        x = jax.random.normal(jax.random.fold_in(key, k), (8, 16)) * x_scale
        used.append(math.log2(float(jdls.get_scale(state).loss_scale)))
        params, state = step(params, state, x, jnp.float32(weights(k)))
    stats = jdls.stats(state)
    return int(stats.skipped_steps), used, stats


def both(make_tx, steps, weights, **kw):
    """(default, classic) results of :func:`train`."""
    return (
        train(make_tx(jdls.AdaptiveScale()), steps, weights, **kw),
        train(make_tx(jdls.DynamicScale()), steps, weights, **kw),
    )


# --------------------------------------------------------------------------------------------
# Clipping in front of the wrap.
# --------------------------------------------------------------------------------------------

CLIPS = {
    "jdls.clip(max_norm)": lambda: jdls.clip(1e-3),
    "jdls.clip(max_value)": lambda: jdls.clip(max_value=1e-5),
}


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.full(keep=1)
def test_jdls_clip_in_front_skips_no_step_as_max_norm_does(clip):
    # Gradient norm about 1: clipped 1000x, the wrap would measure gradients 2**10 too small
    # and aim the scale 2**10 too high (8 and 15 of 20 steps skipped before the handoff).
    def chain(scale):
        return optax.chain(CLIPS[clip](), jdls.wrap(optax.adam(1e-3), scale))

    (default, used, _), (classic, _, _) = both(chain, 20, lambda k: 1e-3)
    assert (default, classic) == (0, 0)
    fused, fused_used, _ = train(jdls.wrap(optax.adam(1e-3), max_norm=1e-3), 20, lambda k: 1e-3)
    assert fused == 0 and used == fused_used  # the scales of wrap(max_norm=...)


@pytest.mark.full
def test_optax_clip_in_front_skips_no_step_as_max_norm_does():
    # optax's clip hands nothing over, but the gradients came from the scale's own
    # value_and_grad: the wrap gives the rule what that backward pass computed.
    def chain(scale):
        return optax.chain(optax.clip_by_global_norm(1e-3), jdls.wrap(optax.adam(1e-3), scale))

    (default, used, _), (classic, _, _) = both(chain, 30, lambda k: 1e-3)
    assert (default, classic) == (0, 0)
    fused, fused_used, _ = train(jdls.wrap(optax.adam(1e-3), max_norm=1e-3), 30, lambda k: 1e-3)
    assert fused == 0 and used == fused_used  # the scales of wrap(max_norm=...)


@pytest.mark.full  # about 3 s
def test_a_gradient_computed_where_the_wrap_cannot_see_is_learned_after_one_run():
    # value_and_grad under an inner jit: its gradients are new arrays of another trace, so the
    # wrap measures the clipped ones it receives; the first prediction overflows, the run of
    # overflows teaches the margin the factor, and no step overflows after it.
    def chain(scale):
        return optax.chain(optax.clip_by_global_norm(1e-3), jdls.wrap(optax.adam(1e-3), scale))

    def hidden(params, state, x, weight):
        scale = jdls.get_scale(state)
        vg = jax.jit(scale.value_and_grad(lambda p: loss_fn(p, x, weight)))
        return vg(params)

    (default, _, _), (classic, _, _) = both(chain, 60, lambda k: 1e-3, grad_fn=hidden)
    assert classic == 0
    assert default == 4
    (default_late, _, _), _ = both(chain, 20, lambda k: 1e-3, grad_fn=hidden)
    assert default_late == default  # all four in the first 20 steps, none in the next 40


LINEAR = {"w": jnp.zeros(2)}


def linear_loss(p, c=1.0):
    return c * (300.0 * p["w"][0] + 400.0 * p["w"][1])  # gradient (300c, 400c), norm 500c


def clipped_step(grads_of):
    """One update of ``clip_by_global_norm(1)`` + ``wrap(sgd)`` on the gradients
    ``grads_of(scale)`` returns; the next scale's log2."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), jdls.wrap(optax.sgd(1.0)))

    def step(state):
        grads = grads_of(jdls.get_scale(state))
        return tx.update(grads, state, LINEAR)

    return step, tx.init(LINEAR)


@with_and_without_jit
def test_the_rule_sees_the_backward_pass_of_the_scale_it_holds(jit):
    def plain(scale):
        return scale.value_and_grad(linear_loss)(LINEAR)[1]

    def two_calls(scale):  # two backward passes at this scale, their sum handed on
        a = scale.value_and_grad(linear_loss)(LINEAR)[1]
        b = scale.value_and_grad(lambda p: linear_loss(p, 10.0))(LINEAR)[1]
        return jax.tree.map(jnp.add, a, b)

    def inner_jit(scale):  # another trace: the wrap measures what it receives
        return jax.jit(scale.value_and_grad(linear_loss))(LINEAR)[1]

    def in_a_scan(scale):  # the body's trace: not seen from outside it, and nothing leaks
        def body(total, c):
            g = scale.value_and_grad(lambda p: linear_loss(p, c))(LINEAR)[1]
            return jax.tree.map(jnp.add, total, g), None

        return lax.scan(body, jax.tree.map(jnp.zeros_like, LINEAR), jnp.ones(2) / 2)[0]

    # largest gradient a, clipped to norm 1: the rule's scale is the largest 2**k with
    # a * 2**k <= 65504 / 2**6 (the default margin)
    for grads_of, amax in (
        (plain, 400.0),  # not the clipped 0.8
        (two_calls, 4000.0),  # the larger of the two backward passes
        (inner_jit, 0.8),
        (in_a_scan, 0.8),
    ):
        step, state = clipped_step(grads_of)
        _, state = maybe_jit(step, jit)(state)
        expected = math.floor(math.log2(65504 / 2**6 / amax))
        assert float(jdls.get_scale(state).loss_scale) == 2.0**expected, grads_of.__name__


@with_and_without_jit
def test_grad_norm_in_a_chain_is_the_norm_before_clipping(jit):
    params = {"w": jnp.zeros(2), "n": jnp.zeros((), jnp.int32)}
    grads = {"w": jnp.array([300.0, 400.0]), "n": jnp.zeros((), jnp.int32)}
    for tx, clipped in (
        (optax.chain(jdls.clip(1.0), jdls.wrap(optax.sgd(1.0))), [0.6, 0.8]),
        (optax.chain(jdls.clip(max_value=1.0), jdls.wrap(optax.sgd(1.0))), [1.0, 1.0]),
        (jdls.wrap(optax.sgd(1.0), max_norm=1.0), [0.6, 0.8]),
    ):
        update = maybe_jit(tx.update, jit)
        updates, state = update(grads, tx.init(params), params)
        stats = jdls.stats(state)
        assert float(stats.grad_norm) == 500.0
        np.testing.assert_allclose(-updates["w"], clipped, rtol=1e-6)
        # The rule set the scale from the gradients before clipping: 400 * 2**k <= 65504 / 2**6.
        assert float(jdls.get_scale(state).loss_scale) == 2.0**1


def test_a_transformation_in_between_hands_nothing_over():
    params = {"w": jnp.zeros(2)}
    grads = {"w": jnp.array([300.0, 400.0])}
    tx = optax.chain(jdls.clip(1.0), optax.scale(1.0), jdls.wrap(optax.sgd(1.0)))
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert float(jdls.stats(state).grad_norm) == pytest.approx(1.0)  # what the wrap received


# --------------------------------------------------------------------------------------------
# All-zero gradients, a float16 loss.
# --------------------------------------------------------------------------------------------


def test_an_all_zero_phase_skips_no_step():
    # A loss weight of 0 for 20 steps (a warm-up, a frozen phase), then 1e-3: before, the
    # scale climbed to 2**127 on the zeros and 16 steps overflowed when the loss came on.
    def weights(k):
        return 0.0 if k < 20 else 1e-3

    def plain(scale):
        return jdls.wrap(optax.adam(1e-3), scale)

    (default, used, _), (classic, _, _) = both(plain, 40, weights)
    assert (default, classic) == (0, 0)
    # one step looks 2**34 higher for flushed gradients, finds zeros, settles at 2**15
    assert used[:4] == [0, 34, 15, 15] and set(used[2:21]) == {15}


def test_an_all_zero_phase_after_training_holds_the_scale():
    def weights(k):
        return 0.0 if 10 <= k < 30 else 1e-3

    (default, used, _), (classic, _, _) = both(
        lambda s: jdls.wrap(optax.adam(1e-3), s), 40, weights
    )
    assert (default, classic) == (0, 0)
    assert used[11:31] == [used[10]] * 20  # held through the zeros


def test_a_float16_loss_skips_no_step():
    # Small gradients, so the rule aims above 65504; the loss is float16, whose seed of the
    # backward pass would be inf there: it is seeded with at most 2**15.
    def plain(scale):
        return jdls.wrap(optax.adam(1e-3), scale)

    (default, used, _), (classic, _, _) = both(
        plain, 60, lambda k: 1e-4, x_scale=0.1, loss_dtype=F16
    )
    assert (default, classic) == (0, 0)
    assert max(used) > 16  # the rule's scale is above float16's range; the seed is not


@with_and_without_jit
def test_a_16_bit_loss_is_seeded_with_at_most_the_largest_power_of_two_of_its_format(jit):
    w = jnp.array([1.0, -2.0])

    def loss(w):
        return jnp.sum(w.astype(F16) * F16(0.5))

    expected = jax.grad(lambda w: jnp.sum(w * 0.5))(w)
    for scale in (jdls.StaticScale(2.0**20), jdls.AdaptiveScale(2.0**40), jdls.DynamicScale()):
        value, grads = maybe_jit(scale.value_and_grad(loss), jit)(w)
        assert value.dtype == F16 and float(value) == -0.5
        assert grads.dtype == jnp.float32
        np.testing.assert_array_equal(grads, expected)
    # A float32 loss is scaled by the scale itself: 2**40 * 0.5 is finite in float32.
    _, grads = jdls.StaticScale(2.0**40).value_and_grad(lambda w: jnp.sum(w * 0.5))(w)
    np.testing.assert_array_equal(grads, expected)
    # bfloat16: the largest power of two is 2**127, above every float32 scale but 2**127.
    _, grads = jdls.StaticScale(2.0**100).value_and_grad(
        lambda w: jnp.sum(w.astype(jnp.bfloat16) * 0.5)
    )(w)
    np.testing.assert_array_equal(grads, expected)


def test_only_a_scale_whose_rule_observes_keeps_the_gradients_it_returned():
    # A static or classic scale's array outlives many eager steps: it must not hold them.
    from jdls._numerics import handoff

    params = {"w": jnp.ones(3)}
    for scale, kept in (
        (jdls.StaticScale(4.0), None),
        (jdls.DynamicScale(), None),
        (jdls.AdaptiveScale(), 1),  # the last call's one leaf
    ):
        for _ in range(2):
            scale.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(params)
        record = handoff._backward.get(id(scale.loss_scale))
        assert (None if record is None else len(record.latest)) == kept


def test_many_calls_with_one_scale_hold_one_gradient():
    """Gradients computed again and again with one scale (eagerly, or micro-batches in one
    trace) are not all held: the last call's leaves, and the largest magnitude of the rest."""
    import gc
    import weakref

    from jdls._numerics import handoff

    params = {"w": jnp.ones((64, 64))}
    scale = jdls.AdaptiveScale()
    kept = []
    for i in range(20):
        _, g = scale.value_and_grad(lambda p, i=i: jnp.sum(p["w"] ** 2) * (i + 1))(params)
        kept.append(weakref.ref(g["w"]))
        del g
    gc.collect()
    assert sum(ref() is not None for ref in kept) == 1  # the last call's, nothing else
    record = handoff._backward[id(scale.loss_scale)]
    assert float(record.earlier) == 2.0 * 19  # d/dw of 19 * sum(w**2) at w = 1
