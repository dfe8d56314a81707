"""Cost of a whole train step with dynamic loss scaling: jdls and its peers against a static scale.

One step: scale the loss, differentiate (float16 compute, float32 master parameters), unscale,
check, update with ``adam``, apply. Every variant is jitted with its parameters and optimizer
state donated (the same for all), run interleaved with the others (``benchmarks/_harness.py``)
and compared with the **static scale** baseline measured in the same rounds: the same loss,
scaled by ``jdls.StaticScale(2**15)``, no finiteness check, ``optax.adam``.

Workloads: an 8M-parameter MLP at batch 256 (``step``) and a small decoder-only transformer
(``transformer``). Run::

    python -m benchmarks step
    python -m benchmarks transformer
    python -m benchmarks step --quick     # tiny models, a few rounds

Each variant follows its library's documented pattern:

* jdls: ``scale = jdls.get_scale(state)``, ``scale.value_and_grad``, ``tx.update``
  of ``jdls.wrap(adam)``, ``optax.apply_updates``;
* Flax: ``DynamicScale.value_and_grad`` (its own check and adjustment), then
  ``jnp.where(is_fin, new, old)`` over the parameters and the optimizer state;
* jmp: ``DynamicLossScale.scale``/``unscale``, ``jmp.all_finite``, ``adjust``,
  ``jmp.select_tree``;
* optax: a static scale and ``optax.apply_if_finite(adam)``.

A *skipped* case feeds a batch whose loss is non-finite, so that every call is a skipped step;
after timing, every jdls case is checked to have taken (or skipped) every step as labelled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import optax

import jdls
from benchmarks import _harness as h
from benchmarks import _models as m
from benchmarks.bench_update import minimal_skip

REFERENCE = "reference: static scale + sum of squares + lax.cond"

SCALE = 2.0**15
MAX_NORM = 1.0


class Method(NamedTuple):
    """One way to do a train step: ``init(params) -> state`` and the step itself."""

    init: Callable[[Any], Any]
    step: Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]
    #: ``state -> bool array``: whether the last step was skipped (None: not known).
    skipped: Callable[[Any], jax.Array] | None = None


def adam() -> optax.GradientTransformation:
    return optax.adam(1e-4)


def static_method(loss: Callable[..., jax.Array], tx: optax.GradientTransformation) -> Method:
    """A static loss scale (``jdls.StaticScale``), no check: the baseline."""
    scale = jdls.StaticScale(SCALE)

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = scale.value_and_grad(loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return Method(tx.init, step)


def jdls_method(
    loss: Callable[..., jax.Array], tx: optax.GradientTransformation, retries: int = 0
) -> Method:
    """jdls: the scale lives in the optimizer state of ``jdls.wrap``; with ``retries``, the
    step is ``jdls.retrying(loss, tx, retries=retries)``."""
    if retries:
        step = jdls.retrying(loss, tx, retries=retries)
        return Method(tx.init, step, lambda state: jdls.stats(state).skipped)

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        scale = jdls.get_scale(state)
        value, grads = scale.value_and_grad(loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return Method(tx.init, step, lambda state: jdls.stats(state).skipped)


def flax_method(loss: Callable[..., jax.Array], tx: optax.GradientTransformation) -> Method:
    """Flax's ``DynamicScale`` and the ``jnp.where`` selection of its documentation."""
    from flax.training.dynamic_scale import DynamicScale

    def init(params: Any) -> Any:
        # Array fields, so that the first step does not change the state's types.
        scale = DynamicScale(fin_steps=jnp.zeros((), jnp.int32), scale=jnp.float32(SCALE))
        return scale, tx.init(params), jnp.array(True)

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        scale, opt_state, _ = state
        scale, is_fin, value, grads = scale.value_and_grad(loss)(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jnp.where, is_fin)
        new_params = jax.tree_util.tree_map(select, new_params, params)
        new_opt_state = jax.tree_util.tree_map(select, new_opt_state, opt_state)
        return new_params, (scale, new_opt_state, is_fin), value

    return Method(init, step, lambda state: ~state[2])


