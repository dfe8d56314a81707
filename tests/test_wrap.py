"""jdls.wrap: skipping non-finite steps exactly, adjusting the scale, statistics, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    INF,
    NAN,
    apply_step,
    assert_bitwise_equal,
    loss_scale_of,
    maybe_jit,
    random_like,
    run_steps,
    with_and_without_jit,
)

import jdls


def small_params():
    # -0.0 on purpose: a skipped step must leave it -0.0 (p + (-0.0) == p bit for bit).
    return {
        "dense": {"kernel": jnp.array([[0.5, -0.0], [1.5, -2.0]]), "bias": jnp.array([-0.0, 0.25])},
        "scale": jnp.array(1.0),
    }


def poison(grads, rng):
    """Put an inf, -inf or NaN in one element of one random leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    k = rng.integers(len(leaves))
    bad = np.array(leaves[k])
    bad.reshape(-1)[rng.integers(bad.size)] = rng.choice([INF, -INF, NAN])
    leaves[k] = jnp.asarray(bad)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def scheduled_adam():
    # A schedule that changes every step: a skipped step must not advance it.
    return optax.adamw(optax.linear_schedule(1e-1, 1e-3, transition_steps=10), weight_decay=0.1)


@with_and_without_jit
def test_the_default_scale_is_adaptive_and_measures_the_gradients(jit):
    tx = jdls.wrap(optax.sgd(0.1))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    assert jdls.get_scale(state) == jdls.AdaptiveScale()
    grads = {"w": jnp.array([2.0**-20, -(2.0**-30)])}
    _, state = maybe_jit(tx.update, jit)(grads, state, params)
    # float16's max is 2**15.9993, margin 6 bits: 2**-20 * 2**(15 - 6 + 20) <= 2**(16 - 6)
    assert loss_scale_of(state) == 2.0 ** (15 - 6 + 20)
    _, state = maybe_jit(tx.update, jit)({"w": jnp.array([jnp.inf, 0.0])}, state, params)
    assert loss_scale_of(state) == 2.0 ** (15 - 6 + 20 - 1)  # an overflow backs off a bit


def test_the_default_scale_trains_through_a_flax_train_state():
    state = jdls.linen.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=jdls.wrap(optax.sgd(0.1))
    )
    state = jax.jit(state.apply_gradients)(grads={"w": jnp.array([2.0**-10, 0.0])})
    assert float(state.loss_scale) == 2.0 ** (15 - 6 + 10)
    assert int(state.step) == 1 and int(state.stats.skipped_steps) == 0


@with_and_without_jit
@pytest.mark.full(keep=1)
def test_finite_step_is_the_inner_step(jit):
    params = small_params()
    grads = random_like(0, params)
    tx = jdls.wrap(optax.adam(0.1), jdls.DynamicScale())
    updates, state = maybe_jit(tx.update, jit)(grads, tx.init(params), params)
    inner = optax.adam(0.1)
    expected, expected_state = jax.jit(inner.update)(grads, inner.init(params), params)
    assert_bitwise_equal(updates, expected)
    assert_bitwise_equal(state.inner_state, expected_state)
    stats = jdls.stats(state)
    assert bool(stats.finite) and not bool(stats.skipped)
    assert int(stats.skipped_steps) == 0 and int(stats.consecutive_skips) == 0
    assert loss_scale_of(state) == 2.0**15
    np.testing.assert_allclose(float(stats.grad_norm), float(optax.tree.norm(grads)), 1e-6)
    assert int(state.scale.state.counter) == 1


