"""A measurement is never a gradient: what jdls's differentiation returns at a site is global
over the devices, exact under the step's own pmean or psum, and refused (a TypeError naming
the fix, at trace time) once a transformation treated it as a gradient."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, fp8_mlp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

N_DEV = 4


def _data(n=32):
    kx, kt = jax.random.split(jax.random.key(7))
    # one device's rows much larger: its amax is the global one, the mean is far below it
    x = jax.random.normal(kx, (n, 8)).at[: n // N_DEV].multiply(8.0)
    return x, jax.random.normal(kt, (n, 2))


def _fp8_state():
    model = fp8_mlp()
    x, _ = _data()
    variables = jax.jit(model.init)(jax.random.key(0), x)
    return jdls.linen.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        sites=variables["jdls"],
        tx=jdls.wrap(optax.sgd(0.01), jdls.StaticScale(1.0)),
    )


def _sum_loss(variables, x, t, apply_fn):
    return jnp.sum((apply_fn(variables, x) - t) ** 2)  # a sum: the shards' output grads exact


def _fp8_step(state, x, t, collective=None):
    loss = functools.partial(_sum_loss, apply_fn=state.apply_fn)
    _, grads = state.value_and_grad(loss)(state.variables, x, t)
    if collective is not None:
        grads = collective(grads)  # the data-parallel step's own averaging, whole tree
    return state.apply_gradients(grads=grads)


@pytest.mark.parametrize(
    "layout", ["pmap-pmean", "pmap-psum", "shard_map-pmean", "shard_map-no-vma-pmean"]
)
@pytest.mark.full(keep=1)  # the quick run keeps pmap with its pmean
def test_fp8_sites_record_the_global_amax_through_the_steps_own_pmean(layout):
    """The documented linen step with a pmean (or psum) of the whole gradient tree records
    the whole batch's amax, bit for bit with one device on the whole batch."""
    state = _fp8_state()
    x, t = _data()
    expected = jax.jit(_fp8_step)(state, x, t).sites
    mean = functools.partial(lax.pmean, axis_name="d")
    total = functools.partial(lax.psum, axis_name="d")
    if layout.startswith("pmap"):
        collective = mean if layout == "pmap-pmean" else total
        shards = lambda a: a.reshape(N_DEV, -1, *a.shape[1:])  # noqa: E731
        got = jax.pmap(
            lambda s, x, t: _fp8_step(s, x, t, collective).sites,
            axis_name="d",
            in_axes=(None, 0, 0),
        )(state, shards(x), shards(t))
        ok = jax.tree_util.tree_map(lambda a: bool(np.all(a == a[:1])), got)
        got = jax.tree_util.tree_map(lambda a: a[0], got)
    else:
        mesh = jax.make_mesh((N_DEV,), ("d",), devices=jax.devices()[:N_DEV])
        step = jax.shard_map(
            lambda s, x, t: _fp8_step(s, x, t, mean).sites,
            mesh=mesh,
            in_specs=(P(), P("d"), P("d")),
            out_specs=P(),
            check_vma=layout == "shard_map-pmean",
        )
        shard = NamedSharding(mesh, P("d"))
        got = jax.jit(step)(state, jax.device_put(x, shard), jax.device_put(t, shard))
    assert_bitwise_equal(got, expected)
    if layout.startswith("pmap"):
        assert all(jax.tree_util.tree_leaves(ok))  # every device holds the same sites
    history = expected["Dense_0"]["DotGeneral_0"]["fp8"].value.lhs.history
    assert float(history[0]) == float(jnp.max(jnp.abs(x)))  # the global amax, not a mean


def _layer_loss(params, sites, x):
    h = jdls.apply_site(jnp.tanh(x @ params["a"]), sites["a"])
    return jnp.sum(jdls.apply_site(h @ params["b"], sites["b"]))


def _layer_setup():
    params = {"a": jnp.full((3, 3), 0.1), "b": jnp.full((3, 1), 0.1)}
    sites = {
        "a": jdls.layer_site(jdls.DynamicScale(2.0**10), 0),
        "b": jdls.layer_site(jdls.DynamicScale(2.0**4), 1),
    }
    x = jnp.ones((N_DEV, 2, 3)).at[1, 0, 0].set(jnp.inf)  # one device's batch overflows
    return params, sites, x


