"""jdls.wrap with the sharding APIs of current JAX: explicit meshes and ``shard_map``.

* Under ``jax.set_mesh`` with an ``AxisType.Explicit`` mesh (the sharding is part of every
  array's type), parameters and gradients sharded with ``NamedSharding``: a run with a step
  whose gradients hold an inf or a NaN ends bit-identical to the run without that step, with
  ``skip_with="cond"`` and ``"select"``, and everything keeps its sharding.
* Inside ``shard_map`` with the default ``check_vma=True``, gradients that differ per device
  and ``axis_name`` without ``sharded`` (no clipping): the step traces (both branches of the
  skip agree on what varies across devices), and every device takes the same decision, which
  the type system proves (the decision and the scale leave ``shard_map`` as replicated
  outputs) and the values confirm.
* Per-layer and per-loss scales under an explicit mesh, on a model-sharded MLP (a column- and
  a row-parallel layer) with a data-sharded batch: float32's gradients, each with its
  parameter's sharding, and replicated scales.

``tests/conftest.py`` provides 8 virtual CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import INF, NAN, assert_bitwise_equal, host_bytes, maybe_jit
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

N = 8

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason="needs 8 devices (conftest.py)")


# --------------------------------------------------------------------------------------------
# jit under an explicit mesh.
# --------------------------------------------------------------------------------------------

SPECS = {"w": P("data", "model"), "b": P("data"), "s": P()}
SHAPES = {"w": (8, 4), "b": (8,), "s": ()}
N_STEPS, FAULTY_STEP = 6, 3


def explicit_mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def put(tree, mesh):
    return jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, spec)),
        tree,
        SPECS,
    )


def initial_params(mesh):
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in SHAPES.items()}
    return put(params, mesh)


def batch(t, mesh):
    """The inputs of step ``t`` (sharded like ``w``) and a fault to add to the gradients."""
    rng = np.random.default_rng(100 + t)
    return jax.device_put(
        rng.standard_normal(SHAPES["w"]).astype(np.float32), NamedSharding(mesh, SPECS["w"])
    )


def poison(mesh, value):
    """Added to every gradient: zeros, with ``value`` at one element of ``w`` and of ``b``."""
    w, b = np.zeros(SHAPES["w"], np.float32), np.zeros(SHAPES["b"], np.float32)
    w[6, 3] = b[2] = value
    return put({"w": w, "b": b, "s": np.float32(0.0)}, mesh)


def loss_fn(params, x):
    y = jnp.tanh(params["w"] * x) + params["b"][:, None] * params["s"]
    return jnp.mean(y**2)


def make_step(tx):
    @jax.jit
    def step(params, state, x, fault):
        scale = jdls.get_scale(state)
        _, grads = scale.value_and_grad(loss_fn)(params, x)
        grads = jax.tree_util.tree_map(jnp.add, grads, fault)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def run(tx, mesh, steps, bad_value):
    """Train on the batches of ``steps``; ``FAULTY_STEP``'s gradients get ``bad_value``."""
    step = make_step(tx)
    params = initial_params(mesh)
    state = tx.init(params)
    clean, bad = poison(mesh, 0.0), poison(mesh, bad_value)
    for t in steps:
        before = params
        params, state = step(params, state, batch(t, mesh), bad if t == FAULTY_STEP else clean)
        if t == FAULTY_STEP:  # the skipped step left every parameter bit for bit as it was
            assert bool(jdls.stats(state).skipped)
            assert_bitwise_equal(params, before)
    return params, state


@pytest.mark.parametrize("bad_value", [INF, NAN], ids=["inf", "nan"])
@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.full(keep=1)
def test_explicit_mesh_skipped_step_is_bit_identical_to_leaving_it_out(skip_with, bad_value):
    mesh = explicit_mesh()
    tx = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(), skip_with=skip_with)
    with jax.set_mesh(mesh):
        params, state = run(tx, mesh, range(N_STEPS), bad_value)
        ref_params, ref_state = run(
            tx, mesh, [t for t in range(N_STEPS) if t != FAULTY_STEP], bad_value
        )

    # Bit-identical to the run that never saw the faulty step.
    assert host_bytes(params) == host_bytes(ref_params)
    assert host_bytes(state.inner_state) == host_bytes(ref_state.inner_state)
    assert int(state.inner_state[0].count) == N_STEPS - 1
    assert int(jdls.stats(state).skipped_steps) == 1
    assert int(jdls.stats(ref_state).skipped_steps) == 0
    # The scale backed off once (and is the same on every device).
    scale = jdls.get_scale(state).loss_scale
    assert float(scale) == 2.0**14 and float(jdls.get_scale(ref_state).loss_scale) == 2.0**15
    assert scale.sharding.is_fully_replicated
    # Parameters and Adam's moments kept their shardings.
    for k, spec in SPECS.items():
        assert params[k].sharding == NamedSharding(mesh, spec), k
        assert state.inner_state[0].mu[k].sharding == NamedSharding(mesh, spec), k
        assert state.inner_state[0].nu[k].sharding == NamedSharding(mesh, spec), k


