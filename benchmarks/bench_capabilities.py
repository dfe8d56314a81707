"""Cost of each capability beyond the plain step, against its target: adaptive scale,
telemetry, per-layer and per-loss scales, retries.

The full train steps of ``bench_step`` (the 8.4M-parameter MLP at batch 256 and the 4-layer
transformer at 8 x 128 tokens, float16 compute, float32 master parameters, ``adam``), every
case jitted with parameters and optimizer state donated, all cases of both workloads timed
in the same interleaved rounds (``benchmarks/_harness.py``). Each case is a ratio to the
step with ``jdls.wrap(adam, jdls.DynamicScale())`` (the classic rule, so that each
capability's own cost shows; every case but the adaptive one uses that rule):

* ``jdls.wrap(adam, AdaptiveScale())``: the rule that measures the gradients (target
  <= 1.02x);
* telemetry: the gradients and measurements of a ``jdls.Probe`` site at every
  layer's output (MLP: each dense layer; transformer: the embedding and each block), the
  telemetry returned by the step (target <= 1.03x);
* per-layer scales, as ``docs/per-layer.md`` writes them: ``jdls.layer_scaled_value_and_grad``
  with a ``jdls.layer_site`` at every layer's output (MLP: each dense layer; transformer:
  ``embed``, ``block_0``... after the block's second residual add, ``head``), one
  ``jdls.AdaptiveScale()`` per layer adjusted by ``jdls.update_sites`` in the step,
  and ``jdls.wrap(adam, jdls.NoOpScale())`` to skip. The transformer ties its embedding: the
  array is passed as a parameter of both ``embed`` and ``head``, and the two gradients are
  added in the step (target <= 1.05x);
* retries: ``jdls.retrying(loss, jdls.wrap(adam), retries=2)``, a finite step (target
  <= 1.01x; ``bench_retry`` also times a step that retries);
* per-loss scales (transformer): the cross-entropy and PaLM's auxiliary z-loss
  (``1e-4 * mean(logsumexp(logits)**2)``) through ``jdls.multi_loss_value_and_grad`` with one
  ``jdls.DynamicScale()`` per loss (weights ``1, 1e-4``) and ``jdls.wrap(adam,
  jdls.NoOpScale())``, against its own baseline: the same two-loss sum under one global
  scale, ``jdls.wrap(adam)`` (target <= 1.05x; one backward pass, the default).

Memory: ``memory_analysis()`` of each compiled step, the difference of its temporary bytes
to its baseline's in units of one float32 gradient buffer. So that the benchmark times a
correct computation, :func:`check_gradients` compares the per-layer and per-loss gradients
with the global scale's (at the quick sizes, before a full run, and in
``tests/integration/test_benchmarks_smoke.py``: XLA:CPU takes some 15 s to compile it, too
long for ``--quick``). After timing, every case must have skipped no step. Run::

    python -m benchmarks capabilities [--quick] [--rounds N]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdls
from benchmarks import _harness as h
from benchmarks import _models as m
from benchmarks import bench_step
from benchmarks.bench_step import Method, adam

COLUMNS = (
    ("workload", "workload", ""),
    ("label", "case", ""),
    ("median_ms", "median ms", ".2f"),
    ("ratio_cell", "ratio (IQR)", ""),
    ("extra_grad_buffers", "Δtemp (gradient buffers)", "+.2f"),
    ("target_cell", "target", ""),
    ("met_cell", "met", ""),
)


@dataclasses.dataclass(frozen=True)
class Model:
    """A workload of ``bench_step`` and the forms of its loss the cases need."""

    work: bench_step.Workload
    #: the loss with ``mark(x, name)`` at every layer's output
    marked: Callable[[m.Mark], Callable[..., jax.Array]]
    #: the loss over parameters keyed by layer, with ``mark(x, name)`` at every layer's output
    layered: Callable[[m.Mark], Callable[..., jax.Array]]
    #: parameters to layers (``to_layers``) and the layers' gradients back (``from_layers``)
    to_layers: Callable[[Any], Any]
    from_layers: Callable[[Any], Any]
    #: the layers a probe measures (telemetry)
    probed: Callable[[str], bool]
    #: ``losses(params, batch) -> {"nll", "z"}`` (None: no per-loss case)
    losses: Callable[..., dict[str, jax.Array]] | None = None


def _identity(x: Any) -> Any:
    return x


def mlp_model(quick: bool) -> Model:
    work = bench_step.mlp_workload(quick)
    return Model(
        work,
        lambda mark: functools.partial(m.mlp_loss, mark=mark),
        lambda mark: functools.partial(m.mlp_loss, mark=mark),
        _identity,
        _identity,
        lambda name: True,
    )


def transformer_model(quick: bool) -> Model:
    work = bench_step.transformer_workload(quick)
    config = work.config
    return Model(
        work,
        lambda mark: m.transformer_loss_fn(config, mark),
        lambda mark: m.transformer_loss_fn(config, mark, layered=True),
        m.transformer_layers,
        m.transformer_unlayer,
        lambda name: name != "head",  # the embedding and the blocks: the residual stream
        m.transformer_losses_fn(config),
    )


# --------------------------------------------------------------------------------------------
# The steps (``bench_step.Method``: ``init(params) -> state`` and the step).
# --------------------------------------------------------------------------------------------


def _skipped(state: Any) -> jax.Array:
    return jdls.stats(state).skipped  # the one jdls.wrap state, wherever it is in ``state``


def _apply(params: Any, updates: Any) -> Any:
    return optax.apply_updates(params, updates)


def _at_sites(sites: dict[str, jdls.Site]) -> m.Mark:
    """``mark(x, name)``: ``x`` through the site of ``name`` (the identity where none is)."""

    def mark(x: Any, name: str) -> Any:
        return jdls.apply_site(x, sites[name]) if name in sites else x

    return mark


def telemetry_method(model: Model, tx: Any) -> Method:
    """``bench_step.jdls_method`` with a ``jdls.Probe`` site at every probed layer (the
    model's state, beside the optimizer's); the step returns the telemetry with the loss and
    records it in the sites."""

    def init(params: Any) -> Any:
        names = [k for k in model.to_layers(params) if model.probed(k)]
        return tx.init(params), {k: jdls.Site(jdls.Probe()) for k in names}

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        opt_state, sites = state
        fn = jdls.get_scale(opt_state).value_and_grad(
            lambda p, s: model.marked(_at_sites(s))(p, batch), argnums=(0, 1)
        )
        value, (grads, measured) = fn(params, sites)
        updates, opt_state = tx.update(grads, opt_state, params)
        sites = jdls.update_sites(sites, measured, jdls.stats(opt_state).finite)
        return _apply(params, updates), (opt_state, sites), (value, jdls.Telemetry.of(measured))

    return Method(init, step, _skipped)


def per_layer_method(model: Model) -> Method:
    """Per-layer scales as ``docs/per-layer.md`` writes them: a ``jdls.layer_site`` with
    ``AdaptiveScale()`` per layer, ``jdls.update_sites`` in the step, ``wrap(adam,
    NoOpScale())`` to skip."""
    tx = jdls.wrap(adam(), jdls.NoOpScale())

    def init(params: Any) -> Any:
        layers = model.to_layers(params)  # keyed in forward order, before any jit
        sites = {k: jdls.layer_site(jdls.AdaptiveScale(), i) for i, k in enumerate(layers)}
        return tx.init(params), sites

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        opt_state, sites = state
        fn = jdls.layer_scaled_value_and_grad(
            lambda layers, s: model.layered(_at_sites(s))(layers, batch)
        )
        value, (grads, measured) = fn(model.to_layers(params), sites)
        updates, opt_state = tx.update(model.from_layers(grads), opt_state, params)
        sites = jdls.update_sites(sites, measured, jdls.stats(opt_state).finite)
        return _apply(params, updates), (opt_state, sites), value

    return Method(init, step, _skipped)


WEIGHTS = {"nll": 1.0, "z": m.Z_LOSS_WEIGHT}


def summed(losses: Callable[..., dict[str, jax.Array]]) -> Callable[..., jax.Array]:
    """The weighted sum of the losses, for one global scale."""

    def loss(params: Any, batch: Any) -> jax.Array:
        values = losses(params, batch)
        return values["nll"] + WEIGHTS["z"] * values["z"]

    return loss


def per_loss_method(losses: Callable[..., dict[str, jax.Array]]) -> Method:
    """Per-loss scales as ``docs/per-layer.md`` writes them: one ``DynamicScale()`` per loss,
    each adjusted by its own finiteness, ``wrap(adam, NoOpScale())`` to skip."""
    tx = jdls.wrap(adam(), jdls.NoOpScale())

    def init(params: Any) -> Any:
        return tx.init(params), {k: jdls.DynamicScale() for k in WEIGHTS}

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        opt_state, scales = state
        fn = jdls.multi_loss_value_and_grad(losses, scales, WEIGHTS)
        values, grads, finite = fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        scales = {k: s.adjust(finite[k]) for k, s in scales.items()}
        return _apply(params, updates), (opt_state, scales), values

    return Method(init, step, _skipped)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One case: its label, the method, its target (a ratio to its group's first case)."""

    label: str
    method: Callable[[], Method]
    target: float | None = None
    owner: str | None = None  # the capability the target belongs to
    group: str = ""