def _layer_step(params, sites, x, collective=None):
    _, (grads, measured) = jdls.layer_scaled_value_and_grad(_layer_loss)(params, sites, x)
    if collective is not None:
        grads, measured = collective((grads, measured))
    ok = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return jdls.update_sites(sites, measured, ok)


def test_a_layer_that_overflows_on_one_device_backs_off_on_every_device():
    """A finite flag is the conjunction over the devices, not their mean (0.75 read as
    finite), and a layer's amax the largest any device's backward pass computed (what its
    scale must keep in range): every device updates its layers alike."""
    params, sites, x = _layer_setup()
    local = [
        jdls.layer_scaled_value_and_grad(_layer_loss)(params, sites, x[d])[1][1]
        for d in range(N_DEV)
    ]
    got = jax.pmap(
        lambda x: _layer_step(params, sites, x, functools.partial(lax.pmean, axis_name="d")),
        axis_name="d",
    )(x)
    for key in ("a", "b"):
        amax = max(float(m[key].value["amax"]) for m in local)
        finite = min(float(m[key].value["finite"]) for m in local)
        assert got[key].value["amax"].tolist() == [amax] * N_DEV
        assert got[key].value["finite"].tolist() == [finite] * N_DEV
    scale = got["a"].value["scale"].loss_scale
    assert scale.tolist() == [2.0**9] * N_DEV  # backed off on every device
    assert got["b"].value["scale"].loss_scale.tolist() == [2.0**4] * N_DEV


@pytest.mark.parametrize("norm", [0.5, 100.0])  # clipping and not
def test_optax_clip_in_front_of_the_wrap_neither_counts_nor_scales_the_sites(norm):
    """optax.clip_by_global_norm in front of jdls.wrap, sites among the params: the norm is
    the parameters' alone and the measurement is recorded as it was, as with jdls.clip."""
    params = {"w": jnp.array([1.0, 2.0, 3.0]), "probe": jdls.Site(jdls.Probe())}
    loss = lambda p: jnp.sum(jdls.apply_site(p["w"] * 2.0, p["probe"]) ** 2)  # noqa: E731

    @functools.partial(jax.jit, static_argnums=0)
    def step(tx):
        opt_state = tx.init(params)
        _, grads = jdls.get_scale(opt_state).value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jdls.apply_updates(params, updates, opt_state)

    inner = optax.sgd(0.1)
    got = step(optax.chain(optax.clip_by_global_norm(norm), jdls.wrap(inner, jdls.NoOpScale())))
    ref = step(optax.chain(jdls.clip(norm), jdls.wrap(inner, jdls.NoOpScale())))
    plain = jax.grad(lambda w: jnp.sum((w * 2.0) ** 2))(params["w"])
    expected = -0.1 * optax.clip_by_global_norm(norm).update(plain, None)[0]
    assert_bitwise_equal(got["w"], params["w"] + expected)
    assert_bitwise_equal(got, ref)
    assert jdls.Telemetry.of(got["probe"]).amax.tolist() == [12.0]


def test_what_a_transformation_in_front_loses_is_lost_not_changed():
    """The limits docs/compositions.md states: on a step whose gradients overflow, optax's
    clip multiplies the whole tree by ``c / inf = 0``, and a transformation that adds to the
    gradients (``optax.add_noise``) does so on every step; neither is a common factor, so the
    measurement is lost (NaN in the telemetry, never another number). ``jdls.clip`` keeps
    it, and the skip is the same behind all three."""
    params = {"w": jnp.array([1.0, 2.0, 3.0]), "probe": jdls.Site(jdls.Probe())}
    loss = lambda p, c: jnp.sum(jdls.apply_site(p["w"] * c, p["probe"]))  # noqa: E731

    @functools.partial(jax.jit, static_argnums=0)
    def step(tx, c):
        opt_state = tx.init(params)
        _, grads = jdls.get_scale(opt_state).value_and_grad(loss)(params, c)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = jdls.apply_updates(params, updates, opt_state)
        return jdls.Telemetry.of(new["probe"]).amax[0], jdls.stats(opt_state).finite

    wrap = jdls.wrap(optax.sgd(0.1), jdls.NoOpScale())
    fronts = {
        "jdls.clip": jdls.clip(1.0),
        "optax clip": optax.clip_by_global_norm(1.0),
        "add_noise": optax.add_noise(0.1, 0.55, 0),
    }
    # (finite step, overflowing step): whether the measurement is lost
    lost = {"jdls.clip": (False, False), "optax clip": (False, True), "add_noise": (True, True)}
    for name, front in fronts.items():
        tx = optax.chain(front, wrap)
        finite_amax, finite = step(tx, jnp.float32(2.0))
        overflow_amax, overflow = step(tx, jnp.float32(jnp.inf))
        assert bool(finite) and not bool(overflow), name
        assert (bool(jnp.isnan(finite_amax)), bool(jnp.isnan(overflow_amax))) == lost[name], name
        for amax, is_lost in zip((finite_amax, overflow_amax), lost[name], strict=True):
            assert is_lost or float(amax) == 1.0, name  # the cotangent at the probe: ones


