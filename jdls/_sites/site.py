"""State at a site: what a place in the forward pass needs goes in as arrays, what it
measures in the backward pass comes out as arrays.

A *site* is a :class:`Site`: a :class:`SiteKind` (configuration, static) and its ``value``
(a pytree of arrays, data). ``apply_site(x, site)`` is a ``custom_vjp`` of ``x`` and the
site's value: the forward pass may use the value (a scale ratio, an FP8 scale), and the
backward pass returns, as the *cotangent of the value*, the kind's measurement of the
cotangent of ``x`` (statistics, an amax). Differentiating with respect to the sites is
therefore how a train step reads what they measured: nothing is read or written as Python
state while tracing, so ``jax.jit``, ``jax.checkpoint`` / ``nn.remat``, ``lax.scan`` /
``nn.scan``, ``lax.cond``, ``vmap`` and ``shard_map`` simply compose, and a scanned stack has
one site per layer (the values stacked along the scan axis, as the parameters are).

The data path of one step::

    loss, grads = scale.value_and_grad(loss_fn)(params_and_sites, batch)  # sites' grads: measurements
    grads, measurements = split_sites(grads)                              # never given to the optimizer
    updates, opt_state = tx.update(grads, opt_state, params)              # jdls.wrap decides the skip
    sites = update_sites(sites, measurements, jdls.stats(opt_state).finite)

``LossScale.unscale`` leaves sites alone (a measurement is never unscaled); the framework
faces (``jdls.linen.TrainState``, ``jdls.nnx``, ``jdls.equinox``) do the split and the update
for the user.

Where one site's value serves several uses (a loop body closing over it, an inner ``vmap``
over an unbatched value), JAX *sums* the cotangents: a kind's measurement must be a sum that
means something (counts, sums), or each use needs its own value (stacked along the loop axis,
batched along the ``vmap`` axis).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from jdls._numerics.paths import path_name

__all__ = ["Site", "SiteKind", "SiteUpdate", "fresh_site", "is_site", "refuse_halved"]


class SiteKind:
    """What a kind of site does: its state, its forward and backward rules, its update.

    Subclass it as a frozen dataclass: its fields are configuration (static, hashed, part of
    the tree structure of every :class:`Site` of this kind); the arrays live in
    ``Site.value``. Override :meth:`init`, :meth:`backward` and usually :meth:`update`.

    Example:
      >>> import dataclasses, jax, jax.numpy as jnp, jdls
      >>> @dataclasses.dataclass(frozen=True)
      ... class Amax(jdls.SiteKind):  # measures the largest cotangent
      ...     def init(self):
      ...         return jnp.zeros((), jnp.float32)
      ...     def backward(self, residuals, g):  # g: the cotangents of x's float leaves
      ...         return g, jnp.max(jnp.abs(g[0])).astype(jnp.float32)
      ...     def update(self, value, measurement, finite):
      ...         return measurement
      >>> site = jdls.Site(Amax())
      >>> grads = jax.grad(lambda x, s: jnp.sum(jdls.apply_site(x, s) * 3.0), (0, 1))(
      ...     jnp.ones(2), site)
      >>> float(grads[1].value)
      3.0
    """

    def init(self) -> Any:
        """The value of a new site (a pytree of arrays, unstacked)."""
        raise NotImplementedError(f"{type(self).__name__} must define init()")

    def forward(self, x: Any, value: Any) -> tuple[Any, Any]:
        """``(y, residuals)``: the forward pass at the site (default: the identity, the value
        as the residuals)."""
        return x, value

    def backward(self, residuals: Any, g: Any) -> tuple[Any, Any]:
        """``(g_x, measurement)``: the cotangent of ``x`` and the measurement, a pytree with
        the structure of the value (a float leaf in its dtype; integer leaves are ignored).
        JAX sums the measurements of a value used more than once."""
        raise NotImplementedError(f"{type(self).__name__} must define backward()")

    def stack_shape(self, value: Any) -> tuple[int, ...]:
        """The leading axes of ``value`` beyond one site's (a stack of sites; ``()`` for
        one). Default: compared with the shapes of :meth:`init`."""
        return _extra_axes(self, value)

    def reduce(self, measurement: Any, axis_name: Any) -> Any:
        """The measurements of every device (``axis_name``, inside ``shard_map`` or
        ``pmap``) combined into one. Default: the largest (``lax.pmax``)."""
        return jax.tree_util.tree_map(lambda m: jax.lax.pmax(m, axis_name), measurement)

    def update(self, value: Any, measurement: Any, finite: jax.Array) -> Any:
        """The site's value for the next step, from this step's ``measurement`` and whether
        the step was taken (``finite``; a skipped step is ``False``). Default: unchanged.

        Pure and traceable: jdls traces it once per kind and shapes and keeps the trace
        (inlined in a jitted step; called eagerly, one compiled program). Kinds that compare
        equal share it: every field it reads takes part in the dataclass's equality."""
        del measurement, finite
        return value

    def unrecorded(self, measurement: Any) -> jax.Array | None:
        """Whether ``measurement`` is one that :meth:`update` refuses to record because the
        site served more than one use in the step (JAX summed the uses' measurements): a
        boolean array with the stack's shape, or ``None`` for a kind whose measurements add
        up meaningfully. ``jdls.update_sites`` warns, naming the site, where it is true.
        Default: ``None``."""
        del measurement
        return None