def specs(model: Model) -> list[Spec]:
    """The cases of one workload; the first is the baseline of the others but the two-loss
    ones, whose baseline is the first of them."""
    loss = model.work.loss

    out = [
        Spec(
            "jdls.wrap(adam, DynamicScale())",
            lambda: bench_step.jdls_method(loss, jdls.wrap(adam(), jdls.DynamicScale())),
        ),
        Spec(
            "jdls.wrap(adam, AdaptiveScale())",
            lambda: bench_step.jdls_method(loss, jdls.wrap(adam(), jdls.AdaptiveScale())),
            1.02,
            "adaptive scaling",
        ),
        Spec(
            "telemetry: a jdls.Probe site per layer",
            lambda: telemetry_method(model, jdls.wrap(adam(), jdls.DynamicScale())),
            1.03,
            "telemetry",
        ),
        Spec(
            "per-layer scales: AdaptiveScale per layer",
            lambda: per_layer_method(model),
            1.05,
            "per-layer scales",
        ),
        Spec(
            "jdls.retrying(loss, jdls.wrap(adam), retries=2), finite step",
            lambda: bench_step.jdls_method(loss, jdls.wrap(adam(), jdls.DynamicScale()), retries=2),
            1.01,
            "retries",
        ),
    ]
    if model.losses is not None:
        losses = model.losses
        out += [
            Spec(
                "nll + z-loss, one global scale: jdls.wrap(adam)",
                lambda: bench_step.jdls_method(
                    summed(losses), jdls.wrap(adam(), jdls.DynamicScale())
                ),
                group="two losses",
            ),
            Spec(
                "nll + z-loss, per-loss scales: multi_loss_value_and_grad",
                lambda: per_loss_method(losses),
                1.05,
                "per-loss scales",
                group="two losses",
            ),
        ]
    return out


