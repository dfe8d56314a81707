"""jdls.fp8 in Equinox: an FP8 Linear trained with jdls.wrap; the sites never reach optax."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

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
        return jdls.equinox.apply_updates(model, updates), opt_state, loss

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
