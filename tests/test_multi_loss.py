"""jdls.multi_loss_value_and_grad: per-loss scales, combined exactly after unscaling."""

from __future__ import annotations

import math

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import maybe_jit

import jdls

F16_MAX = 65504.0


def best_scale(amax: float, margin: int = 6) -> float:
    """The Adaptive rule's choice: the largest power of two putting amax `margin` bits below
    float16's maximum."""
    return 2.0 ** math.floor(math.log2(F16_MAX * 2.0**-margin / amax))


def _model_params() -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "trunk": jax.random.normal(k[0], (16, 32)) / 4,
        "big": jax.random.normal(k[1], (32, 1)),
        "small": jax.random.normal(k[2], (32, 1)) / 65536,
    }


def _batch() -> tuple[jax.Array, jax.Array, jax.Array]:
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (256, 16))
    y_big = 100.0 * jax.random.normal(k[1], (256, 1))
    y_small = 1e-4 * jax.random.normal(k[2], (256, 1))
    return x, y_big, y_small


def multitask_losses(
    params: dict, x: jax.Array, y_big: jax.Array, y_small: jax.Array, dtype=jnp.float16
) -> dict:
    """Two heads on one trunk, computed in ``dtype``; the small head weighted 1e-4 (in float32,
    on the reduced loss: its cotangent enters the compute format 1e-4 times smaller)."""
    p = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    h = jnp.tanh(x.astype(dtype) @ p["trunk"])
    big = jnp.mean((h @ p["big"] - y_big.astype(dtype)) ** 2)
    small = jnp.mean((h @ p["small"] - y_small.astype(dtype)) ** 2)
    return {"big": big.astype(jnp.float32), "small": 1e-4 * small.astype(jnp.float32)}


def _reference(params: dict, batch: tuple) -> dict:
    def total(p: dict) -> jax.Array:
        losses = multitask_losses(p, *batch, dtype=jnp.float32)
        return losses["big"] + losses["small"]

    return jax.grad(total)(params)


def flushed_fraction(grad: jax.Array, reference: jax.Array) -> float:
    nonzero = np.asarray(reference) != 0
    return float(np.mean((np.asarray(grad) == 0)[nonzero]))


@pytest.mark.parametrize("jit", [False, True])
def test_equals_float32_gradients_of_the_weighted_sum(jit: bool) -> None:
    params, batch = _model_params(), _batch()

    def losses(p: dict) -> tuple:
        out = multitask_losses(p, *batch, dtype=jnp.float32)
        return out["big"], out["small"]

    scales = (jdls.StaticScale(2.0**3), jdls.StaticScale(2.0**20))
    fn = maybe_jit(jdls.multi_loss_value_and_grad(losses, scales, weights=(1.0, 1.0)), jit)
    values, grads, finite = fn(params)
    each = [
        jax.grad(lambda p, k=k: multitask_losses(p, *batch, dtype=jnp.float32)[k])(params)
        for k in ("big", "small")
    ]
    for name in params:  # the float32 gradients of each loss, added
        atol = 1e-6 * float(jnp.max(jnp.abs(each[0][name])))
        np.testing.assert_allclose(grads[name], each[0][name] + each[1][name], rtol=1e-6, atol=atol)
    expected = _reference(params, batch)  # jax.grad of the sum adds in another order
    for name in params:
        atol = 1e-6 * float(jnp.max(jnp.abs(expected[name])))
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=atol)
    assert bool(finite[0]) and bool(finite[1])
    assert float(values[0]) == float(multitask_losses(params, *batch, dtype=jnp.float32)["big"])


def test_weights_are_applied_in_float32_after_unscaling() -> None:
    def losses(w: jax.Array) -> list:
        return [jnp.sum(w**2), jnp.sum(w)]

    fn = jdls.multi_loss_value_and_grad(
        losses, [jdls.StaticScale(4.0), jdls.StaticScale(8.0)], weights=[0.5, 1e-30]
    )
    _, grads, _ = fn(jnp.ones(2))
    np.testing.assert_array_equal(grads, jnp.float32(1.0) + jnp.float32(1e-30))


