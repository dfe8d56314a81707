"""Differentiate pytrees with non-array leaves the way Equinox does, without importing it.

An Equinox model is a pytree whose leaves include non-arrays (activation functions,
``jnp.ravel``, Python numbers, strings). ``jax.value_and_grad`` refuses them; Equinox's
``filter_value_and_grad`` differentiates the floating-point (inexact) arrays and returns
``None`` for every other leaf. jdls does the same wherever it differentiates for the user:

* an argument whose leaves are all differentiable by JAX (floating-point arrays and Python
  floats) and that holds no Equinox module is differentiated by ``jax.value_and_grad``
  exactly as before;
* an argument with any other leaf, or holding an Equinox module, is split: its floating-point
  arrays (JAX or NumPy, as ``eqx.is_inexact_array``) are differentiated, every other leaf
  (functions, integer and boolean arrays, Python numbers, strings) is held fixed and gets
  ``None`` as gradient. An Equinox model's Python ``float`` field thus gets ``None``, as
  ``eqx.filter_value_and_grad`` gives it and as ``eqx.filter(model, eqx.is_array)`` (the
  parameters given to the optimizer) leaves it;
* an argument with no floating-point array at all is an error that says what to do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Split",
    "filtered_eval_shape",
    "filtered_value_and_grad",
    "is_inexact_array",
    "is_jax_type",
    "non_array_hint",
    "split_arguments",
]


def is_inexact_array(x: Any) -> bool:
    """Whether ``x`` is a floating-point or complex JAX or NumPy array (``eqx.is_inexact_array``)."""
    if isinstance(x, np.ndarray | np.generic):
        return bool(np.issubdtype(x.dtype, np.inexact))
    if isinstance(x, jax.Array):
        return bool(jnp.issubdtype(x.dtype, jnp.inexact))
    return False


def _differentiable(x: Any) -> bool:
    """What ``jax.value_and_grad`` differentiates as it is: inexact arrays, Python floats."""
    return is_inexact_array(x) or (isinstance(x, float | complex) and not isinstance(x, bool))


def _is_nnx(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX object (module, variable), without importing Flax."""
    return any(c.__module__.startswith("flax.nnx") for c in type(x).__mro__)


def _is_equinox(x: Any) -> bool:
    """Whether ``x`` is an Equinox module, without importing Equinox."""
    return any(c.__module__.startswith("equinox") for c in type(x).__mro__)


def _describe(leaves: list[Any]) -> str:
    kinds = []
    for x in leaves:
        dtype = getattr(x, "dtype", None)
        kind = f"{dtype} arrays" if dtype is not None else type(x).__name__
        if kind not in kinds:
            kinds.append(kind)
    return ", ".join(kinds[:4]) + (", ..." if len(kinds) > 4 else "") if kinds else "no leaves"


@dataclasses.dataclass(frozen=True)
class Split:
    """Arguments split as Equinox splits a model, each into two trees shaped like it: ``diff``
    holds what is differentiated (the floating-point arrays, and the subtrees kept whole)
    with ``None`` elsewhere, ``held`` the rest with ``None`` at those. The gradients of
    ``diff`` are shaped like the arguments with ``None`` where a leaf was held, as
    ``eqx.filter_value_and_grad`` gives them."""

    diff: tuple[Any, ...]
    held: tuple[Any, ...]
    whole: Callable[[Any], bool] | None = None

    def combine(self, diffs: Sequence[Any]) -> list[Any]:
        """The arguments rebuilt from ``diffs`` (trees shaped like :attr:`diff`; a subtree
        kept whole is taken as it is, e.g. a site told its scale) and the held leaves."""
        whole = self.whole

        def stop(x: Any) -> bool:
            return x is None or (whole is not None and whole(x))

        def pick(d: Any, h: Any) -> Any:
            return h if d is None else d

        return [
            jax.tree_util.tree_map(pick, d, h, is_leaf=stop)
            for d, h in zip(diffs, self.held, strict=True)
        ]


