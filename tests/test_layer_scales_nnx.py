"""Per-layer scales of NNX models without model edits: jdls.nnx.layer_boundaries and
jdls.nnx.layer_scaled_value_and_grad."""

from __future__ import annotations

import math

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import as_pure, assert_bitwise_equal, maybe_jit, with_and_without_jit
from flax import nnx

import jdls

F16_MAX = 65504.0


def tanh_mlp(
    depth: int = 4, width: int = 16, dtype=jnp.float32, bias: float = 0.0
) -> nnx.Sequential:
    """Linear, tanh, Linear, tanh, ..., Linear(width, 1): the layers are ``layers/0``,
    ``layers/2``, ... (the tanh are plain functions, not modules)."""
    rngs = nnx.Rngs(0)
    init = nnx.initializers.constant(bias)
    fns: list = []
    for _ in range(depth):
        fns += [nnx.Linear(width, width, dtype=dtype, bias_init=init, rngs=rngs), nnx.tanh]
    fns.append(nnx.Linear(width, 1, dtype=dtype, rngs=rngs))
    return nnx.Sequential(*fns)


def layer_names(depth: int) -> list[str]:
    return [f"layers/{2 * i}" for i in range(depth + 1)]


def mse(model: nnx.Module, x: jax.Array) -> jax.Array:
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


def by_layer(state: nnx.State) -> dict[str, list[jax.Array]]:
    """The arrays of a param state by layer (``layers/2``), on the host."""
    out: dict[str, list] = {}
    for path, value in nnx.to_flat_state(as_pure(state)):
        out.setdefault(f"{path[0]}/{path[1]}", []).append(np.asarray(value))
    return out


def assert_close_in_float32(state: nnx.State, expected: nnx.State) -> None:
    """Equal to float32 rounding (rtol 1e-6): two jitted programs, ours with the boundaries'
    multiplies, fuse differently, and XLA then sums (the bias's batch sum) or rounds in
    another order, as jitted ``nnx.grad`` itself differs from eager ``nnx.grad``."""
    ours, theirs = nnx.to_flat_state(as_pure(state)), nnx.to_flat_state(as_pure(expected))
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    for (path, a), (_, b) in zip(ours, theirs, strict=True):
        atol = 1e-6 * float(np.max(np.abs(b)))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=atol, err_msg=str(path))


@with_and_without_jit
def test_nnx_per_layer_grads_equal_float32_grads(jit: bool) -> None:
    """float32, scales 2**20 apart from layer to layer. Eager: the gradients are nnx.grad's
    bit for bit. Under jax.jit over the split state (the scales an argument): bit for bit
    those of the same compiled program with every scale 1 (the scaling is exact), and
    jitted nnx.grad's to float32 rounding (another program, fused differently)."""
    model = tanh_mlp()
    x = jax.random.normal(jax.random.key(1), (32, 16))
    names = layer_names(4)
    scales = {n: jdls.StaticScale(2.0**e) for n, e in zip(names, [60, 40, 20, 0, -20], strict=True)}
    graphdef, state = nnx.split(model)

    def ours(scales: dict, state: nnx.State, x: jax.Array) -> tuple:
        fn = jdls.nnx.layer_scaled_value_and_grad(mse, scales)
        return fn(nnx.merge(graphdef, state), x)

    def reference(state: nnx.State, x: jax.Array) -> tuple:
        return nnx.value_and_grad(mse)(nnx.merge(graphdef, state), x)

    value, grads, finite = maybe_jit(ours, jit)(scales, state, x)
    expected_value, expected = maybe_jit(reference, jit)(state, x)
    assert float(value) == float(expected_value)
    assert sorted(finite) == sorted(names) and all(bool(f) for f in finite.values())
    if not jit:
        assert_bitwise_equal(as_pure(grads), as_pure(expected))
        return
    ones = dict.fromkeys(names, jdls.StaticScale(1.0))
    _, unscaled, _ = maybe_jit(ours, jit)(ones, state, x)
    assert_bitwise_equal(as_pure(grads), as_pure(unscaled))
    assert_close_in_float32(grads, expected)


