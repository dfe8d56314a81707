"""Equinox models with jdls: an ``eqx.Module`` is a pytree whose leaves include non-arrays
(activation functions, static numbers, strings).

* ``scale.value_and_grad`` differentiates it as ``eqx.filter_value_and_grad`` does
  (gradients for the floating-point arrays, ``None`` elsewhere), bit for bit, eager and under
  ``eqx.filter_jit``; so do ``jdls.accumulate``, ``jdls.multi_loss_value_and_grad``,
  sites (probes, per-layer scales) as Equinox fields.
* ``jdls.wrap``, ``jdls.clip``, ``jdls.stats`` and ``jdls.nonfinite_paths`` take Equinox's
  ``None`` leaves, with float32, bfloat16 and float16 parameters, and under ``shard_map``.
* A model and its optimizer state survive ``eqx.tree_serialise_leaves`` and orbax bit for bit.
* The README's train step runs with an Equinox model in place of the dict.
* ``import jdls`` does not import Equinox.
"""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import ROOT, assert_bitwise_equal, closing_over_sites
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

eqx = pytest.importorskip("equinox")
import jdls.equinox  # noqa: E402  (after the skip: it imports Equinox)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
dtype_ids = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
jit_ids = pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])


def maybe_filter_jit(fn, jit):
    return eqx.filter_jit(fn) if jit else fn


