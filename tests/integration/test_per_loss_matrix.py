"""The per-loss composition matrix: ``jdls.multi_loss_value_and_grad`` under everyday JAX code.

Axes: backward mode (``"one"``, ``"per_loss"``) x composition (outer ``jax.jit``, an inner
``jax.jit`` of the forward, ``nn.jit``, ``nnx.jit``, ``jax.checkpoint``, ``nn.remat``,
``lax.scan`` over the layers, inner and outer ``vmap``, ``shard_map`` with ``check_vma`` on
and off, ``pmap``, positional static arguments (bool, str, callable), ``has_aux``) x
parameter dtype (float32, bfloat16, float16) x extra leaves (none, an integer leaf, a None
leaf). Two losses share a two-layer trunk, each with its own head; the scales are ``2**3``
and ``2**10``, the weights ``0.5`` and ``2``. Each cell must equal its reference, the float32
``jax.grad`` of the weighted sum of the same function (to the parameter dtype's rounding),
with every loss flagged finite, or raise a clear error at trace time (listed in
:data:`REFUSED` with its message): never a silently different result.

CI runs a fixed sample that covers every value of every axis (:data:`SAMPLE_SIZE` cells);
``JDLS_FULL_MATRIX=1`` runs all of them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import FULL_MATRIX, covering_sample, pcast_varying
from flax import nnx
from jax.sharding import PartitionSpec as P

import jdls

BACKWARDS = ("one", "per_loss")
COMPOSITIONS = (
    "plain",
    "outer_jit",
    "inner_jit",
    "nn_jit",
    "nnx_jit",
    "checkpoint",
    "nn_remat",
    "scan",
    "inner_vmap",
    "outer_vmap",
    "shard_map_vma",
    "shard_map_no_vma",
    "pmap",
    "static_bool",
    "static_str",
    "static_callable",
    "has_aux",
)
DTYPES = ("float32", "bfloat16", "float16")
LEAVES = ("plain", "int", "none")
AXES = (BACKWARDS, COMPOSITIONS, DTYPES, LEAVES)

SAMPLE_SIZE = 17  # the fewest that hold every composition
N_DEVICES = 2
AXIS = "data"
SCALES = {"a": 2.0**3, "b": 2.0**10}
WEIGHTS = {"a": 0.5, "b": 2.0}
#: Per dtype, the tolerance relative to each gradient's largest magnitude.
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}

#: Cells refused with an error at trace time: (backward, composition) -> message regex.
REFUSED: dict[tuple[str, str], str] = {}


def _all_cells() -> list[tuple[str, ...]]:
    return list(itertools.product(*AXES))


def _sample(size: int = SAMPLE_SIZE, seed: int = 21) -> list[tuple[str, ...]]:
    """A fixed pseudo-random subset in which every value of every axis appears."""
    return covering_sample(_all_cells(), AXES, size, seed)


FULL = FULL_MATRIX
CELLS = _all_cells() if FULL else _sample()
# The quick run (tests/conftest.py) takes three cells of the sample, holding every backward pass,
# dtype and kind of leaf; the other cells are marked full (tests/integration/
# test_capability_matrix.py's quick cells keep a cell of each composition).
QUICK = {
    ("per_loss", "plain", "float16", "none"),
    ("per_loss", "nn_jit", "float32", "int"),
    ("one", "static_callable", "bfloat16", "plain"),
}


def _cells(cells: list[tuple[str, ...]]) -> list[Any]:
    return [
        pytest.param(*c, id="-".join(c), marks=() if c in QUICK else (pytest.mark.full,))
        for c in cells
    ]


def test_sample_covers_every_value() -> None:
    sample = _sample()
    assert len(sample) == SAMPLE_SIZE
    for axis, values in enumerate(AXES):
        assert {c[axis] for c in sample} == set(values)
    assert set(sample) >= QUICK
    for axis in (0, 2, 3):  # backward, dtype, leaves
        assert {c[axis] for c in QUICK} == set(AXES[axis])


# --------------------------------------------------------------------------------------------
# The model: a two-layer tanh trunk, two heads; computes in its parameters' dtype.
# --------------------------------------------------------------------------------------------


def _layer(w: jax.Array, h: jax.Array) -> jax.Array:
    return jnp.tanh(h @ w)


def _heads(h: jax.Array, p: dict, extra: dict) -> dict:
    a = jnp.mean((h @ p["a"]).astype(jnp.float32) ** 2)
    if "n" in extra:  # an integer leaf of the parameters
        a = a * extra["n"].astype(jnp.float32)
    b = 1e-2 * jnp.mean((h @ p["b"]).astype(jnp.float32))
    return {"a": a, "b": b}


def _trunk_plain(trunk: jax.Array, x: jax.Array) -> jax.Array:
    h = x.astype(trunk.dtype)
    for i in range(trunk.shape[0]):
        h = _layer(trunk[i], h)
    return h


def _trunk_scan(trunk: jax.Array, x: jax.Array) -> jax.Array:
    h, _ = jax.lax.scan(lambda h, w: (_layer(w, h), None), x.astype(trunk.dtype), trunk)
    return h


def _trunk_inner_vmap(trunk: jax.Array, x: jax.Array) -> jax.Array:
    return jax.vmap(_trunk_plain, in_axes=(None, 0))(trunk, x)


class _Trunk(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("w", nn.initializers.normal(0.5), (2, 4, 4))
        return _trunk_plain(w, x)


class _NnxTrunk(nnx.Module):
    def __init__(self, w: jax.Array) -> None:
        self.w = nnx.Param(w)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _trunk_plain(self.w[...], x)


def _linen(wrap: Callable[[type], type]) -> Callable[[Any, jax.Array], jax.Array]:
    module = wrap(_Trunk)()
    return lambda trunk, x: module.apply({"params": {"w": trunk}}, x)


def _nnx_jit(trunk: Any, x: jax.Array) -> jax.Array:
    graphdef, _ = nnx.split(_NnxTrunk(jnp.zeros((2, 4, 4))))
    model = nnx.merge(graphdef, trunk)
    return nnx.jit(lambda m, x: m(x))(model, x)


TRUNKS: dict[str, Callable[..., jax.Array]] = {
    "inner_jit": jax.jit(_trunk_plain),
    "nn_jit": _linen(nn.jit),
    "nnx_jit": _nnx_jit,
    "checkpoint": jax.checkpoint(_trunk_plain),
    "nn_remat": _linen(nn.remat),
    "scan": _trunk_scan,
    "inner_vmap": _trunk_inner_vmap,
}


def _trunk_params(composition: str, w: jax.Array) -> Any:
    if composition == "nnx_jit":
        return nnx.state(_NnxTrunk(w))
    return w


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def _make(composition: str, dtype: str, leaves: str) -> tuple[Callable[..., Any], dict, tuple]:
    """The losses function, its parameters (in ``dtype``) and its other arguments."""
    k = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k[0], (2, 4, 4)) / 2
    params: dict[str, Any] = {
        "trunk": _trunk_params(composition, w),
        "a": jax.random.normal(k[1], (4,)),
        "b": jax.random.normal(k[2], (4,)),
    }
    if leaves == "int":
        params["n"] = jnp.int32(3)
    elif leaves == "none":
        params["none"] = None
    params = _cast(params, jnp.dtype(dtype))
    x = jax.random.normal(k[3], (8, 4))
    trunk_fn = TRUNKS.get(composition, _trunk_plain)

    def extra(p: dict) -> dict:
        return {"n": p["n"]} if "n" in p else {}

    if composition == "static_bool":

        def losses(p: dict, x: jax.Array, train: bool) -> dict:
            h = trunk_fn(p["trunk"], x)
            if train:  # Python control flow on a static argument
                h = h * 1
            return _heads(h, p, extra(p))

        return losses, params, (x, True)
    if composition == "static_str":

        def losses(p: dict, x: jax.Array, mode: str) -> dict:
            h = trunk_fn(p["trunk"], x)
            return _heads(h if mode == "train" else -h, p, extra(p))

        return losses, params, (x, "train")
    if composition == "static_callable":

        def losses(p: dict, x: jax.Array, head_act: Callable) -> dict:
            return _heads(head_act(trunk_fn(p["trunk"], x)), p, extra(p))

        return losses, params, (x, jnp.sin)
    if composition == "has_aux":

        def losses(p: dict, x: jax.Array) -> tuple:
            h = trunk_fn(p["trunk"], x)
            return _heads(h, p, extra(p)), {"h": jnp.mean(h.astype(jnp.float32)), "tag": "aux"}

        return losses, params, (x,)

    def losses(p: dict, x: jax.Array) -> dict:
        return _heads(trunk_fn(p["trunk"], x), p, extra(p))

    return losses, params, (x,)


# --------------------------------------------------------------------------------------------
# Running a cell, and its reference.
# --------------------------------------------------------------------------------------------


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _plain(tree: Any) -> Any:
    """Integer leaves' ``float0`` gradients as a marker that every transformation returns."""
    return jax.tree_util.tree_map(
        lambda g: g if _is_float(g) else jnp.full((), -1, jnp.int32), tree
    )


