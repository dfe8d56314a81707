"""The causes of a skipped step (:class:`SkipCause`) and how the wrap tells them apart.

A whole train step is retried at lower scales by :func:`jdls.retrying`
(``jdls/_transforms/retrying.py``), one micro-batch by :func:`jdls.accumulate`
(``jdls/_transforms/accumulate.py``).
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdls._numerics.leaves import sharded_flags
from jdls._numerics.scalars import pick
from jdls._scales.scale import DynamicScale, LossScale

__all__ = [
    "SCALE_FLOOR",
    "SkipCause",
    "classify",
    "flushed",
    "mean_unsharded",
    "model_overflow",
]


class SkipCause(enum.IntEnum):
    """Why a step was skipped, as recorded in ``jdls.Stats.cause``.

    Example:
      >>> import jdls
      >>> jdls.SkipCause(2).name
      'BACKWARD'
    """

    NONE = 0  #: the step was taken
    FORWARD = 1  #: the loss itself was not finite (bad data, a forward overflow)
    #: the loss was finite, the gradients were not, even after the retries of a
    #: ``jdls.retrying`` step (``retries=0`` included)
    BACKWARD = 2
    #: the gradients were not finite, in a step without ``jdls.retrying`` (the wrap alone):
    #: the loss given as ``value`` was finite, or no loss was given
    GRADIENTS = 3
    #: the step overflowed where the scale cannot be the cause: a scale below 2**-24, or a
    #: dynamic scale at most 1 that its rule could not lower. The model overflows by itself
    #: (a float16 forward pass, a norm's sum of squares): no scale helps.
    MODEL = 4
    #: the gradients were all zero where the loss was not, before the rule had measured
    #: anything (:meth:`jdls.rules.Rule.looks_for_flushed`): taken for gradients that all
    #: flushed (a loss weighted 2**-20 in float16 at the start's scale), not counted; the
    #: scale looks higher on the next step
    UNDERFLOW = 5

    def __str__(self) -> str:
        """The cause's name, in prints and f-strings (``f"{jdls.skip_cause(opt_state)}"``
        reads ``BACKWARD``, not ``2``); ``int(cause)`` is its number.

        Example:
          >>> import jdls
          >>> f"skipped: {jdls.SkipCause.FORWARD}", int(jdls.SkipCause.FORWARD)
          ('skipped: FORWARD', 1)
        """
        return self.name

    def __format__(self, spec: str) -> str:
        number = bool(spec) and spec[-1] in "bdoxXn"
        return format(int(self), spec) if number else format(self.name, spec)

    @property
    def handled(self) -> bool:
        """Whether the skip is loss scaling at work: an overflow of the scaled gradients
        (``BACKWARD``, ``GRADIENTS``), after which the scale backs off and training goes on,
        or gradients that all flushed (``UNDERFLOW``), after which it looks higher.
        False for a taken step (``NONE``), a non-finite loss (``FORWARD``) and the model's
        own overflow (``MODEL``), which no scale changes: what a training loop's own NaN
        guard should still stop on.

        Example:
          >>> import jdls
          >>> jdls.SkipCause.BACKWARD.handled, jdls.SkipCause.FORWARD.handled
          (True, False)
        """
        return self in (SkipCause.BACKWARD, SkipCause.GRADIENTS, SkipCause.UNDERFLOW)


#: The loss scale below which a step that still overflows is the model's own overflow
#: (float16's smallest subnormal: no gradient of a loss near 1 survives a smaller scale).
SCALE_FLOOR = 2.0**-24


def classify(finite: jax.Array, loss_finite: jax.Array) -> jax.Array:
    """The :class:`SkipCause` of a step the wrap decided, an int32 scalar: ``NONE`` when taken,
    ``FORWARD`` when the loss was not finite, else ``GRADIENTS`` (``jdls.retrying`` reads
    that as ``BACKWARD`` once its retries are spent)."""
    cause = pick(loss_finite, jnp.int32(SkipCause.GRADIENTS), jnp.int32(SkipCause.FORWARD))
    return pick(finite, jnp.int32(SkipCause.NONE), cause)


def flushed(
    scale: LossScale, finite: jax.Array, amax: jax.Array, loss_nonzero: jax.Array | None
) -> jax.Array:
    """Whether the step is skipped as ``SkipCause.UNDERFLOW``: its gradients are finite
    and all zero (``amax`` 0) while its loss was not zero (``loss_nonzero``; None: not known,
    never skipped), and ``scale``'s rule would look for gradients that flushed
    (:meth:`jdls.rules.Rule.looks_for_flushed`: :class:`jdls.rules.Adaptive` before its first
    measurement). Exact zeros (a loss weighted 0) are never skipped; a frozen model is
    skipped once, and its next step, which finds zeros again at the raised scale, is taken."""
    if loss_nonzero is None or not isinstance(scale, DynamicScale):
        return jnp.zeros((), jnp.bool_)
    looks = scale.rule.looks_for_flushed(scale.state)
    return jnp.all(looks & finite & (amax == 0) & loss_nonzero)


def model_overflow(cause: jax.Array, before: LossScale, after: LossScale) -> jax.Array:
    """``cause``, or ``SkipCause.MODEL`` for a skipped step that the scale cannot have
    caused: it ran at a scale below :data:`SCALE_FLOOR`, or at a dynamic scale of at most 1
    that the rule did not lower (its minimum). ``before``: the scale the step ran at;
    ``after``: the scale after it. A few scalar operations."""
    ran_at = before.loss_scale
    stuck = jnp.all(ran_at <= SCALE_FLOOR)
    if isinstance(before, DynamicScale):  # a static scale (NoOpScale under per-layer
        # scales) sits at its level on purpose
        stuck = stuck | jnp.all((ran_at <= 1.0) & (after.loss_scale >= ran_at))
    overflowed = (cause != SkipCause.NONE) & (cause != SkipCause.UNDERFLOW)
    return pick(overflowed & stuck, jnp.int32(SkipCause.MODEL), cause)


def mean_unsharded(grads: Any, axis_name: Any, sharded: Any) -> Any:
    """``lax.pmean`` over ``axis_name`` of the gradient leaves that are not sharded across it
    (data parallelism: every device holds the whole gradient of its part of the batch)."""
    if axis_name is None:
        return grads
    flags = sharded_flags(sharded, grads) or [False] * len(jax.tree_util.tree_leaves(grads))
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    leaves = [x if s else lax.pmean(x, axis_name) for x, s in zip(leaves, flags, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)
