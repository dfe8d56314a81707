"""jdls.fp8 in Equinox: an FP8 Linear trained with jdls.wrap; the sites never reach optax."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls
import jdls.equinox
import jdls.fp8.equinox as fp8_eqx
from jdls import fp8


class _Mlp(eqx.Module):
    a: fp8_eqx.Linear
    b: fp8_eqx.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.a = fp8_eqx.Linear(8, 16, recipe=fp8.DelayedScaling(4), key=k1)
        self.b = fp8_eqx.Linear(16, 2, recipe=fp8.DelayedScaling(4), key=k2)

    def __call__(self, x):
        return self.b(jax.nn.gelu(self.a(x)))


@pytest.mark.full  # 6 s; tests/test_fp8_uses.py steps an Equinox FP8 model in the quick run
def test_equinox_step_updates_sites_and_trains():
    model = _Mlp(jax.random.key(0))
    tx = jdls.wrap(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (32, 8)) * 5.0
    y = jnp.sin(x[:, :2])

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @eqx.filter_jit
    def step(model, opt_state):
        # nothing FP8-specific: jdls.wrap keeps the sites from AdamW and clipping and returns
        # them updated, jdls.equinox.apply_updates puts them in place
        loss, grads = jdls.get_scale(opt_state).value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return jdls.equinox.apply_updates(model, updates, opt_state), opt_state, loss

    losses = []
    for _ in range(20):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    # the input amax history holds the (unchanged) input's amax, unscaled by the loss scale
    assert float(model.a.site.value.lhs.history[0]) == float(jnp.max(jnp.abs(x)))
    assert int(jdls.stats(opt_state).skipped_steps) == 0
    rows = fp8.telemetry(model)
    assert set(rows) == {"a/site", "b/site"}


@pytest.mark.full  # 5 s a case; the quick run retraces a kept forward pass in
# tests/test_fp8_loss_scale_paths.py
@with_and_without_jit
def test_the_partitioned_step_with_a_filter_jit_forward_reads_each_loss_scale(jit):
    """Equinox's own step form: the model partitioned outside, the loss closing over the
    static half and combining it with the differentiated one, the forward pass in an
    ``eqx.filter_jit`` that JAX keeps across steps. At two loss scales each dot's recorded
    output-gradient amax is the one at scale 1, jitted and not (an eager step's kept forward
    pass is traced again at a new scale)."""
    model, x = _Mlp(jax.random.key(0)), jax.random.normal(jax.random.key(1), (4, 8))
    params, static = eqx.partition(model, eqx.is_array)
    forward = eqx.filter_jit(lambda m, x: m(x))

    def amaxes(value):
        def loss(params):
            return jnp.sum(forward(eqx.combine(params, static), x) ** 2)

        grads = maybe_jit(jdls.StaticScale(value).value_and_grad(loss), jit)(params)[1]
        return {k: v["grad"]["amax"] for k, v in fp8.telemetry(grads).items()}

    want = amaxes(1.0)
    assert set(want) == {"a/site", "b/site"} and all(v > 0 for v in want.values())
    for value in (2.0**10, 2.0**12):
        assert amaxes(value) == want


def _train(tx, steps=6, jit=True):
    model = _Mlp(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (32, 8)) * 5.0
    y = jnp.sin(x[:, :2])

    def step(model, opt_state, x):
        loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
        _, grads = jdls.get_scale(opt_state).value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return jdls.equinox.apply_updates(model, updates, opt_state), opt_state

    if jit:
        step = eqx.filter_jit(step)
    for i in range(steps):
        model, opt_state = step(model, opt_state, x * (1.0 + i))
    return model, opt_state


@pytest.mark.full  # about 7 s; the Equinox step updating its sites stays in the quick run
@pytest.mark.parametrize("jit", [True, pytest.param(False, marks=pytest.mark.full)])
def test_transformations_after_the_wrap_leave_the_sites_alone(jit):
    """AdamW written with the learning rate after the wrap and optax's clip in front: the FP8
    sites' histories and the weights are those of jdls.wrap(optax.adamw(...)) bit for bit;
    nothing scales a site's state."""
    ref, _ = _train(jdls.wrap(optax.adamw(1e-2, weight_decay=0.1)), jit=jit)
    got, _ = _train(
        optax.chain(
            optax.clip_by_global_norm(1e6),
            jdls.wrap(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1))),
            optax.scale(-1e-2),
        ),
        jit=jit,
    )
    assert_bitwise_equal(got.a.site, ref.a.site)
    assert_bitwise_equal(got.b.site, ref.b.site)
    assert float(got.a.site.value.lhs.history[0]) == 6.0 * float(
        jnp.max(jnp.abs(jax.random.normal(jax.random.key(1), (32, 8)) * 5.0))
    )
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)