# --------------------------------------------------------------------------------------------
# shard_map, check_vma=True, gradients that differ per device, axis_name without sharded.
# --------------------------------------------------------------------------------------------

AXIS = "d"
PARAM_SHAPES = {"w": (4,), "b": (2,)}


def device_grads(seed, bad_device=None, value=INF):
    """Each device's own gradients, concatenated along the first axis (sharded over ``d``)."""
    rng = np.random.default_rng(seed)
    g = {k: rng.standard_normal((N, *s)).astype(np.float32) for k, s in PARAM_SHAPES.items()}
    if bad_device is not None:
        g["w"][bad_device, 1] = value
    return {k: jnp.asarray(v.reshape(-1)) for k, v in g.items()}


def per_device(x):
    """A concatenated output split back into one row per device."""
    return np.asarray(x).reshape(N, -1)


def shard_mapped_update(tx, params):
    mesh = jax.make_mesh((N,), (AXIS,))
    state = tx.init(params)
    # The optimizer state comes in replicated. What comes out: Adam's moments vary across
    # devices (each saw its own gradients); the scale, the statistics and Adam's step count
    # must not, and out_specs P() makes check_vma prove it.
    moments = {k: P(AXIS) for k in PARAM_SHAPES}
    out_state_specs = jax.tree_util.tree_map(lambda _: P(), state)
    adam = out_state_specs.inner_state[0]
    out_state_specs = out_state_specs._replace(
        inner_state=(adam._replace(mu=moments, nu=moments), *out_state_specs.inner_state[1:])
    )

    def local(g, state, params):
        updates, state = tx.update(g, state, params)
        # The decision as each device sees it, one row per device.
        return updates, state, jdls.stats(state).finite[None]

    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=({k: P(AXIS) for k in PARAM_SHAPES}, P(), P()),
        out_specs=({k: P(AXIS) for k in PARAM_SHAPES}, out_state_specs, P(AXIS)),
    )
    f = jax.jit(f)
    grad_sharding = NamedSharding(mesh, P(AXIS))

    def step(g, state, params):
        return f(jax.device_put(g, grad_sharding), state, params)

    return step, state


@pytest.mark.parametrize("skip_with", ["cond", "select"])
@pytest.mark.full(keep=1)
def test_shard_map_differing_gradients_agree_on_the_skip(skip_with):
    params = {"w": jnp.array([1.0, -2.0, 0.5, 0.0]), "b": jnp.array([0.25, -0.0])}
    tx = jdls.wrap(optax.adam(0.1), jdls.DynamicScale(), axis_name=AXIS, skip_with=skip_with)
    step, state0 = shard_mapped_update(tx, params)

    # A clean step: taken everywhere, each device with its own gradients, as one device would.
    g = device_grads(0)
    updates, state, finite = step(g, state0, params)
    assert per_device(finite).ravel().tolist() == [True] * N
    assert not bool(jdls.stats(state).skipped) and int(state.inner_state[0].count) == 1
    one = jdls.wrap(optax.adam(0.1), jdls.DynamicScale())
    for k in PARAM_SHAPES:
        rows = per_device(updates[k])
        assert len({r.tobytes() for r in rows}) == N  # the devices differ ...
        for d in range(N):  # ... and each took the step one device would take
            ref, _ = jax.jit(one.update)(
                {j: per_device(g[j])[d] for j in PARAM_SHAPES}, one.init(params), params
            )
            np.testing.assert_array_equal(rows[d], ref[k])

    # An inf (or NaN) on one device only: every device skips.
    for value in (INF, -INF, NAN):
        updates, state, finite = step(device_grads(1, bad_device=5, value=value), state0, params)
        assert per_device(finite).ravel().tolist() == [False] * N
        stats = jdls.stats(state)
        assert bool(stats.skipped) and int(stats.skipped_steps) == 1
        assert int(stats.consecutive_skips) == 1
        assert float(jdls.get_scale(state).loss_scale) == 2.0**14
        assert np.all(np.isnan(stats.grad_norm))  # not known without `sharded`
        for u in jax.tree_util.tree_leaves(updates):  # -0.0 on every device
            assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))
        adam = state.inner_state[0]
        assert int(adam.count) == 0
        for k in PARAM_SHAPES:  # the moments as they were, on every device
            assert np.all(per_device(adam.mu[k]) == 0) and np.all(per_device(adam.nu[k]) == 0)


