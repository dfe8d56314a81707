"""The scaled ``value_and_grad``: scale the loss, differentiate, unscale the gradients."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp

from jdls._numerics.checks import is_float
from jdls._numerics.handoff import remember_backward
from jdls._sites.backward_scale import backward_scale, set_seed_cap
from jdls._sites.measured import measured
from jdls._sites.site import is_site

__all__ = ["Scaling", "reject_axis_name", "scaled_value_and_grad", "seed_scale", "with_loss_scale"]

T = TypeVar("T")


class Scaling(Protocol):
    """What the scaled ``value_and_grad`` reads of a loss scale: every :class:`jdls.LossScale`
    has it (this module stands below the scales and imports none of them)."""

    @property
    def loss_scale(self) -> jax.Array: ...

    def scale(self, tree: T) -> T: ...

    def unscale(self, tree: T) -> T: ...


S = TypeVar("S", bound=Scaling)


def reject_axis_name(axis_name: Any) -> None:
    """Flax's ``value_and_grad(..., axis_name=...)`` habit: say where the axis goes in jdls."""
    if axis_name is not None:
        raise TypeError(
            f"jdls's value_and_grad takes no axis_name (got {axis_name!r}), unlike Flax's "
            "DynamicScale: average the gradients yourself (jax.lax.pmean(grads, axis_name)) "
            f"and give the axis to the optimizer, jdls.wrap(inner, axis_name={axis_name!r}), "
            "so that every device takes the same skip decision. See the table of "
            "docs/migration/flax.md."
        )


def scaled_value_and_grad(
    scale: Scaling,
    fun: Callable[..., Any],
    has_aux: bool,
    differentiate: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Callable[..., Any]:
    """``value_and_grad`` of ``fun`` with the loss scaled and the results unscaled.

    ``differentiate(scaled)`` builds the gradient function of ``scaled`` (with
    ``has_aux=True``): ``jax.value_and_grad`` here, ``nnx.value_and_grad`` for NNX.
    """

    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, tuple[Any, Any, Any]]:
        out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "with has_aux=True, fun must return a pair (loss, aux), got "
                    + (
                        f"an array of shape {out.shape}: return (loss, aux), or drop has_aux"
                        if isinstance(out, jax.Array)
                        else type(out).__name__
                    )
                )
            loss, aux = out
        else:
            loss, aux = out, None
        seed = seed_scale(scale.loss_scale, loss)
        seeded = scale if seed is None else with_loss_scale(scale, seed)
        # for the sites that measure the cotangents (FP8 output gradients): what caps the
        # scale the backward pass, traced next, is seeded with
        set_seed_cap(seed_cap(loss))
        return seeded.scale(loss), (loss, aux, seed)

    grad_fn = differentiate(scaled)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        with backward_scale(scale.loss_scale, (args, kwargs)):
            (_, (loss, aux, seed)), grads = grad_fn(*args, **kwargs)
        grads = (scale if seed is None else with_loss_scale(scale, seed)).unscale(grads)
        # For the jdls.wrap that holds this scale: what this backward pass computed, whatever
        # a transformation in front of the wrap makes of it (jdls/_numerics/handoff.py). Only
        # a rule that observes reads it, so only such a scale keeps the gradients: a static
        # or classic scale's array outlives many steps when run eagerly, and would hold each
        # step's gradients as long. (``rule.observes`` read by name: this module stands below
        # the scale kinds.)
        if getattr(getattr(scale, "rule", None), "observes", False):
            leaves = jax.tree_util.tree_leaves(grads, is_leaf=is_site)
            remember_backward(
                scale.loss_scale,
                [x for x in leaves if isinstance(x, jax.Array) and is_float(x)],
                loss,
            )
        grads = measured(grads)  # global over the devices, never taken for a gradient
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return value_and_grad_fn


def seed_cap(loss: Any) -> float | None:
    """The largest scale a 16-bit (or narrower) floating-point loss can be multiplied by:
    the largest power of two of its format (``2**15`` for float16), so that the cotangent
    that seeds the backward pass is finite; None for a wider loss."""
    dtype = getattr(loss, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits >= 32:
        return None
    _, exponent = math.frexp(float(jnp.finfo(dtype).max))
    return 2.0 ** (exponent - 1)


def seed_scale(loss_scale: jax.Array, loss: Any) -> jax.Array | None:
    """The scale a 16-bit (or narrower) floating-point loss is multiplied by: ``loss_scale``,
    at most :func:`seed_cap`; None for a wider loss (scaled by ``loss_scale`` itself)."""
    cap = seed_cap(loss)
    return None if cap is None else jnp.minimum(loss_scale, jnp.float32(cap))


def with_loss_scale(scale: S, loss_scale: jax.Array) -> S:
    """``scale`` with another ``loss_scale`` (scaling and unscaling read only that field)."""
    if isinstance(inspect.getattr_static(type(scale), "loss_scale", None), property):
        return scale  # a scale fixed by its kind (NoOpScale: 1)
    out = copy.copy(scale)
    object.__setattr__(out, "loss_scale", loss_scale)
    return out