class _SiteType(type):
    """The type of sites, whose ``repr`` names jdls's fix: optax and Equinox report a site
    where they expected an update (``optax.apply_updates``, ``optax.MultiSteps`` around the
    wrap, ``optax.adaptive_grad_clip`` in front) by the types of the two subtrees, in JAX's
    "pytree structure error"; the error then says what to use instead."""

    def __repr__(cls) -> str:
        return (
            f"<class '{cls.__module__}.{cls.__qualname__}'> (a jdls site, a probe, a per-layer "
            "scale or FP8 state, where an optax function expected a parameter, a gradient or "
            "an update: jdls.wrap's update at a site is a SiteUpdate. Apply updates with "
            "jdls.apply_updates(params, updates, opt_state) (Equinox: "
            "jdls.equinox.apply_updates; Flax linen: jdls.linen.TrainState.create(..., "
            "params=variables['params'], sites=variables['jdls']); NNX: jdls.nnx.Optimizer); "
            "put optax.MultiSteps and transformations that read "
            "the params inside the wrap: jdls.wrap(optax.MultiSteps(...)), "
            "jdls.wrap(optax.chain(optax.adaptive_grad_clip(...), ...)))"
        )


@dataclasses.dataclass(frozen=True)
class Site(metaclass=_SiteType):
    """A site's kind (static) and value (arrays): a pytree whose leaves are the value's.

    Args:
      kind: a :class:`SiteKind` (configuration).
      value: the arrays (default ``kind.init()``); with leading axes for a stack of sites
        (one per layer of a scanned stack, one per example).

    Example:
      >>> import jax, jdls
      >>> site = jdls.Site(jdls.Probe())
      >>> jax.tree_util.tree_leaves(site)[0].shape  # one probe's statistics
      (6,)
    """

    kind: SiteKind
    value: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, SiteKind):
            raise TypeError(
                f"Site(kind, value) takes a jdls.SiteKind as its kind, got "
                f"{type(self.kind).__name__}; e.g. jdls.Site(jdls.Probe())"
            )
        if self.value is None:
            object.__setattr__(self, "value", self.kind.init())

    def __hash__(self) -> int:
        """The hash of the kind and of the value's tree structure and leaves.

        A site whose value holds arrays is unhashable, as arrays are. Without arrays (the
        static half of an Equinox model, ``eqx.partition(model, eqx.is_array)``, a
        ``jax.jit`` static argument) it hashes whatever containers hold the value (a dict
        of a per-layer scale): equal sites hash equal.

        Example:
          >>> import jax, jdls
          >>> without_arrays = lambda s: jax.tree.map(lambda x: None, s)  # eqx.partition's
          >>> a, b = (jdls.layer_site(jdls.DynamicScale(), 0) for _ in range(2))  # dict values
          >>> hash(without_arrays(a)) == hash(without_arrays(b))
          True
        """
        leaves, treedef = jax.tree_util.tree_flatten(self.value)
        return hash((self.kind, treedef, tuple(leaves)))

    def stacked(self, *shape: int) -> Site:
        """This site repeated along new leading axes (``shape``): one value per layer of a
        stack of ``shape[0]`` layers, say.

        Example:
          >>> import jdls
          >>> jdls.Site(jdls.Probe()).stacked(4).value.shape
          (4, 6)
        """
        value = jax.tree_util.tree_map(
            lambda v: jnp.broadcast_to(v, (*shape, *jnp.shape(v))), self.value
        )
        return Site(self.kind, value)


