"""jdls.multi_loss_value_and_grad: per-loss scales, combined exactly after unscaling, in one
backward pass (the default) or one per loss."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import assert_bitwise_equal, maybe_jit, pcast_varying, with_and_without_jit

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


#: Every test of both backward modes runs twice: one backward pass, one per loss.
both_backwards = pytest.mark.parametrize("backward", ["one", "per_loss"])


# --------------------------------------------------------------------------------------------
# Models for the exactness of the one backward pass.
# --------------------------------------------------------------------------------------------


def _keys(n: int, seed: int = 3) -> list[jax.Array]:
    return list(jax.random.split(jax.random.key(seed), n))


def shared_trunk_case() -> tuple:
    params, batch = _model_params(), _batch()
    return (lambda p: multitask_losses(p, *batch, dtype=jnp.float32)), (params,), 0, False


def disjoint_case() -> tuple:
    """Two losses sharing no parameter (tuple losses)."""
    k = _keys(3)
    params = {"a": jax.random.normal(k[0], (8, 4)), "b": jax.random.normal(k[1], (8, 1))}
    x = jax.random.normal(k[2], (32, 8))

    def losses(p: dict) -> tuple:
        return jnp.mean(jnp.tanh(x @ p["a"]) ** 2), 1e-3 * jnp.mean(x @ p["b"])

    return losses, (params,), 0, False


def chained_case() -> tuple:
    """One loss's value feeds the other: the losses ``a`` and ``a + b`` (a list)."""
    k = _keys(3, seed=4)
    params = {"a": jax.random.normal(k[0], (8, 4)), "b": jax.random.normal(k[1], (8, 4))}
    x = jax.random.normal(k[2], (32, 8))

    def losses(p: dict) -> list:
        a = jnp.mean(jnp.tanh(x @ p["a"]) ** 2)
        b = jnp.mean(jnp.sin(x @ p["b"]) * jnp.tanh(x @ p["a"]))
        return [a, a + b]

    return losses, (params,), 0, False


def scan_softmax_case() -> tuple:
    """A shared trunk inside ``lax.scan``, ``jax.nn.relu`` (a ``custom_jvp``), a
    ``custom_vjp`` (``jdls.rescale_boundary``), a softmax cross-entropy head and a
    ``jax.checkpoint``-ed head with a ``lax.cond`` (atomic equations: still exact)."""
    k = _keys(5, seed=5)
    params = {
        "embed": jax.random.normal(k[0], (8, 16)) / 3,
        "layers": jax.random.normal(k[1], (3, 16, 16)) / 4,
        "cls": jax.random.normal(k[2], (16, 5)),
        "reg": jax.random.normal(k[3], (16, 1)),
    }
    x = jax.random.normal(k[4], (32, 8))
    labels = jax.nn.one_hot(jnp.arange(32) % 5, 5)

    def losses(p: dict) -> dict:
        def layer(h: jax.Array, w: jax.Array) -> tuple:
            return jax.nn.relu(h @ w) + h, None

        h, _ = jax.lax.scan(layer, jnp.tanh(x @ p["embed"]), p["layers"])
        h = jdls.rescale_boundary(h, 2.0)  # a custom_vjp: doubles the cotangent, in both
        ce = -jnp.mean(jnp.sum(jnp.log(jax.nn.softmax(h @ p["cls"]) + 1e-6) * labels, -1))

        def head(h: jax.Array, w: jax.Array) -> jax.Array:
            y = h @ w
            y = jax.lax.cond(jnp.sum(y) > 0, jax.nn.relu, jnp.tanh, y)
            return jnp.mean(y**2)

        reg = jax.checkpoint(head)(h, p["reg"])
        return {"ce": ce, "reg": 1e-3 * reg}

    return losses, (params,), 0, False


def aux_argnums_case() -> tuple:
    """``has_aux`` and two differentiated arguments (of three)."""
    k = _keys(3, seed=6)
    w, v = jax.random.normal(k[0], (8, 4)), jax.random.normal(k[1], (4,))
    x = jax.random.normal(k[2], (16, 8))

    def losses(w: jax.Array, x: jax.Array, v: jax.Array) -> tuple:
        h = jnp.tanh(x @ w)
        return (jnp.mean(h**2), jnp.mean(h @ v)), {"h": h}

    return losses, (w, x, v), (0, 2), True


