"""A step's scalar bookkeeping compiled as one kernel.

XLA compiles each scalar output of a chain of scalar operations as a kernel of its own (on
XLA:CPU, each one an LLVM function compiled in several milliseconds), and copies into it the
part of the chain it shares with the other outputs. A scale rule's counters and the step's
statistics are a dozen such outputs, computed from one decision. :func:`one_kernel` passes
them through one variadic reduction instead, which XLA compiles as one kernel: each output is
the maximum of ``[value, lowest]``, with ``lowest`` the int32 minimum or float32 ``-inf``,
which is the value, bit for bit (XLA's ``max`` returns a NaN operand as it is; a test checks
every kind of float32 bit pattern, jitted and not). The one exception: a float32 subnormal
may come back as a zero of its sign, as from any arithmetic operation on XLA:CPU, which
flushes them (a scale rule's scale is a normal number). Float32 values stay float32: a round
trip through their int32 bits would keep subnormals, but cost a conversion kernel per value
on the way out.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["clamp", "one_kernel", "pick"]

T = TypeVar("T")

_I32 = jnp.int32
_LOW = int(jnp.iinfo(jnp.int32).min)
_KINDS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.int32))


def _packable(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.shape == () and x.dtype in _KINDS


def one_kernel(tree: T) -> T:
    """``tree`` unchanged, bit for bit, with its scalar float32 and int32 arrays computed in
    one kernel (see the module docstring). Other leaves (bools too: converting one back would
    be a kernel of its own) pass as they are; with fewer than two such scalars, so does the
    whole tree.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jdls._numerics.scalars import one_kernel
      >>> out = jax.jit(lambda x: one_kernel((x * 2, x > 1, jnp.int32(3))))(jnp.float32(1.5))
      >>> [v.item() for v in out]
      [3.0, True, 3]
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    picked = [i for i, x in enumerate(leaves) if _packable(x)]
    if len(picked) < 2:
        return tree
    rows, inits = [], []
    for i in picked:
        x = leaves[i]
        low = _I32(_LOW) if x.dtype == _I32 else jnp.float32(-jnp.inf)
        rows.append(jnp.stack([x, low]))
        inits.append(low)
    outs = lax.reduce(rows, inits, _maxima, (0,))
    leaves = list(leaves)
    for i, y in zip(picked, outs, strict=True):
        leaves[i] = y
    return jax.tree_util.tree_unflatten(treedef, leaves)


def pick(condition: Any, on_true: Any, on_false: Any) -> jax.Array:
    """``jnp.where(condition, on_true, on_false)``, for scalars as one ``select``:
    ``jnp.where`` traces a nested ``jit`` of its own, which a rule's dozens of scalar choices
    pay for in tracing and lowering every train step that compiles. Arrays go to
    ``jnp.where``, which broadcasts them and their shardings.

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls._numerics.scalars import pick
      >>> pick(jnp.bool_(True), jnp.int32(3), 0).item()
      3
    """
    dtype = jnp.result_type(on_true, on_false)
    a, b = jnp.asarray(on_true, dtype), jnp.asarray(on_false, dtype)
    c = jnp.asarray(condition)
    if c.shape or a.shape or b.shape:  # arrays: jnp.where broadcasts them, shardings too
        return jnp.where(c, a, b)
    return lax.select(c, a, b)


def clamp(x: Any, low: Any, high: Any) -> jax.Array:
    """``jnp.clip(x, low, high)`` without its nested ``jit`` (see :func:`pick`).

    Example:
      >>> import jax.numpy as jnp
      >>> from jdls._numerics.scalars import clamp
      >>> clamp(jnp.int32(9), 0, 4).item()
      4
    """
    return jnp.minimum(jnp.maximum(x, low), high)


def _maxima(xs: tuple[jax.Array, ...], ys: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.maximum(x, y) for x, y in zip(xs, ys, strict=True))
