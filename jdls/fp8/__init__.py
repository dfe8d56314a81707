"""FP8 training: per-tensor (and block) scales held as plain state, skip-aware.

A *recipe* (plain configuration) says how each tensor of a dot is scaled and cast; a
:class:`DotState` holds one dot's scales, amax histories and a meter; :func:`dot_general`
computes the dot in FP8 and reports what it measured as the cotangent of the meter;
:func:`update` turns a step's measurements into the next step's state.

Example:
  >>> import jax, jax.numpy as jnp, jdls
  >>> state = jdls.fp8.init(jdls.fp8.DelayedScaling(history_length=16))
  >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  >>> def loss(w, state):
  ...     y = jdls.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), state=state)
  ...     return jnp.mean(y**2)
  >>> grad_w, grad_state = jax.grad(loss, argnums=(0, 1))(w, state)
  >>> state = jdls.fp8.update(state, grad_state)
  >>> float(state.lhs.history[0]), float(state.grad.history[0])
  (1.0, 2.0)
"""

from jdls.fp8._current import CurrentScaling, CurrentState
from jdls.fp8._delayed import DelayedScaling, DelayedState
from jdls.fp8._dot import dot_general
from jdls.fp8._formats import Formats, format_max
from jdls.fp8._presets import flax_fp8_ops, transformer_engine
from jdls.fp8._recipe import Measurement, Quantized, Recipe, scale_from_amax
from jdls.fp8._state import DotState, Meter, init, measurements, reduce, update

__all__ = [
    "CurrentScaling",
    "CurrentState",
    "DelayedScaling",
    "DelayedState",
    "DotState",
    "Formats",
    "Measurement",
    "Meter",
    "Quantized",
    "Recipe",
    "dot_general",
    "flax_fp8_ops",
    "format_max",
    "init",
    "measurements",
    "reduce",
    "scale_from_amax",
    "transformer_engine",
    "update",
]
