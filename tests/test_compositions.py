"""A composition test that no one hand-picks: hypothesis draws how a user composes sites
(which sites, which model framework, which optax chain around the wrap, which step, which
data-parallel layout) and every draw must give what the plain step gives: one device, the
whole optimizer inside ``jdls.wrap``, ``scale.value_and_grad``, ``tx.update``,
``jdls.apply_updates``. The sites' states must be equal bit for bit (a measurement is never
a gradient: no clip, decay, learning rate, pmean or psum may touch it); the parameters to
float32 rounding (a psum over devices adds in another order)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_bitwise_equal, assert_equal_within_ulps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

N_DEV = 4
BATCH = 16
DIMS = (((1,), (0,)), ((), ()))

SITES = ("probe", "fp8", "both")
FRAMEWORKS = ("dict", "equinox")
CHAINS = ("inside", "optax clip in front", "jdls clip in front", "rate after")
STEPS = ("value_and_grad", "retrying", "accumulate")
LAYOUTS = ("one device", "pmap", "shard_map", "shard_map without vma")


def _params(sites, framework):
    w = jax.random.normal(jax.random.key(0), (8, 4)) * 0.5
    probe = jdls.Site(jdls.Probe()) if sites in ("probe", "both") else None
    dot = jdls.fp8.init(jdls.fp8.DelayedScaling(4)) if sites in ("fp8", "both") else None
    if framework == "dict":
        return {"w": w, "probe": probe, "dot": dot}
    import equinox as eqx

    class Layer(eqx.Module):
        w: jax.Array
        probe: jdls.Site | None
        dot: jdls.Site | None

    return Layer(w, probe, dot)


def _get(p, name):
    return p[name] if isinstance(p, dict) else getattr(p, name)


def _loss(p, x, t):
    """The sum over the rows, times 1/BATCH: each device's share of the whole batch's mean,
    so that a psum of the devices' gradients is the whole batch's gradient and each
    device's cotangents are the whole batch's."""
    dot, w = _get(p, "dot"), _get(p, "w")
    h = x @ w if dot is None else jdls.fp8.dot_general(x, w, DIMS, site=dot)
    if _get(p, "probe") is not None:
        h = jdls.apply_site(h, _get(p, "probe"))
    return jnp.sum((jnp.tanh(h) - t) ** 2) / BATCH


def _tx(chain):
    scale = jdls.DynamicScale(2.0**10)
    if chain == "inside":
        return jdls.wrap(optax.adamw(1e-2, weight_decay=0.1), scale)
    if chain == "optax clip in front":
        return optax.chain(
            optax.clip_by_global_norm(1e6), jdls.wrap(optax.adamw(1e-2, weight_decay=0.1), scale)
        )
    if chain == "jdls clip in front":
        return optax.chain(jdls.clip(1e6), jdls.wrap(optax.adamw(1e-2, weight_decay=0.1), scale))
    return optax.chain(
        jdls.wrap(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1)), scale),
        optax.scale(-1e-2),
    )


def _step(tx, form, collective=None):
    """One train step as the user writes it; ``collective`` (a psum over the devices) where
    the layout is data-parallel."""
    if form == "retrying":
        return jdls.retrying(_loss, tx)

    def step(p, opt_state, x, t):
        scale = jdls.get_scale(opt_state)
        if form == "accumulate":
            batches = (x[None], t[None])  # one micro-batch: the raw and coded paths
            loss, grads, _ = jdls.accumulate(lambda p, b: _loss(p, *b), scale, p, batches)
        else:
            loss, grads = scale.value_and_grad(_loss)(p, x, t)
        if collective is not None:
            grads, loss = collective((grads, loss))
        updates, opt_state = tx.update(grads, opt_state, p)
        return jdls.apply_updates(p, updates, opt_state), opt_state, loss

    return step


def _data(i):
    kx, kt = jax.random.split(jax.random.key(10 + i))
    # one device's rows much larger: its amax is the whole batch's, a mean is far below it
    x = jax.random.normal(kx, (BATCH, 8)).at[(i % N_DEV) * 4 : (i % N_DEV) * 4 + 4].multiply(8.0)
    return x, jax.random.normal(kt, (BATCH, 4))


def _run(sites, framework, chain, form, layout, steps=2):
    p = _params(sites, framework)
    tx = _tx(chain)
    opt_state = tx.init(p)
    psum = functools.partial(lax.psum, axis_name="d")
    if layout == "one device":
        step = jax.jit(_step(tx, form))
    elif layout == "pmap":
        inner = jax.pmap(
            _step(tx, form, psum), axis_name="d", in_axes=(None, None, 0, 0), out_axes=None
        )

        def step(p, opt_state, x, t):
            def shards(a):
                return a.reshape(N_DEV, -1, *a.shape[1:])

            return inner(p, opt_state, shards(x), shards(t))
    else:
        mesh = jax.make_mesh((N_DEV,), ("d",), devices=jax.devices()[:N_DEV])
        mapped = jax.shard_map(
            _step(tx, form, psum),
            mesh=mesh,
            in_specs=(P(), P(), P("d"), P("d")),
            out_specs=(P(), P(), P()),
            check_vma=layout == "shard_map",
        )
        shard = NamedSharding(mesh, P("d"))

        def step(p, opt_state, x, t):
            return jax.jit(mapped)(p, opt_state, jax.device_put(x, shard), jax.device_put(t, shard))

    for i in range(steps):
        p, opt_state, _ = step(p, opt_state, *_data(i))
    return p


@functools.cache
def _reference(sites, framework):
    return _run(sites, framework, "inside", "value_and_grad", "one device")


def _sites_of(p):
    return {name: _get(p, name) for name in ("probe", "dot")}


def _comparable(p, layout):
    """The sites' states; across devices without an FP8 meter's saturated and flushed
    fractions, which combine by their largest (docs/fp8.md), not over the whole batch."""
    sites = _sites_of(p)
    if layout == "one device":
        return sites

    def keep(path, x):
        names = {getattr(k, "name", None) for k in path}
        return None if names & {"saturated", "flushed"} else x

    return jax.tree_util.tree_map_with_path(keep, sites)


def _check(sites, framework, chain, form, layout):
    got = _run(sites, framework, chain, form, layout)
    ref = _reference(sites, framework)
    if layout == "one device":
        assert_bitwise_equal(_comparable(got, layout), _comparable(ref, layout))
    else:  # each device computes its part of the cotangents: XLA may round one differently
        assert_equal_within_ulps(_comparable(got, layout), _comparable(ref, layout))
    np.testing.assert_allclose(
        np.asarray(_get(got, "w")), np.asarray(_get(ref, "w")), rtol=2e-5, atol=1e-6
    )
    if _get(ref, "probe") is not None:  # the measurement moved: the test can fail
        assert float(jdls.Telemetry.of(_sites_of(ref)).amax[0]) > 0.0


compositions = st.tuples(
    st.sampled_from(SITES),
    st.sampled_from(FRAMEWORKS),
    st.sampled_from(CHAINS),
    st.sampled_from(STEPS),
    st.sampled_from(LAYOUTS),
)


def _supported(composition):
    _, _, _, form, layout = composition
    # retrying owns the step, and its data-parallel form averages the devices' gradients (a
    # pmean, with the wrap given the axis): checked in tests/test_retry.py
    return not (form == "retrying" and layout != "one device")


_QUICK = settings(
    max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
_WIDE = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@pytest.mark.full  # about 7 s; the capability matrix keeps a sample quick
@_QUICK
@given(compositions.filter(_supported))
def test_a_drawn_composition_gives_the_plain_step(composition):
    _check(*composition)


@pytest.mark.full
@_WIDE
@given(compositions.filter(_supported))
def test_a_wide_draw_of_compositions_gives_the_plain_step(composition):
    _check(*composition)
