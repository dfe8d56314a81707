"""Flax NNX integration of the loss scale.

``jdls.wrap`` works unchanged in NNX: ``nnx.Optimizer(model, jdls.wrap(optax.adam(...)),
wrt=nnx.Param)``, with :func:`jdls.nnx.value_and_grad` (the scaled ``nnx.value_and_grad``)
and :func:`jdls.nnx.set_scale` (replace the scale, its rule included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jdls._scales.grad import scaled_value_and_grad
from jdls._scales.scale import LossScale, check_scale
from jdls._transforms.stats import get_scale, replace_scale, snapshot

__all__ = ["nnx_value_and_grad", "set_nnx_scale"]


def nnx_value_and_grad(
    fun: Callable[..., Any],
    scale: LossScale,
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    wrt: Any = None,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of ``fun`` with the loss scaled and the gradients unscaled.

    The NNX counterpart of :meth:`jdls.LossScale.value_and_grad`: it differentiates NNX
    modules with ``nnx.value_and_grad`` (only the variables selected by ``wrt``, so modules
    holding RNG streams or batch statistics work, and their updates propagate), multiplies
    the loss by ``scale`` before differentiation, and divides the gradients by it after
    (16-bit gradients come back as float32). Pass the gradients to ``optimizer.update``.

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
      scale: the loss scale, usually ``jdls.get_scale(optimizer)``.
      argnums: which positional arguments to differentiate, as in ``nnx.value_and_grad``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      wrt: the NNX filter of the variables to differentiate (default ``nnx.Param``); it
        should match the ``wrt`` of the ``nnx.Optimizer``.

    Returns:
      A function with the signature of ``fun`` returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``; ``loss`` is the unscaled loss.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
      >>> loss_fn = lambda m: jnp.mean(m(jnp.ones((4, 2)).astype(jnp.float16)) ** 2)
      >>> scale = jdls.get_scale(optimizer)
      >>> loss, grads = jdls.nnx.value_and_grad(loss_fn, scale)(model)
      >>> _ = optimizer.update(model, grads)
      >>> grads["kernel"].dtype, int(jdls.stats(optimizer).skipped_steps)
      (dtype('float32'), 0)
    """
    from flax import nnx

    scale = snapshot(check_scale(scale))

    argnums_spec: Any = argnums if isinstance(argnums, int) else tuple(argnums)
    from jdls._frameworks.nnx_model import SiteVariable

    if wrt is None:
        wrt = nnx.Param
    wrt = nnx.Any(wrt, SiteVariable)  # the sites' gradients: their measurements
    if isinstance(argnums_spec, int):
        argnums_spec = nnx.DiffState(argnums_spec, wrt)
    else:
        argnums_spec = tuple(nnx.DiffState(i, wrt) for i in argnums_spec)
    from jdls._frameworks.nnx_step import measurements

    scaled = scaled_value_and_grad(
        scale,
        fun,
        has_aux,
        lambda scaled: nnx.value_and_grad(scaled, argnums=argnums_spec, has_aux=True),
    )

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        value, grads = scaled(*args, **kwargs)
        return value, measurements(grads)  # the sites' measurements: SiteMeasurement

    return value_and_grad_fn


def set_nnx_scale(optimizer: Any, scale: LossScale) -> None:
    """Replace, in place, the loss scale of an ``nnx.Optimizer`` built with :func:`jdls.wrap`.

    The NNX counterpart of :func:`jdls.set_scale`. Use this rather than
    ``nnx.update``: ``nnx.update`` copies array values only, so it would keep the old scale's
    rule (its growth interval, factors and bounds) and silently mix it with the new values.
    Call it outside ``nnx.jit``, between steps (e.g. after restoring a checkpoint).

    Args:
      optimizer: an ``nnx.Optimizer`` whose ``tx`` holds exactly one ``jdls.wrap``.
      scale: the new loss scale (any :class:`jdls.LossScale`, any rule).

    Returns:
      None; ``optimizer.opt_state`` holds the new scale.

    Example:
      >>> import optax, jdls
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, jdls.wrap(optax.sgd(0.1)), wrt=nnx.Param)
      >>> jdls.nnx.set_scale(optimizer, jdls.presets.pytorch(init_scale=8.0))
      >>> scale = jdls.get_scale(optimizer)
      >>> float(scale.loss_scale), scale.rule.min_loss_scale
      (8.0, None)
    """
    scale = check_scale(scale)
    if not hasattr(optimizer, "opt_state"):
        raise TypeError(
            f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}; for an optax "
            "state or a linen TrainState use jdls.set_scale"
        )
    from flax import nnx
    from flax.nnx.training.optimizer import to_opt_state

    get_scale(optimizer.opt_state)  # exactly one wrap, or a clear error
    new_scale = to_opt_state(scale)  # its arrays as Variables, as nnx.Optimizer stores them
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    optimizer.opt_state = replace_scale(optimizer.opt_state, new_scale, is_leaf=is_variable)