def test_shard_map_without_axis_name_decides_per_device():
    """No axis_name: each device decides for itself, under the default check_vma."""
    mesh = jax.make_mesh((8,), ("d",))
    tx = jdls.wrap(optax.sgd(1.0), jdls.DynamicScale())

    def local(g, p):
        u, state = tx.update(g, tx.init(p), p)
        return u, jdls.stats(state).finite[None]

    f = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"), P("d")))
    )
    g = np.arange(16.0, dtype=np.float32)
    g[11] = np.nan  # device 5 holds elements 10 and 11
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))  # noqa: E731
    updates, finite = f(put(jnp.asarray(g)), put(jnp.zeros(16)))
    assert np.asarray(finite).tolist() == [True] * 5 + [False] + [True] * 2
    u = np.asarray(updates)
    np.testing.assert_array_equal(np.delete(u, [10, 11]), -np.delete(g, [10, 11]))
    assert np.all(np.signbit(u[10:12])) and np.all(u[10:12] == 0)


# --------------------------------------------------------------------------------------------
# Per-layer and per-loss scales under an explicit mesh: a model-sharded MLP, a data-sharded
# batch.
# --------------------------------------------------------------------------------------------

LAYER_SPECS = {"dense_0": P(None, "model"), "dense_1": P("model", None), "out": P(None, None)}


def layered_params(mesh):
    rng = np.random.default_rng(3)
    shapes = {"dense_0": (16, 32), "dense_1": (32, 16), "out": (16, 4)}
    return {
        k: jax.device_put(
            (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32),
            NamedSharding(mesh, LAYER_SPECS[k]),
        )
        for k, s in shapes.items()
    }


def layered_logits(p, x, dtype, sites=None):
    def mark(h, name):
        return h if sites is None else jdls.apply_site(h, sites[name])

    h = jnp.tanh(x.astype(dtype) @ p["dense_0"].astype(dtype))  # (data, model)
    h = mark(h, "dense_0")
    # Megatron's row-parallel layer: the contraction over "model" ends in a sum across it
    h = jnp.matmul(h, p["dense_1"].astype(dtype), out_sharding=P("data", None))
    h = mark(jnp.tanh(h), "dense_1")
    return mark(h @ p["out"].astype(dtype), "out").astype(jnp.float32)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.full
