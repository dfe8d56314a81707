"""An FP8 site serves one use per step: a site used twice (JAX sums the cotangents of a
shared value, so the measured amax would be the sum of the uses') records nothing and is
flagged in ``jdls.fp8.telemetry``; a site used once is recorded exactly as before."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit

import jdls
from jdls import fp8

DN = (((1,), (0,)), ((), ()))
X = jnp.array([[1.0, -3.5]])
W = jnp.array([[2.0], [1.0]])
XS = jnp.stack([X, 2.0 * X, 3.0 * X])  # amaxes 3.5, 7 and 10.5


def _dot(x, site):
    return fp8.dot_general(x, W, DN, site=site)


def _step(loss, site, jit):
    """The measurement of ``loss`` at ``site`` and the site updated from it."""

    def step(site):
        measured = jax.grad(loss)(site)
        return measured, jdls.update_sites(site, measured)

    return maybe_jit(step, jit)(site)


def _quiet_telemetry(tree):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a site used once never warns
        return fp8.telemetry(tree)


@with_and_without_jit
def test_a_site_used_once_records_its_amax_exactly(jit):
    recipe = fp8.DelayedScaling(4)
    site = fp8.init(recipe)
    measured, new = _step(lambda s: jnp.sum(_dot(X, s)), site, jit)
    assert float(measured.value.uses) == 1.0
    assert float(new.value.uses) == 1.0
    # the recipe's own update of the measurement, bit for bit
    for role in ("lhs", "rhs", "grad"):
        expected = recipe.update(
            getattr(site.value, role), getattr(measured.value.meter, role), role
        )
        assert_bitwise_equal(getattr(new.value, role), expected)
    assert new.value.lhs.history.tolist() == [3.5, 0.0, 0.0, 0.0]
    row = _quiet_telemetry({"d": new})["d"]
    assert row["lhs"] == {"amax": 3.5, "saturated": 0.0, "flushed": 0.0, "uses": 1}
    assert row["rhs"]["amax"] == 2.0 and row["grad"]["amax"] == 1.0


@with_and_without_jit
def test_a_site_used_twice_records_nothing_and_is_flagged(jit):
    site = fp8.init(fp8.DelayedScaling(4))
    # one site, two dots: JAX adds up the two measurements (3.5 + 7 = 10.5)
    measured, new = _step(lambda s: jnp.sum(_dot(X, s) + _dot(2.0 * X, s)), site, jit)
    assert float(measured.value.uses) == 2.0
    assert float(measured.value.meter.lhs.amax) == 10.5  # the sum, which is never recorded
    for role in ("lhs", "rhs", "grad"):
        assert_bitwise_equal(getattr(new.value, role), getattr(site.value, role))
    assert_bitwise_equal(new.value.pending, site.value.pending)
    with pytest.warns(UserWarning, match=r"used more than once.*d \(2 uses\).*its own site"):
        row = fp8.telemetry({"d": new})["d"]
    for role in ("lhs", "rhs", "grad"):
        assert np.isnan(row[role]["amax"]) and row[role]["uses"] == 2
        assert np.isnan(row[role]["saturated"]) and np.isnan(row[role]["flushed"])


def test_a_site_used_twice_keeps_its_scale_and_the_next_single_use_records_again():
    site = fp8.init(fp8.DelayedScaling(4))
    once = jax.jit(lambda s: jdls.update_sites(s, jax.grad(lambda s: jnp.sum(_dot(X, s)))(s)))
    twice = jax.jit(
        lambda s: jdls.update_sites(
            s, jax.grad(lambda s: jnp.sum(_dot(X, s) + _dot(X, s)))(s), True
        )
    )
    site = once(site)
    scale = float(site.value.lhs.scale)
    assert scale == 3.5 / 448
    site = twice(site)  # 7 = 2 x 3.5 would have halved the precision
    assert site.value.lhs.history.tolist() == [3.5, 0.0, 0.0, 0.0]
    assert float(site.value.lhs.scale) == scale
    site = once(site)
    assert site.value.lhs.history.tolist() == [3.5, 0.0, 0.0, 3.5]  # Flax's layout: rolled


def test_each_use_with_its_own_site_is_exact():
    """The remedy: one site per use."""
    sites = {"a": fp8.init(fp8.DelayedScaling(4)), "b": fp8.init(fp8.DelayedScaling(4))}

    def loss(s):
        return jnp.sum(_dot(X, s["a"]) + _dot(2.0 * X, s["b"]))

    sites = jdls.update_sites(sites, jax.grad(loss)(sites))
    rows = _quiet_telemetry(sites)
    assert (rows["a"]["lhs"]["amax"], rows["b"]["lhs"]["amax"]) == (3.5, 7.0)


def test_a_site_the_step_did_not_use_records_nothing():
    site = fp8.init(fp8.DelayedScaling(4))

    def loss(s):
        _dot(X, s)  # computed, but the loss does not depend on it
        return jnp.sum(W)

    measured, new = _step(loss, site, True)
    assert float(measured.value.uses) == 0.0
    assert_bitwise_equal(new.value.lhs, site.value.lhs)  # no amax of 0 in the history
    row = _quiet_telemetry({"d": new})["d"]
    assert np.isnan(row["lhs"]["amax"]) and row["lhs"]["uses"] == 0


@with_and_without_jit
def test_scan_counts_uses_per_layer_of_a_stacked_site(jit):
    """A stacked site (one per iteration) serves one use per layer; one site closed over by
    the loop body serves all of them and is flagged."""

    def stacked(s):
        def body(c, xs):
            x, site = xs
            return c + jnp.sum(_dot(x, site)), None

        return jax.lax.scan(body, 0.0, (XS, s))[0]

    def closed_over(s):
        return jax.lax.scan(lambda c, x: (c + jnp.sum(_dot(x, s)), None), 0.0, XS)[0]

    stack = fp8.init(fp8.DelayedScaling(4)).stacked(3)
    measured, new = _step(stacked, stack, jit)
    assert measured.value.uses.tolist() == [1.0, 1.0, 1.0]
    assert new.value.lhs.history[:, 0].tolist() == [3.5, 7.0, 10.5]
    assert _quiet_telemetry({"s": new})["s"]["lhs"]["amax"] == [3.5, 7.0, 10.5]

    one = fp8.init(fp8.DelayedScaling(4))
    measured, new = _step(closed_over, one, jit)
    assert float(measured.value.uses) == 3.0
    for part in ("lhs", "rhs", "grad", "pending"):
        assert_bitwise_equal(getattr(new.value, part), getattr(one.value, part))


@pytest.mark.full  # about 4 s; test_scan_counts_uses_per_layer_of_a_stacked_site stays quick
def test_uses_are_counted_per_element_of_a_stack():
    """Layer 0 of a stack used once, layer 1 twice: layer 0 is recorded, layer 1 is not."""
    stack = fp8.init(fp8.DelayedScaling(4)).stacked(2)

    def loss(s):
        layer = [jax.tree.map(lambda v, i=i: v[i], s) for i in range(2)]
        return jnp.sum(_dot(X, layer[0]) + _dot(X, layer[1]) + _dot(2.0 * X, layer[1]))

    new = jdls.update_sites(stack, jax.grad(loss)(stack))
    assert new.value.uses.tolist() == [1.0, 2.0]
    assert new.value.lhs.history[:, 0].tolist() == [3.5, 0.0]
    with pytest.warns(UserWarning, match=r"s \(2 uses\)"):
        row = fp8.telemetry({"s": new})["s"]["lhs"]
    assert row["amax"][0] == 3.5 and np.isnan(row["amax"][1])
    assert row["uses"] == [1, 2]


@pytest.mark.full  # about 4 s; the other counts of uses stay in the quick run
def test_vmap_over_examples_counts_an_unbatched_site_once_per_example():
    """A site batched along the vmap axis serves one example each; one unbatched site
    serves every example: JAX sums its measurements over the batch, and it is flagged."""
    stack = fp8.init(fp8.DelayedScaling(4)).stacked(3)
    batched = jax.grad(lambda s: jnp.sum(jax.vmap(_dot)(XS, s)))(stack)
    assert batched.value.uses.tolist() == [1.0, 1.0, 1.0]
    assert batched.value.meter.lhs.amax.tolist() == [3.5, 7.0, 10.5]

    one = fp8.init(fp8.DelayedScaling(4))
    shared = jax.grad(lambda s: jnp.sum(jax.vmap(lambda x: _dot(x, s))(XS)))(one)
    assert float(shared.value.uses) == 3.0
    assert float(shared.value.meter.lhs.amax) == 21.0  # 3.5 + 7 + 10.5
    new = jdls.update_sites(one, shared)
    assert_bitwise_equal(new.value.lhs, one.value.lhs)


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        dot = functools.partial(fp8.linen.DotGeneral, recipe=fp8.DelayedScaling(4))
        return nn.Dense(2, use_bias=False, dot_general_cls=dot)(x)


class _TwoDense(nn.Module):
    shared: bool

    @nn.compact
    def __call__(self, x):
        first = _Dense()
        second = first if self.shared else _Dense()
        return second(jnp.tanh(first(x)))


@pytest.mark.parametrize("shared", [True, False], ids=["one-layer-twice", "two-layers"])
@pytest.mark.full(keep=1)
def test_a_linen_layer_applied_twice_is_flagged_and_two_layers_are_not(shared):
    x = jnp.linspace(-2.0, 2.0, 8).reshape(4, 2)
    model, uses = _TwoDense(shared), 2 if shared else 1
    variables = model.init(jax.random.key(0), x)
    grads = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(variables)
    sites = jdls.update_sites(variables["jdls"], grads["jdls"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = fp8.telemetry(sites)
    assert len(rows) == 2 - shared
    assert {row["lhs"]["uses"] for row in rows.values()} == {uses}
    assert len(caught) == uses - 1
    assert all(np.isnan(row["lhs"]["amax"]) == shared for row in rows.values())
    histories = [s.value.lhs.history[0] for s in jax.tree.leaves(sites, is_leaf=jdls.is_site)]
    assert all((float(h) == 0.0) == shared for h in histories)


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.full  # about 5 s; tests/test_fp8_accumulate.py keeps fp8 sites under accumulation
def test_accumulate_keeps_one_use_per_micro_batch(twice):
    """jdls.accumulate combines micro-batches by their maximum: each uses the site once, so
    the step's uses stay 1; a micro-batch that used it twice flags the step."""
    variables = {"w": W, "site": fp8.init(fp8.DelayedScaling(4))}

    def loss(v, x):
        y = fp8.dot_general(x, v["w"], DN, site=v["site"])
        if twice:
            y = y + fp8.dot_general(x, v["w"], DN, site=v["site"])
        return jnp.sum(y**2)

    _, grads, info = jax.jit(lambda v: jdls.accumulate(loss, jdls.StaticScale(1.0), v, XS))(
        variables
    )
    assert int(info.kept) == 3
    assert float(grads["site"].value.uses) == (2.0 if twice else 1.0)
    site = jdls.update_sites(variables["site"], grads["site"])
    expected = [0.0, 0.0, 0.0, 0.0] if twice else [10.5, 0.0, 0.0, 0.0]
    assert site.value.lhs.history.tolist() == expected


