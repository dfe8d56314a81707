"""jdls.fp8.AdaptiveScaling, and FP8 output-gradient scales that follow the loss scale."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls
from jdls import fp8

DN = (((1,), (0,)), ((), ()))
E5M2_MAX = 57344.0
E4M3_MAX = 448.0


def _feed(recipe, amaxes, role="grad", jit=True):
    """The states after each amax of ``amaxes`` (the recipe's update, one step each)."""
    update = maybe_jit(
        lambda s, a: recipe.update(s, fp8.Measurement(a, 0.0 * a, 0.0 * a), role), jit
    )
    state, states = recipe.init(role), []
    for a in amaxes:
        state = update(state, jnp.float32(a))
        states.append(state)
    return states


def _level(state, fmax=E5M2_MAX, headroom=2.0):
    """The amax the state's scale is for (the scale maps headroom x level to fmax)."""
    return float(state.scale) * fmax / headroom


@with_and_without_jit
def test_a_spike_is_clipped_in_its_step_and_forgotten_after_it(jit):
    amaxes = [2.0, 2.2, 1.9, 2.1, 2e4, 2.0, 2.3, 2e4, 2.2]
    states = _feed(fp8.AdaptiveScaling(window=8), amaxes, jit=jit)
    levels = [_level(s) for s in states]
    # after each spike the scale is for the ordinary steps' largest amax, not the spike
    assert levels[4] == pytest.approx(2.2, rel=1e-6)
    assert levels[5] == pytest.approx(2.1, rel=1e-6)  # the newest 4: 2.0, spike, 2.1, 1.9
    assert levels[7] == pytest.approx(2.3, rel=1e-6)
    assert max(levels) < 3.0


@with_and_without_jit
def test_a_jump_is_followed_from_the_second_step(jit):
    amaxes = [1.0, 1.1, 0.9, 1.0, 100.0, 105.0, 98.0, 101.0]
    levels = [_level(s) for s in _feed(fp8.AdaptiveScaling(window=8), amaxes, jit=jit)]
    assert levels[4] == pytest.approx(1.1, rel=1e-6)  # one outlier: a spike so far
    assert levels[5] == pytest.approx(105.0, rel=1e-6)  # two in a row: a jump
    assert levels[6] == pytest.approx(105.0, rel=1e-6)  # the run of outliers keeps it
    assert levels[7] == pytest.approx(105.0, rel=1e-6)


def test_a_fall_brings_the_scale_down_within_recent_steps():
    window = 8
    amaxes = [100.0] * window + [1.0] * window
    levels = [_level(s) for s in _feed(fp8.AdaptiveScaling(window=window, recent=3), amaxes)]
    # the level is the largest of the newest 3: the old amaxes count for 2 more steps
    assert levels[window + 1] == pytest.approx(100.0)
    assert levels[window + 2] == pytest.approx(1.0)


def test_frequent_outliers_are_part_of_the_distribution():
    """Outlier channels in every other batch: not spikes, so the scale covers them (where a
    spike filter would clip every second step)."""
    amaxes = [1.0, 100.0] * 8
    levels = [_level(s) for s in _feed(fp8.AdaptiveScaling(), amaxes)]
    assert levels[1] == pytest.approx(1.0)  # one outlier so far: maybe a spike
    assert all(level == pytest.approx(100.0) for level in levels[3:])  # from the second on


def test_steady_noise_and_slow_drift_never_clip():
    """Headroom 2 over the window's largest amax: step-to-step noise of 30% and a drift of
    5% a step up never exceed the scale."""
    rng = np.random.default_rng(0)
    amaxes = 1.05 ** np.arange(200) * rng.uniform(0.7, 1.3, 200)
    states = _feed(fp8.AdaptiveScaling(), amaxes)
    used = [1.0] + [float(s.scale) * E5M2_MAX for s in states[:-1]]  # the largest value
    clipped = [a > u for a, u in zip(amaxes[1:], used[1:], strict=True)]
    assert not any(clipped)
    over = [u / a for a, u in zip(amaxes[1:], used[1:], strict=True)]
    assert max(over) < 8  # and never more than 8x above


def test_the_scale_of_the_forward_roles_uses_their_formats():
    (state,) = _feed(fp8.AdaptiveScaling(), [3.5], role="lhs")
    assert float(state.scale) == pytest.approx(2 * 3.5 / E4M3_MAX)
    assert state.history.tolist()[:2] == [3.5, 0.0]


def test_inf_nan_and_zero_amaxes_do_not_enter_the_history():
    states = _feed(fp8.AdaptiveScaling(window=4), [3.0, np.inf, np.nan, 0.0, 5.0])
    assert states[3].history.tolist() == [3.0, 0.0, 0.0, 0.0]
    assert float(states[3].scale) == float(states[0].scale)
    assert states[4].history.tolist() == [5.0, 3.0, 0.0, 0.0]


def test_before_any_amax_the_scale_is_one():
    (state,) = _feed(fp8.AdaptiveScaling(), [0.0])
    assert float(state.scale) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 2}, "window must be an int >= 3"),
        ({"headroom": 0.0}, "headroom must be > 0"),
        ({"outlier": 1.0}, "outlier must be > 1"),
        ({"window": 8, "recent": 9}, r"recent must be an int in \[1, window=8\]"),
    ],
)
def test_bad_configuration_says_what_to_pass(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fp8.AdaptiveScaling(**kwargs)


def test_a_stack_of_sites_updates_layer_by_layer():
    recipe = fp8.AdaptiveScaling(window=4)
    stack = fp8.init(recipe, stack=(3,))
    xs = jnp.stack([jnp.full((2, 4), v) for v in (1.0, 10.0, 100.0)])

    def loss(stack):
        def body(h, layer):
            x, site = layer
            return h + jnp.sum(fp8.dot_general(x, jnp.ones((4, 2)), DN, site=site)), None

        return jax.lax.scan(body, 0.0, (xs, stack))[0]

    stack = jax.jit(lambda s: jdls.update_sites(s, jax.grad(loss)(s)))(stack)
    assert stack.value.lhs.history[:, 0].tolist() == [1.0, 10.0, 100.0]
    np.testing.assert_allclose(
        np.asarray(stack.value.lhs.scale), 2 * np.array([1.0, 10.0, 100.0]) / E4M3_MAX
    )


# --------------------------------------------------------------------------------------------
# The output gradient's scale follows the loss scale.
# --------------------------------------------------------------------------------------------


class _Mlp(nn.Module):
    recipe: fp8.Recipe

    @nn.compact
    def __call__(self, x):
        for width in (16, 16, 4):
            x = nn.Dense(
                width, dot_general_cls=functools.partial(fp8.linen.DotGeneral, recipe=self.recipe)
            )(x)
            x = jnp.tanh(x) if width != 4 else x
        return x


def _train(recipe, scale, steps=6, jit=True):
    model = _Mlp(recipe)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (steps, 8, 12))
    t = jax.random.normal(k[1], (steps, 8, 4))
    variables = model.init(k[2], x[0])
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=jdls.wrap(optax.sgd(0.1), scale),
        sites=variables["jdls"],
    )  # fmt: skip

    def step(state, x, t):
        def loss_fn(v):
            return jnp.mean((state.apply_fn(v, x) - t) ** 2)

        _, grads = state.value_and_grad(loss_fn)(state.variables)
        return state.apply_gradients(grads=grads)

    step = maybe_jit(step, jit)
    scales = []
    for i in range(steps):
        scales.append(float(state.loss_scale))
        state = step(state, x[i], t[i])
    return state, scales