def _flatten_with_keys(site: Site) -> tuple[tuple[tuple[Any, Any], ...], SiteKind]:
    return ((jax.tree_util.GetAttrKey("value"), site.value),), site.kind


def _unflatten(kind: SiteKind, children: Iterable[Any]) -> Site:
    site = object.__new__(Site)
    object.__setattr__(site, "kind", kind)
    object.__setattr__(site, "value", next(iter(children)))
    return site


jax.tree_util.register_pytree_with_keys(
    Site, _flatten_with_keys, _unflatten, lambda s: ((s.value,), s.kind)
)


class _SiteUpdateType(type):
    """The type of :class:`SiteUpdate`, whose ``repr`` names the fix where a function that
    adds updates to parameters meets one (``eqx.apply_updates``,
    ``optax.add_decayed_weights`` after the wrap): JAX's "pytree structure error" prints it."""

    def __repr__(cls) -> str:
        return (
            f"<class '{cls.__module__}.{cls.__qualname__}'> (jdls.wrap's update at a site: "
            "the site's new state waits in the optimizer state, and no update can be added "
            "to a site. Apply updates with jdls.equinox.apply_updates(model, updates, "
            "opt_state) in place of eqx.apply_updates, jdls.apply_updates(params, updates, "
            "opt_state) in place of optax.apply_updates; put transformations that read the "
            "params inside the wrap: jdls.wrap(optax.chain(..., "
            "optax.add_decayed_weights(wd), ...)))"
        )


