"""A two-operand einsum as one FP8 dot, with the roles of its call: the first operand (the
activation) is the site's ``lhs``, the second (the kernel) its ``rhs``.

``jnp.einsum`` contracts two operands in the order its path finder picks: for
``"BSD,3KDH->3BSKH"`` it calls its dot with the kernel first. A ``_dot_general`` hook would
then quantize the kernel by the activation's rules (its tiles, its random bits, its amax
history) and the activation by the kernel's. Here the equation is read once into the
dimension numbers of ``dot_general(x, kernel, ...)`` and a transpose of its result, as
``jnp.einsum`` computes it when it keeps the operands' order, so nothing depends on the path
finder:

1. an axis of size 1 whose label has another size on the other operand is dropped (it
   broadcasts), as ``jnp.einsum`` does;
2. a label on one operand only and not in the output is summed away on that operand;
3. the labels on both operands and in the output are the dot's batch axes (in the output's
   order), those on both and not in the output its contracted axes (sorted), the rest each
   operand's free axes;
4. the dot's result (batch, then ``x``'s free axes, then the kernel's) is transposed into
   the output's order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdls._sites.site import Site
from jdls.fp8._dot import Dims, dot_general

__all__ = ["EinsumPlan", "einsum", "einsum_plan"]

#: Characters that are syntax, not labels (jnp.einsum takes any other character as a label).
_SYNTAX = frozenset(",->.")


@dataclasses.dataclass(frozen=True)
class EinsumPlan:
    """How ``einsum(equation, x, kernel)`` is computed as ``dot_general(x, kernel, dims)``.

    Attributes:
      x_squeeze: the axes of ``x`` of size 1 dropped before anything else (they broadcast).
      x_sum: the axes of ``x`` (after the squeeze) summed away before the dot.
      kernel_squeeze: as ``x_squeeze``, for the kernel.
      kernel_sum: as ``x_sum``, for the kernel.
      dims: the dot's dimension numbers, ``x`` the left operand.
      perm: the transpose of the dot's result into the output's order (``None``: none).
    """

    x_squeeze: tuple[int, ...]
    x_sum: tuple[int, ...]
    kernel_squeeze: tuple[int, ...]
    kernel_sum: tuple[int, ...]
    dims: Dims
    perm: tuple[int, ...] | None


def _check_syntax(term: str, what: str, equation: str) -> None:
    bad = sorted(set(term.replace("...", "")) & _SYNTAX)
    if bad or term.count("...") > 1:
        raise ValueError(
            f"einsum {equation!r}: {what} {term!r} has "
            + (f"the characters {bad}" if bad else "more than one '...'")
            + "; label each axis with one character (e.g. a-z, A-Z), with at most one '...'"
        )


def _term(term: str, ndim: int, which: str, equation: str) -> list[str]:
    """The labels of one operand's axes; ``...`` becomes ``"...0"``, ``"...1"``, ... counted
    from the right, so that two operands' ellipses line up as NumPy broadcasts them."""
    _check_syntax(term, f"the {which} term", equation)
    head, dots, tail = term.partition("...")
    n_ellipsis = ndim - len(head) - len(tail)
    if n_ellipsis < 0 or (n_ellipsis and not dots):
        raise ValueError(
            f"einsum {equation!r}: the {which} term {term!r} labels {len(head) + len(tail)} "
            f"axes but the {which} has {ndim}; give one label per axis (or '...' for the "
            "leading ones)"
        )
    return [*head, *(f"...{i}" for i in reversed(range(n_ellipsis))), *tail]


def _check_labels(labels: list[str], which: str, equation: str) -> None:
    repeated = sorted({n for n in labels if labels.count(n) > 1})
    if repeated:
        raise ValueError(
            f"einsum {equation!r}: the label {repeated[0]!r} repeats within the {which} "
            "(a diagonal); this FP8 einsum takes each label once per operand: take the "
            "diagonal first (jnp.diagonal), then call it"
        )