@pytest.mark.parametrize(
    ("recipe", "jit"),
    [
        pytest.param(fp8.DelayedScaling(4), True, id="max-jit"),
        pytest.param(fp8.DelayedScaling(4, "most_recent"), True, id="most_recent-jit"),
        pytest.param(fp8.AdaptiveScaling(window=4), True, id="adaptive-jit"),
        # eager once: the recipes differ only in their history's reduction, the same code
        # jitted or not (each eager case took 45-55 s of the full suite)
        pytest.param(fp8.AdaptiveScaling(window=4), False, id="adaptive-eager"),
    ],
)
@pytest.mark.full  # about 12 s a jitted case; the backed-off loss scale test stays quick
def test_a_growing_loss_scale_changes_nothing_of_the_fp8_training(recipe, jit):
    """A loss scale that grows every step (2**0 .. 2**5, powers of two) gives the parameters
    and FP8 states of a run without loss scaling, bit for bit: the output gradient's history
    holds unscaled amaxes and its scale follows the loss scale."""
    growing = jdls.DynamicScale(1.0, growth_interval=1)
    scaled, scales = _train(recipe, growing, jit=jit)
    assert scales == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    plain, _ = _train(recipe, jdls.NoOpScale(), jit=jit)
    assert_bitwise_equal(scaled.params, plain.params)
    assert_bitwise_equal(scaled.sites, plain.sites)