def test_nnx_jit_model_argument_and_custom_module_with_lists() -> None:
    """A custom module (attributes, an nnx.List of residual blocks, a Dropout child without
    parameters) under nnx.jit: the layers are its direct children; the gradients with scales
    2**42 apart are bit for bit those with every scale 1, and nnx.grad's to float32
    rounding; the Dropout's RNG advances as under nnx.value_and_grad."""

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(8, 16, rngs=rngs)
            self.down = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, h: jax.Array) -> jax.Array:
            return h + self.down(jnp.tanh(self.up(h)))  # the add inside the layer

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Linear(4, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)
            self.blocks = nnx.List([Block(rngs), Block(rngs)])
            self.head = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.drop(self.embed(x))
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    model = Net(nnx.Rngs(0, dropout=1))
    twin = nnx.clone(model)
    x = jax.random.normal(jax.random.key(2), (16, 4))
    scales = {
        "embed": jdls.StaticScale(2.0**30),
        "blocks/0": jdls.StaticScale(2.0**-10),
        "blocks/1": jdls.StaticScale(2.0**12),
        "head": jdls.StaticScale(1.0),
    }
    ones = dict.fromkeys(scales, jdls.StaticScale(1.0))

    @nnx.jit
    def fn(model: nnx.Module, scales: dict, x: jax.Array) -> tuple:
        return jdls.nnx.layer_scaled_value_and_grad(mse, scales)(model, x)

    reference = nnx.jit(nnx.value_and_grad(mse))
    for _ in range(2):  # the second call sees the advanced RNG
        _, unscaled, _ = fn(nnx.clone(model), ones, x)
        value, grads, finite = fn(model, scales, x)
        expected_value, expected = reference(twin, x)
        assert float(value) == float(expected_value)
        assert_bitwise_equal(as_pure(grads), as_pure(unscaled))
        assert_close_in_float32(grads, expected)
    assert sorted(finite) == sorted(scales)
    counts = as_pure(nnx.state(model, nnx.RngCount))
    assert counts == as_pure(nnx.state(twin, nnx.RngCount))
    assert int(dict(nnx.to_flat_state(counts))[("drop", "rngs", "count")]) == 2  # once a call
    assert type(model.blocks[0]) is Block and type(model.head) is nnx.Linear  # restored


def deep_models(depth: int = 12, width: int = 32) -> tuple[nnx.Sequential, nnx.Sequential]:
    """The saturated-tanh MLP of tests/test_layer_scales.py as nnx.Sequential: float16 compute
    and a float32 twin with the same parameters (bias 3: each layer shrinks the backward
    signal by ~2**-4)."""
    f16 = tanh_mlp(depth - 1, width, jnp.float16, bias=3.0)
    f32 = tanh_mlp(depth - 1, width, jnp.float32, bias=3.0)
    keys = jax.random.split(jax.random.key(0), depth)
    for i, k in enumerate(keys):
        layer = f16.layers[2 * i]
        shape = layer.kernel.shape
        kernel = jax.random.normal(k, shape) / math.sqrt(width)
        layer.kernel[...] = kernel
        f32.layers[2 * i].kernel[...] = kernel
    return f16, f32


def best_scale(amax: float, margin: int = 6) -> float:
    return 2.0 ** math.floor(math.log2(F16_MAX * 2.0**-margin / amax))


def flushed_fraction(grads: list, reference: list) -> float:
    g = np.concatenate([np.ravel(a) for a in grads])
    r = np.concatenate([np.ravel(a) for a in reference])
    return float(np.mean((g == 0)[r != 0]))


def test_nnx_per_layer_scales_recover_the_deep_layers_flushed_gradients() -> None:
    """float16: the best global scale flushes the first layers' gradients; per-layer scales
    keep them (>= 10x fewer flushed values), on an unedited nnx.Sequential."""
    model, model32 = deep_models()
    x = jax.random.normal(jax.random.key(1), (64, 32))
    names = layer_names(11)
    small = lambda m, x: 1e-3 * mse(m, x)  # noqa: E731
    expected = by_layer(nnx.grad(small)(model32, x))
    amax = {k: max(float(np.max(np.abs(a))) for a in v) for k, v in expected.items()}
    one = jdls.StaticScale(best_scale(max(amax.values())))
    _, global_grads, _ = jdls.nnx.layer_scaled_value_and_grad(small, dict.fromkeys(names, one))(
        model, x
    )
    own = {k: jdls.StaticScale(best_scale(a)) for k, a in amax.items()}
    _, layer_grads, finite = jdls.nnx.layer_scaled_value_and_grad(small, own)(model, x)
    assert all(bool(f) for f in finite.values())
    global_grads, layer_grads = by_layer(global_grads), by_layer(layer_grads)
    flushed_global = np.mean([flushed_fraction(global_grads[k], expected[k]) for k in names])
    flushed_layer = np.mean([flushed_fraction(layer_grads[k], expected[k]) for k in names])
    print(f"nnx: flushed global {flushed_global:.3f}, per-layer {flushed_layer:.3f}")
    assert flushed_global >= 0.2
    assert flushed_layer * 10 <= flushed_global


