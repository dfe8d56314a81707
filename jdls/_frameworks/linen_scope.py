"""The ``"jdls"`` collection of a linen model's sites, and the check that a module can read
or make its site: :func:`require_site` raises :class:`MissingSitesError`, which names the
omission (``"jdls"`` missing from an ``nn.scan``'s ``variable_axes``, from the ``mutable`` of an
``apply`` used as ``init``, or from the variables an evaluation applies the model with) and the
line that fixes it."""

from __future__ import annotations

import re
from typing import NamedTuple

from flax import errors
from flax.core import Scope

__all__ = ["LAYER_SCALE", "PROBE", "SITES", "MissingSitesError", "Outer", "require_site"]

#: The variable collection that holds the sites of a linen model.
SITES = "jdls"
#: The variable names of a module's probe and per-layer scale in :data:`SITES`.
PROBE = "probe"
LAYER_SCALE = "layer_scale"


class MissingSitesError(errors.ScopeCollectionNotFound, ValueError):
    """A module reads a site of the ``"jdls"`` collection that is not in the variables and
    cannot be made there; the message says which omission it is and the line that fixes it.

    A Flax ``ScopeCollectionNotFound`` (code catching that one catches this one too) and a
    ``ValueError``.
    """

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)  # not FlaxError's: no link to Flax's page of its own

    def __reduce__(self) -> tuple[type[MissingSitesError], tuple[str]]:
        return (type(self), (str(self),))


class Outer(NamedTuple):
    """What the model's own scope (outside every lifted transformation) holds of the sites:
    whether ``"jdls"`` is mutable there, whether variables of it were given, and whether
    ``"params"`` is mutable (an ``apply`` that initialises)."""

    mutable: bool
    given: bool
    params_mutable: bool


#: What the site of each variable name is, in the errors.
_WHAT = {PROBE: "probe", LAYER_SCALE: "per-layer scale", "fp8": "FP8 dot"}

_FIX_LIFT = (
    'the {lift} on the way does not carry the collection "jdls": add "jdls": 0 to its '
    'variable_axes, as the parameters, e.g. nn.scan(Block, variable_axes={{"params": 0, '
    '"jdls": 0}}, split_rngs={{"params": True}}, length=n)'
)
_FIX_INIT = (
    'an apply that makes the variables (mutable=["params"] used as init) does not make '
    'the sites: add "jdls" to mutable, model.apply(variables, *args, rngs=rngs, '
    'mutable=["params", "jdls"]) (model.init makes every collection)'
)
_FIX_EVAL = (
    'the model is applied with {"params": ...} only (an evaluation, a sampler): pass its '
    'sites too, model.apply({"params": params, "jdls": variables["jdls"]}, *args) '
    "(state.variables of a jdls.linen.TrainState holds both)"
)
_FIX_OTHER = (
    'the "jdls" variables given hold no such site here: they were made by another model '
    "(before jdls.linen.probes or layer_scales wrapped it, or with other FP8 layers); make "
    "them with this model's init"
)


def _lift(scope: Scope) -> str | None:
    """The lifted transformations ``scope`` runs inside (``"nn.scan at /scan(Block_0)"``),
    or None outside every one (the root of a lifted scope has a name; the model's has none)."""
    if scope.root.name is None:
        return None
    path = [str(p) for p in scope.debug_path]
    lifted = [k for k, p in enumerate(path) if re.match(r"\w+\(", p)]
    if not lifted:
        return "lifted transformation"
    names = sorted({path[k].split("(")[0] for k in lifted})
    where = "/" + "/".join(path[: lifted[-1] + 1])
    return f"{' or '.join('nn.' + n for n in names)} (at {where})"


def require_site(scope: Scope, name: str, outer: Outer | None = None) -> None:
    """Raise :class:`MissingSitesError` if the site ``name`` of the ``"jdls"`` collection can
    be neither read nor made at ``scope``: the message names the fix where the scope (and,
    from the model's wrapper, ``outer``) tells which of the usual omissions it is, and lists
    them all where it cannot. Call it where a module reads its site, before the variable."""
    if scope.has_variable(SITES, name) or scope.is_mutable_collection(SITES):
        return
    lift = _lift(scope)
    fixes: list[str]
    if not scope.is_collection_empty(SITES):
        fixes = [_FIX_OTHER]
    elif lift is None:  # the model's own scope: the apply itself lacks the sites
        fixes = [_FIX_INIT if scope.is_mutable_collection("params") else _FIX_EVAL]
    elif (outer is not None and (outer.mutable or outer.given)) or (
        outer is None and scope.flags.get("initializing", False)
    ):
        fixes = [_FIX_LIFT.format(lift=lift)]  # made or given outside, dropped by the lift
    else:  # the apply lacks them, and the lift may as well (it cannot be seen from inside)
        init_like = outer.params_mutable if outer is not None else None
        if init_like is None:
            init_like = scope.is_mutable_collection("params")
        fixes = [_FIX_INIT if init_like else _FIX_EVAL, _FIX_LIFT.format(lift=lift)]
    what = _WHAT.get(name, "site")
    head = (
        f'jdls: the {what} site "{name}" of the collection "jdls" at {scope.path_text} is not '
        'in the variables, and "jdls" is not mutable there to make it. '
    )
    if len(fixes) == 1:
        raise MissingSitesError(head + "The cause: " + fixes[0] + ".")
    listed = " ".join(f"({k + 1}) {fix}." for k, fix in enumerate(fixes))
    raise MissingSitesError(head + "Check each of these (all may apply): " + listed)