def test_per_loss_scales_recover_the_small_heads_flushed_gradients() -> None:
    """float16, a head weighted 1e-4: the best global scale flushes most of its gradient to
    zero; its own scale keeps it (>= 10x fewer flushed values)."""
    params, batch = _model_params(), _batch()
    expected = _reference(params, batch)
    global_amax = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(expected))
    big_only = jax.grad(lambda p: multitask_losses(p, *batch, dtype=jnp.float32)["big"])(params)
    small_only = jax.grad(lambda p: multitask_losses(p, *batch, dtype=jnp.float32)["small"])(params)
    amax = lambda t: max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(t))  # noqa: E731
    one = jdls.StaticScale(best_scale(global_amax))
    loss_fn = lambda p: multitask_losses(p, *batch)  # noqa: E731
    _, global_grads, _ = jdls.multi_loss_value_and_grad(loss_fn, {"big": one, "small": one})(params)
    # each loss's largest backward value: its gradients, or its cotangent at the loss (1e-4)
    own = {
        "big": jdls.StaticScale(best_scale(amax(big_only))),
        "small": jdls.StaticScale(min(best_scale(amax(small_only)), best_scale(1e-4))),
    }
    _, per_loss_grads, finite = jdls.multi_loss_value_and_grad(loss_fn, own)(params)
    assert bool(finite["big"]) and bool(finite["small"])
    flushed_global = flushed_fraction(global_grads["small"], expected["small"])
    flushed_own = flushed_fraction(per_loss_grads["small"], expected["small"])
    print(f"small head flushed: global scale {flushed_global:.3f}, per-loss {flushed_own:.3f}")
    assert flushed_global >= 0.5
    assert flushed_own * 10 <= flushed_global
    np.testing.assert_allclose(per_loss_grads["small"], expected["small"], rtol=0.05, atol=1e-9)


def test_per_loss_finiteness_adjusts_each_scale() -> None:
    def losses(w: jax.Array) -> tuple:
        return jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32), jnp.sum(w)

    scales = (jdls.DynamicScale(2.0**15), jdls.DynamicScale(2.0**15))
    _, _, finite = jdls.multi_loss_value_and_grad(losses, scales)(jnp.full(2, 4.0))
    assert (bool(finite[0]), bool(finite[1])) == (False, True)
    adjusted = tuple(s.adjust(f) for s, f in zip(scales, finite, strict=True))
    assert [float(s.loss_scale) for s in adjusted] == [2.0**14, 2.0**15]


def test_has_aux_and_several_argnums() -> None:
    def losses(a: jax.Array, b: jax.Array) -> tuple:
        return (jnp.sum(a * b), jnp.sum(b)), "aux"

    fn = jdls.multi_loss_value_and_grad(
        losses, (jdls.StaticScale(2.0), jdls.NoOpScale()), argnums=(0, 1), has_aux=True
    )
    (values, aux), (ga, gb), _ = fn(jnp.ones(2), jnp.full(2, 3.0))
    assert aux == "aux" and float(values[1]) == 6.0
    assert ga.tolist() == [3.0, 3.0] and gb.tolist() == [2.0, 2.0]


def test_scales_checkpoint_round_trip() -> None:
    scales = {"big": jdls.DynamicScale(2.0**3), "small": jdls.AdaptiveScale(2.0**20)}
    scales = {k: s.adjust(False) for k, s in scales.items()}
    data = flax.serialization.to_bytes(scales)
    target = {"big": jdls.DynamicScale(), "small": jdls.AdaptiveScale()}
    restored = flax.serialization.from_bytes(target, data)
    for k in scales:
        assert float(restored[k].loss_scale) == float(scales[k].loss_scale)
        assert jax.tree_util.tree_all(
            jax.tree_util.tree_map(lambda a, b: bool(a == b), restored[k].state, scales[k].state)
        )


