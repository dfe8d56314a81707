"""Flax integration: linen TrainState (plain and jdls.linen.TrainState) and the NNX Optimizer."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import as_pure, assert_bitwise_equal, maybe_jit, with_and_without_jit
from flax import nnx, serialization
from flax.training import train_state

import jdls

X = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10
Y = jnp.ones((4, 2), jnp.float32)


# --------------------------------------------------------------------------------------------
# linen
# --------------------------------------------------------------------------------------------


def make_linen(state_cls=train_state.TrainState, scale=None, inner=None):
    model = nn.Dense(2)
    params = model.init(jax.random.key(0), X)["params"]
    inner = optax.sgd(0.1) if inner is None else inner
    scale = jdls.DynamicScale(1024.0, growth_interval=1) if scale is None else scale
    state = state_cls.create(apply_fn=model.apply, params=params, tx=jdls.wrap(inner, scale))
    return state, inner


def linen_loss(state):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, X) - Y) ** 2)

    return loss_fn


@with_and_without_jit
def test_linen_trainstate_finite_step_is_the_inner_update(jit):
    state, inner = make_linen()
    grads = jax.grad(linen_loss(state))(state.params)
    new = maybe_jit(lambda s, g: s.apply_gradients(grads=g), jit)(state, grads)

    updates, inner_state = inner.update(grads, inner.init(state.params), state.params)
    assert_bitwise_equal(new.params, optax.apply_updates(state.params, updates))
    wrap_state = new.opt_state
    assert isinstance(wrap_state, jdls.WrapState)
    assert_bitwise_equal(wrap_state.inner_state, inner_state)
    assert int(new.step) == 1
    assert float(jdls.get_scale(new).loss_scale) == 2048.0  # grown (interval 1)
    assert int(jdls.stats(new).skipped_steps) == 0


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.full(keep=1)
def test_linen_trainstate_nonfinite_step_is_skipped_exactly(bad):
    state, _ = make_linen(inner=optax.adam(0.1))
    grads = jax.grad(linen_loss(state))(state.params)
    state = state.apply_gradients(grads=grads)  # one real step first: Adam moments nonzero
    bad_grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(bad), grads)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, bad_grads)

    assert_bitwise_equal(new.params, state.params)
    assert_bitwise_equal(new.opt_state.inner_state, state.opt_state.inner_state)
    assert float(jdls.get_scale(new).loss_scale) == 1024.0  # 2048 halved
    stats = jdls.stats(new)
    assert int(stats.skipped_steps) == 1
    assert not bool(stats.finite)
    assert int(new.step) == 2  # Flax counts every apply_gradients call, skipped or not


def test_jdls_trainstate_properties_match_the_functions():
    state, _ = make_linen(jdls.linen.TrainState)
    assert isinstance(state, train_state.TrainState)
    assert isinstance(state.scale, jdls.DynamicScale)
    assert float(state.loss_scale) == 1024.0
    assert state.loss_scale.dtype == jnp.float32
    assert int(state.stats.skipped_steps) == 0
    grads = jax.grad(linen_loss(state))(state.params)
    state = state.apply_gradients(grads=grads)
    assert isinstance(state, jdls.linen.TrainState)  # replace keeps the class
    assert float(state.loss_scale) == float(jdls.get_scale(state.opt_state).loss_scale)
    assert float(state.loss_scale) == 2048.0
    assert state.stats == jdls.stats(state.opt_state)


def test_jdls_trainstate_value_and_grad_is_exact_in_float32():
    state, _ = make_linen(jdls.linen.TrainState)
    loss_fn = linen_loss(state)
    loss, grads = jax.jit(lambda s: s.value_and_grad(loss_fn)(s.params))(state)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(state.params)
    assert float(loss) == float(ref_loss)  # the unscaled loss
    assert_bitwise_equal(grads, ref_grads)  # power-of-two scale: exact in float32


def test_jdls_trainstate_value_and_grad_has_aux_and_argnums():
    state, _ = make_linen(jdls.linen.TrainState)

    def loss_fn(params, x):
        pred = state.apply_fn({"params": params}, x)
        return jnp.sum(pred), pred

    (loss, pred), (g_params, g_x) = state.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state.params, X
    )
    (ref_loss, ref_pred), (ref_gp, ref_gx) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True
    )(state.params, X)
    assert float(loss) == float(ref_loss)
    assert_bitwise_equal(pred, ref_pred)
    assert_bitwise_equal(g_params, ref_gp)
    assert_bitwise_equal(g_x, ref_gx)


def test_jdls_trainstate_rescues_float16_underflow():
    """A loss whose float16 gradients underflow: zero without scaling, right with jdls."""
    params = {"w": jnp.ones(3, jnp.float32)}
    x = jnp.array([1.0, 2.0, 3.0], jnp.float32)

    def loss_fn(p):  # d/dw = 1e-8 * x: below float16's smallest subnormal (6e-8) / 2
        return 1e-8 * jnp.sum(p["w"].astype(jnp.float16) * x.astype(jnp.float16)).astype(
            jnp.float32
        )

    unscaled = jax.grad(loss_fn)(params)["w"]
    assert unscaled.tolist() == [0.0, 0.0, 0.0]
    state = jdls.linen.TrainState.create(
        apply_fn=None, params=params, tx=jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(2.0**15))
    )
    _, grads = state.value_and_grad(loss_fn)(state.params)
    assert grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(grads["w"], 1e-8 * np.asarray(x), rtol=1e-3)


def test_jdls_trainstate_serialization_round_trip():
    state, _ = make_linen(jdls.linen.TrainState, scale=jdls.DynamicScale(64.0, growth_interval=1))
    state = state.apply_gradients(grads=jax.grad(linen_loss(state))(state.params))
    template, _ = make_linen(
        jdls.linen.TrainState, scale=jdls.DynamicScale(64.0, growth_interval=1)
    )
    restored = serialization.from_bytes(template, serialization.to_bytes(state))
    assert isinstance(restored, jdls.linen.TrainState)
    assert float(restored.loss_scale) == 128.0
    assert restored.scale.rule == state.scale.rule
    assert_bitwise_equal(restored.params, state.params)
    assert int(restored.step) == 1


class BNDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, momentum=0.5)(nn.Dense(2)(x))


class BNTrainState(jdls.linen.TrainState):
    batch_stats: Any


def make_bn(state_cls):
    model = BNDense()
    variables = model.init(jax.random.key(0), X)
    return state_cls.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=jdls.wrap(optax.adam(0.1), jdls.DynamicScale(1024.0, growth_interval=1)),
    )


def bn_loss(state, x):
    def loss_fn(params):
        out, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
        )
        return jnp.mean((out - Y) ** 2), updates["batch_stats"]

    return loss_fn


class PlainBNTrainState(train_state.TrainState):
    batch_stats: Any


def bn_step_apply_gradients(state, x):
    """``jdls.linen.TrainState.apply_gradients(grads=..., batch_stats=...)`` keeps them on a skip."""
    (_, new_bs), grads = state.value_and_grad(bn_loss(state, x), has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=new_bs), new_bs


def bn_step_keep_if_skipped(state, x):
    """A plain Flax TrainState: ``jdls.keep_if_skipped`` selects the batch stats."""
    scale = jdls.get_scale(state.opt_state)
    (_, new_bs), grads = scale.value_and_grad(bn_loss(state, x), has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads)
    kept = jdls.keep_if_skipped(new.opt_state, new_bs, state.batch_stats)
    return new.replace(batch_stats=kept), new_bs


@with_and_without_jit
@pytest.mark.parametrize(
    ("state_cls", "step"),
    [(BNTrainState, bn_step_apply_gradients), (PlainBNTrainState, bn_step_keep_if_skipped)],
    ids=["apply_gradients", "keep_if_skipped"],
)
@pytest.mark.full(keep=1)
def test_batch_stats_are_kept_on_a_skipped_step(state_cls, step, jit):
    """A linen BatchNorm model: a skipped step leaves the running statistics bit for bit as
    they were (an inf batch would poison them for good); a finite step takes the new ones."""
    step = maybe_jit(step, jit)
    state = make_bn(state_cls)

    # A finite step: the batch statistics the forward pass computed.
    new, computed = step(state, X)
    assert bool(jdls.stats(new.opt_state).finite)
    assert_bitwise_equal(new.batch_stats, computed)
    assert not np.array_equal(
        new.batch_stats["BatchNorm_0"]["mean"], state.batch_stats["BatchNorm_0"]["mean"]
    )
    state = new

    # A batch holding an inf: the step is skipped, params and batch stats kept bit for bit.
    new, computed = step(state, X.at[1, 2].set(jnp.inf))
    assert bool(jdls.stats(new.opt_state).skipped)
    assert not bool(jdls.all_finite(computed))  # what the forward pass would have stored
    assert_bitwise_equal(new.batch_stats, state.batch_stats)
    assert_bitwise_equal(new.params, state.params)
    assert_bitwise_equal(new.opt_state.inner_state, state.opt_state.inner_state)
    assert int(new.step) == int(state.step) + 1  # Flax counts every call
    state = new

    # The next finite step takes the new statistics again.
    new, computed = step(state, X * 2)
    assert bool(jdls.stats(new.opt_state).finite)
    assert_bitwise_equal(new.batch_stats, computed)
    assert bool(jdls.all_finite(new.batch_stats))


def test_trainstate_without_wrap_says_what_to_do():
    state = jdls.linen.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match=r"jdls\.wrap"):
        _ = state.loss_scale


# --------------------------------------------------------------------------------------------
# NNX
# --------------------------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: bool = False):
        self.dense = nnx.Linear(3, 2, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs) if dropout else None
        self.norm = nnx.BatchNorm(2, rngs=rngs) if dropout else None

    def __call__(self, x):
        y = self.dense(x)
        if self.dropout is not None:
            y = self.norm(self.dropout(y))
        return y


def nnx_loss(model, x=X):
    return jnp.mean((model(x) - Y) ** 2)


def make_nnx(scale=None, dropout=False, inner=None):
    model = Net(nnx.Rngs(0), dropout=dropout)
    scale = jdls.DynamicScale(1024.0, growth_interval=1) if scale is None else scale
    inner = optax.sgd(0.1) if inner is None else inner
    optimizer = nnx.Optimizer(model, jdls.wrap(inner, scale), wrt=nnx.Param)
    return model, optimizer


def params_of(model):
    return as_pure(nnx.state(model, nnx.Param))


def test_nnx_scale_is_discoverable():
    _, optimizer = make_nnx()
    for where in (optimizer, optimizer.opt_state, as_pure(optimizer.opt_state)):
        scale = jdls.get_scale(where)
        assert isinstance(scale, jdls.DynamicScale)
        assert float(scale.loss_scale) == 1024.0
        assert int(jdls.stats(where).skipped_steps) == 0
    pure = jdls.get_scale(as_pure(optimizer.opt_state))
    assert isinstance(pure.loss_scale, jax.Array)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_nnx_optimizer_finite_step_is_the_inner_update(jit):
    model, optimizer = make_nnx()
    before = params_of(model)
    ref_loss, ref_grads = nnx.value_and_grad(nnx_loss)(nnx.clone(model))

    def step(model, optimizer):
        scale = jdls.get_scale(optimizer)
        loss, grads = jdls.nnx.value_and_grad(nnx_loss, scale)(model)
        optimizer.update(model, grads)
        return loss, grads

    loss, grads = (nnx.jit(step) if jit else step)(model, optimizer)
    assert float(loss) == float(ref_loss)
    assert_bitwise_equal(as_pure(grads), as_pure(ref_grads))

    inner = optax.sgd(0.1)
    updates, _ = inner.update(as_pure(ref_grads), inner.init(before), before)
    assert_bitwise_equal(params_of(model), optax.apply_updates(before, updates))
    stats = jdls.stats(as_pure(optimizer.opt_state))
    assert float(jdls.get_scale(as_pure(optimizer.opt_state)).loss_scale) == 2048.0
    assert int(stats.skipped_steps) == 0
    assert int(optimizer.step[...]) == 1


def test_nnx_value_and_grad_is_exact_in_float32():
    model, optimizer = make_nnx()
    scale = jdls.get_scale(optimizer)
    loss, grads = jdls.nnx.value_and_grad(nnx_loss, scale)(model)
    ref_loss, ref_grads = nnx.value_and_grad(nnx_loss)(model)
    assert float(loss) == float(ref_loss)
    assert_bitwise_equal(as_pure(grads), as_pure(ref_grads))


def test_nnx_optimizer_nonfinite_step_is_skipped_exactly():
    model, optimizer = make_nnx(inner=optax.adam(0.1))
    scale = jdls.get_scale(optimizer)
    _, grads = jdls.nnx.value_and_grad(nnx_loss, scale)(model)
    optimizer.update(model, grads)  # one real step first
    params = params_of(model)
    opt_state = as_pure(optimizer.opt_state)

    bad_x = X.at[0, 0].set(jnp.inf)
    scale = jdls.get_scale(optimizer)
    _, grads = jdls.nnx.value_and_grad(lambda m: nnx_loss(m, bad_x), scale)(model)
    assert not bool(jdls.all_finite(as_pure(grads)))
    optimizer.update(model, grads)

    assert_bitwise_equal(params_of(model), params)
    new_state = as_pure(optimizer.opt_state)
    assert_bitwise_equal(new_state.inner_state, opt_state.inner_state)
    stats = jdls.stats(new_state)
    assert float(jdls.get_scale(new_state).loss_scale) == 1024.0  # 2048 halved
    assert int(stats.skipped_steps) == 1
    assert not bool(stats.finite)


def test_nnx_stats_and_scale_are_snapshots():
    model, optimizer = make_nnx()
    before = jdls.stats(optimizer)
    pure = jdls.get_scale(as_pure(optimizer.opt_state))
    scale = jdls.get_scale(optimizer)
    assert not isinstance(scale.loss_scale, nnx.Variable)
    assert not isinstance(before.consecutive_skips, nnx.Variable)
    _, grads = jdls.nnx.value_and_grad(nnx_loss, scale)(model)
    optimizer.update(model, grads)
    # Values taken before the update do not follow the optimizer's Variables.
    assert float(pure.loss_scale) == 1024.0
    assert float(scale.loss_scale) == 1024.0
    assert float(jdls.get_scale(optimizer).loss_scale) == 2048.0  # a new call sees the update
    assert float(before.grad_norm) == 0.0  # the stats from before the first step
    assert float(jdls.stats(optimizer).grad_norm) > 0.0


def test_nnx_value_and_grad_with_rngs_and_batch_stats():
    model, optimizer = make_nnx(dropout=True)
    scale = jdls.get_scale(optimizer)
    with pytest.raises(TypeError, match=r"NNX object .* jdls\.nnx\.value_and_grad\(fun, scale\)"):
        scale.value_and_grad(nnx_loss)(model)
    mean_before = np.asarray(model.norm.mean[...])
    loss, grads = jdls.nnx.value_and_grad(nnx_loss, scale)(model)
    assert np.isfinite(float(loss))
    assert not np.array_equal(np.asarray(model.norm.mean[...]), mean_before)  # BN updated
    assert set(nnx.to_pure_dict(grads)) == {"dense", "norm"}
    optimizer.update(model, grads)
    assert int(jdls.stats(as_pure(optimizer.opt_state)).skipped_steps) == 0


def test_nnx_value_and_grad_has_aux_argnums_and_float16():
    model = nnx.Linear(3, 2, dtype=jnp.float16, rngs=nnx.Rngs(0))  # float32 params
    optimizer = nnx.Optimizer(
        model, jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**15)), wrt=nnx.Param
    )
    scale = jdls.get_scale(optimizer)

    def loss_fn(model, x):
        pred = model(x)  # float16
        return 1e-8 * jnp.sum(pred.astype(jnp.float32)), pred

    (loss, pred), (g_model, g_x) = jdls.nnx.value_and_grad(
        loss_fn, scale, argnums=(0, 1), has_aux=True
    )(model, X)
    assert pred.dtype == jnp.float16
    assert float(loss) == pytest.approx(1e-8 * float(jnp.sum(pred.astype(jnp.float32))))
    assert g_x.dtype == jnp.float32 and g_x.shape == X.shape
    kernel = as_pure(g_model)["kernel"]
    assert kernel.dtype == jnp.float32
    # d loss / d kernel[i, j] = 1e-8 * sum_b x[b, i]: lost in float16 without the scale
    expected = 1e-8 * np.tile(np.asarray(X).sum(0)[:, None], (1, 2))
    np.testing.assert_allclose(kernel, expected, rtol=2e-3)
    _, (g_plain, _) = nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(model, X)
    assert float(jnp.abs(as_pure(g_plain)["kernel"]).max()) == 0.0
    optimizer.update(model, g_model)
    assert int(jdls.stats(as_pure(optimizer.opt_state)).skipped_steps) == 0


def test_nnx_value_and_grad_rejects_a_non_scale():
    with pytest.raises(TypeError, match="jdls loss scale"):
        jdls.nnx.value_and_grad(nnx_loss, 1024.0)


def test_set_nnx_scale_replaces_value_and_rule_then_trains():
    model, optimizer = make_nnx()
    jdls.nnx.set_scale(optimizer, jdls.presets.pytorch(init_scale=8.0, growth_interval=1))
    scale = jdls.get_scale(as_pure(optimizer.opt_state))
    assert float(scale.loss_scale) == 8.0
    assert scale.rule == jdls.presets.pytorch(growth_interval=1).rule

    @nnx.jit
    def step(model, optimizer):
        scale = jdls.get_scale(optimizer)
        _, grads = jdls.nnx.value_and_grad(nnx_loss, scale)(model)
        optimizer.update(model, grads)

    step(model, optimizer)
    scale = jdls.get_scale(as_pure(optimizer.opt_state))
    assert float(scale.loss_scale) == 16.0  # the new rule's growth
    assert scale.rule == jdls.presets.pytorch(growth_interval=1).rule


def test_set_nnx_scale_errors():
    _, optimizer = make_nnx()
    with pytest.raises(TypeError, match="jdls loss scale"):
        jdls.nnx.set_scale(optimizer, 8.0)
    with pytest.raises(TypeError, match="nnx.Optimizer"):
        jdls.nnx.set_scale({"w": 1}, jdls.DynamicScale())
    model = Net(nnx.Rngs(0))
    plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"jdls\.wrap"):
        jdls.nnx.set_scale(plain, jdls.DynamicScale())
