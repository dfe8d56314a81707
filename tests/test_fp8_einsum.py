"""jdls.fp8.einsum and the einsum layers: the first operand (the activation) is always the
site's lhs, the second (the kernel) its rhs, whatever order jnp.einsum contracts them in."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import (
    assert_bitwise_equal,
    assert_equal_within_ulps,
    closing_over_sites,
    maybe_jit,
    with_and_without_jit,
)
from flax import nnx
from jax import lax

import jdls
from jdls import fp8

HIGHEST = lax.Precision.HIGHEST


class Case:
    """An equation, the operands' shapes, and by hand: the dimension numbers of
    ``dot_general(x, kernel)``, the transpose of its result, and whether ``jnp.einsum``
    contracts the kernel first."""

    def __init__(self, equation, x_shape, w_shape, dims, perm, swapped):
        self.equation, self.x_shape, self.w_shape = equation, x_shape, w_shape
        self.dims, self.perm, self.swapped = dims, perm, swapped

    def __repr__(self) -> str:
        return self.equation


_NONE: tuple[()] = ()
CASES = [
    # Gemma's fused QKV projection: the "3" is a free axis of the kernel only.
    Case("BSD,3KDH->3BSKH", (2, 5, 32), (3, 2, 32, 16), (((2,), (2,)), (_NONE, _NONE)),
         (2, 0, 1, 3, 4), swapped=True),
    Case("btd,df->btf", (2, 3, 32), (32, 16), (((2,), (0,)), (_NONE, _NONE)), None,
         swapped=False),
    Case("bsnh,nhd->bsd", (2, 3, 2, 16), (2, 16, 16), (((3, 2), (1, 0)), (_NONE, _NONE)),
         None, swapped=False),
    Case("...d,df->...f", (2, 3, 32), (32, 16), (((2,), (0,)), (_NONE, _NONE)), None,
         swapped=False),
    Case("td,fd->ft", (6, 32), (16, 32), (((1,), (1,)), (_NONE, _NONE)), (1, 0), swapped=True),
    Case("btd,dnh->bnth", (2, 3, 32), (32, 2, 16), (((2,), (0,)), (_NONE, _NONE)),
         (0, 2, 1, 3), swapped=True),
    # attention scores: batch axes on both operands
    Case("BTNH,BSNH->BNTS", (2, 3, 2, 16), (2, 5, 2, 16), (((3,), (3,)), ((0, 2), (0, 2))),
         None, swapped=False),
]  # fmt: skip


def _quick_first(cases: list[Case], quick: int = 0) -> list[Any]:
    """The cases as parameters, all but ``cases[quick]`` in the full suite only."""
    return [
        pytest.param(c, id=c.equation, marks=() if i == quick else pytest.mark.full)
        for i, c in enumerate(cases)
    ]


QKV = CASES[0]

RECIPES = {
    "current": fp8.CurrentScaling(),
    "delayed": fp8.DelayedScaling(16),
    "deepseek": fp8.deepseek(),
    "nvfp4": fp8.nvfp4(),
}
#: Recipes that quantize the lhs and the rhs differently (their tiles).
BY_ROLE = ("deepseek", "nvfp4")
#: DeepSeek's tiles (1x128 activations, 128x128 weights) on every equation, the others on
#: Gemma's (the whole test is in the full suite; DeepSeek on Gemma's is its first case).
ROLE_CASES = [
    pytest.param(c, "deepseek", id=f"{c.equation}-deepseek", marks=pytest.mark.full)
    for c in CASES[1:]
] + [
    pytest.param(CASES[0], n, id=f"{CASES[0].equation}-{n}", marks=() if n == "deepseek" else
                 pytest.mark.full)
    for n in RECIPES
]  # fmt: skip


def _spread(key: Any, shape: tuple[int, ...], contracted: tuple[int, ...]) -> jax.Array:
    """Normal values whose slices along the last free axis span 2**-12 to 1: a weight's 2-D
    tile (along that axis) flushes what an activation's tile per row keeps."""
    x = jax.random.normal(key, shape)
    free = [a for a in range(len(shape)) if a not in contracted]
    axis = free[-1] if free else 0
    factors = 2.0 ** jnp.linspace(-12.0, 0.0, shape[axis])
    return x * jnp.expand_dims(factors, [a for a in range(len(shape)) if a != axis])


def _operands(case: Case) -> tuple[jax.Array, jax.Array]:
    """x normal, the kernel spread: quantized as the rhs its small slices are flushed, as
    the lhs they are kept."""
    _, wc = case.dims[0]
    return jax.random.normal(jax.random.key(1), case.x_shape), _spread(
        jax.random.key(2), case.w_shape, wc
    )


