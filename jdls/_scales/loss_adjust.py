"""Per-loss scales after a step: :func:`adjust_loss_scales` moves each loss's scale by its own
flag and measurement, through the global path's code; and the keyed containers (a dict, tuple
or list of losses or scales) that the per-loss functions share."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from jdls._scales.scale import LossScale, adjust_observed, check_scale, observes

__all__ = ["adjust_loss_scales", "keyed_items", "rebuilt"]


def keyed_items(tree: Any, what: str) -> tuple[list[Any], list[Any]]:
    """Keys and values of a dict, tuple or list of losses or scales."""
    if isinstance(tree, Mapping):
        return list(tree.keys()), list(tree.values())
    if isinstance(tree, tuple | list):
        return list(range(len(tree))), list(tree)
    raise TypeError(
        f"{what} must be a dict, tuple or list (one entry per loss), got {type(tree).__name__}"
    )


def rebuilt(like: Any, values: list[Any]) -> Any:
    """``values`` in a container like ``like`` (a dict by its keys, a list or a tuple)."""
    if isinstance(like, Mapping):
        return dict(zip(like.keys(), values, strict=True))
    return type(like)(values) if isinstance(like, list) else tuple(values)


def adjust_loss_scales(
    scales: Mapping[Any, LossScale] | Sequence[LossScale],
    finite: Mapping[Any, Any] | Sequence[Any],
    grad_amax: Mapping[Any, Any] | Sequence[Any] | None = None,
) -> Any:
    """The next per-loss scales after a step: each loss's scale adjusted by its own flag.

    Each scale moves as :func:`jdls.wrap` would move it fed that loss's gradients, by the same
    code (``adjust_observed``), all-zero gradients included: backs off
    where ``finite[k]`` is False, follows its rule where it is True. A rule that observes
    (:func:`jdls.AdaptiveScale`, ``rule.observes``) gets ``grad_amax[k]``, the largest
    magnitude of loss ``k``'s unscaled gradients: ask
    :func:`jdls.multi_loss_value_and_grad` for it with ``with_amax=True``. No global skip:
    a loss whose gradients were finite moves even when another's overflowed (skipping the
    step is the optimizer's business: ``jdls.wrap`` with a ``jdls.NoOpScale()`` skips a step
    whose combined gradients are not finite). Pure and traceable: jit it with the step.

    Args:
      scales: one jdls loss scale per loss (a dict, tuple or list).
      finite: per loss, a boolean scalar (the third output of
        :func:`jdls.multi_loss_value_and_grad`), in the container of ``scales``.
      grad_amax: per loss, a float scalar (its fourth output with ``with_amax=True``); needed
        when a scale's rule observes, ignored by the others.

    Returns:
      The new scales, in the container of ``scales``.

    Raises:
      ValueError: the keys differ, or a rule observes and ``grad_amax`` is None.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> def losses(p):
      ...     return {"big": jnp.sum(p["a"] ** 2), "small": 1e-6 * jnp.sum(p["b"])}
      >>> scales = {"big": jdls.AdaptiveScale(), "small": jdls.AdaptiveScale()}
      >>> fn = jdls.multi_loss_value_and_grad(losses, scales, with_amax=True)
      >>> _, grads, finite, amax = fn({"a": jnp.ones(2), "b": jnp.ones(2)})
      >>> scales = jdls.adjust_loss_scales(scales, finite, amax)
      >>> float(scales["big"].loss_scale), float(scales["small"].loss_scale) == 2.0**29
      (256.0, True)
    """
    keys, scale_list = keyed_items(scales, "scales")
    flags = _matching(finite, keys, "finite")
    amaxes = None if grad_amax is None else _matching(grad_amax, keys, "grad_amax")
    out = []
    for i, (key, scale) in enumerate(zip(keys, scale_list, strict=True)):
        check_scale(scale, f"scales[{key!r}]")
        if observes(scale) and amaxes is None:
            raise ValueError(
                f"scales[{key!r}]'s rule {type(scale.rule).__name__} sets the scale from the "
                "largest magnitude of that loss's unscaled gradients, and grad_amax was not "
                "given: build the function with jdls.multi_loss_value_and_grad(..., "
                "with_amax=True) and pass its fourth output, "
                "jdls.adjust_loss_scales(scales, finite, grad_amax)"
            )
        # the global path's adjustment (jdls.wrap), fed this loss's flag and measurement
        amax = None if amaxes is None else amaxes[i]
        out.append(adjust_observed(scale, flags[i], functools.partial(_given, amax)))
    return rebuilt(scales, out)


def _given(value: Any) -> Any:
    """``value``: a measurement already made, as :func:`adjust_observed` asks for one."""
    return value


def _matching(tree: Any, keys: list[Any], what: str) -> list[Any]:
    """The values of ``tree`` in the order of ``keys`` (a dict by key, a sequence by position)."""
    got, values = keyed_items(tree, what)
    if isinstance(tree, Mapping) and set(got) == set(keys):
        return [tree[k] for k in keys]
    if got != keys:
        raise ValueError(
            f"{what} must have the keys of scales, {keys}, got {got}: pass the outputs of "
            "jdls.multi_loss_value_and_grad built with these scales"
        )
    return values