def cast(model, dtype):
    """The model with its floating-point arrays in ``dtype``."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model
    )


def make_model(dtype=jnp.float32, seed=0):
    return cast(eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(seed)), dtype)


def loss_fn(model, x, y):
    dtype = model.layers[0].weight.dtype
    pred = jax.vmap(model)(x.astype(dtype))
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def data(seed=0, n=16):
    x = jax.random.normal(jax.random.key(seed), (n, 4))
    return x, jnp.stack([x.sum(axis=1), x[:, 0] - x[:, 1]], axis=1)


class Tagged(eqx.Module):
    """Array leaves of every kind next to non-array ones."""

    w: jax.Array
    steps: jax.Array  # an integer array
    activation: object
    name: str
    factor: float


def tagged():
    return Tagged(jnp.array([1.0, -2.0]), jnp.array(3), jax.nn.relu, "t", 0.5)


def tagged_loss(m):
    return jnp.sum(m.activation(m.w) * m.steps * m.factor + m.w)


# --------------------------------------------------------------------------------------------
# Import.
# --------------------------------------------------------------------------------------------


def test_import_jdls_does_not_import_equinox():
    code = "import sys, jdls; print('equinox' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# value_and_grad.
# --------------------------------------------------------------------------------------------


@jit_ids
def test_non_array_leaves_get_none(jit):
    fn = maybe_filter_jit(jdls.DynamicScale(2.0**15).value_and_grad(tagged_loss), jit)
    loss, grads = fn(tagged())
    assert float(loss) == 0.5  # relu([1, -2]) * 3 * 0.5 + [1, -2] summed
    assert grads.w.tolist() == [2.5, 1.0] and grads.w.dtype == jnp.float32
    assert grads.steps is None and grads.activation is None
    assert grads.name is None and grads.factor is None


@jit_ids
@pytest.mark.parametrize(
    "scale", [jdls.StaticScale(2.0**10), jdls.DynamicScale(), jdls.NoOpScale()], ids=type
)
@pytest.mark.full(keep=1)
def test_equals_filter_value_and_grad(jit, scale):
    model, (x, y) = make_model(), data()
    loss, grads = maybe_filter_jit(scale.value_and_grad(loss_fn), jit)(model, x, y)
    ref_loss, ref_grads = maybe_filter_jit(eqx.filter_value_and_grad(loss_fn), jit)(model, x, y)
    assert_bitwise_equal(loss, ref_loss)
    assert_bitwise_equal(grads, ref_grads)  # None at the activations, as Equinox
    assert grads.activation is None and grads.final_activation is None


@jit_ids
def test_has_aux_and_several_arguments(jit):
    def fun(a, b, x):
        return jnp.sum(jax.vmap(a)(x) * jax.vmap(b)(x)), "aux"

    a, b, (x, _) = make_model(seed=1), make_model(seed=2), data()
    scale = jdls.StaticScale(4.0)
    (loss, aux), (ga, gb) = maybe_filter_jit(
        scale.value_and_grad(fun, argnums=(0, 1), has_aux=True), jit
    )(a, b, x)
    (ref_loss, _), (ra, rb) = maybe_filter_jit(
        eqx.filter_value_and_grad(lambda ab, x: fun(*ab, x), has_aux=True), jit
    )((a, b), x)
    assert aux == "aux"
    assert_bitwise_equal(loss, ref_loss)
    assert_bitwise_equal((ga, gb), (ra, rb))


def test_jdls_equinox_value_and_grad_is_filter_value_and_grad_scaled():
    model, (x, y) = make_model(), data()
    scale = jdls.StaticScale(2.0**10)
    loss, grads = eqx.filter_jit(jdls.equinox.value_and_grad(loss_fn, scale))(model, x, y)
    ref = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, x, y)
    assert_bitwise_equal((loss, grads), ref)
    (_, aux), _ = jdls.equinox.value_and_grad(lambda m: (jnp.sum(m.w), 7), scale, has_aux=True)(
        tagged()
    )
    assert aux == 7


def test_python_float_beside_arrays_is_held_as_in_equinox():
    model = {"w": jnp.ones(2), "eps": 0.5, "act": jax.nn.relu}
    _, grads = jdls.DynamicScale().value_and_grad(lambda m: jnp.sum(m["act"](m["w"]) * m["eps"]))(
        model
    )
    assert grads == {"w": grads["w"], "eps": None, "act": None}
    assert grads["w"].tolist() == [0.5, 0.5]
    # all floats (arrays and Python floats): jax.value_and_grad's own rules, as before
    _, grads = jdls.DynamicScale().value_and_grad(lambda m: m["a"] * m["b"])(
        {"a": 2.0, "b": jnp.float32(3.0)}
    )
    assert float(grads["a"]) == 3.0 and float(grads["b"]) == 2.0


class Scaled(eqx.Module):
    """Arrays and a Python ``float`` field, nothing else: every leaf is one JAX differentiates."""

    linear: eqx.nn.Linear
    factor: float


def scaled_model():
    return Scaled(eqx.nn.Linear(4, 2, key=jax.random.key(3)), 0.5)


def scaled_loss(model, x, y):
    return jnp.mean((jax.vmap(model.linear)(x) * model.factor - y) ** 2)


@jit_ids
def test_python_float_field_of_an_equinox_module_gets_none(jit):
    model, (x, y) = scaled_model(), data()
    scale = jdls.StaticScale(2.0**10)
    loss, grads = maybe_filter_jit(scale.value_and_grad(scaled_loss), jit)(model, x, y)
    ref = maybe_filter_jit(eqx.filter_value_and_grad(scaled_loss), jit)(model, x, y)
    assert grads.factor is None
    assert_bitwise_equal((loss, grads), ref)
    # the same tree as the parameters given to the optimizer
    params = eqx.filter(model, eqx.is_array)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)


def test_documented_step_with_a_python_float_field_trains_and_skips():
    """The train step of docs/equinox.md, on a model with a Python ``float`` field: it trains,
    and a step at an overflowing scale leaves the model as it was."""
    tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.adam(1e-2)))
    model, (x, y) = scaled_model(), data()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    step = make_step(tx, jit=True, loss=scaled_loss)
    losses = []
    for _ in range(20):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    assert model.factor == 0.5 and isinstance(model.factor, float)
    assert int(jdls.stats(opt_state).skipped_steps) == 0 and losses[-1] < losses[0]
    # an inf in the batch: the step is skipped, the model kept bit for bit
    new, opt_state, _ = step(model, opt_state, x.at[0, 0].set(jnp.inf), y)
    assert bool(jdls.stats(opt_state).skipped)
    assert_bitwise_equal(eqx.filter(new, eqx.is_array), eqx.filter(model, eqx.is_array))


def test_no_floating_point_array_says_what_to_do():
    scale = jdls.DynamicScale()
    with pytest.raises(
        TypeError,
        match=re.escape(
            "DynamicScale.value_and_grad differentiates argument 0 (argnums), which holds no "
            "floating-point array (its leaves: custom_jvp, int32 arrays). Pass the parameters "
            "to differentiate as floating-point arrays (e.g. x.astype(jnp.float32)), or choose "
            "the argument with argnums=..."
        ),
    ):
        scale.value_and_grad(lambda m: jnp.sum(m["n"]) * 1.0)(
            {"n": jnp.arange(3), "act": jax.nn.relu}
        )


# --------------------------------------------------------------------------------------------
# The other entry points that differentiate.
# --------------------------------------------------------------------------------------------


@pytest.mark.full  # about 6 s; tests/test_accumulate.py and the other Equinox tests stay
def test_accumulate_takes_an_equinox_model():
    model, (x, y) = make_model(), data()
    batches = (x.reshape(2, 8, 4), y.reshape(2, 8, 2))
    scale = jdls.DynamicScale(2.0**10)
    for retries in (0, 2):
        _, grads, info = eqx.filter_jit(
            lambda m, retries: jdls.accumulate(
                lambda m, b: loss_fn(m, *b), scale, m, batches, retries=retries
            )
        )(model, retries)
        ref = [
            eqx.filter_grad(loss_fn)(model, x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8])
            for i in (0, 1)
        ]
        ref = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, *ref)
        assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref)
        for g, r in zip(
            jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref), strict=True
        ):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
        assert int(info.kept) == 2 and grads.activation is None


@pytest.mark.parametrize("backward", ["one", "per_loss"])
@pytest.mark.full  # about 5 s; tests/test_multi_loss.py and the other Equinox tests stay
def test_multi_loss_takes_an_equinox_model(backward):
    model, (x, y) = make_model(), data()

    def losses(m, x, y):
        pred = jax.vmap(m)(x)
        return {"a": jnp.mean((pred[:, 0] - y[:, 0]) ** 2), "b": jnp.mean(pred[:, 1] ** 2)}

    scales = {"a": jdls.StaticScale(2.0**4), "b": jdls.StaticScale(2.0**8)}
    _, grads, finite = jdls.multi_loss_value_and_grad(losses, scales, backward=backward)(
        model, x, y
    )
    ref = eqx.filter_grad(lambda m: sum(losses(m, x, y).values()))(model)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
    assert bool(finite["a"]) and bool(finite["b"])


@pytest.mark.parametrize("jit", [True, False], ids=["filter_jit", "eager"])
@pytest.mark.full(keep=1)  # the quick run keeps the jitted case
def test_a_probe_field_measures_and_leaves_the_gradients_unchanged(jit):
    model, (x, y) = make_model(), data()
    probe = jdls.Site(jdls.Probe())

    def probed_loss(m, site, x, y):
        h = jdls.apply_site(jax.vmap(m)(x).astype(jnp.float16), site)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    scale = jdls.StaticScale(2.0**10)
    loss, grads = maybe_filter_jit(
        jdls.equinox.value_and_grad(lambda mp, x, y: probed_loss(*mp, x, y), scale), jit
    )((model, probe), x, y)
    ref_loss, ref = closing_over_sites(
        maybe_filter_jit(
            jdls.equinox.value_and_grad(lambda m, x, y: probed_loss(m, probe, x, y), scale), jit
        )
    )(model, x, y)
    assert jdls.Telemetry.of({"out": grads[1]}).names == ("out",)
    assert_bitwise_equal((loss, grads[0]), (ref_loss, ref))


class Block(eqx.Module):
    linear: eqx.nn.Linear
    probe: jdls.Site
    scale: jdls.Site

    def __call__(self, h: jax.Array) -> jax.Array:
        h = jnp.tanh(jax.vmap(self.linear)(h.astype(self.linear.weight.dtype)) + 1.0)
        return jdls.apply_site(jdls.apply_site(h, self.probe), self.scale)


class Stacked(eqx.Module):
    """Blocks made by eqx.filter_vmap (their sites stacked with them), run by lax.scan of
    eqx.filter_checkpoint, and a head: the shape of an Equinox transformer."""

    blocks: Block
    head: eqx.nn.Linear
    head_scale: jdls.Site

    def __init__(self, key: jax.Array, depth: int = 4, width: int = 8, levels=None):
        keys = jax.random.split(key, depth + 1)
        levels = [1.0] * depth if levels is None else levels

        def make(key: jax.Array, level: jax.Array) -> Block:
            site = jdls.layer_site(jdls.StaticScale(1.0), 0)
            site = jdls.Site(site.kind, {**site.value, "scale": jdls.StaticScale(1.0)})
            block = Block(eqx.nn.Linear(width, width, key=key), jdls.Site(jdls.Probe()), site)
            return eqx.tree_at(lambda b: b.scale.value["scale"].loss_scale, block, level)

        self.blocks = eqx.filter_vmap(make)(keys[:depth], jnp.asarray(levels, jnp.float32))
        self.head = eqx.nn.Linear(width, 1, key=keys[depth])
        self.head_scale = jdls.layer_site(jdls.StaticScale(2.0**-3), 1)

    def __call__(self, x: jax.Array) -> jax.Array:
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        @eqx.filter_checkpoint
        def body(h: jax.Array, d: Block) -> tuple[jax.Array, None]:
            return eqx.combine(d, static)(h), None

        h, _ = jax.lax.scan(body, x, dynamic)
        return jdls.apply_site(jax.vmap(self.head)(h), self.head_scale)


LEVELS = [2.0**30, 2.0**-6, 2.0**12, 2.0**3]


def stacked_loss(model: Stacked, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.full
def test_a_scanned_checkpointed_stack_has_a_site_per_layer():
    """Per-layer scales (2**36 apart within the stack) and probes in an eqx.filter_vmap
    stack run by lax.scan of eqx.filter_checkpoint: the gradients are float32
    eqx.filter_grad's, a row of telemetry per layer, and the ordinary Equinox step (jdls.wrap,
    jdls.equinox.apply_updates) records the measurements in the model's sites."""
    model = Stacked(jax.random.key(0), levels=LEVELS)
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jnp.ones((16, 1))
    fn = eqx.filter_jit(jdls.equinox.layer_scaled_value_and_grad(stacked_loss))
    loss, grads = fn(model, x, y)
    ref_loss, ref = eqx.filter_value_and_grad(stacked_loss)(model, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    params = lambda t: eqx.filter(  # noqa: E731
        jdls.split_sites(t)[0], eqx.is_array, is_leaf=lambda v: v is None
    )
    for g, r in zip(
        jax.tree_util.tree_leaves(params(grads)),
        jax.tree_util.tree_leaves(params(ref)),
        strict=True,
    ):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7 * float(jnp.max(jnp.abs(r))))
    t = jdls.Telemetry.of(grads)
    assert t.names == tuple(f"blocks[{i}]" for i in range(4))
    assert np.asarray(t.uses).tolist() == [1.0] * 4
    # each probe sits before its layer's site in the forward pass: it sees its layer's scale
    probes_plain = jdls.Telemetry.of(ref)
    np.testing.assert_allclose(t.amax, np.asarray(probes_plain.amax) * np.array(LEVELS), rtol=1e-5)

    tx = jdls.wrap(optax.sgd(0.1), jdls.NoOpScale())
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    new = jdls.equinox.apply_updates(model, updates, opt_state)
    np.testing.assert_allclose(jdls.Telemetry.of(new).amax, t.amax)
    assert new.blocks.scale.value["scale"].loss_scale.tolist() == LEVELS  # static scales
    np.testing.assert_allclose(
        new.blocks.scale.value["amax"],
        jnp.max(
            jnp.stack(
                [
                    jnp.abs(grads.blocks.linear.weight).reshape(4, -1).max(1),
                    jnp.abs(grads.blocks.linear.bias).max(1),
                ]
            ),
            axis=0,
        ),
    )


