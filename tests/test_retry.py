"""``jdls.retrying``: an overflowing step is recomputed at lower scales inside the compiled step,
and the retried step equals, bit for bit, the step taken directly at the backed-off scale with
the same batch, through every supported optimizer shape and device layout; forward NaNs are
never retried; the statistics say why a step was skipped; the shapes that cannot be made exact
are refused."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    assert_bitwise_equal,
    maybe_jit,
    pcast_varying,
    tanh_stack,
    with_and_without_jit,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

N = 4  # devices of the multi-device tests (of the 8 CPU devices of conftest.py)
HIGH = 2.0**15


def loss_fn(params, c):
    """``sum(w * c)`` in float16: the scaled backward is ``c * scale`` in float16, so it
    overflows at scale ``2**15`` when ``c >= 2`` and at ``2**14`` only when ``c >= 4``."""
    w = params["w"].astype(jnp.float16)
    return jnp.sum((w * c.astype(jnp.float16)).astype(jnp.float32))


def mean_loss_fn(params, c):
    """``loss_fn`` averaged over the rows of ``c`` (a batch): overflows at ``2**15`` when a row
    holds ``c >= 2 * rows``."""
    w = params["w"].astype(jnp.float16)
    return jnp.sum((w * c.astype(jnp.float16)).astype(jnp.float32)) / c.shape[0]


OVERFLOWING = jnp.array([3.0, 1.0, 0.5])  # overflows at 2**15, not at 2**14


def direct_step(tx, fn, params, state, scale, *batch):
    """The step taken directly at ``scale``: differentiate, ``tx.update`` once, apply."""
    state = jdls.set_scale(state, scale)
    loss, grads = jdls.get_scale(state).value_and_grad(fn)(params, *batch)
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state


def without_retry_stats(state):
    """``state`` with the retry statistics zeroed (the direct step has none)."""

    def clear(x):
        if not isinstance(x, jdls.WrapState):
            return x
        zero = jnp.zeros((), jnp.int32)
        return x._replace(stats=x.stats._replace(retries=zero, retried_steps=zero))

    return jax.tree_util.tree_map(clear, state, is_leaf=lambda x: isinstance(x, jdls.WrapState))


def backed_off(state, times=1):
    """The scale a retry recomputes at, ``times`` retries down."""
    scale = jdls.get_scale(state)
    for _ in range(times):
        scale = scale.back_off()
    return scale


def assert_retried_equals_direct(got, want, retries=1):
    (p, s), (rp, rs) = got, want
    assert int(jdls.stats(s).retries) == retries
    assert bool(jdls.stats(s).finite)
    assert_bitwise_equal(p, rp)
    assert_bitwise_equal(without_retry_stats(s), without_retry_stats(rs))


# --------------------------------------------------------------------------------------------
# Every optimizer shape: the retried step is the direct step at the backed-off scale.
# --------------------------------------------------------------------------------------------


def _scale():
    return jdls.DynamicScale(HIGH, growth_interval=100)


SHAPES = {
    "wrap": lambda: jdls.wrap(optax.sgd(0.1, momentum=0.9), _scale()),
    "wrap_adam": lambda: jdls.wrap(optax.adam(0.1), _scale()),
    "wrap_max_norm": lambda: jdls.wrap(optax.sgd(1.0), _scale(), max_norm=1.0),
    "clip_then_wrap": lambda: optax.chain(jdls.clip(1.0), jdls.wrap(optax.sgd(1.0), _scale())),
    "optax_clip_then_wrap": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), jdls.wrap(optax.sgd(1.0), _scale())
    ),
    "adamw_chain": lambda: jdls.wrap(
        optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1), optax.scale(-0.5)),
        _scale(),
    ),
    "inject_hyperparams_inside": lambda: jdls.wrap(
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9), _scale()
    ),
    "inject_hyperparams_before": lambda: optax.chain(
        optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0),
        jdls.wrap(optax.sgd(1.0), _scale()),
    ),
    "multisteps_inside": lambda: jdls.wrap(optax.MultiSteps(optax.sgd(0.1), 2), _scale()),
    "adaptive": lambda: jdls.wrap(optax.sgd(0.1), jdls.AdaptiveScale(HIGH)),
    # a rule that observes sets the scale from the gradients the backward pass computed, not
    # from what a transformation in front of the wrap made of them
    "optax_clip_then_adaptive": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), jdls.wrap(optax.sgd(0.1), jdls.AdaptiveScale(HIGH))
    ),
    "optax_scale_then_adaptive": lambda: optax.chain(
        optax.scale(0.1), jdls.wrap(optax.sgd(0.1), jdls.AdaptiveScale(HIGH))
    ),
}


#: Jitted, the hand-written step is another XLA program, which fuses the clipping before the
#: wrap differently from the retrying step: their parameters differ in the last bit.
CLIP_BEFORE_THE_WRAP = (
    "clip_then_wrap",
    "optax_clip_then_wrap",
    "inject_hyperparams_before",
    "optax_clip_then_adaptive",
)


@pytest.mark.parametrize("shape", list(SHAPES))
@with_and_without_jit
@pytest.mark.full(keep=1)
def test_retried_step_equals_the_direct_step_at_the_backed_off_scale(shape, jit):
    """Bit for bit: the same step fed the same batch at the backed-off scale (the same
    compiled program), and the hand-written step (``tx.update`` once at that scale), eagerly
    and jitted; jitted with clipping before the wrap, to the last bit of the parameters."""
    tx = SHAPES[shape]()
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    if "adaptive" in shape:  # the rule at a scale that overflows: one retry settles it
        state = jdls.set_scale(state, jdls.get_scale(state).replace(loss_scale=jnp.float32(HIGH)))
    step = maybe_jit(jdls.retrying(loss_fn, tx, retries=2), jit)
    new_params, new_state, loss = step(params, state, OVERFLOWING)
    again = step(params, jdls.set_scale(state, backed_off(state)), OVERFLOWING)
    assert int(jdls.stats(again[1]).retries) == 0
    assert_retried_equals_direct((new_params, new_state), again[:2])
    assert float(loss) == float(again[2]) == float(loss_fn(params, OVERFLOWING))
    assert int(jdls.stats(new_state).retried_steps) == 1
    assert int(jdls.stats(new_state).cause) == jdls.SkipCause.NONE

    ref = maybe_jit(lambda p, s, sc: direct_step(tx, loss_fn, p, s, sc, OVERFLOWING), jit)(
        params, state, backed_off(state)
    )
    if jit and shape in CLIP_BEFORE_THE_WRAP:
        assert_bitwise_equal(jdls.get_scale(new_state), jdls.get_scale(ref[1]))
        np.testing.assert_allclose(new_params["w"], ref[0]["w"], rtol=0, atol=2**-23)  # 1 ulp
    else:
        assert_retried_equals_direct((new_params, new_state), ref)


def test_clipping_before_the_wrap_clips_the_retried_gradients():
    """The retried gradients ``[3, 1, 0.5]`` (norm 3.2) go through ``jdls.clip(1.0)``."""
    tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.sgd(1.0), _scale()))
    params = {"w": jnp.zeros(3)}
    new_params, state, _ = jax.jit(jdls.retrying(loss_fn, tx))(params, tx.init(params), OVERFLOWING)
    assert int(jdls.stats(state).retries) == 1
    g = np.asarray(OVERFLOWING, np.float32)
    np.testing.assert_allclose(new_params["w"], -g / np.linalg.norm(g), rtol=1e-6)
    assert float(jnp.linalg.norm(new_params["w"])) == pytest.approx(1.0, rel=1e-6)


@with_and_without_jit
@pytest.mark.full(keep=1)
def test_finite_step_is_the_plain_step(jit):
    """A finite step with retries is, bit for bit, the step without."""
    c = jnp.array([0.5, 1.0, 1.5])
    params = {"w": jnp.ones(3)}
    for shape in ("wrap_adam", "clip_then_wrap", "adamw_chain", "optax_clip_then_adaptive"):
        tx = SHAPES[shape]()
        state = tx.init(params)
        got = maybe_jit(jdls.retrying(loss_fn, tx, retries=2), jit)(params, state, c)
        plain = maybe_jit(jdls.retrying(loss_fn, tx, retries=0), jit)(params, state, c)
        ref = maybe_jit(
            lambda p, s, tx=tx: direct_step(tx, loss_fn, p, s, jdls.get_scale(s), c), jit
        )(params, state)
        assert_bitwise_equal(got, plain)
        if jit and shape == "optax_clip_then_adaptive":  # optax's clip, fused otherwise
            assert_bitwise_equal(jdls.get_scale(got[1]), jdls.get_scale(ref[1]))
            np.testing.assert_allclose(got[0]["w"], ref[0]["w"], rtol=0, atol=2**-23)
        else:
            assert_bitwise_equal(got[:2], ref)
        assert int(jdls.stats(got[1]).retries) == 0 and int(jdls.stats(got[1]).cause) == 0


@with_and_without_jit
def test_two_retries_equal_the_direct_step_two_backoffs_down(jit):
    c = jnp.array([5.0, 1.0, 0.5])  # overflows at 2**15 and 2**14, not at 2**13
    tx = SHAPES["wrap"]()
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    got = maybe_jit(jdls.retrying(loss_fn, tx, retries=2), jit)(params, state, c)[:2]
    ref = maybe_jit(lambda p, s, sc: direct_step(tx, loss_fn, p, s, sc, c), jit)(
        params, state, backed_off(state, 2)
    )
    assert_retried_equals_direct(got, ref, retries=2)
    assert float(jdls.get_scale(got[1]).loss_scale) == 2.0**13


#: The presets whose rule forgives overflows, at 2**15 (float16).
FORGIVING = {
    "deepspeed": lambda: jdls.presets.deepspeed(init_scale=HIGH),  # delayed_shift 2
    "deepspeed_consecutive": lambda: jdls.presets.deepspeed(
        init_scale=HIGH, delayed_shift=3, consecutive_hysteresis=True
    ),
    "megatron": lambda: jdls.presets.megatron(initial_scale=HIGH),  # hysteresis 2
    "cerebras_tolerance": lambda: jdls.presets.cerebras(init_scale=HIGH, overflow_tolerance=0.5),
}


@pytest.mark.parametrize("preset", list(FORGIVING))
@with_and_without_jit
@pytest.mark.full(keep=1)  # about 4 s a case
def test_every_retry_lowers_the_scale_with_hysteresis(preset, jit):
    """A rule with hysteresis (or a tolerance) forgives the first overflows; a retry must not:
    each recomputes at a lower scale, so a batch finite at half the scale is kept with one
    retry, and one finite at a quarter with two, through the wrap and through accumulate."""
    params = {"w": jnp.ones(3)}
    for retries, c, settled in (
        (1, OVERFLOWING, 2.0**14),
        (2, jnp.array([5.0, 1.0, 0.5]), 2.0**13),
    ):
        tx = jdls.wrap(optax.sgd(0.1), FORGIVING[preset]())
        state = tx.init(params)
        got = maybe_jit(jdls.retrying(loss_fn, tx, retries=retries), jit)(params, state, c)[:2]
        assert not bool(jdls.stats(got[1]).skipped) and int(jdls.stats(got[1]).retries) == retries
        ref = maybe_jit(lambda p, s, sc, c=c, tx=tx: direct_step(tx, loss_fn, p, s, sc, c), jit)(
            params, state, backed_off(state, retries)
        )
        assert_retried_equals_direct(got, ref, retries=retries)
        assert float(jdls.get_scale(got[1]).loss_scale) == settled

        # accumulate: the second micro-batch is retried, none is dropped
        micro = jnp.stack([jnp.ones(3), c, jnp.ones(3), jnp.ones(3)])  # a mean exact in float32
        scale = FORGIVING[preset]()
        _, grads, info = maybe_jit(
            lambda p, xs, s, retries=retries: jdls.accumulate(loss_fn, s, p, xs, retries=retries),
            jit,
        )(params, micro, scale)
        assert (int(info.kept), int(info.dropped), int(info.retries)) == (4, 0, retries)
        assert float(info.scale.loss_scale) == settled
        np.testing.assert_array_equal(grads["w"], jnp.mean(micro, axis=0))


@with_and_without_jit
@pytest.mark.parametrize(
    "chain",
    [
        "wrap",
        pytest.param("clip in front", marks=pytest.mark.full),
        pytest.param("scale after", marks=pytest.mark.full),
    ],
)
def test_overflow_left_after_the_retries_is_skipped_as_backward(chain, jit):
    """Skipped: the parameters (a -0.0 among them) and the optimizer state bit for bit, with
    the wrap alone, clipping in front and a stateful transformation after it."""
    params = {"w": jnp.array([1.0, -0.0, 0.0])}
    c = jnp.array([60000.0, 1.0, 1.0])  # overflows at every scale >= 2
    wrap = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(HIGH))
    tx = {
        "wrap": wrap,
        "clip in front": optax.chain(jdls.clip(1.0), wrap),
        "scale after": optax.chain(wrap, optax.scale_by_schedule(lambda n: 1.0 + n)),
    }[chain]
    state = tx.init(params)
    new_params, new_state, _ = maybe_jit(jdls.retrying(loss_fn, tx, retries=2), jit)(
        params, state, c
    )
    stats = jdls.stats(new_state)
    assert not bool(stats.finite) and int(stats.retries) == 2
    assert int(stats.cause) == jdls.SkipCause.BACKWARD and int(stats.skipped_steps) == 1
    assert_bitwise_equal(new_params, params)

    def held(s):  # what a skipped step keeps: all but the wraps' scale and statistics
        return jax.tree_util.tree_map(
            lambda x: x.inner_state if isinstance(x, jdls.WrapState) else x,
            s,
            is_leaf=lambda x: isinstance(x, jdls.WrapState),
        )

    assert_bitwise_equal(held(new_state), held(state))
    state = new_state
    # Three overflowing feeds: 2**15 -> 2**14 -> 2**13 (the retries) -> 2**12 (the skip).
    assert float(jdls.get_scale(state).loss_scale) == 2.0**12


@with_and_without_jit
@pytest.mark.parametrize(("start", "retries"), [(2.0, 0), (4.0, 1)])
@pytest.mark.full(keep=1)
def test_no_retry_at_the_minimum_scale(start, retries, jit):
    """A retry at the rule's minimum would recompute the same overflow: the loop stops there,
    and the step is the direct step at the minimum (skipped, as BACKWARD)."""
    params = {"w": jnp.ones(3)}
    c = jnp.array([60000.0, 1.0, 1.0])  # overflows at every scale >= 2
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(start, min_loss_scale=2.0))
    state = tx.init(params)
    new_params, new_state, _ = maybe_jit(jdls.retrying(loss_fn, tx, retries=3), jit)(
        params, state, c
    )
    stats = jdls.stats(new_state)
    assert int(stats.retries) == retries and int(stats.retried_steps) == (retries > 0)
    assert not bool(stats.finite) and int(stats.cause) == jdls.SkipCause.BACKWARD
    assert float(jdls.get_scale(new_state).loss_scale) == 2.0
    want_params, want_state = direct_step(tx, loss_fn, params, state, backed_off(state, retries), c)

    def as_backward(x):  # the direct step, a wrap alone, cannot tell BACKWARD from GRADIENTS
        if not isinstance(x, jdls.WrapState):
            return x
        cause = jnp.asarray(jdls.SkipCause.BACKWARD, x.stats.cause.dtype)
        return x._replace(stats=x.stats._replace(cause=cause))

    want_state = jax.tree_util.tree_map(
        as_backward, want_state, is_leaf=lambda x: isinstance(x, jdls.WrapState)
    )
    assert_bitwise_equal(new_params, want_params)
    assert_bitwise_equal(without_retry_stats(new_state), without_retry_stats(want_state))


@with_and_without_jit
def test_forward_nan_is_never_retried(jit):
    params = {"w": jnp.ones(3)}
    c = jnp.array([jnp.nan, 1.0, 1.0])
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(HIGH))
    new_params, state, _ = maybe_jit(jdls.retrying(loss_fn, tx, retries=3), jit)(
        params, tx.init(params), c
    )
    stats = jdls.stats(state)
    assert not bool(stats.finite) and int(stats.retries) == 0
    assert int(stats.cause) == jdls.SkipCause.FORWARD and int(stats.retried_steps) == 0
    assert_bitwise_equal(new_params, params)
    assert float(jdls.get_scale(state).loss_scale) == 2.0**14  # one skipped step


def test_causes_of_the_wrap_alone():
    params = {"w": jnp.ones(2)}
    tx = jdls.wrap(optax.sgd(0.1))
    state = tx.init(params)
    _, s = tx.update({"w": jnp.array([jnp.inf, 0.0])}, state, params)
    assert int(jdls.stats(s).cause) == jdls.SkipCause.GRADIENTS
    _, s = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.float32(jnp.nan))
    assert int(jdls.stats(s).cause) == jdls.SkipCause.FORWARD


def test_has_aux_returns_the_first_attempts_aux():
    def with_aux(params, c):
        return loss_fn(params, c), {"n": jnp.sum(c)}

    tx = SHAPES["wrap"]()
    params = {"w": jnp.ones(3)}
    _, state, (loss, aux) = jax.jit(jdls.retrying(with_aux, tx, has_aux=True))(
        params, tx.init(params), OVERFLOWING
    )
    assert int(jdls.stats(state).retries) == 1
    assert float(aux["n"]) == 4.5 and float(loss) == 4.5


# --------------------------------------------------------------------------------------------
# Refused shapes and the old API.
# --------------------------------------------------------------------------------------------


def test_wrap_retries_points_to_retrying():
    with pytest.raises(TypeError, match=r"retries=2\) is gone.*jdls.retrying\(loss_fn, tx"):
        jdls.wrap(optax.sgd(0.1), retries=2)
    tx = jdls.wrap(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    with pytest.raises(TypeError, match=r"value_fn=...\) is gone.*jdls.retrying"):
        tx.update(params, tx.init(params), params, value_fn=lambda p: loss_fn(p, OVERFLOWING))


def test_refused_shapes():
    params = {"w": jnp.ones(3)}
    tx = jdls.wrap(optax.sgd(0.1), jdls.StaticScale(8.0))
    with pytest.raises(ValueError, match="needs a scale that backs off"):
        jdls.retrying(loss_fn, tx)(params, tx.init(params), OVERFLOWING)
    tx = optax.MultiSteps(jdls.wrap(optax.sgd(0.1)), 2)
    with pytest.raises(ValueError, match=r"put MultiSteps inside the wrap: jdls.wrap\(optax.Multi"):
        jax.jit(jdls.retrying(loss_fn, tx))(params, tx.init(params), OVERFLOWING)
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match="found no jdls.wrap state"):
        jdls.retrying(loss_fn, tx)(params, tx.init(params), OVERFLOWING)
    with pytest.raises(ValueError, match="retries must be >= 0, got -1"):
        jdls.retrying(loss_fn, jdls.wrap(optax.sgd(0.1)), retries=-1)
    with pytest.raises(TypeError, match="tx must be an optax transformation holding a jdls.wrap"):
        jdls.retrying(loss_fn, "adam")
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        jdls.retrying(3.0, jdls.wrap(optax.sgd(0.1)))


# --------------------------------------------------------------------------------------------
# Device layouts: jit with shardings, shard_map (check_vma on and off), pmap.
# --------------------------------------------------------------------------------------------

#: One row per device; only the last overflows at 2**15 (3 * 2**15 > 65504), not at 2**14.
ROWS = np.array([[0.5, 1.0, 0.25]] * (N - 1) + [[3.0, 1.0, 0.5]], np.float32)
MEAN = ROWS.mean(axis=0)  # exact: dyadic numbers


def _mesh():
    return jax.make_mesh((N,), ("d",), devices=jax.devices()[:N])


def _layout_tx(axis_name=None):
    return jdls.wrap(optax.sgd(1.0), _scale(), axis_name=axis_name)


def _shard_map_inputs():
    """The mesh, a wrap over ``"d"``, replicated parameters and state, ``ROWS`` split by row."""
    mesh = _mesh()
    tx = _layout_tx("d")
    rep = NamedSharding(mesh, P())
    params = jax.device_put({"w": jnp.ones(3)}, rep)
    state = jax.device_put(tx.init({"w": jnp.ones(3)}), rep)
    c = jax.device_put(jnp.asarray(ROWS), NamedSharding(mesh, P("d")))
    return mesh, tx, params, state, c


@pytest.mark.full
def test_jit_with_shardings_equals_the_direct_step():
    mesh = _mesh()
    tx = _layout_tx()
    params = jax.device_put({"w": jnp.ones(3)}, NamedSharding(mesh, P()))
    state = jax.device_put(tx.init({"w": jnp.ones(3)}), NamedSharding(mesh, P()))
    # The backward of the batch mean sums ``c * scale / 4`` over the rows in float16: the
    # first column, 12.75 * 2**15 / 4, overflows, 12.75 * 2**14 / 4 does not.
    rows = np.array([[0.25, 0.5, 0.25]] * (N - 1) + [[12.0, 1.0, 0.5]], np.float32)
    c = jax.device_put(jnp.asarray(rows), NamedSharding(mesh, P("d")))
    got = jax.jit(jdls.retrying(mean_loss_fn, tx))(params, state, c)[:2]
    ref = jax.jit(lambda p, s, sc: direct_step(tx, mean_loss_fn, p, s, sc, c))(
        params, state, backed_off(state)
    )
    assert_retried_equals_direct(got, ref)
    np.testing.assert_array_equal(got[0]["w"], 1.0 - rows.mean(axis=0))


def _per_device_reference(tx, params, state, scale, c, vary=False):
    """The step taken directly at ``scale`` with data parallelism: each device's gradients
    (of the parameters marked as varying, under ``shard_map`` with ``check_vma``), averaged
    (``jax.lax.pmean``), then ``tx.update``."""
    state = jdls.set_scale(state, scale)
    mine = jax.tree.map(lambda x: pcast_varying(x, ("d",)), params) if vary else params
    loss, grads = scale.value_and_grad(loss_fn)(mine, c)
    grads = jax.lax.pmean(grads, "d")
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.full(keep=1)
def test_shard_map_equals_the_direct_step(check_vma):
    """Each device differentiates its own loss: the update is the mean gradient's (not the
    sum's), one retry, one halving, on every device."""
    mesh, tx, params, state, c = _shard_map_inputs()

    def local(params, state, c):
        params, state, loss = jdls.retrying(loss_fn, tx, axis_name="d")(params, state, c[0])
        return params, state, loss[None]

    def local_ref(params, state, c):
        scale = jdls.get_scale(state).adjust(False)
        return _per_device_reference(tx, params, state, scale, c[0], vary=check_vma)

    specs = dict(mesh=mesh, in_specs=(P(), P(), P("d")), check_vma=check_vma)
    got = jax.jit(jax.shard_map(local, out_specs=(P(), P(), P("d")), **specs))(params, state, c)
    ref = jax.jit(jax.shard_map(local_ref, out_specs=(P(), P()), **specs))(params, state, c)
    assert_retried_equals_direct(got[:2], ref)
    np.testing.assert_array_equal(got[0]["w"], 1.0 - MEAN)
    assert float(jdls.get_scale(got[1]).loss_scale) == 2.0**14