class TwoHeads(nn.Module):
    """The two-head model of ``multitask_losses`` as a Flax linen module (``Dense`` layers
    computing in ``dtype``)."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple:
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        h = jnp.tanh(dense(32, "trunk")(x))
        return dense(1, "big")(h), dense(1, "small")(h)


def linen_losses(dtype, jit_apply: bool = False):
    """``multitask_losses`` through the linen model (its apply optionally ``jax.jit``-ed: one
    ``jit`` equation holding both heads)."""
    model = TwoHeads(dtype)
    apply = jax.jit(model.apply) if jit_apply else model.apply

    def losses(params: dict, x: jax.Array, y_big: jax.Array, y_small: jax.Array) -> dict:
        big, small = apply({"params": params}, x)
        big = jnp.mean((big - y_big.astype(dtype)) ** 2)
        small = jnp.mean((small - y_small.astype(dtype)) ** 2)
        return {"big": big.astype(jnp.float32), "small": 1e-4 * small.astype(jnp.float32)}

    return losses


def linen_params() -> dict:
    return {k: {"kernel": v} for k, v in _model_params().items()}


def linen_case(jit_apply: bool = False) -> tuple:
    fn = linen_losses(jnp.float32, jit_apply)
    batch = _batch()
    return (lambda p: fn(p, *batch)), (linen_params(),), 0, False


def sharded_jit_case() -> tuple:
    """Both heads inside a ``jax.jit`` that constrains its output sharding: not inlined (that
    would drop the constraint), one atomic equation, still exact."""
    params, batch = _model_params(), _batch()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    fn = jax.jit(lambda p: multitask_losses(p, *batch, dtype=jnp.float32), out_shardings=one_device)
    return fn, (params,), 0, False


CASES = {
    "shared_trunk": shared_trunk_case,
    "disjoint": disjoint_case,
    "chained": chained_case,
    "scan_softmax": scan_softmax_case,
    "aux_argnums": aux_argnums_case,
    "linen": linen_case,
    "linen_jitted_apply": lambda: linen_case(jit_apply=True),
    "sharded_jit": sharded_jit_case,
}


#: Models calling a ``jax.jit``-ed function: eager, ``jax.grad`` runs it compiled (its
#: backward pass fused by XLA) while the one pass inlines it, so they compare as under jit.
COMPILED_INSIDE = {"linen_jitted_apply"}


def weighted_sum_grad(fn, args: tuple, argnums, has_aux: bool, weights) -> tuple:
    """``jax.value_and_grad`` of ``sum(weights[i] * loss_i)`` (of ``sum(loss_i)`` without
    weights): the reference."""

    def total(*args: object) -> tuple:
        out = fn(*args)
        losses = out[0] if has_aux else out
        values = list(losses.values()) if isinstance(losses, dict) else list(losses)
        if weights is None:
            return sum(values[1:], values[0]), out
        ws = list(weights.values()) if isinstance(weights, dict) else list(weights)
        return sum((w * v for w, v in zip(ws[1:], values[1:], strict=True)), ws[0] * values[0]), out

    return jax.grad(total, argnums=argnums, has_aux=True)(*args)


def _like(losses: object, values: list) -> object:
    """``values`` in the container of ``losses`` (dict keys, or positions)."""
    if isinstance(losses, dict):
        return dict(zip(losses, values, strict=True))
    return type(losses)(values)  # type: ignore[call-arg]


def _scales_like(losses: object, exps: tuple) -> object:
    return _like(losses, [jdls.StaticScale(2.0**e) for e in exps])


@with_and_without_jit
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weights"])
@pytest.mark.parametrize(
    "exps", [(0, 20), (20, -10), (-10, 0)], ids=lambda e: f"exp{e[0]}_exp{e[1]}"
)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.full(keep=1)
def test_one_pass_equals_grad_of_the_weighted_sum_bit_for_bit(
    case: str, exps: tuple, weighted: bool, jit: bool
) -> None:
    """float32, scales 2**0 / 2**20 / 2**-10, weights 1 or powers of two: the one backward
    pass gives ``jax.grad(sum(w_i * loss_i))`` bit for bit, eager. Under ``jax.jit`` (the
    scales an argument), and eager for a model calling a jitted function: bit for bit the
    same program with every scale 1 (the scaling is exact), and ``jax.grad`` to float32
    rounding (another program, fused differently; see tests/test_layer_scales_nnx.py)."""
    fn, args, argnums, has_aux = CASES[case]()
    out = fn(*args)
    losses = out[0] if has_aux else out
    weights = _like(losses, [0.5, 4.0]) if weighted else None

    def ours(scales: object, *args: object) -> tuple:
        vg = jdls.multi_loss_value_and_grad(fn, scales, weights, argnums=argnums, has_aux=has_aux)
        return vg(*args)

    value, grads, finite = maybe_jit(ours, jit)(_scales_like(losses, exps), *args)
    expected, expected_value = maybe_jit(
        lambda *a: weighted_sum_grad(fn, a, argnums, has_aux, weights), jit
    )(*args)
    assert all(bool(f) for f in jax.tree_util.tree_leaves(finite))
    if has_aux:
        assert_bitwise_equal(value[1], expected_value[1])
    if not jit and case not in COMPILED_INSIDE:
        assert_bitwise_equal(value, expected_value)
        assert_bitwise_equal(grads, expected)
        return
    _, unscaled, _ = maybe_jit(ours, jit)(_scales_like(losses, (0, 0)), *args)
    assert_bitwise_equal(grads, unscaled)
    for a, b in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(b))))


def _count(jaxpr: object, name: str) -> int:
    """How many equations of ``name`` a jaxpr holds, sub-jaxprs included."""
    n = 0
    for eqn in jaxpr.eqns:  # type: ignore[attr-defined]
        n += eqn.primitive.name == name
        for sub in _sub_jaxprs(eqn.params):
            n += _count(sub, name)
    return n


def _sub_jaxprs(params: dict) -> list:
    """The jaxprs in an equation's parameters (``jax.extend.core.jaxprs_in_params`` where the
    JAX release has it)."""
    core = jax.extend.core
    if hasattr(core, "jaxprs_in_params"):
        return list(core.jaxprs_in_params(params))
    values = [x for v in params.values() for x in (v if isinstance(v, tuple | list) else (v,))]
    return [
        x.jaxpr if isinstance(x, core.ClosedJaxpr) else x
        for x in values
        if isinstance(x, core.ClosedJaxpr | core.Jaxpr)
    ]


def test_one_backward_pass_has_the_matmuls_of_one_global_scale() -> None:
    """The jaxpr of the one pass holds as many matrix products as ``jax.value_and_grad`` of
    the sum (one forward, one backward); one pass per loss holds more."""
    params, batch = _model_params(), _batch()
    loss_fn = lambda p: multitask_losses(p, *batch)  # noqa: E731
    scales = {"big": jdls.StaticScale(2.0**6), "small": jdls.StaticScale(2.0**20)}
    total = lambda p: sum(loss_fn(p).values())  # noqa: E731
    counts = {
        backward: _count(
            jax.make_jaxpr(jdls.multi_loss_value_and_grad(loss_fn, scales, backward=backward))(
                params
            ).jaxpr,
            "dot_general",
        )
        for backward in ("one", "per_loss")
    }
    one_scale = _count(jax.make_jaxpr(jax.value_and_grad(total))(params).jaxpr, "dot_general")
    assert counts["one"] == one_scale < counts["per_loss"]


# --------------------------------------------------------------------------------------------
# Both modes.
# --------------------------------------------------------------------------------------------


@both_backwards
@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.full(keep=1)  # the quick run keeps a jitted case
def test_equals_float32_gradients_of_the_weighted_sum(jit: bool, backward: str) -> None:
    params, batch = _model_params(), _batch()

    def losses(p: dict) -> tuple:
        out = multitask_losses(p, *batch, dtype=jnp.float32)
        return out["big"], out["small"]

    scales = (jdls.StaticScale(2.0**3), jdls.StaticScale(2.0**20))
    fn = jdls.multi_loss_value_and_grad(losses, scales, weights=(1.0, 1.0), backward=backward)
    values, grads, finite = maybe_jit(fn, jit)(params)
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


@both_backwards
def test_weights_are_applied_in_float32_after_unscaling(backward: str) -> None:
    """Shared parameter: 1 + 1e-30 rounds to 1 in float32 either way. A parameter of one
    loss only, computed in float16: its weight 1e-30 is applied to the unscaled float32
    gradient (in the one pass too), so it does not flush to zero in float16."""

    def losses(w: jax.Array) -> list:
        return [jnp.sum(w**2), jnp.sum(w)]

    fn = jdls.multi_loss_value_and_grad(
        losses,
        [jdls.StaticScale(4.0), jdls.StaticScale(8.0)],
        weights=[0.5, 1e-30],
        backward=backward,
    )
    _, grads, _ = fn(jnp.ones(2))
    np.testing.assert_array_equal(grads, jnp.float32(1.0) + jnp.float32(1e-30))

    def split(p: dict) -> list:
        return [jnp.sum(p["a"] ** 2), jnp.sum(p["b"].astype(jnp.float16)).astype(jnp.float32)]

    fn = jdls.multi_loss_value_and_grad(
        split,
        [jdls.StaticScale(4.0), jdls.StaticScale(8.0)],
        weights=[0.5, 1e-30],
        backward=backward,
    )
    _, grads, _ = fn({"a": jnp.ones(2), "b": jnp.ones(2)})
    np.testing.assert_array_equal(grads["a"], jnp.ones(2))
    np.testing.assert_array_equal(grads["b"], jnp.full(2, 1e-30, jnp.float32))


def recovery(loss_fn, params: dict, expected: dict, backward: str, small: str) -> tuple:
    """The small head's flushed fraction under the best global scale, and with the per-loss
    scales chosen from each loss's float32 gradients."""
    ref32 = lambda k: jax.grad(lambda p: loss_fn(p, jnp.float32)[k])(params)  # noqa: E731
    amax = lambda t: max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(t))  # noqa: E731
    one = jdls.StaticScale(best_scale(amax(expected)))
    f16 = lambda p: loss_fn(p, jnp.float16)  # noqa: E731
    fn = lambda s: jdls.multi_loss_value_and_grad(f16, s, backward=backward)(params)  # noqa: E731
    _, global_grads, _ = fn({"big": one, "small": one})
    # each loss's largest backward value: its gradients, or its cotangent at the loss (1e-4)
    own = {
        "big": jdls.StaticScale(best_scale(amax(ref32("big")))),
        "small": jdls.StaticScale(min(best_scale(amax(ref32("small"))), best_scale(1e-4))),
    }
    _, per_loss_grads, finite = fn(own)
    assert bool(finite["big"]) and bool(finite["small"])
    leaf = lambda t: jax.tree_util.tree_leaves(t[small])[0]  # noqa: E731
    flushed_global = flushed_fraction(leaf(global_grads), leaf(expected))
    flushed_own = flushed_fraction(leaf(per_loss_grads), leaf(expected))
    print(f"small head flushed: global scale {flushed_global:.3f}, per-loss {flushed_own:.3f}")
    np.testing.assert_allclose(leaf(per_loss_grads), leaf(expected), rtol=0.05, atol=1e-9)
    return flushed_global, flushed_own