def test_layer_scales_take_equinox_layers_holding_their_sites():
    key0, key1 = jax.random.split(jax.random.key(0))

    class Layer(eqx.Module):
        inner: eqx.Module
        site: jdls.Site

        def __call__(self, x):
            return jdls.apply_site(jax.vmap(self.inner)(x), self.site)

    layers = [
        Layer(
            eqx.nn.Sequential([eqx.nn.Linear(4, 8, key=key0), eqx.nn.Lambda(jax.nn.relu)]),
            jdls.layer_site(jdls.StaticScale(2.0**6), 0),
        ),
        Layer(eqx.nn.Linear(8, 2, key=key1), jdls.layer_site(jdls.StaticScale(2.0**2), 1)),
    ]
    x, y = data()

    def loss(p, x, y):
        h = x
        for layer in p:
            h = layer(h)
        return jnp.mean((h - y) ** 2)

    _, grads = jdls.equinox.layer_scaled_value_and_grad(loss)(layers, x, y)
    ref = eqx.filter_grad(loss)(layers, x, y)
    rest, measured = jdls.split_sites(grads)
    assert_bitwise_equal(rest, jdls.split_sites(ref)[0])
    assert rest[0].inner.layers[1].fn is None and float(measured[0].site.value["finite"]) == 1.0


