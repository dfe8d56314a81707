"""jdls.wrap on 8 (virtual CPU) devices: pmap, shard_map and jit over a Mesh.

Every device must take the same decision and, with clipping, use the same global norm; one
device's overflow makes all of them skip. ``tests/conftest.py`` provides the 8 devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import INF, NAN, apply_step, assert_bitwise_equal
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

N = 8

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason="needs 8 devices (conftest.py)")


def local_grads(seed, bad_device=None, value=INF):
    """Per-device gradients, stacked on a leading axis of size 8."""
    rng = np.random.default_rng(seed)
    g = {
        "w": rng.standard_normal((N, 4)).astype(np.float32),
        "b": rng.standard_normal((N, 2)).astype(np.float32),
    }
    if bad_device is not None:
        g["w"][bad_device, 1] = value
    return jax.tree_util.tree_map(jnp.asarray, g)


def replicate(tree):
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (N, *jnp.shape(x))), tree)


PARAMS = {"w": jnp.array([1.0, -2.0, 0.5, 0.0]), "b": jnp.array([0.25, -0.0])}


# --------------------------------------------------------------------------------------------
# pmap.
# --------------------------------------------------------------------------------------------


def make_step(tx, mean=True):
    def step(params, state, g):
        if mean:
            g = lax.pmean(g, "i")
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, jdls.stats(state)

    return jax.pmap(step, axis_name="i")


def test_data_parallel_after_pmean():
    tx = jdls.wrap(
        optax.adam(0.1),
        jdls.DynamicScale(),
        max_norm=0.5,
        axis_name="i",
        sharded=False,
        track_nonfinite=True,
    )
    step = make_step(tx)
    params, state = replicate(PARAMS), jax.pmap(tx.init)(replicate(PARAMS))
    g = local_grads(0)
    params, state, stats = step(params, state, g)
    # Same as one device with the mean gradient (pmean sums in another order: allclose).
    mean = jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0), g)
    ref_tx = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(), max_norm=0.5)
    ref_u, _ = jax.jit(ref_tx.update)(mean, ref_tx.init(PARAMS), PARAMS)
    np.testing.assert_allclose(stats.grad_norm, float(optax.tree.norm(mean)), rtol=1e-6)
    for k in PARAMS:
        np.testing.assert_allclose(
            params[k], np.broadcast_to(PARAMS[k] + ref_u[k], (N, *PARAMS[k].shape)), rtol=1e-6
        )
    # One device's inf reaches every device through pmean: all skip, identically.
    before = params
    params, state, stats = step(params, state, local_grads(1, bad_device=3))
    np.testing.assert_array_equal(stats.skipped, [True] * N)
    np.testing.assert_array_equal(jdls.get_scale(state).loss_scale, [2.0**14] * N)
    assert_bitwise_equal(params, before)
    assert jdls.nonfinite_paths(state) == ["['w']"]


def test_the_decision_is_agreed_without_pmean():
    g = local_grads(2, bad_device=5, value=NAN)
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), axis_name="i")
    _, _, stats = make_step(tx, mean=False)(
        replicate(PARAMS), jax.pmap(tx.init)(replicate(PARAMS)), g
    )
    np.testing.assert_array_equal(stats.skipped, [True] * N)
    assert np.all(np.isnan(stats.grad_norm))  # not known without `sharded`
    # Without axis_name only the device holding the NaN skips: the devices diverge.
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())
    _, _, stats = make_step(tx, mean=False)(
        replicate(PARAMS), jax.pmap(tx.init)(replicate(PARAMS)), g
    )
    np.testing.assert_array_equal(stats.skipped, [i == 5 for i in range(N)])


def test_clip_with_sharded_gradients():
    """Each device holds one slice of one global gradient: jdls.clip clips by its norm."""
    g = local_grads(3)
    tx = jdls.clip(1.0, axis_name="i", sharded=True)
    out, _ = jax.pmap(lambda g: tx.update(g, optax.EmptyState()), axis_name="i")(g)
    whole, _ = jdls.clip(1.0).update(g, optax.EmptyState())  # the same leaves, unsplit
    for k in g:
        np.testing.assert_allclose(out[k], whole[k], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# shard_map over a Mesh.
# --------------------------------------------------------------------------------------------


MESH_AXIS = "d"


def mesh():
    return jax.make_mesh((N,), (MESH_AXIS,))


def global_grads(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "w": (scale * rng.standard_normal(2 * N)).astype(np.float32),  # sharded: 2 per device
        "b": (scale * rng.standard_normal(3)).astype(np.float32),  # replicated
    }


SPECS = {"w": P(MESH_AXIS), "b": P()}


def put(tree, m):
    return jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(m, spec)), tree, SPECS
    )


def run_sharded(tx, grads):
    m = mesh()
    params = put({"w": np.zeros(2 * N, np.float32), "b": np.zeros(3, np.float32)}, m)
    state = tx.init(params)
    # Adam's moments of "w" are sharded like "w"; everything else is replicated.
    state_specs = jax.tree_util.tree_map(
        lambda x: P(MESH_AXIS) if jnp.shape(x) == (2 * N,) else P(), state
    )
    if state.stats.nonfinite is not None:
        state_specs = state_specs._replace(
            stats=state_specs.stats._replace(nonfinite={"w": P(), "b": P()})
        )

    def step(g, state, params):
        return tx.update(g, state, params)

    f = jax.jit(
        jax.shard_map(
            step,
            mesh=m,
            in_specs=(SPECS, state_specs, SPECS),
            out_specs=(SPECS, state_specs),
        )
    )
    return f(put(grads, m), state, params)


def test_sharded_gradients_use_the_global_norm():
    kw = dict(max_norm=1.0, axis_name=MESH_AXIS, sharded={"w": True, "b": False})
    grads = global_grads(0)
    updates, state = run_sharded(jdls.wrap(optax.sgd(1.0), **kw), grads)
    tx1 = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale(), max_norm=1.0)
    ref, ref_state = tx1.update(jax.tree_util.tree_map(jnp.asarray, grads), tx1.init(grads))
    np.testing.assert_allclose(
        float(jdls.stats(state).grad_norm), float(jdls.stats(ref_state).grad_norm), rtol=1e-6
    )
    for k in grads:
        np.testing.assert_allclose(updates[k], ref[k], rtol=1e-6)
    norm = np.sqrt(sum(np.sum(np.asarray(u, np.float64) ** 2) for u in updates.values()))
    assert norm == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.full(keep=1)
def test_one_shard_overflowing_skips_everywhere(skip_with):
    kw = dict(
        scale=jdls.DynamicScale(),
        max_norm=1.0,
        axis_name=MESH_AXIS,
        sharded=True,
        track_nonfinite=True,
        skip_with=skip_with,
    )
    grads = global_grads(1)
    grads["w"][13] = -INF  # on device 6 only
    tx = jdls.wrap(optax.sgd(1.0), **kw)
    with pytest.raises(ValueError, match="pytree prefix of the gradients"):
        bad_prefix = jdls.wrap(optax.sgd(1.0), **{**kw, "sharded": {"w": True}})
        bad_prefix.update(jax.tree_util.tree_map(jnp.asarray, grads), tx.init(grads))
    kw["sharded"] = {"w": True, "b": False}
    tx = jdls.wrap(optax.adam(0.1), **kw)
    updates, state = run_sharded(tx, grads)
    assert_bitwise_equal(state.inner_state, tx.init(grads).inner_state)
    stats = jdls.stats(state)
    scale = jdls.get_scale(state)
    assert bool(stats.skipped) and float(scale.loss_scale) == 2.0**14
    assert scale.loss_scale.sharding.is_fully_replicated
    assert jdls.nonfinite_paths(state) == ["['w']"]
    for u in jax.tree_util.tree_leaves(updates):
        assert np.all(np.asarray(u) == 0)


def test_overflow_of_the_summed_norm_is_not_a_skip():
    # Each device's sum of squares is finite (2 * 1e38); their psum overflows.
    grads = {"w": np.full(2 * N, 1e19, np.float32), "b": np.zeros(3, np.float32)}
    kw = dict(max_norm=2.0, axis_name=MESH_AXIS, sharded={"w": True, "b": False})
    updates, state = run_sharded(jdls.wrap(optax.sgd(1.0), **kw), grads)
    assert not bool(jdls.stats(state).skipped)
    np.testing.assert_allclose(float(jdls.stats(state).grad_norm), 4e19, rtol=1e-6)
    np.testing.assert_allclose(updates["w"], np.full(2 * N, -0.5), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# jit over a Mesh.
# --------------------------------------------------------------------------------------------


def test_jit_over_a_mesh_needs_no_axis_name():
    m = mesh()
    tx = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(), max_norm=1.0, track_nonfinite=True)
    params = put({"w": np.ones(2 * N, np.float32), "b": np.ones(3, np.float32)}, m)

    step = jax.jit(apply_step(tx))
    state = tx.init(params)
    grads = global_grads(2, scale=3.0)
    p1, s1 = step(params, state, put(grads, m))
    # The same step on one device.
    q1, r1 = jax.jit(apply_step(tx))(
        jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), params),
        tx.init(params),
        jax.tree_util.tree_map(jnp.asarray, grads),
    )
    for k in grads:
        np.testing.assert_allclose(p1[k], q1[k], rtol=1e-6)
    np.testing.assert_allclose(
        float(jdls.stats(s1).grad_norm), float(jdls.stats(r1).grad_norm), rtol=1e-6
    )
    assert p1["w"].sharding.spec == P(MESH_AXIS)
    # An inf in one shard: skipped, the scale replicated.
    bad = global_grads(3)
    bad["w"][9] = INF
    p2, s2 = step(p1, s1, put(bad, m))
    assert_bitwise_equal(p2, p1)
    assert bool(jdls.stats(s2).skipped) and float(jdls.get_scale(s2).loss_scale) == 2.0**14
    assert jdls.get_scale(s2).loss_scale.sharding.is_fully_replicated
    assert jdls.nonfinite_paths(s2) == ["['w']"]
