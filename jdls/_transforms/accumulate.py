"""Gradient accumulation over micro-batches inside one step, each micro-batch checked on its own.

``jdls.accumulate`` runs a ``lax.scan`` over the micro-batches of one step. Each micro-batch's
loss and gradients are computed at the current scale and checked; with ``retries``, a
micro-batch whose gradients overflow while its loss is finite is recomputed at lower scales,
as ``jdls.retrying`` does for a whole step. A micro-batch that
is still not finite is **dropped**: it never enters the sum, and the divisor is the number of
micro-batches kept. Every failed attempt counts for the scale's rule as the overflows that
lower the scale (``scale.back_off()``: one, or with hysteresis also those it would forgive),
and a dropped micro-batch as one overflow, so the scale backs off within the step as feeding
the micro-batches one by one to ``jdls.wrap(optax.MultiSteps(...))`` would. When more than
``max_dropped`` micro-batches were dropped, the returned gradients are NaN, so that
``jdls.wrap`` skips the step; its back-off for the skip stands for the last dropped
micro-batch's, so that a step backs off once per overflow, as with ``MultiSteps`` (and, with
the defaults, once per skipped step, as PyTorch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax

from jdls._numerics.axes import agree, vary_like
from jdls._numerics.checks import check_int
from jdls._numerics.leaves import FloatLeaves, flatten_floats
from jdls._numerics.norm import tree_norm
from jdls._scales.layer_site import layer_sites
from jdls._scales.scale import DynamicScale, LossScale, check_scale
from jdls._sites.measured import measured, raw
from jdls._sites.site import Site, is_site
from jdls._sites.update import split_sites

__all__ = ["AccumulateInfo", "accumulate"]


class AccumulateInfo(NamedTuple):
    """What :func:`jdls.accumulate` did in one step: on-device arrays, no host sync.

    Attributes:
      kept: int32, micro-batches whose gradients entered the mean.
      dropped: int32, micro-batches left out (non-finite after their retries).
      retries: int32, recomputations at a lower scale, over all micro-batches.
      skip: bool, whether more than ``max_dropped`` micro-batches were dropped (the
        gradients returned are then NaN, so that ``jdls.wrap`` skips the step).
      kept_mask: bool[micro-batches], which micro-batches were kept.
      scale: the loss scale after the micro-batches: backed off once per failed attempt
        (``back_off()``) and once per dropped micro-batch (``adjust(False)``), except that
        on a step the wrap will skip (``skip``, or no micro-batch kept) the last dropped
        micro-batch's back-off is left to the wrap's skip, so that each overflow counts once.
        Put it back with ``jdls.set_scale(opt_state, info.scale)`` before ``tx.update``.
    """

    kept: jax.Array
    dropped: jax.Array
    retries: jax.Array
    skip: jax.Array
    kept_mask: jax.Array
    scale: LossScale


def accumulate(
    loss_fn: Callable[..., Any],
    scale: LossScale,
    params: Any,
    micro_batches: Any,
    *,
    has_aux: bool = False,
    retries: int = 0,
    max_dropped: int = 0,
    value_and_grad: Callable[..., Callable[..., Any]] | None = None,
) -> tuple[Any, Any, AccumulateInfo]:
    """The mean loss and gradients over micro-batches, each checked (and retried) on its own.

    A ``lax.scan`` over the leading axis of ``micro_batches``: for each micro-batch ``b``,
    ``scale.value_and_grad(loss_fn)(params, b)``, then

    * finite gradients (and loss) are added to the sum;
    * gradients that overflow while the loss is finite are recomputed at the rule's backed-off
      scale (``scale.back_off()``: lower every time, with hysteresis too), up to ``retries``
      times (the lower scale carries on to the next micro-batches);
    * a micro-batch still not finite (or whose loss is not finite: bad data is never retried)
      is dropped: it never poisons the sum, and it backs the scale off once.

    The result is the sum over the kept micro-batches divided by their number. When more than
    ``max_dropped`` were dropped, the gradients are NaN so that ``jdls.wrap`` skips the whole
    step (``info.skip`` says so). The loss is the mean over the kept micro-batches.

    Args:
      loss_fn: ``loss_fn(params, micro_batch)``, the unscaled loss of one micro-batch, or
        ``(loss, aux)`` with ``has_aux``.
      scale: the loss scale of this step, ``jdls.get_scale(opt_state)``.
      params: the parameters to differentiate.
      micro_batches: a pytree whose leaves all have the number of micro-batches as their
        leading axis.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; the auxes come back stacked.
      retries: the most recomputations per micro-batch (needs a :class:`jdls.DynamicScale`).
      max_dropped: the most micro-batches that may be dropped before the step is skipped;
        0 (default) skips the step on any dropped micro-batch, as PyTorch does.
      value_and_grad: how to differentiate one micro-batch, ``value_and_grad(fun,
        has_aux=...)`` returning ``fn(params, micro_batch) -> (loss, grads)``: needed where
        the parameters hold per-layer scales, which ``scale`` alone cannot apply (pass
        ``state.value_and_grad`` of a ``jdls.linen.TrainState``, or
        ``jdls.equinox.layer_scaled_value_and_grad``); default ``scale.value_and_grad``.
        With it, a micro-batch that overflows is dropped, never retried.

    Returns:
      ``(loss, grads, info)`` (``((loss, aux), grads, info)`` with ``has_aux``): the mean
      loss over the kept micro-batches, the mean unscaled gradients (float32 for 16-bit
      parameters), and an :class:`AccumulateInfo`.

    Raises:
      TypeError: ``scale`` is not a loss scale.
      ValueError: bad ``retries`` or ``max_dropped``, micro-batch leaves without a common
        leading axis, or ``retries`` with a scale that does not back off.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap(optax.sgd(0.1))
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p, x: jnp.sum(p["w"] * x)
      >>> xs = jnp.array([[1.0, 1.0], [jnp.inf, 0.0], [3.0, 3.0]])   # 3 micro-batches
      >>> @jax.jit
      ... def step(params, opt_state, xs):
      ...     scale = jdls.get_scale(opt_state)
      ...     loss, grads, info = jdls.accumulate(loss_fn, scale, params, xs, max_dropped=1)
      ...     opt_state = jdls.set_scale(opt_state, info.scale)
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state, info
      >>> params, opt_state, info = step(params, opt_state, xs)
      >>> int(info.kept), int(info.dropped), params["w"].tolist()   # mean of the two kept
      (2, 1, [0.800000011920929, 0.800000011920929])
    """
    scale = check_scale(scale)
    retries = check_int("retries", retries, minimum=0)
    max_dropped = check_int("max_dropped", max_dropped, minimum=0)
    if value_and_grad is None:
        _refuse_layer_sites(params)
    elif retries:
        raise ValueError(
            "accumulate: retries need the scale's own value_and_grad (a retry backs the "
            "scale off); with value_and_grad given, pass retries=0"
        )
    if retries and not isinstance(scale, DynamicScale):
        raise ValueError(
            f"retries={retries} needs a scale that backs off, a jdls.DynamicScale; "
            f"a {type(scale).__name__} would retry at the same scale"
        )
    count = _count(micro_batches)

    def loss_only(p: Any, batch: Any) -> Any:
        return loss_fn(p, batch)[0] if has_aux else loss_fn(p, batch)

    # zeros_like of the abstract gradients keeps their shardings (explicit meshes).
    # The sites' measurements are added as floats (raw) and coded again at the end.
    # Under shard_map with check_vma, zeros vary as the gradients do (the scan's carry type).
    first_loss, zeros = jax.tree_util.tree_map(
        lambda t: vary_like(jnp.zeros_like(t), t),
        jax.eval_shape(
            lambda: raw(
                (value_and_grad or _of_scale(scale))(loss_only)(params, _first(micro_batches))
            )
        ),
    )

    def differentiate(s: LossScale, batch: Any) -> tuple[Any, Any, Any, Any, Any]:
        """One micro-batch at the scale ``s``: its loss, aux and gradients (measurements as
        floats), whether it is kept (finite gradients and loss) and whether its loss is
        finite, each decided alike on every device (as one device on the whole batch)."""
        fn = value_and_grad or _of_scale(s)
        if has_aux:
            (loss, aux), grads = fn(loss_fn, has_aux=True)(params, batch)
        else:
            (loss, grads), aux = fn(loss_only)(params, batch), None
        grads = raw(grads)
        # a measurement is never a gradient: the sites' never decide (as in the wrap)
        finite = agree(_finite(flatten_floats(split_sites(grads)[0])))
        loss_finite = agree(jnp.all(jnp.isfinite(loss)))
        return loss, aux, grads, finite & loss_finite, loss_finite

    def body(carry: tuple[Any, ...], batch: Any) -> tuple[tuple[Any, ...], Any]:
        # ``held``: the scale as ``s`` but for the last dropped micro-batch's own back-off,
        # which a skipped step leaves to the wrap's skip (one overflow counted once)
        total, loss_sum, s, held, tries, first = carry
        if retries:
            total, loss_sum, s, held, n, ok, aux = _retried(total, loss_sum, s, held, first, batch)
            return (total, loss_sum, s, held, tries + n, jnp.array(False)), (ok, aux)
        loss, aux, grads, ok, _ = differentiate(s, batch)
        # A dropped micro-batch never enters the sum: ``where``, not a multiplication (0 * inf).
        # Where any dropped micro-batch skips the step (max_dropped=0), the sum is not
        # returned then (NaN instead), so every micro-batch is added as it comes: the
        # additions need not wait for the step's decision, and XLA fuses each with the
        # gradient it adds.
        total = _add_kept(total, grads, ok if max_dropped else jnp.array(True), first)
        loss_sum = jnp.where(ok, loss_sum + loss.astype(jnp.float32), loss_sum)
        held = _pick(ok, held, s)
        s = _pick(ok, s, s.adjust(False))  # a dropped micro-batch's own overflow
        return (total, loss_sum, s, held, tries, jnp.array(False)), (ok, aux)

    def _retried(
        total: Any, loss_sum: Any, s: LossScale, held: LossScale, first: Any, batch: Any
    ) -> tuple[Any, Any, LossScale, LossScale, Any, Any, Any]:
        """The micro-batch's attempts in one ``lax.while_loop``, each the whole micro-step
        (differentiate, check, add where kept), so that the sum is updated in place and no
        gradients are held apart from it. While an attempt overflows with a finite loss, the
        next runs at ``back_off()`` of its scale, up to ``retries`` times, as long as that is
        lower. The scale that goes on is the last one whose loss was finite; backed off once
        more (``adjust(False)``) when the micro-batch is dropped. Only the last attempt's
        measurements (sites) enter the sum. ``held`` goes through the same back-offs; when
        the micro-batch is dropped, it becomes ``base`` (without the drop's own back-off)."""

        def attempt(c: tuple[Any, ...]) -> tuple[Any, ...]:
            total, loss_sum, (cur, base), (held_cur, held_base), n, k, _, _, _ = c
            loss, aux, grads, ok, loss_finite = differentiate(cur, batch)
            base, held_base = _pick(loss_finite, (cur, held_cur), (base, held_base))
            n = n + (loss_finite & (k > 0)).astype(jnp.int32)  # a retry whose loss was finite
            lower = cast(DynamicScale, cur).back_off()
            again = ~ok & loss_finite & (n < retries) & (lower.loss_scale < cur.loss_scale)
            total = _add_kept(total, grads, ok, first, final=~again)
            loss_sum = jnp.where(ok, loss_sum + loss.astype(jnp.float32), loss_sum)
            lowered = (lower, cast(DynamicScale, held_cur).back_off())
            cur, held_cur = _pick(again, lowered, (cur, held_cur))
            return (total, loss_sum, (cur, base), (held_cur, held_base), n, k + 1, again, ok, aux)

        zero = jnp.zeros((), jnp.int32)
        no, yes = jnp.array(False), jnp.array(True)
        init = (total, loss_sum, (s, s), (held, held), zero, zero, yes, no, aux_zeros)
        total, loss_sum, (_, base), (_, held_base), n, _, _, ok, aux = lax.while_loop(
            lambda c: c[6], attempt, init
        )
        held = _pick(ok, held_base, base)
        return total, loss_sum, _pick(ok, base, base.adjust(False)), held, n, ok, aux

    # The aux's type for the retry loop's carry (the forward pass alone).
    aux_zeros = None
    if retries and has_aux:
        aux_zeros = jax.tree_util.tree_map(
            lambda t: vary_like(jnp.zeros_like(t), t),
            jax.eval_shape(lambda: loss_fn(params, _first(micro_batches))[1]),
        )

    loss_sum = vary_like(jnp.zeros((), jnp.float32), first_loss)
    init = (zeros, loss_sum, scale, scale, jnp.zeros((), jnp.int32), jnp.array(True))
    (total, loss_sum, scale, held, tries, _), (mask, auxes) = lax.scan(body, init, micro_batches)
    kept = jnp.sum(mask.astype(jnp.int32))
    dropped = jnp.int32(count) - kept
    skip = dropped > max_dropped
    # The wrap skips the step (NaN gradients) and backs off for it: that back-off is the last
    # dropped micro-batch's, counted once.
    scale = _pick(skip | (kept == 0), held, scale)
    divisor = kept.astype(jnp.float32)
    grads = jax.tree_util.tree_map(
        lambda t: (
            t
            if is_site(t)
            else jnp.where(skip, jnp.nan, t / divisor.astype(t.dtype)).astype(t.dtype)
        ),
        total,
        is_leaf=is_site,
    )
    grads = measured(grads, reduce=False)  # each micro-batch's was global already
    loss = loss_sum / divisor
    info = AccumulateInfo(kept, dropped, tries, skip, mask, scale)
    return ((loss, auxes) if has_aux else loss), grads, info


def _of_scale(scale: LossScale) -> Callable[..., Callable[..., Any]]:
    return lambda fun, has_aux=False: scale.value_and_grad(fun, has_aux=has_aux)


def _refuse_layer_sites(params: Any) -> None:
    if layer_sites(params):
        raise ValueError(
            "accumulate: the parameters hold per-layer scales, which the wrap's scale cannot "
            "apply (it would differentiate at one scale and measure nothing per layer). "
            "Pass how to differentiate them: value_and_grad=state.value_and_grad (a "
            "jdls.linen.TrainState) or value_and_grad=jdls.equinox.layer_scaled_value_and_grad"
        )


def _add_kept(total: Any, grads: Any, ok: jax.Array, first: jax.Array, final: Any = True) -> Any:
    """``total + grads`` where ``ok``. A site's measurements are what the backward passes saw,
    of every micro-batch, kept or dropped (a layer that overflowed must back off): they
    combine by the kind's ``accumulate(a, b)`` when it has one (an FP8 amax, a per-layer
    amax: the maximum), else add (a probe's counts), the first micro-batch's taking the place
    of the zeros; they are never divided by the number of micro-batches. Of a micro-batch's
    retried attempts, only the last (``final``) gives its measurements."""

    def add(t: Any, g: Any) -> Any:
        if is_site(t):
            combine = getattr(t.kind, "accumulate", None)
            value = (
                combine(t.value, g.value)
                if combine is not None
                else jax.tree_util.tree_map(jnp.add, t.value, g.value)
            )
            value = jax.tree_util.tree_map(
                lambda a, b, old: jnp.where(final, jnp.where(first, b, a), old).astype(b.dtype),
                value,
                g.value,
                t.value,
            )
            return Site(t.kind, value)
        return jnp.where(ok, t + g, t).astype(t.dtype)

    return jax.tree_util.tree_map(add, total, grads, is_leaf=is_site)


def _pick(condition: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where ``condition``, else ``on_false``, leaf by leaf (two scales)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(condition, a, b), on_true, on_false)


def _finite(tree: FloatLeaves) -> jax.Array:
    """Whether a micro-batch's gradients are finite, from their largest magnitude and their
    sum of squares (exact: an inf reaches the maximum, a NaN the sum), without the second,
    scaled pass that tells an inf from a sum of squares that overflows: that pass sits in a
    ``lax.cond`` that holds the gradients, which cost the scan about a gradient buffer."""
    return tree_norm(tree, largest=True, exact_overflow=False).finite


def _first(micro_batches: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[0], micro_batches)


def _count(micro_batches: Any) -> int:
    leaves = jax.tree_util.tree_leaves(micro_batches)
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else -1 for x in leaves}
    if not leaves or -1 in sizes or len(sizes) != 1 or 0 in sizes:
        shapes = [jnp.shape(x) for x in leaves]
        raise ValueError(
            "micro_batches must be a pytree of arrays that all have the number of micro-batches "
            f"as their leading axis, e.g. xs.reshape(k, -1, *xs.shape[1:]); got shapes {shapes}"
        )
    return sizes.pop()