@both_backwards
@pytest.mark.full  # about 4 s
def test_per_loss_scales_recover_the_small_heads_flushed_gradients(backward: str) -> None:
    """float16, a head weighted 1e-4: the best global scale flushes most of its gradient to
    zero; its own scale keeps it (>= 10x fewer flushed values), also in the one backward
    pass, where the small head's backward runs at its own scale."""
    params, batch = _model_params(), _batch()
    loss_fn = lambda p, dtype: multitask_losses(p, *batch, dtype=dtype)  # noqa: E731
    flushed_global, flushed_own = recovery(
        loss_fn, params, _reference(params, batch), backward, "small"
    )
    assert flushed_global >= 0.5
    assert flushed_own * 10 <= flushed_global


@both_backwards
@pytest.mark.parametrize("jit_apply", [False, True], ids=["apply", "jitted_apply"])
@pytest.mark.full(keep=1)
def test_linen_model_small_head_recovered(backward: str, jit_apply: bool) -> None:
    """The same through a Flax linen model, its ``apply`` plain or ``jax.jit``-ed (the one
    pass looks into the ``jit``: both heads are one ``jit`` equation from outside)."""
    params, batch = linen_params(), _batch()
    loss_fn = lambda p, dtype: linen_losses(dtype, jit_apply)(p, *batch)  # noqa: E731
    expected = jax.grad(lambda p: sum(loss_fn(p, jnp.float32).values()))(params)
    flushed_global, flushed_own = recovery(loss_fn, params, expected, backward, "small")
    assert flushed_global >= 0.5
    assert flushed_own * 10 <= flushed_global