@with_and_without_jit
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.full(keep=1)
def test_nonfinite_step_is_skipped(bad, jit):
    params = small_params()
    grads = random_like(1, params)
    grads["dense"]["kernel"] = grads["dense"]["kernel"].at[1, 0].set(bad)
    tx = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(1024.0))
    state0 = tx.init(params)
    updates, state = maybe_jit(tx.update, jit)(grads, state0, params)
    # Zero updates, -0.0, so that apply_updates returns the params bit for bit.
    for u in jax.tree_util.tree_leaves(updates):
        assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))
    assert_bitwise_equal(optax.apply_updates(params, updates), params)
    assert_bitwise_equal(state.inner_state, state0.inner_state)
    stats = jdls.stats(state)
    assert bool(stats.skipped) and not bool(stats.finite)
    assert loss_scale_of(state) == 512.0
    assert int(stats.skipped_steps) == 1 and int(stats.consecutive_skips) == 1
    assert np.isnan(float(stats.grad_norm)) == np.isnan(bad)
    assert np.isinf(float(stats.grad_norm)) == np.isinf(bad)


@with_and_without_jit
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.full(keep=1)
def test_skips_are_exact(seed, skip_with, jit):
    """Injected inf/NaN steps leave params and inner state as if those steps never were."""
    rng = np.random.default_rng(seed)
    params = small_params()
    n_steps = 6
    bad_steps = set(rng.choice(n_steps, size=2, replace=False).tolist())
    grads_seq = [random_like(100 * seed + t, params) for t in range(n_steps)]
    poisoned = [poison(g, rng) if t in bad_steps else g for t, g in enumerate(grads_seq)]
    clean = [g for t, g in enumerate(grads_seq) if t not in bad_steps]

    tx = jdls.wrap(scheduled_adam(), jdls.DynamicScale(2.0**10), skip_with=skip_with)

    p_bad, s_bad = run_steps(tx, poisoned, params, jit=jit)
    p_ref, s_ref = run_steps(tx, clean, params, jit=jit)
    assert_bitwise_equal(p_bad, p_ref)
    assert_bitwise_equal(s_bad.inner_state, s_ref.inner_state)
    assert int(s_bad.inner_state[0].count) == n_steps - len(bad_steps)
    stats = jdls.stats(s_bad)
    assert int(stats.skipped_steps) == len(bad_steps)
    assert loss_scale_of(s_bad) == 2.0**10 / 2 ** len(bad_steps)
    assert bool(stats.finite) == ((n_steps - 1) not in bad_steps)


@with_and_without_jit
def test_a_skipped_step_leaves_the_params_with_weight_decay_inside_the_wrap(jit):
    """AdamW as the docs show it, the whole chain inside the wrap (``jdls.wrap(optax.adamw)``
    or ``jdls.wrap(optax.chain(scale_by_adam, add_decayed_weights, scale))``): a skipped step
    leaves every parameter and state bit for bit. The decay after the wrap, which the docs
    warn against, shrinks the parameters on a skipped step (``1.0 -> 0.99``)."""
    lr, wd = 0.1, 0.1
    params = small_params()
    grads = random_like(3, params)
    grads["dense"]["kernel"] = grads["dense"]["kernel"].at[1, 0].set(INF)
    inside = {
        "adamw": jdls.wrap(optax.adamw(lr, weight_decay=wd)),
        "chain": jdls.wrap(
            optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(wd), optax.scale(-lr))
        ),
    }
    for tx in inside.values():
        state0 = tx.init(params)
        updates, state = maybe_jit(tx.update, jit)(grads, state0, params)
        assert bool(jdls.stats(state).skipped)
        assert_bitwise_equal(optax.apply_updates(params, updates), params)
        assert_bitwise_equal(state.inner_state, state0.inner_state)

    after = optax.chain(
        jdls.wrap(optax.scale_by_adam()), optax.add_decayed_weights(wd), optax.scale(-lr)
    )
    updates, state = maybe_jit(after.update, jit)(grads, after.init(params), params)
    assert bool(jdls.stats(state).skipped)
    assert float(optax.apply_updates(params, updates)["scale"]) == np.float32(1 - lr * wd)


