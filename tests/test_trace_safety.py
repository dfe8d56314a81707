"""Per-layer boundaries and probes never give a silently different number.

A boundary or a probe acts only in the trace of the differentiation it belongs to. One reached
inside a nested transformation of the loss (an inner ``jax.jit`` of the forward, a jitted
``model.apply``, ``jax.checkpoint``, ``lax.scan``, ``nn.scan``, an inner ``vmap``), whose
trace JAX caches or batches on its own, is refused at trace time with an error naming the
construct; a trace JAX cached before without them is detected. Positional Python arguments
(a ``train`` flag, a mode string, a callable) pass through as themselves, as with
``jax.value_and_grad``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdls

NAMES = ("d0", "d1", "d2")
SCALES = {
    "d0": jdls.StaticScale(2.0**20),
    "d1": jdls.StaticScale(2.0**14),
    "d2": jdls.StaticScale(2.0**8),
}
NESTED = "nested JAX transformation"


def _params():
    rng = np.random.default_rng(0)
    return {n: jnp.asarray(rng.standard_normal((3, 3)) * 0.5, jnp.float32) for n in NAMES}


X = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3)), jnp.float32)


def _forward(p, x):
    for n in NAMES:
        x = jdls.layer_boundary(jnp.tanh(x @ p[n]), n)
    return x


def _plain(p, x):
    for n in NAMES:
        x = jnp.tanh(x @ p[n])
    return x


def _assert_tree_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- boundaries inside a jitted forward ------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_boundaries_in_the_loss_itself_are_exact(jit):
    def loss(p, x):
        return jnp.sum(_forward(p, x))

    fn = jdls.layer_scaled_value_and_grad(loss, SCALES)
    fn = jax.jit(fn) if jit else fn
    _, grads, finite = fn(_params(), X)
    expected = jax.grad(lambda p, x: jnp.sum(_plain(p, x)))(_params(), X)
    _assert_tree_equal(grads, expected)
    assert all(bool(f) for f in finite.values())


def test_boundaries_inside_an_inner_jit_are_refused():
    forward = jax.jit(_forward)

    def loss(p, x):
        return jnp.sum(forward(p, x))

    with pytest.raises(ValueError, match=f"layer_boundary\\('d0'\\).*{NESTED}"):
        jdls.layer_scaled_value_and_grad(loss, SCALES)(_params(), X)


def test_a_jitted_linen_apply_is_refused():
    model = nn.Sequential([nn.Dense(3), nn.Dense(3)])
    params = model.init(jax.random.key(0), X)["params"]
    apply = jax.jit(model.apply)
    scales = {"layers_0": jdls.StaticScale(2.0**10), "layers_1": jdls.StaticScale(2.0**4)}

    def loss(p, x):
        with jdls.linen.layer_boundaries():
            return jnp.sum(apply({"params": p}, x))

    with pytest.raises(ValueError, match=f"layer_boundary\\('layers_0'\\).*{NESTED}"):
        jdls.layer_scaled_value_and_grad(loss, scales)(params, X)


def test_a_trace_cached_without_the_boundaries_is_detected():
    forward = jax.jit(_forward)
    forward(_params(), X)  # traced outside: JAX caches a trace without boundaries

    def loss(p, x):
        return jnp.sum(forward(p, x))

    with pytest.raises(ValueError, match="cached"):
        jdls.layer_scaled_value_and_grad(loss, SCALES)(_params(), X)


# ---- probes inside an inner jit or checkpoint ------------------------------------------------


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(4)(x)))


def test_probe_linen_around_a_jitted_apply_is_refused():
    model = _MLP()
    params = model.init(jax.random.key(0), X)
    apply = jax.jit(model.apply)

    def loss(p):
        with jdls.linen.probes():
            return jnp.sum(apply(p, X))

    with pytest.raises(ValueError, match=f"jdls.probe\\('Dense_1'\\).*{NESTED}"):
        jdls.probed_value_and_grad(loss, jdls.StaticScale(8.0))(params)


def test_a_probe_inside_a_checkpointed_function_is_refused():
    @jax.checkpoint
    def block(w, x):
        return jdls.probe(jnp.tanh(x * w), "h")

    def loss(w):
        return jnp.sum(block(w, X) * 3.0)

    with pytest.raises(ValueError, match=f"jdls.probe\\('h'\\).*{NESTED}"):
        jdls.probed_value_and_grad(loss, jdls.StaticScale(8.0))(jnp.float32(0.5))


def test_probes_outside_the_inner_jit_measure_the_cotangents():
    inner = jax.jit(lambda w, x: jnp.tanh(x * w))

    def loss(w):
        return jnp.sum(jdls.probe(inner(w, X), "h") * 3.0)

    _, _, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(8.0))(jnp.float32(0.5))
    assert t.names == ("h",)
    assert float(t.amax[0]) == 24.0


# ---- probes inside loops and inner vmaps -----------------------------------------------------


def test_a_probe_inside_lax_scan_is_refused():
    def loss(w):
        def body(c, _):
            return c + jdls.probe(w * 1.0, "step"), None

        total, _ = jax.lax.scan(body, jnp.zeros(()), None, length=5)
        return total

    with pytest.raises(ValueError, match=f"jdls.probe\\('step'\\).*{NESTED}"):
        jdls.probed_value_and_grad(loss, jdls.StaticScale(1.0))(jnp.float32(1.0))


def test_a_probe_inside_an_inner_vmap_is_refused():
    def loss(w):
        return jnp.sum(jax.vmap(lambda x: jdls.probe(x * w, "row"))(X))

    with pytest.raises(ValueError, match=f"jdls.probe\\('row'\\).*{NESTED}"):
        jdls.probed_value_and_grad(loss, jdls.StaticScale(1.0))(jnp.float32(1.0))


def test_probe_linen_inside_nn_scan_is_refused():
    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return jnp.tanh(nn.Dense(3)(c)), None

    model = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()
    params = model.init(jax.random.key(0), X, None)

    def loss(p):
        with jdls.linen.probes():
            return jnp.sum(model.apply(p, X, None)[0])

    with pytest.raises(ValueError, match=NESTED):
        jdls.probed_value_and_grad(loss, jdls.StaticScale(1.0))(params)


def test_an_outer_vmap_keeps_one_measurement_per_example():
    def loss(w, x):
        return jnp.sum(jdls.probe(x * w, "h") * 2.0)

    fn = jax.vmap(jdls.probed_value_and_grad(loss, jdls.StaticScale(4.0)), in_axes=(None, 0))
    _, _, t = fn(jnp.float32(1.0), X)
    assert t.amax.shape == (2, 1)
    assert np.asarray(t.amax).tolist() == [[8.0], [8.0]]


# ---- positional Python arguments -------------------------------------------------------------


def _with_statics(p, x, train, mode, act):
    assert isinstance(train, bool) and isinstance(mode, str) and callable(act)
    h = x
    for n in NAMES:
        h = jdls.layer_boundary(act(h @ p[n]), n)
    y = jnp.sum(h) if train else jnp.mean(h)
    return y * 2.0 if mode == "double" else y


@pytest.mark.parametrize("jit", [False, True])
def test_positional_python_arguments_pass_through_layer_scaled(jit):
    fn = jdls.layer_scaled_value_and_grad(_with_statics, SCALES)
    if jit:
        fn = jax.jit(fn, static_argnums=(2, 3, 4))
    value, grads, _ = fn(_params(), X, True, "double", jnp.tanh)
    ref_value, ref_grads = jax.value_and_grad(_with_statics)(_params(), X, True, "double", jnp.tanh)
    assert float(value) == float(ref_value)
    _assert_tree_equal(grads, ref_grads)


def test_positional_python_arguments_pass_through_nnx_layer_scaled():
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    scales = {"layers/0": jdls.StaticScale(2.0**10), "layers/1": jdls.StaticScale(2.0**4)}

    def loss_fn(m, x, train, mode, act):
        assert isinstance(train, bool) and isinstance(mode, str)
        y = act(m(x))
        y = jnp.sum(y) if train else jnp.mean(y)
        return y * 2.0 if mode == "double" else y

    fn = jdls.nnx.layer_scaled_value_and_grad(loss_fn, scales)
    value, grads, _ = fn(model, X, True, "double", jnp.tanh)
    ref_value, ref_grads = nnx.value_and_grad(loss_fn)(model, X, True, "double", jnp.tanh)
    assert float(value) == float(ref_value)
    _assert_tree_equal(grads, ref_grads)


def test_positional_python_arguments_pass_through_probed():
    def loss(w, train, mode, act):
        assert isinstance(train, bool) and isinstance(mode, str)
        y = jdls.probe(act(w * 2.0), "h")
        y = jnp.sum(y) if train else jnp.mean(y)
        return y * 2.0 if mode == "double" else y

    w = jnp.ones(3, jnp.float32)
    value, grads, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(4.0))(
        w, True, "double", jnp.tanh
    )
    ref_value, ref_grads = jax.value_and_grad(loss)(w, True, "double", jnp.tanh)
    assert float(value) == float(ref_value)
    _assert_tree_equal(grads, ref_grads)
    assert float(t.amax[0]) == 8.0  # the cotangent of h: 2 * the scale 4


# ---- NNX: transformations call copies of the hooked modules ----------------------------------


@pytest.mark.parametrize("transform", ["jit", "remat"])
def test_nnx_transformations_inside_the_loss_are_refused(transform):
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    scales = {"layers/0": jdls.StaticScale(2.0**10), "layers/1": jdls.StaticScale(2.0**4)}
    wrap = {"jit": nnx.jit, "remat": nnx.remat}[transform]

    def loss_fn(m, x):
        return jnp.sum(wrap(lambda m, x: m(x))(m, x))

    with pytest.raises(ValueError, match="a copy of an NNX module"):
        jdls.nnx.layer_scaled_value_and_grad(loss_fn, scales)(model, X)

    def probed(x):
        with jdls.nnx.probes(model):
            return loss_fn(model, x)

    with pytest.raises(ValueError, match="a copy of an NNX module"):
        jdls.probed_value_and_grad(probed, jdls.StaticScale(4.0))(X)


# ---- shard_map: each device measures its own cotangents ---------------------------------------


@pytest.mark.parametrize("check_vma", [True, False])
def test_probes_under_shard_map_measure_each_device(check_vma):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    x = jax.device_put(jnp.array([[1.0], [2.0]]), NamedSharding(mesh, P("d")))

    def loss(w, x):
        return jnp.sum(jdls.probe(x * w, "h") * x)  # the cotangent of h is x

    def per_device(w, x):
        _, _, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(4.0))(w, x)
        return t.amax[None]

    run = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"), check_vma=check_vma
    )
    assert np.asarray(jax.jit(run)(jnp.float32(1.0), x)).tolist() == [[4.0], [8.0]]


def test_a_python_int_argument_stays_a_python_int():
    def loss(p, x, repeats):
        h = x
        for _ in range(repeats):  # needs a Python int, as jax.value_and_grad passes it
            h = h * 1.0
        return jnp.sum(_forward(p, h))

    _, grads, _ = jdls.layer_scaled_value_and_grad(loss, SCALES)(_params(), X, 2)
    _assert_tree_equal(grads, jax.grad(loss)(_params(), X, 2))

    def probed(w, repeats):
        return jnp.sum(jdls.probe(w * float(repeats), "h"))

    _, g, t = jdls.probed_value_and_grad(probed, jdls.StaticScale(2.0))(jnp.ones(2), 3)
    assert g.tolist() == [3.0, 3.0] and float(t.amax[0]) == 2.0
