"""Silent traps and unclear errors found by porting real training code: restoring a Flax-example
checkpoint, lookahead, ``jax_debug_nans``, ``skip_with="select"`` on Python scalars, Flax
habits (a ``dynamic_scale`` field, ``axis_name=``, four-value unpacking), editing
``inject_hyperparams`` inside the wrap, policy strings, batched reprs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, enable_x64
from flax import serialization
from flax.training import dynamic_scale as flax_dynamic_scale
from flax.training import train_state

import jdls

# --------------------------------------------------------------------------------------------
# Item 13: a Flax-example checkpoint into a jdls state.
# --------------------------------------------------------------------------------------------


class FlaxExampleState(train_state.TrainState):
    """The TrainState of Flax's ImageNet example: a dynamic_scale beside a plain opt_state."""

    dynamic_scale: Any = None


def _trained_flax_state():
    tx = optax.sgd(0.1, momentum=0.9)
    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.zeros(3)}}
    dyn = flax_dynamic_scale.DynamicScale(growth_interval=3, scale=1024.0)
    state = FlaxExampleState.create(apply_fn=None, params=params, tx=tx, dynamic_scale=dyn)

    def loss_fn(p):
        return jnp.sum(p["dense"]["kernel"] ** 2) + jnp.sum(p["dense"]["bias"])

    for i in range(3):
        dyn, is_fin, _, grads = state.dynamic_scale.value_and_grad(loss_fn)(state.params)
        assert bool(is_fin)
        if i == 1:  # an overflow, as Flax's example handles it: only the scale changes
            dyn = state.dynamic_scale.replace(fin_steps=0, scale=state.dynamic_scale.scale / 2)
            state = state.replace(step=state.step + 1, dynamic_scale=dyn)
        else:
            state = state.apply_gradients(grads=grads, dynamic_scale=dyn)
    return tx, state


@pytest.mark.parametrize("source", ["object", "state_dict", "bytes"])
@pytest.mark.full
def test_from_flax_train_state_keeps_momentum_and_scale(source):
    tx, old = _trained_flax_state()
    assert int(old.dynamic_scale.fin_steps) == 1 and float(old.dynamic_scale.scale) == 512.0
    if source == "object":
        given: Any = old
    elif source == "state_dict":
        given = serialization.to_state_dict(old)
    else:
        given = serialization.msgpack_restore(serialization.to_bytes(old))
    options = {"growth_interval": 3}
    new = jdls.linen.from_train_state(
        given,
        jdls.wrap(tx, jdls.DynamicScale()),
        flax_scale_options=None if source == "object" else options,
    )
    assert isinstance(new, jdls.linen.TrainState)
    assert_bitwise_equal(new.params, old.params)
    assert_bitwise_equal(new.opt_state.inner_state, old.opt_state)  # momentum, exactly
    assert int(new.step) == int(old.step) == 3
    assert float(new.loss_scale) == 512.0
    assert int(new.scale.state.counter) == 1
    assert new.scale.rule == jdls.presets.flax(growth_interval=3).rule
    # The next steps follow Flax's rule: one more finite step is counted, the next grows.
    flax_scale = old.dynamic_scale
    for _ in range(3):
        flax_scale, *_ = flax_scale.value_and_grad(lambda p: jnp.sum(p))(jnp.ones(2))
        new = new.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, new.params))
        assert float(new.loss_scale) == float(flax_scale.scale)


def test_restoring_a_flax_checkpoint_into_a_jdls_state_is_loud():
    tx, old = _trained_flax_state()
    target = jdls.linen.TrainState.create(
        apply_fn=None, params=old.params, tx=jdls.wrap(tx, jdls.DynamicScale())
    )
    with pytest.raises(ValueError, match="inner_state") as info:
        serialization.from_state_dict(
            target, {**serialization.to_state_dict(old), "dynamic_scale": None}
        )
    assert "'0'" in str(info.value)  # the saved keys are named
    with pytest.raises(ValueError, match="do not match"):
        serialization.from_bytes(target, serialization.to_bytes(old))


def test_from_flax_train_state_names_a_mismatch():
    tx, old = _trained_flax_state()
    with pytest.raises(ValueError, match="does not match jdls.wrap"):
        jdls.linen.from_train_state(old, jdls.wrap(optax.adam(1e-3), jdls.DynamicScale()))
    with pytest.raises(ValueError, match="wrap the whole"):
        jdls.linen.from_train_state(
            old, optax.chain(jdls.clip(1.0), jdls.wrap(tx, jdls.DynamicScale()))
        )


# --------------------------------------------------------------------------------------------
# Item 15 (a): lookahead.
# --------------------------------------------------------------------------------------------