def test_carried_measurements_are_recorded_as_received_or_lost():
    """What the wrap records is what reaches it, never a measurement of another call: the
    gradients of the step before, applied with a transformation in front that loses their
    measurement (a delayed update), are lost, not replaced by this step's; a micro-batch
    carried in and summed with one differentiated in the step is lost too (a sum of two
    measurements), and with nothing in front."""
    params = {"w": jnp.array([1.0, 2.0, 3.0]), "probe": jdls.Site(jdls.Probe())}
    loss = lambda p, c: jnp.sum(jdls.apply_site(p["w"], p["probe"]) * c)  # noqa: E731

    def recorded(front, carried, summed):
        tx = optax.chain(front, jdls.wrap(optax.sgd(0.1), jdls.StaticScale(1.0)))
        opt_state = tx.init(params)

        @jax.jit
        def step(carried, c):
            grads = jdls.get_scale(opt_state).value_and_grad(loss)(params, c)[1]
            applied = jax.tree.map(jnp.add, carried, grads) if summed else carried
            updates, state = tx.update(applied, opt_state, params)
            return jdls.Telemetry.of(jdls.apply_updates(params, updates, state)["probe"]).amax

        return float(step(carried, jnp.float32(5.0))[0])

    carried = jax.jit(jdls.StaticScale(1.0).value_and_grad(loss))(params, jnp.float32(2.0))[1]
    assert recorded(jdls.clip(1.0), carried, summed=False) == 2.0  # the step before's
    assert np.isnan(recorded(optax.add_noise(0.1, 0.55, 0), carried, summed=False))
    for front in (optax.identity(), jdls.clip(1e9), optax.add_noise(0.1, 0.55, 0)):
        assert np.isnan(recorded(front, carried, summed=True))


def test_an_update_without_params_is_refused_where_sites_need_them():
    params = {"w": jnp.ones(3), "probe": jdls.Site(jdls.Probe())}
    tx = jdls.wrap(optax.sgd(0.1))
    opt_state = tx.init(params)
    loss = lambda p: jnp.sum(jdls.apply_site(p["w"], p["probe"]))  # noqa: E731
    _, grads = jdls.get_scale(opt_state).value_and_grad(loss)(params)
    with pytest.raises(ValueError, match=re.escape("tx.update(grads, opt_state, params)")):
        tx.update(grads, opt_state)


def test_retrying_updates_a_site_among_the_params():
    params = {"w": jnp.ones(3), "probe": jdls.Site(jdls.Probe())}
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**4))
    step = jax.jit(jdls.retrying(lambda p, x: jnp.sum(jdls.apply_site(p["w"] * x, p["probe"])), tx))
    new, opt_state, _ = step(params, tx.init(params), jnp.full(3, 2.0))
    assert bool(jdls.stats(opt_state).finite)
    assert jdls.Telemetry.of(new["probe"]).amax.tolist() == [2.0**4]  # scaled cotangents
    assert_bitwise_equal(new["w"], jnp.ones(3) - jnp.float32(0.1) * 2.0)  # sgd, unscaled


