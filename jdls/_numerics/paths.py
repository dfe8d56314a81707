"""The plain key of a pytree path entry: how jdls names a place in a tree."""

from __future__ import annotations

from typing import Any

__all__ = ["path_key", "path_name"]


def path_key(entry: Any) -> Any:
    """The key a path entry of ``jax.tree_util.tree_flatten_with_path`` stands for: a dict's
    key (``DictKey``), a sequence's index (``SequenceKey``, ``FlattenedIndexKey``), an
    attribute's name (``GetAttrKey``); any other entry as it is.

    Example:
      >>> import jax
      >>> from jdls._numerics.paths import path_key
      >>> (path, _), = jax.tree_util.tree_flatten_with_path({"a": [7]})[0]
      >>> [path_key(k) for k in path]
      ['a', 0]
    """
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def path_name(path: Any) -> str:
    """A pytree path as jdls names a site in its messages: the plain keys joined by ``/``,
    ``(root)`` for the empty path.

    Example:
      >>> import jax
      >>> from jdls._numerics.paths import path_name
      >>> (path, _), = jax.tree_util.tree_flatten_with_path({"a": [7]})[0]
      >>> path_name(path), path_name(())
      ('a/0', '(root)')
    """
    return "/".join(str(path_key(k)) for k in path) or "(root)"
