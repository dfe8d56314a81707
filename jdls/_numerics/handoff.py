"""What was measured of the gradients before they reach ``jdls.wrap``, handed to it.

The first two handoffs share one idea: the rule sets the scale for the next backward pass, so
it must measure what the backward pass computed, not what a transformation in front of the
wrap made of it. The third saves the wrap a reduction the differentiation already made.

**From ``jdls.clip``.**
``optax.chain(jdls.clip(c), jdls.wrap(inner))`` gives the wrap only the clipped gradients. A
rule that sets the scale from the largest gradient would then aim up to ``norm / c`` too high
for the next backward pass, which computes the gradients before clipping, and
``Stats.grad_norm`` would be the clipped norm. So ``jdls.clip`` records, for the leaves it
returns, the :class:`GlobalNorm` of the leaves it received (:func:`remember`), and
``jdls.wrap`` looks it up by the identity of the leaves it receives (:func:`recall`): the two
forms then take the decisions of ``jdls.wrap(inner, max_norm=c)``.

Only the very objects ``jdls.clip`` returned match, all of them, in the same order: a
transformation in between or a ``jit`` boundary makes new objects, and the wrap then measures
what it receives, as before. A record lives as long as the leaves it describes (a weak
reference removes it), so no value outlives its trace.

**From the scale's own ``value_and_grad``.** Any other transformation in front
(``optax.clip_by_global_norm``, a hand-written rescale) hands nothing over. But the gradients
came from ``scale.value_and_grad`` with the very scale the wrap holds: that call records, for
the scale's ``loss_scale`` array, the unscaled gradients it returned (:func:`remember_backward`),
and the wrap holding that array looks them up (:func:`recall_backward`) and gives the rule
their largest magnitude. A record is kept only for the trace it was made in (JAX's opaque
trace state, public API: a ``value_and_grad`` inside ``lax.scan``, an inner ``jit`` or a
``vmap`` is not seen from outside it), only while the scale array lives (a weak reference to
it), and several calls with one scale in one trace all count (the rule takes the largest of
them: each was a backward pass at that scale). Only the last call's leaves are held: an
earlier call's are folded into their largest magnitude when the next call comes, so that
gradients computed again and again with one scale (eagerly, an accumulation loop over many
micro-batches) are never all held at once. The record holds the loss of the last call too
(and whether an earlier one was nonzero): gradients all zero where the loss was not are taken
for gradients that flushed before the rule's first measurement (``SkipCause.UNDERFLOW``).

**From per-layer scales.** Their differentiation measures each layer's largest gradient (inf
where the layer is not finite), which with the sum of squares the wrap makes anyway decides
finiteness exactly. It records their largest for the float gradient leaves it returns
(:func:`remember_largest`), and a wrap given those very leaves, in order, reads its first
pass's sums alone (:func:`recall_largest`): no reduction of its own for the largest magnitude,
and no second pass compiled for an overflowing sum of squares.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend

from jdls._numerics.by_identity import ByIdentity
from jdls._numerics.norm import GlobalNorm, amax

__all__ = [
    "backward_amax",
    "backward_loss_nonzero",
    "nonzero",
    "recall",
    "recall_backward",
    "recall_largest",
    "remember",
    "remember_backward",
    "remember_largest",
]


class _Record(NamedTuple):
    norm: GlobalNorm
    axis_name: Hashable | None


_records: ByIdentity[_Record] = ByIdentity()


def remember(leaves: Sequence[Any], norm: GlobalNorm, axis_name: Hashable | None) -> None:
    """Record ``norm``, measured before clipping, for the float ``leaves`` a clip returns."""
    _records.put(leaves, _Record(norm, axis_name))


def recall(leaves: Sequence[Any], axis_name: Hashable | None) -> GlobalNorm | None:
    """The norm recorded for exactly these ``leaves`` (the same objects, in order, measured
    across the same ``axis_name``), or None."""
    record = _records.get(leaves)
    if record is None or record.axis_name != axis_name:
        return None
    return record.norm


_largest: ByIdentity[jax.Array] = ByIdentity()


def remember_largest(leaves: Sequence[Any], largest: jax.Array) -> None:
    """Record ``largest``, the largest magnitude of the float ``leaves`` on this device (a
    float32 scalar, inf where an element is not finite), for those leaves."""
    _largest.put(leaves, largest)


def recall_largest(leaves: Sequence[Any]) -> jax.Array | None:
    """The largest magnitude recorded for exactly these ``leaves`` (the same objects, in
    order), or None."""
    return _largest.get(leaves)


# --------------------------------------------------------------------------------------------
# From the scale's value_and_grad to the wrap that holds the scale.
# --------------------------------------------------------------------------------------------

_trace_state: Callable[..., Any] = (
    getattr(jax.extend.core, "get_opaque_trace_state", None)
    or jax.core.get_opaque_trace_state  # where jax.extend.core has none (jax 0.8)
)


class _Backward:
    """The backward passes at one scale array, in one trace: the last call's leaves and loss,
    the largest magnitude of every earlier call's leaves (None before a second call), and
    whether an earlier call's loss was nonzero."""

    def __init__(self, scale: weakref.ref[Any], trace: Any) -> None:
        self.scale = scale
        self.trace = trace
        self.latest: tuple[Any, ...] = ()
        self.earlier: jax.Array | None = None
        self.loss: Any = None
        self.earlier_nonzero: jax.Array | None = None

    def add(self, leaves: Sequence[Any], loss: Any, largest: Any = None) -> None:
        for folded in ([amax(self.latest)] if self.latest else []) + (
            [] if largest is None else [largest]
        ):
            self.earlier = (
                folded if self.earlier is None else jax.numpy.maximum(self.earlier, folded)
            )
        if self.loss is not None:
            was = nonzero(self.loss)
            self.earlier_nonzero = (
                was if self.earlier_nonzero is None else self.earlier_nonzero | was
            )
        self.latest = tuple(leaves)
        self.loss = loss


