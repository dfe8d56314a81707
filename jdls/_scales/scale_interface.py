"""The ``LossScale`` interface: scaling, unscaling, ``value_and_grad``, value equality, pytrees.

:mod:`jdls._scales.scale` holds the kinds of scale (no-op, static, dynamic); this module what they
share, and the error a loss scale gives when it is used as an optax transformation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jdls._numerics.checks import is_float
from jdls._scales.filter import filtered_value_and_grad
from jdls._scales.grad import reject_axis_name, scaled_value_and_grad
from jdls._sites.site import is_site

__all__ = ["LossScale", "check_scale", "new_scale", "register_scale", "show"]

_F32 = jnp.float32
T = TypeVar("T")


class _NotATransformation:
    """``init``/``update`` of a loss scale: an error saying how to use the scale instead.

    ``optax.chain(jdls.DynamicScale(), ...)`` is a common mistake. The error is an
    ``AttributeError``, so ``hasattr(scale, "init")`` stays False.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        what = (type(obj) if obj is not None or owner is None else owner).__name__
        instance = f"jdls.{what}" + ("" if obj is None else "(...)")
        raise AttributeError(
            f"{instance} is a loss scale, not an optax transformation (it has no "
            f".{self.name}); wrap the optimizer with it instead: "
            f"jdls.wrap(optax.adam(1e-3), jdls.{what}(...)), and put jdls.wrap(...) in "
            "optax.chain"
        )


