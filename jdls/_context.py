"""A thread-local stack of the collectors active while a function is being traced.

``jdls.probe`` and ``jdls.layer_boundary`` are the identity outside a collecting call; inside
``probed_value_and_grad`` or ``layer_scaled_value_and_grad`` they find the innermost collector
here; the NNX output hooks (``_nnx_hooks``) keep theirs here too. Each module keeps its own
:class:`ContextStack`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["ContextStack"]

T = TypeVar("T")


class ContextStack(Generic[T]):
    """A per-thread stack: ``push`` for the duration of a ``with``, ``current`` the innermost."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> T | None:
        """The innermost pushed item of this thread, or None outside any ``push``."""
        stack: list[T] = getattr(self._local, "stack", [])
        return stack[-1] if stack else None

    def all(self) -> tuple[T, ...]:
        """Every pushed item of this thread, outermost first."""
        return tuple(getattr(self._local, "stack", []))

    @contextlib.contextmanager
    def push(self, item: T) -> Iterator[T]:
        """Make ``item`` the innermost item until the ``with`` block ends."""
        stack: list[T] = self._local.__dict__.setdefault("stack", [])
        stack.append(item)
        try:
            yield item
        finally:
            stack.pop()


def current_trace() -> object:
    """The JAX trace that the code running now records into (an evaluation trace outside
    any transformation). A boundary or a probe compares it with the one its collector was
    opened in: the same object, or the boundary sits in a nested transformation."""
    from jax._src import core

    return core.trace_ctx.trace


_NESTED = (
    "jax.jit / nn.jit / nnx.jit, jax.checkpoint / nn.remat, lax.scan / fori_loop / "
    "while_loop / nn.scan, lax.cond / switch, jax.vmap / nn.vmap, shard_map, pmap"
)


def refuse_nested(what: str, owner: str, move: str) -> None:
    """Raise the error for ``what`` (``"jdls.probe('h')"``) reached inside a nested JAX
    transformation of the function given to ``owner``."""
    raise ValueError(
        f"{what} was traced inside a nested JAX transformation ({_NESTED}) within the "
        f"function given to {owner}. JAX traces, caches and batches that inner function on "
        "its own, so its result would not be right (it could reuse a trace made without "
        f"the scales, or add up the statistics of every iteration). {move} Or transform the "
        f"whole {owner}(...) call instead (jax.jit, jax.vmap, shard_map and pmap around it "
        "are supported), or leave the inner transformation out."
    )


def refuse_changed(kind: str, owner: str, first: list[str], second: list[str]) -> None:
    """Raise the error for a trace whose boundaries or probes differ from the first one's."""
    raise ValueError(
        f"{owner} traced the function twice (once to find the {kind}, once to "
        f"differentiate) and reached different {kind}: {first} then {second}. Either the "
        "function's Python code takes a different path from call to call, or JAX reused a "
        f"trace it had cached (a jitted or checkpointed function traced before without the "
        f"{kind}). Make the {kind} depend on nothing but the arguments, and place them "
        "outside jitted or checkpointed inner functions."
    )