def test_explicit_mesh_per_layer_and_per_loss_gradients_keep_their_shardings(jit):
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        params = layered_params(mesh)
        x = jax.device_put(
            np.random.default_rng(4).standard_normal((8, 16)).astype(np.float32),
            NamedSharding(mesh, P("data", None)),
        )

        def loss(p, sites, x, dtype=jnp.float32):
            return jnp.mean(layered_logits(p, x, dtype, sites) ** 2)

        def losses(p, x):
            y = layered_logits(p, x, jnp.float32)
            return {"main": jnp.mean(y**2), "small": 1e-4 * jnp.mean(jnp.abs(y))}

        maybe = jax.jit if jit else (lambda f: f)
        expected = jax.grad(loss)(params, None, x)
        levels = {"dense_0": 2.0**30, "dense_1": 2.0**9, "out": 2.0**-3}
        sites = {
            k: jdls.layer_site(jdls.StaticScale(v), i) for i, (k, v) in enumerate(levels.items())
        }
        _, (grads, measured) = maybe(jdls.layer_scaled_value_and_grad(loss))(params, sites, x)
        loss_scales = {"main": jdls.StaticScale(2.0), "small": jdls.StaticScale(2.0**20)}
        _, loss_grads, loss_finite = maybe(jdls.multi_loss_value_and_grad(losses, loss_scales))(
            params, x
        )
        expected_sum = jax.grad(lambda p, x: sum(losses(p, x).values()))(params, x)
        adaptive = {k: jdls.layer_site(jdls.AdaptiveScale(), i) for i, k in enumerate(levels)}
        adjusted = jdls.update_sites(adaptive, measured, True)

    for k, spec in LAYER_SPECS.items():
        # float32, power-of-two scales: float32's gradients up to the programs' summation order
        atol = 1e-6 * float(jnp.max(jnp.abs(expected[k])))
        np.testing.assert_allclose(grads[k], expected[k], rtol=1e-6, atol=atol)
        np.testing.assert_allclose(loss_grads[k], expected_sum[k], rtol=1e-6, atol=atol)
        assert grads[k].sharding == NamedSharding(mesh, spec), k
        assert loss_grads[k].sharding == NamedSharding(mesh, spec), k
        assert float(measured[k].value["finite"]) == 1.0
        assert adjusted[k].value["scale"].loss_scale.sharding.is_fully_replicated, k
    assert all(bool(f) for f in loss_finite.values())


# --------------------------------------------------------------------------------------------
# jdls.retrying and jdls.accumulate with a sharded parameter, explicit and automatic meshes:
# their loop carries take the shardings of the arrays they stand for.
# --------------------------------------------------------------------------------------------


def f16_loss(p, x):
    """float16 compute: the scaled backward is ``x * scale`` in float16, inf for |x| >= 2 at
    2**15 and finite at 2**14. Small integers: every sum is exact in any order."""
    return jnp.sum((p["w"].astype(jnp.float16) * x.astype(jnp.float16)).astype(jnp.float32))


def retry_inputs():
    w = np.arange(32, dtype=np.float32).reshape(8, 4) % 5 - 2
    xs = np.ones((3, 8, 4), np.float32)
    xs[1, 6, 3] = 3.0  # the second micro-batch (and the whole batch) overflows at 2**15
    return {"w": w}, xs


def retried_run(mesh, jit):
    """``jdls.retrying`` and ``jdls.accumulate`` (both with one retry) on the same batch;
    ``mesh=None``: unsharded."""
    params, xs = retry_inputs()
    if mesh is not None:
        params = {"w": jax.device_put(params["w"], NamedSharding(mesh, P("data", "model")))}
        xs = jax.device_put(xs, NamedSharding(mesh, P(None, "data", "model")))
    else:
        params, xs = {"w": jnp.asarray(params["w"])}, jnp.asarray(xs)
    tx = jdls.wrap(optax.adam(0.5), jdls.DynamicScale(2.0**15))
    step = maybe_jit(jdls.retrying(f16_loss, tx, retries=1), jit)
    retried = step(params, tx.init(params), xs[1])

    def accumulated(params, opt_state, xs):
        scale = jdls.get_scale(opt_state)
        loss, grads, info = jdls.accumulate(f16_loss, scale, params, xs, retries=1)
        updates, opt_state = tx.update(grads, jdls.set_scale(opt_state, info.scale), params)
        return optax.apply_updates(params, updates), opt_state, loss, info

    acc = maybe_jit(accumulated, jit)(params, tx.init(params), xs)
    return retried, acc


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.full
def test_retrying_and_accumulate_with_a_sharded_parameter_match_the_unsharded_step(axis_type, jit):
    expected_retried, expected_acc = retried_run(None, jit)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
        retried, acc = retried_run(mesh, jit)

    params, state, loss = retried
    assert int(jdls.stats(state).retries) == 1 and not bool(jdls.stats(state).skipped)
    assert float(jdls.get_scale(state).loss_scale) == 2.0**14
    assert host_bytes((params, state, loss)) == host_bytes(expected_retried)
    assert params["w"].sharding == NamedSharding(mesh, P("data", "model"))

    params, state, loss, info = acc
    assert (int(info.kept), int(info.dropped), int(info.retries)) == (3, 0, 1)
    assert not bool(jdls.stats(state).skipped)
    assert host_bytes((params, state, loss, info)) == host_bytes(expected_acc)
    assert params["w"].sharding == NamedSharding(mesh, P("data", "model"))
