"""Per-loss scales: several losses, each differentiated at its own scale, combined exactly.

One forward pass (``jax.vjp`` of the function returning every loss), then one backward pass
per loss: loss ``i``'s cotangent is its scale ``s_i``, its gradients are unscaled by ``s_i``
and checked for finiteness on their own, and the unscaled gradients are summed (times the
optional float32 ``weights``). A small loss then keeps its gradients in the compute format's
range even where the big loss's scale would flush them to zero (apex's ``num_losses`` /
``loss_id``). One *combined* backward pass cannot unscale each loss's share exactly where the
losses share parameters, so this takes one backward pass per loss, sharing the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jdls._checks import all_finite
from jdls._scale import LossScale, check_scale

__all__ = ["multi_loss_value_and_grad"]


def _items(tree: Any, what: str) -> tuple[list[Any], list[Any]]:
    """Keys and values of a dict, tuple or list of losses or scales."""
    if isinstance(tree, Mapping):
        return list(tree.keys()), list(tree.values())
    if isinstance(tree, tuple | list):
        return list(range(len(tree))), list(tree)
    raise TypeError(
        f"{what} must be a dict, tuple or list (one entry per loss), got {type(tree).__name__}"
    )


def _rebuild(like: Any, values: list[Any]) -> Any:
    if isinstance(like, Mapping):
        return dict(zip(like.keys(), values, strict=True))
    return type(like)(values) if isinstance(like, list) else tuple(values)


def multi_loss_value_and_grad(
    fun: Callable[..., Any],
    scales: Mapping[Any, LossScale] | Sequence[LossScale],
    weights: Mapping[Any, float] | Sequence[float] | None = None,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Any]]:
    """Gradients of several losses, each scaled by its own scale, combined after unscaling.

    ``fun`` returns its losses as a dict, tuple or list shaped like ``scales`` (one scalar
    per loss). Loss ``i`` is differentiated at scale ``scales[i]``, unscaled by it, multiplied
    by ``weights[i]`` in float32 and added to the others: the gradients equal
    ``jax.grad`` of ``sum(weights[i] * loss[i])`` wherever nothing underflows or overflows.
    One forward pass, one backward pass per loss.

    Args:
      fun: the loss function; returns the losses (``{"a": la, "b": lb}`` or ``(la, lb)``),
        or ``(losses, aux)`` with ``has_aux``.
      scales: one jdls loss scale per loss, in the same container (dict keys or positions).
      weights: one float per loss (default 1 each), applied to the unscaled float32
        gradients, so that a tiny weight never enters the compute format.
      argnums: positional argument(s) to differentiate, as in ``jax.value_and_grad``.
      has_aux: whether ``fun`` returns ``(losses, aux)``.

    Returns:
      A function of ``fun``'s arguments returning ``(losses, grads, finite)`` (or
      ``((losses, aux), grads, finite)``): the losses as ``fun`` computed them, the combined
      unscaled gradients, and per loss a boolean scalar, whether that loss's gradients were
      finite (adjust each scale with it: ``scales[i].adjust(finite[i])``; under
      ``shard_map`` combine it over the devices first, ``jax.lax.pmin``, see
      ``docs/per-layer.md``).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> def losses(w):
      ...     return {"big": jnp.sum(w**2), "small": 1e-4 * jnp.sum(w)}
      >>> scales = {"big": jdls.StaticScale(8.0), "small": jdls.StaticScale(2.0**20)}
      >>> fn = jdls.multi_loss_value_and_grad(losses, scales)
      >>> values, grads, finite = fn(jnp.ones(2))
      >>> [round(g, 4) for g in grads.tolist()], bool(finite["small"])
      ([2.0001, 2.0001], True)
    """
    keys, scale_list = _items(scales, "scales")
    if not keys:
        raise ValueError("scales must hold one loss scale per loss, got none")
    for key, scale in zip(keys, scale_list, strict=True):
        check_scale(scale, f"scales[{key!r}]")
    if weights is None:
        weight_list = [1.0] * len(keys)
    else:
        weight_keys, weight_list = _items(weights, "weights")
        if isinstance(weights, Mapping) and set(weight_keys) == set(keys):
            weight_list = [weights[k] for k in keys]
        elif weight_keys != keys:
            raise ValueError(
                f"weights must have the keys of scales, {keys}, got {weight_keys}: pass one "
                "weight per loss, or None"
            )
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        def forward(*diff: Any) -> Any:
            full = list(args)
            for n, value in zip(nums, diff, strict=True):
                full[n] = value
            return fun(*full, **kwargs)

        primals = [args[n] for n in nums]
        if has_aux:
            losses, vjp_fn, aux = jax.vjp(forward, *primals, has_aux=True)
        else:
            (losses, vjp_fn), aux = jax.vjp(forward, *primals), None
        loss_keys, _ = _items(losses, "fun's losses")
        if sorted(map(str, loss_keys)) != sorted(map(str, keys)) or len(loss_keys) != len(keys):
            raise ValueError(
                f"fun must return one loss per scale, with the keys of scales {keys}; got "
                f"{loss_keys}"
            )
        total: Any = None
        finite = []
        for i, (scale, weight) in enumerate(zip(scale_list, weight_list, strict=True)):
            cotangent = _rebuild(
                losses,
                [
                    scale.scale(jnp.ones_like(losses[k]))
                    if k == keys[i]
                    else jnp.zeros_like(losses[k])
                    for k in loss_keys
                ],
            )
            grads = scale.unscale(vjp_fn(cotangent))
            finite.append(all_finite(grads))
            grads = jax.tree_util.tree_map(lambda g, w=weight: g * jnp.asarray(w, g.dtype), grads)
            total = grads if total is None else jax.tree_util.tree_map(jnp.add, total, grads)
        grads = total[0] if isinstance(argnums, int) else tuple(total)
        value = (losses, aux) if has_aux else losses
        return value, grads, _rebuild(scales, finite)

    return value_and_grad_fn