@both_backwards
def test_per_loss_finiteness_adjusts_each_scale(backward: str) -> None:
    def losses(p: dict) -> tuple:
        big = jnp.sum(p["a"].astype(jnp.float16) ** 2).astype(jnp.float32)
        return big, jnp.sum(p["b"])

    scales = (jdls.DynamicScale(2.0**15), jdls.DynamicScale(2.0**15))
    params = {"a": jnp.full(2, 4.0), "b": jnp.full(2, 4.0)}
    _, _, finite = jdls.multi_loss_value_and_grad(losses, scales, backward=backward)(params)
    assert (bool(finite[0]), bool(finite[1])) == (False, True)
    adjusted = tuple(s.adjust(f) for s, f in zip(scales, finite, strict=True))
    assert [float(s.loss_scale) for s in adjusted] == [2.0**14, 2.0**15]


@both_backwards
def test_a_shared_parameters_overflow_flags_per_mode(backward: str) -> None:
    """One parameter, used by both losses, whose gradient overflows only in the first loss's
    backward (in its float16 region, before the cast back to the shared float32 parameter):
    both modes flag that loss only (the one pass does not carry the inf into the shared
    region), and the parameter's gradient is not finite."""

    def losses(w: jax.Array) -> tuple:
        return jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32), jnp.sum(w)

    scales = (jdls.DynamicScale(2.0**15), jdls.DynamicScale(2.0**15))
    _, grads, finite = jdls.multi_loss_value_and_grad(losses, scales, backward=backward)(
        jnp.full(2, 4.0)
    )
    assert (bool(finite[0]), bool(finite[1])) == (False, True)
    assert not bool(jdls.all_finite(grads))