@with_and_without_jit
def test_the_step_warns_where_a_shared_site_records_nothing(jit):
    """Nothing is silent: where a site served several uses (here one unbatched site under
    ``jax.vmap`` over examples), ``jdls.update_sites`` warns at run time, naming it; a site
    used once never warns, and the warning changes nothing in the state."""
    sites = {"up": fp8.init(fp8.DelayedScaling(4)), "down": fp8.init(fp8.DelayedScaling(4))}

    def loss(s):
        per_example = jax.vmap(lambda x: _dot(x, s["up"]))(XS)  # "up" closed over: shared
        return jnp.sum(per_example) + jnp.sum(_dot(X, s["down"]))

    step = maybe_jit(lambda s: jdls.update_sites(s, jax.grad(loss)(s)), jit)
    with pytest.warns(UserWarning, match=r"site\(s\) up served more than one use") as record:
        new = jax.block_until_ready(step(sites))
    assert not any("down" in str(w.message) for w in record)
    assert_bitwise_equal(new["up"].value.lhs, sites["up"].value.lhs)  # nothing recorded
    assert new["down"].value.lhs.history.tolist() == [3.5, 0.0, 0.0, 0.0]

    once = maybe_jit(
        lambda s: jdls.update_sites(s, jax.grad(lambda s: jnp.sum(_dot(X, s)))(s)), jit
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.block_until_ready(once(sites["down"]))


@pytest.mark.full  # about 3 s
def test_an_equinox_model_called_per_example_warns_in_its_step():
    """The Equinox idiom, ``jax.vmap(model)(x)`` with the model's FP8 layer closed over:
    every example uses the one site, so the step warns (it used to train with scales that
    never moved, silently); called on the batch, the same layer records and does not."""
    eqx = pytest.importorskip("equinox")
    import optax

    import jdls.equinox
    import jdls.fp8.equinox

    layer = jdls.fp8.equinox.Linear(2, 1, recipe=fp8.DelayedScaling(4), key=jax.random.key(0))
    tx = jdls.wrap(optax.sgd(0.1))

    @eqx.filter_jit
    def step(model, opt_state, per_example):
        def loss_fn(m):
            y = jax.vmap(m)(XS[:, 0]) if per_example else m(XS[:, 0])
            return jnp.sum(y**2)

        _, grads = jdls.equinox.value_and_grad(loss_fn, jdls.get_scale(opt_state))(model)
        updates, opt_state = tx.update(grads, opt_state, model)
        return jdls.equinox.apply_updates(model, updates, opt_state), opt_state

    opt_state = tx.init(eqx.filter(layer, eqx.is_inexact_array))
    with pytest.warns(UserWarning, match=r"site\(s\) site served more than one use.*jax.vmap"):
        shared, _ = step(layer, opt_state, True)
        jax.block_until_ready(shared)
    assert float(shared.site.value.uses) == 3.0
    assert shared.site.value.lhs.history.tolist() == [0.0] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched, _ = step(layer, opt_state, False)
        jax.block_until_ready(batched)
    assert batched.site.value.lhs.history.tolist() == [10.5, 0.0, 0.0, 0.0]