def test_wrap_lookahead_matches_optax_and_skips_exactly():
    inner = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    tx = jdls.wrap(inner, jdls.StaticScale(1.0))
    params = optax.LookaheadParams.init_synced({"w": jnp.arange(3.0)})
    ours, theirs = (params, tx.init(params)), (params, inner.init(params))
    step = jax.jit(lambda t, g, s, p: t.update(g, s, p), static_argnums=0)
    for i in range(5):
        g = {"w": jnp.full(3, float(i + 1))}
        u, s = step(tx, g, ours[1], ours[0])
        ours = (optax.apply_updates(ours[0], u), s)
        u, s = step(inner, g, theirs[1], theirs[0])  # jitted alike: XLA's fusion on both sides
        theirs = (optax.apply_updates(theirs[0], u), s)
        # An inf step in between changes nothing.
        u, s = step(tx, {"w": jnp.array([jnp.inf, 0.0, 0.0])}, ours[1], ours[0])
        skipped = optax.apply_updates(ours[0], u)
        assert_bitwise_equal(skipped, ours[0])
        assert_bitwise_equal(s.inner_state, ours[1].inner_state)
    assert_bitwise_equal(ours[0], theirs[0])
    assert_bitwise_equal(ours[1].inner_state, theirs[1])


# --------------------------------------------------------------------------------------------
# Item 15 (b): jax_debug_nans.
# --------------------------------------------------------------------------------------------


@pytest.fixture
def debug_nans():
    old = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", True)
    try:
        yield
    finally:
        jax.config.update("jax_debug_nans", old)


def test_init_and_finite_steps_under_debug_nans(debug_nans):
    tx = jdls.wrap(optax.adam(1e-3), jdls.DynamicScale(), track_nonfinite=True)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    state = jax.jit(tx.init)(params)
    assert float(jdls.stats(state).grad_norm) == 0.0  # 0 before the first step, not NaN
    _, state = jax.jit(tx.update)({"w": jnp.ones(3)}, state, params)
    assert float(jdls.stats(state).grad_norm) == pytest.approx(3**0.5)
    s = jdls.linen.TrainState.create(apply_fn=None, params=params, tx=tx)
    assert int(s.stats.skipped_steps) == 0


# --------------------------------------------------------------------------------------------
# Item 15 (c): skip_with="select" and Python scalars in the inner state.
# --------------------------------------------------------------------------------------------


def _python_scalar_state_tx():
    def init(params):
        del params
        return {"count": 0, "total": 0.0}

    def update(updates, state, params=None):
        del params
        new = {"count": state["count"] + 1, "total": state["total"] + 1.0}
        return jax.tree_util.tree_map(lambda g: -0.1 * g, updates), new

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("skip_with", ["select", "cond"])
@pytest.mark.full(keep=1)
def test_python_scalars_in_the_inner_state(skip_with):
    tx = jdls.wrap(_python_scalar_state_tx(), jdls.DynamicScale(), skip_with=skip_with)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.ones(2)}, state, params)  # outside jit
    assert int(state.inner_state["count"]) == 1
    _, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert int(state.inner_state["count"]) == 1 and float(state.inner_state["total"]) == 1.0
    _, state = jax.jit(tx.update)({"w": jnp.ones(2)}, state, params)
    assert int(state.inner_state["count"]) == 2


# --------------------------------------------------------------------------------------------
# Item 15 (d), (e): Flax habits.
# --------------------------------------------------------------------------------------------


def test_train_state_subclass_fields():
    class WithDynamicScale(jdls.linen.TrainState):
        dynamic_scale: Any = None

    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(64.0))
    s = WithDynamicScale.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    assert s.dynamic_scale is None and float(s.loss_scale) == 64.0
    s = s.apply_gradients(grads={"w": jnp.array([jnp.inf, 0.0])})
    assert float(s.scale.loss_scale) == 32.0 and int(s.stats.skipped_steps) == 1

    for name in ("scale", "loss_scale", "stats"):
        with pytest.raises(TypeError, match=f"declares the field\\(s\\) \\['{name}'\\]"):
            type("Bad", (jdls.linen.TrainState,), {"__annotations__": {name: Any}, name: None})


def test_value_and_grad_axis_name_points_to_wrap():
    scale = jdls.DynamicScale()
    with pytest.raises(TypeError, match=r"jdls.wrap\(inner, axis_name='batch'\)") as info:
        scale.value_and_grad(lambda w: jnp.sum(w), axis_name="batch")
    assert "docs/migration/flax.md" in str(info.value)
    state = jdls.linen.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=jdls.wrap(optax.sgd(0.1), jdls.DynamicScale())
    )
    with pytest.raises(TypeError, match="lax.pmean"):
        state.value_and_grad(lambda p: jnp.sum(p["w"]), axis_name="batch")


def test_flax_four_value_unpacking_fails_plainly():
    """Documented in docs/migration/flax.md: jdls returns (loss, grads)."""
    fn = jdls.DynamicScale().value_and_grad(lambda w: jnp.sum(w**2))
    with pytest.raises(ValueError, match="not enough values to unpack \\(expected 4, got 2\\)"):
        _dyn_scale, _is_fin, _loss, _grads = fn(jnp.ones(2))