def overflow_losses(p: dict, x: jax.Array) -> dict:
    """Linear float16 heads on a linear trunk (every value predictable)."""
    f16 = lambda a: a.astype(jnp.float16)  # noqa: E731
    h = f16(x) @ f16(p["trunk"])
    big = jnp.sum(h @ f16(p["big"])).astype(jnp.float32)
    small = jnp.sum(h @ f16(p["small"])).astype(jnp.float32)
    return {"big": big, "small": small}


@both_backwards
@with_and_without_jit
@pytest.mark.full(keep=1)
def test_overflow_in_a_head_flags_its_loss_in_the_trunk_the_level_setter(
    backward: str, jit: bool
) -> None:
    """float16. The small head's weight gradient (64 rows x 4 x 2**10) overflows, its
    cotangent into the trunk does not: only the small loss is flagged. The trunk's weight
    gradient (64 rows x 100 x 2**4 x 2) overflows: one pass per loss flags both (each pass
    overflows there); the one pass runs the trunk at the smaller scale, the big loss's, and
    flags the big loss only (the small loss's cotangent entered the trunk scaled down)."""
    fn = lambda s, p, x: jdls.multi_loss_value_and_grad(overflow_losses, s, backward=backward)(p, x)  # noqa: E731
    fn = maybe_jit(fn, jit)
    head = {"trunk": jnp.full((16, 8), 0.25), "big": jnp.full((8, 1), 1e-3)}
    head["small"] = head["big"]
    scales = {"big": jdls.StaticScale(1.0), "small": jdls.StaticScale(2.0**10)}
    _, grads, finite = fn(scales, head, jnp.ones((64, 16)))
    assert (bool(finite["big"]), bool(finite["small"])) == (True, False)
    assert bool(jdls.all_finite(grads["trunk"])) and bool(jdls.all_finite(grads["big"]))
    trunk = {"trunk": jnp.full((16, 8), 0.0025), "big": jnp.ones((8, 1)), "small": jnp.ones((8, 1))}
    scales = {"big": jdls.StaticScale(2.0**4), "small": jdls.StaticScale(2.0**5)}
    _, grads, finite = fn(scales, trunk, jnp.full((64, 16), 100.0))
    expected = (False, False) if backward == "per_loss" else (False, True)
    assert (bool(finite["big"]), bool(finite["small"])) == expected
    assert bool(jdls.all_finite(grads["big"])) and bool(jdls.all_finite(grads["small"]))


@both_backwards
def test_has_aux_and_several_argnums(backward: str) -> None:
    def losses(a: jax.Array, b: jax.Array) -> tuple:
        return (jnp.sum(a * b), jnp.sum(b)), "aux"

    fn = jdls.multi_loss_value_and_grad(
        losses,
        (jdls.StaticScale(2.0), jdls.NoOpScale()),
        argnums=(0, 1),
        has_aux=True,
        backward=backward,
    )
    (values, aux), (ga, gb), _ = fn(jnp.ones(2), jnp.full(2, 3.0))
    assert aux == "aux" and float(values[1]) == 6.0
    assert ga.tolist() == [3.0, 3.0] and gb.tolist() == [2.0, 2.0]


@both_backwards
def test_integer_arguments_get_float0_gradients(backward: str) -> None:
    def losses(p: dict) -> tuple:
        return jnp.sum(p["w"] ** 2) * p["n"], jnp.sum(p["w"])

    scales = (jdls.StaticScale(2.0), jdls.StaticScale(4.0))
    fn = jdls.multi_loss_value_and_grad(losses, scales, backward=backward)
    _, grads, _ = fn({"w": jnp.ones(2), "n": jnp.int32(3)})
    assert grads["w"].tolist() == [7.0, 7.0] and grads["n"].dtype == jax.dtypes.float0


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


