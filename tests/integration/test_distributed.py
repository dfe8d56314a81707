"""Two JAX processes on localhost: only one process's data overflows, both skip the same steps.

The test starts two ``python tests/integration/_two_process_worker.py`` processes that join with
``jax.distributed.initialize`` (CPU, gloo collectives, loopback only; 2 CPU devices each, 4 in
all) and train in two setups (see the worker's docstring): ``jax.jit`` with a global ``Mesh``
(parameters replicated, batch sharded over the processes) and ``shard_map`` with one tower of
the model per device (``jdls.wrap(..., axis_name="model")``). Process 1's data blows up on
some steps; process 0's never does.

Checked: each process (each device) decides finite/skipped identically on every step, and the
two processes end with byte-identical parameters, optimizer state and scale. Each result is
also compared with a run over the clean steps only (the faulty steps' batches left out): with
``shard_map`` the same program run here in one process on 4 devices, bit for bit; with ``jit``
the same two-process program (bit for bit) and a one-process run (to rounding: gloo's
all-reduce sums in another order).

The subprocesses are bounded (timeouts, killed on failure) and use only 127.0.0.1.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import _mlp
import _two_process_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import host_bytes
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jdls

pytestmark = pytest.mark.full  # two processes and soaks: the full suite only

TIMEOUT_S = 150
LOCAL_DEVICES = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path) -> list[str]:
    """Run the two workers to completion; return their logs. Kill both on any failure."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not the 8 test devices
    env["JAX_PLATFORMS"] = "cpu"
    port = free_port()
    procs, logs = [], []
    try:
        for i in range(2):
            log = open(out / f"process{i}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [sys.executable, worker.__file__, "--process-id", str(i), "--port", str(port)]
            cmd += ["--out", str(out), "--local-devices", str(LOCAL_DEVICES)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    texts = [(out / f"process{i}.log").read_text() for i in range(2)]
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{texts[i][-4000:]}"
    return texts


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_processes")
    launch(out)
    return [dict(np.load(out / f"process{i}.npz")) for i in range(2)]


@pytest.fixture(scope="module")
def mesh4():
    return jax.devices()[: 2 * LOCAL_DEVICES]


FAULTY = worker.fault_steps()
CLEAN_STEPS = np.nonzero(~FAULTY)[0].astype(np.int32)


def expected_scale() -> float:
    scale = worker.make_scale()
    for f in ~FAULTY:
        scale = scale.adjust(bool(f))
    return float(scale.loss_scale)


def expected_consecutive() -> int:
    return int(np.argmax(~FAULTY[::-1])) if (~FAULTY).any() else len(FAULTY)


# --------------------------------------------------------------------------------------------
# jit with a global mesh.
# --------------------------------------------------------------------------------------------


def test_jit_both_processes_skip_the_same_steps(results):
    p0, p1 = results
    np.testing.assert_array_equal(p0["jit_finite"], ~FAULTY)
    np.testing.assert_array_equal(p1["jit_finite"], ~FAULTY)
    for r in results:
        assert int(r["jit_skipped_steps"]) == FAULTY.sum() > 0
        assert int(r["jit_consecutive_skips"]) == expected_consecutive()
        assert float(r["jit_loss_scale"]) == expected_scale()
    inner_count = [k for k in p0 if k.startswith("jit_inner")]
    assert int(p0[inner_count[0]]) == (~FAULTY).sum()  # adam's count: clean steps only


def test_jit_processes_end_byte_identical(results):
    p0, p1 = results
    keys = sorted(k for k in p0 if k.startswith("jit"))
    assert keys == sorted(k for k in p1 if k.startswith("jit"))
    for k in keys:
        assert p0[k].tobytes() == p1[k].tobytes(), k


def test_jit_equals_the_two_process_run_without_the_faulty_steps(results):
    for r in results:
        assert np.all(r["jitref_finite"])
        for k in sorted(k for k in r if k.startswith(("jit_param", "jit_inner"))):
            assert r[k].tobytes() == r[k.replace("jit_", "jitref_")].tobytes(), k


def test_jit_matches_a_one_process_run_to_rounding(results, mesh4):
    """One process on 4 devices runs the same program, but its all-reduce sums the gradients
    in another order than gloo across two processes: equal to rounding, not bit for bit."""
    reference = worker.run_jit(
        Mesh(np.array(mesh4), ("data",)), CLEAN_STEPS, np.zeros(len(CLEAN_STEPS), bool)
    )
    for k in sorted(k for k in reference if k.startswith("jit_param")):
        np.testing.assert_allclose(reference[k], results[0][k], rtol=1e-5, atol=1e-7, err_msg=k)


# --------------------------------------------------------------------------------------------
# shard_map, one tower per device, wrap(axis_name=...).
# --------------------------------------------------------------------------------------------


def per_device(result, name):
    keys = sorted(
        (k for k in result if k.startswith(f"sm_{name}")), key=lambda k: int(k.split("device")[1])
    )
    return {k: result[k] for k in keys}


def test_shard_map_every_device_skips_the_same_steps(results):
    decisions = {**per_device(results[0], "finite"), **per_device(results[1], "finite")}
    assert len(decisions) == 2 * LOCAL_DEVICES
    for flags in decisions.values():
        np.testing.assert_array_equal(flags[0], ~FAULTY)
    scales = {**per_device(results[0], "scale"), **per_device(results[1], "scale")}
    assert {float(v[0]) for v in scales.values()} == {expected_scale()}
    skipped = {**per_device(results[0], "skipped"), **per_device(results[1], "skipped")}
    assert {int(v[0]) for v in skipped.values()} == {int(FAULTY.sum())}


def test_shard_map_towers_equal_one_process_run_without_the_faulty_steps(results, mesh4):
    mesh = Mesh(np.array(mesh4), ("model",))
    ones = np.ones((len(mesh4), len(CLEAN_STEPS)), np.float32)
    towers, (_, skipped, _, finite) = worker.train_towers(mesh, CLEAN_STEPS, ones)
    assert bool(jnp.all(finite)) and int(jnp.max(skipped)) == 0
    got = {**per_device(results[0], "towers"), **per_device(results[1], "towers")}
    for i, leaf in enumerate(jax.tree.leaves(towers)):
        leaf = np.asarray(leaf)
        for d in range(len(mesh4)):
            assert got[f"sm_towers{i}_device{d}"].tobytes() == leaf[d : d + 1].tobytes(), (i, d)


# --------------------------------------------------------------------------------------------
# One process, 8 devices: a longer run with faults on one device at a time.
# --------------------------------------------------------------------------------------------

N_DEV = 8
SOAK8_STEPS = 600
ROWS = 8 * N_DEV


def _soak8_specs() -> np.ndarray:
    """(batch, kind, leaf, pos) per step; the faulty device is ``pos % 8``."""
    specs = _mlp.make_specs(SOAK8_STEPS, seed=0, fault_rate=0.4)
    assert min(_mlp.fault_counts(specs).values()) > 10  # every kind, many times
    return specs


@functools.cache
def _soak8_jit():
    """jax.jit over a Mesh: parameters replicated, batch rows sharded; the faulty device's rows
    blow up (x 1e30) or its loss term is multiplied by inf/-inf/NaN."""
    mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("d",))
    repl, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    tx = jdls.wrap(_mlp.adamw_cosine(SOAK8_STEPS), jdls.DynamicScale(growth_interval=10))

    def body(carry, spec):
        params, state = carry
        x, y = _mlp.make_batch(spec[0], ROWS)
        x = jax.lax.with_sharding_constraint(x, rows)
        on_device = (jnp.arange(ROWS) // (ROWS // N_DEV)) == spec[3] % N_DEV
        blow = (spec[1] >= 1) & (spec[1] <= 3) & on_device
        x = jnp.where(blow[:, None], x * jnp.float32(1e30), x)
        mult = jnp.where(on_device, _mlp.loss_multiplier(spec[1]), jnp.float32(1.0))
        scale = jdls.get_scale(state)
        _, grads = scale.value_and_grad(
            lambda p: jnp.mean(jnp.mean((_mlp.apply(p, x) - y) ** 2, axis=1) * mult)
        )(params)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), jdls.stats(state).finite

    @jax.jit
    def run(specs):
        params = jax.device_put(_mlp.init_params(0), repl)
        (params, state), finite = jax.lax.scan(body, (params, tx.init(params)), specs)
        return params, state, finite

    return run


@functools.cache
def _soak8_shard_map():
    """shard_map, data parallel: local gradients, lax.pmean, then a fault written into the
    faulty device's copy only (a device-local corruption after the reduction) or its loss
    term multiplied by inf/-inf/NaN; jdls.wrap(axis_name="d", sharded=False, max_norm=1.0)
    must make all 8 devices skip together."""
    mesh = Mesh(np.array(jax.devices()[:N_DEV]), ("d",))
    tx = jdls.wrap(
        _mlp.adamw_cosine(SOAK8_STEPS),
        jdls.DynamicScale(growth_interval=10),
        axis_name="d",
        sharded=False,
        max_norm=1.0,
    )
    n = ROWS // N_DEV

    def local(specs):
        device = jax.lax.axis_index("d")

        def body(carry, spec):
            params, state = carry
            x, y = _mlp.make_batch(spec[0], ROWS)
            x = jax.lax.dynamic_slice_in_dim(x, device * n, n)
            y = jax.lax.dynamic_slice_in_dim(y, device * n, n)
            here = device == spec[3] % N_DEV
            mult = jnp.where(here, _mlp.loss_multiplier(spec[1]), jnp.float32(1.0))
            scale = jdls.get_scale(state)
            _, grads = scale.value_and_grad(lambda p: _mlp.loss_fn(p, x, y) * mult)(params)
            grads = jax.lax.pmean(grads, "d")
            grads = _mlp.inject(grads, jnp.where(here, spec[1], 0), spec[2], spec[3])
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), jdls.stats(state).finite

        params = _mlp.init_params(0)
        (params, state), finite = jax.lax.scan(body, (params, tx.init(params)), specs)
        everything = (params, state.inner_state, jdls.get_scale(state).loss_scale, finite)
        return jax.tree.map(lambda a: a[None], everything)  # one copy per device

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P("d"), check_vma=False))