# --------------------------------------------------------------------------------------------
# Item 15 (f): inject_hyperparams inside the wrap.
# --------------------------------------------------------------------------------------------


def _set_hyperparam(opt_state, name, value):
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)

    def edit(x):
        if isinstance(x, kinds):
            old = x.hyperparams[name]
            return x._replace(hyperparams={**x.hyperparams, name: jnp.asarray(value, old.dtype)})
        return x

    return jax.tree_util.tree_map(edit, opt_state, is_leaf=lambda x: isinstance(x, kinds))


def test_inject_hyperparams_recipe():
    """The recipe of docs/optax.md: the edited rate is the one the next step uses."""
    tx = optax.chain(
        jdls.clip(1.0),
        jdls.wrap(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5), jdls.DynamicScale()),
    )
    params = {"w": jnp.zeros(2)}
    state = _set_hyperparam(tx.init(params), "learning_rate", 0.25)
    step = jax.jit(tx.update)
    updates, state = step({"w": jnp.array([0.6, 0.8])}, state, params)
    np.testing.assert_array_equal(updates["w"], np.float32([-0.15, -0.2]))
    state = _set_hyperparam(state, "learning_rate", 1.0)
    updates, state = step({"w": jnp.array([0.6, 0.8])}, state, params)
    np.testing.assert_array_equal(updates["w"], np.float32([-0.6, -0.8]))
    assert jdls.stats(state).skipped_steps == 0


# --------------------------------------------------------------------------------------------
# Item 15 (g): str(policy) parses back.
# --------------------------------------------------------------------------------------------

_FORMATS = [
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "cbfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    jnp.float4_e2m1fn if hasattr(jnp, "float4_e2m1fn") else "float16",
    jdls.FloatFormat(5, 10),
    jdls.FloatFormat(4, 3),  # default name float8_e4m3 is also a native dtype's name
    jdls.FloatFormat(4, 3, bias=3),
    jdls.FloatFormat(3, 2, name="my-format"),
    jdls.cbfloat16,
]


@pytest.mark.parametrize("fmt", _FORMATS, ids=str)
def test_str_policy_parses_back(fmt):
    for policy in (
        jdls.Policy(param_dtype="float32", compute_dtype=fmt, output_dtype="float32"),
        jdls.Policy(param_dtype=fmt, compute_dtype=fmt, output_dtype=fmt),
    ):
        again = jdls.get_policy(str(policy))
        assert again == policy, (str(policy), again)
        assert str(again) == str(policy)


# --------------------------------------------------------------------------------------------
# Item 15 (h): batched scales print their values.
# --------------------------------------------------------------------------------------------


def test_batched_scales_repr_values():
    dynamic = jax.vmap(lambda f: jdls.DynamicScale(8.0).adjust(f))(jnp.array([True, False]))
    text = repr(dynamic)
    assert "loss_scale=[8.0, 4.0]" in text and "counter=[1, 0]" in text
    assert "Array" not in text
    n = 2
    static = jax.pmap(lambda x: jdls.StaticScale(4.0).adjust(x > 0))(jnp.zeros(n))
    assert repr(static) == "StaticScale([4.0, 4.0])"
    mapped = jax.pmap(lambda x: jdls.presets.deepspeed(init_scale=2.0, delayed_shift=1).adjust(x))(
        jnp.array([False, True])
    )
    assert "loss_scale=[1.0, 2.0]" in repr(mapped) and "Array" not in repr(mapped)


@pytest.mark.full
def test_float64_gradients_near_1e183_are_finite_and_clipped():
    """Finite float64 gradients whose squares overflow float64 (x64) are not an inf."""
    with enable_x64(True):
        tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), max_norm=1.0)
        params = {"w": jnp.zeros(3, jnp.float64), "v": jnp.zeros(2, jnp.float32)}
        grads = {"w": jnp.array([1e183, 2e183, 0.0]), "v": jnp.array([1e30, 3.0], jnp.float32)}
        updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
        assert bool(jdls.stats(state).finite)
        np.testing.assert_allclose(np.asarray(updates["w"]), [-1 / 5**0.5, -2 / 5**0.5, 0.0])
        assert np.all(np.asarray(updates["v"]) == 0)  # far below float32's range once clipped
        _, state = tx.update(
            {"w": jnp.array([1e183, jnp.inf, 0.0]), "v": grads["v"]}, tx.init(params), params
        )
        assert not bool(jdls.stats(state).finite)


def test_check_on_batched_scales():
    """``check()`` reads vmapped and pmapped counters (sums them) instead of failing."""
    scale = jdls.presets.deepspeed(init_scale=1.0, delayed_shift=1)
    batched = jax.vmap(lambda f: scale.adjust(f))(jnp.array([True, False, True]))
    with pytest.raises(jdls.MinimumScaleError, match="1 step"):
        batched.check()
    fine = jax.vmap(lambda f: scale.adjust(f))(jnp.array([True, True]))
    assert fine.check() is fine
