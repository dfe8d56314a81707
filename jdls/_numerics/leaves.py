"""The float leaves of a gradient tree, and how they are laid out across devices.

:func:`flatten_floats` gives the float leaves of a tree (as arrays) with their positions, so
that a transformation can measure and rewrite them and rebuild the tree
(:class:`FloatLeaves`). :func:`check_sharded` and :func:`sharded_flags` read the ``sharded``
argument of ``jdls.wrap``, ``jdls.clip`` and the retries: whether each leaf is split across
the devices of ``axis_name`` (its squared norm then summed over them) or whole on each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdls._numerics.checks import is_float

__all__ = ["FloatLeaves", "check_sharded", "flatten_floats", "sharded_flags"]


class FloatLeaves(NamedTuple):
    """A flattened tree whose float leaves are arrays, with their positions."""

    leaves: list[Any]
    treedef: Any
    float_idx: tuple[int, ...]

    @property
    def floats(self) -> list[jax.Array]:
        """The floating-point leaves, in tree order."""
        return [self.leaves[i] for i in self.float_idx]

    def with_floats(self, floats: Sequence[Any]) -> FloatLeaves:
        """The same tree with its float leaves replaced."""
        leaves = list(self.leaves)
        for i, x in zip(self.float_idx, floats, strict=True):
            leaves[i] = x
        return self._replace(leaves=leaves)

    def unflatten(self) -> Any:
        """The tree."""
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)


def flatten_floats(tree: Any) -> FloatLeaves:
    """Flatten ``tree``, turning its float leaves (Python floats too) into arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    float_idx = tuple(i for i, x in enumerate(leaves) if is_float(x))
    leaves = [jnp.asarray(x) if i in float_idx else x for i, x in enumerate(leaves)]
    return FloatLeaves(leaves, treedef, float_idx)


def check_sharded(axis_name: Any, sharded: Any, clipping: bool, where: str) -> None:
    """``sharded`` needs an ``axis_name``; clipping across an axis needs ``sharded``."""
    if axis_name is None and sharded is not None:
        raise ValueError(f"{where}: sharded={sharded!r} needs an axis_name")
    if axis_name is not None and clipping and sharded is None:
        raise ValueError(
            f"{where}: with axis_name={axis_name!r} and clipping, say how the gradients are laid "
            "out across that axis: sharded=True when each device holds a different part of every "
            "leaf (shard_map with sharded parameters: the squared norms are summed with psum), "
            "sharded=False when every device holds the whole gradient (after lax.pmean, as in "
            "pmap data parallelism), or a pytree prefix of bools for a mix. "
            "See docs/multi-device.md."
        )


def sharded_flags(sharded: Any, grads: Any) -> list[bool] | None:
    """One bool per leaf of ``grads`` from ``sharded`` (None, a bool, a prefix tree, a callable)."""
    if sharded is None:
        return None
    if callable(sharded):
        sharded = sharded(grads)
    if isinstance(sharded, bool | np.bool_):
        return [bool(sharded)] * len(jax.tree_util.tree_leaves(grads))
    try:
        full = jax.tree_util.tree_map(
            lambda flag, sub: jax.tree_util.tree_map(lambda _: bool(flag), sub), sharded, grads
        )
    except ValueError as e:
        raise ValueError(
            "sharded must be a bool or a pytree prefix of the gradients with one bool per "
            f"subtree: {e}"
        ) from None
    return [bool(f) for f in jax.tree_util.tree_leaves(full)]