@pytest.mark.full
def test_skips_match_the_plain_inner_optimizer():
    """The reference may also be the inner optimizer alone, jitted, on the clean steps.

    Updates and state are compared as returned: when ``apply_updates`` is compiled in the
    same ``jit`` as a plain optimizer, XLA may fuse the two and contract ``p + u`` into a
    fused multiply-add, which is not what happens behind the wrap's ``lax.cond``.
    """
    params = small_params()
    grads_seq = [random_like(t, params) for t in range(4)]
    bad = poison(grads_seq[1], np.random.default_rng(0))
    inner = scheduled_adam()
    tx = jdls.wrap(inner, jdls.DynamicScale())
    wrapped, plain = jax.jit(tx.update), jax.jit(inner.update)
    apply = jax.jit(optax.apply_updates)

    p, s = params, tx.init(params)
    for g in [grads_seq[0], bad, *grads_seq[1:]]:
        u, s = wrapped(g, s, p)
        p = apply(p, u)
    q, r = params, inner.init(params)
    for g in grads_seq:
        u, r = plain(g, r, q)
        q = apply(q, u)
    assert_bitwise_equal(p, q)
    assert_bitwise_equal(s.inner_state, r)


def test_consecutive_skips_and_growth():
    params = {"w": jnp.zeros(2)}
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(8.0, growth_interval=2))
    step = jax.jit(tx.update)
    state = tx.init(params)
    ok, bad = {"w": jnp.ones(2)}, {"w": jnp.array([1.0, NAN])}
    seen = []
    for g in [bad, bad, ok, ok, ok, bad]:
        _, state = step(g, state, params)
        s = jdls.stats(state)
        seen.append((loss_scale_of(state), int(s.consecutive_skips), int(s.skipped_steps)))
    assert seen == [(4, 1, 1), (2, 2, 2), (2, 0, 2), (4, 0, 2), (4, 0, 2), (2, 1, 3)]


@pytest.mark.parametrize("kind", ["static", "noop"])
def test_static_and_noop_scales_still_skip(kind):
    scale = jdls.StaticScale(128.0) if kind == "static" else jdls.NoOpScale()
    params = {"w": jnp.zeros(2)}
    tx = jdls.wrap(optax.sgd(1.0), scale)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.array([INF, 1.0])}, state, params)
    assert_bitwise_equal(optax.apply_updates(params, updates), params)
    stats = jdls.stats(state)
    assert bool(stats.skipped) and int(stats.skipped_steps) == 1
    assert loss_scale_of(state) == float(scale.loss_scale)
    updates, state = jax.jit(tx.update)({"w": jnp.array([2.0, 1.0])}, state, params)
    np.testing.assert_array_equal(updates["w"], [-2.0, -1.0])
    assert type(jdls.get_scale(state)) is type(scale)


def test_extra_args_reach_the_inner_transformation():
    def update(updates, state, params=None, *, factor):
        return jax.tree_util.tree_map(lambda g: g * factor, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = jdls.wrap(inner, jdls.DynamicScale())
    params = {"w": jnp.zeros(2)}
    updates, _ = jax.jit(tx.update)({"w": jnp.ones(2)}, tx.init(params), params, factor=3.0)
    np.testing.assert_array_equal(updates["w"], [3.0, 3.0])

    # Non-array extra arguments (a function, a Python number, an unhashable list) too.
    def update2(updates, state, params=None, *, fn, offset, more):
        return jax.tree_util.tree_map(lambda g: fn(g) + offset + sum(more), updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update2)
    tx = jdls.wrap(inner, jdls.DynamicScale())
    for offset in (1.0, 2.0):
        updates, _ = tx.update(
            {"w": jnp.ones(2)}, tx.init(params), params, fn=jnp.exp, offset=offset, more=[1.0]
        )
        np.testing.assert_allclose(updates["w"], np.exp(1.0) + offset + 1.0, rtol=1e-6)
    # An inner transformation without extra-args support ignores them.
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params, factor=3.0)
    np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])


