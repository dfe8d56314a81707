"""``flax.serialization`` of the loss scales and the sites (data only; the rule or the kind
comes from the target), so that ``to_bytes``/``from_bytes`` of any state holding one work.

Registered on import: the public faces ``jdls.linen`` and ``jdls.nnx`` import this module.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import serialization

from jdls._scales.scale import DynamicScale, NoOpScale, StaticScale
from jdls._sites.site import Site


def _restore(target: Any, state: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    if set(state) != set(fields):
        raise ValueError(
            f"cannot restore a {type(target).__name__} from the saved fields {sorted(state)} (a "
            f"{type(target).__name__} has {sorted(fields)}): build the target with the same "
            "kind of scale as the one that was saved"
        )
    return {f: serialization.from_state_dict(getattr(target, f), state[f], f) for f in fields}


def _register_serialization(cls: type, fields: tuple[str, ...]) -> None:
    def to_state(scale: Any) -> dict[str, Any]:
        return {f: serialization.to_state_dict(getattr(scale, f)) for f in fields}

    def from_state(target: Any, state: dict[str, Any]) -> Any:
        leaves = _restore(target, state, fields)
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(target),
            jax.tree_util.tree_leaves([leaves[f] for f in fields]),
        )

    serialization.register_serialization_state(cls, to_state, from_state)


_register_serialization(DynamicScale, ("loss_scale", "state"))
_register_serialization(StaticScale, ("loss_scale",))
_register_serialization(NoOpScale, ())


def _site_to_state(site: Site) -> dict[str, Any]:
    return {"value": serialization.to_state_dict(site.value)}


def _site_from_state(target: Site, state: dict[str, Any]) -> Site:
    # the kind (configuration) comes from the target, as a scale's rule does
    return Site(target.kind, serialization.from_state_dict(target.value, state["value"], "value"))


serialization.register_serialization_state(Site, _site_to_state, _site_from_state)