def test_shard_map_refuses_a_loss_averaged_across_devices():
    mesh, tx, params, state, c = _shard_map_inputs()

    def averaged(p, c):
        return jax.lax.pmean(loss_fn(p, c), "d")

    def local(params, state, c):
        return jdls.retrying(averaged, tx, axis_name="d")(params, state, c[0])[:2]

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P()))
    with pytest.raises(ValueError, match="return this device's own loss"):
        jax.jit(f)(params, state, c)


def test_shard_map_refuses_sharded_parameters():
    mesh = _mesh()
    tx = _layout_tx("d")
    params = jax.device_put({"w": jnp.ones(N)}, NamedSharding(mesh, P("d")))
    state = tx.init({"w": jnp.ones(N)})
    c = jax.device_put(jnp.ones(N), NamedSharding(mesh, P("d")))

    def local(params, state, c):
        return jdls.retrying(loss_fn, tx, axis_name="d")(params, state, c)[0]

    f = jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=P("d"))
    with pytest.raises(ValueError, match=r"the parameter at \['w'\] varies across 'd'"):
        jax.jit(f)(params, state, c)
    with pytest.raises(ValueError, match="sharded=True.*not supported.*jax.jit and NamedSharding"):
        jdls.retrying(loss_fn, tx, axis_name="d", sharded=True)


