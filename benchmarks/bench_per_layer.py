"""Cost of per-layer and per-loss scales against one global scale (CPU, interleaved).

    PYTHONPATH=. python benchmarks/bench_per_layer.py

A 12-layer tanh MLP (width 256, batch 256, float16 compute): ``StaticScale.value_and_grad``
against ``layer_scaled_value_and_grad``; a two-head model: one global scale on the sum against
``multi_loss_value_and_grad`` with two scales, ``backward="one"`` (one backward pass) and
``backward="per_loss"`` (one per loss), and the global step with ``jdls.all_finite`` of its
gradients (``multi_loss_value_and_grad`` returns finite flags; a dynamic global scale needs
them too). Each set is timed in alternation, jitted, and the ratio of the medians printed (and
the median of the per-round ratios).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import jdls

DEPTH, WIDTH, BATCH = 12, 256, 256


def mlp_loss(params: dict, sites: dict | None, x: jax.Array) -> jax.Array:
    h = x.astype(jnp.float16)
    for i in range(DEPTH):
        name = f"dense_{i}"
        h = jnp.tanh(h @ params[name].astype(jnp.float16))
        h = h if sites is None else jdls.apply_site(h, sites[name])
    return jnp.mean(h.astype(jnp.float32) ** 2)


def heads_losses(params: dict, x: jax.Array) -> dict:
    h = jnp.tanh(x.astype(jnp.float16) @ params["trunk"].astype(jnp.float16))
    for i in range(4):
        h = jnp.tanh(h @ params[f"t{i}"].astype(jnp.float16))
    big = jnp.mean((h @ params["big"].astype(jnp.float16)).astype(jnp.float32) ** 2)
    small = jnp.mean((h @ params["small"].astype(jnp.float16)).astype(jnp.float32) ** 2)
    return {"big": big, "small": 1e-4 * small}


def timed(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def compare(
    name: str, base, others: dict, *args, rounds: int = 15, base_name: str = "global"
) -> dict[str, np.ndarray]:
    """Time ``base`` and each of ``others`` in alternation, ``rounds`` times; print each one's
    median against the base's, and the range and median of the per-round ratios. Returns the
    times by name (the base's under ``base_name``)."""
    times: dict[str, list[float]] = {base_name: [], **{k: [] for k in others}}
    for _ in range(rounds):
        times[base_name].append(timed(base, *args))
        for k, fn in others.items():
            times[k].append(timed(fn, *args))
    out = {k: np.array(v) for k, v in times.items()}
    for k in others:
        report(f"{name}, {k}", out[base_name], out[k], base_name)
    return out


def report(name: str, base: np.ndarray, other: np.ndarray, base_name: str) -> None:
    rounds = other / base
    print(
        f"{name}: {base_name} {np.median(base) * 1e3:.2f} ms, per-scale "
        f"{np.median(other) * 1e3:.2f} ms, ratio {np.median(other) / np.median(base):.3f} "
        f"(per-round ratios {rounds.min():.3f}-{rounds.max():.3f}, median {np.median(rounds):.3f})"
    )


def main() -> None:
    keys = jax.random.split(jax.random.key(0), DEPTH + 1)
    x = jax.random.normal(keys[-1], (BATCH, WIDTH))
    params = {
        f"dense_{i}": jax.random.normal(k, (WIDTH, WIDTH)) / math.sqrt(WIDTH)
        for i, k in enumerate(keys[:DEPTH])
    }
    one = jdls.StaticScale(2.0**10)
    sites = {k: jdls.layer_site(jdls.StaticScale(2.0**10), i) for i, k in enumerate(params)}
    base = jax.jit(lambda p, x: one.value_and_grad(mlp_loss)(p, None, x))
    layered = jax.jit(lambda p, x: jdls.layer_scaled_value_and_grad(mlp_loss)(p, sites, x))
    compare("per-layer, 12-layer MLP", base, {"per-layer": layered}, params, x)

    hp = {
        k: jax.random.normal(kk, (WIDTH, WIDTH if k not in ("big", "small") else 1))
        / math.sqrt(WIDTH)
        for k, kk in zip(
            ["trunk", "t0", "t1", "t2", "t3", "big", "small"],
            jax.random.split(keys[0], 7),
            strict=True,
        )
    }
    total = lambda p, x: sum(heads_losses(p, x).values())  # noqa: E731
    base = jax.jit(one.value_and_grad(total))
    scales = {"big": one, "small": jdls.StaticScale(2.0**20)}
    candidates = {
        f"backward={b!r}": jax.jit(jdls.multi_loss_value_and_grad(heads_losses, scales, backward=b))
        for b in ("one", "per_loss")
    }

    def checked(p: dict, x: jax.Array) -> tuple:  # a dynamic global scale needs the flag too
        value, grads = one.value_and_grad(total)(p, x)
        return value, grads, jdls.all_finite(grads)

    candidates["global + all_finite"] = jax.jit(checked)
    times = compare("per-loss, two heads on a 5-layer trunk", base, candidates, hp, x)
    for k in ("backward='one'", "backward='per_loss'"):  # both return per-loss finite flags
        report(
            f"  {k} against the global step with its finite check",
            times["global + all_finite"],
            times[k],
            "global+finite",
        )
    print(jax.devices()[0].device_kind, jax.__version__)


if __name__ == "__main__":
    main()
