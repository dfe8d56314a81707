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
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Site",
    "SiteKind",
    "apply_site",
    "is_site",
    "merge_sites",
    "split_sites",
    "update_sites",
]


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
        the step was taken (``finite``; a skipped step is ``False``). Default: unchanged."""
        del measurement, finite
        return value


@dataclasses.dataclass(frozen=True)
class Site:
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


def is_site(x: Any) -> bool:
    """Whether ``x`` is a :class:`Site` (use as ``is_leaf`` to stop at sites).

    Example:
      >>> import jdls
      >>> jdls.is_site(jdls.Site(jdls.Probe())), jdls.is_site(1.0)
      (True, False)
    """
    return isinstance(x, Site)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _cotangent(measurement: Any, value: Any) -> Any:
    """The measurement as a cotangent of ``value``: each float leaf in its leaf's dtype and
    shape (a shape mismatch is the kind's error), ``float0`` zeros for integer leaves."""
    from jdls._numerics.norm import sum_like, vary_like

    def leaf(m: Any, v: Any) -> Any:
        if m is None:  # no measurement for this part of the value: zeros
            return jax.tree_util.tree_map(lambda u: leaf(jnp.zeros_like(u), u), v)
        if not _is_float(v):
            return np.zeros(jnp.shape(v), jax.dtypes.float0)
        m = jnp.asarray(m).astype(jnp.result_type(v))
        if m.shape != jnp.shape(v):
            raise ValueError(
                f"a site's backward() returned a measurement of shape {m.shape} for a value "
                f"leaf of shape {jnp.shape(v)}: it must have the value's structure and shapes"
            )
        # inside shard_map: a value that varies per device gets its device's measurement; a
        # replicated one the sum over the devices, as JAX gives any replicated input
        return sum_like(vary_like(m, v), v)

    return jax.tree_util.tree_map(leaf, measurement, value, is_leaf=lambda x: x is None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _site_op(kind: SiteKind, x: Any, value: Any) -> Any:
    return kind.forward(x, value)[0]


def _site_fwd(kind: SiteKind, x: Any, value: Any) -> tuple[Any, Any]:
    y, residuals = kind.forward(x, value)
    return y, (residuals, value)


def _site_bwd(kind: SiteKind, saved: Any, g: Any) -> tuple[Any, Any]:
    residuals, value = saved
    g_x, measurement = kind.backward(residuals, g)
    return g_x, _cotangent(measurement, value)


_site_op.defvjp(_site_fwd, _site_bwd)


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


def apply_site(x: Any, site: Site) -> Any:
    """Pass ``x`` through ``site``: the kind's forward pass, and in the backward pass its
    measurement of the cotangent of ``x`` as the cotangent of ``site.value``.

    ``x`` is an array or a pytree; its floating-point leaves go through the site together
    (the others pass unchanged). The site must be one site's value: inside ``lax.scan`` over
    a stack, the slice of the stacked site for this iteration.

    Args:
      x: a value of the forward pass (a layer's output, say).
      site: a :class:`Site` (one, not a stack).

    Returns:
      The kind's forward output (``x`` for probes and boundaries).

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> site = jdls.Site(jdls.Probe())
      >>> def loss(x, site):
      ...     return jnp.sum(jdls.apply_site(jnp.tanh(x), site))
      >>> _, measured = jax.grad(loss, (0, 1))(jnp.ones(3), site)
      >>> jdls.Telemetry.of({"h": measured}).uses.tolist()
      [1.0]
    """
    if not isinstance(site, Site):
        raise TypeError(
            f"apply_site(x, site) takes a jdls.Site as its second argument, got "
            f"{type(site).__name__}: build one with jdls.Site(kind), keep it with the model's "
            "state and pass it in"
        )
    stack = site.kind.stack_shape(site.value)
    if stack:
        raise ValueError(
            f"apply_site got a stack of {math.prod(stack)} {type(site.kind).__name__} sites "
            f"(leading axes {stack}): pass one site, e.g. the slice lax.scan gives each "
            "iteration (scan over the stacked sites with the stacked parameters)"
        )
    leaves, treedef = jax.tree_util.tree_flatten(x)
    floats = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
    if not floats:
        return x
    out = _site_op(site.kind, [leaves[i] for i in floats], site.value)
    leaves = list(leaves)
    for i, y in zip(floats, out, strict=True):
        leaves[i] = y
    return jax.tree_util.tree_unflatten(treedef, leaves)


def split_sites(tree: Any) -> tuple[Any, Any]:
    """``(rest, sites)``: two trees shaped like ``tree``, one with ``None`` in place of every
    :class:`Site`, the other with ``None`` everywhere but the sites.

    On gradients: ``rest`` is what the optimizer gets, ``sites`` the measurements.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> rest, sites = jdls.split_sites({"w": jnp.ones(2), "probe": jdls.Site(jdls.Probe())})
      >>> rest["probe"], sites["w"], type(sites["probe"]).__name__
      (None, None, 'Site')
    """
    rest = jax.tree_util.tree_map(lambda x: None if is_site(x) else x, tree, is_leaf=is_site)
    sites = jax.tree_util.tree_map(lambda x: x if is_site(x) else None, tree, is_leaf=is_site)
    return rest, sites


def merge_sites(rest: Any, sites: Any) -> Any:
    """The inverse of :func:`split_sites`: ``rest`` with the sites of ``sites`` put back.

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> tree = {"w": jnp.ones(2), "probe": jdls.Site(jdls.Probe())}
      >>> jdls.is_site(jdls.merge_sites(*jdls.split_sites(tree))["probe"])
      True
    """

    def pick(s: Any, r: Any) -> Any:
        return s if is_site(s) or isinstance(s, SiteUpdate) else r

    def stop(x: Any) -> bool:
        return x is None or is_site(x) or isinstance(x, SiteUpdate)

    return jax.tree_util.tree_map(pick, sites, rest, is_leaf=stop)


def _update_one(
    site: Site, measured: Site | None, finite: jax.Array, axis_name: Any = None
) -> Site:
    if measured is None:
        return site
    if not isinstance(measured, Site) or measured.kind != site.kind:
        raise ValueError(
            f"update_sites: the measurement of a {type(site.kind).__name__} site is "
            f"{type(measured).__name__}; pass the sites' gradients as the measurements"
        )
    update: Callable[..., Any] = site.kind.update
    for _ in site.kind.stack_shape(site.value):
        update = jax.vmap(update, in_axes=(0, 0, None))
    value = measured.value
    if axis_name is not None:
        value = site.kind.reduce(value, axis_name)
    # the measurement's integer leaves are None (held fixed) or float0: the kind ignores them
    return Site(site.kind, update(site.value, value, finite))


def update_sites(sites: Any, measurements: Any, finite: Any = True, axis_name: Any = None) -> Any:
    """Every :class:`Site` in ``sites`` updated by its kind from its measurement.

    ``measurements`` are the gradients at the sites (:func:`split_sites` of the gradients);
    ``finite`` whether the step was taken (``jdls.stats(opt_state).finite``): a kind decides
    what a skipped step changes (a probe records its statistics either way). A stacked site
    is updated site by site. Leaves that are not sites are returned unchanged.

    Args:
      sites: a pytree holding sites (the model's variables, a dict of sites).
      measurements: the same structure, with the measurements at the sites (``None``
        elsewhere, or the same leaves).
      finite: a boolean scalar.
      axis_name: inside ``shard_map`` or ``pmap`` with each device's own measurements (its
        own copy of the sites): the axis over which each kind combines them
        (:meth:`SiteKind.reduce`), so that every device updates alike.

    Returns:
      ``sites`` with every site's value updated.

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> sites = {"h": jdls.Site(jdls.Probe())}
      >>> loss = lambda x, s: jnp.sum(jdls.apply_site(x * 2.0, s["h"]))
      >>> _, measured = jax.grad(loss, (0, 1))(jnp.ones(4), sites)
      >>> sites = jdls.update_sites(sites, measured)
      >>> jdls.Telemetry.of(sites).amax.tolist()
      [1.0]
    """
    finite = jnp.asarray(finite, bool)
    measured_sites = jax.tree_util.tree_map(
        lambda x: x if is_site(x) else None, measurements, is_leaf=is_site
    )

    def one(site: Any, measured: Any) -> Any:
        return _update_one(site, measured, finite, axis_name) if is_site(site) else site

    return jax.tree_util.tree_map(
        one, sites, measured_sites, is_leaf=lambda x: is_site(x) or x is None
    )


@dataclasses.dataclass(frozen=True)
class SiteUpdate:
    """The new state of a site, as an optimizer update: ``jdls.wrap`` returns one at every
    site of the parameters, and the framework faces (``jdls.equinox.apply_updates``,
    ``jdls.linen.TrainState``) put its ``site`` in place of the old one. A pytree of its own
    kind, so that ``optax.apply_updates`` (which would add it to the old state) refuses it."""

    site: Site


jax.tree_util.register_pytree_node(
    SiteUpdate, lambda u: ((u.site,), None), lambda _, children: SiteUpdate(*children)
)


def is_site_update(x: Any) -> bool:
    """Whether ``x`` is a :class:`SiteUpdate`."""
    return isinstance(x, SiteUpdate)


def put_site_updates(tree: Any, updates: Any) -> Any:
    """``tree`` with every site replaced by the :class:`SiteUpdate` at its place in
    ``updates`` (where ``updates`` has one); other leaves unchanged."""

    def put(x: Any, u: Any) -> Any:
        return u.site if is_site(x) and is_site_update(u) else x

    return jax.tree_util.tree_map(
        put, tree, updates, is_leaf=lambda x: is_site(x) or x is None or is_site_update(x)
    )


def sites_apart(
    init_fn: Callable[..., Any],
    update_fn: Callable[..., Any],
    finite_of: Callable[[Any], jax.Array] | None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """An optax transformation's functions with the sites of the parameters and of the
    gradients kept apart: the transformation never sees them (``None`` in their place: never
    clipped, decayed or counted in a norm). With ``finite_of`` (``jdls.wrap``: the state's
    skip decision), the update at each site is a :class:`SiteUpdate` of the site updated by
    its kind from its measurement; without (``jdls.clip``), the measurement passes on."""

    def init(params: Any) -> Any:
        return init_fn(split_sites(params)[0])

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        rest, measured = split_sites(updates)
        if not any(map(is_site, jax.tree_util.tree_leaves(measured, is_leaf=is_site))):
            return update_fn(updates, state, params, **extra)
        held = None if params is None else split_sites(params)[0]
        out, new_state = update_fn(rest, state, held, **extra)
        if finite_of is None:
            return merge_sites(out, measured), new_state
        if params is None:
            return out, new_state
        sites = split_sites(params)[1]
        new_sites = update_sites(sites, measured, finite_of(new_state))
        wrapped = jax.tree_util.tree_map(
            lambda s: SiteUpdate(s) if is_site(s) else s, new_sites, is_leaf=is_site
        )
        return merge_sites(out, wrapped), new_state

    return init, update
