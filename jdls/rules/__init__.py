"""Scale-update rules of :class:`jdls.DynamicScale`: one file per rule.

* :class:`GrowBackoff`: back off on an overflow, grow after a run of finite steps, with
  hysteresis (PyTorch, Flax, jmp, Keras, DeepSpeed, Megatron-LM and jdls's default).
* :class:`OverflowTolerance`: back off when the fraction of overflowing steps since the last
  change exceeds a tolerance (Cerebras).

Example:
  >>> import jdls
  >>> scale = jdls.DynamicScale(256.0, jdls.rules.GrowBackoff(hysteresis=2))
  >>> float(scale.adjust(False).loss_scale), float(scale.adjust(False).adjust(False).loss_scale)
  (256.0, 128.0)
"""

from jdls.rules._adaptive import Adaptive, AdaptiveState
from jdls.rules._grow_backoff import GrowBackoff, GrowBackoffState, MinimumScaleError
from jdls.rules._overflow_tolerance import OverflowTolerance, OverflowToleranceState
from jdls.rules._rule import Rule

__all__ = [
    "Adaptive",
    "AdaptiveState",
    "GrowBackoff",
    "GrowBackoffState",
    "MinimumScaleError",
    "OverflowTolerance",
    "OverflowToleranceState",
    "Rule",
]