def jmp_method(loss: Callable[..., jax.Array], tx: optax.GradientTransformation) -> Method:
    """jmp's ``DynamicLossScale`` with ``all_finite`` and ``select_tree``."""

    def init(params: Any) -> Any:
        return jmp.DynamicLossScale(jnp.float32(SCALE)), tx.init(params), jnp.array(True)

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        scale, opt_state, _ = state

        def scaled(p: Any) -> tuple[jax.Array, jax.Array]:
            value = loss(p, batch)
            return scale.scale(value), value

        grads, value = jax.grad(scaled, has_aux=True)(params)
        grads = scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_params = jmp.select_tree(finite, new_params, params)
        new_opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
        return new_params, (scale.adjust(finite), new_opt_state, finite), value

    return Method(init, step, lambda state: ~state[2])


def make_methods(loss: Callable[..., jax.Array]) -> dict[str, Callable[[], Method]]:
    """The variants, by name; ``static scale`` is the baseline."""
    c = MAX_NORM
    clip = optax.clip_by_global_norm
    return {
        "static scale": lambda: static_method(loss, adam()),
        "jdls.wrap(adam)": lambda: jdls_method(loss, jdls.wrap(adam())),
        "jdls.wrap(adam, select)": lambda: jdls_method(loss, jdls.wrap(adam(), skip_with="select")),
        "jdls.wrap(adam, max_norm)": lambda: jdls_method(loss, jdls.wrap(adam(), max_norm=c)),
        "chain(jdls.clip, jdls.wrap(adam))": lambda: jdls_method(
            loss, optax.chain(jdls.clip(c), jdls.wrap(adam()))
        ),
        "jdls.wrap(chain(jdls.clip, adam))": lambda: jdls_method(
            loss, jdls.wrap(optax.chain(jdls.clip(c), adam()))
        ),
        "static scale + optax clip": lambda: static_method(loss, optax.chain(clip(c), adam())),
        "Flax DynamicScale + jnp.where": lambda: flax_method(loss, adam()),
        "jmp DynamicLossScale + select_tree": lambda: jmp_method(loss, adam()),
        "static scale + optax.apply_if_finite": lambda: static_method(
            loss, optax.apply_if_finite(adam(), 10**6)
        ),
        "static scale + optax clip + apply_if_finite": lambda: static_method(
            loss, optax.chain(clip(c), optax.apply_if_finite(adam(), 10**6))
        ),
        REFERENCE: lambda: static_method(loss, minimal_skip(adam())),
    }


SKIPPED = ("jdls.wrap(adam)", "jdls.wrap(adam, select)", "jdls.wrap(adam, max_norm)")


_JITTED: dict[int, tuple[Method, Callable[..., Any]]] = {}


def _jitted(method: Method) -> Callable[..., Any]:
    """The jitted step of ``method``, one per method object (so cases share compilations)."""
    key = id(method)
    if key not in _JITTED or _JITTED[key][0] is not method:
        _JITTED[key] = (method, jax.jit(method.step, donate_argnums=(0, 1)))
    return _JITTED[key][1]


class Runner:
    """One case: a jitted step (parameters and state donated) on its own parameters and state."""

    def __init__(self, method: Method, params: Any, batch: Any) -> None:
        self.method = method
        self.fn = _jitted(method)
        # Own copies: the first call donates (deletes) them.
        self.params = jax.tree_util.tree_map(jnp.copy, params)
        self.state = method.init(self.params)
        self.batch = batch
        self.skips: list[bool] = []
        h.settle(self, self.fn)

    def __call__(self) -> None:
        self.params, self.state, value = self.fn(self.params, self.state, self.batch)
        jax.block_until_ready((self.params, self.state, value))

    def temp_bytes(self) -> int:
        """The compiled step's temporary memory (``memory_analysis``)."""
        return h.temp_bytes(self.fn, self.params, self.state, self.batch)

    def last_skipped(self) -> bool | None:
        if self.method.skipped is None:
            return None
        return bool(self.method.skipped(self.state))


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    loss: Callable[..., jax.Array]
    params: Any
    batch: Any
    poisoned: Any
    n_params: int
    description: str
    #: the model's configuration (``_models.MLPConfig`` or ``TransformerConfig``)
    config: Any = None


def mlp_workload(quick: bool) -> Workload:
    config = m.MLPConfig(widths=(64, 128, 64), batch=32) if quick else m.MLPConfig()
    return mlp_workload_of(config, "mlp", "Full train step, MLP")


