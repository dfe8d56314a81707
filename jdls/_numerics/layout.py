"""The row-major layout of an array that a compiled loop carries (XLA:CPU).

A ``lax.while_loop`` or ``lax.scan`` carry has one layout for its body and for the code after
the loop. Left to itself, XLA:CPU gives a kernel's gradient the transposed layout of the
backward pass's ``dot`` there, and copies it back to row-major for the update that reads it
after the loop: a transposed copy and a buffer more of temporaries. Pinned row-major, the
loop's own reads and the update share the one transposed copy that the step without the loop
makes as well (``benchmarks/bench_retry.py``: the row without the row-major carry).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

__all__ = ["row_major"]

#: Whether :func:`row_major` pins (read when a step is traced; ``benchmarks/bench_retry.py``
#: measures the steps without it).
PIN = True


def row_major(x: Any) -> Any:
    """``x`` in the row-major layout when compiled for CPU, if it is a float array of two or
    more dimensions; unchanged otherwise, and on other platforms, which keep the layouts
    their compilers choose (tiled on TPU)."""
    if not PIN or jnp.ndim(x) < 2 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return x
    layout = Layout(tuple(range(jnp.ndim(x))))
    return lax.platform_dependent(
        x, cpu=lambda y: with_layout_constraint(y, layout), default=lambda y: y
    )
