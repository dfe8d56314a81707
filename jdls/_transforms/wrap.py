"""``jdls.wrap``: dynamic loss scaling as an optax transformation.

One train step, top to bottom::

    scale = jdls.get_scale(opt_state)                            # the scale for this step
    loss, grads = scale.value_and_grad(loss_fn)(params, batch)   # scale, differentiate, unscale
    updates, opt_state = tx.update(grads, opt_state, params)     # decide, apply or skip, record
    params = optax.apply_updates(params, updates)

Inside ``tx.update``: one exact sum of squares (with the largest magnitude, for the default
rule) decides finiteness and gives the global norm
(``jdls/_numerics/norm.py``); the inner update runs only on finite steps (``jdls/_transforms/skip.py`` builds what a
skipped step returns); then the scale is adjusted and the step recorded (``jdls/_transforms/stats.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdls._numerics.checks import all_finite, check_int, check_limit
from jdls._numerics.handoff import (
    backward_amax,
    backward_loss_nonzero,
    nonzero,
    recall,
    recall_largest,
)
from jdls._numerics.leaves import FloatLeaves, check_sharded, flatten_floats
from jdls._numerics.norm import AxisName, GlobalNorm, clip_by_norm, tree_norm
from jdls._numerics.scalars import one_kernel, pick
from jdls._scales.filter import non_array_hint
from jdls._scales.scale import (
    AdaptiveScale,
    LossScale,
    adjust_observed,
    check_scale,
    observes,
)
from jdls._sites.apart import sites_apart
from jdls._transforms.retry import SkipCause, classify, flushed, model_overflow
from jdls._transforms.skip import cond_branches, keep_dtypes, select
from jdls._transforms.stats import Stats, WrapState, step_applied
from jdls._transforms.wrap_arguments import check_inner, check_match, check_wrap_state, is_arrays

__all__ = ["FLUSHED", "loss_nonzero", "wrap"]

#: The extra argument of a wrap's ``update`` by which :func:`jdls.wrap_groups` tells each
#: group's wrap (which runs at no scale of its own) that the shared scale skips the step as
#: ``jdls.SkipCause.UNDERFLOW``; never passed on to the inner transformation.
FLUSHED = "jdls_flushed"

_SKIP_WITH = ("cond", "select")

_RETRIES_MOVED = (
    "{} is gone: retries moved to a train step that owns differentiation and the update, so "
    "that a retried step equals the direct one through the whole optimizer and on every "
    "device layout: step = jdls.retrying(loss_fn, tx, retries=2), then "
    "params, opt_state, loss = step(params, opt_state, *batch) (docs/guides/retries.md)"
)


def wrap(
    inner: optax.GradientTransformation,
    scale: LossScale | None = None,
    *,
    max_norm: float | None = None,
    skip_norm_overflow: bool = False,
    axis_name: AxisName | None = None,
    sharded: bool | Any | Callable[[Any], Any] | None = None,
    skip_with: str = "cond",
    track_nonfinite: bool = False,
    max_consecutive_skips: int | None = None,
    retries: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scaling around an optax transformation: skip non-finite steps, adjust.

    ``tx.update(grads, state, params)`` takes the **unscaled** gradients (as returned by
    ``scale.value_and_grad``, with ``scale = jdls.get_scale(state)``) and

    1. decides whether they are all finite, from one sum of squares over every float leaf
       (exact: an overflowing sum of finite values is told apart from an inf, by the largest
       magnitude for a rule that measures it, else by a second pass; see :func:`jdls.clip`),
       which also gives the global norm;
    2. with ``max_norm``, clips them by that same global norm, as ``jdls.clip(max_norm)``
       (and ``optax.clip_by_global_norm``) would;
    3. applies ``inner`` only when they are finite (``lax.cond``); a skipped step returns zero
       updates (``-0.0``, so that ``optax.apply_updates`` leaves every parameter bit for bit
       as it was) and the inner state untouched, so the inner step count and any learning-rate
       schedule do not advance: a run with skipped steps ends bit-identical to a run that
       left those steps out;
    4. adjusts the scale with ``scale.adjust(finite)`` and records :class:`jdls.Stats`.

    A step whose gradients are all zero while its loss is not (given as ``value``, or
    differentiated by the scale's own ``value_and_grad`` in the same trace), before the rule
    has measured anything (:meth:`jdls.rules.Rule.looks_for_flushed`: the default
    :func:`jdls.AdaptiveScale` at its start), is skipped too, ``SkipCause.UNDERFLOW``: its
    gradients flushed, and the rule raises the scale to look for them (docs/adaptive.md).

    Any :class:`jdls.LossScale` works (a static or no-op scale never changes, but non-finite
    steps are still skipped). Integer and boolean leaves pass to ``inner`` as they are; extra
    keyword arguments of ``update`` reach ``inner``. Clipping with ``max_norm`` is fused into
    the update branch: it costs no more than ``wrap(inner)`` and takes the decisions of
    ``optax.chain(jdls.clip(c), wrap(inner))`` (docs/optax.md has the measurements).

    Args:
      inner: the optax transformation to protect, e.g. ``optax.adam(1e-3)`` (objects with
        ``init``/``update`` methods, such as ``optax.MultiSteps``, work too).
      scale: the initial loss scale; default ``jdls.AdaptiveScale()`` (the scale
        follows the gradients it measures; ``jdls.DynamicScale()`` for the classic rule).
      max_norm: clip the gradients to this global L2 norm (a finite number > 0).
      skip_norm_overflow: also skip a step whose gradients are all finite but whose float32
        global norm overflows, as Cerebras does (``jdls.presets.cerebras_wrap`` sets it).
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
      max_consecutive_skips: fail loudly (a ``FloatingPointError`` raised from the step,
        surfacing as a ``JaxRuntimeError`` that quotes it) once this many steps in a row were
        skipped, naming the likely causes; None (default) never fails.
      retries: no longer here: retries moved to :func:`jdls.retrying`, a train step that
        owns differentiation and the update; any value but 0 raises a ``TypeError`` that
        says so.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`jdls.WrapState`.

    Raises:
      TypeError: ``inner`` is not a transformation, or ``scale`` not a loss scale.
      ValueError: a bad ``max_norm`` or ``skip_with``, or ``axis_name`` with clipping but no
        ``sharded``; at update time, gradients whose structure differs from the params.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdls
      >>> tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.adam(1e-3)))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> @jax.jit
      ... def step(params, state):
      ...     scale = jdls.get_scale(state)
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
    inner_tx = check_inner(inner)
    scale0 = AdaptiveScale() if scale is None else check_scale(scale, wrapping=True)
    if max_norm is not None:
        max_norm = check_limit("max_norm", max_norm)
    check_sharded(axis_name, sharded, max_norm is not None, "jdls.wrap")
    if max_consecutive_skips is not None:
        max_consecutive_skips = check_int("max_consecutive_skips", max_consecutive_skips, 1)
    if retries != 0:
        raise TypeError(_RETRIES_MOVED.format(f"jdls.wrap(..., retries={retries!r})"))
    if skip_with not in _SKIP_WITH:
        raise ValueError(f"skip_with must be one of {_SKIP_WITH}, got {skip_with!r}")
    for name, flag in (
        ("skip_norm_overflow", skip_norm_overflow),
        ("track_nonfinite", track_nonfinite),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")

    def init_fn(params: Any) -> WrapState:
        hint = non_array_hint(params, "jdls.wrap: the params given to tx.init")
        if hint:
            raise TypeError(hint)
        nonfinite = None
        if track_nonfinite:
            nonfinite = jax.tree_util.tree_map(lambda _: jnp.zeros((), jnp.bool_), params)
        return WrapState(
            # A fresh copy: a donated state must not delete the arrays of ``scale0``.
            scale=jax.tree_util.tree_map(jnp.array, scale0),
            inner_state=inner_tx.init(params),
            stats=Stats(
                finite=jnp.array(True),
                skipped_steps=jnp.zeros((), jnp.int32),
                consecutive_skips=jnp.zeros((), jnp.int32),
                # 0, not NaN, before the first step: a NaN constant trips jax_debug_nans.
                grad_norm=jnp.zeros((), jnp.float32),
                nonfinite=nonfinite,
                retries=jnp.zeros((), jnp.int32),
                cause=jnp.zeros((), jnp.int32),
                retried_steps=jnp.zeros((), jnp.int32),
            ),
        )

    @functools.lru_cache(maxsize=64)
    def apply_branch(
        treedef: Any, float_idx: tuple[int, ...], static: tuple[tuple[str, Any], ...]
    ) -> Callable[[tuple[Any, ...]], tuple[Any, Any]]:
        # Built once per gradient structure, so that lax.cond finds it in its cache outside
        # jit too. Every array comes in as an operand.
        def apply(operands: tuple[Any, ...]) -> tuple[Any, Any]:
            leaves, inner_state, params, n, dynamic = operands
            tree = FloatLeaves(leaves, treedef, float_idx)
            if max_norm is not None:  # in the branch: fused into inner, skipped steps skip it
                tree = clip_by_norm(tree, n, max_norm, fused=True)
            grads = tree.unflatten()
            updates, new_state = inner_tx.update(
                grads, inner_state, params, **dynamic, **dict(static)
            )
            return updates, keep_dtypes(new_state, inner_state)

        return apply

    def update_or_skip(
        tree: FloatLeaves,
        inner_state: Any,
        params: Any,
        clipped: GlobalNorm,
        finite: jax.Array,
        extra_args: dict[str, Any],
    ) -> tuple[Any, Any]:
        """The inner update on a finite step; on a skipped one, ``-0.0`` updates and the inner
        state as it was. ``clipped`` is the norm ``max_norm`` clips by."""
        dynamic = {k: v for k, v in extra_args.items() if is_arrays(v)}
        static = tuple(sorted((k, v) for k, v in extra_args.items() if k not in dynamic))
        try:
            apply = apply_branch(tree.treedef, tree.float_idx, static)
        except TypeError:  # an unhashable static argument: build the branch uncached
            apply = apply_branch.__wrapped__(tree.treedef, tree.float_idx, static)
        operands = (tree.leaves, inner_state, params, clipped, dynamic)
        if skip_with == "cond":
            return lax.cond(finite, *cond_branches(apply), operands)
        return select(finite, apply(operands), inner_state)

    def update_fn(
        updates: Any, state: WrapState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, WrapState]:
        check_wrap_state(state)
        check_match(updates, params)
        if "value_fn" in extra_args:
            raise TypeError(_RETRIES_MOVED.format("tx.update(..., value_fn=...)"))
        underflow = extra_args.pop(FLUSHED, None)  # decided by jdls.wrap_groups' shared scale
        tree = flatten_floats(updates)
        n, clipped = _measure(
            tree, state.scale, axis_name, sharded, track_nonfinite, max_norm is not None
        )
        finite, loss_finite = _decide(n, skip_norm_overflow, extra_args, axis_name)
        if underflow is None and observes(state.scale) and n.amax is not None:
            nonzero_loss = loss_nonzero(state.scale, extra_args, axis_name)
            underflow = flushed(state.scale, finite, n.amax, nonzero_loss)
        taken = finite if underflow is None else finite & ~underflow
        new_updates, inner_state = update_or_skip(
            tree, state.inner_state, params, clipped, taken, extra_args
        )
        scale = adjust_observed(state.scale, finite, lambda: n.amax)
        cause = model_overflow(classify(finite, loss_finite), state.scale, scale)
        if underflow is not None:
            cause = pick(underflow, jnp.int32(SkipCause.UNDERFLOW), cause)
        stats = _record(state.stats, taken, n, tree, jnp.int32(0), cause)
        if max_consecutive_skips is not None:
            _fail_if_stuck(stats.consecutive_skips, max_consecutive_skips)
        return new_updates, WrapState(scale, inner_state, stats, state.sites)

    # Sites among the parameters (per-layer scales, probes, FP8 state): never given to the
    # inner optimizer, never clipped or in the norm; each updated by its kind, skip-aware
    # (with optax.MultiSteps inside: once per applied step, not per micro-batch).
    init, update = sites_apart(init_fn, update_fn, step_applied, _hold)
    return optax.GradientTransformationExtraArgs(init, update)


def _hold(state: WrapState, sites: tuple[Any, ...]) -> WrapState:
    return state._replace(sites=sites)


def _measure(
    tree: FloatLeaves,
    scale: LossScale,
    axis_name: AxisName | None,
    sharded: Any,
    per_leaf: bool,
    clipping: bool = False,
) -> tuple[GlobalNorm, GlobalNorm]:
    """What the decision, the rule and the statistics see, and the norm of the gradients given
    (what ``max_norm`` clips by). One sum of squares gives finiteness and the global norm,
    and for a rule that observes the largest magnitude. A ``jdls.clip`` right in front hands
    over what it measured before clipping; else, for a rule that observes, the largest
    magnitude is that of the gradients ``scale.value_and_grad`` returned
    (jdls/_numerics/handoff.py): the rule and the statistics see the backward pass. Given the
    gradients of per-layer scales, the largest magnitude their layers measured decides
    finiteness with the sum of squares: no reduction for it, no second pass compiled."""
    largest = observes(scale)
    # per-layer scales measured the largest magnitude of these very gradients already
    known = recall_largest(tree.floats)
    decides = largest or known is not None  # a largest magnitude beside the sum of squares
    given = tree_norm(
        tree,
        axis_name=axis_name,
        sharded=sharded,
        per_leaf=per_leaf,
        largest=decides,
        # the largest magnitude decides finiteness on its own; only clipping needs the norm
        # of an overflowing sum of squares
        exact_overflow=clipping or per_leaf or not decides,
        known_largest=known,
    )
    handed = recall(tree.floats, axis_name)
    if handed is not None:
        seen = given._replace(
            norm=handed.norm, robust=handed.robust, amax=handed.amax if largest else None
        )
        return seen, given
    if largest:
        amax = backward_amax(scale.loss_scale, tree.floats, given.amax, axis_name)
        return given._replace(amax=amax), given
    given = given._replace(amax=None)  # it decided finiteness; the rule observes nothing
    return given, given


def loss_nonzero(
    scale: LossScale, extra_args: dict[str, Any], axis_name: AxisName | None
) -> jax.Array | None:
    """Whether the step's loss was finite and not zero on some device: the loss given as
    ``value``, else the one ``scale.value_and_grad`` differentiated in this trace
    (jdls/_numerics/handoff.py); None where neither is known."""
    if "value" in extra_args:
        found: jax.Array | None = nonzero(extra_args["value"])
    else:
        found = backward_loss_nonzero(scale.loss_scale)
    if found is not None and axis_name is not None:
        found = lax.pmax(found.astype(jnp.int32), axis_name) > 0
    return found


def _decide(
    n: GlobalNorm, skip_norm_overflow: bool, extra_args: dict[str, Any], axis_name: AxisName | None
) -> tuple[jax.Array, jax.Array]:
    """Whether the step is applied, and whether the loss was finite: the gradients are finite
    (and, with ``skip_norm_overflow``, so is their float32 norm), and so is a loss given as
    ``value`` (optax's extra argument)."""
    finite = n.finite & ~n.robust if skip_norm_overflow else n.finite
    loss_finite = jnp.array(True)
    if "value" in extra_args:
        loss_finite = _finite_value(extra_args["value"], axis_name)
        finite = finite & loss_finite
    return finite, loss_finite


def _record(
    old: Stats,
    finite: jax.Array,
    n: GlobalNorm,
    tree: FloatLeaves,
    retries: jax.Array,
    cause: jax.Array,
) -> Stats:
    """The statistics of this step, their counters computed in one kernel."""
    nonfinite = None
    if n.leaf_nonfinite is not None:
        per_leaf: list[Any] = [jnp.zeros((), jnp.bool_)] * len(tree.leaves)
        for k, i in enumerate(tree.float_idx):
            per_leaf[i] = n.leaf_nonfinite[k]
        nonfinite = jax.tree_util.tree_unflatten(tree.treedef, per_leaf)
    return one_kernel(
        Stats(
            finite=finite,
            skipped_steps=pick(finite, old.skipped_steps, optax.safe_increment(old.skipped_steps)),
            consecutive_skips=pick(finite, 0, optax.safe_increment(old.consecutive_skips)),
            grad_norm=n.norm.astype(jnp.float32),
            nonfinite=nonfinite,
            retries=retries,
            cause=cause,
            retried_steps=pick(
                retries > 0, optax.safe_increment(old.retried_steps), old.retried_steps
            ),
        )
    )


def _finite_value(value: Any, axis_name: AxisName | None) -> jax.Array:
    """Whether every float leaf of the ``value`` extra argument is finite, on every device."""
    ok = all_finite(value)
    if axis_name is not None:
        ok = lax.pmin(ok.astype(jnp.int32), axis_name) > 0
    return ok


def _fail_if_stuck(consecutive: jax.Array, limit: int) -> None:
    def fail(count: Any) -> None:
        raise FloatingPointError(
            f"jdls.wrap skipped {int(count)} steps in a row (max_consecutive_skips={limit}). "
            "Likely causes: the loss was scaled with a scale built outside the step instead "
            "of jdls.get_scale(opt_state); scaled gradients were passed to tx.update (use "
            "scale.value_and_grad, which unscales); optax.MultiSteps(jdls.wrap(...)) kept a "
            "NaN in its accumulator (use jdls.wrap(optax.MultiSteps(...))); the data or "
            "the parameters hold an inf or NaN (jdls.nonfinite_paths names the leaves); or "
            "the model overflows by itself at any scale (jdls.skip_cause(opt_state) is "
            "jdls.SkipCause.MODEL: compute the overflowing part in float32)."
        )

    def report() -> None:
        jax.debug.callback(fail, consecutive)

    lax.cond(consecutive >= limit, report, lambda: None)