def _by_hand(case: Case, x: jax.Array, w: jax.Array, site: jdls.Site) -> jax.Array:
    out = fp8.dot_general(x, w, case.dims, site=site)
    return out if case.perm is None else jnp.transpose(out, case.perm)


def _loss_and_grads(f: Any, x: jax.Array, w: jax.Array, site: jdls.Site, jit: bool) -> Any:
    """The output and the gradients of x, the kernel and the site (the measurement)."""
    c = jax.random.normal(jax.random.key(3), jax.eval_shape(f, x, w, site).shape)

    def loss(x, w, site):
        y = f(x, w, site)
        return jnp.sum(y * c), y

    return maybe_jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True), jit)(x, w, site)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _dequantized(recipe: Any, site: jdls.Site, x: jax.Array, role: str, axes: Any) -> jax.Array:
    """``x`` quantized and dequantized as the forward dot's ``role`` operand."""
    q, _ = recipe.quantize(x, getattr(site.value, role), role, tuple(axes))
    return q.dequantize(jnp.float32)


@pytest.mark.parametrize("case, recipe_name", ROLE_CASES)
@pytest.mark.full  # 10-20 s a case; tests/test_fp8_lowering.py keeps DeepSeek's tiles and
# test_linen_hand_written_parameter_has_its_kernel_in_the_rhs_role the kernel's role quick
def test_the_kernel_is_the_rhs_whatever_order_jnp_einsum_contracts_in(case, recipe_name):
    """The output, both gradients and the measurement are those of the dot written by hand
    with x as lhs, bit for bit; the kernel's amax is in the rhs slot; the output is the
    einsum of the operands quantized by their own roles, not by each other's. (Jitted: the
    eager path is test_output_and_gradients_are_jnp_einsums_where_fp8_is_exact's.)"""
    recipe = RECIPES[recipe_name]
    site = fp8.init(recipe)
    x, w = _operands(case)
    f = lambda x, w, site: fp8.einsum(case.equation, x, w, site=site)  # noqa: E731
    (_, y), (gx, gw, measured) = _loss_and_grads(f, x, w, site, True)
    (_, y0), grads0 = _loss_and_grads(lambda *a: _by_hand(case, *a), x, w, site, True)
    assert_bitwise_equal((y, gx, gw, measured), (y0, *grads0))
    meter = measured.value.meter
    assert float(meter.rhs.amax) == float(jnp.max(jnp.abs(w)))
    assert float(meter.lhs.amax) == float(jnp.max(jnp.abs(x)))
    (xc, wc), _ = case.dims
    qx = _dequantized(recipe, site, x, "lhs", xc)
    qw = _dequantized(recipe, site, w, "rhs", wc)
    expected = jnp.einsum(case.equation, qx, qw, precision=HIGHEST)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6 * float(jnp.max(abs(expected))))
    if recipe_name in BY_ROLE:  # the test tells the roles apart: swapped, the output differs
        swapped = jnp.einsum(
            case.equation,
            _dequantized(recipe, site, x, "rhs", xc),
            _dequantized(recipe, site, w, "lhs", wc),
            precision=HIGHEST,
        )
        assert not np.allclose(swapped, expected, rtol=1e-2, atol=0.0)


def _hook_einsum(equation: str, x: jax.Array, w: jax.Array, site: jdls.Site) -> jax.Array:
    """The einsum as it was: jnp.einsum with the FP8 dot as its ``_dot_general``."""

    def dot(a: Any, b: Any, dims: Any, precision: Any = None, **kw: Any) -> jax.Array:
        pet = kw.get("preferred_element_type")
        return fp8.dot_general(a, b, dims, precision, pet, site=site)

    return jnp.einsum(equation, x, w, _dot_general=dot)


@pytest.mark.parametrize("case", _quick_first(CASES, quick=1))
@pytest.mark.full  # about 5 s; the quick run compares with jnp.einsum in the test below
def test_where_jnp_einsum_kept_the_order_nothing_changes(case):
    """Bit for bit as jnp.einsum with the FP8 dot as its hook (values, gradients and the
    measurement); where it swapped the operands, a recipe that treats both alike gives the
    same values (up to the order XLA sums the transposed product in: a few ulps on an AVX2
    CPU) and the measurement's lhs and rhs change places (it was mislabelled)."""
    recipe = fp8.DelayedScaling(16) if not case.swapped else fp8.CurrentScaling()
    site = fp8.init(recipe)
    x, w = _operands(case)
    new = _loss_and_grads(lambda x, w, s: fp8.einsum(case.equation, x, w, site=s), x, w, site, True)
    old = _loss_and_grads(lambda *a: _hook_einsum(case.equation, *a), x, w, site, True)
    if not case.swapped:
        assert_bitwise_equal(new, old)
        return
    assert_equal_within_ulps(new[0], old[0], ulps=32)
    assert_equal_within_ulps(new[1][:2], old[1][:2], ulps=32)
    new_meter, old_meter = new[1][2].value.meter, old[1][2].value.meter
    assert_bitwise_equal((new_meter.lhs, new_meter.rhs), (old_meter.rhs, old_meter.lhs))