def _output(spec: str | None, xl: list[str], kl: list[str], equation: str) -> list[str]:
    dots = {n for n in (*xl, *kl) if n.startswith("...")}
    ellipsis = sorted(dots, key=lambda n: -int(n[3:]))  # the leftmost first
    if spec is None:  # implicit: the broadcast axes, then each label used once, sorted
        once = sorted(n for n in {*xl, *kl} if len(n) == 1 and (xl + kl).count(n) == 1)
        return [*ellipsis, *once]
    _check_syntax(spec, "the output", equation)
    head, has_dots, tail = spec.partition("...")
    # without '...' in the output, the broadcast axes are summed, as jnp.einsum does
    out = [*head, *(ellipsis if has_dots else []), *tail]
    _check_labels(out, "output", equation)
    unknown = [n for n in out if n not in xl and n not in kl]
    if unknown:
        raise ValueError(
            f"einsum {equation!r}: the output label {unknown[0]!r} is on neither operand; "
            "every output label must label an axis of x or of the kernel"
        )
    return out


@functools.lru_cache(maxsize=256)
def einsum_plan(
    equation: str, x_shape: tuple[int, ...], kernel_shape: tuple[int, ...]
) -> EinsumPlan:
    """The :class:`EinsumPlan` of a two-operand ``equation`` for operands of these shapes.

    Raises:
      ValueError: the equation does not name two operands, a label repeats within an
        operand (a diagonal), a term's labels do not match its operand's axes, or a label
        on both operands has two sizes neither of which is 1.

    Example:
      >>> from jdls.fp8._einsum import einsum_plan
      >>> plan = einsum_plan("BSD,3KDH->3BSKH", (2, 5, 4), (3, 6, 4, 7))
      >>> plan.dims, plan.perm  # x is the dot's lhs, the kernel its rhs
      ((((2,), (2,)), ((), ())), (2, 0, 1, 3, 4))
    """
    spec = equation.replace(" ", "")
    inputs, arrow, out_spec = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        raise ValueError(
            f"einsum {equation!r} has {len(terms)} operand(s); an FP8 einsum takes two, the "
            "activation then the kernel (e.g. 'btd,df->btf')"
        )
    xl = _term(terms[0], len(x_shape), "x", equation)
    kl = _term(terms[1], len(kernel_shape), "kernel", equation)
    _check_labels(xl, "x", equation)
    _check_labels(kl, "kernel", equation)
    out = _output(out_spec if arrow else None, xl, kl, equation)
    x_size, k_size = dict(zip(xl, x_shape, strict=True)), dict(zip(kl, kernel_shape, strict=True))
    for n in set(x_size) & set(k_size):
        if x_size[n] != k_size[n] and 1 not in (x_size[n], k_size[n]):
            raise ValueError(
                f"einsum {equation!r}: the label {n!r} has size {x_size[n]} on x (shape "
                f"{x_shape}) and {k_size[n]} on the kernel (shape {kernel_shape}); the sizes "
                "must be equal (or one of them 1)"
            )
    # 1. A size-1 axis against another size broadcasts: dropped (jnp.einsum's rule).
    x_squeeze = tuple(i for i, n in enumerate(xl) if x_size[n] == 1 and k_size.get(n, 1) != 1)
    k_squeeze = tuple(i for i, n in enumerate(kl) if k_size[n] == 1 and x_size.get(n, 1) != 1)
    xl = [n for i, n in enumerate(xl) if i not in x_squeeze]
    kl = [n for i, n in enumerate(kl) if i not in k_squeeze]
    # 2. A label of one operand only, not in the output, is summed away on that operand.
    x_sum = tuple(i for i, n in enumerate(xl) if n not in kl and n not in out)
    k_sum = tuple(i for i, n in enumerate(kl) if n not in xl and n not in out)
    xl = [n for i, n in enumerate(xl) if i not in x_sum]
    kl = [n for i, n in enumerate(kl) if i not in k_sum]
    # 3. Batch (the output's order), contracted (sorted, as jnp.einsum), free.
    batch = [n for n in out if n in xl and n in kl]
    contracted = sorted(n for n in xl if n in kl and n not in out)
    x_free = [n for n in xl if n not in kl]
    k_free = [n for n in kl if n not in xl]
    dims: Dims = (
        (tuple(xl.index(n) for n in contracted), tuple(kl.index(n) for n in contracted)),
        (tuple(xl.index(n) for n in batch), tuple(kl.index(n) for n in batch)),
    )
    # 4. The dot's result into the output's order.
    result = [*batch, *x_free, *k_free]
    perm = None if result == out else tuple(result.index(n) for n in out)
    return EinsumPlan(x_squeeze, x_sum, k_squeeze, k_sum, dims, perm)


