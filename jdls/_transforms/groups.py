"""Several optimizers, one loss scale: PyTorch's one ``GradScaler`` over several optimizers.

``jdls.wrap_groups({"gen": optax.adam(..), "disc": optax.adam(..)}, scale)`` is one optax
transformation over a dict of parameter groups (a GAN's generator and discriminator, the
heads of a multi-task model). Each group is a ``jdls.wrap`` of its own optimizer that skips on
its **own** gradients; the one scale backs off when any group given to this ``update``
overflowed, and grows only when all were finite, as ``scaler.step(opt)`` for each optimizer
and one ``scaler.update()`` do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdls._numerics.handoff import backward_amax
from jdls._numerics.leaves import flatten_floats
from jdls._numerics.norm import tree_amax
from jdls._numerics.scalars import one_kernel, pick
from jdls._scales.scale import (
    AdaptiveScale,
    LossScale,
    NoOpScale,
    adjust_observed,
    check_scale,
    observes,
)
from jdls._transforms.retry import flushed, model_overflow
from jdls._transforms.stats import Stats, WrapState, the_wrap_state
from jdls._transforms.wrap import FLUSHED, loss_nonzero, wrap

__all__ = ["GroupState", "group_stats", "wrap_groups"]


class GroupState(NamedTuple):
    """The state of one group of :func:`jdls.wrap_groups`.

    Attributes:
      inner_state: the state of the group's optimizer, untouched by the group's skipped steps.
      stats: a :class:`jdls.Stats` about the group's last step.
      sites: the sites of the group's parameters as its last step left them (``None``
        without sites; see :class:`jdls.WrapState`).
    """

    inner_state: Any
    stats: Stats
    sites: Any = None


def wrap_groups(
    inners: Mapping[str, optax.GradientTransformation],
    scale: LossScale | None = None,
    **wrap_options: Any,
) -> optax.GradientTransformationExtraArgs:
    """One loss scale over several optimizers, each skipping on its own gradients.

    ``tx.init(params)`` and ``tx.update(grads, state, params)`` take dicts keyed like
    ``inners``, one parameter (or gradient) tree per group. On ``update``, each group given
    is checked and updated (or skipped) on its own, as ``jdls.wrap(inner)`` would; the scale
    is adjusted once, as overflowing if any given group's gradients were not finite (a rule
    that observes, :class:`jdls.rules.Adaptive`, gets the largest magnitude of the given
    groups' gradients, or of those the scale's ``value_and_grad`` returned when a
    transformation in front changed them, as :func:`jdls.wrap` gives it). A
    group left out of ``grads`` is not stepped (its state stays as it was, and it has no
    say in the scale): the pattern of a GAN stepping its discriminator and its generator
    in turn, ``scaler.step(opt_d); scaler.update()`` then ``scaler.step(opt_g);
    scaler.update()`` in PyTorch.

    The state is a :class:`jdls.WrapState` whose ``inner_state`` is a dict of
    :class:`GroupState`, so :func:`jdls.get_scale`, :func:`jdls.set_scale` and
    :func:`jdls.stats` work unchanged; ``jdls.stats`` describes the step as the scale saw it
    (finite when every given group was), :func:`jdls.group_stats` each group.

    Args:
      inners: the optimizer of each group, e.g. ``{"gen": optax.adam(2e-4), "disc":
        optax.adam(2e-4)}``.
      scale: the one loss scale; default ``jdls.AdaptiveScale()`` (the scale
        follows the gradients it measures; ``jdls.DynamicScale()`` for the classic rule).
      **wrap_options: options of :func:`jdls.wrap` applied to every group (``max_norm``,
        ``skip_norm_overflow``, ``skip_with``, ``track_nonfinite``): each group is clipped
        by its own global norm, as ``clip_grad_norm_`` per optimizer in PyTorch. With
        ``track_nonfinite``, :func:`jdls.nonfinite_paths` names the leaves with their group
        (``"['disc']['w']"``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` over dicts of parameter groups.

    Raises:
      TypeError: ``inners`` is not a non-empty dict of transformations, ``scale`` not a loss
        scale, or an option :func:`jdls.wrap_groups` does not support (``retries``,
        ``axis_name``, ``max_consecutive_skips``).
      ValueError: at update time, groups that ``inners`` does not have.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap_groups({"gen": optax.sgd(1.0), "disc": optax.sgd(1.0)},
      ...                       jdls.DynamicScale(128.0))
      >>> params = {"gen": {"w": jnp.ones(2)}, "disc": {"w": jnp.ones(2)}}
      >>> state = tx.init(params)
      >>> grads = {"gen": {"w": jnp.ones(2)}, "disc": {"w": jnp.array([jnp.inf, 1.0])}}
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["gen"]["w"].tolist(), params["disc"]["w"].tolist()   # disc skipped alone
      ([0.0, 0.0], [1.0, 1.0])
      >>> float(jdls.get_scale(state).loss_scale), bool(jdls.group_stats(state)["disc"].skipped)
      (64.0, True)
    """
    if not isinstance(inners, Mapping) or not inners:
        raise TypeError(
            "inners must be a non-empty dict of optax transformations, one per parameter "
            f'group, e.g. {{"gen": optax.adam(2e-4), "disc": optax.adam(2e-4)}}; got {inners!r}'
        )
    unsupported = sorted(
        set(wrap_options) & {"retries", "axis_name", "sharded", "max_consecutive_skips"}
    )
    if unsupported:
        raise TypeError(
            f"jdls.wrap_groups does not support {', '.join(unsupported)}; use jdls.wrap for "
            "one optimizer, or step the groups in separate jdls.wrap optimizers"
        )
    scale0 = AdaptiveScale() if scale is None else check_scale(scale, wrapping=True)
    groups = {name: wrap(inner, NoOpScale(), **wrap_options) for name, inner in inners.items()}

    def init_fn(params: Mapping[str, Any]) -> WrapState:
        _check_groups(params, groups, "params")
        states = {name: groups[name].init(params[name]) for name in groups}
        first = next(iter(states.values()))
        return WrapState(
            scale=jax.tree_util.tree_map(jnp.array, scale0),
            inner_state={n: GroupState(*s[1:]) for n, s in states.items()},
            stats=first.stats._replace(nonfinite=_flags(states)),
            sites=_sites(states),
        )

    def update_fn(
        grads: Mapping[str, Any],
        state: WrapState,
        params: Mapping[str, Any] | None = None,
        **extra_args: Any,
    ) -> tuple[dict[str, Any], WrapState]:
        if not isinstance(state, WrapState):
            raise TypeError(
                f"jdls.wrap_groups' update expects its own WrapState, got {type(state).__name__}"
            )
        _check_groups(grads, groups, "grads", partial=True)
        scale = state.scale

        def largest() -> jax.Array:  # of the backward pass, as jdls.wrap measures it
            given = flatten_floats(dict(grads)).floats
            return backward_amax(scale.loss_scale, given, tree_amax(dict(grads)), None)

        # Every given group all zero while the loss was not, before the shared scale's rule
        # measured anything: each group skips the step (SkipCause.UNDERFLOW), as jdls.wrap.
        underflow = jnp.zeros((), jnp.bool_)
        if observes(scale):
            nonzero_loss = loss_nonzero(scale, extra_args, None)
            underflow = flushed(scale, jnp.array(True), largest(), nonzero_loss)
        inner = dict(state.inner_state)
        updates: dict[str, Any] = {}
        finites, norms, causes = [], [], []
        for name, g in grads.items():
            old = inner[name]
            p = None if params is None else params[name]
            group_state = WrapState(NoOpScale(), *old)
            # Each group sees this step's scale (its gradients are already unscaled).
            updates[name], new = groups[name].update(
                g, group_state, p, **extra_args, **{FLUSHED: underflow}
            )
            inner[name] = GroupState(*new[1:])
            finites.append(new.stats.finite)
            norms.append(new.stats.grad_norm)
            causes.append(new.stats.cause)
        finite = jnp.all(jnp.stack(finites))
        old = state.stats
        nonfinite = old.nonfinite
        if nonfinite is not None:  # the groups not given this step held no inf or NaN in it
            nonfinite = {
                name: inner[name].stats.nonfinite
                if name in grads
                else jax.tree_util.tree_map(jnp.zeros_like, flags)
                for name, flags in nonfinite.items()
            }
        stats = one_kernel(  # the counters in one kernel, not one each
            old._replace(
                nonfinite=nonfinite,
                finite=finite,
                skipped_steps=pick(
                    finite, old.skipped_steps, optax.safe_increment(old.skipped_steps)
                ),
                consecutive_skips=pick(finite, 0, optax.safe_increment(old.consecutive_skips)),
                grad_norm=jnp.sqrt(jnp.sum(jnp.square(jnp.stack(norms)))),
                cause=jnp.max(jnp.stack(causes)),
            )
        )

        scale = adjust_observed(scale, finite | underflow, largest)  # all zero: finite
        # the groups ran at no scale of their own: the shared one tells a model overflow
        stats = stats._replace(cause=model_overflow(stats.cause, state.scale, scale))
        return updates, WrapState(scale, inner, stats, _sites(inner))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def group_stats(opt_state: Any) -> dict[str, Stats]:
    """The :class:`jdls.Stats` of each group of the one :func:`jdls.wrap_groups` in a state.

    Args:
      opt_state: an optimizer state holding the state of one :func:`jdls.wrap_groups`.

    Returns:
      A dict from group name to that group's statistics (its own skips, norms, causes).

    Raises:
      ValueError: the state holds no :func:`jdls.wrap_groups` state.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap_groups({"a": optax.sgd(0.1), "b": optax.sgd(0.1)})
      >>> state = tx.init({"a": jnp.zeros(1), "b": jnp.zeros(1)})
      >>> sorted(jdls.group_stats(state))
      ['a', 'b']
    """
    inner = the_wrap_state(opt_state, "group_stats").inner_state
    if not (isinstance(inner, dict) and all(isinstance(v, GroupState) for v in inner.values())):
        raise ValueError(
            "group_stats: this optimizer state was not made by jdls.wrap_groups; for "
            "jdls.wrap use jdls.stats(opt_state)"
        )
    return {name: g.stats for name, g in inner.items()}


def _sites(states: Mapping[str, WrapState | GroupState]) -> tuple[Any, ...] | None:
    """The groups' sites in the order the parameters' dict flattens (sorted names), where
    ``jdls.apply_updates`` looks for them."""
    held = [site for name in sorted(states) for site in states[name].sites or ()]
    return tuple(held) if held else None


def _flags(states: Mapping[str, WrapState]) -> dict[str, Any] | None:
    """The per-leaf non-finite flags of every group, keyed like the gradients (or None)."""
    flags = {name: s.stats.nonfinite for name, s in states.items()}
    return None if any(f is None for f in flags.values()) else flags


def _check_groups(tree: Any, groups: Mapping[str, Any], what: str, partial: bool = False) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"jdls.wrap_groups: {what} must be a dict with one tree per group "
            f"({', '.join(map(repr, groups))}), got {type(tree).__name__}"
        )
    unknown = [k for k in tree if k not in groups]
    missing = [k for k in groups if k not in tree]
    if unknown or (missing and not partial):
        raise ValueError(
            f"jdls.wrap_groups: {what} has groups {sorted(tree)!r} but the optimizers are "
            f"for {sorted(groups)!r}"
            + (f" (unknown: {unknown})" if unknown else "")
            + (f" (missing: {missing})" if missing and not partial else "")
        )
