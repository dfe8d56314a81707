"""Helpers shared by the tests: constants, jit-or-not, exact comparisons, small builders.

Not a test module (no ``test_`` prefix). How the tests import it: ``tests/conftest.py`` puts
the ``tests/`` folder first on ``sys.path`` (it is loaded before any test module, also for
``tests/integration/``), so every test module, wherever it lies under ``tests/``, writes::

    from _helpers import assert_bitwise_equal, maybe_jit, with_and_without_jit

and the same for the other shared modules of ``tests/`` (``_mlp``, ``reference_rules``). The
subprocess workers of ``tests/integration/`` are run as scripts, not by pytest: they put
``tests/`` and the repository root on ``sys.path`` themselves. This works with
``python -m pytest`` and with ``pytest`` alike, from the repository root (``testpaths`` is
``tests``) or on single files.
"""

from __future__ import annotations

import functools
import os
import random
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jdls

#: The repository root (``tests/..``) and the tests folder.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

INF, NAN = float("inf"), float("nan")
F32_MAX = float(np.finfo(np.float32).max)

# --------------------------------------------------------------------------------------------
# With and without jax.jit.
# --------------------------------------------------------------------------------------------

#: Runs a test twice, ``jit=False`` (ids ``eager``) and ``jit=True`` (``jit``); the test
#: passes the function under test through :func:`maybe_jit`.
#: A test run jitted and eagerly. The quick run keeps the jitted case (how a train step runs);
#: the full suite runs both. Eager cases are the slow ones (every operation dispatched on its
#: own), and the quick run must stay under 5 minutes with its install.
with_and_without_jit = pytest.mark.parametrize(
    "jit", [pytest.param(False, id="eager", marks=pytest.mark.full), pytest.param(True, id="jit")]
)
jitted_in_quick_run = with_and_without_jit


def closing_over_sites(fn: Callable) -> Callable:
    """``fn``, a reference that differentiates through sites it closes over on purpose
    (``jax.grad`` of the bare model, the sites held fixed), with ``jdls.SiteNotDifferentiated``
    silenced while it runs or is traced. Everywhere else that warning is an error
    (``pyproject.toml``): every jdls path must differentiate the sites it goes through."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jdls.SiteNotDifferentiated)
            return fn(*args, **kwargs)

    return run


def maybe_jit(fn: Callable, jit: bool) -> Callable:
    """``jax.jit(fn)`` if ``jit``, else ``fn`` itself."""
    return jax.jit(fn) if jit else fn


# --------------------------------------------------------------------------------------------
# Exact comparisons.
# --------------------------------------------------------------------------------------------


def assert_bitwise_equal(a: Any, b: Any) -> None:
    """Same tree structure, and every leaf the same dtype, shape and bytes."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)}: {x} != {y}"