def test_errors_say_what_to_pass() -> None:
    with pytest.raises(TypeError, match="StaticScale"):
        jdls.multi_loss_value_and_grad(lambda w: (w,), (128.0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keys of scales"):
        jdls.multi_loss_value_and_grad(lambda w: (w,), (jdls.NoOpScale(),), weights=(1.0, 2.0))
    fn = jdls.multi_loss_value_and_grad(lambda w: {"a": jnp.sum(w)}, {"b": jdls.NoOpScale()})
    with pytest.raises(ValueError, match="one loss per scale"):
        fn(jnp.ones(2))


def test_dict_losses_match_scales_by_key_in_any_order() -> None:
    def losses(w: jax.Array) -> dict:
        return {"b": jnp.sum(w), "a": jnp.sum(w**2)}

    scales = {"a": jdls.StaticScale(4.0), "b": jdls.StaticScale(2.0**30)}
    values, grads, finite = jdls.multi_loss_value_and_grad(
        losses, scales, weights={"b": 2.0, "a": 1.0}
    )(jnp.ones(2))
    assert grads.tolist() == [4.0, 4.0] and set(finite) == {"a", "b"}
    assert float(values["b"]) == 2.0


def test_under_shard_map_on_8_devices_the_per_loss_scales_agree() -> None:
    """8 devices, a different batch shard on each (each differentiates a varying copy of the
    parameters), one shard whose big loss overflows float16: the per-loss flags combined
    with ``pmin`` over the devices, every device adjusts the scales alike (the big loss's
    backs off everywhere, the small loss's stays); in float32 the pmean-ed gradients equal
    the full batch's."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 CPU devices"
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    params, (x, y_big, y_small) = _model_params(), _batch()
    y_bad = y_big.at[96:128].set(3e4)  # rows of device 3: the big loss overflows float16
    scales = {"big": jdls.DynamicScale(2.0**6), "small": jdls.DynamicScale(2.0**20)}

    def step(params: dict, x: jax.Array, y_big: jax.Array, y_small: jax.Array, dtype) -> tuple:
        losses = lambda p: multitask_losses(p, x, y_big, y_small, dtype)  # noqa: E731
        local_params = jax.lax.pcast(params, "data", to="varying")
        _, grads, finite = jdls.multi_loss_value_and_grad(losses, scales)(local_params)
        grads = jax.lax.pmean(grads, "data")
        agreed = {k: jax.lax.pmin(f.astype(jnp.int32), "data") == 1 for k, f in finite.items()}
        new = {k: s.adjust(agreed[k]) for k, s in scales.items()}
        stacked = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], (new, finite))
        return grads, new, stacked

    def run(dtype, y_big: jax.Array) -> tuple:
        return jax.jit(
            jax.shard_map(
                lambda *a: step(*a, dtype),
                mesh=mesh,
                in_specs=(P(), P("data"), P("data"), P("data")),
                out_specs=(P(), P(), P("data")),
            )
        )(params, x, y_big, y_small)

    grads, _, _ = run(jnp.float32, y_big)
    expected = _reference(params, (x, y_big, y_small))
    for name in params:
        atol = 1e-6 * float(jnp.max(jnp.abs(expected[name])))
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=atol)

    grads, new, (per_device, local_finite) = run(jnp.float16, y_bad)
    assert np.asarray(local_finite["big"]).tolist() == [True] * 3 + [False] + [True] * 4
    assert np.all(np.asarray(local_finite["small"]))
    for leaf in jax.tree_util.tree_leaves(per_device):
        assert np.all(np.asarray(leaf) == np.asarray(leaf)[:1])
    assert float(new["big"].loss_scale) == 2.0**5  # backed off on every device
    assert float(new["small"].loss_scale) == 2.0**20
    assert not bool(jdls.all_finite(grads))  # the pmean-ed step is skipped (jdls.wrap)