def is_jax_type(x: Any) -> bool:
    """Whether JAX takes ``x`` as a function argument: an array or a Python number."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | int | float | complex)


def split_arguments(
    values: Sequence[Any],
    nums: Sequence[int],
    who: str,
    as_is: Callable[[Any], bool] | None = None,
    whole: Callable[[Any], bool] | None = None,
) -> Split | None:
    """``None`` when JAX differentiates ``values`` as they are, else how to split them.

    ``values`` holding an Equinox module are always split (Equinox's rule: only the
    floating-point arrays are differentiated, a Python ``float`` field is held fixed).
    ``nums`` are the positions (``argnums``) of ``values``, for the error message. ``as_is``
    says which leaves JAX takes as they are (default: floating-point arrays, Python floats;
    ``is_jax_type`` for ``jax.vjp``, which gives integer arrays ``float0`` gradients).
    ``whole`` says which subtrees are differentiated whole, every leaf of them (``is_site``
    for ``jax.vjp``: a site stays a site, so its cotangent is known as a measurement).
    """
    flat = [jax.tree_util.tree_flatten(v) for v in values]
    as_is = _differentiable if as_is is None else as_is
    if all(as_is(x) for leaves, _ in flat for x in leaves) and not any(
        map(_is_equinox, jax.tree_util.tree_leaves(values, is_leaf=_is_equinox))
    ):
        return None
    for n, value in zip(nums, values, strict=True):
        if any(map(_is_nnx, jax.tree_util.tree_leaves(value, is_leaf=_is_nnx))):
            raise TypeError(
                f"{who} got a Flax NNX object in argument {n} (argnums), whose leaves include "
                "non-float arrays (RNG keys and counts): differentiate an NNX model with "
                "jdls.nnx.value_and_grad(fun, scale)(model), which follows nnx.value_and_grad "
                "(gradients of the nnx.Param only, the model's state updates kept)"
            )
    masks = []
    for n, (leaves, _) in zip(nums, flat, strict=True):
        mask = tuple(is_inexact_array(x) for x in leaves)
        if leaves and not any(mask):
            raise TypeError(
                f"{who} differentiates argument {n} (argnums), which holds no floating-point "
                f"array (its leaves: {_describe(leaves)}). Pass the parameters to differentiate "
                "as floating-point arrays (e.g. x.astype(jnp.float32)), or choose the argument "
                "with argnums=..., or pass this value as a later argument or a keyword. "
                "Non-array leaves such as functions, strings and integer arrays are held fixed "
                "(their gradient is None) only beside floating-point arrays."
            )
        masks.append(mask)

    def kept(x: Any) -> bool:
        return (whole is not None and whole(x)) or is_inexact_array(x)

    def part(value: Any, differentiated: bool) -> Any:
        return jax.tree_util.tree_map(
            lambda x: x if kept(x) == differentiated else None, value, is_leaf=whole
        )

    return Split(tuple(part(v, True) for v in values), tuple(part(v, False) for v in values), whole)


def filtered_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    who: str = "value_and_grad",
) -> Callable[..., Any]:
    """``jax.value_and_grad`` that also takes pytrees with non-array leaves, as
    ``eqx.filter_value_and_grad``: gradients for the floating-point arrays, ``None`` elsewhere.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jdls._scales.filter import filtered_value_and_grad
      >>> model = {"w": jnp.ones(2), "act": jax.nn.relu, "n": 3}
      >>> loss, grads = filtered_value_and_grad(lambda m: jnp.sum(m["act"](m["w"]) * m["n"]))(model)
      >>> float(loss), grads["w"].tolist(), grads["act"], grads["n"]
      (6.0, [3.0, 3.0], None, None)
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        if any(not isinstance(n, int) or not -len(args) <= n < len(args) for n in nums):
            # jax says what is wrong with argnums
            return jax.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)
        split = split_arguments([args[n] for n in nums], nums, who)
        if split is None:
            return jax.value_and_grad(fun, argnums, has_aux)(*args, **kwargs)

        def inner(*diffs: Any) -> Any:
            full = list(args)
            for n, value in zip(nums, split.combine(diffs), strict=True):
                full[n] = value
            return fun(*full, **kwargs)

        value, grads = jax.value_and_grad(inner, tuple(range(len(nums))), has_aux)(*split.diff)
        return value, grads[0] if isinstance(argnums, int) else tuple(grads)

    return value_and_grad_fn


def filtered_eval_shape(fun: Callable[..., Any], *args: Any) -> Any:
    """``jax.eval_shape(fun, *args)`` where ``args`` may hold non-array leaves (held fixed)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    mask = [is_jax_type(x) for x in leaves]
    arrays = [x for x, m in zip(leaves, mask, strict=True) if m]

    def inner(arrays: list[Any]) -> Any:
        it = iter(arrays)
        full = [next(it) if m else x for x, m in zip(leaves, mask, strict=True)]
        return fun(*jax.tree_util.tree_unflatten(treedef, full))

    return jax.eval_shape(inner, arrays)


def non_array_hint(tree: Any, where: str) -> str:
    """``""`` when every leaf of ``tree`` is a JAX type, else what to pass instead (for errors)."""
    found, _ = jax.tree_util.tree_flatten_with_path(tree)
    bad = [(jax.tree_util.keystr(p) or "<root>", x) for p, x in found if not is_jax_type(x)]
    if not bad:
        return ""
    path, x = bad[0]
    return (
        f"{where} hold non-array leaves ({len(bad)}, the first {type(x).__name__} at {path}), "
        "as an Equinox model does: pass only its arrays, eqx.filter(model, eqx.is_array), to "
        "tx.init and tx.update, and apply the updates with eqx.apply_updates(model, updates)"
    )