def assert_equal_within_ulps(a: Any, b: Any, ulps: int = 4) -> None:
    """Same tree structure, dtypes and shapes; integer and boolean leaves equal; float leaves
    non-finite at the same places and otherwise within ``ulps`` units in the last place of
    the larger magnitude. For two different programs of the same arithmetic (one device
    against ``pmap``, operands swapped), which XLA may sum in different orders or fuse
    differently, depending on the CPU's vector width: an error of jdls (an average where a
    maximum belongs, a measurement counted as a gradient) is many ulps off."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        where = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, where
        if not np.issubdtype(x.dtype, np.floating):
            assert x.tobytes() == y.tobytes(), f"{where}: {x} != {y}"
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        finite = np.isfinite(x64)
        assert np.array_equal(finite, np.isfinite(y64)), f"{where}: {x} != {y}"
        assert np.array_equal(x64[~finite], y64[~finite], equal_nan=True), f"{where}: {x} != {y}"
        big = np.maximum(np.abs(x64[finite]), np.abs(y64[finite]))
        info = jnp.finfo(x.dtype)
        exponent = np.floor(np.log2(np.maximum(big, float(info.smallest_normal))))
        spacing = 2.0 ** (exponent - info.nmant)
        off = np.abs(x64[finite] - y64[finite])
        assert np.all(off <= ulps * spacing), f"{where}: {x} != {y} (more than {ulps} ulps)"


def tanh_stack(layers: int = 3, width: int = 256) -> tuple[Callable[..., jax.Array], Any, int]:
    """``(loss, params, gradient_buffer)``: ``layers`` float16 tanh layers of ``width`` (the
    model of the compiled-memory tests) and the bytes of one float32 gradient buffer."""

    def loss(params: Any, x: jax.Array) -> jax.Array:
        h = x
        for w in params["w"]:
            h = jnp.tanh(h.astype(jnp.float16) @ w.astype(jnp.float16))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    keys = jax.random.split(jax.random.key(0), layers)
    params = {"w": [jax.random.normal(k, (width, width)) / 16 for k in keys]}
    return loss, params, 4 * layers * width * width


def programs_lowered(fn: Callable[[], Any]) -> int:
    """How many programs ``fn()`` lowers for XLA. Give it shapes no other test uses, so that
    none is in JAX's in-memory caches; it counts whether or not the persistent cache then
    holds the program, so a warm cache cannot hide a regression."""
    seen: list[str] = []
    event = "/jax/core/compile/jaxpr_to_mlir_module_duration"
    listener = lambda e, _d, **_kw: seen.append(e) if e == event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(seen)


def inner_jits(fn: Callable[..., Any], *args: Any) -> set[str]:
    """The names of the ``jax.jit`` calls left in ``fn``'s jaxpr (those not inlined)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return {e.params["name"] for e in jaxpr.eqns if e.primitive.name == "jit"}


def host_bytes(tree: Any) -> list[bytes]:
    """Every leaf of a pytree as raw bytes, for comparisons on the host."""
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


def f32_bits(x: Any) -> np.ndarray:
    """The bit pattern of float32 values (``uint32``), on the host."""
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def bits(x: jax.Array) -> jax.Array:
    """The bit pattern of a float array (for exact comparisons inside jit)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        width = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
        return lax.bitcast_convert_type(x, width)
    return x


def same_bits(a: Any, b: Any) -> jax.Array:
    """Whether two pytrees of arrays are bit for bit equal (a bool scalar, traceable)."""
    flags = [
        jnp.all(bits(x) == bits(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


# --------------------------------------------------------------------------------------------
# Small builders.
# --------------------------------------------------------------------------------------------


def random_like(seed: int, tree: Any) -> Any:
    """Standard-normal float32 arrays shaped like the leaves of ``tree`` (numpy's generator)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.standard_normal(np.shape(p)).astype(np.float32)), tree
    )


def apply_step(tx: optax.GradientTransformation) -> Callable:
    """``step(params, state, grads) -> (params, state)``: ``tx.update`` then ``apply_updates``."""

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@functools.cache
def _jitted_apply_step(tx: optax.GradientTransformation) -> Callable:
    return jax.jit(apply_step(tx))


def run_steps(
    tx: optax.GradientTransformation, grads_seq: Sequence[Any], params: Any, *, jit: bool = True
) -> tuple[Any, Any]:
    """Apply ``tx`` from its initial state to a sequence of gradients; return params, state.

    Under jit, one compiled step per ``tx`` serves every call."""
    step = _jitted_apply_step(tx) if jit else apply_step(tx)
    state = tx.init(params)
    for g in grads_seq:
        params, state = step(params, state, g)
    return params, state


def loss_scale_of(state: Any) -> float:
    """The loss scale held by the ``jdls.wrap`` state inside ``state``, as a Python float."""
    return float(jdls.get_scale(state).loss_scale)


def torch_gradscaler(**kwargs: Any) -> tuple[Any, Callable[[bool], None]]:
    """A real ``torch.amp.GradScaler`` on the CPU and ``step(finite)``, one SGD step with it
    whose loss is finite or inf. Skips the test when torch is not installed."""
    torch = pytest.importorskip("torch")
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)

    def step(finite: bool) -> None:
        opt.zero_grad()
        loss = (p * (1.0 if finite else float("inf"))).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return scaler, step