# --------------------------------------------------------------------------------------------
# Correctness of what is timed.
# --------------------------------------------------------------------------------------------


def _max_relative_error(got: Any, want: Any) -> float:
    """The largest ``max|got - want| / max|want|`` over the leaves."""
    errors = jax.tree_util.tree_map(
        lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)),
        got,
        want,
    )
    return max(jax.tree_util.tree_leaves(errors))


#: How far the per-layer and per-loss gradients may be from the global scale's (relative to
#: each leaf's largest): the float16 rounding of a sum that the global scale adds in float16
#: (the tied embedding's two uses; the two losses' cotangents) and the others in float32.
TOLERANCE = 2.0**-8


def check_gradients(model: Model) -> dict[str, float]:
    """The per-layer (and per-loss) gradients against the global scale's, at different scales
    per layer (``2**10``, ``2**12``, ...) so that every boundary rescales; returns the largest
    relative error of each, and raises beyond :data:`TOLERANCE`."""
    params, batch = model.work.params, model.work.batch
    base = jdls.DynamicScale()
    value, want = jax.jit(base.value_and_grad(model.work.loss))(params, batch)
    names = list(model.to_layers(params))
    sites = {
        k: jdls.layer_site(jdls.StaticScale(2.0 ** (10 + 2 * i)), i) for i, k in enumerate(names)
    }
    fn = jax.jit(
        jdls.layer_scaled_value_and_grad(
            lambda layers, s, b: model.layered(_at_sites(s))(layers, b)
        )
    )
    got_value, (got, _) = fn(model.to_layers(params), sites, batch)
    errors = {"per-layer": _max_relative_error(model.from_layers(got), want)}
    np.testing.assert_allclose(got_value, value, rtol=1e-6)
    if model.losses is not None:
        _, want = jax.jit(base.value_and_grad(summed(model.losses)))(params, batch)
        two = {"nll": jdls.DynamicScale(), "z": jdls.DynamicScale(2.0**12)}
        fn = jax.jit(jdls.multi_loss_value_and_grad(model.losses, two, WEIGHTS))
        _, got, _ = fn(params, batch)
        errors["per-loss"] = _max_relative_error(got, want)
    for what, error in errors.items():
        if not error <= TOLERANCE:
            raise RuntimeError(
                f"{model.work.name}: {what} gradients differ from the global scale's by "
                f"{error:.3g} (relative), more than {TOLERANCE:.3g}"
            )
    return errors