def test_pmap_equals_the_direct_step():
    devices = jax.devices()[:N]
    tx = _layout_tx("d")
    params = jax.tree.map(lambda x: jnp.stack([x] * N), {"w": jnp.ones(3)})
    state = jax.pmap(tx.init, devices=devices)(params)
    c = jnp.asarray(ROWS)
    got = jax.pmap(jdls.retrying(loss_fn, tx, axis_name="d"), "d", devices=devices)(
        params, state, c
    )

    def ref_step(p, s, c):
        return _per_device_reference(tx, p, s, jdls.get_scale(s).adjust(False), c)

    ref = jax.pmap(ref_step, "d", devices=devices)(params, state, c)
    stats = jdls.stats(got[1])
    assert np.all(np.asarray(stats.retries) == 1) and np.all(np.asarray(stats.finite))
    assert_bitwise_equal(got[0], ref[0])
    assert_bitwise_equal(without_retry_stats(got[1]), without_retry_stats(ref[1]))
    w = np.asarray(got[0]["w"])
    for i in range(N):
        np.testing.assert_array_equal(w[i], 1.0 - MEAN)


@pytest.mark.parametrize("layout", ["shard_map", "pmap"])
@pytest.mark.parametrize("batch", ["retried", "finite"])
@pytest.mark.full(keep=1)
def test_an_observing_rule_sets_the_scale_from_each_devices_gradients(layout, batch):
    """Under an axis_name the default rule measures the largest gradient any device computed,
    before the step averages them (3.0 on the last device, 1.125 in the mean), as in the
    hand-written step, where ``value_and_grad`` hands it to the wrap: in a retried step and
    in a finite one alike."""
    c = ROWS if batch == "retried" else ROWS / 4  # / 4: nothing overflows at 2**15
    tx = jdls.wrap(optax.sgd(1.0), jdls.AdaptiveScale(HIGH), axis_name="d")
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    state = jdls.set_scale(state, jdls.get_scale(state).replace(loss_scale=jnp.float32(HIGH)))
    at = backed_off(state) if batch == "retried" else jdls.get_scale(state)

    def ref_step(p, s, c):
        return _per_device_reference(tx, p, s, at, c, vary=layout == "shard_map")

    if layout == "shard_map":
        mesh = _mesh()
        specs = dict(mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P()))

        def local(p, s, c):
            return jdls.retrying(loss_fn, tx, axis_name="d")(p, s, c[0])[:2]

        rep = NamedSharding(mesh, P())
        args = (
            jax.device_put(params, rep),
            jax.device_put(state, rep),
            jax.device_put(jnp.asarray(c), NamedSharding(mesh, P("d"))),
        )
        got = jax.jit(jax.shard_map(local, **specs))(*args)
        ref = jax.jit(jax.shard_map(lambda p, s, c: ref_step(p, s, c[0]), **specs))(*args)
    else:
        devices = jax.devices()[:N]
        stack = functools.partial(jax.tree.map, lambda x: jnp.stack([x] * N))
        step = jdls.retrying(loss_fn, tx, axis_name="d")
        got = jax.pmap(lambda p, s, c: step(p, s, c)[:2], "d", devices=devices)(
            stack(params), stack(state), jnp.asarray(c)
        )
        ref = jax.pmap(ref_step, "d", devices=devices)(stack(params), stack(state), jnp.asarray(c))
    retries = np.asarray(jdls.stats(got[1]).retries)
    assert np.all(retries == (batch == "retried"))
    assert_bitwise_equal(got[0], ref[0])
    assert_bitwise_equal(without_retry_stats(got[1]), without_retry_stats(ref[1]))