@pytest.mark.full
def test_retrying_with_an_equinox_model():
    """In float16 at 2**24 the gradients overflow and the loss does not: ``jdls.retrying``
    recomputes them at backed-off scales inside the step; the model's arrays are the
    parameters and ``eqx.combine`` rebuilds the model in the loss."""
    model, (x, y) = make_model(jnp.float16), data()
    params, static = eqx.partition(model, eqx.is_array)
    tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**24))
    step = jdls.retrying(lambda p, x, y: loss_fn(eqx.combine(p, static), x, y), tx, retries=12)
    new_params, opt_state, _ = jax.jit(step)(params, tx.init(params), x, y)
    new = eqx.combine(new_params, static)
    stats = jdls.stats(opt_state)
    assert not bool(stats.skipped) and int(stats.retries) > 0
    _, ref = jdls.get_scale(opt_state).value_and_grad(loss_fn)(model, x, y)
    ref_new = jdls.equinox.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, ref))
    for a, b in zip(
        jax.tree_util.tree_leaves(eqx.filter(new, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(ref_new, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-3)


# --------------------------------------------------------------------------------------------
# The train step: wrap, clip, stats, nonfinite_paths.
# --------------------------------------------------------------------------------------------


def make_step(tx, jit=True, loss=loss_fn):
    def train_step(model, opt_state, x, y):
        scale = jdls.get_scale(opt_state)
        loss_value, grads = scale.value_and_grad(loss)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return jdls.equinox.apply_updates(model, updates, opt_state), opt_state, loss_value

    return maybe_filter_jit(train_step, jit)


@jit_ids
@dtype_ids
@pytest.mark.full
def test_train_step_equals_the_hand_written_one(jit, dtype):
    """The front door (``scale.value_and_grad``) equals Equinox's differentiation of the
    scaled loss, unscaled by hand, bit for bit, step after step."""
    tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.adam(1e-2), track_nonfinite=True))
    model, (x, y) = make_model(dtype), data()
    step = make_step(tx, jit)

    def by_hand(model, opt_state, x, y):
        scale = jdls.get_scale(opt_state)
        _, grads = eqx.filter_value_and_grad(lambda m: scale.scale(loss_fn(m, x, y)))(model)
        grads = scale.unscale(grads)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return jdls.equinox.apply_updates(model, updates, opt_state), opt_state

    a, sa = model, tx.init(eqx.filter(model, eqx.is_array))
    b, sb = a, sa
    for _ in range(5):
        a, sa, _ = step(a, sa, x, y)
        b, sb = maybe_filter_jit(by_hand, jit)(b, sb, x, y)
    assert_bitwise_equal(eqx.filter((a, sa), eqx.is_array), eqx.filter((b, sb), eqx.is_array))
    assert a.layers[0].weight.dtype == dtype
    assert int(jdls.stats(sa).skipped_steps) == 0 and jdls.nonfinite_paths(sa) == []
    # the default (AdaptiveScale) moved up from 1 to the measured gradients: 2**12 here
    assert float(jdls.get_scale(sa).loss_scale) == 2.0**12


@dtype_ids
@pytest.mark.full(keep=1)
def test_overflow_is_skipped_and_located(dtype):
    """At a loss scale of 2**24, float16 gradients overflow: the step is skipped (the model
    unchanged, bit for bit), the scale halves, and nonfinite_paths names the leaves."""
    tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.adam(1e-2), track_nonfinite=True))
    model, (x, y) = make_model(dtype), data()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    opt_state = jdls.set_scale(opt_state, jdls.DynamicScale(2.0**24))
    new, opt_state, _ = make_step(tx)(model, opt_state, x, y)
    stats = jdls.stats(opt_state)
    if dtype == jnp.float16:
        assert bool(stats.skipped) and int(stats.skipped_steps) == 1
        assert float(jdls.get_scale(opt_state).loss_scale) == 2.0**23
        assert_bitwise_equal(eqx.filter(new, eqx.is_array), eqx.filter(model, eqx.is_array))
        assert jdls.nonfinite_paths(opt_state) == [
            ".layers[0].weight",
            ".layers[0].bias",
            ".layers[1].weight",
            ".layers[1].bias",
            ".layers[2].weight",
            ".layers[2].bias",
        ]
    else:
        assert not bool(stats.skipped) and jdls.nonfinite_paths(opt_state) == []