# --------------------------------------------------------------------------------------------
# The suite.
# --------------------------------------------------------------------------------------------


def _cells(row: dict[str, Any]) -> None:
    """The printable columns of a row: ratio with its IQR, target, whether it is met."""
    row["ratio_cell"] = f"{row['ratio']:.3f} ({row['ratio_q1']:.3f}–{row['ratio_q3']:.3f})"
    target = row.get("target")
    if target is None:
        row["target_cell"], row["met"], row["met_cell"] = "baseline", None, ""
        return
    row["target_cell"] = f"<= {target:.2f}x ({row['owner']})"
    row["met"] = bool(row["ratio"] <= target)
    row["met_cell"] = "yes" if row["met"] else "**no**"


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """The ``capabilities`` suite: every case of both workloads, interleaved."""
    rounds = rounds or (3 if quick else 40)
    checked = {}
    for model in () if quick else (mlp_model(True), transformer_model(True)):
        checked[model.work.name] = errors = check_gradients(model)  # the same code, quick sizes
        h.log(f"{model.work.name}: gradients agree, largest relative difference {errors}")
    models = [mlp_model(quick), transformer_model(quick)]
    jobs = [(model, spec) for model in models for spec in specs(model)]
    h.log(f"compiling {len(jobs)} cases, {os.cpu_count()} at a time")

    def compiled(job: tuple[Model, Spec]) -> bench_step.Runner:
        model, spec = job
        return bench_step.Runner(spec.method(), model.work.params, model.work.batch)

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:  # XLA frees the GIL
        runners = list(pool.map(compiled, jobs))
    cases, base_temp = [], {}
    for (model, spec), runner in zip(jobs, runners, strict=True):
        temp = runner.temp_bytes()  # the compiled step's, no second compilation
        group = f"{model.work.name}{', ' + spec.group if spec.group else ''}"
        base_temp.setdefault(group, temp)
        info = {
            "workload": model.work.name,
            "target": spec.target,
            "owner": spec.owner,
            **h.temp_info(temp, base_temp[group], 4 * model.work.n_params),
        }
        cases.append(h.Case(spec.label, runner, group, info))
    rows = h.time_cases(cases, rounds=rounds, warmup=1 if quick else 2)
    for row, runner in zip(rows, runners, strict=True):
        row["skipped_steps"] = int(jdls.stats(runner.state).skipped_steps)
        if row["skipped_steps"]:
            raise RuntimeError(f"{row['workload']}: {row['label']} skipped steps")
        _cells(row)
    note = (
        f"{models[0].work.description}; {models[1].work.description}. Parameters and "
        f"optimizer state donated; {rounds} rounds, every case of both workloads interleaved; "
        "ratio = median of the per-round ratios to the workload's "
        "`jdls.wrap(adam, DynamicScale())` (the "
        "per-loss case: to the same two losses under one global scale), IQR in brackets; "
        "Δtemp = compiled temporary memory minus the baseline's, in float32 gradient buffers "
        f"({4 * models[0].work.n_params / 2**20:.1f} MiB MLP, "
        f"{4 * models[1].work.n_params / 2**20:.1f} MiB transformer)."
    )
    config = {
        "workloads": [mo.work.description for mo in models],
        "rounds": rounds,
        "gradient_check_relative_error": checked,
    }
    return [h.Section("Cost of each capability, full train step", note, rows, COLUMNS, config)]