def _exact(key: Any, shape: tuple[int, ...]) -> jax.Array:
    """Values that e4m3 and e5m2 hold exactly, so a power-of-two scaled FP8 dot is exact."""
    return jax.random.choice(key, jnp.array([-2.0, -1.5, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0]), shape)


@with_and_without_jit
@pytest.mark.parametrize("case", _quick_first(CASES))
def test_output_and_gradients_are_jnp_einsums_where_fp8_is_exact(case, jit):
    """With operands and output gradient that FP8 holds exactly, the output and both
    gradients are those of jnp.einsum without FP8, bit for bit."""
    site = fp8.init(fp8.CurrentScaling(power_of_two=True))
    x, w = _exact(jax.random.key(1), case.x_shape), _exact(jax.random.key(2), case.w_shape)
    y_shape = jnp.einsum(case.equation, x, w).shape
    c = _exact(jax.random.key(3), y_shape)

    def loss(f):
        return maybe_jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * c), (0, 1)), jit)

    # the op's arithmetic: the site held fixed, not differentiated
    got = closing_over_sites(loss(lambda x, w: fp8.einsum(case.equation, x, w, site=site)))(x, w)
    expected = loss(lambda x, w: jnp.einsum(case.equation, x, w, precision=HIGHEST))(x, w)
    assert_bitwise_equal(got, expected)


@pytest.mark.parametrize(
    "equation, x_shape, w_shape",
    [
        ("abd,df->bf", (3, 2, 8), (8, 4)),  # "a" summed away on x
        pytest.param("bd,dfg->bf", (2, 8), (8, 4, 3), marks=pytest.mark.full),  # on the kernel
        pytest.param("btd,df", (2, 3, 8), (8, 4), marks=pytest.mark.full),  # implicit: "bft"
        pytest.param("b1d,d1->b1", (2, 1, 8), (8, 3), marks=pytest.mark.full),  # size 1: broadcast
        pytest.param("...d,...df->...f", (5, 2, 8), (2, 8, 4), marks=pytest.mark.full),
    ],
)
def test_sums_implicit_output_and_broadcasting_are_jnp_einsums(equation, x_shape, w_shape):
    site = fp8.init(fp8.CurrentScaling(power_of_two=True))
    x, w = _exact(jax.random.key(1), x_shape), _exact(jax.random.key(2), w_shape)
    y = jax.jit(lambda x, w: fp8.einsum(equation, x, w, site=site))(x, w)
    assert_bitwise_equal(y, jnp.einsum(equation, x, w, precision=HIGHEST))


@pytest.mark.parametrize(
    "equation, x_shape, w_shape, message",
    [
        ("bd,df,fg->bg", (2, 8), (8, 4), "has 3 operand"),
        ("ii,ij->j", (3, 3), (3, 4), "repeats within the x"),
        ("btd,df->btf", (2, 8), (8, 4), "labels 3 axes but the x has 2"),
        ("bd,df->bf", (2, 8), (6, 4), "size 8 on x"),
        ("bd,df->bz", (2, 8), (8, 4), "'z' is on neither operand"),
        ("bd,df->bff", (2, 8), (8, 4), "repeats within the output"),
        ("b.d,df->bf", (2, 8), (8, 4), "has the characters ['.']"),
    ],
)
def test_an_equation_it_cannot_compute_is_refused_with_what_to_do(
    equation, x_shape, w_shape, message
):
    site = fp8.init(fp8.CurrentScaling())
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fp8.einsum(equation, jnp.ones(x_shape), jnp.ones(w_shape), site=site)


@pytest.mark.full  # about 3 s; jax.set_mesh is newer than the oldest supported jax
def test_out_sharding_is_the_outputs_also_where_the_result_is_transposed():
    """Under an explicit mesh the output is sharded as asked, though the dot's result is
    transposed into it, and the values are those without a mesh."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    site = fp8.init(fp8.CurrentScaling(power_of_two=True))
    x, w = _operands(QKV)
    expected = fp8.einsum(QKV.equation, x, w, site=site)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
        ws = jax.device_put(w, NamedSharding(mesh, PartitionSpec()))
        wanted = NamedSharding(mesh, PartitionSpec(None, "data"))
        f = lambda x, w: fp8.einsum(QKV.equation, x, w, site=site, out_sharding=wanted)  # noqa: E731
        y = jax.jit(f)(xs, ws)
        assert y.sharding.spec[:2] == (None, "data")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))


# --------------------------------------------------------------------------------------------
# The frameworks: a hand-written parameter and its einsum.
# --------------------------------------------------------------------------------------------


class _Qkv(nn.Module):
    """Gemma's projection written by hand: ``self.param`` and an einsum."""

    recipe: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("qkv", nn.initializers.normal(1.0), QKV.w_shape)
        return fp8.linen.Einsum(self.recipe, name="qkv_fp8")(QKV.equation, x, w)


