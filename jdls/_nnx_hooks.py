"""Hooks on the outputs of NNX modules without model edits: the class swap shared by
``jdls.nnx.probes`` and ``jdls.nnx.layer_boundaries``.

While :func:`hook_outputs` is open, each given module's class is swapped for a cached
subclass whose ``__call__`` passes the output through the hook that every open context (of
this thread, outermost first) holds for that module; on exit the classes are restored.
Contexts nest: a module already swapped by an enclosing context is not swapped again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jdls._context import ContextStack

__all__ = ["hook_outputs", "module_name"]

Hook = Callable[[Any], Any]

_HOOKS: ContextStack[dict[int, Hook]] = ContextStack()
_ORIGINAL = "_jdls_hooked_from"


def module_name(path: Sequence[Any]) -> str:
    """A module's path in its model joined by ``/``, as NNX state paths print.

    Example:
      >>> from jdls._nnx_hooks import module_name
      >>> module_name(("layers", 0))
      'layers/0'
    """
    return "/".join(str(p) for p in path)


def _has_call(cls: type) -> bool:
    return any("__call__" in vars(c) for c in cls.__mro__ if c is not object)


def _refuse_copy(cls: type) -> None:
    raise ValueError(
        f"a copy of an NNX module ({cls.__name__}) that jdls.nnx.probes or "
        "jdls.nnx.layer_boundaries hooks was called while the hooks were open. NNX "
        "transformations (nnx.jit, nnx.remat, nnx.scan, nnx.vmap) and JAX transformations of a "
        "split model call copies of the modules inside a nested trace of their own, where a "
        "probe cannot measure and a boundary cannot rescale. Call the model outside such a "
        "transformation (transform the whole jdls call instead: jax.jit, jax.vmap, shard_map "
        "and pmap around it are supported)."
    )


@functools.cache
def _hooked_class(cls: type) -> type:
    original = cls.__call__

    @functools.wraps(original)  # the signature NNX inspects (``rngs``) stays the original's
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        contexts = _HOOKS.all()
        found = False
        for hooks in contexts:
            hook = hooks.get(id(self))
            if hook is not None:
                found = True
                out = hook(out)
        if contexts and not found:
            _refuse_copy(cls)
        return out

    namespace = {"__call__": __call__, "__module__": cls.__module__, _ORIGINAL: cls}
    return type(cls.__name__, (cls,), namespace)


@contextlib.contextmanager
def hook_outputs(hooks: Sequence[tuple[Any, Hook]]) -> Iterator[None]:
    """Within this context, ``module(...)`` returns ``hook(output)`` for every
    ``(module, hook)`` of ``hooks`` (modules without a ``__call__`` are left alone).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jdls._nnx_hooks import hook_outputs
      >>> layer = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> with hook_outputs([(layer, lambda out: out * 0)]):
      ...     float(layer(jnp.ones((1, 2)))[0, 0])
      0.0
      >>> type(layer) is nnx.Linear
      True
    """
    callable_hooks = [(m, h) for m, h in hooks if _has_call(type(m))]
    swapped: list[tuple[Any, Any]] = []
    try:
        for module, _ in callable_hooks:
            cls: Any = type(module)
            if _ORIGINAL not in vars(cls):  # not swapped by an enclosing context already
                object.__setattr__(module, "__class__", _hooked_class(cls))
                swapped.append((module, cls))
        with _HOOKS.push({id(m): h for m, h in callable_hooks}):
            yield
    finally:
        for module, cls in reversed(swapped):
            object.__setattr__(module, "__class__", cls)
