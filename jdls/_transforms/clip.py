"""``jdls.clip``: gradient clipping that keeps non-finite gradients detectable.

Put it in front of ``jdls.wrap``; the exact global norm it clips by is in ``jdls/_numerics/norm.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jdls._numerics.checks import check_limit
from jdls._numerics.handoff import remember
from jdls._numerics.leaves import check_sharded, flatten_floats
from jdls._numerics.norm import AxisName, clip_by_norm, tree_norm
from jdls._sites.apart import sites_apart

__all__ = ["clip"]


def clip(
    max_norm: float | None = None,
    max_value: float | None = None,
    *,
    axis_name: AxisName | None = None,
    sharded: bool | Any | Callable[[Any], Any] | None = None,
) -> optax.GradientTransformation:
    """Clip gradients by global norm or by value, keeping non-finite gradients detectable.

    Put it in front of :func:`jdls.wrap`: ``optax.chain(jdls.clip(1.0), jdls.wrap(adam))``.
    On finite gradients ``jdls.clip(max_norm=c)`` gives exactly what
    ``optax.clip_by_global_norm(c)`` gives (same reduction, same formula: ``g * c / norm``
    when ``norm >= c``), with four differences:

    * **non-finite gradients pass through untouched** (optax turns them into NaN and zeros,
      and per-value clipping would turn inf into a finite ``max_value``), so the wrap behind
      sees the same inf/NaN in the same leaves and skips the step;
    * **a finite gradient whose norm overflows float32** (elements around ``1e20`` or more)
      is still clipped to norm ``max_norm``; optax's norm is inf there and every update
      silently becomes zero. The overflow is detected from the sum of squares and handled by
      a second pass over the gradients scaled by ``2**-96``;
    * 16-bit leaves are squared and clipped in float32, then cast back;
    * a :func:`jdls.wrap` right behind it sees what it received: the wrap's rule sets the
      scale, and ``Stats.grad_norm`` reports the norm, from the gradients before clipping, so
      the chain takes the decisions of ``jdls.wrap(inner, max_norm=c)`` (docs/optax.md).

    Exactly one of ``max_norm`` and ``max_value`` must be given, as in Cerebras'
    ``optimizer_step``; a ``jdls.clip()`` with neither would do nothing, so it is an error
    too (leave the transformation out instead). Integer and boolean leaves pass through.

    Args:
      max_norm: largest global L2 norm, a finite number > 0.
      max_value: largest absolute value of each element, a finite number > 0.
      axis_name: with ``max_norm`` inside ``pmap``/``shard_map``: the mapped axis across which
        every device must see the same global norm.
      sharded: with ``axis_name``: True when each device holds a different part of the
        gradients (squared norms are summed with ``psum``), False when each holds all of them
        (after ``lax.pmean``), or a pytree prefix of bools (or a function of the gradients
        returning one) for a mix. See ``docs/multi-device.md``.

    Returns:
      An ``optax.GradientTransformation`` with an empty state.

    Raises:
      ValueError: neither or both limits given, or a limit that is not a finite number > 0
        (the message names the argument).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> tx = jdls.clip(max_norm=1.0)
      >>> g, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> g["w"].tolist()
      [0.6000000238418579, 0.800000011920929]
      >>> g, _ = tx.update({"w": jnp.array([jnp.inf, 4.0])}, tx.init(None))
      >>> g["w"].tolist()
      [inf, 4.0]

    References:
      Pascanu et al., `On the difficulty of training Recurrent Neural Networks
      <https://arxiv.org/abs/1211.5063>`_, 2012; Cerebras ``cerebras.pytorch.optim``
      ``optimizer_step(max_gradient_norm, max_gradient_value)``.
    """
    if max_norm is not None and max_value is not None:
        raise ValueError(
            f"give max_norm or max_value, not both (got max_norm={max_norm!r} and "
            f"max_value={max_value!r})"
        )
    if max_norm is None and max_value is None:
        raise ValueError(
            "give max_norm (global-norm clipping) or max_value (per-element clipping); "
            "for no clipping leave jdls.clip out of the chain"
        )
    if max_norm is not None:
        max_norm = check_limit("max_norm", max_norm)
        check_sharded(axis_name, sharded, True, "jdls.clip")
    else:
        max_value = check_limit("max_value", max_value)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        tree = flatten_floats(updates)
        # Measured before clipping, for a jdls.wrap right behind (jdls/_numerics/handoff.py): its rule
        # and Stats.grad_norm then see what the backward pass computed.
        n = tree_norm(tree, axis_name=axis_name, sharded=sharded, largest=True)
        if max_value is not None:
            out = tree.with_floats([_clip_value(g, max_value) for g in tree.floats])
        else:
            out = clip_by_norm(tree, n, max_norm)
        remember(out.floats, n, axis_name)
        return out.unflatten(), state

    # Sites among the gradients (their measurements) pass on unclipped, outside the norm.
    return optax.GradientTransformation(*sites_apart(optax.init_empty_state, update_fn, None))


def _clip_value(g: jax.Array, max_value: Any) -> jax.Array:
    clipped = jnp.clip(g, -max_value, max_value).astype(g.dtype)
    return jnp.where(jnp.isinf(g), g, clipped)  # NaN stays NaN through clip
