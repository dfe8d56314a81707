"""Plots and the target summary, drawn from the JSON results of the suites.

``python -m benchmarks plot [--out benchmarks/results] [--img docs/img]`` redraws
``perf_ratios.png`` (time ratios to the baseline, IQR whiskers, per suite),
``perf_roofline.png`` (achieved GB/s against the streaming kernels) and
``perf_capabilities.png`` (each capability's time ratio against its target); ``python -m
benchmarks all`` also writes ``summary.md``, jdls's performance targets next to the measured
values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def load(out: Path, suite: str, suffix: str = "") -> dict[str, Any] | None:
    path = Path(out) / f"{suite}{suffix}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _rows(result: dict[str, Any] | None, section: int = 0) -> dict[str, dict[str, Any]]:
    if result is None or len(result["sections"]) <= section:
        return {}
    return {r["label"]: r for r in result["sections"][section]["rows"]}


# --------------------------------------------------------------------------------------------
# Targets.
# --------------------------------------------------------------------------------------------


def targets(out: Path, suffix: str = "") -> list[dict[str, Any]]:
    """The performance targets with the measured value of each (None where not measured)."""
    step = _rows(load(out, "step", suffix))
    update = _rows(load(out, "update", suffix))
    large = _rows(load(out, "update-large", suffix))
    compile_result = load(out, "compile", suffix)
    c_step, c_update = _rows(compile_result, 0), _rows(compile_result, 1)
    roof = _rows(load(out, "roofline", suffix))
    found: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, detail: str = "") -> None:
        met = None if value is None else bool(value <= limit)
        found.append({"target": name, "value": value, "limit": limit, "met": met, "detail": detail})

    def get(rows: dict[str, dict[str, Any]], label: str, key: str) -> float | None:
        row = rows.get(label)
        return None if row is None else row.get(key)

    add("full step: jdls.wrap(adam) / static scale", get(step, "jdls.wrap(adam)", "ratio"), 1.03)
    peers = [
        "Flax DynamicScale + jnp.where",
        "jmp DynamicLossScale + select_tree",
        "static scale + optax.apply_if_finite",
    ]
    peer_ratios = [(get(step, p, "ratio"), p) for p in peers if get(step, p, "ratio") is not None]
    jd = get(step, "jdls.wrap(adam)", "ratio")
    if peer_ratios and jd is not None:
        best, who = min(peer_ratios)
        add("full step: jdls.wrap(adam) / best peer", jd / best, 1.0, f"best peer: {who}")
    add("update: jdls.wrap(adam) / adam", get(update, "jdls.wrap(adam)", "ratio"), 1.25)
    add(
        "update: jdls.wrap(adam, max_norm) / adam",
        get(update, "jdls.wrap(adam, max_norm)", "ratio"),
        1.30,
    )
    add("update, 100M: jdls.wrap(adam) / adam", get(large, "jdls.wrap(adam)", "ratio"), 1.25)
    add(
        "update, 100M: jdls.wrap(adam, max_norm) / adam",
        get(large, "jdls.wrap(adam, max_norm)", "ratio"),
        1.30,
    )
    for rows, where in ((step, "full step"), (update, "update")):
        for name in ("jdls.wrap(adam)", "jdls.wrap(adam, max_norm)"):
            taken = get(rows, name, "ratio")
            skipped = get(rows, f"{name} [skipped step]", "ratio")
            if taken is not None and skipped is not None:
                add(f"{where}: {name} skipped / taken", skipped / taken, 1.0)
    for rows, where, label in (
        (c_step, "full step", "jdls.wrap(adam)"),
        (c_update, "update", "jdls.wrap(adam)"),
    ):
        if not rows:
            continue
        base = next(iter(rows.values()))
        add(
            f"{where}: temp memory increase, % of the static footprint",
            get(rows, label, "temp_delta_pct_of_footprint"),
            1.0,
            f"temp {get(rows, label, 'temp_mib') or 0:.2f} MiB vs {base['temp_mib']:.2f} MiB",
        )
        add(
            f"{where}: compile time (trace+lower+compile) ratio",
            get(rows, label, "total_ratio"),
            1.25,
        )
    wrap = roof.get("jdls.wrap(adam)")
    if wrap is not None:
        add(
            "roofline: jdls.wrap(adam) time / adam time",
            wrap["ratio_to_adam"],
            1.25,
            f"bound from bytes moved: {wrap['bound_ratio_to_adam']:.3f}",
        )
    capabilities = load(out, "capabilities", suffix)
    for row in capabilities["sections"][0]["rows"] if capabilities else []:
        if row.get("target") is not None:
            add(
                f"{row['workload']} full step: {row['label']} / {row['baseline']}",
                row["ratio"],
                row["target"],
                row.get("owner") or row.get("issue", ""),
            )
    return found


def summary_markdown(out: Path, suffix: str = "") -> str:
    rows = targets(out, suffix)
    lines = [
        f"## Targets{' (' + suffix.strip('-') + ')' if suffix else ''}",
        "",
        "| target | measured | limit | met |",
        "|:--|--:|--:|:--|",
    ]
    for r in rows:
        value = "–" if r["value"] is None else f"{r['value']:.3f}"
        met = {None: "not measured", True: "yes", False: "**no**"}[r["met"]]
        detail = f" ({r['detail']})" if r["detail"] else ""
        lines.append(f"| {r['target']}{detail} | {value} | {r['limit']:.2f} | {met} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Plots.
# --------------------------------------------------------------------------------------------


def _ratio_panel(ax: Any, result: dict[str, Any], title: str, limit: float | None) -> None:
    rows = result["sections"][0]["rows"]
    labels = [r["label"] for r in rows][::-1]
    med = [r["ratio"] for r in rows][::-1]
    lo = [r["ratio"] - r["ratio_q1"] for r in rows][::-1]
    hi = [r["ratio_q3"] - r["ratio"] for r in rows][::-1]
    colors = [
        "tab:blue"
        if label.startswith(("jdls", "chain(jdls"))
        else "tab:olive"
        if label.startswith("reference")
        else "tab:gray"
        for label in labels
    ]
    ax.barh(range(len(rows)), med, xerr=[lo, hi], color=colors, capsize=2)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8)
    if limit is not None:
        ax.axvline(limit, color="tab:red", lw=0.8, ls="--", label=f"target {limit}")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(f"time / {rows[0]['label']} (median of per-round ratios, IQR)", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)


def plot_all(out: Path, img: Path, suffix: str = "") -> list[Path]:
    """Draw the plots from the results in ``out`` into ``img``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = Path(img)
    img.mkdir(parents=True, exist_ok=True)
    written = []
    panels = [
        ("step", "Full step, 8M-parameter MLP (float16 compute)", 1.03),
        ("transformer", "Full step, small transformer", 1.03),
        ("update", "Update only, 8M parameters in 64 leaves", 1.25),
        ("update-large", "Update only, 100M parameters in 500 leaves", 1.25),
    ]
    present = [
        (load(out, s, suffix), t, lim) for s, t, lim in panels if load(out, s, suffix) is not None
    ]
    if present:
        fig, axes = plt.subplots(len(present), 1, figsize=(8, 2.2 + 2.3 * len(present)))
        axes = [axes] if len(present) == 1 else list(axes)
        for ax, (result, title, limit) in zip(axes, present, strict=True):
            _ratio_panel(ax, result, title, limit)
        env = present[0][0]["environment"]
        fig.suptitle(
            f"jdls benchmarks, {env['date']}, {env['cpu']} ({env['cpu_count']} cores), "
            f"jax {env['versions']['jax']}",
            fontsize=9,
        )
        fig.tight_layout()
        path = img / f"perf_ratios{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    capabilities = load(out, "capabilities", suffix)
    if capabilities is not None:
        rows = [r for r in capabilities["sections"][0]["rows"] if r.get("target")][::-1]
        fig, ax = plt.subplots(figsize=(10, 1.4 + 0.35 * len(rows)))
        y = range(len(rows))
        err = [
            [r["ratio"] - r["ratio_q1"] for r in rows],
            [r["ratio_q3"] - r["ratio"] for r in rows],
        ]
        colors = ["tab:blue" if r["met"] else "tab:orange" for r in rows]
        ax.barh(y, [r["ratio"] - 1 for r in rows], left=1, xerr=err, color=colors, capsize=2)
        targets_x = [r["target"] for r in rows]
        ax.scatter(targets_x, y, marker="|", s=300, color="tab:red", label="target", zorder=3)
        ax.set_yticks(y, [f"{r['workload']}: {r['label']}" for r in rows], fontsize=7)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.legend(fontsize=7, loc="upper right")
        ax.set_xlabel("time / baseline step (median of per-round ratios, IQR)", fontsize=7)
        ax.set_title("Cost of each capability, full train step (blue: target met)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        path = img / f"perf_capabilities{suffix}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    roof = load(out, "roofline", suffix)
    if roof is not None:
        sections = roof["sections"]
        fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 3.8))
        axes = [axes] if len(sections) == 1 else list(axes)
        for ax, section in zip(axes, sections, strict=True):
            rows = section["rows"]
            labels = [r["label"] for r in rows][::-1]
            gbs = [r["gb_per_s"] for r in rows][::-1]
            colors = [
                "tab:green"
                if lab.startswith("streaming")
                else "tab:blue"
                if "jdls" in lab
                else "tab:gray"
                for lab in labels
            ]
            ax.barh(range(len(rows)), gbs, color=colors)
            ax.set_yticks(range(len(rows)), labels, fontsize=7)
            ax.set_xlabel("GB/s (minimum bytes / median time)", fontsize=8)
            ax.set_title(section["title"], fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        path = img / f"perf_roofline{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    leaves = load(out, "compile-leaves", suffix)
    if leaves is not None:
        rows = leaves["sections"][0]["rows"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for k, name in enumerate(dict.fromkeys(r["variant"] for r in rows)):
            mine = [r for r in rows if r["variant"] == name]
            x = [r["n_leaves"] for r in mine]
            color = f"C{k}"
            axes[0].plot(x, [r["cpu_ms"] for r in mine], "o-", label=name, color=color)
            if name != "adam":
                added = [r["added_cpu_ms"] for r in mine]
                axes[1].plot(x, added, "o-", label=name, color=color)
        for ax, what in zip(axes, ("trace+lower+compile", "added to adam's"), strict=True):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("leaves (fixed total size)", fontsize=8)
            ax.set_ylabel(f"{what}, CPU ms", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
        fig.suptitle("Compile time of the update against the number of leaves", fontsize=9)
        fig.tight_layout()
        path = img / f"perf_compile_leaves{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
