"""``jdls.retrying``: a train step that recomputes an overflowing step at a lower scale.

The step owns differentiation and the update, so that a retried step is, through the whole
optimizer, the step taken directly at the backed-off scale with the same batch::

    scale = jdls.get_scale(opt_state)
    params, opt_state = step(params, opt_state at scale)   # the step without retries
    while the wrap skipped it for overflowing gradients, the loss is finite,
            tries < retries and scale > its minimum:
        scale = scale.back_off()                           # lower, as the rule backs off
        params, opt_state = step(params, opt_state at scale)   # the same batch, the same inputs
    # (grads all zero, the loss not, before the rule's first measurement: they flushed, and
    # the step is recomputed the same way at the higher scale the rule looks at)

Every attempt, the first included, is one iteration of a single ``lax.while_loop`` whose body
is the whole step without retries: differentiation, the whole chain (clipping before the wrap,
transformations after it, ``inject_hyperparams``, ``MultiSteps`` inside the wrap) and the
update. A finite step is therefore the step without retries, compiled in a loop of one
iteration: its fusions, its reads of the gradients (the wrap decides whether to retry from
the measurement it takes anyway) and its temporaries. A skipped attempt is a no-op through the
chain, so the next one starts from the same parameters and state (the loop's carry, updated
in place: nothing is copied on a finite step), with the statistics and the sites the skip
recorded put back as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdls._numerics.axes import vary_like, vary_over
from jdls._numerics.checks import all_finite, check_int
from jdls._numerics.norm import AxisName
from jdls._scales.scale import DynamicScale, LossScale, observes
from jdls._sites.site import is_site
from jdls._transforms.apply import apply_updates
from jdls._transforms.retry import SkipCause, mean_unsharded
from jdls._transforms.stats import (
    Stats,
    WrapState,
    get_scale,
    stats,
)

__all__ = ["retrying"]


def retrying(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    retries: int = 2,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
    sharded: bool | None = None,
) -> Callable[..., tuple[Any, Any, Any]]:
    """A train step that never drops a batch because the loss scale was too high.

    ``step = jdls.retrying(loss_fn, tx, retries=2)`` returns
    ``step(params, opt_state, *batch) -> (params, opt_state, loss)`` that

    1. takes the step without retries: differentiates ``loss_fn(params, *batch)`` at the
       scale of the one :func:`jdls.wrap` in ``tx`` (``jdls.get_scale(opt_state)``), runs
       ``tx.update(grads, opt_state, params, value=loss)`` and applies the updates;
    2. while the wrap skipped that step for gradients that were not finite, the loss is
       finite, fewer than ``retries`` attempts were made and the scale is above the rule's
       minimum, backs the scale off as the rule does (``scale.back_off()``: one overflow, or
       with hysteresis as many as lower the scale) and takes the step again from the same
       parameters and state with the same batch, inside the compiled step
       (``lax.while_loop``; a finite step takes one iteration, its first attempt); at the
       minimum a retry would recompute the same overflow, so the step is skipped instead;
       gradients that are all zero while the loss is not, before the rule's first
       measurement (they flushed, ``jdls.SkipCause.UNDERFLOW``), are recomputed the same
       way at the scale the rule looks at (:meth:`jdls.rules.Rule.looks_for_flushed`).

    A retried step is therefore, bit for bit, the step taken directly at the backed-off scale
    with the same batch, through the whole of ``tx``: ``jdls.wrap`` alone or with
    ``max_norm``, ``optax.chain(jdls.clip(...), jdls.wrap(...))``, transformations after the
    wrap, ``inject_hyperparams`` and ``jdls.wrap(optax.MultiSteps(...))``. A step whose loss
    is not finite is never retried (a lower scale cannot help): it is skipped, with cause
    ``FORWARD``. ``jdls.stats(opt_state)`` records ``retries``, ``retried_steps`` and, for a
    skipped step, ``cause`` (``BACKWARD``: the gradients still overflowed after the retries).

    Args:
      loss_fn: ``loss_fn(params, *batch)``, this batch's **unscaled** loss (a float scalar),
        or ``(loss, aux)`` with ``has_aux``. Under ``shard_map`` or ``pmap``: this device's
        loss, not averaged across devices (the step averages the gradients).
      tx: the optimizer, holding exactly one :func:`jdls.wrap` with a
        :class:`jdls.DynamicScale` (or a preset).
      retries: the most recomputations per step (>= 0; 0 is the plain step).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns ``(loss, aux)`` of the
        attempt applied (the same as the first attempt's: the forward pass does not depend
        on the scale).
      axis_name: inside ``shard_map`` or ``pmap``, the data-parallel axis: every device
        differentiates its own loss and the gradients are averaged with ``lax.pmean`` (as in
        the step without retries), and every device takes the same retry decisions. Give
        ``jdls.wrap`` the same ``axis_name``.
      sharded: only None or False: parameters sharded across ``axis_name`` inside
        ``shard_map`` (FSDP, ZeRO) are refused, since their gradients are reduced inside the
        backward pass, not averaged by the step; shard them with ``jax.jit`` and
        ``NamedSharding`` instead (no ``axis_name``), where the retried step is exact.

    Returns:
      ``step(params, opt_state, *batch)`` returning ``(params, opt_state, loss)`` (or
      ``(params, opt_state, (loss, aux))``); jit it, donating ``params`` and ``opt_state``.

    Raises:
      TypeError: ``tx`` is not an optax transformation, or ``loss_fn`` not callable.
      ValueError: a negative ``retries`` or ``sharded=True``; at trace time, ``tx`` holds no
        wrap or several, its scale cannot back off, the wrap sits inside ``optax.MultiSteps``
        (use ``jdls.wrap(optax.MultiSteps(...))``), or, under ``shard_map`` with
        ``check_vma``, a parameter varies across ``axis_name`` (sharded) or ``loss_fn``
        returned a loss already averaged across ``axis_name``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdls
      >>> def loss_fn(params, x):   # float16 compute: the scaled backward is x * scale
      ...     w = params["w"].astype(jnp.float16)
      ...     return jnp.sum((w * x.astype(jnp.float16)).astype(jnp.float32))
      >>> tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.sgd(0.1), jdls.DynamicScale(2.0**15)))
      >>> step = jax.jit(jdls.retrying(loss_fn, tx, retries=2))
      >>> params = {"w": jnp.ones(3)}
      >>> params, state, loss = step(params, tx.init(params), jnp.array([3.0, 1.0, 0.5]))
      >>> int(jdls.stats(state).retries), float(jdls.get_scale(state).loss_scale)
      (1, 16384.0)
    """
    retries = check_int("retries", retries, 0)
    if sharded not in (None, False):
        raise ValueError(
            f"jdls.retrying(sharded={sharded!r}): parameters sharded across axis_name inside "
            "shard_map are not supported (their gradients are reduced inside the backward "
            "pass); shard them with jax.jit and NamedSharding instead, without axis_name"
        )
    if not isinstance(tx, optax.GradientTransformation) and not (
        callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))
    ):
        raise TypeError(
            f"jdls.retrying(loss_fn, tx): tx must be an optax transformation holding a "
            f"jdls.wrap, got {type(tx).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(f"jdls.retrying(loss_fn, tx): loss_fn must be callable, got {loss_fn!r}")
    update = (
        optax.with_extra_args_support(tx).update
        if isinstance(tx, optax.GradientTransformation)
        else tx.update
    )

    def agree(ok: jax.Array) -> jax.Array:
        """The same bool on every device: all of them ok."""
        ok = jnp.asarray(ok)
        return ok if axis_name is None else lax.pmin(ok.astype(jnp.int32), axis_name) > 0

    def step(params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
        scale = _check_state(opt_state, retries)

        def differentiate(p: Any, s: LossScale) -> tuple[Any, Any]:
            """The loss and the averaged gradients of ``p`` at ``s``, as the step without
            retries computes them."""
            p = _per_device(p, axis_name)
            out, grads = s.value_and_grad(loss_fn, has_aux=has_aux)(p, *batch)
            if axis_name is not None:
                _check_not_averaged(out[0] if has_aux else out, p, axis_name)
            return out, mean_unsharded(grads, axis_name, False)

        def take(p: Any, state: Any) -> tuple[Any, Any, Any]:
            """One whole step from ``p`` and ``state`` at the scale ``state`` holds: the
            step without retries. A step the wrap skipped is a no-op through the whole
            chain: transformations after the wrap (weight decay, a schedule's count) and
            their states do not move either. Sites keep what their kinds made of the step
            (a probe records a skipped step too)."""
            out, grads = differentiate(p, get_scale(state))
            loss = out[0] if has_aux else out
            updates, new_state = update(grads, state, p, value=loss)
            new_p = apply_updates(p, updates, new_state)
            applied = stats(new_state).finite
            new_p = jax.tree_util.tree_map(
                lambda new, old: new if is_site(new) else jnp.where(applied, new, old),
                new_p,
                p,
                is_leaf=is_site,
            )
            new_state = jax.tree_util.tree_map(
                lambda new, old: (
                    new if isinstance(new, WrapState) else jnp.where(applied, new, old)
                ),
                new_state,
                state,
                is_leaf=lambda x: isinstance(x, WrapState),
            )
            return new_p, new_state, out

        before = stats(opt_state)
        if not retries:
            new_params, new_state, out = take(params, opt_state)
            return new_params, _record(new_state, before, jnp.zeros((), jnp.int32)), out

        def given(p: Any, state: Any, s: LossScale) -> tuple[Any, Any]:
            """The step's own inputs at scale ``s``: a skipped attempt leaves the parameters
            and the optimizer state as they were (``p``, ``state``) except for what it
            records, the sites and the wrap's statistics, which are put back."""
            p = jax.tree_util.tree_map(
                lambda now, was: was if is_site(was) else now, p, params, is_leaf=is_site
            )
            state = jax.tree_util.tree_map(
                lambda now, was: (
                    now._replace(scale=s, stats=was.stats, sites=was.sites)
                    if isinstance(now, WrapState)
                    else now
                ),
                state,
                opt_state,
                is_leaf=lambda x: isinstance(x, WrapState),
            )
            return p, state

        def more(carry: tuple[Any, ...]) -> jax.Array:
            *_, n, again, _ = carry
            return (n == 0) | (again & (n <= retries))

        def attempt(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            s, p, state, _, n, _, look = carry
            # After the first attempt, each one at the scale the rule backs off to (with
            # hysteresis, after the overflows it would forgive: a lower scale every time),
            # or, after gradients that all flushed, at the scale it looks at.
            s = jax.tree_util.tree_map(
                lambda now, lower: jnp.where(n == 0, now, lower), s, _next_scale(s, look)
            )
            p, state, out = take(*given(p, state, s))
            taken = stats(state)
            loss = out[0] if has_aux else out
            loss_finite = agree(all_finite(loss))
            look = taken.cause == SkipCause.UNDERFLOW
            # At the rule's minimum the scale cannot go lower: a retry would recompute the
            # same overflow, so the step is skipped instead.
            lower = s.back_off().loss_scale < s.loss_scale
            overflow = ~taken.finite & ~look & loss_finite & lower
            again = overflow | look
            return s, p, state, out, n + 1, again, look

        shapes = jax.eval_shape(lambda: differentiate(params, scale)[0])
        out = jax.tree_util.tree_map(lambda t: vary_like(jnp.zeros_like(t), t), shapes)
        no = jnp.array(False)
        carry = (scale, params, opt_state, out, jnp.int32(0), no, no)
        _, new_params, new_state, out, n, _, _ = lax.while_loop(more, attempt, carry)
        return new_params, _record(new_state, before, n - 1), out

    return step


def _next_scale(scale: DynamicScale, look: jax.Array) -> DynamicScale:
    """The scale of the next attempt: where the rule looks for gradients that all flushed
    (``look``: an all-zero step, ``jdls.SkipCause.UNDERFLOW``), else where it backs off."""
    lower = scale.back_off()
    if not observes(scale):
        return lower
    higher = scale.adjust(True, grad_amax=jnp.zeros((), jnp.float32))
    return jax.tree_util.tree_map(lambda h, b: jnp.where(look, h, b), higher, lower)


def _check_state(opt_state: Any, retries: int) -> LossScale:
    """The scale of the one wrap in ``opt_state``, after refusing the shapes a retry cannot
    make exact."""
    scale = get_scale(opt_state)  # raises without exactly one wrap
    if retries and not isinstance(scale, DynamicScale):
        raise ValueError(
            f"jdls.retrying(retries={retries}) needs a scale that backs off (jdls.DynamicScale "
            f"or a preset); the wrap's {type(scale).__name__} would retry at the same scale"
        )
    found = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState | WrapState)
    )
    for x in found:
        if isinstance(x, optax.MultiStepsState) and any(
            isinstance(y, WrapState)
            for y in jax.tree_util.tree_leaves(
                x.inner_opt_state, is_leaf=lambda y: isinstance(y, WrapState)
            )
        ):
            raise ValueError(
                "jdls.retrying: the jdls.wrap sits inside optax.MultiSteps, which decides and "
                "adjusts the scale only every k-th micro-batch, so a retried micro-batch "
                "cannot equal the direct one; put MultiSteps inside the wrap: "
                "jdls.wrap(optax.MultiSteps(optax.adam(1e-3), k), scale)"
            )
    return scale


