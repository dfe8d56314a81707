"""The FP8 state of one dot (a site) and its update from the measurement of a step.

A :class:`DotState` holds the recipe's state of the three tensors of a dot (``lhs``,
``rhs``, the output gradient ``grad``) and a ``meter``: zeros whose cotangent, when the loss
is differentiated with respect to the state, is the :class:`Measurement` of the step. The
state is plain data: it goes into :func:`jdls.fp8.dot_general` as arrays, and
:func:`update` turns it and its cotangent into the state of the next step. Nothing is
overwritten with a gradient; an optimizer, clipping or weight decay never sees it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jdls.fp8._recipe import ROLES, Measurement, Recipe

__all__ = ["DotState", "Meter", "init", "reduce", "update"]


@struct.dataclass
class Meter:
    """One :class:`Measurement` per tensor of a dot."""

    lhs: Measurement
    rhs: Measurement
    grad: Measurement

    @classmethod
    def zeros(cls) -> Meter:
        return cls(Measurement.zeros(), Measurement.zeros(), Measurement.zeros())

    def combine(self, other: Meter) -> Meter:
        """Two uses' measurements combined: the maximum of each."""
        return jax.tree.map(jnp.maximum, self, other)


@struct.dataclass
class DotState:
    """The FP8 state of one dot: its recipe (static), each tensor's state, and the meter.

    Attributes:
      lhs, rhs, grad: the recipe's state of the left operand, the right operand and the
        output gradient (``recipe.init(role)``).
      meter: a :class:`Meter` of zeros; its cotangent is the step's measurement.
      recipe: the recipe (static configuration, not an array).
    """

    lhs: Any
    rhs: Any
    grad: Any
    meter: Meter
    recipe: Recipe = struct.field(pytree_node=False)


def init(recipe: Recipe) -> DotState:
    """The initial FP8 state of one dot under ``recipe``.

    Example:
      >>> import jdls
      >>> state = jdls.fp8.init(jdls.fp8.DelayedScaling(history_length=8))
      >>> state.lhs.history.shape, float(state.grad.scale)
      ((8,), 1.0)
    """
    lhs, rhs, grad = (recipe.init(role) for role in ROLES)
    return DotState(lhs=lhs, rhs=rhs, grad=grad, meter=Meter.zeros(), recipe=recipe)


def reduce(meter: Meter, axis_name: Any) -> Meter:
    """A meter reduced over a mapped axis (data parallelism): the maximum of each field.

    Use it inside ``shard_map`` or ``pmap``, where each device measured its own shard.
    """
    return jax.tree.map(lambda v: jax.lax.pmax(v, axis_name), meter)


def _is_state(x: Any) -> bool:
    return isinstance(x, DotState)


def update(states: Any, cotangents: Any, *, skipped: Any = False, axis_name: Any = None) -> Any:
    """The FP8 states of the next step, from the states and their cotangents.

    ``states`` is any pytree holding :class:`DotState` nodes (one dot, a model's whole FP8
    collection, layers stacked by a scan); ``cotangents`` is the gradient of the loss with
    respect to it (same structure), whose meters hold the step's measurements.

    Args:
      states: the pytree of FP8 states used in the step.
      cotangents: the gradient with respect to ``states``.
      skipped: whether the optimizer skipped the step (passed to the recipe).
      axis_name: reduce each measurement over this mapped axis first (``shard_map`` or
        ``pmap`` data parallelism); ``None`` under ``jit``, where amaxes are already global.

    Returns:
      The same pytree with every DotState updated and its meter zeroed.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> state = jdls.fp8.init(jdls.fp8.DelayedScaling(history_length=4))
      >>> x, w = jnp.full((2, 3), 3.5), jnp.ones((3, 1))
      >>> loss = lambda s: jdls.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), state=s).sum()
      >>> state = jdls.fp8.update(state, jax.grad(loss)(state))
      >>> state.lhs.history.tolist(), float(state.lhs.scale)  # 3.5 / 448
      ([3.5, 0.0, 0.0, 0.0], 0.0078125)
    """

    def one(state: DotState, cotangent: DotState) -> DotState:
        meter = cotangent.meter
        if axis_name is not None:
            meter = reduce(meter, axis_name)
        recipe = state.recipe
        new = {
            role: recipe.update(getattr(state, role), getattr(meter, role), role, skipped)
            for role in ROLES
        }
        zeros = jax.tree.map(jnp.zeros_like, state.meter)
        return dataclasses.replace(state, meter=zeros, **new)

    return jax.tree.map(one, states, cotangents, is_leaf=_is_state)


def measurements(cotangents: Any) -> Any:
    """The meters of a pytree of FP8 state cotangents (for telemetry), as a pytree of Meter."""
    return jax.tree.map(lambda c: c.meter, cotangents, is_leaf=_is_state)
