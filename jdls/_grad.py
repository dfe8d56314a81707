"""The scaled ``value_and_grad``: scale the loss, differentiate, unscale the gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from jdls._scale import LossScale

__all__ = ["reject_axis_name", "scaled_value_and_grad"]


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
    scale: LossScale,
    fun: Callable[..., Any],
    has_aux: bool,
    differentiate: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Callable[..., Any]:
    """``value_and_grad`` of ``fun`` with the loss scaled and the results unscaled.

    ``differentiate(scaled)`` builds the gradient function of ``scaled`` (with
    ``has_aux=True``): ``jax.value_and_grad`` here, ``nnx.value_and_grad`` for NNX.
    """

    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, tuple[Any, Any]]:
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
        return scale.scale(loss), (loss, aux)

    grad_fn = differentiate(scaled)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        grads = scale.unscale(grads)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return value_and_grad_fn