@both_backwards
def test_errors_say_what_to_pass(backward: str) -> None:
    vg = lambda *a, **k: jdls.multi_loss_value_and_grad(*a, **k, backward=backward)  # noqa: E731
    with pytest.raises(TypeError, match="StaticScale"):
        vg(lambda w: (w,), (128.0,))
    with pytest.raises(ValueError, match="keys of scales"):
        vg(lambda w: (w,), (jdls.NoOpScale(),), weights=(1.0, 2.0))
    fn = vg(lambda w: {"a": jnp.sum(w)}, {"b": jdls.NoOpScale()})
    with pytest.raises(ValueError, match="one loss per scale"):
        fn(jnp.ones(2))


@both_backwards
def test_a_loss_that_is_not_a_scalar_or_a_wrong_has_aux_names_the_fix(backward: str) -> None:
    scales = {"a": jdls.StaticScale(8.0), "b": jdls.StaticScale(2.0**10)}
    w = jnp.arange(1.0, 4.0)
    vg = lambda f, **k: jdls.multi_loss_value_and_grad(f, scales, **k, backward=backward)  # noqa: E731

    def losses(w):
        return {"a": jnp.sum(w**2), "b": jnp.sum(w)}

    # not summed silently: jax.grad refuses a loss that is not a scalar, and so does jdls
    with pytest.raises(TypeError, match=r"loss 'a' has shape \(3,\): reduce it"):
        vg(lambda w: {"a": w**2, "b": jnp.sum(w)})(w)
    with pytest.raises(
        TypeError, match=r"has_aux=True, fun must return \(losses, aux\), got a dict"
    ):
        vg(losses, has_aux=True)(w)
    with pytest.raises(ValueError, match="needs has_aux=True"):
        vg(lambda w: (losses(w), 1.0))(w)
    with pytest.raises(TypeError, match=r"got an array: with has_aux=True, fun returns"):
        jdls.multi_loss_value_and_grad(
            lambda w: (jnp.sum(w), jnp.sum(w**2)),
            (scales["a"], scales["b"]),
            has_aux=True,
            backward=backward,
        )(w)
    with pytest.raises(TypeError, match="argnums=3 requires at least 4 positional arguments"):
        vg(losses, argnums=3)(w)
    (_, aux), grads, _ = jax.jit(vg(lambda w: (losses(w), 1.0), has_aux=True))(w)
    assert float(aux) == 1.0 and grads.tolist() == [3.0, 5.0, 7.0]  # 2w + 1
    assert vg(losses, argnums=-1)(w)[1].tolist() == [3.0, 5.0, 7.0]


def test_backward_must_be_one_or_per_loss() -> None:
    with pytest.raises(ValueError, match="'one'.*'per_loss'.*got 'both'"):
        jdls.multi_loss_value_and_grad(lambda w: (w,), (jdls.NoOpScale(),), backward="both")


@both_backwards
def test_dict_losses_match_scales_by_key_in_any_order(backward: str) -> None:
    def losses(w: jax.Array) -> dict:
        return {"b": jnp.sum(w), "a": jnp.sum(w**2)}

    scales = {"a": jdls.StaticScale(4.0), "b": jdls.StaticScale(2.0**30)}
    values, grads, finite = jdls.multi_loss_value_and_grad(
        losses, scales, weights={"b": 2.0, "a": 1.0}, backward=backward
    )(jnp.ones(2))
    assert grads.tolist() == [4.0, 4.0] and set(finite) == {"a", "b"}
    assert float(values["b"]) == 2.0