@pytest.mark.full  # 7-11 s; the quick run measures unscaled amaxes in tests/test_fp8_loss_scale_paths.py
def test_a_backed_off_loss_scale_leaves_the_history_in_unscaled_amaxes():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 2))
    site = fp8.init(fp8.DelayedScaling(4))

    def loss(site):
        return jnp.sum(fp8.dot_general(x, w, DN, site=site) * 0.25)

    for loss_scale in (2.0**10, 2.0**3):
        grads = jdls.StaticScale(loss_scale).value_and_grad(loss)(site)[1]
        new = jdls.update_sites(site, grads)
        assert new.value.grad.history.tolist()[0] == 0.25  # not 0.25 * loss_scale
        assert float(new.value.grad.scale) == pytest.approx(0.25 / E5M2_MAX, rel=1e-6)


def test_float16_loss_scaled_past_its_cap_measures_the_seeded_scale():
    """A float16 loss is seeded with at most 2**15 (its cotangent must be finite): the dot
    divides by that, not by the larger loss scale."""
    x, w = jnp.ones((2, 4), jnp.float16), jnp.ones((4, 2), jnp.float16)
    site = fp8.init(fp8.DelayedScaling(4))

    def loss(site):
        return jnp.sum(fp8.dot_general(x, w, DN, site=site) * jnp.float16(0.25))

    grads = jax.jit(jdls.StaticScale(2.0**20).value_and_grad(loss))(site)[1]
    assert jax.jit(jdls.update_sites)(site, grads).value.grad.history.tolist()[0] == 0.25


def test_without_jdls_value_and_grad_the_cotangent_is_measured_as_it_is():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 2))
    site = fp8.init(fp8.DelayedScaling(4))
    g = jax.grad(lambda s: jnp.sum(fp8.dot_general(x, w, DN, site=s) * 8.0))(site)
    assert jdls.update_sites(site, g).value.grad.history.tolist()[0] == 8.0


@pytest.mark.parametrize(
    "recipe",
    # 6 s; AdaptiveScaling's own tests above stay in the quick run
    [fp8.DelayedScaling(4), pytest.param(fp8.AdaptiveScaling(), marks=pytest.mark.full)],
)
def test_a_fresh_site_keeps_the_range_the_loss_scale_gives_small_gradients(recipe):
    """Before its first amax, a site's scale (1) applies to the gradient as the backward
    pass computes it: an output gradient of 1e-6 at a loss scale of 2**15 is 0.03 there, an
    e5m2 normal, not flushed (below e5m2's smallest subnormal, 2**-16, unscaled). From then
    on the history is in unscaled amaxes."""
    x, w = jnp.ones((2, 4)), jnp.ones((4, 2))
    site = fp8.init(recipe)

    def loss(site):
        return jnp.sum(fp8.dot_general(x, w, DN, site=site) * 1e-6)

    grad_fn = jax.jit(jdls.StaticScale(2.0**15).value_and_grad(loss))
    for _ in range(2):
        site = jax.jit(jdls.update_sites)(site, grad_fn(site)[1])
        assert float(site.value.meter.grad.flushed) == 0.0
        assert float(site.value.grad.history[0]) == pytest.approx(1e-6)