def _one_update(tx):
    model = _Mlp(jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    opt_state = tx.init(params)
    _, grads = jdls.get_scale(opt_state).value_and_grad(lambda m: jnp.sum(m(jnp.ones((2, 8)))))(
        model
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return model, updates, opt_state


@pytest.mark.full  # 7-15 s eager; tests/test_bad_input.py's sites-eqx-apply-updates stays quick
def test_equinox_apply_updates_on_sites_names_the_fix():
    """eqx.apply_updates cannot put a site's new state in place (it would add the update to
    the old state, or keep it): it fails, and the error names jdls.equinox.apply_updates,
    which gives the model jdls.wrap's new sites."""
    model, updates, opt_state = _one_update(jdls.wrap(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=re.escape("jdls.equinox.apply_updates(model, updates")):
        eqx.apply_updates(model, updates)
    new = jdls.equinox.apply_updates(model, updates, opt_state)
    assert float(new.a.site.value.lhs.history[0]) == 1.0  # the input's amax, recorded


@pytest.mark.full  # tests/test_bad_input.py's sites-decay-after-wrap stays in the quick run
def test_weight_decay_after_the_wrap_on_sites_names_the_fix():
    """optax.add_decayed_weights after the wrap would decay the parameters on a skipped step
    and meets a site's update: it fails, naming the chain with the decay inside the wrap."""
    tx = optax.chain(jdls.wrap(optax.scale_by_adam()), optax.add_decayed_weights(0.1))
    with pytest.raises(ValueError, match=re.escape("optax.add_decayed_weights(wd)")):
        _one_update(tx)


@pytest.mark.full  # about 4 s
def test_apply_updates_without_the_state_names_the_fix():
    model = _Mlp(jax.random.key(0))
    tx = jdls.wrap(optax.sgd(0.1))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    grads = jax.grad(lambda m: jnp.sum(m(jnp.ones((2, 8)))))(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    with pytest.raises(ValueError, match=re.escape("apply_updates(params, updates, opt_state)")):
        jdls.equinox.apply_updates(model, updates)
    other = jdls.wrap(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    with pytest.raises(
        ValueError, match="hold 2 sites, but no jdls.wrap in the optimizer state saw them"
    ):
        jdls.apply_updates(model, updates, other)


@pytest.mark.full  # about 4 s
@with_and_without_jit
def test_per_loss_scales_measure_an_equinox_models_fp8_sites(jit):
    """jdls.multi_loss_value_and_grad on an Equinox model (split as Equinox splits it, its
    sites kept whole): with backward="one" each FP8 site records what one global scale of 1
    records for the sum of the losses (the dots told their regions' scales); "per_loss" is
    refused, naming "one"."""
    model = _Mlp(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 8)) * 3.0

    def losses(m, x):
        y = m(x)
        return {"a": jnp.mean(y[:, 0] ** 2), "b": jnp.mean(y[:, 1] ** 2)}

    scales = {"a": jdls.StaticScale(2.0**2), "b": jdls.StaticScale(2.0**6)}
    one = maybe_jit(jdls.multi_loss_value_and_grad(losses, scales), jit)
    _, grads, finite = one(model, x)
    assert all(bool(f) for f in finite.values())
    total = lambda m, x: sum(losses(m, x).values())  # noqa: E731
    ref = maybe_jit(jdls.StaticScale(1.0).value_and_grad(total), jit)(model, x)[1]
    # the amaxes unscaled, each use recorded (the flushed fractions are the scaled
    # cotangents', fewer at the larger scales: what loss scaling is for)
    got, want = fp8.telemetry(grads), fp8.telemetry(ref)
    assert set(got) == set(want) == {"a/site", "b/site"}
    for row in want:
        for operand in ("lhs", "rhs", "grad"):
            for field in ("amax", "uses"):
                assert got[row][operand][field] == want[row][operand][field], (row, operand)
    # shaped as Equinox's gradients: None where the model holds no float array
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref)
    # "per_loss" cannot tell a dot its scale (one forward pass, a backward pass per scale)
    per_loss = jdls.multi_loss_value_and_grad(losses, scales, backward="per_loss")
    with pytest.raises(ValueError, match="Use backward='one'"):
        maybe_jit(per_loss, jit)(model, x)