class LossScale:
    """The interface of :class:`DynamicScale`, :class:`StaticScale` and :class:`NoOpScale`:
    ``loss_scale`` (a float32 scalar), ``scale``, ``unscale``, ``adjust``, ``value_and_grad``.
    """

    loss_scale: jax.Array

    init = _NotATransformation()
    update = _NotATransformation()

    def scale(self, tree: T) -> T:
        """Multiply every float leaf of ``tree`` by the scale, rounding once to its dtype.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.StaticScale(8.0).scale(jnp.float16(0.5))
          Array(4., dtype=float16)
        """
        loss_scale = self.loss_scale

        def scale_leaf(x: Any) -> Any:
            if not is_float(x):
                return x
            x = jnp.asarray(x)
            return (x.astype(jnp.promote_types(x.dtype, _F32)) * loss_scale).astype(x.dtype)

        return jax.tree_util.tree_map(scale_leaf, tree)

    def unscale(self, tree: T) -> T:
        """Divide every float leaf by the scale; leaves narrower than float32 become float32.

        A :class:`jdls.Site` in ``tree`` (the measurement a differentiation returns for a
        site) is left as it is: a measurement is never unscaled.

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> jdls.StaticScale(1024.0).unscale(jnp.float16(2.0))
          Array(0.00195312, dtype=float32)
        """
        loss_scale = self.loss_scale

        def unscale_leaf(x: Any) -> Any:
            if is_site(x) or not is_float(x):
                return x
            x = jnp.asarray(x)
            dtype = jnp.promote_types(x.dtype, _F32)
            return x.astype(dtype) / loss_scale.astype(dtype)

        return jax.tree_util.tree_map(unscale_leaf, tree, is_leaf=is_site)

    def adjust(self, grads_finite: jax.Array | bool) -> LossScale:  # pragma: no cover
        """The next state after a step whose gradients were finite (or not)."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        """Equal by value: the same kind, the same configuration (the rule), equal arrays.

        Compares on the host, so the values must be concrete: under ``jit``, ``vmap`` or
        ``grad`` a TypeError says to compare the arrays instead. Arrays are equal when they
        have the same shape, dtype and elements (batched scales compare element-wise).
        Scales are unhashable, like other pytrees of arrays (``NoOpScale`` excepted).

        Example:
          >>> import jax, jdls
          >>> scale = jdls.DynamicScale(1024.0)
          >>> scale == jax.tree_util.tree_map(lambda x: x, scale), scale == scale.adjust(False)
          (True, False)
        """
        if type(other) is not type(self):
            return NotImplemented
        ours, our_def = jax.tree_util.tree_flatten(self)
        theirs, their_def = jax.tree_util.tree_flatten(other)
        if len(ours) == 1 and ours[0] is self:  # a subclass not registered as a pytree
            return self is other
        if our_def != their_def:  # type: ignore[operator]
            return False  # a different rule, or differently structured counters
        if any(isinstance(x, jax.core.Tracer) for x in (*ours, *theirs)):
            raise TypeError(
                f"cannot compare jdls.{type(self).__name__} values with == inside a traced "
                "function (jit, vmap, grad): the comparison is made on the host. Compare the "
                "arrays instead, e.g. jnp.all(a.loss_scale == b.loss_scale), or compare the "
                "scales outside the traced function"
            )
        return all(_same_array(a, b) for a, b in zip(ours, theirs, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        *,
        axis_name: Any = None,
    ) -> Callable[..., Any]:
        """``jax.value_and_grad`` of ``fun`` with the loss scaled and the results unscaled.

        The value returned is the loss ``fun`` computed (not ``scaled / scale``), so it is
        exact even when the scaled loss overflowed.

        Pytrees with non-array leaves (an Equinox model, with its activation functions and
        static fields) are differentiated as ``eqx.filter_value_and_grad`` does: the
        floating-point arrays get gradients, every other leaf (functions, integer and boolean
        arrays, Python numbers) gets ``None``; so does an Equinox model's Python ``float``
        field. Any other argument whose leaves are all floating-point arrays or Python floats
        is differentiated by ``jax.value_and_grad`` as it is; one with no floating-point array
        at all is a TypeError that says what to do.

        Args:
          fun: the loss function; returns a scalar, or ``(scalar, aux)`` with ``has_aux``.
          argnums: positional argument(s) to differentiate, as in ``jax.value_and_grad``.
          has_aux: whether ``fun`` returns ``(loss, aux)``.
          axis_name: not accepted (Flax's ``DynamicScale.value_and_grad`` takes it): a
            TypeError says what to do instead (``lax.pmean`` the gradients yourself, and pass
            the axis to ``jdls.wrap``).

        Returns:
          A function with ``fun``'s arguments returning ``(loss, grads)``, or
          ``((loss, aux), grads)`` with ``has_aux`` (two values: Flax's four-value unpacking
          ``dyn_scale, is_fin, loss, grads = ...`` does not apply, see docs/migration/flax.md).

        Example:
          >>> import jax.numpy as jnp, jdls
          >>> loss, grads = jdls.DynamicScale().value_and_grad(lambda w: jnp.sum(w**2))(jnp.ones(2))
          >>> float(loss), grads.tolist()
          (2.0, [2.0, 2.0])
          >>> import jax
          >>> model = {"w": jnp.ones(2), "activation": jax.nn.relu}  # a non-array leaf
          >>> loss_fn = lambda m: jnp.sum(m["activation"](m["w"]))
          >>> loss, grads = jdls.DynamicScale().value_and_grad(loss_fn)(model)
          >>> grads["w"].tolist(), grads["activation"]
          ([1.0, 1.0], None)
        """
        reject_axis_name(axis_name)
        return scaled_value_and_grad(
            self,
            fun,
            has_aux,
            lambda scaled: filtered_value_and_grad(
                scaled, argnums, has_aux=True, who=f"{type(self).__name__}.value_and_grad"
            ),
        )


def _same_array(a: Any, b: Any) -> bool:
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


def check_scale(scale: Any, what: str = "scale", wrapping: bool = False) -> LossScale:
    """``scale`` if it is a loss scale instance, else an error saying what to pass."""
    if isinstance(scale, LossScale):
        return scale
    if isinstance(scale, type) and issubclass(scale, LossScale):
        raise TypeError(
            f"{what} must be a loss scale instance: pass jdls.{scale.__name__}(...), not the "
            f"class jdls.{scale.__name__}"
        )
    if isinstance(scale, int | float | np.number) and not isinstance(scale, bool):
        raise TypeError(
            f"{what} must be a jdls loss scale, got the number {scale!r}: for a fixed scale "
            f"pass jdls.StaticScale({scale!r})"
        )
    if callable(getattr(scale, "init", None)) and callable(getattr(scale, "update", None)):
        hint = (
            "the optimizer is the first argument: jdls.wrap(optax.adam(1e-3), jdls.DynamicScale())"
            if wrapping
            else "pass a loss scale such as jdls.DynamicScale(...)"
        )
        raise TypeError(f"{what} must be a jdls loss scale, got an optax transformation; {hint}")
    raise TypeError(
        f"{what} must be a jdls loss scale: jdls.DynamicScale(...), a jdls.presets scale, "
        f"jdls.StaticScale(...) or jdls.NoOpScale(); got {type(scale).__name__}"
    )


def show(x: Any) -> str:
    """A readable value for ``repr``: numbers and small arrays as lists, tracers by type."""
    try:
        value = np.asarray(x)
    except Exception:  # tracers and other stand-ins
        return type(x).__name__
    return repr(value.item()) if value.ndim == 0 else repr(value.tolist())


def register_scale(cls: type, data: tuple[str, ...], static: tuple[str, ...]) -> None:
    """Register a scale class as a pytree: ``data`` fields are children, ``static`` aux data.

    Unflattening builds the object without validation (the children may be tracers).
    """

    def flatten_with_keys(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        children = [(jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in data]
        return children, tuple(getattr(obj, f) for f in static)

    def unflatten(aux: tuple[Any, ...], children: Iterable[Any]) -> Any:
        return new_scale(
            cls,
            **dict(zip(static, aux, strict=True)),
            **dict(zip(data, list(children), strict=True)),
        )

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, f) for f in data], tuple(getattr(obj, f) for f in static)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


def new_scale(cls: type[T], **fields: Any) -> T:
    """An instance of ``cls`` with these fields, unvalidated: the one way past ``__init__``."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj
