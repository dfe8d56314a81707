"""jdls.fp8 under data parallelism (amaxes reduced over the data axis) and checkpoint/resume."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _helpers import assert_bitwise_equal, fp8_mlp, maybe_jit, with_and_without_jit
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

_Mlp = fp8_mlp


def _data(step, n=32):
    k = jax.random.split(jax.random.key(step), 2)
    x = jax.random.normal(k[0], (n, 8)) * (1 + step)
    return x, jax.random.normal(k[1], (n, 2))


def _sum_loss(model, variables, x, t):
    return jnp.sum((model.apply(variables, x) - t) ** 2)  # a sum: shards add up exactly


def _grads(model, variables, x, t):
    return jax.grad(functools.partial(_sum_loss, model))(variables, x, t)


@pytest.mark.full
def test_shard_map_reduces_every_amax_over_the_data_axis():
    """Per-device amaxes, reduced over the axis the site is replicated on, equal the whole
    batch's (no axis name given anywhere)."""
    n_dev = 4
    mesh = jax.make_mesh((n_dev,), ("data",), devices=jax.devices()[:n_dev])
    single = sharded = _Mlp()
    x, t = _data(0)
    variables = single.init(jax.random.key(0), x)
    expected = _grads(single, variables, x, t)["jdls"]

    def per_device(variables, x, t):
        return _grads(sharded, variables, x, t)["jdls"]

    shard = NamedSharding(mesh, P("data"))
    got = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    )(
        jax.device_put(variables, NamedSharding(mesh, P())),
        jax.device_put(x, shard),
        jax.device_put(t, shard),
    )
    assert_bitwise_equal(
        jdls.update_sites(variables["jdls"], got), jdls.update_sites(variables["jdls"], expected)
    )


