"""Exact loss-scale rules of PyTorch, Flax, jmp, Keras, DeepSpeed, Megatron-LM and Cerebras.

Each preset takes the keyword arguments of the library it mirrors, under the same names and
with the same defaults, and returns a :class:`jdls.DynamicScale` whose rule reproduces that
library's loss-scale trajectory step by step (or a static or no-op scale where the library
would not scale dynamically). A preset picks a rule and its parameters and nothing else.

Example:
  >>> import jdls
  >>> scale = jdls.presets.pytorch(init_scale=2.0**16, growth_interval=2000)
  >>> float(scale.adjust(False).loss_scale)
  32768.0
"""

from jdls.presets._cerebras import CEREBRAS_MIN_LOSS_SCALE, cerebras, cerebras_wrap
from jdls.presets._libraries import (
    deepspeed,
    deepspeed_fp16,
    flax,
    from_jmp,
    jmp,
    keras,
    megatron,
    pytorch,
)
from jdls.presets._state_dicts import (
    from_cerebras_state_dict,
    from_pytorch_state_dict,
    to_cerebras_state_dict,
    to_pytorch_state_dict,
)

__all__ = [
    "CEREBRAS_MIN_LOSS_SCALE",
    "cerebras",
    "cerebras_wrap",
    "deepspeed",
    "deepspeed_fp16",
    "flax",
    "from_cerebras_state_dict",
    "from_jmp",
    "from_pytorch_state_dict",
    "jmp",
    "keras",
    "megatron",
    "pytorch",
    "to_cerebras_state_dict",
    "to_pytorch_state_dict",
]
