"""One of two JAX processes on localhost, for ``tests/integration/test_distributed.py``.

Not collected by pytest (no ``test_`` prefix). Run as::

    python tests/integration/_two_process_worker.py --process-id I --port P --out DIR [--local-devices 2]

The two processes join with ``jax.distributed.initialize`` (CPU, gloo collectives over
loopback) and train twice, with faults in **process 1's data only** on the steps
:func:`fault_steps` picks:

* ``jit``: one global ``Mesh`` over the devices of both processes, parameters replicated,
  the batch sharded over ``data``; each process builds its own rows of every batch
  (``jax.make_array_from_process_local_data``), process 1 blows up its rows (x 1e30: the
  squared error overflows float32). XLA reduces the gradients across processes, ``jdls.wrap``
  skips the step on both.
* ``shard_map``: model parallel. Every device holds its own tower of the MLP (parameters
  sharded over ``model``) and its own data, so each device's gradients are its own; only
  process 1's towers overflow. ``jdls.wrap(..., axis_name="model")`` must make every device
  skip the same steps.

Each process writes what it holds (its copy of the replicated parameters and scale, its
shards of the towers, the per-step decisions of each of its devices) to
``DIR/process<I>.npz``; the test compares the two files byte for byte.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # tests/integration
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]  # + tests/, the repo

import _mlp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jdls  # noqa: E402

STEPS = 120
GLOBAL_BATCH = 16
BLOW_UP = np.float32(1e30)


def fault_steps(steps: int = STEPS, seed: int = 3) -> np.ndarray:
    """Steps on which process 1's data overflows: sparse faults and one burst."""
    rng = np.random.default_rng(seed)
    faulty = rng.random(steps) < 0.12
    faulty[60:72] = True  # a burst: the scale backs off many times in a row
    return faulty


def make_scale() -> jdls.DynamicScale:
    return jdls.DynamicScale(2.0**10, growth_interval=8)


# --------------------------------------------------------------------------------------------
# jit with shardings: replicated parameters, batch sharded over the processes.
# --------------------------------------------------------------------------------------------


def global_batch(t: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = _mlp.make_batch(jnp.int32(t), GLOBAL_BATCH)
    return np.asarray(x), np.asarray(y)


def replicate(tree: Any, sharding: NamedSharding) -> Any:
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(
            np.shape(a), sharding, lambda idx: np.asarray(a)[idx]
        ),
        tree,
    )


