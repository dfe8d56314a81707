"""Assertions shared by the tests."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def assert_bitwise_equal(a: Any, b: Any) -> None:
    """Same tree structure, and every leaf the same dtype, shape and bytes."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)}: {x} != {y}"