def test_wrap_says_to_filter_the_model():
    tx = jdls.wrap(optax.adam(1e-2))
    model = make_model()
    with pytest.raises(
        TypeError,
        match=re.escape(
            "jdls.wrap: the params given to tx.init hold non-array leaves (2, the first "
            "custom_jvp at .activation), as an Equinox model does: pass only its arrays, "
            "eqx.filter(model, eqx.is_array), to tx.init and tx.update"
        ),
    ):
        tx.init(model)
    state = tx.init(eqx.filter(model, eqx.is_array))
    grads = eqx.filter_grad(loss_fn)(model, *data())
    with pytest.raises(
        ValueError,
        match=r"only in params: \.activation, \.final_activation.*eqx\.filter\(model, eqx\.is_array\)",
    ):
        tx.update(grads, state, model)


@dtype_ids
@pytest.mark.full(keep=1)
def test_apply_updates_keeps_the_dtype(dtype):
    """``eqx.apply_updates`` adds float32 updates to 16-bit parameters and so promotes them;
    ``jdls.equinox.apply_updates`` keeps them, as ``optax.apply_updates`` does for dicts."""
    model = make_model(dtype)
    params = eqx.filter(model, eqx.is_array)
    updates = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 2.0**-4, jnp.float32), params)
    new = jdls.equinox.apply_updates(model, updates)
    assert new.activation is model.activation
    assert_bitwise_equal(eqx.filter(new, eqx.is_array), optax.apply_updates(params, updates))
    assert eqx.apply_updates(model, updates).layers[0].weight.dtype == jnp.promote_types(
        dtype, jnp.float32
    )