def test_cerebras_wrap_brings_its_clipping():
    # Clipping is the wrap's now: presets.cerebras builds the scale only, and
    # presets.cerebras_wrap(inner, max_gradient_norm=c) is Cerebras' optimizer step.
    params = {"w": jnp.zeros(2)}
    tx = jdls.presets.cerebras_wrap(optax.sgd(1.0), max_gradient_norm=1.0)
    updates, state = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-7)
    assert float(jdls.stats(state).grad_norm) == 5.0
    # The same as wrapping with the preset's scale, clipping and the float32-norm test.
    scale = jdls.presets.cerebras()
    tx = jdls.wrap(optax.sgd(1.0), scale, max_norm=1.0, skip_norm_overflow=True)
    expected, expected_state = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
    assert_bitwise_equal(updates, expected)
    assert_bitwise_equal(state, expected_state)
    # The scale alone brings no clipping; the wrap's max_norm decides.
    tx = jdls.wrap(optax.sgd(1.0), scale)
    updates, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-3.0, -4.0])
    tx = jdls.wrap(optax.sgd(1.0), scale, max_norm=10.0)
    updates, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(params), params)
    np.testing.assert_array_equal(updates["w"], [-3.0, -4.0])
    with pytest.raises(TypeError, match="cerebras_wrap"):
        jdls.presets.cerebras(max_gradient_norm=1.0)


def test_finite_gradients_whose_squares_overflow_are_not_skipped():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    step = jax.jit(tx.update)
    # Squares overflow float32 (1e40), the norm (2e20) does not.
    grads = {"a": jnp.array([1e20, -1e20]), "b": jnp.array([1e20, 1e20])}
    updates, state = step(grads, tx.init(params), params)
    assert not bool(jdls.stats(state).skipped)
    np.testing.assert_allclose(float(jdls.stats(state).grad_norm), 2e20, rtol=1e-6)
    np.testing.assert_array_equal(updates["a"], -grads["a"])
    # Even the norm overflows (4 * 3e38 > float32 max): finite, norm inf.
    grads = {"a": jnp.array([3e38, -3e38]), "b": jnp.array([3e38, 3e38])}
    _, state = step(grads, state, params)
    assert not bool(jdls.stats(state).skipped)
    assert float(jdls.stats(state).grad_norm) == INF


def test_float16_gradients_are_checked_in_float32():
    params = {"w": jnp.zeros(2, jnp.float16)}
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    grads = {"w": jnp.array([300.0, 400.0], jnp.float16)}  # squares overflow float16
    updates, state = tx.update(grads, tx.init(params), params)
    assert not bool(jdls.stats(state).skipped)
    assert float(jdls.stats(state).grad_norm) == 500.0
    assert updates["w"].dtype == jnp.float16


def test_init_copies_the_scale_so_donation_is_safe():
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(64.0))
    params = {"w": jnp.zeros(2)}
    step = jax.jit(tx.update, donate_argnums=(1,))
    step({"w": jnp.ones(2)}, tx.init(params), params)
    assert float(tx.init(params).scale.loss_scale) == 64.0  # still alive


def test_stats_before_any_step():
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    s = jdls.stats(tx.init({"w": jnp.zeros(2)}))
    assert bool(s.finite) and int(s.skipped_steps) == 0
    assert float(s.grad_norm) == 0.0 and s.nonfinite is None  # not NaN: jax_debug_nans


def test_stats_inside_jit():
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    params = {"w": jnp.zeros(2)}

    @jax.jit
    def step(state, grads):
        _, state = tx.update(grads, state, params)
        return state, jdls.stats(state).skipped

    state, skipped = step(tx.init(params), {"w": jnp.array([NAN, 0.0])})
    assert bool(skipped)
    state, skipped = step(state, {"w": jnp.array([1.0, 0.0])})
    assert not bool(skipped)


@with_and_without_jit
# --------------------------------------------------------------------------------------------
# track_nonfinite: which leaves were non-finite.
# --------------------------------------------------------------------------------------------


