"""Loss sets (which losses each traced value feeds) and the one-pass evaluation that uses them.

The *loss set* of a value of the jaxpr is the set of losses whose value depends on it (backward
reachability from the loss outputs). One backward pass then serves several loss scales: each
value's cotangent is kept at its set's *level*, ``s_i`` (loss ``i``'s scale) where only loss
``i`` depends on it and the smallest scale of the set where several do (their cotangents are
summed there; the smallest scale keeps the sum from overflowing). Where the set changes along
an edge of the jaxpr (a value used by an equation of a smaller set, an equation's output used by
fewer losses), :func:`jdls.rescale_boundary` converts the cotangent from the consumer's level to
the producer's. Each boundary also measures, backward, whether the cotangent it converts is
finite, and blames the losses that set the level of the region that made it: the finite flag
of a loss then covers its own region even where it has no parameters of its own. A non-finite
cotangent does not cross a boundary (zeros go on into the producer's region, and the boundary
records that it reached that region): each region's overflows are its own, so an overflow in
one loss's head does not blame the losses of the trunk it feeds, and the caller makes the
gradients the cotangent would have reached NaN, so that the step is still skipped.

The cotangent of a value of a one-loss set ``{i}`` is ``s_i`` times loss ``i``'s own gradient,
without its weight; that of a value of a several-loss set ``S`` is ``min(s_j, j in S)`` times
the weighted sum of the gradients of the losses of ``S``: the weight ``w_i`` enters at the edges
from ``{i}`` into a shared region, and at the unscaling of a parameter of ``{i}`` (in float32).
With powers of two, the one backward pass is that of ``sum(w_i * loss_i)`` times exact powers of
two, wherever nothing underflows or overflows.

``jit`` (``pjit``) and ``closed_call`` equations are inlined, so that branches inside a jitted
model function are seen (unless the ``jit`` constrains shardings or layouts: then it is
atomic); every other higher-order primitive (``custom_jvp_call``, ``custom_vjp_call``,
``scan``, ``cond``, ``while``, ``remat``, ``shard_map``...) is one atomic equation: its inputs
and outputs may carry several sets, and inside it the cotangent runs at the level of the union
(coarser, still exact).

A site's value (``jdls.Site``, ``jdls/_sites/``) among the inputs is *fixed*: its cotangent is
the site's measurement, not a gradient, so no boundary converts it (nor measures it), and
neither any value computed from site values alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jdls._numerics.axes import vary_like
from jdls._numerics.checks import is_float

__all__ = ["EMPTY", "Levels", "Scope", "all_sets", "analyze", "evaluate", "var_set"]

LossSet = frozenset[int]

#: The set of a value on which no loss depends (or that no differentiated input reaches).
EMPTY: LossSet = frozenset()

_F32 = jnp.float32

#: The output variable of an equation that nothing reads (``jax.extend.core.DropVar`` in recent
#: jax, ``jax.core.DropVar`` before).
_DROP_VAR: type = getattr(jcore, "DropVar", None) or jax.core.DropVar  # type: ignore[attr-defined]

# The call primitives whose sub-jaxpr is inlined, and the parameter holding it.
_INLINED = {
    jcore.primitives.jit_p: "jaxpr",
    jcore.primitives.closed_call_p: "call_jaxpr",
}


def _sub_jaxpr(eqn: Any) -> jcore.ClosedJaxpr | None:
    """The closed sub-jaxpr of a ``jit`` or ``closed_call`` equation to inline, else None.

    A ``jit`` with sharding or layout constraints is not inlined: inlining would drop them.
    """
    key = _INLINED.get(eqn.primitive)
    if key is None:
        return None
    params = eqn.params
    shardings = [*params.get("in_shardings", ()), *params.get("out_shardings", ())]
    if any(type(s).__name__ != "UnspecifiedValue" for s in shardings):
        return None
    if any(x is not None for x in (*params.get("in_layouts", ()), *params.get("out_layouts", ()))):
        return None
    sub = eqn.params[key]
    return sub if isinstance(sub, jcore.ClosedJaxpr) else None


class Scope:
    """The analysis of one jaxpr at one place of the trace (an inlined jaxpr called twice has
    two scopes): which variables depend on the differentiated inputs (``live``), their loss
    sets, each atomic equation's set, and the scopes of its inlined equations; the ``fixed``
    variables (sites' values) carry measurements, never converted."""

    def __init__(self, closed: jcore.ClosedJaxpr) -> None:
        self.jaxpr = closed.jaxpr
        self.consts = closed.consts
        self.live: set[Any] = set()
        self.fixed: set[Any] = set()
        self.sets: dict[Any, LossSet] = {}
        self.eqn_sets: dict[int, LossSet] = {}
        self.subs: dict[int, Scope] = {}


def var_set(scope: Scope, v: Any) -> LossSet:
    """The loss set of an atom of ``scope``'s jaxpr (a literal's is empty)."""
    return scope.sets.get(v, EMPTY) if isinstance(v, jcore.Var) else EMPTY


def _forward(closed: jcore.ClosedJaxpr, in_live: Sequence[bool], in_fixed: Sequence[bool]) -> Scope:
    """Which variables depend on the live inputs (only they carry cotangents), which are
    computed from fixed inputs alone; the scopes of the inlined equations."""
    scope = Scope(closed)
    live, fixed = scope.live, scope.fixed
    live.update(v for v, on in zip(scope.jaxpr.invars, in_live, strict=True) if on)
    fixed.update(v for v, on in zip(scope.jaxpr.invars, in_fixed, strict=True) if on)
    for k, eqn in enumerate(scope.jaxpr.eqns):
        eqn_in = [isinstance(v, jcore.Var) and v in live for v in eqn.invars]
        eqn_fixed = [isinstance(v, jcore.Var) and v in fixed for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            inner = scope.subs[k] = _forward(sub, eqn_in, eqn_fixed)
            out_live = [isinstance(v, jcore.Var) and v in inner.live for v in sub.jaxpr.outvars]
            out_fixed = [isinstance(v, jcore.Var) and v in inner.fixed for v in sub.jaxpr.outvars]
        else:
            out_live = [any(eqn_in)] * len(eqn.outvars)
            from_live = [f for f, on in zip(eqn_fixed, eqn_in, strict=True) if on]
            out_fixed = [bool(from_live) and all(from_live)] * len(eqn.outvars)
        live.update(v for v, on in zip(eqn.outvars, out_live, strict=True) if on)
        fixed.update(v for v, on in zip(eqn.outvars, out_fixed, strict=True) if on)
    return scope


def _backward(scope: Scope, out_sets: Sequence[LossSet]) -> None:
    """The loss sets of ``scope``'s variables, given those of its outputs."""
    sets = scope.sets

    def add(v: Any, s: LossSet) -> None:
        if s and isinstance(v, jcore.Var) and v in scope.live:
            sets[v] = sets.get(v, EMPTY) | s

    for v, s in zip(scope.jaxpr.outvars, out_sets, strict=True):
        add(v, s)
    for k in reversed(range(len(scope.jaxpr.eqns))):
        eqn = scope.jaxpr.eqns[k]
        outs = [var_set(scope, v) for v in eqn.outvars]
        inner = scope.subs.get(k)
        if inner is not None:
            _backward(inner, outs)
            for v, iv in zip(eqn.invars, inner.jaxpr.invars, strict=True):
                add(v, var_set(inner, iv))
            continue
        s = frozenset().union(*outs)
        if s:
            scope.eqn_sets[k] = s
            for v in eqn.invars:
                add(v, s)


def all_sets(scope: Scope) -> list[LossSet]:
    """Every nonempty loss set of ``scope`` and its inlined scopes, in a fixed order."""
    found: set[LossSet] = set(scope.sets.values()) | set(scope.eqn_sets.values())
    for inner in scope.subs.values():
        found.update(all_sets(inner))
    found.discard(EMPTY)
    return sorted(found, key=lambda s: (len(s), sorted(s)))


def analyze(
    closed: jcore.ClosedJaxpr,
    in_live: Sequence[bool],
    out_sets: Sequence[LossSet],
    in_fixed: Sequence[bool] | None = None,
) -> Scope:
    """The loss sets of every variable of ``closed``.

    Args:
      closed: the traced function, from ``jax.make_jaxpr``.
      in_live: per input, whether it is differentiated (a float leaf of the argnums).
      out_sets: per output, the losses it is (``{i}`` for loss ``i``; empty for aux).
      in_fixed: per input, whether it is a site's value, whose cotangent is a measurement
        that no boundary converts (default: none).

    Returns:
      The top scope: ``var_set(scope, v)`` is the set of an input or output ``v``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jdls._scales.loss_sets import analyze, var_set
      >>> closed = jax.make_jaxpr(lambda w, h: (jnp.sum(w * h), jnp.sum(h)))(1.0, 2.0)
      >>> scope = analyze(closed, [True, True], [frozenset({0}), frozenset({1})])
      >>> [sorted(var_set(scope, v)) for v in closed.jaxpr.invars]
      [[0], [0, 1]]
    """
    fixed = [False] * len(in_live) if in_fixed is None else in_fixed
    scope = _forward(closed, in_live, fixed)
    _backward(scope, out_sets)
    return scope


Sinks = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


@jax.custom_vjp
def _measured_rescale(x: jax.Array, ratio: jax.Array, sinks: Sinks, marks: Sinks) -> jax.Array:
    del ratio, sinks, marks
    return x


def _measured_fwd(
    x: jax.Array, ratio: jax.Array, sinks: Sinks, marks: Sinks
) -> tuple[jax.Array, Any]:
    return x, (ratio, marks, jax.tree_util.tree_map(jnp.zeros_like, sinks))


def _measured_bwd(res: Any, g: jax.Array) -> tuple[Any, ...]:
    ratio, (region, entered, own, inverse_level), zero_sinks = res
    dtype = jnp.promote_types(g.dtype, _F32)
    out = (g.astype(dtype) * ratio.astype(dtype)).astype(g.dtype)
    # A non-finite value made in the consumer's region is blamed there; it does not enter the
    # producer's region, whose own overflows stay its own (the caller poisons the gradients
    # it reaches, so that a skipped step stays skipped).
    out = jnp.where(jnp.isfinite(g), out, jnp.zeros_like(out))
    amax = jnp.max(jnp.abs(g)).astype(_F32) if g.size else jnp.zeros((), _F32)
    finite = jnp.isfinite(amax)  # the cotangent as the consumer's region made it
    flags = (
        (~finite).astype(_F32) * region,
        (~finite).astype(_F32) * entered,
        jnp.where(finite, amax * jnp.abs(ratio), 0.0) * own,
        jnp.where(finite, amax * inverse_level, 0.0) * own,
    )
    sinks = tuple(vary_like(f, z) for f, z in zip(flags, zero_sinks, strict=True))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, (region, entered, own, inverse_level))
    return out, jnp.zeros_like(ratio), sinks, zeros


_measured_rescale.defvjp(_measured_fwd, _measured_bwd)


class Levels:
    """The float32 level of each loss set, and the ratios converting cotangents between sets,
    computed once per set (or pair) from the traced scales and weights (one ``Levels`` per
    differentiation).

    Args:
      scales: per loss, its scale (a float32 scalar, a power of two for exactness).
      weights: per loss, its float32 weight, or None for 1.
    """

    def __init__(self, scales: Sequence[jax.Array], weights: Sequence[jax.Array | None]) -> None:
        self.scales = [jnp.asarray(s, _F32) for s in scales]
        self.weights = list(weights)
        self._levels: dict[LossSet, jax.Array] = {}
        self._ratios: dict[tuple[LossSet, LossSet], jax.Array] = {}
        self._setters: dict[LossSet, jax.Array] = {}
        #: The loss sets whose regions the boundaries report on, by position in ``sinks[0]``.
        self.index: dict[LossSet, int] = {}
        #: Set by the caller before evaluating: float32 zeros, two of one per set of ``index``
        #: and two of one per loss. Backward, each boundary adds to the first whether the
        #: cotangent it converted (made in its consumer's region) was non-finite, to the second
        #: the same at its producer's set (a non-finite value reached that region: it is
        #: replaced by zeros there, the gradients it reaches are poisoned by the caller), and,
        #: where the consumer's region is one loss's own, to the third the largest magnitude it
        #: passed on (converted) and to the fourth that magnitude unscaled.
        self.sinks: Sinks | None = None

    def level(self, s: LossSet) -> jax.Array:
        """``s_i`` for ``{i}``; the smallest scale of the set for several losses."""
        if s not in self._levels:
            self._levels[s] = functools.reduce(jnp.minimum, [self.scales[i] for i in sorted(s)])
        return self._levels[s]

    def setters(self, s: LossSet) -> jax.Array:
        """Per loss (float32 0 or 1): whether it belongs to ``s`` and its scale is ``s``'s
        level. A cotangent of ``s``'s region runs at that level, so an overflow there is
        those losses' (the others' cotangents entered it scaled down)."""
        if s not in self._setters:
            level = self.level(s)
            self._setters[s] = jnp.stack(
                [
                    (scale == level).astype(_F32) if i in s else jnp.zeros((), _F32)
                    for i, scale in enumerate(self.scales)
                ]
            )
        return self._setters[s]

    def ratio(self, producer: LossSet, consumer: LossSet) -> jax.Array:
        """The factor taking a cotangent at ``consumer``'s level to ``producer``'s (a superset)."""
        key = (producer, consumer)
        if key not in self._ratios:
            r = self.level(producer) / self.level(consumer)
            if len(consumer) == 1 < len(producer):  # into a shared region: the weight enters
                (i,) = consumer
                w = self.weights[i]
                if w is not None:
                    r = w * r
            self._ratios[key] = r
        return self._ratios[key]

    def seed(self, s: LossSet, i: int) -> jax.Array:
        """The cotangent of loss ``i``'s output, whose set is ``s`` (float32)."""
        if s == {i}:
            return self.level(s)
        if not s:  # the loss does not depend on the differentiated arguments
            return jnp.zeros((), _F32)
        w = self.weights[i]
        return self.level(s) if w is None else w * self.level(s)

    def convert(self, x: Any, producer: LossSet, consumer: LossSet) -> Any:
        """``x``, through a boundary if the sets differ: the identity forward; backward, the
        cotangent (made at ``consumer``'s level) times the ratio to ``producer``'s level,
        measured into :attr:`sinks`."""
        if not producer or not consumer or producer == consumer or not is_float(x):
            return x
        if self.sinks is None:
            raise RuntimeError("Levels.sinks must be set before evaluating")
        region = jnp.zeros(self.sinks[0].shape, _F32).at[self.index[consumer]].set(1.0)
        entered = jnp.zeros(self.sinks[1].shape, _F32).at[self.index[producer]].set(1.0)
        own = jnp.zeros(self.sinks[2].shape, _F32)
        if len(consumer) == 1:
            own = own.at[next(iter(consumer))].set(1.0)
        marks = (region, entered, own, 1.0 / self.level(consumer))
        return _measured_rescale(x, self.ratio(producer, consumer), self.sinks, marks)

    def culprits(self, s: LossSet, size: jax.Array) -> jax.Array:
        """Per loss (float32 0 or 1), whom a non-finite value in ``s``'s region blames: the
        loss whose scale is the region's level; where several share that scale, those of
        them whose cotangents entered largest (``size``, at least half the largest)."""
        setters = self.setters(s)
        if len(s) == 1:
            return setters
        tied = jnp.where(setters > 0, size, 0.0)
        top = jnp.max(tied)
        largest = (tied >= 0.5 * top) & (setters > 0)
        return jnp.where((jnp.sum(setters) > 1) & (top > 0), largest.astype(_F32), setters)


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """Apply ``eqn``'s primitive to ``invals``, as ``jax.core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None)
    if manager is None:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    else:
        with manager:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def evaluate(scope: Scope, levels: Levels, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate ``scope``'s jaxpr on ``args``, converting cotangents wherever the set changes.

    The forward values are those of the jaxpr (every boundary is the identity forward).
    """
    jaxpr = scope.jaxpr
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def convert(x: Any, v: Any, producer: LossSet, consumer: LossSet) -> Any:
        if isinstance(v, jcore.Var) and v in scope.fixed:  # a site's value: a measurement
            return x
        return levels.convert(x, producer, consumer)

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for k, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        inner = scope.subs.get(k)
        if inner is not None:
            ij = inner.jaxpr
            invals = [
                convert(x, v, var_set(scope, v), var_set(inner, iv))
                for x, v, iv in zip(invals, eqn.invars, ij.invars, strict=True)
            ]
            outs = evaluate(inner, levels, inner.consts, invals)
            outs = [
                convert(y, v, var_set(inner, iv), var_set(scope, v))
                for y, iv, v in zip(outs, ij.outvars, eqn.outvars, strict=True)
            ]
        else:
            s = scope.eqn_sets.get(k, EMPTY)
            if s:
                invals = [
                    convert(x, v, var_set(scope, v), s)
                    for x, v in zip(invals, eqn.invars, strict=True)
                ]
            outs = _bind(eqn, invals)
            if s:
                outs = [
                    convert(y, v, s, var_set(scope, v))
                    for y, v in zip(outs, eqn.outvars, strict=True)
                ]
        for v, y in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, _DROP_VAR):
                env[v] = y
    return [read(v) for v in jaxpr.outvars]