# --------------------------------------------------------------------------------------------
# A run: no batch dropped for a scale-caused overflow.
# --------------------------------------------------------------------------------------------


def _run(tx, cs, params, retries, *, scan):
    step = jdls.retrying(loss_fn, tx, retries=retries)

    def body(carry, c):
        p, s, _ = step(*carry, c)
        return (p, s), jdls.stats(s).finite

    carry = (params, tx.init(params))
    if scan:
        return jax.lax.scan(body, carry, cs)
    body = jax.jit(body)
    kept = []
    for c in cs:
        carry, finite = body(carry, c)
        kept.append(finite)
    return carry, jnp.stack(kept)


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.full
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
    scale = jdls.DynamicScale(HIGH, growth_interval=4, max_loss_scale=HIGH)
    tx = jdls.wrap(optax.adam(schedule), scale)

    (_, state), finite = _run(tx, cs, params, 2, scan=scan)
    assert bool(jnp.all(finite)), "a batch was dropped"
    assert int(jdls.stats(state).skipped_steps) == 0
    assert int(jdls.stats(state).retried_steps) >= 1
    assert int(state.inner_state[0].count) == steps  # adam's step count = the schedule's step

    (_, state), finite = _run(tx, cs, params, 0, scan=scan)
    dropped = int(jdls.stats(state).skipped_steps)
    assert dropped >= 1 and int(state.inner_state[0].count) == steps - dropped