@pytest.mark.full(keep=1)
def test_names_the_leaves(jit):
    params = {
        "params": {
            "dense": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros(2)},
            "head": {"kernel": jnp.zeros(3)},
        },
        "count": jnp.array(0, jnp.int32),
    }
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    grads["params"]["dense"]["kernel"] = jnp.array([[1.0, INF], [0.0, 0.0]])
    grads["params"]["head"]["kernel"] = jnp.array([NAN, 0.0, 0.0])
    tx = jdls.wrap(optax.identity(), jdls.DynamicScale(), track_nonfinite=True)
    _, state = maybe_jit(tx.update, jit)(grads, tx.init(params), params)
    assert jdls.nonfinite_paths(state) == [
        "['params']['dense']['kernel']",
        "['params']['head']['kernel']",
    ]
    flags = jdls.stats(state).nonfinite
    assert jax.tree_util.tree_structure(flags) == jax.tree_util.tree_structure(params)
    assert not bool(flags["count"]) and not bool(flags["params"]["dense"]["bias"])
    # A finite step clears the flags.
    _, state = maybe_jit(tx.update, jit)(jax.tree_util.tree_map(jnp.ones_like, params), state)
    assert jdls.nonfinite_paths(state) == []


def test_overflowing_squares_are_not_flagged():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    tx = jdls.wrap(optax.identity(), jdls.DynamicScale(), track_nonfinite=True)
    grads = {"a": jnp.array([3e38, 3e38]), "b": jnp.array([1.0, -INF])}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert jdls.nonfinite_paths(state) == ["['b']"]


def test_needs_tracking():
    tx = jdls.wrap(optax.identity(), jdls.DynamicScale())
    with pytest.raises(ValueError, match="track_nonfinite=True"):
        jdls.nonfinite_paths(tx.init({"w": jnp.zeros(1)}))


# --------------------------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------------------------


def test_gradients_not_matching_params():
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"only in params: \['b'\]"):
        tx.update({"a": jnp.zeros(2)}, state, params)
    with pytest.raises(ValueError, match=r"only in gradients: \['c'\]"):
        tx.update({"a": jnp.zeros(2), "b": jnp.zeros(2), "c": jnp.zeros(1)}, state, params)
    with pytest.raises(
        ValueError, match=r"gradients: PyTreeDef\(\(\*, \*\)\); params: PyTreeDef\(\[\*, \*\]\)"
    ):
        tx.update((jnp.zeros(2), jnp.zeros(2)), state, [jnp.zeros(2), jnp.zeros(2)])


@with_and_without_jit
def test_integer_bool_and_none_leaves(jit):
    params = {"w": jnp.zeros(2), "n": jnp.array([1, 2]), "flag": jnp.array(True), "x": None}
    tx = jdls.wrap(optax.identity(), jdls.DynamicScale(), track_nonfinite=True)
    grads = {
        "w": jnp.ones(2),
        "n": jnp.array([7, 2**31 - 1]),
        "flag": jnp.array(False),
        "x": None,
    }
    updates, state = maybe_jit(tx.update, jit)(grads, tx.init(params), params)
    assert updates["x"] is None
    assert_bitwise_equal(updates, grads)
    assert not bool(jdls.stats(state).skipped)
    assert float(jdls.stats(state).grad_norm) == float(np.sqrt(np.float32(2.0)))
    bad = {**grads, "w": jnp.array([INF, 1.0])}
    updates, state = maybe_jit(tx.update, jit)(bad, state, params)
    assert bool(jdls.stats(state).skipped)
    assert updates["n"].dtype == jnp.int32 and updates["n"].tolist() == [0, 0]
    assert updates["flag"].dtype == jnp.bool_ and not bool(updates["flag"])
    assert jdls.nonfinite_paths(state) == ["['w']"]


@with_and_without_jit
def test_empty_tree(jit):
    tx = jdls.wrap(optax.adam(1e-3), jdls.DynamicScale(), max_norm=1.0, track_nonfinite=True)
    updates, state = maybe_jit(tx.update, jit)({}, tx.init({}), {})
    assert updates == {}
    assert bool(jdls.stats(state).finite) and float(jdls.stats(state).grad_norm) == 0.0


def test_dynamic_scale_must_be_a_loss_scale():
    with pytest.raises(TypeError, match="optimizer is the first argument"):
        jdls.wrap(optax.sgd(1.0), optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"pass jdls.DynamicScale\(...\), not the class"):
        jdls.wrap(optax.sgd(1.0), jdls.DynamicScale)
    with pytest.raises(TypeError, match=r"jdls.StaticScale\(128.0\)"):
        jdls.wrap(optax.sgd(1.0), 128.0)
    with pytest.raises(TypeError, match="must be a jdls loss scale"):
        jdls.wrap(optax.sgd(1.0), "dynamic")