# --------------------------------------------------------------------------------------------
# Composition matrices: the full matrix or a fixed sample.
# --------------------------------------------------------------------------------------------

#: ``JDLS_FULL_MATRIX=1`` runs every cell of the composition matrices; otherwise a fixed sample.
FULL_MATRIX = os.environ.get("JDLS_FULL_MATRIX") == "1"


def as_pure(tree: Any) -> Any:
    """``tree`` with its Flax NNX Variables replaced by their values (``nnx.as_pure`` from flax
    0.12.7)."""
    from flax import nnx

    if hasattr(nnx, "as_pure"):
        return nnx.as_pure(tree)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree_util.tree_map(
        lambda v: v.get_value() if is_variable(v) else v, tree, is_leaf=is_variable
    )


def pcast_varying(tree: Any, axes: Any) -> Any:
    """``jax.lax.pcast(tree, axes, to="varying")`` (``jax.lax.pvary`` before jax 0.8.2)."""
    if hasattr(lax, "pcast"):
        return lax.pcast(tree, axes, to="varying")
    return lax.pvary(tree, axes)


#: ``jax.enable_x64`` as a context manager (``jax.experimental.enable_x64`` before jax 0.8).
if hasattr(jax, "enable_x64"):
    enable_x64 = jax.enable_x64
else:  # pragma: no cover - jax < 0.8
    import jax.experimental

    enable_x64 = jax.experimental.enable_x64


def covering_sample(
    cells: Sequence[tuple[Any, ...]], axes: Sequence[Sequence[Any]], size: int, seed: int
) -> list[tuple[Any, ...]]:
    """A fixed pseudo-random subset of ``cells`` (at least ``size``, if there are as many) in
    which every value of every axis appears, in the order of ``cells``."""
    shuffled = list(cells)
    random.Random(seed).shuffle(shuffled)
    chosen: list[tuple[Any, ...]] = []
    for axis, values in enumerate(axes):
        for value in values:
            if not any(c[axis] == value for c in chosen):
                chosen.append(next(c for c in shuffled if c[axis] == value and c not in chosen))
    for c in shuffled:
        if len(chosen) >= size:
            break
        if c not in chosen:
            chosen.append(c)
    return sorted(chosen, key=list(cells).index)


def decoded(tree: Any) -> Any:
    """``tree`` with every site's measurement as its values (``.value``), not as the coded
    arrays jdls returns: what a tolerance comparison of measurements should compare."""
    return jax.tree_util.tree_map(
        lambda x: jdls.Site(x.kind, x.value) if jdls.is_site(x) else x, tree, is_leaf=jdls.is_site
    )


# --------------------------------------------------------------------------------------------
# Small models.
# --------------------------------------------------------------------------------------------


def fp8_mlp() -> Any:
    """A two-layer linen MLP (8 -> 16 -> 2) whose dots are FP8 sites with delayed scaling
    (a history of 4): the data-parallel and checkpoint tests' model."""
    import flax.linen as nn

    class Fp8Mlp(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            dot = functools.partial(jdls.fp8.linen.DotGeneral, recipe=jdls.fp8.DelayedScaling(4))
            x = nn.relu(nn.Dense(16, dot_general_cls=dot)(x))
            return nn.Dense(2, dot_general_cls=dot)(x)

    return Fp8Mlp()


def exported_rules() -> set[str]:
    """The names of the rule classes ``jdls.rules`` exports (``Rule`` itself left out): a
    test that walks every rule compares its table with this."""
    return {
        n
        for n in jdls.rules.__all__
        if isinstance(getattr(jdls.rules, n), type)
        and issubclass(getattr(jdls.rules, n), jdls.rules.Rule)
        and n != "Rule"
    }