def _prepare(x: jax.Array, squeeze: Sequence[int], summed: Sequence[int], dtype: Any) -> jax.Array:
    """``x`` with the broadcast axes dropped and the one-sided labels summed, in ``dtype``
    where that is wider, as ``jnp.einsum`` sums them."""
    if squeeze:
        x = lax.squeeze(x, tuple(squeeze))
    if summed:
        if jnp.result_type(x, dtype) != x.dtype:
            x = x.astype(dtype)
        x = lax.reduce(x, np.array(0, x.dtype), lax.add, tuple(summed))
    return x


def _sharding_before(out_sharding: Any, perm: tuple[int, ...] | None) -> Any:
    """The dot's output sharding whose transpose by ``perm`` is ``out_sharding``."""
    if out_sharding is None or perm is None:
        return out_sharding
    if isinstance(out_sharding, jax.sharding.NamedSharding):
        spec = _spec_before(out_sharding.spec, perm)
        return jax.sharding.NamedSharding(out_sharding.mesh, spec)
    if isinstance(out_sharding, jax.sharding.PartitionSpec):
        return _spec_before(out_sharding, perm)
    raise TypeError(
        "out_sharding must be a jax.sharding.NamedSharding or PartitionSpec (or None), got "
        f"{type(out_sharding).__name__}"
    )


def _spec_before(spec: jax.sharding.PartitionSpec, perm: tuple[int, ...]) -> Any:
    entries = tuple(spec) + (None,) * (len(perm) - len(spec))
    inverse = np.argsort(perm)
    return jax.sharding.PartitionSpec(*(entries[i] for i in inverse))


def einsum(
    equation: str,
    x: Any,
    kernel: Any,
    *,
    site: Site,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """``jnp.einsum(equation, x, kernel)`` computed as one FP8 dot, with ``x`` in the site's
    ``lhs`` role and ``kernel`` in its ``rhs`` role, whatever order ``jnp.einsum`` would
    contract them in.

    The roles decide how each operand is scaled: its amax history, its format, its blocks
    (DeepSeek's 1x128 activation tiles against 128x128 weight tiles, NVFP4's 16x16 weight
    tiles). The dot is :func:`jdls.fp8.dot_general`; a label on one operand only and not in
    the output is summed away before it.

    Args:
      equation: a two-operand einsum, ``"x_labels,kernel_labels->output_labels"`` (one
        character per axis, ``...`` for leading axes; without ``->`` the output is NumPy's
        implicit one).
      x: the activation, the dot's left operand.
      kernel: the weight, the dot's right operand.
      site: the dot's FP8 site (:func:`jdls.fp8.init`).
      precision: the forward dot's precision, as for ``jnp.einsum``.
      preferred_element_type: the output dtype (default: the operands' result type).
      out_sharding: the output's sharding (a ``NamedSharding`` or ``PartitionSpec``).

    Returns:
      The einsum, in the output's axis order.

    Raises:
      ValueError: the equation is not one this einsum computes (:func:`einsum_plan`).

    Example:
      >>> import jax, jax.numpy as jnp, jdls
      >>> site = jdls.fp8.init(jdls.fp8.CurrentScaling(power_of_two=True))
      >>> x, w = jnp.ones((2, 5, 4)), jnp.full((3, 6, 4, 7), 0.5)
      >>> y = jdls.fp8.einsum("BSD,3KDH->3BSKH", x, w, site=site)
      >>> y.shape, float(y[0, 0, 0, 0, 0])
      ((3, 2, 5, 6, 7), 2.0)
      >>> loss = lambda site: jdls.fp8.einsum("BSD,3KDH->3BSKH", x, w, site=site).sum()
      >>> float(jax.grad(loss)(site).value.meter.rhs.amax)  # the kernel's amax: the rhs
      0.5
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    plan = einsum_plan(equation, tuple(x.shape), tuple(kernel.shape))
    dtype = (
        jnp.result_type(x, kernel)
        if preferred_element_type is None
        else jnp.dtype(preferred_element_type)
    )
    x = _prepare(x, plan.x_squeeze, plan.x_sum, dtype)
    kernel = _prepare(kernel, plan.kernel_squeeze, plan.kernel_sum, dtype)
    sharding = _sharding_before(out_sharding, plan.perm)
    out = dot_general(x, kernel, plan.dims, precision, dtype, site=site, out_sharding=sharding)
    return out if plan.perm is None else lax.transpose(out, plan.perm)