_backward: dict[int, _Backward] = {}


def _current_trace() -> Any:
    return _trace_state(convention="jdls")


def remember_backward(
    loss_scale: Any, leaves: Sequence[Any], loss: Any = None, largest: Any = None
) -> None:
    """Record the unscaled gradient ``leaves`` (and the ``loss``) that a backward pass at
    ``loss_scale`` (the scale's own array) produced in the current trace. The record holds
    the last call's leaves and loss for as long as the scale array lives (under ``jit``: the
    trace; eagerly: the optimizer state that holds the scale), never longer, and an earlier
    call's only as their largest magnitude and whether its loss was nonzero. ``largest``: the
    largest magnitude of gradients this call measured and does not hand over as ``leaves``
    (``jdls.retrying``: each device's own, before the step averages them)."""
    if not leaves and largest is None:
        return
    try:
        scale_ref = weakref.ref(loss_scale)
    except TypeError:  # a Python number: no array to recognise the scale by
        return
    key, trace = id(loss_scale), _current_trace()
    record = _backward.get(key)
    if record is None or record.scale() is not loss_scale or record.trace != trace:
        record = _Backward(scale_ref, trace)
        _backward[key] = record
        weakref.finalize(loss_scale, _forget_backward, key, scale_ref)
    record.add(leaves, loss, largest)


def _forget_backward(key: int, ref: weakref.ref[Any]) -> None:
    record = _backward.get(key)
    if record is not None and record.scale is ref:
        del _backward[key]


def recall_backward(loss_scale: Any) -> tuple[tuple[Any, ...], jax.Array | None] | None:
    """The gradient leaves of the last ``value_and_grad`` at ``loss_scale`` in the current
    trace and the largest magnitude of the earlier ones (None without earlier ones), or None
    where there was none."""
    record = _backward.get(id(loss_scale))
    if record is None or record.scale() is not loss_scale or record.trace != _current_trace():
        return None
    return record.latest, record.earlier


def nonzero(loss: Any) -> jax.Array:
    """Whether any floating-point leaf of ``loss`` is finite and not zero (a bool scalar)."""
    flags = [
        jax.numpy.any(jax.numpy.isfinite(x) & (x != 0))
        for x in jax.tree_util.tree_leaves(loss)
        if jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)
    ]
    return jax.numpy.any(jax.numpy.stack(flags)) if flags else jax.numpy.zeros((), bool)


def backward_loss_nonzero(loss_scale: Any) -> jax.Array | None:
    """Whether a loss that ``value_and_grad`` at ``loss_scale`` differentiated in this trace
    was finite and not zero, or None where none was recorded (or without its loss)."""
    record = _backward.get(id(loss_scale))
    if record is None or record.scale() is not loss_scale or record.trace != _current_trace():
        return None
    if record.loss is None:
        return record.earlier_nonzero
    latest = nonzero(record.loss)
    return latest if record.earlier_nonzero is None else latest | record.earlier_nonzero


def backward_amax(
    loss_scale: Any, received: Sequence[Any], measured: Any, axis_name: Hashable | None
) -> Any:
    """The largest magnitude of the gradients that ``value_and_grad`` at ``loss_scale``
    returned in this trace, for a wrap that received ``received`` (measured: ``measured``).
    When a transformation in front changed them (``optax``'s clip), the backward pass the rule
    sets the scale for computes the returned ones, not the clipped ones. With several calls,
    the largest of them all; ``measured`` where nothing else was recorded."""
    found = recall_backward(loss_scale)
    if found is None:
        return measured
    latest, earlier = found
    same = bool(latest) and {id(x) for x in latest} == {id(x) for x in received}
    if same and earlier is None:
        return measured  # the very gradients the wrap received: already measured
    parts = ([measured if same else amax(latest)] if latest else []) + (
        [] if earlier is None else [earlier]
    )
    largest = parts[0] if len(parts) == 1 else jax.numpy.maximum(*parts)
    if axis_name is not None:
        largest = jax.lax.pmax(largest, axis_name)
    return largest