@both_backwards
@pytest.mark.full  # 4-9 s; per-loss scales stay quick on one device, shard_map in test_sites and others
def test_under_shard_map_on_8_devices_the_per_loss_scales_agree(backward: str) -> None:
    """8 devices, a different batch shard on each (each differentiates a varying copy of the
    parameters), one shard whose big loss overflows float16: the per-loss flags combined
    with ``pmin`` over the devices, every device adjusts the scales alike (the big loss's
    backs off everywhere; the small loss's stays, in both modes: with the one pass the
    shared trunk runs at the big loss's scale, so the overflow there is the big loss's); in
    float32 the pmean-ed gradients equal the full batch's."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 CPU devices"
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    params, (x, y_big, y_small) = _model_params(), _batch()
    y_bad = y_big.at[96:128].set(3e4)  # rows of device 3: the big loss overflows float16
    scales = {"big": jdls.DynamicScale(2.0**6), "small": jdls.DynamicScale(2.0**20)}

    def step(params: dict, x: jax.Array, y_big: jax.Array, y_small: jax.Array, dtype) -> tuple:
        losses = lambda p: multitask_losses(p, x, y_big, y_small, dtype)  # noqa: E731
        local_params = pcast_varying(params, "data")
        fn = jdls.multi_loss_value_and_grad(losses, scales, backward=backward)
        _, grads, finite = fn(local_params)
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
    device_3 = [True] * 3 + [False] + [True] * 4
    assert np.asarray(local_finite["big"]).tolist() == device_3
    assert np.asarray(local_finite["small"]).tolist() == [True] * 8
    for leaf in jax.tree_util.tree_leaves(per_device):
        assert np.all(np.asarray(leaf) == np.asarray(leaf)[:1])
    assert float(new["big"].loss_scale) == 2.0**5  # backed off on every device
    assert float(new["small"].loss_scale) == 2.0**20
    assert not bool(jdls.all_finite(grads))  # the pmean-ed step is skipped (jdls.wrap)


@with_and_without_jit
def test_overflow_in_a_loss_region_without_parameters_flags_that_loss(jit: bool) -> None:
    """One pass: loss ``b`` (a float16 square of shared logits, no parameters of its own, as
    an auxiliary z-loss) overflows in its own region at its large scale; the boundary where
    its cotangent enters the shared region sees the inf and flags ``b`` only (the inf does
    not enter the shared region, whose level ``a`` sets: ``a`` is not flagged, as with one
    backward pass per loss), and the gradients it reaches are not finite. Without the
    boundary's measurement ``b`` would never back off."""

    def losses(w: jax.Array, x: jax.Array) -> dict:
        logits = x.astype(jnp.float16) @ w.astype(jnp.float16)
        return {
            "a": jnp.mean(logits.astype(jnp.float32)),
            "b": jnp.sum(logits * logits).astype(jnp.float32),
        }

    fn = maybe_jit(lambda s, w, x: jdls.multi_loss_value_and_grad(losses, s)(w, x), jit)
    w, x = jnp.full((4, 2), 0.5), jnp.ones((8, 4))
    ok = {"a": jdls.StaticScale(1.0), "b": jdls.StaticScale(2.0**8)}
    _, grads, finite = fn(ok, w, x)
    assert bool(finite["a"]) and bool(finite["b"]) and bool(jdls.all_finite(grads))
    big = {"a": jdls.StaticScale(1.0), "b": jdls.StaticScale(2.0**20)}  # 2 * 2 * 2**20 > 65504
    _, grads, finite = fn(big, w, x)
    assert {k: bool(f) for k, f in finite.items()} == {"a": True, "b": False}
    assert not bool(jdls.all_finite(grads))


@with_and_without_jit
def test_tied_scales_blame_the_loss_whose_cotangent_entered_the_trunk_largest(jit: bool) -> None:
    """One pass, both scales ``2**4`` (as two scales built alike start): the trunk's weight
    gradient overflows; the big head's cotangent into the trunk is 1e4 times the small one's,
    so only the big loss is flagged, and the two scales can part (flagging both would keep
    them tied for ever)."""
    fn = maybe_jit(lambda s, p, x: jdls.multi_loss_value_and_grad(overflow_losses, s)(p, x), jit)
    params = {
        "trunk": jnp.full((16, 8), 0.0025),
        "big": jnp.ones((8, 1)),
        "small": jnp.full((8, 1), 1e-4),
    }
    scales = {"big": jdls.StaticScale(2.0**4), "small": jdls.StaticScale(2.0**4)}
    _, grads, finite = fn(scales, params, jnp.full((64, 16), 100.0))
    assert not bool(jdls.all_finite(grads["trunk"]))
    assert (bool(finite["big"]), bool(finite["small"])) == (False, True)


@both_backwards
@with_and_without_jit
def test_an_overflow_in_the_small_heads_cotangent_flags_the_small_loss_only(
    backward: str, jit: bool
) -> None:
    """float16. The small head's cotangent into the trunk (``2**10 * 100`` per element)
    overflows in its own region; the trunk, at the big loss's scale, makes nothing
    non-finite itself. Both modes flag the small loss only (the one pass does not carry the
    inf into the trunk's region, where it would blame the big loss); the trunk's gradients,
    which the inf reaches, are not finite, so that the step is skipped."""
    fn = lambda s, p, x: jdls.multi_loss_value_and_grad(overflow_losses, s, backward=backward)(p, x)  # noqa: E731
    fn = maybe_jit(fn, jit)
    params = {
        "trunk": jnp.full((16, 8), 0.25),
        "big": jnp.full((8, 1), 1e-3),
        "small": jnp.full((8, 1), 100.0),
    }
    scales = {"big": jdls.StaticScale(1.0), "small": jdls.StaticScale(2.0**10)}
    _, grads, finite = fn(scales, params, jnp.ones((64, 16)))
    assert {k: bool(f) for k, f in finite.items()} == {"big": True, "small": False}
    assert not bool(jdls.all_finite(grads["trunk"]))
    assert not bool(jdls.all_finite(grads["small"]))
    assert grads["big"].tolist() == [[64.0 * 4.0]] * 8  # the big head's own: untouched


