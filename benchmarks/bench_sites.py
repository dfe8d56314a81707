"""Cost of probes and per-layer scales (sites) on a scanned, rematerialised linen transformer.

The model is ``examples/scanned_transformer.py``'s ``CharLM``: byte embeddings, the blocks
(pre-norm causal self-attention and an MLP) under ``nn.scan(nn.remat(Block))``, float16
compute, float32 parameters, a float32-logit head; 12 layers of width 128, 16 sequences of 64
bytes (``--quick``: 2 layers of width 32, 4 sequences of 16). Every case is the whole train
step (``jdls.linen.TrainState``, ``adamw``), jitted with the state donated:

* ``plain``: ``jdls.wrap(adamw)`` (the default scale), no sites: the baseline;
* ``+ probes``: ``jdls.linen.probes(model)``, a probe after every submodule (in each block:
  its layer norms, attention projections and dense layers, and the block), the step
  returning their telemetry (target <= 1.05x);
* ``+ a probe per layer``: a probe at each layer's output only (``embed``, each block,
  ``head``), placed by hand with ``jdls.apply_site`` (:class:`LayerProbes`), to tell the cost
  of a probe from the number of probes;
* ``+ per-layer scales``: ``jdls.linen.layer_scales(model, jdls.AdaptiveScale())`` (``embed``,
  one per block, ``head``) and ``jdls.wrap(adamw, jdls.NoOpScale())`` (target <= 1.05x);
* ``+ both``: ``jdls.linen.probes(jdls.linen.layer_scales(...))`` (target <= 1.05x).

Step time: medians of interleaved rounds and the median of per-round ratios to ``plain``
(``benchmarks/_harness.py``). Compile time: ``jax.jit(step).lower(...).compile()`` of a new
function each round (tracing, lowering and XLA's compilation), the cases interleaved in
shuffled order, medians and per-round ratios (target <= 1.2x); the time of XLA's compilation
alone (``Lowered.compile``) is reported beside it, and the process CPU time of the whole
(less sensitive to other jobs on a shared machine than wall time). Run::

    python -m benchmarks sites [--quick] [--rounds N]
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import jdls
from benchmarks import _harness as h

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "scanned_transformer.py"
CASES = ("plain", "+ probes", "+ a probe per layer", "+ per-layer scales", "+ both")
PROBED = ("+ probes", "+ a probe per layer", "+ both")


class LayerProbes(nn.Module):
    """``net`` with a probe at each layer's output only (``embed``, each block, ``head``):
    sites placed by hand with ``jdls.apply_site``, for comparison with ``jdls.linen.probes``,
    which probes every submodule."""

    net: nn.Module

    def setup(self) -> None:
        nn.share_scope(self, self.net)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        ex = example()
        layers = (ex.Embed, ex.Block, ex.Head)

        def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
            out = next_fun(*args, **kwargs)
            module = context.module
            if context.method_name != "__call__" or not isinstance(module, layers):
                return out
            site = module.variable("jdls", "probe", lambda: jdls.Site(jdls.Probe()))
            return jdls.apply_site(out, site.value)

        with nn.intercept_methods(interceptor):
            return self.net(tokens)


def example() -> Any:
    """``examples/scanned_transformer.py`` as a module (the examples are not a package)."""
    name = "jdls_example_scanned_transformer"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def build(case: str, config: dict[str, int]) -> tuple[Any, jax.Array]:
    """The train state of ``case`` and a batch of bytes."""
    ex = example()
    net = ex.CharLM(config["dim"], config["heads"], config["layers"])
    tx = jdls.wrap(optax.adamw(1e-3))
    model: Any = net
    if case in ("+ per-layer scales", "+ both"):
        model = jdls.linen.layer_scales(net, jdls.AdaptiveScale())
        tx = jdls.wrap(optax.adamw(1e-3), jdls.NoOpScale())
    if case in ("+ probes", "+ both"):
        model = jdls.linen.probes(model)
    if case == "+ a probe per layer":
        model = LayerProbes(net)
    data = ex.load_text()
    starts = np.random.default_rng(0).integers(
        0, len(data) - config["context"] - 1, config["batch"]
    )
    batch = jax.numpy.asarray(np.stack([data[s : s + config["context"] + 1] for s in starts]))
    variables = model.init(jax.random.key(0), batch[:, :-1])
    state = jdls.linen.TrainState.create(
        apply_fn=model.apply, params=variables["params"], sites=variables.get("jdls"), tx=tx
    )
    # the sites of one init share arrays (every layer's initial scale): a buffer each, so
    # that the state can be donated
    return jax.tree_util.tree_map(jax.numpy.copy, state), batch


def step_fn(case: str) -> Callable[..., Any]:
    """A new (not yet jitted) train step: loss, gradients, update; with probes, the telemetry."""

    def step(state: Any, batch: jax.Array) -> tuple[Any, ...]:
        def loss_fn(variables: Any) -> jax.Array:
            logits = state.apply_fn(variables, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        if state.sites is None:  # no sites: the gradients of the parameters, as Flax's
            loss, grads = state.value_and_grad(lambda p: loss_fn({"params": p}))(state.params)
            return state.apply_gradients(grads=grads), loss
        loss, grads = state.value_and_grad(loss_fn)(state.variables)
        new = state.apply_gradients(grads=grads)
        if case in PROBED:
            return new, loss, jdls.Telemetry.of(grads["jdls"])
        return new, loss

    return step


def compile_times(
    cases: dict[str, tuple[Any, jax.Array]], rounds: int
) -> tuple[dict[str, list[tuple[float, float, float]]], dict[str, Any]]:
    """Per case, ``rounds`` (trace + lower + compile, compile alone, trace + lower + compile
    in process CPU time) seconds, interleaved, and the last compiled step (the step timing
    runs it: no compilation more). CPU time is less sensitive to other jobs on the machine
    than wall time."""
    times: dict[str, list[tuple[float, float, float]]] = {c: [] for c in cases}
    compiled: dict[str, Any] = {}
    order = list(cases)
    rng = random.Random(0)
    for k in range(rounds):
        rng.shuffle(order)
        for case in order:
            state, batch = cases[case]
            start, cpu = time.perf_counter(), time.process_time()
            lowered = jax.jit(step_fn(case), donate_argnums=0).lower(state, batch)
            lowered_at = time.perf_counter()
            compiled[case] = lowered.compile()
            end = time.perf_counter()
            times[case].append((end - start, end - lowered_at, time.process_time() - cpu))
        h.log(f"  compile round {k + 1}/{rounds}")
    return times, compiled


def _runner(case: str, state: Any, batch: jax.Array, jitted: Any) -> h.Case:
    box = [state]

    def run() -> None:
        out = jitted(box[0], batch)
        box[0] = out[0]
        jax.block_until_ready(out)

    h.settle(run, jitted)
    return h.Case(case, run)


def suite(quick: bool = False, rounds: int | None = None) -> list[h.Section]:
    """Step and compile time of the four cases (see the module docstring)."""
    config = (
        {"layers": 2, "dim": 32, "heads": 2, "context": 16, "batch": 4}
        if quick
        else {"layers": 12, "dim": 128, "heads": 4, "context": 64, "batch": 16}
    )
    step_rounds = rounds or (3 if quick else 30)
    compile_rounds = 1 if quick else max(3, step_rounds // 6)
    built = {c: build(c, config) for c in CASES}

    h.log(f"sites: compile time, {compile_rounds} rounds")
    ctimes, compiled = compile_times(built, compile_rounds)
    base = ctimes["plain"]
    compile_rows = []
    for case in CASES:
        total = [t for t, _, _ in ctimes[case]]
        xla = [c for _, c, _ in ctimes[case]]
        cpu = [c for _, _, c in ctimes[case]]
        ratios = [a / b for a, (b, _, _) in zip(total, base, strict=True)]
        cpu_ratios = [a / b for a, (_, _, b) in zip(cpu, base, strict=True)]
        q1, med, q3 = h.quartiles(total)
        compile_rows.append(
            {
                "label": case,
                "rounds": len(total),
                "median_ms": 1e3 * med,  # the harness's row shape, in milliseconds
                "q1_ms": 1e3 * q1,
                "q3_ms": 1e3 * q3,
                "times_ms": [1e3 * t for t in total],
                "compile_s": med,
                "xla_compile_s": statistics.median(xla),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "cpu_s": statistics.median(cpu),
                "cpu_ratio": statistics.median(cpu_ratios),
                "cpu_ratio_min": min(cpu_ratios),
                "cpu_ratio_max": max(cpu_ratios),
                "times_s": total,
                "cpu_times_s": cpu,
                "target": None if case == "plain" else 1.2,
            }
        )

    h.log(f"sites: step time, {step_rounds} rounds")
    cases = [_runner(c, *built[c], compiled[c]) for c in CASES]
    rows = h.time_cases(cases, rounds=step_rounds)
    for row in rows:
        row["target"] = None if row["label"] == "plain" else 1.05
        if row["label"] != "plain":
            row["meets_target"] = bool(row["ratio"] <= 1.05)
    for row in compile_rows:
        if row["label"] != "plain":
            row["meets_target"] = bool(row["cpu_ratio"] <= 1.2)  # CPU time: less noisy

    sizes = ", ".join(f"{k} {v}" for k, v in config.items())
    return [
        h.Section(
            "Step time: sites on nn.scan(nn.remat(Block)), float16",
            f"{sizes}; whole train step (adamw), state donated; ratio = median of per-round "
            "ratios to plain jdls.wrap; target <= 1.05x",
            rows,
            config=config,
        ),
        h.Section(
            "Compile time: sites on nn.scan(nn.remat(Block)), float16",
            f"{sizes}; trace + lower + compile of a new jitted step each round, cases "
            "interleaved; XLA = Lowered.compile alone; CPU = the same in process CPU time; "
            "target <= 1.2x",
            compile_rows,
            columns=(
                ("label", "variant", ""),
                ("compile_s", "median s", ".2f"),
                ("xla_compile_s", "XLA s", ".2f"),
                ("ratio", "ratio", ".3f"),
                ("ratio_min", "min ratio", ".3f"),
                ("ratio_max", "max ratio", ".3f"),
                ("cpu_s", "CPU s", ".2f"),
                ("cpu_ratio", "CPU ratio", ".3f"),
                ("cpu_ratio_min", "min", ".3f"),
                ("cpu_ratio_max", "max", ".3f"),
            ),
            config=config,
        ),
    ]
