"""16-bit storage of a tree in an emulated format: ``compress`` and ``decompress``."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import numpy as np

from jdls._floats.formats import FloatFormat, cbfloat16
from jdls._numerics.checks import is_float_array

__all__ = ["compress", "decompress"]

T = TypeVar("T")


def compress(tree: T, fmt: FloatFormat = cbfloat16) -> T:
    """Encodes the floating-point leaves of a pytree in a format's bits (e.g. uint16).

    Each float array leaf becomes ``fmt.to_bits(leaf)`` (rounded to the format, then
    encoded), halving the memory of float32 leaves for 16-bit formats. Other leaves (integer
    arrays, Python scalars, strings) are returned unchanged and ``None`` stays ``None``.
    Works under ``jax.jit``.

    Args:
      tree: a pytree; its float array leaves must be float32, float16 or bfloat16.
      fmt: the format to store in; defaults to :data:`cbfloat16`.

    Returns:
      A pytree of the same structure with float leaves replaced by arrays of
      ``fmt.storage_dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jdls
      >>> packed = jdls.compress({"w": jnp.ones((2, 3)), "step": jnp.array(3)})
      >>> packed["w"].dtype, packed["step"].dtype
      (dtype('uint16'), dtype('int32'))
    """
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"fmt must be a jdls.FloatFormat (e.g. jdls.cbfloat16), got {fmt!r}")
    return jax.tree_util.tree_map(lambda x: fmt.to_bits(x) if is_float_array(x) else x, tree)


def decompress(tree: T, fmt: FloatFormat = cbfloat16) -> T:
    """Decodes the leaves that :func:`compress` produced back to float32.

    Every array leaf whose dtype is ``fmt.storage_dtype`` is decoded with ``fmt.from_bits``;
    all other leaves are returned unchanged. A tree that had its own integer leaves of that
    dtype (e.g. uint16 token ids with a 16-bit format) would have them decoded too: keep such
    leaves out of the tree you compress. ``decompress(compress(t, f), f)`` equals
    ``fmt.round`` on every float leaf, bit for bit.

    Args:
      tree: a pytree produced by :func:`compress` with the same ``fmt``.
      fmt: the format the tree was stored in; defaults to :data:`cbfloat16`.

    Returns:
      A pytree of the same structure with encoded leaves replaced by float32 arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> import jdls
      >>> tree = {"w": jnp.array([0.1, 1e-12])}
      >>> back = jdls.decompress(jdls.compress(tree))
      >>> bool((back["w"] == jdls.cbfloat16.round(tree["w"])).all())
      True
    """
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"fmt must be a jdls.FloatFormat (e.g. jdls.cbfloat16), got {fmt!r}")
    storage = fmt.storage_dtype

    def leaf(x: Any) -> Any:
        if isinstance(x, np.ndarray | jax.Array) and x.dtype == storage:
            return fmt.from_bits(x)
        return x

    return jax.tree_util.tree_map(leaf, tree)
