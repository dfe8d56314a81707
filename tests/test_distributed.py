"""Two JAX processes on localhost: only one process's data overflows, both skip the same steps.

The test starts two ``python tests/_two_process_worker.py`` processes that join with
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

import os
import socket
import subprocess
import sys
from pathlib import Path

import _two_process_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

TIMEOUT_S = 150
LOCAL_DEVICES = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path) -> list[str]:
    """Run the two workers to completion; return their logs. Kill both on any failure."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # not the 8 test devices
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
