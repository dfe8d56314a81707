"""The FP8 dots lower to dots of float8 operands: the pattern XLA rewrites into FP8 GEMMs on
GPUs with FP8 units (a ``dot_general`` of two float8 tensors, its scales applied outside)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax.linen import fp8_ops

from jdls import fp8

DN = (((1,), (0,)), ((), ()))

PER_TENSOR = {
    "delayed": fp8.DelayedScaling(),
    "adaptive": fp8.AdaptiveScaling(),
    "current": fp8.CurrentScaling(),
    "flax": fp8.flax_fp8_ops(16),
    "transformer_engine": fp8.transformer_engine(16),
}


def _dot_operand_types(text: str) -> list[tuple[str, str]]:
    """The element types of the two operands of every ``stablehlo.dot_general``."""
    found = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            operands = re.search(r":\s*\(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", line)
            assert operands is not None, line
            found.append(operands.groups())
    return found


def _lowered(loss, *args):
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))))).lower(*args)


@pytest.mark.parametrize("name", PER_TENSOR)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_tensor_recipes_lower_to_float8_dots(name, dtype):
    x, w = jnp.ones((16, 32), dtype), jnp.ones((32, 8), dtype)
    site = fp8.init(PER_TENSOR[name])

    def loss(x, w, site):
        return jnp.sum(fp8.dot_general(x, w, DN, site=site).astype(jnp.float32))

    types = _dot_operand_types(_lowered(loss, x, w, site).as_text())
    # the forward dot (e4m3 x e4m3) and both gradient dots (e5m2 x e4m3)
    assert sorted(types) == sorted(
        [("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN")]
    ), types


def test_flax_direct_op_lowers_to_the_same_dots():
    """The reference: Flax's own FP8 op gives the same three float8 dots."""
    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    meta = {
        f"{r}_{f}": jnp.ones((), jnp.float32) if f == "scale" else jnp.zeros(16, jnp.float32)
        for r in ("lhs", "rhs", "grad")
        for f in ("scale", "amax_history")
    }

    def loss(x, w, meta):
        y = fp8_ops.fp8_scaled_dot_general(
            x, w, DN, preferred_element_type=jnp.float32, quantize_compute_type=jnp.float32,
            **meta,
        )  # fmt: skip
        return jnp.sum(y)

    types = _dot_operand_types(_lowered(loss, x, w, meta).as_text())
    assert sorted(types) == sorted(
        [("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN")]
    ), types


@pytest.mark.parametrize("recipe", [fp8.mx("e4m3"), fp8.deepseek(), fp8.nvfp4()])
def test_block_recipes_are_emulated_in_float32(recipe):
    """Block-scaled recipes dequantize each block, then multiply in float32: exact emulation
    on any backend, not yet XLA's block-scaled GEMM (docs/fp8-blocks.md)."""
    x, w = jnp.ones((16, 256)), jnp.ones((256, 128))
    site = fp8.init(recipe)

    def loss(x, w, site):
        return jnp.sum(fp8.dot_general(x, w, DN, site=site))

    types = _dot_operand_types(_lowered(loss, x, w, site).as_text())
    assert types and all(t == ("f32", "f32") for t in types), types