def _per_device(params: Any, axis_name: AxisName | None) -> Any:
    """``params`` marked as varying over ``axis_name`` (``shard_map`` with ``check_vma``), so
    that each device differentiates its own loss: otherwise JAX sums the per-device gradients
    of replicated parameters inside the backward pass. A no-op elsewhere."""
    if axis_name is None:
        return params
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def vary(path: Any, x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        have = _varying(x)
        if any(a in have for a in axes):
            raise ValueError(
                f"jdls.retrying(axis_name={axis_name!r}): the parameter at "
                f"{jax.tree_util.keystr(path) or '<root>'} varies across {axis_name!r} "
                "(sharded inside shard_map), whose gradients the backward pass reduces, so "
                "the step cannot average them as the direct step does; pass the parameters "
                "replicated (in_specs P()), or shard them with jax.jit and NamedSharding "
                "(no axis_name)"
            )
        return vary_over(x, axes)

    return jax.tree_util.tree_map_with_path(vary, params)


def _varying(x: Any) -> frozenset[Any]:
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    varying = getattr(mat, "varying", None) if mat is not None else getattr(t, "vma", None)
    return frozenset(varying or ())


def _check_not_averaged(loss: Any, params: Any, axis_name: AxisName) -> None:
    """Under ``shard_map`` with ``check_vma``: a loss that does not vary across the axis while
    the parameters do was already averaged (``lax.pmean``) inside ``loss_fn``."""
    axes = set(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    if not any(axes <= _varying(p) for p in jax.tree_util.tree_leaves(params)):
        return  # no type information (pmap, check_vma=False)
    if not axes <= _varying(loss):
        raise ValueError(
            f"jdls.retrying(axis_name={axis_name!r}): loss_fn returned a loss that does not vary "
            f"across {axis_name!r}, so it was already reduced across devices (lax.pmean or "
            "psum); return this device's own loss: the step averages the gradients"
        )


def _record(opt_state: Any, before: Stats, tries: jax.Array) -> Any:
    """The wrap's statistics with the retries of this step."""

    def patch(x: Any) -> Any:
        if not isinstance(x, WrapState):
            return x
        s = x.stats
        cause = jnp.where(
            s.cause == SkipCause.GRADIENTS, jnp.int32(SkipCause.BACKWARD), s.cause
        ).astype(s.cause.dtype)
        return x._replace(
            stats=s._replace(
                retries=tries,
                cause=cause,
                retried_steps=jnp.where(
                    tries > 0, optax.safe_increment(before.retried_steps), before.retried_steps
                ),
            )
        )

    return jax.tree_util.tree_map(patch, opt_state, is_leaf=lambda x: isinstance(x, WrapState))