@with_and_without_jit
@pytest.mark.parametrize("across", ["shard_map", "pmap"])
def test_a_forward_pass_alone_runs_inside_shard_map_and_pmap(across, jit):
    """An evaluation step: the FP8 model and a probe, not differentiated, per device. JAX
    cannot run the sites' undifferentiated watch there (custom_vjp with symbolic zeros), so
    they pass unwatched; each device's output is the model's on its part of the batch."""
    n_dev, model = 4, _Mlp()
    x, _ = _data(0)
    variables = model.init(jax.random.key(0), x)
    probe = jdls.Site(jdls.Probe())

    def evaluate(variables, x):
        return jdls.apply_site(model.apply(variables, x), probe)

    if across == "pmap":
        fn = jax.pmap(evaluate, in_axes=(None, 0), devices=jax.devices()[:n_dev])
        got = maybe_jit(fn, jit)(variables, x.reshape(n_dev, -1, 8)).reshape(-1, 2)
    else:
        mesh = jax.make_mesh((n_dev,), ("data",), devices=jax.devices()[:n_dev])
        fn = jax.shard_map(evaluate, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
        placed = jax.device_put(variables, NamedSharding(mesh, P()))
        got = maybe_jit(fn, jit)(placed, jax.device_put(x, NamedSharding(mesh, P("data"))))
    want = jnp.concatenate([evaluate(variables, part) for part in jnp.split(x, n_dev)])
    assert_bitwise_equal(got, want)


@pytest.mark.full
def test_jit_with_a_sharded_batch_measures_the_global_amax():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    model = _Mlp()
    x, t = _data(1)
    variables = model.init(jax.random.key(0), x)
    expected = _grads(model, variables, x, t)["jdls"]
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ts = jax.device_put(t, NamedSharding(mesh, P("data")))
    got = jax.jit(functools.partial(_grads, model))(variables, xs, ts)["jdls"]
    for path in ("Dense_0", "Dense_1"):
        a = got[path]["DotGeneral_0"]["fp8"].value.meter
        b = expected[path]["DotGeneral_0"]["fp8"].value.meter
        assert_bitwise_equal(a.lhs.amax, b.lhs.amax)
        assert_bitwise_equal(a.grad.amax, b.grad.amax)


@pytest.mark.full
def test_checkpoint_resume_continues_bit_for_bit(tmp_path):
    model = _Mlp()
    tx = jdls.wrap(optax.adam(1e-2))
    x, _ = _data(0)
    variables = model.init(jax.random.key(0), x)
    state = {"variables": variables, "opt": tx.init(variables["params"])}

    @jax.jit
    def step(state, x, t):
        v = state["variables"]
        scale = jdls.get_scale(state["opt"])
        _, grads = scale.value_and_grad(lambda v: _sum_loss(model, v, x, t))(v)
        updates, opt = tx.update(grads["params"], state["opt"], v["params"])
        sites = jdls.update_sites(v["jdls"], grads["jdls"], jdls.stats(opt).finite)
        params = optax.apply_updates(v["params"], updates)
        return {"variables": {"params": params, "jdls": sites}, "opt": opt}

    for i in range(3):
        state = step(state, *_data(i))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
    reference = state
    for i in range(3, 6):
        reference = step(reference, *_data(i))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(
            tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        )
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for i in range(3, 6):
        restored = step(restored, *_data(i))
    assert_bitwise_equal(restored, reference)
    site = restored["variables"]["jdls"]["Dense_0"]["DotGeneral_0"]["fp8"].value
    assert np.count_nonzero(np.asarray(site.lhs.history)) == 4


@pytest.mark.full  # about 5 s
def test_a_checkpoint_saved_before_uses_were_counted_restores():
    """``flax.serialization`` of FP8 sites saved before a site counted its uses (no ``uses``
    field): they restore, ``uses`` from the target, and training goes on bit for bit."""
    from flax import serialization

    model = _Mlp()
    x, _ = _data(0)
    variables = model.init(jax.random.key(0), x)

    @jax.jit
    def step(v, x, t):
        grads = _grads(model, v, x, t)
        params = jax.tree.map(lambda p, g: p - 1e-3 * g, v["params"], grads["params"])
        return {"params": params, "jdls": jdls.update_sites(v["jdls"], grads["jdls"], True)}

    for i in range(2):
        variables = step(variables, *_data(i))

    def drop_uses(tree):  # the state dict as it was saved before the field existed
        if isinstance(tree, dict):
            return {k: drop_uses(v) for k, v in tree.items() if k != "uses"}
        return tree

    saved = serialization.msgpack_serialize(drop_uses(serialization.to_state_dict(variables)))
    target = model.init(jax.random.key(1), x)
    restored = serialization.from_state_dict(target, serialization.msgpack_restore(saved))
    site = restored["jdls"]["Dense_0"]["DotGeneral_0"]["fp8"].value
    assert float(site.uses) == 0.0  # the target's: a fresh state counts none
    assert (
        np.asarray(site.lhs.history).tolist()
        == np.asarray(
            variables["jdls"]["Dense_0"]["DotGeneral_0"]["fp8"].value.lhs.history
        ).tolist()
    )
    assert_bitwise_equal(step(restored, *_data(2)), step(variables, *_data(2)))
    with pytest.raises(ValueError, match="missing \\['meter'\\]"):
        broken = drop_uses(serialization.to_state_dict(variables))
        del broken["jdls"]["Dense_0"]["DotGeneral_0"]["fp8"]["value"]["meter"]
        serialization.from_state_dict(target, broken)


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(jdls.fp8.DelayedScaling(4), marks=pytest.mark.full),
        pytest.param(jdls.fp8.nvfp4(measure_error=True), marks=pytest.mark.full),
    ],
    ids=["delayed", "nvfp4"],
)
def test_retrying_with_an_axis_name_inside_shard_map_takes_fp8_sites(recipe):
    """jdls.retrying(axis_name=...) under shard_map with check_vma: the FP8 dot's cotangent
    of a measurement field it does not measure (``error``) is typed as the site state it is
    the cotangent of (the state varies across the data axis inside the retry loop)."""
    n = 4
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    dot = functools.partial(jdls.fp8.linen.DotGeneral, recipe=recipe)
    model = nn.Dense(8, dot_general_cls=dot)
    x = jax.random.normal(jax.random.key(1), (16 * n, 16))
    v = model.init(jax.random.key(0), x[:16])
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**15), axis_name="d")
    step = jdls.retrying(lambda p, x: jnp.mean(model.apply(p, x) ** 2), tx, axis_name="d")
    mapped = jax.shard_map(
        lambda p, o, x: step(p, o, x)[:2], mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=P()
    )
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    _, opt_state = jax.jit(mapped)(put(v, P()), put(tx.init(v), P()), put(x, P("d")))
    assert bool(jdls.stats(opt_state).finite)