def local_copy(tree: Any) -> Any:
    """This process's copy of a replicated global array (not fully addressable)."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)


def run_jit(
    mesh: Mesh, steps: np.ndarray, blow_up: np.ndarray, prefix: str = "jit"
) -> dict[str, np.ndarray]:
    """Train on the batches ``steps``; this process's rows are blown up where ``blow_up``."""
    repl, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = jdls.wrap(_mlp.adamw_cosine(STEPS), make_scale())
    params = replicate(jax.device_get(_mlp.init_params(0)), repl)
    state = jax.jit(tx.init, out_shardings=repl)(params)

    @partial(jax.jit, out_shardings=(repl, repl))
    def step(params, state, x, y):
        scale = jdls.get_scale(state)
        _, grads = scale.value_and_grad(lambda p: _mlp.loss_fn(p, x, y))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    n = GLOBAL_BATCH // jax.process_count()
    mine = slice(jax.process_index() * n, (jax.process_index() + 1) * n)
    finite = []
    for t, blow in zip(steps, blow_up, strict=True):
        x, y = global_batch(int(t))
        x, y = x[mine] * (BLOW_UP if blow else np.float32(1.0)), y[mine]
        x = jax.make_array_from_process_local_data(rows, x)
        y = jax.make_array_from_process_local_data(rows, y)
        params, state = step(params, state, x, y)
        finite.append(bool(local_copy(jdls.stats(state).finite)))
    stats = local_copy(jdls.stats(state))
    out = {f"param{i}": a for i, a in enumerate(jax.tree.leaves(local_copy(params)))}
    out.update(
        {f"inner{i}": a for i, a in enumerate(jax.tree.leaves(local_copy(state.inner_state)))}
    )
    out.update(
        finite=np.array(finite),
        loss_scale=local_copy(jdls.get_scale(state).loss_scale),
        skipped_steps=stats.skipped_steps,
        consecutive_skips=stats.consecutive_skips,
    )
    return {f"{prefix}_{k}": v for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# shard_map: one tower of the MLP per device, each with its own data.
# --------------------------------------------------------------------------------------------


def towers(n_devices: int) -> Any:
    """One MLP per device, stacked on a leading axis."""
    return jax.tree.map(
        lambda *xs: np.stack(xs), *[jax.device_get(_mlp.init_params(d)) for d in range(n_devices)]
    )


def train_towers(mesh: Mesh, steps: np.ndarray, blow_up: np.ndarray) -> Any:
    """Train one tower per device on the steps ``steps`` (batch indices), under one shard_map.

    ``blow_up[d, k]`` multiplies device ``d``'s data on the ``k``-th step (1 or 1e30).
    Returns the towers, the per-device scale and the per-device per-step decisions.
    """
    n = mesh.devices.size
    tx = jdls.wrap(_mlp.adamw_cosine(STEPS), make_scale(), axis_name="model")
    model = NamedSharding(mesh, P("model"))

    def local(params, blow_up, steps):
        params = jax.tree.map(lambda a: a[0], params)  # this device's tower
        device = jax.lax.axis_index("model")
        state = tx.init(params)

        def body(carry, k):
            params, state = carry
            x, y = _mlp.make_batch(steps[k] * n + device)
            x = x * blow_up[0, k]
            scale = jdls.get_scale(state)
            _, grads = scale.value_and_grad(lambda p: _mlp.loss_fn(p, x, y))(params)
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), jdls.stats(state).finite

        (params, state), finite = jax.lax.scan(body, (params, state), jnp.arange(steps.shape[0]))
        stats = jdls.stats(state)
        per_device = (
            jdls.get_scale(state).loss_scale,
            stats.skipped_steps,
            stats.consecutive_skips,
            finite,
        )
        return (
            jax.tree.map(lambda a: a[None], params),
            jax.tree.map(lambda a: a[None], per_device),
        )

    run = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("model"), P("model"), P()),
            out_specs=(P("model"), P("model")),
            check_vma=False,
        )
    )
    params = jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, model, lambda idx: a[idx]), towers(n)
    )
    blow = jax.make_array_from_callback(blow_up.shape, model, lambda idx: blow_up[idx])
    repl = NamedSharding(mesh, P())
    steps_arr = jax.make_array_from_callback(steps.shape, repl, lambda idx: steps[idx])
    return run(params, blow, steps_arr)


def blow_up_matrix(mesh: Mesh, faulty: np.ndarray, faulty_process: int | None) -> np.ndarray:
    """(devices, steps): 1e30 on the faulty steps for the devices of ``faulty_process``."""
    rows = [
        np.where(faulty & (d.process_index == faulty_process), BLOW_UP, np.float32(1.0))
        for d in mesh.devices.flat
    ]
    return np.stack(rows).astype(np.float32)


def run_shard_map(mesh: Mesh, faulty: np.ndarray) -> dict[str, np.ndarray]:
    steps = np.arange(len(faulty), dtype=np.int32)
    params, (loss_scale, skipped, consecutive, finite) = train_towers(
        mesh, steps, blow_up_matrix(mesh, faulty, faulty_process=1)
    )
    out: dict[str, np.ndarray] = {}
    for name, tree in [
        ("towers", params),
        ("scale", loss_scale),
        ("skipped", skipped),
        ("consecutive", consecutive),
        ("finite", finite),
    ]:
        for i, leaf in enumerate(jax.tree.leaves(tree)):
            for shard in leaf.addressable_shards:
                position = shard.index[0].start  # the device's place on the mesh
                out[f"sm_{name}{i}_device{position}"] = np.asarray(shard.data)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local-devices", type=int, default=2)
    args = parser.parse_args()

    os.environ["JAX_PLATFORMS"] = "cpu"  # read when the backend starts, below
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=2,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    try:
        assert jax.process_count() == 2, jax.process_count()
        assert jax.local_device_count() == args.local_devices
        assert jax.device_count() == 2 * args.local_devices
        faulty = fault_steps()
        mesh = Mesh(np.array(jax.devices()), ("data",))
        steps = np.arange(STEPS, dtype=np.int32)
        out = run_jit(mesh, steps, faulty & (args.process_id == 1))
        # The reference: the same two-process program over the clean steps only.
        clean = steps[~faulty]
        out.update(run_jit(mesh, clean, np.zeros(len(clean), bool), prefix="jitref"))
        out.update(run_shard_map(Mesh(np.array(jax.devices()), ("model",)), faulty))
        np.savez(args.out / f"process{args.process_id}.npz", **out)
        print(f"process {args.process_id}: done, {len(out)} arrays")
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