# --------------------------------------------------------------------------------------------
# One measurement per attempt: each attempt is the step without retries, decided by its wrap.
# --------------------------------------------------------------------------------------------


_jaxprs_in = getattr(jax.extend.core, "jaxprs_in_params", None) or jax.core.jaxprs_in_params


def _gradient_reads(fn, *args):
    """``{primitive: count}`` of the reductions in the jaxpr of ``fn`` (sub-jaxprs included:
    the loop's body, the conditionals' branches) that read a whole gradient-shaped array."""
    shapes = {(8, 4), (3,)}
    counts = {}

    def walk(jaxpr):
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name.startswith("reduce_") and tuple(e.invars[0].aval.shape) in shapes:
                counts[name] = counts.get(name, 0) + 1
            for sub in _jaxprs_in(e.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


@pytest.mark.parametrize("scale", ["adaptive", "dynamic"])
def test_a_finite_attempt_is_read_once_for_its_measurement(scale):
    """Each attempt is the step without retries, whose wrap decides whether it was finite
    (and so whether to retry): a finite step reads each gradient exactly as often as the step
    without retries, with no separate finiteness check (``jdls.all_finite``)."""

    def loss(params, x):
        return jnp.sum(jnp.tanh(params["w"] @ x) * params["b"])

    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(3)}
    make = {"adaptive": jdls.AdaptiveScale, "dynamic": jdls.DynamicScale}[scale]
    tx = optax.chain(jdls.wrap(optax.adam(1e-3), make(HIGH)))
    state = tx.init(params)
    x = jnp.ones((4, 3))
    once = _gradient_reads(jdls.retrying(loss, tx, retries=0), params, state, x)
    retried = _gradient_reads(jdls.retrying(loss, tx, retries=2), params, state, x)
    assert "reduce_and" not in retried and "reduce_or" not in retried
    assert retried == once
    # the largest magnitude is read only where the rule reads it (the adaptive rule)
    assert once.get("reduce_max") == (2 if scale == "adaptive" else None)


def test_a_finite_step_needs_no_more_memory_than_the_step_without_retries():
    """The loop carries the parameters and the optimizer state in place and each attempt is
    the whole step: its compiled temporaries are those of the step without retries, within a
    quarter of one gradient buffer (a loop around the backward pass alone held the gradients
    in its carry: 0.58 of a buffer more on this model)."""

    loss, params, gradient_buffer = tanh_stack()
    tx = jdls.wrap(optax.adam(1e-3), jdls.DynamicScale(HIGH))
    state = tx.init(params)
    x = jnp.ones((64, 256))

    def temporaries(retries):
        step = jax.jit(jdls.retrying(loss, tx, retries=retries), donate_argnums=(0, 1))
        compiled = step.lower(params, state, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    extra = (temporaries(2) - temporaries(0)) / gradient_buffer
    assert extra <= 0.25, f"{extra:.2f} gradient buffers more than without retries"
