"""Sites in a Flax NNX model: probes and per-layer scales as ``SiteVariable``s of the modules.

:func:`probes_nnx` and ``jdls/_frameworks/nnx_layer_scales.py`` give modules of an NNX model
:class:`SiteVariable` attributes (``jdls_probe``, ``jdls_probe#2``, ``jdls_probe.decode``,
``jdls_layer_scale``) holding :class:`jdls.Site`s, and swap each such module's class for a
subclass whose ``__call__`` and public methods pass the output through the site of the call
that the instance holds. The sites are the model's state: they are split, merged, stacked
(``nnx.vmap``), scanned (``nnx.scan``), rematerialised (``nnx.remat``) and jitted
(``nnx.jit``) with it, and a module acts on its sites whenever it holds them. The one Python
state read while tracing is which call of a method this is: counted from the outermost
probed call of a pass, per trace (a body traced twice counts afresh each time). The train
step with sites is in ``nnx_step``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core.tracers import current_trace

from jdls._frameworks.linen_sites import probe_name
from jdls._frameworks.nnx_model import SiteVariable, modules_in_order
from jdls._numerics.checks import holds_floats
from jdls._scales.layer_site import note_applied
from jdls._sites.apply import apply_site
from jdls._sites.probe import Probe
from jdls._sites.site import Site

__all__ = ["LAYER_SCALE", "attach_site", "probes_nnx"]

PROBE = "jdls_probe"
LAYER_SCALE = "jdls_layer_scale"
_ORIGINAL = "_jdls_sites_of"


def _has_call(cls: type) -> bool:
    return any("__call__" in vars(c) for c in cls.__mro__ if c is not object)


#: The classes every NNX module derives from: their public methods (``sow``, ``train``) are
#: not layers' methods, and never probed.
_BASES = frozenset(nnx.Module.__mro__)


def _public_methods(cls: type, own: bool = False) -> list[str]:
    """The public methods of the module class ``cls`` whose outputs can get a probe (``encode``,
    ``decode``, ``nnx.Embed.attend``), in the order they were defined (a base class's
    first); with ``own``, only those defined by classes outside Flax (the model's own code).
    Not ``__call__``, not a property, a static or class method, nor a method of ``nnx.Module``
    itself."""
    if isinstance(cls, type) and issubclass(cls, nnx.List | nnx.Dict):
        return []
    found: dict[str, None] = {}
    for c in reversed(cls.__mro__):
        if c in _BASES or c is object or _ORIGINAL in vars(c):
            continue
        if own and c.__module__.split(".")[0] == "flax":
            continue
        for name, value in vars(c).items():
            if not name.startswith("_") and inspect.isfunction(value):
                found[name] = None
    return list(found)


def _probe_attr(method: str, use: int) -> str:
    """The attribute holding the probe after the ``use``-th call (from 1) of ``method`` in
    one pass: ``"jdls_probe"``, ``"jdls_probe.decode"``, ``"jdls_probe#2"`` (linen's
    :func:`probe_name` with the NNX prefix; :class:`jdls.Telemetry` names the rows alike)."""
    return "jdls_" + probe_name(method, use)


_ATTR = re.compile(r"jdls_probe(?:\.([A-Za-z_]\w*))?(?:#(\d+))?")


def _call_of(attr: str) -> tuple[str, int] | None:
    """``(method, use)`` of a probe attribute (:func:`_probe_attr`), or None."""
    match = _ATTR.fullmatch(attr)
    if match is None:
        return None
    return match.group(1) or "__call__", int(match.group(2) or 1)


class _Calls:
    """The probed method calls of one pass of a model (from the outermost probed call to its
    return): which modules are inside one of their own methods, and how many times each
    module's method returned so far in each trace."""

    def __init__(self) -> None:
        self.calling: list[int] = []
        # per trace: (the trace, {(module id, method): calls}); a lifted transformation traces
        # its body in a trace of its own, and may trace it more than once: the k-th call of a
        # method in a trace takes the k-th probe, the same one on every trace
        self.traces: list[tuple[Any, dict[tuple[int, str], int]]] = []
        self.alive: list[Any] = []  # the modules counted, kept alive so that ids stay theirs

    def count(self, module: Any, method: str) -> int:
        trace = current_trace()
        counts = next((c for held, c in self.traces if held == trace), None)
        if counts is None:
            counts = {}
            self.traces.append((trace, counts))
        key = (id(module), method)
        if key not in counts:
            self.alive.append(module)
        use = counts[key] = counts.get(key, 0) + 1
        return use


_CALLS: contextvars.ContextVar[_Calls | None] = contextvars.ContextVar(
    "jdls_nnx_calls", default=None
)
#: While :func:`probes_nnx` runs the model on its example inputs: the calls, in the order
#: they returned, as (the module's identity, method, use).
_RECORD: contextvars.ContextVar[list[tuple[int, str, int]] | None] = contextvars.ContextVar(
    "jdls_nnx_record", default=None
)


def _identity(module: Any) -> int | None:
    """The smallest position of the probes ``module`` holds (unique to it while
    :func:`probes_nnx` runs the example pass; it travels with the sites into the copies
    that ``nnx.split`` / ``nnx.merge`` and the lifted transformations make), or None."""
    positions = [
        v.get_value().kind.position
        for v in vars(module).values()
        if isinstance(v, SiteVariable)
        and isinstance(v.get_value().kind, Probe)
        and v.get_value().kind.position is not None
    ]
    return min(positions) if positions else None


def _after(module: Any, method: str, use: int, out: Any) -> Any:
    """``out`` of the ``use``-th call of ``module.method`` through the sites it holds: the
    call's probe (the method's first one where the module has none for this use: one probe
    serving several uses, whose row counts them), then, after ``__call__``, the per-layer
    scale (the probe sees the layer's own scale)."""
    own = vars(module)
    first = method == "__call__" and use == 1
    if first or holds_floats(out, refuse=(nnx.Module, nnx.Variable)):
        record = _RECORD.get()
        if record is not None:
            identity = _identity(module)
            if identity is not None:
                record.append((identity, method, use))
        probe = own.get(_probe_attr(method, use))
        if not isinstance(probe, SiteVariable):
            probe = own.get(_probe_attr(method, 1))
        if isinstance(probe, SiteVariable):
            site = probe.get_value()
            stack = site.kind.stack_shape(site.value)
            if stack:
                raise ValueError(
                    f"jdls.nnx.probes: a {type(module).__name__} holds a stack of {stack[0]} "
                    "probes (one per layer) but was called outside a loop over the layers "
                    "(nnx.scan, nnx.vmap): stacked= must name only stacks made by nnx.vmap "
                    "and run by nnx.scan; drop this module from stacked="
                )
            note_applied(site)
            out = apply_site(out, site)
    if method == "__call__":
        scale = own.get(LAYER_SCALE)
        if isinstance(scale, SiteVariable):
            site = scale.get_value()
            note_applied(site)  # checked by jdls.nnx.layer_scaled_value_and_grad
            out = apply_site(out, site)
    return out


def _probed(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a module's method) with its output passed through the sites of the call."""

    @functools.wraps(original)  # the signature NNX inspects (``rngs``) stays the original's
    def probed(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls = _CALLS.get()
        if calls is not None and id(self) in calls.calling:
            # super().__call__, a method calling another of the module's own: one call, one
            # site (the outermost method's)
            return original(self, *args, **kwargs)
        token = None
        if calls is None:  # the outermost probed call: a pass of its own, counted afresh
            calls = _Calls()
            token = _CALLS.set(calls)
        try:
            calls.calling.append(id(self))
            try:
                out = original(self, *args, **kwargs)
            finally:
                calls.calling.pop()
            return _after(self, method, calls.count(self, method), out)
        finally:
            if token is not None:
                _CALLS.reset(token)

    return probed


@functools.cache
def _with_sites(cls: type) -> type:
    namespace: dict[str, Any] = {"__module__": cls.__module__, _ORIGINAL: cls}
    if _has_call(cls):
        namespace["__call__"] = _probed("__call__", cls.__call__)  # type: ignore[operator]
    for name in _public_methods(cls):
        namespace[name] = _probed(name, getattr(cls, name))
    return type(cls.__name__, (cls,), namespace)


def attach_site(module: Any, name: str, site: Site) -> None:
    """Give ``module`` the attribute ``name`` holding ``site`` (a :class:`SiteVariable`), its
    class swapped, once, for the subclass whose calls pass their outputs through the sites."""
    cls: Any = type(module)
    if _ORIGINAL not in vars(cls):
        object.__setattr__(module, "__class__", _with_sites(cls))
    setattr(module, name, SiteVariable(site))


def probes_nnx(
    model: Any,
    *example_args: Any,
    compute_dtype: Any = "float16",
    stacked: Callable[[Any], Any] | None = None,
    **example_kwargs: Any,
) -> Any:
    """Give the modules of the NNX ``model`` (the model included) a :class:`jdls.Probe` after
    each call, in place; returns ``model``.

    The probes are :class:`SiteVariable` attributes named as ``jdls.linen.probes`` names its
    variables (:func:`probe_name`): ``jdls_probe`` after a module's ``__call__``,
    ``jdls_probe.decode`` after its method ``decode``, ``jdls_probe#2`` after its second call
    in one pass. Their gradients (``jdls.nnx.value_and_grad``) are what they measured, one row
    of :meth:`jdls.Telemetry.of` each: ``"layers/0"``, ``"embedder.decode"``,
    ``"dropout#2"``.

    With example inputs (``model(*example_args, **example_kwargs)``: arrays or
    ``jax.ShapeDtypeStruct``), the model runs once abstractly (``nnx.eval_shape``: nothing is
    computed, no state changes) and every call of a module's ``__call__`` or public method
    (``encode``, ``nnx.Embed.attend``) that returns floats gets a probe of its own: a dropout
    applied twice per block gets two rows. The rows then follow the order in which the calls
    returned in that pass. Without them, each module with a ``__call__`` gets one probe there,
    and each public method defined by the model's own classes (not Flax's) one; a module
    called twice shares its probe between the two uses, whose row then reads ``amax`` NaN
    with ``uses`` 2. The k-th call of a method in a pass (counted afresh in each trace, so a
    body that ``nnx.remat`` or ``nnx.scan`` traces twice takes the same probes) takes its
    k-th probe; a call without one goes through the method's first probe, a method without
    any unprobed.

    Each probe's ``position`` (the forward order of :meth:`jdls.Telemetry.of`'s rows) is
    set here: the order of the example pass, and without one the order the modules'
    attributes were assigned (each module after its submodules, siblings in assignment
    order; ``nnx.Sequential``: its list order). Call it where the model is built, before
    ``nnx.split`` / ``nnx.merge``, ``nnx.jit`` or a checkpoint's restore rebuild the modules
    with their attributes sorted by name; the positions then travel with the sites. The
    model's own probes are named after its class. A stack of layers made by ``nnx.vmap`` (and
    run by ``nnx.scan``) is named by ``stacked`` (``lambda m: m.layers``, or a tuple of such
    modules): the probes of its modules get its leading axis, one per layer (rows
    ``layers/attn[2]``). Calling this function inside the vmapped constructor does the same.

    Args:
      model: an NNX module (changed in place).
      *example_args: inputs of one call of ``model``, optional.
      compute_dtype: the format whose flushing to zero the probes count.
      stacked: for a model with stacks of layers made by ``nnx.vmap``: a function of the
        model returning the stack (or a tuple of stacks), e.g. ``lambda m: m.layers``.
      **example_kwargs: keyword inputs of that call.

    Raises:
      ValueError: a site other than a probe is reachable under two paths (one
        ``jdls.fp8.nnx.DotGeneral`` passed to several layers).

    Example:
      >>> import jax.numpy as jnp, jdls
      >>> from flax import nnx
      >>> model = jdls.nnx.probes(nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
      ...                                        nnx.Linear(4, 1, rngs=nnx.Rngs(1))))
      >>> loss = lambda m, x: jnp.sum(m(x))
      >>> _, grads = jdls.nnx.value_and_grad(loss, jdls.StaticScale(8.0))(model, jnp.ones((2, 3)))
      >>> jdls.Telemetry.of(grads).names  # forward order: the layers, then the model
      ('layers/0', 'layers/1', 'Sequential')
      >>> class Twice(nnx.Module):  # one module used twice: a row per use
      ...     def __init__(self):
      ...         self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
      ...     def __call__(self, x):
      ...         return self.linear(self.linear(x))
      >>> model = jdls.nnx.probes(Twice(), jnp.ones((2, 3)))
      >>> _, grads = jdls.nnx.value_and_grad(loss, jdls.StaticScale(8.0))(model, jnp.ones((2, 3)))
      >>> jdls.Telemetry.of(grads).names
      ('linear', 'linear#2', 'Twice')
    """
    modules = [
        (path, module)
        for path, module in modules_in_order(model, "jdls.nnx.probes")
        if not isinstance(module, nnx.List | nnx.Dict)
    ]
    kind = Probe(compute_dtype)
    layers = _stack_sizes(model, stacked)
    markers: list[tuple[Any, str]] = []  # the probes of methods made here, without a call yet
    for _, module in modules:
        cls = vars(type(module)).get(_ORIGINAL, type(module))
        wanted = [_probe_attr("__call__", 1)] if _has_call(cls) else []
        methods = [_probe_attr(m, 1) for m in _public_methods(cls, own=True)]
        for attr in (*wanted, *methods):
            if not isinstance(vars(module).get(attr), SiteVariable):
                site = Site(kind)
                size = layers.get(id(module))
                attach_site(
                    module, attr, _stacked_as(module, site) if size is None else site.stacked(size)
                )
                if attr in methods:
                    markers.append((module, attr))
    _place(modules, None)  # unique positions: a module's identity in the example pass
    if not example_args and not example_kwargs:
        return model
    returned = _example_pass(model, example_args, example_kwargs)
    holder = {
        variable.get_value().kind.position: module
        for _, module in modules
        for _, variable in _probes_of(module)
    }
    order: dict[tuple[int, str], int] = {}
    for identity, method, use in returned:
        module = holder.get(identity)
        if module is None:
            continue  # a module with no probe to know it by
        attr = _probe_attr(method, use)
        if not isinstance(vars(module).get(attr), SiteVariable):
            attach_site(module, attr, _stacked_as(module, Site(kind)))
        order.setdefault((id(module), attr), len(order))
    for module, attr in markers:  # a method the pass never called: no row
        if (id(module), attr) not in order:
            delattr(module, attr)
    _place(modules, order)
    return model


def _stack_sizes(model: Any, stacked: Callable[[Any], Any] | None) -> dict[int, int]:
    """``{id(module): number of layers}`` for every module of the stacks ``stacked(model)``
    names (made by ``nnx.vmap``: every array has the leading axis of the layers)."""
    if stacked is None:
        return {}
    roots = stacked(model)
    roots = roots if isinstance(roots, tuple | list) else (roots,)
    sizes: dict[int, int] = {}
    for root in roots:
        if not isinstance(root, nnx.Module):
            raise TypeError(
                f"jdls.nnx.probes: stacked= must return the stack's module (made by nnx.vmap), "
                f"or a tuple of them; got {type(root).__name__}"
            )
        arrays = [x for x in jax.tree_util.tree_leaves(nnx.state(root)) if jnp.ndim(x) > 0]
        if not arrays or len({jnp.shape(x)[0] for x in arrays}) != 1:
            raise ValueError(
                f"jdls.nnx.probes: stacked= named a {type(root).__name__} whose arrays do not "
                "share one leading axis (the number of layers, as nnx.vmap makes them): name "
                "only stacks of layers"
            )
        size = int(jnp.shape(arrays[0])[0])
        for _, module in modules_in_order(root, "jdls.nnx.probes"):
            sizes[id(module)] = size
    return sizes


def _probes_of(module: Any) -> list[tuple[str, SiteVariable]]:
    """The probes ``module`` holds after its calls, in the order of its methods (``__call__``,
    then the others as they were defined), each method's uses in order."""
    cls = vars(type(module)).get(_ORIGINAL, type(module))
    rank = {m: k for k, m in enumerate(["__call__", *_public_methods(cls)])}
    found = []
    for attr, variable in vars(module).items():
        call = _call_of(attr)
        if call is None or not isinstance(variable, SiteVariable):
            continue
        if isinstance(variable.get_value().kind, Probe):
            method, use = call
            found.append(((rank.get(method, len(rank)), method, use), attr, variable))
    return [(attr, variable) for _, attr, variable in sorted(found, key=lambda f: f[0])]


def _stacked_as(module: Any, site: Site) -> Site:
    """``site`` stacked as the first probe ``module`` holds (a module of a stack made by
    ``nnx.vmap``: one per layer), or as it is."""
    for _, variable in _probes_of(module):
        held = variable.get_value()
        return site.stacked(*held.kind.stack_shape(held.value))
    return site


def _example_pass(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The probed calls of ``model(*args, **kwargs)`` run abstractly, in the order they
    returned: ``(the module's identity, method, use)`` (:func:`_identity`), each once."""
    record: list[tuple[int, str, int]] = []
    token = _RECORD.set(record)
    try:
        nnx.eval_shape(lambda m, a, kw: m(*a, **kw), model, args, kwargs)
    except Exception as error:
        stack = "leading axis" in str(error)
        raise ValueError(
            f"jdls.nnx.probes: the model could not be run on the example inputs given "
            f"(model(*example_args, **example_kwargs), abstractly: {error}). "
            + (
                "A stack of layers made by nnx.vmap and run by nnx.scan needs its probes "
                "stacked with its layers: name it, jdls.nnx.probes(model, ..., "
                "stacked=lambda m: m.layers)"
                if stack
                else "Pass the inputs of one call of the model, or none (a probe per module "
                "and method, one per use only with inputs)"
            )
        ) from error
    finally:
        _RECORD.reset(token)
    return list(dict.fromkeys(record))


def _place(modules: list[tuple[tuple[Any, ...], Any]], order: dict[Any, int] | None) -> None:
    """Number every probe of ``modules`` in forward order: each module after its submodules
    (``modules``' order), its own probes in :func:`_probes_of`'s order; where ``order`` (the
    example pass: ``(id(module), attribute)`` -> rank) is given, the probes it saw by their
    rank, each other one right after the probe before it."""
    listed = [
        (path, module, attr, variable)
        for path, module in modules
        for attr, variable in _probes_of(module)
    ]
    keys: list[tuple[float, int]] = []
    carry = -1.0
    for k, (_, module, attr, _) in enumerate(listed):
        rank = None if order is None else order.get((id(module), attr))
        carry = max(carry, float(rank)) if rank is not None else carry
        keys.append((float(rank) if rank is not None else carry, k))
    ranked = sorted(range(len(listed)), key=keys.__getitem__)
    for position, k in enumerate(ranked):
        path, module, _, variable = listed[k]
        site = variable.get_value()
        name = None if path else type(module).__name__
        variable.set_value(
            Site(dataclasses.replace(site.kind, position=position, name=name), site.value)
        )
