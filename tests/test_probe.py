"""jdls.probe and the telemetry of the backward pass: statistics of the cotangents, the first
non-finite layer in backward order, automatic probes of Flax linen and NNX models."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import maybe_jit, with_and_without_jit
from flax import nnx

import jdls


@with_and_without_jit
def test_statistics_of_the_scaled_cotangent(jit):
    def loss(w, x):
        h = jdls.probe(w * x, "h")  # float32 cotangent: d loss / d h = c
        return jnp.sum(h * jnp.array([1e-9, 2.0**-20, 0.0, 4.0]))

    fn = maybe_jit(jdls.probed_value_and_grad(loss, jdls.StaticScale(2.0**4)), jit)
    value, grads, t = fn(jnp.ones(4), jnp.ones(4))
    assert t.names == ("h",)
    assert float(t.amax[0]) == 64.0  # 4 * 16: the scaled cotangent
    # 1e-9 * 16 flushes to zero in float16; 2**-20 * 16 does not: 1 of 3 nonzero values.
    assert math.isclose(float(t.flushed[0]), 1 / 3, rel_tol=1e-6)
    assert float(t.zeros[0]) == 0.25
    assert float(t.nonfinite[0]) == 0.0
    np.testing.assert_allclose(grads, [1e-9, 2.0**-20, 0.0, 4.0], rtol=1e-6)
    assert float(value) == pytest.approx(4.0 + 1e-9 + 2.0**-20)
    assert float(t.headroom_bits()[0]) == pytest.approx(math.log2(65504 / 64))


@with_and_without_jit
def test_a_nan_in_a_large_cotangent_is_flagged(jit):
    """XLA's max reduction drops a NaN in a large array on CPU: the nonfinite statistic must
    not be read off the largest magnitude."""

    def loss(w):
        h = jdls.probe(w * 2.0, "h")
        return jnp.sum(h * jnp.ones(20_000).at[3].set(jnp.nan))

    _, _, t = maybe_jit(jdls.probed_value_and_grad(loss, jdls.StaticScale(1.0)), jit)(
        jnp.ones(20_000)
    )
    assert float(t.nonfinite[0]) == 1.0
    assert t.first_nonfinite() == "h"


def test_probes_leave_the_gradients_bit_for_bit_unchanged():
    def loss(w):
        return jnp.sum(jnp.tanh(jdls.probe(w.astype(jnp.float16) * 3, "a")).astype(jnp.float32))

    w = jnp.linspace(-2, 2, 7)
    scale = jdls.StaticScale(1024.0)
    _, plain = scale.value_and_grad(loss)(w)
    _, probed, _ = jdls.probed_value_and_grad(loss, scale)(w)
    assert np.asarray(plain).tobytes() == np.asarray(probed).tobytes()


def test_outside_a_probed_differentiation_probe_is_the_identity():
    x = jnp.ones(3)
    assert jdls.probe(x, "x") is x
    assert float(jax.grad(lambda v: jnp.sum(jdls.probe(v, "v") * 2))(x)[0]) == 2.0


def test_first_nonfinite_layer_in_backward_order():
    def loss(w):
        a = jdls.probe(w, "first")
        b = jdls.probe(a.astype(jnp.float16) * 1e3, "second")
        c = jdls.probe(b * 1e3, "third")
        return jnp.sum(c.astype(jnp.float32) * 100.0)

    _, grads, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(2.0**8))(jnp.ones(2))
    assert t.names == ("first", "second", "third")
    # "third" gets 100 * 256 = 25600 (a float16 number); "second" 25600 * 1e3: inf.
    assert t.first_nonfinite() == "second"
    assert not bool(jdls.all_finite(grads))
    assert t.as_dict()["third"]["nonfinite"] == 0.0


def test_repeated_names_and_pytrees():
    def loss(w):
        a, b = jdls.probe((w, 2 * w), "pair")
        c = jdls.probe(a + b, "sum")
        d = jdls.probe(c, "sum")
        return jnp.sum(d)

    _, _, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(1.0))(jnp.ones(2))
    assert t.names == ("pair[0]", "pair[1]", "sum", "sum#2")


def test_argnums_and_has_aux():
    def loss(a, b):
        return jnp.sum(jdls.probe(a * b, "ab")), "aux"

    fn = jdls.probed_value_and_grad(loss, jdls.StaticScale(2.0), argnums=(0, 1), has_aux=True)
    (value, aux), (ga, gb), t = fn(jnp.full(2, 3.0), jnp.full(2, 5.0))
    assert aux == "aux" and float(value) == 30.0
    assert ga.tolist() == [5.0, 5.0] and gb.tolist() == [3.0, 3.0]
    assert float(t.amax[0]) == 2.0


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, dtype=jnp.float16, name="hidden")(x))
        return nn.Dense(2, dtype=jnp.float16, name="out")(x).astype(jnp.float32)


@with_and_without_jit
def test_every_linen_module_is_probed_without_editing_the_model(jit):
    model = _MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))

    def loss(p):
        with jdls.linen.probes():
            return jnp.mean(model.apply(p, jnp.ones((3, 4))) ** 2)

    fn = maybe_jit(jdls.probed_value_and_grad(loss, jdls.StaticScale(1024.0)), jit)
    _, grads, t = fn(params)
    assert t.names == ("hidden", "out", "")
    assert np.all(np.asarray(t.amax) > 0)
    _, plain = jdls.StaticScale(1024.0).value_and_grad(
        lambda p: jnp.mean(model.apply(p, jnp.ones((3, 4))) ** 2)
    )(params)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_every_nnx_module_is_probed_and_restored():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 8, dtype=jnp.float16, rngs=rngs)
            self.down = nnx.Linear(8, 1, dtype=jnp.float16, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x))).astype(jnp.float32)

    model = Model(nnx.Rngs(0))

    def loss(x):
        with jdls.nnx.probes(model):
            return jnp.sum(model(x))

    _, _, t = jdls.probed_value_and_grad(loss, jdls.StaticScale(8.0))(jnp.ones((2, 4)))
    assert t.names == ("up", "down", "")
    assert type(model.up) is nnx.Linear  # restored


def test_plot_headroom(tmp_path):
    pytest.importorskip("matplotlib")
    z = jnp.zeros(2)
    history = [jdls.Telemetry(("a", "b"), jnp.array([2.0**k, 1.0]), z, z, z) for k in range(4)]
    path = tmp_path / "headroom.png"
    fig = jdls.plot_headroom(history, path=str(path))
    assert path.stat().st_size > 0
    assert len(fig.axes[0].lines) == 3  # two probes and the zero line
    with pytest.raises(ValueError, match="at least one Telemetry"):
        jdls.plot_headroom([])


def test_a_bad_compute_dtype_says_what_to_pass():
    with pytest.raises(TypeError, match="finfo expects a floating-point dtype"):
        jdls.probed_value_and_grad(lambda w: w, jdls.NoOpScale(), compute_dtype="int8")