def test_clip_takes_none_leaves():
    grads = eqx.filter_grad(tagged_loss)(tagged())
    clipped, _ = jdls.clip(1.0).update(grads, jdls.clip(1.0).init(None))
    assert clipped.steps is None and clipped.activation is None
    np.testing.assert_allclose(clipped.w, np.array([2.5, 1.0]) / np.hypot(2.5, 1.0), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------------------------


@dtype_ids
@pytest.mark.full(keep=1)
def test_tree_serialise_leaves_round_trip(dtype, tmp_path):
    scale = jdls.DynamicScale(2.0**24, growth_interval=3)
    tx = jdls.wrap(optax.adam(1e-2), scale, track_nonfinite=True)
    model, (x, y) = make_model(dtype), data()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    step = make_step(tx)
    for _ in range(4):
        model, opt_state, _ = step(model, opt_state, x, y)
    eqx.tree_serialise_leaves(tmp_path / "run.eqx", (model, opt_state))

    template_model = make_model(dtype, seed=9)  # other values, same structure
    template = (template_model, tx.init(eqx.filter(template_model, eqx.is_array)))
    restored = eqx.tree_deserialise_leaves(tmp_path / "run.eqx", template)
    assert_bitwise_equal(
        eqx.filter(restored, eqx.is_array), eqx.filter((model, opt_state), eqx.is_array)
    )
    assert jdls.get_scale(restored[1]) == jdls.get_scale(opt_state)
    a = step(model, opt_state, x, y)
    b = step(*restored, x, y)
    assert_bitwise_equal(eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array))


def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = jdls.wrap(optax.adam(1e-2))
    model, (x, y) = make_model(jnp.bfloat16), data()
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = tx.init(params)
    model, opt_state, _ = make_step(tx)(model, opt_state, x, y)
    tree = (eqx.filter(model, eqx.is_array), opt_state)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", tree)
        checkpointer.wait_until_finished()
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(
            tmp_path / "ckpt", jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
        )
    assert_bitwise_equal(restored, tree)
    assert isinstance(eqx.combine(restored[0], static), eqx.nn.MLP)


# --------------------------------------------------------------------------------------------
# shard_map.
# --------------------------------------------------------------------------------------------