def mlp_workload_of(config: m.MLPConfig, name: str, title: str) -> Workload:
    """The full train step of the MLP ``config`` (float16 compute), as a workload."""
    return Workload(
        name,
        title,
        m.mlp_loss,
        m.mlp_init(config),
        m.mlp_batch(config),
        m.mlp_batch(config, poison=True),
        config.n_params,
        f"MLP {'-'.join(map(str, config.widths))}, {config.n_params:,} float32 parameters, "
        f"float16 compute, batch {config.batch}",
        config,
    )


def transformer_workload(quick: bool) -> Workload:
    config = (
        m.TransformerConfig(vocab=64, d_model=32, heads=2, layers=1, d_mlp=64, seq=16, batch=2)
        if quick
        else m.TransformerConfig()
    )
    return Workload(
        "transformer",
        "Full train step, transformer",
        m.transformer_loss_fn(config),
        m.transformer_init(config),
        m.transformer_batch(config),
        m.transformer_batch(config, poison=True),
        config.n_params,
        f"decoder-only transformer, {config.layers} layers, d_model {config.d_model}, "
        f"{config.heads} heads, MLP {config.d_mlp}, vocab {config.vocab}, "
        f"{config.n_params:,} float32 parameters, float16 compute, batch {config.batch} x "
        f"{config.seq} tokens",
        config,
    )


def run(
    work: Workload,
    names: Sequence[str],
    skipped: Sequence[str],
    *,
    rounds: int,
    warmup: int,
) -> h.Section:
    methods = make_methods(work.loss)
    specs = [(n, n, False) for n in names] + [(f"{n} [skipped step]", n, True) for n in skipped]
    h.log(f"{work.title}: compiling {len(specs)} cases")
    runners = []
    for _, name, poison in specs:
        runners.append(
            Runner(methods[name](), work.params, work.poisoned if poison else work.batch)
        )
    cases = [h.Case(label, r) for (label, _, _), r in zip(specs, runners, strict=True)]
    rows = h.time_cases(cases, rounds=rounds, warmup=warmup)
    for row, r, (_, _, poison) in zip(rows, runners, specs, strict=True):
        was = r.last_skipped()
        row["last_step_skipped"] = was
        if was is not None and was != poison:
            raise RuntimeError(f"{row['label']}: expected skipped={poison}, got {was}")
    note = (
        f"{work.description}; parameters and optimizer state donated; {rounds} interleaved "
        "rounds; ratio = median of the per-round ratios to `static scale` (IQR beside it)."
    )
    config = {"workload": work.description, "n_params": work.n_params, "rounds": rounds}
    return h.Section(work.title, note, rows, config=config)


QUICK_VARIANTS = (
    "static scale",
    "jdls.wrap(adam)",
    "jdls.wrap(adam, max_norm)",
    "Flax DynamicScale + jnp.where",
    "jmp DynamicLossScale + select_tree",
    "static scale + optax.apply_if_finite",
)


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``step`` suite: the MLP, every variant, skipped steps (fewer variants when quick)."""
    work = mlp_workload(quick)
    names = QUICK_VARIANTS if quick else list(make_methods(work.loss))
    return [
        run(
            work,
            names,
            ("jdls.wrap(adam)",) if quick else SKIPPED,
            rounds=rounds or (3 if quick else 30),
            warmup=1 if quick else 2,
        )
    ]


TRANSFORMER_VARIANTS = (
    "static scale",
    "jdls.wrap(adam)",
    "jdls.wrap(adam, select)",
    "jdls.wrap(adam, max_norm)",
    "static scale + optax clip",
    "Flax DynamicScale + jnp.where",
    "jmp DynamicLossScale + select_tree",
    "static scale + optax.apply_if_finite",
)


def suite_transformer(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``transformer`` suite: the main variants, and a skipped step of ``jdls.wrap``."""
    work = transformer_workload(quick)
    return [
        run(
            work,
            TRANSFORMER_VARIANTS[:2] if quick else TRANSFORMER_VARIANTS,
            ("jdls.wrap(adam)",),
            rounds=rounds or (3 if quick else 20),
            warmup=1 if quick else 2,
        )
    ]