def test_eight_devices_jit_soak():
    specs = _soak8_specs()
    clean = _mlp.clean_specs(specs)
    run = _soak8_jit()
    params, state, finite = run(specs)
    ref_params, ref_state, ref_finite = run(clean)
    np.testing.assert_array_equal(np.asarray(finite), specs[:, 1] == 0)
    assert bool(jnp.all(ref_finite))
    assert int(jdls.stats(state).skipped_steps) == len(specs) - len(clean) > 50
    assert host_bytes(params) == host_bytes(ref_params)
    assert host_bytes(state.inner_state) == host_bytes(ref_state.inner_state)
    assert jdls.get_scale(state).loss_scale.sharding.is_fully_replicated


def test_eight_devices_shard_map_soak():
    specs = _soak8_specs()
    clean = _mlp.clean_specs(specs)
    run = _soak8_shard_map()
    params, inner, loss_scale, finite = run(specs)
    ref_params, ref_inner, _, ref_finite = run(clean)
    finite = np.asarray(finite)
    for d in range(N_DEV):  # every device took every decision, and the right one
        np.testing.assert_array_equal(finite[d], specs[:, 1] == 0)
    assert bool(jnp.all(ref_finite)) and len(specs) - len(clean) > 50
    assert len(set(np.asarray(loss_scale).tolist())) == 1
    for got, ref in [(params, ref_params), (inner, ref_inner)]:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            for d in range(N_DEV):  # all copies identical, and equal to the clean run
                assert a[d].tobytes() == a[0].tobytes() == b[d].tobytes()