def test_a_step_retrying_skips_is_a_no_op_after_the_wrap_too():
    """AdamW written as a chain around the wrap: a skipped step decays nothing."""
    params = {"w": jnp.ones(3)}
    tx = optax.chain(
        jdls.wrap(optax.scale_by_adam(), jdls.DynamicScale(2.0**4)),
        optax.add_decayed_weights(0.1),
        optax.scale_by_schedule(lambda n: -0.01 * (n + 1)),
    )
    step = jax.jit(jdls.retrying(lambda p, x: jnp.sum(p["w"] * x), tx))
    new, opt_state, _ = step(params, tx.init(params), jnp.full(3, 2.0))
    before = opt_state
    skipped, opt_state, _ = step(new, opt_state, jnp.full(3, jnp.nan))
    assert not bool(jdls.stats(opt_state).finite)
    assert_bitwise_equal(skipped, new)  # no decay on a skipped step
    assert_bitwise_equal(opt_state[2], before[2])  # the schedule's count did not move


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.full(keep=1)
def test_retrying_takes_a_micro_step_as_the_chain_does(jit):
    """optax.MultiSteps inside the wrap, weight decay after it: a micro-step that completes
    no accumulated step is still a step the wrap took, so retrying gives what the same chain
    gives without it (decay on every step), bit for bit."""
    tx = optax.chain(
        jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), jdls.DynamicScale(2.0**4)),
        optax.add_decayed_weights(0.1),
    )
    loss = lambda p, x: jnp.sum(p["w"] * x) ** 2  # noqa: E731

    def plain(p, opt_state, x):
        value, grads = jdls.get_scale(opt_state).value_and_grad(loss)(p, x)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    retried = jdls.retrying(loss, tx)
    if jit:
        plain, retried = jax.jit(plain), jax.jit(retried)
    a = b = {"w": jnp.array([1.0, -0.5, 0.25])}
    sa = sb = tx.init(a)
    for i in range(4):
        x = jnp.full(3, 0.5 + i)
        a, sa, _ = plain(a, sa, x)
        b, sb, _ = retried(b, sb, x)
        assert_bitwise_equal(b, a)
    assert_bitwise_equal(sb, sa)


def test_a_bfloat16_all_reduce_keeps_the_measurement_and_a_mix_is_refused():
    """The step's all-reduce in bfloat16 (the whole tree cast, pmeaned, cast back) keeps a
    measurement exact; float16 (its count flushed), a sum with another measurement, or
    values rounded off its bytes decode to NaN, never to another measurement."""
    sites = {"h": jdls.Site(jdls.Probe())}

    def loss(x, s):
        return jnp.sum(jdls.apply_site(x, s["h"]) ** 2)

    grad = jdls.StaticScale(1.0).value_and_grad(loss, (0, 1))
    _, (_, m) = grad(jnp.array([1.5, -3.0, 0.25, 0.0]), sites)
    _, (_, other) = grad(jnp.array([7.0, 1.0, 2.0, 5.0]), sites)
    expected = np.asarray(m["h"].value)
    assert expected[0] == 6.0  # the largest cotangent magnitude, 2 * 3.0

    def all_reduce(t):
        t = jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)
        t = jax.pmap(lambda t: lax.pmean(t, "d"), "d")(
            jax.tree.map(lambda a: jnp.stack([a] * N_DEV), t)
        )
        return jax.tree.map(lambda a: a[0].astype(jnp.float32), t)

    assert np.asarray(all_reduce(m)["h"].value).tolist() == expected.tolist()
    flushed = jax.tree.map(lambda a: a.astype(jnp.float16).astype(jnp.float32), m)
    assert np.all(np.isnan(np.asarray(flushed["h"].value)))
    mixed = np.asarray(jax.tree.map(jnp.add, m, other)["h"].value)  # an average, in effect
    differ = expected != np.asarray(other["h"].value)
    assert differ.sum() == 2 and np.all(np.isnan(mixed[differ]))  # amax, non-zero count
    assert mixed[~differ].tolist() == expected[~differ].tolist()  # equal fields stay

    def off(path, a):  # every part moved a little, but not the count: not a common factor
        return a if "count" in jax.tree_util.keystr(path) else a * (1.0 + 2.0**-4)

    rounded = jax.tree_util.tree_map_with_path(off, m)
    assert np.all(np.isnan(np.asarray(rounded["h"].value))[expected != 0])