def test_nnx_train_step_with_optimizer_and_adjusted_scales() -> None:
    """nnx.Optimizer with jdls.wrap(adam, NoOpScale()), the per-layer scales adjusted after
    each step; the first step is the plain float32 Adam step (to float32 rounding), and the
    scales round-trip a checkpoint."""
    model = tanh_mlp()
    twin = nnx.clone(model)
    x = jax.random.normal(jax.random.key(3), (32, 16))
    optimizer = nnx.Optimizer(model, jdls.wrap(optax.adam(1e-2), jdls.NoOpScale()), wrt=nnx.Param)
    plain = nnx.Optimizer(twin, optax.adam(1e-2), wrt=nnx.Param)
    scales = {n: jdls.AdaptiveScale() for n in layer_names(4)}

    @nnx.jit
    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, scales: dict, x: jax.Array):
        value, grads, _ = jdls.nnx.layer_scaled_value_and_grad(mse, scales)(model, x)
        optimizer.update(model, grads)
        return value, jdls.adjust_layer_scales(scales, grads)

    @nnx.jit
    def plain_step(model: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array):
        value, grads = nnx.value_and_grad(mse)(model, x)
        optimizer.update(model, grads)
        return value

    first, scales = train_step(model, optimizer, scales, x)
    assert float(first) == float(plain_step(twin, plain, x))
    assert_close_in_float32(nnx.state(model, nnx.Param), nnx.state(twin, nnx.Param))
    for _ in range(4):
        value, scales = train_step(model, optimizer, scales, x)
    assert float(value) < float(first)
    assert int(jdls.stats(optimizer).skipped_steps) == 0
    levels = {k: float(s.loss_scale) for k, s in scales.items()}
    assert len(set(levels.values())) > 1, levels  # each layer at its own headroom
    target = {k: jdls.AdaptiveScale() for k in scales}
    restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(scales))
    for k in scales:
        assert float(restored[k].loss_scale) == levels[k]
        assert [int(v) for v in restored[k].state] == [int(v) for v in scales[k].state]


def test_nnx_errors_say_what_to_do() -> None:
    class Gained(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.dense = nnx.Linear(3, 3, rngs=rngs)
            self.gain = nnx.Param(jnp.ones(3))  # not inside a child module

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.dense(x) * self.gain

    x = jnp.ones((2, 3))
    fn = jdls.nnx.layer_scaled_value_and_grad(mse, {"dense": jdls.NoOpScale()})
    with pytest.raises(ValueError, match=r"outside every child: \['gain'\]"):
        fn(Gained(nnx.Rngs(0)), x)
    model = tanh_mlp(depth=1)
    with pytest.raises(ValueError, match=r"without a scale \['layers/2'\], scales of no layer"):
        jdls.nnx.layer_scaled_value_and_grad(mse, {"layers/0": jdls.NoOpScale()})(
            model, jnp.ones((2, 16))
        )
    with pytest.raises(ValueError, match=r"scales of no layer \['layers/1'\]"):
        jdls.nnx.layer_scaled_value_and_grad(
            mse, dict.fromkeys(["layers/0", "layers/1", "layers/2"], jdls.NoOpScale())
        )(model, jnp.ones((2, 16)))
    with pytest.raises(TypeError, match="dict of jdls loss scales"):
        jdls.nnx.layer_scaled_value_and_grad(mse, [jdls.NoOpScale()])  # type: ignore[arg-type]


def test_nnx_boundaries_and_probes_nest() -> None:
    """jdls.nnx.layer_boundaries and jdls.nnx.probes share the class swap: open together, in either
    order, both act on each child's output, and the classes are restored."""
    model = tanh_mlp(depth=1)
    x = jnp.ones((2, 16))
    for outer, inner in [
        (jdls.nnx.layer_boundaries, jdls.nnx.probes),
        (jdls.nnx.probes, jdls.nnx.layer_boundaries),
    ]:

        def loss(x: jax.Array, outer=outer, inner=inner) -> jax.Array:
            with outer(model), inner(model):
                return mse(model, x)

        _, _, telemetry = jdls.probed_value_and_grad(loss, jdls.StaticScale(8.0))(x)
        assert telemetry.names == ("layers/0", "layers/2", "")
        assert type(model.layers[0]) is nnx.Linear and type(model) is nnx.Sequential
    scales = {"layers/0": jdls.StaticScale(2.0**30), "layers/2": jdls.StaticScale(1.0)}

    def probed(model: nnx.Module, x: jax.Array) -> jax.Array:
        with jdls.nnx.probes(model):  # inside the boundaries' context
            return mse(model, x)

    _, grads, _ = jdls.nnx.layer_scaled_value_and_grad(probed, scales)(model, x)
    _, plain, _ = jdls.nnx.layer_scaled_value_and_grad(mse, scales)(model, x)
    assert_bitwise_equal(as_pure(grads), as_pure(plain))
