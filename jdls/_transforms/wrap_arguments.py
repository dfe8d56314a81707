"""The arguments of ``jdls.wrap`` checked: the inner transformation, the state, and the
gradients against the params (their tree and shapes), each error saying what to pass."""

from __future__ import annotations

import inspect
from typing import Any

import jax
import numpy as np
import optax

from jdls._scales.filter import non_array_hint
from jdls._scales.scale import LossScale
from jdls._transforms.stats import WrapState

__all__ = ["check_inner", "check_match", "check_wrap_state", "describe_mismatch", "is_arrays"]


def check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    if isinstance(inner, optax.GradientTransformation):
        return optax.with_extra_args_support(inner)
    if isinstance(inner, LossScale) or (isinstance(inner, type) and issubclass(inner, LossScale)):
        raise TypeError(
            "inner must be an optax transformation and comes first: "
            "jdls.wrap(optax.adam(1e-3), jdls.DynamicScale()), got a loss scale "
            f"({getattr(inner, '__name__', type(inner).__name__)})"
        )
    init = getattr(inner, "init", None)
    update = getattr(inner, "update", None)
    if callable(init) and callable(update) and not isinstance(inner, type):
        # Objects with init/update methods, e.g. optax.MultiSteps.
        params = inspect.signature(update).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return optax.GradientTransformationExtraArgs(init, update)
        return optax.with_extra_args_support(optax.GradientTransformation(init, update))
    if callable(inner):
        raise TypeError(
            f"inner must be an optax transformation such as optax.adam(1e-3), got the function "
            f"{getattr(inner, '__name__', inner)!r}: call it to build the transformation"
        )
    raise TypeError(
        f"inner must be an optax transformation such as optax.adam(1e-3), got "
        f"{type(inner).__name__}"
    )


def check_wrap_state(state: Any) -> None:
    if not isinstance(state, WrapState):
        raise TypeError(
            f"jdls.wrap's update expects its own WrapState, got {type(state).__name__}: "
            "pass the state returned by this transformation's init"
        )


def describe_mismatch(updates: Any, params: Any) -> str:
    def paths(tree: Any) -> list[str]:
        found, _ = jax.tree_util.tree_flatten_with_path(tree)
        return [jax.tree_util.keystr(p) for p, _ in found]

    u, p = paths(updates), paths(params)
    only_u = [k for k in u if k not in set(p)]
    only_p = [k for k in p if k not in set(u)]

    def show(keys: list[str]) -> str:
        head = ", ".join(k or "<root>" for k in keys[:5])
        return head + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

    parts = [f"gradients have {len(u)} leaves, params {len(p)}"]
    if only_u:
        parts.append(f"only in gradients: {show(only_u)}")
    if only_p:
        parts.append(f"only in params: {show(only_p)}")
    if not only_u and not only_p:

        def brief(tree: Any) -> str:
            text = str(jax.tree_util.tree_structure(tree))
            return text if len(text) <= 200 else text[:200] + "..."

        parts.append(f"gradients: {brief(updates)}; params: {brief(params)}")
    return "; ".join(parts)


def check_match(updates: Any, params: Any) -> None:
    if params is None:
        return
    if isinstance(params, optax.LookaheadParams):
        params = params.fast  # optax.lookahead: the gradients are those of the fast params
    ours: Any = jax.tree_util.tree_structure(updates)
    if ours != jax.tree_util.tree_structure(params):
        raise ValueError(
            "jdls.wrap: the gradients do not have the tree structure of the params ("
            + describe_mismatch(updates, params)
            + "). Pass the gradients of the params given to tx.update"
            + ("; " + hint if (hint := non_array_hint(params, "the params")) else "")
            + _held_fixed_hint(updates, params)
            + "."
        )
    grads_found, _ = jax.tree_util.tree_flatten_with_path(updates)
    for (path, g), p in zip(grads_found, jax.tree_util.tree_leaves(params), strict=True):
        g_shape, p_shape = np.shape(g), np.shape(p)
        if g_shape != p_shape:
            raise ValueError(
                f"jdls.wrap: the gradient at {jax.tree_util.keystr(path) or '<root>'} has shape "
                f"{g_shape} but its parameter has shape {p_shape}; pass the gradients of the "
                "params given to tx.update (optax.apply_updates would broadcast or fail)"
            )


def _held_fixed_hint(updates: Any, params: Any) -> str:
    """Where the gradients hold None at arrays of the params that are not floating-point
    (differentiation holds them fixed, as Equinox's does): the fix, naming them."""
    try:  # the gradients' subtree (None where held fixed) at each leaf of the params
        treedef: Any = jax.tree_util.tree_structure(params)
        grads = treedef.flatten_up_to(updates)
    except (ValueError, TypeError):
        return ""
    found, _ = jax.tree_util.tree_flatten_with_path(params)
    fixed = [
        f"{jax.tree_util.keystr(path) or '<root>'} ({np.dtype(p.dtype).name})"
        for (path, p), g in zip(found, grads, strict=True)
        if g is None and hasattr(p, "dtype") and not np.issubdtype(np.dtype(p.dtype), np.inexact)
    ]
    if not fixed:
        return ""
    return (
        f"; the gradients are None at arrays that are not floating-point, {', '.join(fixed[:3])}"
        ", which differentiation holds fixed: give the optimizer the floating-point arrays "
        "only (with Equinox, eqx.filter(model, eqx.is_inexact_array), or keep integer state "
        "out of the parameters)"
    )


def is_arrays(x: Any) -> bool:
    """Whether ``x`` is a non-empty pytree of arrays (an extra argument passed as an operand)."""
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(isinstance(v, jax.Array | np.ndarray) for v in leaves)
