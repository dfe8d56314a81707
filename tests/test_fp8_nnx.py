"""jdls.fp8 in Flax NNX: nnx.Linear(dot_general=...), nnx.Einsum(einsum_op=...), the jdls
NNX optimizer updating the FP8 sites (skip-aware) while AdamW sees the parameters only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import jitted_in_quick_run
from flax import nnx

import jdls
from jdls import fp8


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        recipe = fp8.DelayedScaling(4)
        self.a = nnx.Linear(8, 16, dot_general=fp8.nnx.DotGeneral(recipe), rngs=rngs)
        self.b = nnx.Linear(16, 2, dot_general=fp8.nnx.DotGeneral(recipe), rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.gelu(self.a(x)))


def _step(model, optimizer, x, y):
    loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    loss, grads = jdls.nnx.value_and_grad(loss_fn, jdls.get_scale(optimizer))(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.full  # 8 s; jdls.nnx.Optimizer updates sites in tests/test_nnx_sites.py's quick run
def test_nnx_optimizer_trains_and_updates_the_fp8_sites():
    model = _Mlp(nnx.Rngs(0))
    optimizer = jdls.nnx.Optimizer(
        model,
        jdls.wrap(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))),
        wrt=nnx.Param,
    )
    x = jax.random.normal(jax.random.key(1), (32, 8)) * 3.0
    y = jnp.sin(x[:, :2])
    step = nnx.jit(_step)
    losses = [float(step(model, optimizer, x, y)) for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]
    site = model.a.dot_general.site.get_value().value
    assert float(site.lhs.history[0]) == float(jnp.max(jnp.abs(x)))
    # no amax history (shape (4,); no parameter has it) in the optimizer's state
    assert not any(leaf.shape == (4,) for leaf in jax.tree.leaves(nnx.state(optimizer)))
    rows = fp8.telemetry(nnx.state(model, jdls.nnx.SiteVariable))
    assert len(rows) == 2


@pytest.mark.full
def test_nnx_skipped_step_keeps_the_history_and_waits():
    model = _Mlp(nnx.Rngs(0))
    optimizer = jdls.nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
    x = jnp.ones((4, 8)).at[0, 0].set(5.0)
    y = jnp.zeros((4, 2)).at[0, 0].set(jnp.inf)  # the loss's gradient overflows
    _step(model, optimizer, x, y)
    assert int(jdls.stats(optimizer).skipped_steps) == 1
    site = model.a.dot_general.site.get_value().value
    assert site.lhs.history.tolist() == [0.0] * 4
    assert float(site.pending.lhs.amax) == 5.0


def test_nnx_einsum_op_is_one_fp8_dot():
    op = fp8.nnx.Einsum(fp8.CurrentScaling())
    layer = nnx.Einsum("btd,df->btf", (8, 4), (4,), einsum_op=op, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 3, 8))
    expected = (
        fp8.dot_general(x, layer.kernel[...], (((2,), (0,)), ((), ())), site=op.site.get_value())
        + layer.bias[...]
    )
    np.testing.assert_array_equal(layer(x), expected)


@jitted_in_quick_run
@pytest.mark.full  # about 8 s; the wrap with MultiSteps (tests/test_fp8_accumulate.py) stays
def test_nnx_optimizer_with_multisteps_records_one_amax_per_applied_step(jit):
    """jdls.nnx.Optimizer with jdls.wrap(optax.MultiSteps(..., 2)): the FP8 sites are updated
    with "the step was applied", one history entry per applied step (the micro-batches'
    maximum)."""
    model = _Mlp(nnx.Rngs(0))
    tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), jdls.StaticScale(1.0))
    optimizer = jdls.nnx.Optimizer(model, tx, wrt=nnx.Param)
    scales = [1.0, 30.0, 7.0, 2.0]
    xs = [jax.random.normal(jax.random.key(i), (4, 8)) * s for i, s in enumerate(scales)]
    step = nnx.jit(_step) if jit else _step
    counts = []
    for x in xs:
        step(model, optimizer, x, jnp.zeros((4, 2)))
        history = np.asarray(model.a.dot_general.site.get_value().value.lhs.history)
        counts.append(int(np.count_nonzero(history)))
    assert counts == [0, 1, 1, 2]
    amax = [float(jnp.max(jnp.abs(x))) for x in xs]
    expected = sorted([max(amax[0], amax[1]), max(amax[2], amax[3])])
    assert sorted(history[history != 0].tolist()) == expected