def _pmean_floats(tree: Any, axis: str) -> Any:
    return jax.tree_util.tree_map(lambda g: jax.lax.pmean(g, axis) if _is_float(g) else g, tree)


def _scales() -> dict:
    return {k: jdls.StaticScale(v) for k, v in SCALES.items()}


def _value_and_grad(losses: Callable, scales: dict, backward: str, has_aux: bool) -> Callable:
    return jdls.multi_loss_value_and_grad(
        losses, scales, WEIGHTS, has_aux=has_aux, backward=backward
    )


def _run(backward: str, composition: str, losses: Callable, params: dict, args: tuple) -> tuple:
    """``(values, grads, finite)`` of the cell (grads through :func:`_plain`)."""
    has_aux = composition == "has_aux"

    def call(scales: dict, p: dict, *a: Any) -> tuple:
        values, grads, finite = _value_and_grad(losses, scales, backward, has_aux)(p, *a)
        return values, _plain(grads), finite

    if composition == "outer_jit":
        return jax.jit(call)(_scales(), params, *args)
    if composition == "outer_vmap":  # two independent batches
        xs = jnp.stack([args[0], 2 * args[0]])
        return jax.vmap(call, in_axes=(None, None, 0))(_scales(), params, xs)
    if composition in ("shard_map_vma", "shard_map_no_vma", "pmap"):
        vma = composition == "shard_map_vma"

        def step(scales: dict, p: dict, x: jax.Array) -> tuple:
            if vma:  # this device's gradients, not their sum over the devices
                p = pcast_varying(p, AXIS)
            values, grads, finite = call(scales, p, x)
            finite = {k: jax.lax.pmin(f.astype(jnp.int32), AXIS) == 1 for k, f in finite.items()}
            return _pmean_floats(values, AXIS), _pmean_floats(grads, AXIS), finite

        x = args[0]
        if composition == "pmap":
            split = x.reshape(N_DEVICES, -1, *x.shape[1:])
            out = jax.pmap(step, AXIS, in_axes=(None, None, 0), devices=jax.devices()[:N_DEVICES])(
                _scales(), params, split
            )
            return jax.tree_util.tree_map(lambda a: a[0], out)
        mesh = jax.make_mesh((N_DEVICES,), (AXIS,), devices=jax.devices()[:N_DEVICES])
        fn = jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=P(), check_vma=vma
        )
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(AXIS)))
        return jax.jit(fn)(_scales(), params, x)
    return call(_scales(), params, *args)


