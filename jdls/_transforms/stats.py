"""The state of ``jdls.wrap`` and the one place that finds it in any optimizer state.

``jdls.wrap`` keeps its loss scale, the inner optimizer's state and the statistics of the last
step in a :class:`WrapState`, which may sit anywhere in a larger optimizer state (a chain,
``MultiSteps``, ``inject_hyperparams``, a Flax ``TrainState``, an ``nnx.Optimizer``).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdls._scales.scale import LossScale, check_scale
from jdls._transforms.retry import SkipCause

__all__ = [
    "Stats",
    "WrapState",
    "get_scale",
    "keep_if_skipped",
    "nonfinite_paths",
    "replace_scale",
    "set_scale",
    "skip_cause",
    "snapshot",
    "stats",
    "step_applied",
    "wrap_states",
]


class Stats(NamedTuple):
    """What ``jdls.wrap`` records about the last step: on-device arrays, no host sync.

    Attributes:
      finite: bool, whether the last step was taken: its gradients were all finite (True
        before the first step), and not all flushed (``cause`` ``UNDERFLOW``: all zero
        before the rule's first measurement, with a loss that was not). A step that was not
        finite was skipped.
      skipped_steps: int32, skipped steps since ``init`` (saturates at the int32 maximum).
      consecutive_skips: int32, skipped steps in a row up to the last one.
      grad_norm: float32, the global L2 norm of the last step's unclipped, unscaled
        gradients: inf when a gradient is inf or the norm exceeds float32 (with the default
        rule and no ``max_norm``: once its float32 sum of squares overflows, past ``2**64``,
        as ``optax.global_norm``), NaN when a
        gradient is NaN, and when it is not known (``axis_name`` without ``sharded``); 0
        before the first step (a NaN there would trip ``jax_debug_nans``).
      nonfinite: with ``track_nonfinite=True``, one bool per gradient leaf (True where the
        leaf held an inf or NaN on the last step; :func:`jdls.wrap_groups`: a dict of the
        groups' flags); None otherwise.
      retries: int32, how many times the last step's gradients were recomputed at a lower
        scale (:func:`jdls.retrying`).
      cause: int32, why the last step was skipped, a :class:`jdls.SkipCause` (0 if taken;
        ``MODEL``, 4, where the scale cannot have caused it: the model overflows by itself;
        ``UNDERFLOW``, 5, where its gradients all flushed).
        :func:`jdls.skip_cause` reads it on the host.
      retried_steps: int32, steps that needed at least one retry since ``init``.
    """

    finite: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    grad_norm: jax.Array
    nonfinite: Any
    retries: jax.Array
    cause: jax.Array
    retried_steps: jax.Array

    @property
    def skipped(self) -> jax.Array:
        """Whether the last step was skipped (``~finite``)."""
        return jnp.logical_not(self.finite)

    def __getattr__(self, name: str) -> Any:
        if name == "loss_scale":
            raise AttributeError(
                "jdls.Stats has no loss_scale: the scale is jdls.get_scale(opt_state).loss_scale "
                "(state.loss_scale on a jdls.linen.TrainState)"
            )
        raise AttributeError(f"jdls.Stats has no attribute {name!r}")


class WrapState(NamedTuple):
    """The optimizer state of :func:`jdls.wrap`.

    Attributes:
      scale: the loss scale (a :class:`jdls.LossScale`) to use on the next step.
      inner_state: the state of the wrapped transformation, untouched by skipped steps.
      stats: a :class:`Stats` about the last step.
      sites: the sites of the parameters, as the last step left them (``None`` when the
        parameters hold none): the update at a site is a ``SiteUpdate``, and
        :func:`jdls.apply_updates` puts these in place.
    """

    scale: LossScale
    inner_state: Any
    stats: Stats
    sites: Any = None


def _is_wrap_state(x: Any) -> bool:
    return isinstance(x, WrapState)


def wrap_states(opt_state: Any) -> list[tuple[str, WrapState]]:
    found, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_wrap_state)
    return [(jax.tree_util.keystr(path), x) for path, x in found if isinstance(x, WrapState)]


def snapshot(tree: Any) -> Any:
    """``tree`` with Flax NNX ``Variable``s replaced by their current values.

    An ``nnx.Optimizer`` keeps its state in Variables that the next ``update`` changes in
    place; what :func:`stats` and :func:`get_scale` return must not change after it.
    """
    nnx = sys.modules.get("flax.nnx")
    variable = getattr(nnx, "Variable", None)
    if variable is None:
        return tree
    is_variable = lambda v: isinstance(v, variable)  # noqa: E731
    if not any(map(is_variable, jax.tree_util.tree_leaves(tree, is_leaf=is_variable))):
        return tree  # the very same object, as most callers expect
    return jax.tree_util.tree_map(
        lambda v: v.get_value() if isinstance(v, variable) else v,
        tree,
        is_leaf=is_variable,
    )


def _the_wrap_state(opt_state: Any, what: str) -> WrapState:
    found = wrap_states(opt_state)
    if len(found) == 1:
        return snapshot(found[0][1])
    if not found:
        raise ValueError(
            f"{what}: found no jdls.wrap state in this {type(opt_state).__name__}; build the "
            "optimizer with jdls.wrap(...) and pass its state (or the Flax TrainState)"
        )
    paths = ", ".join(path or "<root>" for path, _ in found)
    raise ValueError(
        f"{what}: found {len(found)} jdls.wrap states (at {paths}); a train step needs exactly "
        "one, so wrap the whole optimizer once, or pass the part of the state holding the one "
        "you mean"
    )


def get_scale(opt_state: Any) -> LossScale:
    """The loss scale held by the one :func:`jdls.wrap` inside an optimizer state.

    Works wherever the wrap sits (alone, in a chain, inside or around ``MultiSteps`` or
    ``inject_hyperparams``, in a Flax ``TrainState`` or an ``nnx.Optimizer``, whose values
    come back as a snapshot) and inside ``jit``.

    Args:
      opt_state: an optimizer state (any pytree) holding exactly one :class:`WrapState`.

    Returns:
      The loss scale to use for this step.

    Raises:
      ValueError: no wrap state, or more than one (the message lists their paths).

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = optax.chain(jdls.clip(1.0), jdls.wrap(optax.sgd(0.1), jdls.DynamicScale()))
      >>> float(jdls.get_scale(tx.init({"w": jnp.zeros(2)})).loss_scale)
      32768.0
    """
    return _the_wrap_state(opt_state, "get_scale").scale


def set_scale(opt_state: Any, scale: LossScale) -> Any:
    """A copy of an optimizer state with the loss scale of its one :func:`jdls.wrap` replaced.

    Args:
      opt_state: an optimizer state holding exactly one :class:`WrapState`.
      scale: the new loss scale, e.g. ``jdls.presets.from_pytorch_state_dict(...)``.

    Returns:
      The optimizer state, same structure, with ``scale`` in place of the old one.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> state = jdls.wrap(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
      >>> state = jdls.set_scale(state, jdls.DynamicScale(1024.0))
      >>> float(jdls.get_scale(state).loss_scale)
      1024.0
    """
    scale = check_scale(scale)
    _the_wrap_state(opt_state, "set_scale")
    return replace_scale(opt_state, scale)


def replace_scale(opt_state: Any, scale: Any, is_leaf: Any = None) -> Any:
    """``opt_state`` with the scale of every :class:`WrapState` replaced (no checks)."""

    def replace(x: Any) -> Any:
        return x._replace(scale=scale) if isinstance(x, WrapState) else x

    leaf = _is_wrap_state if is_leaf is None else (lambda x: _is_wrap_state(x) or is_leaf(x))
    return jax.tree_util.tree_map(replace, opt_state, is_leaf=leaf)


def stats(opt_state: Any) -> Stats:
    """Statistics of the last step of the one :func:`jdls.wrap` in an optimizer state.

    On-device values, no host synchronisation: usable inside ``jit`` and cheap to log.

    Args:
      opt_state: an optimizer state (or Flax ``TrainState``) holding one :class:`WrapState`.

    Returns:
      A :class:`Stats`; ``.skipped`` says whether the last step was skipped.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap(optax.sgd(0.1), jdls.DynamicScale())
      >>> params = {"w": jnp.zeros(2)}
      >>> _, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, tx.init(params), params)
      >>> s = jdls.stats(state)
      >>> bool(s.skipped), int(s.skipped_steps), float(jdls.get_scale(state).loss_scale)
      (True, 1, 16384.0)
    """
    return _the_wrap_state(opt_state, "stats").stats


def skip_cause(opt_state: Any) -> SkipCause:
    """Why jdls skipped the last step, read on the host: ``SkipCause.NONE`` (falsy) if it
    was taken.

    The one line a training loop's own checks need beside jdls: a guard that stops on
    non-finite gradients stops only where loss scaling does not account for them,
    ``if not np.isfinite(grad_norm) and not jdls.skip_cause(opt_state).handled: raise ...``
    (:attr:`SkipCause.handled`; docs/guides/debugging.md). Pass the loss to the wrap
    (``tx.update(..., value=loss)``) to tell a non-finite loss (``FORWARD``) from an
    overflow of the scaled backward pass. Reads one integer from the device: call it outside
    ``jit`` (inside, ``jdls.stats(opt_state).cause`` is the same number as an array).

    Args:
      opt_state: an optimizer state (or Flax ``TrainState``) holding one :class:`WrapState`.

    A step skipped as ``SkipCause.MODEL`` (the model overflows whatever the scale:
    below ``2**-24``, or a dynamic scale at its minimum) also warns, a ``RuntimeWarning``
    that Python shows once per line calling this function.

    Returns:
      A :class:`jdls.SkipCause`; its ``name`` says why, ``handled`` whether the scale took
      care of it.

    Raises:
      TypeError: called inside a traced function.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap(optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(2)}
      >>> _, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, tx.init(params), params)
      >>> cause = jdls.skip_cause(state)
      >>> cause.name, cause.handled
      ('GRADIENTS', True)
      >>> bool(jdls.skip_cause(tx.init(params)))  # nothing skipped
      False
    """
    cause = _the_wrap_state(opt_state, "skip_cause").stats.cause
    if isinstance(cause, jax.core.Tracer):
        raise TypeError(
            "jdls.skip_cause reads the cause on the host: call it outside jit (inside a "
            "traced function, jdls.stats(opt_state).cause is the same number as an array)"
        )
    found = SkipCause(int(np.max(jax.device_get(cause))))  # pmap: every device holds it
    if found is SkipCause.MODEL:
        _warn_model_overflow()
    return found


def _warn_model_overflow() -> None:
    # One text, so that Python's default filter shows it once per calling line.
    warnings.warn(
        "jdls skipped the last step at a loss scale too small to be the cause (below 2**-24, "
        "or a dynamic scale at its minimum): the model overflows by itself "
        "(jdls.SkipCause.MODEL) and every step will be skipped, whatever the scale. Find the "
        "operation that overflows (jax.config.update('jax_debug_nans', True); often a "
        "float16 norm's sum of squares or a softmax) and compute it in float32 "
        "(docs/guides/debugging.md)",
        RuntimeWarning,
        stacklevel=3,
    )


def keep_if_skipped(opt_state: Any, new: Any, old: Any) -> Any:
    """``new`` if the last step of the one :func:`jdls.wrap` in ``opt_state`` was taken, else ``old``.

    A skipped step leaves the parameters and the optimizer state as they were; model state
    updated by the forward pass (Flax ``batch_stats``, NNX ``BatchStat``) needs this to stay
    as it was too: one float16 overflow would otherwise poison running statistics for good.

    Args:
      opt_state: the optimizer state after ``tx.update``.
      new: the model state the step computed.
      old: the model state before the step (same structure).

    Returns:
      ``new`` or ``old``, leaf by leaf, selected on device (usable inside ``jit``).

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap(optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(2)}
      >>> _, state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, tx.init(params), params)
      >>> jdls.keep_if_skipped(state, {"mean": jnp.ones(2)}, {"mean": jnp.zeros(2)})["mean"].tolist()
      [0.0, 0.0]
    """
    finite = _the_wrap_state(opt_state, "keep_if_skipped").stats.finite
    return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)


def nonfinite_paths(opt_state: Any) -> list[str]:
    """Key paths of the gradient leaves that held an inf or NaN on the last step (host side).

    Needs ``jdls.wrap(..., track_nonfinite=True)`` (or ``jdls.wrap_groups(...,
    track_nonfinite=True)``, whose paths start with the group: ``"['disc']['w']"``). Reads the
    flags from the device, so call it outside ``jit``, e.g. when ``jdls.stats(state).skipped``
    is True. With ``pmap`` the flags of all devices are combined.

    Args:
      opt_state: an optimizer state (or Flax ``TrainState``) holding one :class:`WrapState`.

    Returns:
      A list of ``jax.tree_util.keystr`` paths, in tree order, e.g.
      ``["['params']['dense']['kernel']"]``; empty when the last step was finite.

    Raises:
      ValueError: the wrap was built without ``track_nonfinite=True``.

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap(optax.sgd(0.1), track_nonfinite=True)
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> grads = {"a": jnp.ones(2), "b": jnp.array([jnp.inf, 0.0])}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> jdls.nonfinite_paths(state)
      ["['b']"]
    """
    flags = _the_wrap_state(opt_state, "nonfinite_paths").stats.nonfinite
    if flags is None:
        raise ValueError(
            "nonfinite_paths needs per-leaf flags: build the optimizer with "
            "jdls.wrap(..., track_nonfinite=True) (or jdls.wrap_groups(..., "
            "track_nonfinite=True))"
        )
    flags = jax.device_get(flags)
    found, _ = jax.tree_util.tree_flatten_with_path(flags)
    return [jax.tree_util.keystr(path) for path, flag in found if bool(np.any(flag))]


def the_wrap_state(opt_state: Any, what: str) -> WrapState:
    """The one :class:`WrapState` in ``opt_state`` (``what`` names the caller in errors)."""
    return _the_wrap_state(opt_state, what)


def step_applied(opt_state: Any) -> jax.Array:
    """Whether the last ``tx.update`` of a ``jdls.wrap`` changed the parameters: its step was
    finite and every ``optax.MultiStepsState`` in ``opt_state`` (``optax.MultiSteps`` inside
    or around the wrap) completed an accumulated step. Without ``MultiSteps`` it equals
    ``stats(opt_state).finite``.

    ``jdls.wrap``, ``jdls.linen.TrainState``, ``jdls.nnx.Optimizer`` and the Equinox step pass
    it as ``finite`` to ``jdls.update_sites``; pass it yourself when a hand-written step updates
    sites: a site's measurements of the micro-batches of one accumulated step then count once
    (FP8: their maximum enters the history when the step is applied).

    Example:
      >>> import jax.numpy as jnp, optax, jdls
      >>> tx = jdls.wrap(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
      >>> params = jnp.ones(2)
      >>> opt_state = tx.init(params)
      >>> _, opt_state = tx.update(jnp.ones(2), opt_state, params)
      >>> bool(jdls.fp8.step_applied(opt_state))
      False
      >>> _, opt_state = tx.update(jnp.ones(2), opt_state, params)
      >>> bool(jdls.fp8.step_applied(opt_state))
      True
    """
    applied = jnp.asarray(stats(opt_state).finite, bool)

    def is_multi(x: Any) -> bool:
        return isinstance(x, optax.MultiStepsState)

    for leaf in jax.tree.leaves(opt_state, is_leaf=is_multi):
        if is_multi(leaf):
            mini_step = leaf.mini_step
            if hasattr(mini_step, "get_value"):  # an nnx.Optimizer's state holds Variables
                mini_step = mini_step.get_value()
            applied = applied & (jnp.asarray(mini_step) == 0)
    return applied
