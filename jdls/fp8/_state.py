"""The FP8 state of one dot, held as a jdls site, and its update from a step's measurement.

An FP8 dot is a *site* (``jdls/_sites/site.py``): a :class:`jdls.Site` whose kind is
:class:`Fp8` (the recipe, configuration) and whose value is a :class:`DotState` (arrays):
the recipe's state of the three tensors of the dot (``lhs``, ``rhs``, the output gradient
``grad``) and a ``meter``. The dot (:func:`jdls.fp8.dot_general`) returns the step's
:class:`Meter` as the cotangent of the meter and zeros for the rest, so differentiating the
loss with respect to the site gives its measurement, and ``jdls.update_sites`` (or a
framework's train step) computes the next step's state. The meter's own value holds the last
measurement, for telemetry. Nothing is overwritten with a gradient; an optimizer, clipping or
weight decay never sees the state.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jdls._sites.site import Site, SiteKind, is_site
from jdls._transforms.stats import step_applied
from jdls.fp8._recipe import ROLES, Measurement, Recipe, register_fields

__all__ = [
    "DotState",
    "Fp8",
    "Meter",
    "init",
    "needs_key",
    "replace_states",
    "states",
    "step_applied",
    "telemetry",
]


@struct.dataclass
class Meter:
    """One :class:`Measurement` per tensor of a dot."""

    lhs: Measurement
    rhs: Measurement
    grad: Measurement

    @classmethod
    def zeros(cls) -> Meter:
        return cls(Measurement.zeros(), Measurement.zeros(), Measurement.zeros())

    @classmethod
    def empty(cls) -> Meter:
        """Nothing measured yet: amaxes of ``-inf`` (a maximum's identity), fractions 0."""
        zero = jnp.zeros((), jnp.float32)
        m = Measurement(
            amax=jnp.full((), -jnp.inf, jnp.float32), saturated=zero, flushed=zero, error=zero
        )
        return cls(m, m, m)


@struct.dataclass
class DotState:
    """The arrays of one FP8 dot site.

    Attributes:
      lhs, rhs, grad: the recipe's state of the left operand, the right operand and the
        output gradient (``recipe.init(role)``).
      meter: the last step's :class:`Meter`; its cotangent is the step's measurement.
      pending: the largest finite measurements of the steps since the state was last
        updated (steps skipped, or micro-batches of a step not yet applied); an amax of
        ``-inf`` when there were none.
      uses: float32, how many times the last step used the site; its cotangent is 1 per use
        (JAX sums the cotangents of a value used several times). Where it is not 1, the
        meter holds JAX's sum of the uses' measurements (or nothing), which is not recorded:
        :func:`telemetry` reports NaN there.
    """

    lhs: Any
    rhs: Any
    grad: Any
    meter: Meter
    pending: Meter
    uses: jax.Array


# ``uses`` came after the other fields: a state saved before it restores the target's (a
# freshly initialised state counts none).
register_fields(DotState, "jdls.fp8.DotState", frozenset({"uses"}))


@dataclasses.dataclass(frozen=True)
class Fp8(SiteKind):
    """The site kind of an FP8 dot: its recipe.

    Args:
      recipe: the FP8 recipe (e.g. :class:`jdls.fp8.DelayedScaling`).

    Measurements of several devices combine by their maximum: inside ``shard_map`` the dot
    takes it over the axes the site is replicated on; under ``pmap`` pass ``axis_name`` to
    ``jdls.update_sites`` (the default ``SiteKind.reduce``, ``lax.pmax``).
    """

    recipe: Recipe
    #: its output gradient is measured unscaled: told the loss scale of its cotangent
    #: (``jdls/_sites/backward_scale.py``) on the global, per-layer and per-loss paths
    reads_loss_scale: ClassVar[bool] = True

    def init(self) -> DotState:
        lhs, rhs, grad = (self.recipe.init(role) for role in ROLES)
        return DotState(
            lhs=lhs,
            rhs=rhs,
            grad=grad,
            meter=Meter.zeros(),
            pending=Meter.empty(),
            uses=jnp.zeros((), jnp.float32),
        )

    def backward(self, residuals: Any, g: Any) -> tuple[Any, Any]:
        raise TypeError("an FP8 site is used by jdls.fp8.dot_general, not jdls.apply_site")

    def accumulate(self, a: DotState, b: DotState) -> DotState:
        """Two micro-batches' measurements: the maximum of each (the step's amax is the
        largest of its micro-batches'; each micro-batch uses the site once, so the uses stay
        1, and a micro-batch that used it twice flags the step). The largest *finite*
        measurements ride in ``pending`` beside them, so that a micro-batch that overflowed
        (an amax of inf in the meter, for telemetry) does not hide the others' from the
        scales."""
        both = jax.tree.map(jnp.maximum, a, b)
        pending = jax.tree.map(
            jnp.maximum,
            jax.tree.map(jnp.maximum, _finite_part(a.pending), _finite_part(a.meter)),
            jax.tree.map(jnp.maximum, _finite_part(b.pending), _finite_part(b.meter)),
        )
        return dataclasses.replace(both, pending=pending)

    def unrecorded(self, measurement: DotState) -> jax.Array:
        """Where the site served more than one use in the step: :meth:`update` records
        nothing there, and ``jdls.update_sites`` warns."""
        return jnp.asarray(measurement.uses) > 1

    def update(self, value: DotState, measurement: DotState, finite: jax.Array) -> DotState:
        """The next state from this step's measurement (``measurement.meter``).

        When ``finite`` (the step was applied), the largest finite measurements since the last
        applied step (this one's included) go to the recipe; otherwise (a skipped step, or a
        micro-batch of ``optax.MultiSteps`` before its step) they wait in ``pending``. An amax
        that is not finite never reaches the recipe. The meter keeps this step's measurement
        and ``uses`` its number of uses.

        A measurement is recorded only where the site served exactly one use
        (``measurement.uses == 1``). Used twice, JAX has summed the uses' measurements (an
        amax too large); not used, there is nothing to record. Either way the step adds
        nothing to the history or to ``pending``, as if the site had not been in it, and
        :func:`jdls.fp8.telemetry` reports its amax as NaN.
        """
        # in float32 whatever the state was cast to (a model cast to float16 whole): an
        # FP8 scale (2**-20 and below) is not a float16 number
        value, measurement = (jax.tree.map(_float32, tree) for tree in (value, measurement))
        new = measurement.meter
        once = measurement.uses == 1
        usable = jax.tree.map(lambda m, e: jnp.where(once, m, e), new, Meter.empty())

        def finite_max(p: jax.Array, m: jax.Array) -> jax.Array:
            return jnp.where(jnp.isfinite(m), jnp.maximum(p, m), p)

        pending = jax.tree.map(finite_max, value.pending, usable)
        # micro-batches (:meth:`accumulate`): their finite measurements, kept apart from an
        # overflowed one's inf (a single backward pass leaves zeros here)
        accumulated = jax.tree.map(
            lambda m, e: jnp.where(once, m, e), _finite_part(measurement.pending), Meter.empty()
        )
        pending = jax.tree.map(finite_max, pending, accumulated)
        applied = jnp.asarray(finite, bool)
        skipped = jnp.logical_not(applied)
        roles = {}
        for role in ROLES:
            old = getattr(value, role)
            updated = self.recipe.update(old, getattr(pending, role), role, skipped)
            roles[role] = jax.tree.map(lambda u, o: jnp.where(applied, u, o), updated, old)
        empty = Meter.empty()
        pending = jax.tree.map(lambda e, p: jnp.where(applied, e, p), empty, pending)
        return DotState(**roles, meter=new, pending=pending, uses=measurement.uses)


def _finite_part(meter: Meter) -> Meter:
    """``meter`` with every amax that is not a finite, positive number replaced by ``-inf``
    (nothing, for a maximum): a cotangent's zeros and an overflow's inf are not amaxes."""

    def one(m: Measurement) -> Measurement:
        ok = jnp.isfinite(m.amax) & (m.amax > 0)
        return dataclasses.replace(m, amax=jnp.where(ok, m.amax, -jnp.inf))

    return Meter(lhs=one(meter.lhs), rhs=one(meter.rhs), grad=one(meter.grad))


def _float32(x: Any) -> Any:
    x = jnp.asarray(x)
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def needs_key(recipe: Recipe) -> bool:
    """Whether a new site of ``recipe`` draws its own random seed (stochastic rounding)."""
    return hasattr(recipe, "seeded")


def init(
    recipe: Recipe, key: jax.Array | None = None, *, stack: int | tuple[int, ...] = ()
) -> Site:
    """A new FP8 dot site: ``jdls.Site(jdls.fp8.Fp8(recipe))``, or a stack of them.

    Args:
      recipe: the FP8 recipe.
      key: a ``jax.random`` key for a recipe that rounds stochastically (NVFP4): each site
        draws its own seed from it, so that the layers of a stack round independently.
        Without it the recipe's ``seed`` is used. Other recipes ignore it.
      stack: leading axes of a stack of sites, e.g. ``(n_layers,)`` for the layers of a
        ``lax.scan`` or ``eqx.filter_vmap`` stack (each with its own seed when ``key`` is
        given).

    Example:
      >>> import jax, jdls
      >>> site = jdls.fp8.init(jdls.fp8.DelayedScaling(history_length=8))
      >>> site.value.lhs.history.shape, float(site.value.grad.scale)
      ((8,), 1.0)
      >>> stack = jdls.fp8.init(jdls.fp8.nvfp4(), jax.random.key(0), stack=(4,))
      >>> len(set(stack.value.grad.seed.tolist()))  # one seed per layer
      4
    """
    stack = (int(stack),) if isinstance(stack, int) else tuple(int(n) for n in stack)
    if stack:
        if key is None or not needs_key(recipe):
            return init(recipe).stacked(*stack)
        keys = jax.random.split(key, stack)
        make = functools.partial(init, recipe)
        for _ in stack:
            make = jax.vmap(make)
        return make(keys)
    site = Site(Fp8(recipe))
    if key is None or not needs_key(recipe):
        return site
    keys = jax.random.split(key, len(ROLES))
    seeded = recipe.seeded  # type: ignore[attr-defined]  # needs_key: the recipe has it
    roles = {
        role: seeded(getattr(site.value, role), k) for role, k in zip(ROLES, keys, strict=True)
    }
    return Site(site.kind, dataclasses.replace(site.value, **roles))


def _is_fp8(x: Any) -> bool:
    return is_site(x) and isinstance(x.kind, Fp8)


def _path_name(path: Any) -> str:
    """``"blocks/Dense_0/fp8"`` for a path of dict keys, attributes and indices."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if names and names[-1] == "value":  # the site inside an NNX Variable
        names.pop()
    return "/".join(names)


def _fields(recipe: Recipe) -> tuple[str, ...]:
    measured = ("amax", "saturated", "flushed")
    return (*measured, "error") if getattr(recipe, "measures_error", False) else measured


def telemetry(tree: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """The last measurement of every FP8 site in ``tree``, by path, on the host.

    Returns ``{path: {"lhs" | "rhs" | "grad": {"amax", "saturated", "flushed", "uses"}}}``
    (and ``"error"`` for a recipe that measures it)
    with paths such as ``"params/Dense_0/fp8"``; a stack of sites (a scanned layer) gives
    lists, one entry per layer. ``uses`` is how many times the step used the site. Where it
    is not 1 the measurement was not recorded, and ``amax``, ``saturated`` and ``flushed``
    are NaN: a site used twice (JAX sums the measurements of a shared value) or not used, as
    in a site that has not measured yet. A site used more than once also warns: give each use
    its own site.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> site = jdls.fp8.init(jdls.fp8.CurrentScaling())
      >>> x = jnp.array([[1.0, -3.5]])
      >>> loss = lambda s: jnp.sum(jdls.fp8.dot_general(x, x.T, (((1,), (0,)), ((), ())), site=s))
      >>> site = jdls.update_sites(site, jax.grad(loss)(site))
      >>> jdls.fp8.telemetry({"dense": site})["dense"]["lhs"]
      {'amax': 3.5, 'saturated': 0.0, 'flushed': 0.0, 'uses': 1}
    """
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    shared: list[str] = []
    for path, site in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_fp8)[0]:
        if not _is_fp8(site):
            continue
        meter, uses = jax.device_get((site.value.meter, site.value.uses))
        uses = np.asarray(uses)
        name = _path_name(path)
        if np.any(uses > 1):
            shared.append(f"{name} ({int(uses.max())} uses)")
        rows[name] = {
            role: {
                **{
                    field: np.where(
                        uses == 1, np.asarray(getattr(getattr(meter, role), field)), np.nan
                    ).tolist()
                    for field in _fields(site.kind.recipe)
                },
                "uses": uses.astype(int).tolist(),
            }
            for role in ROLES
        }
    if shared:
        warnings.warn(
            f"FP8 sites used more than once in one step: {', '.join(shared)}. JAX sums the "
            "measurements of a shared site, so they were not recorded and its scales did not "
            "change. Give each use its own site (one jdls.fp8.init per call; under jax.vmap over "
            "examples, the layer called on the whole batch; inside a loop, "
            "sites stacked along the loop axis).",
            stacklevel=2,
        )
    return rows


def states(tree: Any) -> dict[str, DotState]:
    """Every FP8 site's state in ``tree``, by path: one call instead of three levels of
    attributes (``model.dot.site.get_value().value``).

    ``tree`` is anything holding sites: Flax variables or a ``TrainState``'s ``sites``, an
    NNX model or ``nnx.state(model)``, an Equinox model. A stack of sites (a scanned layer)
    gives a stacked state (leading axis: the layers).

    Example:
      >>> import jdls
      >>> sites = {"mlp": {"up": jdls.fp8.init(jdls.fp8.AdaptiveScaling())}}
      >>> state = jdls.fp8.states(sites)["mlp/up"]
      >>> float(state.grad.scale), state.grad.history.shape
      (1.0, (16,))
    """
    return {
        _path_name(path): site.value
        for path, site in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_fp8)[0]
        if _is_fp8(site)
    }


def replace_states(tree: Any, fn: Any) -> Any:
    """``tree`` with every FP8 site's state replaced by ``fn(path, state)``: set a scale,
    restore a history, reset a layer, in one call.

    ``fn`` gets the path (as :func:`states` names it) and the :class:`DotState` (use its
    ``.replace``) and returns the new state, of the same structure. For an NNX model, pass
    its state and update the model with the result:
    ``nnx.update(model, jdls.fp8.replace_states(nnx.state(model), fn))``.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> sites = {"up": jdls.fp8.init(jdls.fp8.DelayedScaling(4))}
      >>> def grad_scale(path, state):  # the output gradient's scale, set by hand
      ...     return state.replace(grad=state.grad.replace(scale=jnp.float32(2.0**-10)))
      >>> sites = jdls.fp8.replace_states(sites, grad_scale)
      >>> float(jdls.fp8.states(sites)["up"].grad.scale)
      0.0009765625
    """

    def one(path: Any, site: Any) -> Any:
        if not _is_fp8(site):
            return site
        new = fn(_path_name(path), site.value)
        old_shape: Any = jax.tree_util.tree_structure(site.value)
        if jax.tree_util.tree_structure(new) != old_shape:
            raise ValueError(
                f"replace_states: fn returned a state of another structure for "
                f"{_path_name(path)!r}; return state.replace(...) of the state it gets"
            )
        return Site(site.kind, new)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_fp8)