@pytest.mark.full  # about 6 s; shard_map skipping stays in tests/integration/test_multidevice.py
def test_shard_map_data_parallel_skips_everywhere():
    """Data parallelism over 8 devices with an Equinox model: the model's arrays replicated,
    the batch split; an inf on one device's part makes every device skip."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    tx = jdls.wrap(optax.adam(1e-2), jdls.DynamicScale(2.0**8), axis_name="d")
    model, (x, y) = make_model(jnp.float16), data(n=2 * n)
    params, static = eqx.partition(model, eqx.is_array)

    def local(params, opt_state, x, y):
        model = eqx.combine(params, static)
        loss, grads = jdls.get_scale(opt_state).value_and_grad(loss_fn)(model, x, y)
        grads = jax.lax.pmean(eqx.filter(grads, eqx.is_array), "d")
        updates, opt_state = tx.update(grads, opt_state, params)
        return (
            jdls.equinox.apply_updates(params, updates, opt_state),
            opt_state,
            jax.lax.pmean(loss, "d"),
        )

    step = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P(), P(), P())
        )
    )
    opt_state = tx.init(params)
    split = NamedSharding(mesh, P("d"))
    new, state, loss = step(params, opt_state, jax.device_put(x, split), jax.device_put(y, split))
    assert not bool(jdls.stats(state).skipped)
    ref_loss = loss_fn(model, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    ref_new, _, _ = make_step(jdls.wrap(optax.adam(1e-2), jdls.DynamicScale(2.0**8)))(
        model, opt_state, x, y
    )
    ref_new = eqx.filter(ref_new, eqx.is_array)
    for a, b in zip(
        jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(ref_new), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-3)

    bad_x = jax.device_put(x.at[2 * (n - 1), 0].set(jnp.inf), split)  # the last device's
    new, state, _ = step(params, opt_state, bad_x, jax.device_put(y, split))
    stats = jdls.stats(state)
    assert bool(stats.skipped) and int(stats.skipped_steps) == 1
    assert float(jdls.get_scale(state).loss_scale) == 2.0**7
    assert_bitwise_equal(new, params)


# --------------------------------------------------------------------------------------------
# The README's train step.
# --------------------------------------------------------------------------------------------


def readme_block():
    text = (ROOT / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


README_LOSS = """def loss_fn(params, x, y):
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)  # compute in float16
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)
"""
README_PARAMS = 'params = {"w": jnp.zeros((8, 1))}\n'

EQX_LOSS = """def loss_fn(params, x, y):
    half = jax.tree_util.tree_map(
        lambda p: p.astype(jnp.float16) if eqx.is_inexact_array(p) else p, params
    )
    pred = jax.vmap(half)(x.astype(jnp.float16))  # compute in float16
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)
"""


def run_readme(source, capsys):
    namespace = {"__name__": "readme"}
    exec(compile("import equinox as eqx\n" + source, "<README>", "exec"), namespace)
    return capsys.readouterr().out, namespace


@pytest.mark.full
def test_readme_step_with_an_equinox_linear_runs_unchanged(capsys):
    """A model whose leaves are all arrays (``eqx.nn.Linear``): only the loss and the model
    change; ``jax.jit``, ``tx.init(params)`` and ``optax.apply_updates`` as in the README."""
    source = readme_block()
    assert README_LOSS in source and README_PARAMS in source
    source = source.replace(README_LOSS, EQX_LOSS).replace(
        README_PARAMS, "params = eqx.nn.Linear(8, 1, key=jax.random.key(1))\n"
    )
    out, ns = run_readme(source, capsys)
    assert isinstance(ns["params"], eqx.nn.Linear)
    assert re.fullmatch(r"loss 0\.0\d\d\d, scale \d+, skipped \d+\n", out), out


def test_readme_step_with_an_equinox_mlp(capsys):
    """A model with function leaves (``eqx.nn.MLP``): the train step's body as in the README;
    around it, Equinox's own three lines for any optax optimizer: ``eqx.filter_jit``,
    ``eqx.filter(model, eqx.is_array)`` for the optimizer, ``eqx.apply_updates``."""
    source = readme_block()
    edits = {
        README_LOSS: EQX_LOSS,
        README_PARAMS: "params = eqx.nn.MLP(8, 1, 16, 1, key=jax.random.key(1))\n",
        "@jax.jit\n": "@eqx.filter_jit\n",
        "opt_state = tx.init(params)": "opt_state = tx.init(eqx.filter(params, eqx.is_array))",
        "tx.update(grads, opt_state, params)": (
            "tx.update(grads, opt_state, eqx.filter(params, eqx.is_array))"
        ),
        "optax.apply_updates(params, updates)": "eqx.apply_updates(params, updates)",
    }
    for old, new in edits.items():
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    out, ns = run_readme(source, capsys)
    assert isinstance(ns["params"], eqx.nn.MLP)
    assert re.fullmatch(r"loss 0\.0\d\d\d, scale \d+, skipped \d+\n", out), out