class SiteUpdate(metaclass=_SiteUpdateType):
    """``jdls.wrap``'s update at a site: a pytree without leaves.

    A site's new state is not an update that can be added to it (nor scaled, decayed or
    clipped by a transformation after the wrap, which maps no leaf of it): the wrap keeps
    the new state in its own state and puts a ``SiteUpdate`` in the updates, and
    ``jdls.apply_updates`` (``jdls.equinox.apply_updates``) puts the new state in place.
    Functions that would add it to the site (``eqx.apply_updates``, ``optax.apply_updates``,
    ``optax.add_decayed_weights`` after the wrap) fail with JAX's pytree structure error,
    which names the fix.

    Example:
      >>> import jax, jdls
      >>> from jdls._sites.site import SiteUpdate
      >>> jax.tree_util.tree_leaves({"probe": SiteUpdate()})
      []
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "SiteUpdate()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SiteUpdate)

    def __hash__(self) -> int:
        return hash(SiteUpdate)


jax.tree_util.register_pytree_node(SiteUpdate, lambda _: ((), None), lambda _, __: SiteUpdate())


def is_site(x: Any) -> bool:
    """Whether ``x`` is a :class:`Site` (use as ``is_leaf`` to stop at sites).

    Example:
      >>> import jdls
      >>> jdls.is_site(jdls.Site(jdls.Probe())), jdls.is_site(1.0)
      (True, False)
    """
    return isinstance(x, Site)


def fresh_site(site: Site) -> Site:
    """``site`` with its arrays copied: every site's initial value its own buffer (sites made
    from one scale would otherwise share arrays, which a donating ``jax.jit`` refuses).

    Example:
      >>> import jdls
      >>> from jdls._sites.site import fresh_site
      >>> site = jdls.layer_site(jdls.StaticScale(2.0), 0)
      >>> fresh_site(site).value["ratio"] is site.value["ratio"]
      False
    """
    return jax.tree.map(lambda x: jnp.array(x, copy=True), site)


@functools.cache
def _value_shapes(kind: SiteKind) -> Any:
    return jax.eval_shape(kind.init)


def _extra_axes(kind: SiteKind, value: Any) -> tuple[int, ...]:
    """The leading axes of ``value`` beyond one site's (a stack of sites)."""
    one = jax.tree_util.tree_leaves(_value_shapes(kind))
    have = jax.tree_util.tree_leaves(value)
    if len(one) != len(have):
        raise ValueError(
            f"a {type(kind).__name__} site's value has {len(have)} leaves, its kind makes "
            f"{len(one)}: build sites with jdls.Site(kind)"
        )
    extra: tuple[int, ...] | None = None
    for o, h in zip(one, have, strict=True):
        shape = jnp.shape(h)
        n = len(shape) - len(o.shape)
        if n < 0 or tuple(shape[n:]) != tuple(o.shape):
            raise ValueError(
                f"a {type(kind).__name__} site's value has a leaf of shape {shape}, where "
                f"one site's is {o.shape} (with leading stack axes at most)"
            )
        if extra is None:
            extra = tuple(shape[:n])
        elif extra != tuple(shape[:n]):
            raise ValueError(
                f"a {type(kind).__name__} site's value leaves are stacked unevenly: "
                f"{extra} and {tuple(shape[:n])}"
            )
    return extra or ()


def _is_none(x: Any) -> bool:
    return x is None


def refuse_halved(tree: Any, who: str) -> None:
    """Refuse the sites of ``tree`` that a filter split: a ``None`` where a site's value holds
    an array (no kind's value holds ``None``). ``eqx.partition`` does that with a filter
    spec that freezes a site's layer (the whole value goes to the other half), or with
    ``eqx.is_inexact_array`` (a scale's integer counters go to the other half); such a half
    cannot be differentiated, updated or told its scale.

    Example:
      >>> import jax, jdls
      >>> from jdls._sites.site import refuse_halved
      >>> site = jdls.layer_site(jdls.DynamicScale(), 0)
      >>> refuse_halved({"head": site}, "jdls.wrap: tx.init")  # whole: nothing to say
      >>> halved = jax.tree_util.tree_map(lambda x: x if x.dtype.kind == "f" else None, site)
      >>> refuse_halved({"head": halved}, "jdls.wrap: tx.init")
      Traceback (most recent call last):
      ...
      ValueError: jdls.wrap: tx.init: the LayerScale site at head holds None where its value ...
    """
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_site)[0]
    for path, site in found:
        if not is_site(site):
            continue
        if any(x is None for x in jax.tree_util.tree_leaves(site.value, is_leaf=_is_none)):
            where = path_name(path)
            raise ValueError(
                f"{who}: the {type(site.kind).__name__} site at {where} holds None where its "
                "value holds arrays: a filter split it, as eqx.partition does with a "
                "filter_spec that freezes the site's layer, or with eqx.is_inexact_array, "
                "which moves a scale's integer counters to the other half. Keep every site "
                "whole in the half that is differentiated and updated: partition with "
                "eqx.is_array, and freeze a layer's parameters but not its sites, e.g. spec = "
                "jax.tree_util.tree_map(lambda s, x: True if jdls.is_site(x) else s, spec, "
                "model, is_leaf=jdls.is_site)"
            )