def test_inner_must_be_a_transformation():
    with pytest.raises(TypeError, match="comes first"):
        jdls.wrap(jdls.DynamicScale())
    with pytest.raises(TypeError, match="call it to build"):
        jdls.wrap(optax.adam)
    with pytest.raises(TypeError, match="optax transformation"):
        jdls.wrap(42)


def test_bad_options():
    with pytest.raises(ValueError, match="skip_with"):
        jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), skip_with="where")
    for bad in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="max_norm"):
            jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), max_norm=bad)
    with pytest.raises(TypeError, match="track_nonfinite"):
        jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), track_nonfinite=1)
    with pytest.raises(ValueError, match="sharded=True"):
        jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), max_norm=1.0, axis_name="i")
    with pytest.raises(ValueError, match="needs an axis_name"):
        jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), sharded=True)


def test_foreign_state():
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    with pytest.raises(TypeError, match="WrapState"):
        tx.update({"w": jnp.ones(1)}, optax.sgd(1.0).init({"w": jnp.ones(1)}))


@with_and_without_jit
@pytest.mark.full(keep=1)
def test_cerebras_wrap_decides_finiteness_from_the_float32_norm(jit):
    """Cerebras calls a step non-finite when its float32 global norm is inf, even if every
    gradient element is finite (``presets.cerebras_wrap`` sets ``skip_norm_overflow=True``);
    the other rules, and a plain wrap of the Cerebras scale, look at the elements only."""
    params = {"w": jnp.zeros(4)}
    big = {"w": jnp.full(4, 1e20)}  # finite, but the float32 sum of squares overflows
    for tx, skipped in [
        (jdls.presets.cerebras_wrap(optax.sgd(1.0)), True),
        (jdls.wrap(optax.sgd(1.0), jdls.presets.cerebras(), skip_norm_overflow=True), True),
        (jdls.wrap(optax.sgd(1.0), jdls.presets.cerebras()), False),
        (jdls.wrap(optax.sgd(1.0), jdls.DynamicScale()), False),
    ]:
        state0 = tx.init(params)
        updates, state = maybe_jit(tx.update, jit)(big, state0, params)
        stats = jdls.stats(state)
        assert bool(stats.skipped) is skipped
        assert float(stats.grad_norm) == pytest.approx(2e20, rel=1e-6)  # known either way
        expected = -0.0 if skipped else -1e20
        np.testing.assert_array_equal(updates["w"], np.full(4, expected, np.float32))
        backed_off = loss_scale_of(state) < loss_scale_of(state0)
        assert backed_off is skipped


# --------------------------------------------------------------------------------------------
# skip_norm_overflow, a non-finite value, max_consecutive_skips.
# --------------------------------------------------------------------------------------------