def _reference(composition: str, losses: Callable, params: dict, args: tuple) -> tuple:
    """float32 ``jax.value_and_grad`` of the weighted sum of the same function."""
    has_aux = composition == "has_aux"
    params32 = _cast(params, jnp.float32)

    def total(p: dict, *a: Any) -> tuple:
        out = losses(p, *a)
        values = out[0] if has_aux else out
        return sum(WEIGHTS[k] * v for k, v in values.items()), out

    def grad(*a: Any) -> tuple:
        g, out = jax.grad(total, has_aux=True, allow_int=True)(params32, *a)
        return out, _plain(g)

    if composition == "outer_vmap":
        outs = [grad(x, *args[1:]) for x in (args[0], 2 * args[0])]
        return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outs)
    return grad(*args)


def _close(got: Any, want: Any, tol: float) -> None:
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if not _is_float(w):
            assert np.array_equal(np.asarray(g), np.asarray(w))
            continue
        w = np.asarray(w, np.float32)
        atol = tol * float(np.max(np.abs(w))) if w.size else 0.0
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=atol)


@pytest.mark.parametrize(("backward", "composition", "dtype", "leaves"), _cells(CELLS))
def test_cell_equals_its_reference_or_is_refused(
    backward: str, composition: str, dtype: str, leaves: str
) -> None:
    losses, params, args = _make(composition, dtype, leaves)
    refused = REFUSED.get((backward, composition))
    if refused is not None:
        with pytest.raises((TypeError, ValueError, NotImplementedError), match=refused):
            _run(backward, composition, losses, params, args)
        return
    values, grads, finite = _run(backward, composition, losses, params, args)
    want_values, want_grads = _reference(composition, losses, params, args)
    tol = TOLERANCE[dtype]
    assert all(bool(np.all(np.asarray(f))) for f in finite.values()), finite
    _close(grads, want_grads, tol)
    _close(values, want_values, tol)
    if leaves == "none":
        assert grads["none"] is None
    if leaves == "int":
        assert int(np.asarray(grads["n"]).ravel()[0]) == -1  # a float0 gradient came back


@functools.cache
def _eager_int_grad(backward: str) -> Any:
    losses, params, args = _make("plain", "float32", "int")
    _, grads, _ = _value_and_grad(losses, _scales(), backward, False)(params, *args)
    return grads["n"]


@pytest.mark.parametrize("backward", BACKWARDS)
def test_integer_leaf_gets_a_float0_gradient(backward: str) -> None:
    assert _eager_int_grad(backward).dtype == jax.dtypes.float0
