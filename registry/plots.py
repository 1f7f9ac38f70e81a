"""Run plots written as PNG files: the stage-2 KL curve and the layer-assignment matrix.

matplotlib is imported inside the functions with the Agg backend, so importing this module opens no display
and costs nothing for commands that never plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    # Agg renders to files only: works headless and never tries to open a window.
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def kl_curve(history: list[dict[str, Any]], path: Path, *, title: str) -> Path | None:
    """Train KL per step and validation KL on the eval steps, on one axis. Returns the PNG path, or None
    when the history holds no step with a KL value (a closed-form-only fit)."""
    train = [(r["step"], r["train_kl"]) for r in history if r.get("train_kl") is not None]
    val = [(r["step"], r["val_kl"]) for r in history if r.get("val_kl") is not None]
    if not train and not val:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    try:
        if train:
            ax.plot(*zip(*train), label="train KL", linewidth=1.2)
        if val:
            ax.plot(*zip(*val), "o-", label="validation KL", linewidth=1.5)
        _save_line_plot(fig, ax, path, xlabel="optimizer step", ylabel="KL (nats/token)", title=title)
    finally:
        plt.close(fig)
    return path


def _save_line_plot(fig, ax, path: Path, *, xlabel: str, ylabel: str, title: str) -> None:
    """Label, grid and legend one line plot, then write it as PNG (the layout every line plot of a run shares)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def assignment_matrix(assignment: dict[str, dict[str, list[int]]]) -> dict[str, list[list[float]]]:
    """Per cache object (keys, values, ...), a [n_target_layers][n_source_layers] matrix: 1 where the target
    layer reads the source layer.

    The source depth is not in a fit summary, so columns run up to the deepest source layer read.
    """
    n_target = max((int(t) + 1 for layers in assignment.values() for t in layers), default=0)
    n_source = max((s + 1 for layers in assignment.values() for src in layers.values() for s in src), default=0)
    matrices = {}
    for side, layers in assignment.items():
        rows = [[0.0] * n_source for _ in range(n_target)]
        for t, sources in layers.items():
            for s in sources:
                rows[int(t)][s] = 1.0
        matrices[side] = rows
    return matrices


def assignment_heatmap(assignment: dict[str, dict[str, list[int]]], path: Path, *, title: str) -> Path | None:
    """The cache objects' (keys, values, ...) assignment matrices side by side (target layer × source layer).
    None if empty."""
    matrices = assignment_matrix(assignment)
    first = next(iter(matrices.values()), None)
    if not first or not first[0]:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(matrices), figsize=(4.5 * len(matrices), 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    try:
        for ax, side in zip(axes, matrices):
            ax.imshow(matrices[side], cmap="Blues", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
            ax.set_title(side)
            ax.set_xlabel("source layer")
        axes[0].set_ylabel("target layer")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


# Colours per condition, fixed so that every figure of a page reads the same way.
CONDITION_COLOURS = {
    "target_native": "#2b6cb0", "source_native": "#805ad5", "closed_form": "#dd6b20", "distilled": "#2f855a",
    "empty_prefix": "#a0aec0", "random_map": "#e53e3e",
}


def kl_bars(val_kl: dict[str, float], val_kl_se: dict[str, float], path: Path, *, title: str) -> Path | None:
    """Validation KL per condition (closed form, distilled, and the empty-prefix / random-map controls) as bars
    with ±1.96·SE whiskers on a log axis (the controls sit one to two decades above). None if no KL."""
    order = [c for c in ("closed_form", "distilled", "empty_prefix", "random_map") if val_kl.get(c) is not None]
    if not order:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    try:
        values = [val_kl[c] for c in order]
        errors = [1.96 * (val_kl_se.get(c) or 0.0) for c in order]
        bars = ax.bar(order, values, yerr=errors, capsize=4, color=[CONDITION_COLOURS[c] for c in order])
        ax.bar_label(bars, labels=[f"{v:.3f}" for v in values], padding=2, fontsize=9)
        ax.set_yscale("log")
        ax.set_ylabel("validation KL (nats/token, log)")
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def benchmark_scores(rows: list[dict[str, Any]], path: Path, *, title: str) -> Path | None:
    """One panel per benchmark: the score of every condition with a ±1.96·SE whisker (its own mean over items).
    `rows`: dicts with benchmark, condition, score, se. None if there are no rows."""
    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    if not benchmarks:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(benchmarks), figsize=(3.4 * len(benchmarks), 3.6), squeeze=False)
    try:
        for ax, name in zip(axes[0], benchmarks):
            picked = [r for r in rows if r["benchmark"] == name]
            labels = [r["condition"] for r in picked]
            ax.bar(range(len(picked)), [r["score"] for r in picked],
                   yerr=[1.96 * (r.get("se") or 0.0) for r in picked], capsize=3,
                   color=[CONDITION_COLOURS.get(c, "#718096") for c in labels])
            ax.set_xticks(range(len(picked)), labels, rotation=40, ha="right", fontsize=8)
            ax.set_title(name, fontsize=10)
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def multiturn_per_turn(modes: dict[str, dict[str, Any]], path: Path, *, title: str) -> Path | None:
    """Recall per turn of an alternating hand-off, one line per mode (`tasks.multiturn` result["modes"])."""
    if not modes:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    try:
        for mode, row in modes.items():
            turns = range(1, len(row["per_turn"]) + 1)
            ax.plot(turns, row["per_turn"], "o-", label=f"{mode} (mean {row['mean']:.2f})")
        ax.set_ylim(-0.05, 1.05)
        _save_line_plot(fig, ax, path, xlabel="turn (holder alternates A, B, A, …)", ylabel="recall", title=title)
    finally:
        plt.close(fig)
    return path