@with_and_without_jit
@pytest.mark.parametrize("skip_norm_overflow", [True, False])
@pytest.mark.full(keep=1)
def test_skip_norm_overflow(skip_norm_overflow, jit):
    """Finite gradients whose float32 sum of squares overflows: skipped with
    ``skip_norm_overflow=True`` (Cerebras' test), taken without it."""
    params = {"w": jnp.zeros(4), "b": jnp.array([-0.0, 1.0])}
    tx = jdls.wrap(
        optax.adam(0.1), jdls.DynamicScale(1024.0), skip_norm_overflow=skip_norm_overflow
    )
    step = maybe_jit(tx.update, jit)
    state0 = tx.init(params)
    big = {"w": jnp.full(4, 1e20), "b": jnp.array([1.0, 2.0])}  # every element finite
    assert bool(jdls.all_finite(big))
    updates, state = step(big, state0, params)
    stats = jdls.stats(state)
    assert float(stats.grad_norm) == pytest.approx(2e20, rel=1e-6)  # known either way
    if skip_norm_overflow:
        assert bool(stats.skipped) and int(stats.skipped_steps) == 1
        assert_bitwise_equal(optax.apply_updates(params, updates), params)
        assert_bitwise_equal(state.inner_state, state0.inner_state)
        assert loss_scale_of(state) == 512.0
    else:
        assert not bool(stats.skipped) and int(stats.skipped_steps) == 0
        inner = optax.adam(0.1)
        expected, expected_state = jax.jit(inner.update)(big, inner.init(params), params)
        assert_bitwise_equal(updates, expected)
        assert_bitwise_equal(state.inner_state, expected_state)
        assert loss_scale_of(state) == 1024.0
    # Gradients whose squares do not overflow are taken either way.
    updates, state = step({"w": jnp.full(4, 1e10), "b": jnp.ones(2)}, state, params)
    assert not bool(jdls.stats(state).skipped)
    # And a real inf is skipped either way.
    _, state = step({"w": jnp.array([1.0, INF, 0.0, 0.0]), "b": jnp.ones(2)}, state, params)
    assert bool(jdls.stats(state).skipped)


def value_recorder():
    """An inner transformation taking ``value``: its state counts steps and sums the values."""

    def init(params):
        del params
        return (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def update(updates, state, params=None, *, value):
        del params
        count, total = state
        updates = jax.tree_util.tree_map(lambda g: -0.1 * g, updates)
        return updates, (count + 1, total + value)

    return optax.GradientTransformationExtraArgs(init, update)


@with_and_without_jit
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.full
def test_nonfinite_value_skips_the_step_exactly(bad, jit):
    """A non-finite loss given as ``value`` makes the step non-finite, even when every
    gradient is finite: params and inner state are left bit for bit as they were."""
    params = small_params()
    grads = random_like(3, params)
    for inner in (value_recorder(), optax.polyak_sgd(max_learning_rate=0.1)):
        tx = jdls.wrap(inner, jdls.DynamicScale(1024.0))
        step = maybe_jit(tx.update, jit)
        # A finite value: the inner step.
        updates, state = step(grads, tx.init(params), params, value=jnp.float32(2.0))
        assert not bool(jdls.stats(state).skipped)
        expected, expected_state = inner.update(
            grads, inner.init(params), params, value=jnp.float32(2.0)
        )
        np.testing.assert_allclose(optax.tree.norm(updates), optax.tree.norm(expected), rtol=1e-6)
        assert jax.tree_util.tree_structure(state.inner_state) == jax.tree_util.tree_structure(
            expected_state
        )
        p1 = optax.apply_updates(params, updates)
        # A non-finite value, finite gradients: skipped exactly.
        updates, new = step(grads, state, p1, value=jnp.float32(bad))
        assert bool(jdls.all_finite(grads))
        stats = jdls.stats(new)
        assert bool(stats.skipped) and int(stats.skipped_steps) == 1
        assert int(stats.consecutive_skips) == 1
        assert_bitwise_equal(optax.apply_updates(p1, updates), p1)
        assert_bitwise_equal(new.inner_state, state.inner_state)
        assert loss_scale_of(new) == 512.0
    # The recorder's state did advance on the finite step.
    tx = jdls.wrap(value_recorder(), jdls.DynamicScale())
    _, state = maybe_jit(tx.update, jit)(grads, tx.init(params), params, value=jnp.float32(2.0))
    assert int(state.inner_state[0]) == 1 and float(state.inner_state[1]) == 2.0


@with_and_without_jit
def test_max_consecutive_skips(jit):
    """The third skip in a row raises, naming the count; a finite step resets the count."""
    params = {"w": jnp.zeros(2)}
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), max_consecutive_skips=3)
    step = maybe_jit(tx.update, jit)
    ok, bad = {"w": jnp.ones(2)}, {"w": jnp.array([NAN, 1.0])}
    state = tx.init(params)
    # Two skips, a finite step, two skips: never three in a row.
    for g, count in [(bad, 1), (bad, 2), (ok, 0), (bad, 1), (bad, 2)]:
        _, state = step(g, state, params)
        jax.block_until_ready(state)
        assert int(jdls.stats(state).consecutive_skips) == count
    with pytest.raises(jax.errors.JaxRuntimeError, match="skipped 3 steps in a row"):
        _, state = step(bad, state, params)
        jax.block_until_ready(state)
    # Without the limit, the same steps go on.
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    step = maybe_jit(tx.update, jit)
    state = tx.init(params)
    for _ in range(4):
        _, state = step(bad, state, params)
    assert int(jdls.stats(state).consecutive_skips) == 4


