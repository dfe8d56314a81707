"""``jdls.wrap``: dynamic loss scaling as an optax transformation.

One train step, top to bottom::

    scale = jdls.get_dynamic_scale(opt_state)                    # the scale for this step
    loss, grads = scale.value_and_grad(loss_fn)(params, batch)   # scale, differentiate, unscale
    updates, opt_state = tx.update(grads, opt_state, params)     # check, (clip), update, adjust
    params = optax.apply_updates(params, updates)

and inside ``tx.update`` (this module): one sum of squares over the gradients decides whether
they are all finite and gives the global norm (see ``jdls/_clip.py``); the gradients are clipped
when asked; the inner transformation runs only on finite steps (``lax.cond``), otherwise the
updates are zero and the inner state is returned untouched; then ``scale.adjust(finite)``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdls._clip import (
    AxisName,
    _check_limit,
    _check_sharded,
    _clip_by_norm,
    _global_norm,
    _is_float,
    _sharded_flags,
)
from jdls._scale import DynamicScale, LossScale
from jdls._state import StepStats, WrapState

__all__ = ["wrap"]

_SKIP_WITH = ("cond", "select")


# --------------------------------------------------------------------------------------------
# Arguments.
# --------------------------------------------------------------------------------------------


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
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


def _check_scale(scale: Any) -> LossScale:
    if scale is None:
        return DynamicScale()
    if isinstance(scale, LossScale):
        return scale
    if isinstance(scale, type) and issubclass(scale, LossScale):
        raise TypeError(
            f"dynamic_scale must be a loss scale instance: pass jdls.{scale.__name__}(...), "
            f"not the class jdls.{scale.__name__}"
        )
    if isinstance(scale, optax.GradientTransformation):
        raise TypeError(
            "dynamic_scale must be a jdls loss scale, got an optax transformation; the "
            "optimizer is the first argument: jdls.wrap(optax.adam(1e-3), jdls.DynamicScale())"
        )
    if isinstance(scale, int | float | np.number) and not isinstance(scale, bool):
        raise TypeError(
            f"dynamic_scale must be a jdls loss scale, got the number {scale!r}: for a fixed "
            f"scale pass jdls.StaticScale({scale!r})"
        )
    raise TypeError(
        "dynamic_scale must be a jdls loss scale: jdls.DynamicScale(...), a jdls.presets "
        f"scale, jdls.StaticScale(...) or jdls.NoOpScale(); got {type(scale).__name__}"
    )


def _describe_mismatch(updates: Any, params: Any) -> str:
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


def _check_match(updates: Any, params: Any) -> None:
    if params is None:
        return
    ours: Any = jax.tree_util.tree_structure(updates)
    if ours != jax.tree_util.tree_structure(params):
        raise ValueError(
            "jdls.wrap: the gradients do not have the tree structure of the params ("
            + _describe_mismatch(updates, params)
            + "). Pass the gradients of the params given to tx.update."
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


# --------------------------------------------------------------------------------------------
# Skipping.
# --------------------------------------------------------------------------------------------


def _is_arrays(x: Any) -> bool:
    """Whether ``x`` is a non-empty pytree of arrays (an extra argument passed as an operand)."""
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(isinstance(v, jax.Array | np.ndarray) for v in leaves)


def _varying_axes(t: Any) -> frozenset[Any]:
    """The manual mesh axes a value varies over, inside ``shard_map`` (empty elsewhere)."""
    mat = getattr(t, "manual_axis_type", None)  # jax >= 0.9; ``vma`` before
    varying = getattr(mat, "varying", None) if mat is not None else getattr(t, "vma", None)
    return frozenset(varying or ())


def _vary_like(x: Any, like: Any) -> Any:
    """``x`` marked as varying over the axes ``like`` varies over (a no-op outside shard_map).

    Inside ``shard_map`` the two branches of ``lax.cond`` must agree on which outputs vary
    across devices; constants made by the skip branch do not, until marked.
    """
    if not isinstance(like, jax.ShapeDtypeStruct):
        like = jax.typeof(like)
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(jax.typeof(x)), key=str))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # type: ignore[attr-defined]  # pragma: no cover - older jax


def _skip_value(s: jax.ShapeDtypeStruct) -> jax.Array:
    """The update of a skipped step: -0.0, so that ``p + u`` is ``p`` bit for bit, even -0.0."""
    if s.dtype == jax.dtypes.float0:
        return np.zeros(s.shape, jax.dtypes.float0)  # type: ignore[return-value]
    if jnp.issubdtype(s.dtype, jnp.inexact):
        return _vary_like(jnp.full(s.shape, -0.0, s.dtype), s)
    return _vary_like(jnp.zeros(s.shape, s.dtype), s)


# --------------------------------------------------------------------------------------------
# The transformation.
# --------------------------------------------------------------------------------------------


def wrap(
    inner: optax.GradientTransformation,
    dynamic_scale: LossScale | None = None,
    *,
    max_norm: float | None = None,
    axis_name: AxisName | None = None,
    sharded: bool | Any | Callable[[Any], Any] | None = None,
    skip_with: str = "cond",
    track_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scaling around an optax transformation: skip non-finite steps, adjust.

    ``tx.update(grads, state, params)`` takes the **unscaled** gradients (as returned by
    ``scale.value_and_grad``, with ``scale = jdls.get_dynamic_scale(state)``) and

    1. decides whether they are all finite, from one sum of squares over every float leaf
       (exact: an overflowing sum of finite values is told apart from an inf; see
       :func:`jdls.clip`), which also gives the global norm;
    2. with ``max_norm``, clips them by that same global norm, as ``jdls.clip(max_norm)``
       (and ``optax.clip_by_global_norm``) would;
    3. applies ``inner`` only when they are finite (``lax.cond``); a skipped step returns zero
       updates (``-0.0``, so that ``optax.apply_updates`` leaves every parameter bit for bit
       as it was) and the inner state untouched, so the inner step count and any learning-rate
       schedule do not advance: a run with skipped steps ends bit-identical to a run that
       left those steps out;
    4. adjusts the scale with ``scale.adjust(finite)`` and records :class:`jdls.StepStats`.

    Any :class:`jdls.LossScale` works: with :class:`jdls.StaticScale` or
    :class:`jdls.NoOpScale` the scale never changes but non-finite steps are still skipped.
    Integer and boolean gradient leaves are passed to ``inner`` as they are and do not count
    for finiteness; ``None`` leaves are preserved; extra keyword arguments of ``update`` reach
    ``inner``.

    Clipping here is fused: the norm used to clip is the one that decided finiteness, and the
    clipping runs inside the update branch where XLA fuses it into ``inner``, so
    ``wrap(inner, max_norm=c)`` costs no more than ``wrap(inner)`` and gives the decisions
    of ``optax.chain(jdls.clip(c), wrap(inner))`` and, up to rounding, its updates. Like optax,
    gradients whose norm is ``norm >= c`` become ``g * c / norm``; Cerebras instead multiplies
    every gradient by ``min(c / (norm + 1e-6), 1)``, which differs by a relative ``1e-6 / norm``
    and shrinks gradients slightly even just below ``c``.

    Args:
      inner: the optax transformation to protect, e.g. ``optax.adam(1e-3)`` (objects with
        ``init``/``update`` methods, such as ``optax.MultiSteps``, work too).
      dynamic_scale: the initial loss scale; default ``jdls.DynamicScale()``.
      max_norm: clip the gradients to this global L2 norm (a finite number > 0). When None and
        ``dynamic_scale`` is a dynamic scale whose rule has ``max_gradient_norm`` (the
        Cerebras preset), that value is used.
      axis_name: inside ``pmap`` or ``shard_map``, the mapped axis across which every device
        must take the same decision (a ``pmax`` of the non-finite flag) and, with clipping,
        see the same global norm. Not needed under ``jax.jit`` with sharded arrays.
      sharded: with ``axis_name``: True when each device holds a different part of the
        gradients (``shard_map`` with sharded parameters: the squared norms are summed with
        ``psum``), False when each holds all of them (after ``lax.pmean``), or a pytree prefix
        of bools (or a function of the gradients returning one) for a mix. Required with
        ``axis_name`` when clipping; without clipping it only makes ``grad_norm`` known.
      skip_with: ``"cond"`` (default) runs ``inner`` only on finite steps; ``"select"`` always
        runs it and selects the result with ``jnp.where`` (see docs/optax.md for timings).
      track_nonfinite: record which gradient leaves held an inf or NaN
        (:func:`jdls.nonfinite_paths`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`jdls.WrapState`.

    Raises:
      TypeError: ``inner`` is not a transformation, or ``dynamic_scale`` not a loss scale.
      ValueError: a bad ``max_norm`` or ``skip_with``, or ``axis_name`` with clipping but no
        ``sharded``; at update time, gradients whose structure differs from the params.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdls
      >>> tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.adam(1e-3)))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> @jax.jit
      ... def step(params, state):
      ...     scale = jdls.get_dynamic_scale(state)
      ...     loss, grads = scale.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> params, state = step(params, state)
      >>> bool(jdls.stats(state).skipped), params["w"].tolist()
      (False, [0.9990000128746033, 0.9990000128746033, 0.9990000128746033])

    References:
      Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
      2018; ``torch.amp.GradScaler.step``; ``optax.apply_if_finite``.
    """
    inner_tx = _check_inner(inner)
    scale0 = _check_scale(dynamic_scale)
    if max_norm is None and isinstance(scale0, DynamicScale):
        max_norm = scale0.rule.max_gradient_norm
    if max_norm is not None:
        max_norm = _check_limit("max_norm", max_norm)
    _check_sharded(axis_name, sharded, max_norm is not None, "jdls.wrap")
    if skip_with not in _SKIP_WITH:
        raise ValueError(f"skip_with must be one of {_SKIP_WITH}, got {skip_with!r}")
    if not isinstance(track_nonfinite, bool):
        raise TypeError(f"track_nonfinite must be a bool, got {track_nonfinite!r}")

    def init_fn(params: Any) -> WrapState:
        nonfinite = None
        if track_nonfinite:
            nonfinite = jax.tree_util.tree_map(lambda _: jnp.zeros((), jnp.bool_), params)
        return WrapState(
            # A fresh copy: a donated state must not delete the arrays of ``scale0``.
            scale=jax.tree_util.tree_map(jnp.array, scale0),
            inner_state=inner_tx.init(params),
            stats=StepStats(
                finite=jnp.array(True),
                skipped_steps=jnp.zeros((), jnp.int32),
                consecutive_skips=jnp.zeros((), jnp.int32),
                grad_norm=jnp.full((), jnp.nan, jnp.float32),
                nonfinite=nonfinite,
            ),
        )

    @functools.lru_cache(maxsize=64)
    def branches(
        treedef: Any, float_idx: tuple[int, ...], static: tuple[tuple[str, Any], ...]
    ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        # The two branches of the update, built once per gradient structure so that lax.cond
        # finds them in its cache outside jit too. All arrays come in as operands.
        static_args = dict(static)

        def apply(operands: tuple[Any, ...]) -> tuple[Any, Any]:
            leaves, inner_state, params, n, dynamic = operands
            if max_norm is not None:
                # Inside the branch, so that XLA fuses the clipping into the inner update
                # instead of writing the clipped gradients out, and skipped steps skip it.
                leaves = _clip_by_norm(leaves, list(float_idx), n, max_norm, fused=True)
            grads = jax.tree_util.tree_unflatten(treedef, leaves)
            return inner_tx.update(grads, inner_state, params, **dynamic, **static_args)

        def skip(operands: tuple[Any, ...]) -> tuple[Any, Any]:
            shapes, state_shapes = jax.eval_shape(apply, operands)
            old_state = jax.tree_util.tree_map(_vary_like, operands[1], state_shapes)
            return jax.tree_util.tree_map(_skip_value, shapes), old_state

        return apply, skip

    def update_fn(
        updates: Any, state: WrapState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, WrapState]:
        if not isinstance(state, WrapState):
            raise TypeError(
                f"jdls.wrap's update expects its own WrapState, got {type(state).__name__}: "
                "pass the state returned by this transformation's init"
            )
        _check_match(updates, params)

        # 1. Check: one sum of squares gives finiteness and the global norm.
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        float_idx = [i for i, x in enumerate(leaves) if _is_float(x)]
        leaves = [jnp.asarray(x) if i in float_idx else x for i, x in enumerate(leaves)]
        flags = _sharded_flags(sharded, updates)
        n = _global_norm(
            [leaves[i] for i in float_idx],
            axis_name=axis_name,
            sharded=None if flags is None else [flags[i] for i in float_idx],
            per_leaf=track_nonfinite,
        )
        finite = n.finite
        rule = getattr(state.scale, "rule", None)
        if rule is not None and rule.finite_from_norm:
            finite = finite & ~n.robust  # Cerebras: the float32 norm itself must be finite

        # 2-3. Clip with the same norm and update, only if finite.
        dynamic = {k: v for k, v in extra_args.items() if _is_arrays(v)}
        static = tuple(sorted((k, v) for k, v in extra_args.items() if k not in dynamic))
        try:
            apply, skip = branches(treedef, tuple(float_idx), static)
        except TypeError:  # an unhashable static argument: build the branches uncached
            apply, skip = branches.__wrapped__(treedef, tuple(float_idx), static)
        operands = (leaves, state.inner_state, params, n, dynamic)
        if skip_with == "cond":
            new_updates, inner_state = lax.cond(finite, apply, skip, operands)
        else:
            computed, computed_state = apply(operands)
            new_updates = jax.tree_util.tree_map(
                lambda u: jnp.where(finite, u, _skip_value(u)), computed
            )
            inner_state = jax.tree_util.tree_map(
                lambda new, old: jnp.where(finite, new, old).astype(new.dtype),
                computed_state,
                state.inner_state,
            )

        # 4. Adjust the scale, record the step.
        nonfinite = None
        if track_nonfinite:
            assert n.leaf_nonfinite is not None
            per_leaf: list[Any] = [jnp.zeros((), jnp.bool_)] * len(leaves)
            for k, i in enumerate(float_idx):
                per_leaf[i] = n.leaf_nonfinite[k]
            nonfinite = jax.tree_util.tree_unflatten(treedef, per_leaf)
        old = state.stats
        new_stats = StepStats(
            finite=finite,
            skipped_steps=jnp.where(
                finite, old.skipped_steps, optax.safe_increment(old.skipped_steps)
            ),
            consecutive_skips=jnp.where(finite, 0, optax.safe_increment(old.consecutive_skips)),
            grad_norm=n.norm.astype(jnp.float32),
            nonfinite=nonfinite,
        )
        return new_updates, WrapState(state.scale.adjust(finite), inner_state, new_stats)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