@pytest.mark.full  # about 4 s
def test_linen_hand_written_parameter_has_its_kernel_in_the_rhs_role():
    model = _Qkv(fp8.DelayedScaling(4))
    x = jax.random.normal(jax.random.key(1), QKV.x_shape)
    variables = model.init(jax.random.key(0), x)
    assert set(variables["jdls"]) == {"qkv_fp8"}  # the site: "jdls"/<name>/"fp8"
    grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
    meter = grads["jdls"]["qkv_fp8"]["fp8"].value.meter
    assert float(meter.rhs.amax) == float(jnp.max(jnp.abs(variables["params"]["qkv"])))
    assert float(meter.lhs.amax) == float(jnp.max(jnp.abs(x)))


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
        w = self.param("w", nn.initializers.normal(1.0), (h.shape[-1], h.shape[-1]))
        return h + fp8.linen.Einsum(fp8.DelayedScaling(4), name="w_fp8")("btd,df->btf", h, w), None


@pytest.mark.full  # about 2 s
def test_linen_scan_gives_each_layer_its_site_with_its_kernel_as_rhs():
    stack = nn.scan(
        _Layer,
        variable_axes={"params": 0, "jdls": 0},
        split_rngs={"params": True},
        length=3,
    )()
    x = jax.random.normal(jax.random.key(1), (2, 3, 8))
    variables = stack.init(jax.random.key(0), x, None)
    loss = lambda v: jnp.sum(stack.apply(v, x, None)[0] ** 2)  # noqa: E731
    grads = jax.jit(jax.grad(loss))(variables)
    amax = grads["jdls"]["w_fp8"]["fp8"].value.meter.rhs.amax
    w = variables["params"]["w"]
    np.testing.assert_array_equal(amax, jnp.max(jnp.abs(w), axis=(1, 2)))


class _NnxQkv(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.qkv = nnx.Param(jax.random.normal(rngs.params(), QKV.w_shape))
        self.qkv_fp8 = fp8.nnx.Einsum(fp8.DelayedScaling(4))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.qkv_fp8(QKV.equation, x, self.qkv[...])


@pytest.mark.full  # about 5 s
def test_nnx_hand_written_parameter_and_einsum_op_have_the_kernel_as_rhs():
    model = _NnxQkv(nnx.Rngs(0))
    layer = nnx.Einsum(
        "btd,dnh->bnth", (8, 2, 4), einsum_op=fp8.nnx.Einsum(fp8.DelayedScaling(4)),
        rngs=nnx.Rngs(1),
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(2), QKV.x_shape)
    kernels = {"qkv": model.qkv[...], "layer": layer.kernel[...]}
    for name, m, xin in (("qkv", model, x), ("layer", layer, x[..., :8])):
        optimizer = jdls.nnx.Optimizer(m, jdls.wrap(optax.sgd(0.0)), wrt=nnx.Param)
        loss_fn = lambda m, xin=xin: jnp.sum(m(xin) ** 2)  # noqa: E731
        _, grads = jdls.nnx.value_and_grad(loss_fn, jdls.get_scale(optimizer))(m)
        optimizer.update(m, grads)
        op = m.qkv_fp8 if name == "qkv" else m.einsum_op
        history = op.site.get_value().value.rhs.history
        assert float(history[0]) == float(jnp.max(jnp.abs(kernels[name]))), name


@pytest.mark.full  # about 1 s; the quick run has jdls.fp8.einsum in the tests above
def test_equinox_hand_written_parameter_has_its_kernel_in_the_rhs_role():
    eqx = pytest.importorskip("equinox")

    class Qkv(eqx.Module):
        w: jax.Array
        site: jdls.Site

        def __call__(self, x: jax.Array) -> jax.Array:
            return fp8.einsum(QKV.equation, x, self.w, site=self.site)

    model = Qkv(jax.random.normal(jax.random.key(0), QKV.w_shape), fp8.init(fp8.deepseek()))
    x = _spread(jax.random.key(1), QKV.x_shape, (2,))
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2)))(model)
    assert float(grads.site.value.meter.rhs.amax) == float(jnp.max(jnp.abs(model.w)))