# --------------------------------------------------------------------------------------------
# Half-precision and complex parameters.
# --------------------------------------------------------------------------------------------


@with_and_without_jit
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: optax.adam(1e-2),
        lambda: optax.sgd(1e-2, momentum=0.9),
        lambda: optax.adamw(1e-2, weight_decay=0.1),
    ],
    ids=["adam", "sgd-momentum", "adamw"],
)
@pytest.mark.full(keep=1)
def test_half_precision_params(make_inner, dtype, jit):
    """16-bit params, float32 gradients (as ``value_and_grad`` unscales them): two finite
    steps, then a non-finite one that leaves params and inner state bit for bit."""
    params = jax.tree_util.tree_map(lambda p: p.astype(dtype), small_params())
    tx = jdls.wrap(make_inner(), jdls.DynamicScale(1024.0))
    step = maybe_jit(apply_step(tx), jit)
    state = tx.init(params)

    def float_dtypes(tree):
        return {
            x.dtype
            for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)
        }

    assert float_dtypes(state.inner_state) == {jnp.dtype(dtype)}
    for t in range(2):
        before = params
        params, state = step(params, state, random_like(10 + t, params))
        assert not bool(jdls.stats(state).skipped)
        assert float_dtypes(params) == {jnp.dtype(dtype)}
        assert float_dtypes(state.inner_state) == {jnp.dtype(dtype)}
        assert not all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(
                jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(before), strict=True
            )
        )
    bad = random_like(12, params)
    bad["dense"]["kernel"] = bad["dense"]["kernel"].at[0, 1].set(INF)
    new_params, new_state = step(params, state, bad)
    assert bool(jdls.stats(new_state).skipped)
    assert_bitwise_equal(new_params, params)
    assert_bitwise_equal(new_state.inner_state, state.inner_state)
    assert loss_scale_of(new_state) == 512.0


@with_and_without_jit
@pytest.mark.parametrize("make_inner", [lambda: optax.sgd(0.1), lambda: optax.adam(0.1)])
@pytest.mark.full(keep=1)
def test_complex_params_skipped_exactly(make_inner, jit):
    """complex64 params: a skipped step keeps them bit for bit, a -0.0 imaginary (and real)
    part included."""
    params = {
        "z": jnp.array(
            [complex(1.0, -0.0), complex(-0.0, -0.0), complex(-0.0, 2.0)], jnp.complex64
        ),
        "w": jnp.array([-0.0, 1.0]),
    }
    assert np.signbit(np.asarray(params["z"]).imag).tolist() == [True, True, False]
    tx = jdls.wrap(make_inner(), jdls.DynamicScale(1024.0))
    step = maybe_jit(apply_step(tx), jit)
    state = tx.init(params)
    grads = {"z": jnp.array([1 + 1j, 2 - 1j, -1j], jnp.complex64), "w": jnp.ones(2)}
    for bad in (complex(INF, 0.0), complex(0.0, NAN)):
        poisoned = {**grads, "z": grads["z"].at[1].set(bad)}
        new_params, new_state = step(params, state, poisoned)
        assert bool(jdls.stats(new_state).skipped)
        assert_bitwise_equal(new_params, params)
        assert_bitwise_equal(new_state.inner_state, state.inner_state)
    # A finite step moves them.
    new_params, new_state = step(params, state, grads)
    assert not bool(jdls.stats(new_state).skipped)
    assert new_params["z"].dtype == jnp.complex64
    assert not np.array_equal(np.asarray(new_params["z"]), np.asarray(params["z"]))