@both_backwards
@with_and_without_jit
def test_weights_with_integer_and_none_leaves(backward: str, jit: bool) -> None:
    """An integer leaf gets its ``float0`` gradient and a None leaf stays None, with weights."""

    def losses(p: dict) -> dict:
        return {"a": jnp.sum(p["w"] ** 2) * p["n"], "b": jnp.sum(p["w"] * p["v"])}

    scales = {"a": jdls.StaticScale(2.0), "b": jdls.StaticScale(4.0)}
    fn = jdls.multi_loss_value_and_grad(losses, scales, {"a": 0.5, "b": 2.0}, backward=backward)
    params = {"w": jnp.ones(2), "v": jnp.full(2, 3.0), "n": jnp.int32(3), "none": None}
    _, grads, finite = maybe_jit(fn, jit)(params)
    assert grads["w"].tolist() == [0.5 * 6.0 + 2.0 * 3.0] * 2
    assert grads["v"].tolist() == [2.0, 2.0]
    assert grads["n"].dtype == jax.dtypes.float0 and grads["none"] is None
    assert all(bool(f) for f in finite.values())


@both_backwards
@with_and_without_jit
def test_adjust_loss_scales_gives_each_observing_rule_its_measurement(
    backward: str, jit: bool
) -> None:
    """``with_amax=True``: each loss's largest unscaled gradient (before its weight); an
    ``AdaptiveScale`` per loss moves to its own headroom, as ``jdls.wrap`` fed that loss's
    gradients would; a dict, tuple or list of scales alike (a static scale stays)."""

    def losses(p: dict) -> dict:
        return {"big": jnp.sum(p["a"] ** 2), "small": 1e-6 * jnp.sum(p["b"] * p["a"])}

    def step(scales: dict, p: dict) -> tuple:
        fn = jdls.multi_loss_value_and_grad(
            losses, scales, {"big": 1.0, "small": 4.0}, backward=backward, with_amax=True
        )
        _, _, finite, amax = fn(p)
        return amax, jdls.adjust_loss_scales(scales, finite, amax)

    scales = {"big": jdls.AdaptiveScale(), "small": jdls.AdaptiveScale()}
    amax, new = maybe_jit(step, jit)(scales, {"a": jnp.ones(2), "b": jnp.full(2, 2.0)})
    # per_loss: big's own gradients (2a), small's (1e-6 b, 1e-6 a). One pass, both scales 1:
    # the shared parameter a's combined gradient is measured by the loss whose cotangent
    # entered largest (big); small gets its own region's, where its cotangent leaves it
    # (1e-6 b = 2e-6) and its parameter b (1e-6): the tied scales part.
    big = 2.0 if backward == "per_loss" else float(jnp.float32(2.0) + jnp.float32(8e-6))
    assert float(amax["big"]) == big
    np.testing.assert_allclose(float(amax["small"]), 2e-6, rtol=1e-6)
    assert float(new["big"].loss_scale) == 2.0**8  # float16 max 2**16, margin 6, amax 2
    assert float(new["small"].loss_scale) == best_scale(2e-6, 6)
    pair = jdls.adjust_loss_scales((jdls.DynamicScale(8.0), jdls.StaticScale(2.0)), [False, True])
    assert [float(s.loss_scale) for s in pair] == [4.0, 2.0]


def test_adjust_loss_scales_errors_say_what_to_pass() -> None:
    scales = {"a": jdls.AdaptiveScale(), "b": jdls.DynamicScale()}
    with pytest.raises(ValueError, match=r"scales\['a'\].*with_amax=True"):
        jdls.adjust_loss_scales(scales, {"a": True, "b": True})
    with pytest.raises(ValueError, match="finite must have the keys of scales"):
        jdls.adjust_loss_scales(scales, {"a": True})
    with pytest.raises(TypeError, match="StaticScale"):
        jdls.adjust_loss_scales({"a": 2.0}, {"a": True})
    with pytest.raises(TypeError, match="with_amax must be True or False"):
        jdls.multi_loss_value_and_grad(lambda w: (w,), (jdls.NoOpScale(),), with_amax=1)
