"""PNG figures for evaluation and run reports (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from mcfn.core.policy import FULL, policies  # noqa: E402
from mcfn.evaluation.headroom import BEST_OF  # noqa: E402
from mcfn.evaluation.result import FULL_PLAIN, DepthAccuracy, EvalReport  # noqa: E402


def plot_budget_sweep(report: EvalReport, path: Path) -> None:
    """The headline task's tail bpb against compression ratio ``T / W``, one line per condition."""
    rows = sorted(report.head.sweep, key=lambda r: r.compression)
    x = [r.compression for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    markers = iter("osd^x*<>ph" * 2)
    styles = {FULL.name: "k--", FULL_PLAIN: "k:"}
    styles |= {policy.name: f"{next(markers)}-" for policy in policies() if policy is not FULL}
    styles[BEST_OF[-1]] = "v:"  # the out-of-sample best of every cut: the headroom
    for name, style in styles.items():
        if all(name in r.bpb for r in rows):  # only the conditions that were measured
            ax.plot(x, [r.bpb[name] for r in rows], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel("compression T / W")
    ax.set_ylabel(f"tail bits per byte (last {report.H} tokens)")
    ax.set_title(f"Budget sweep, T={report.T}, {report.windows} held-out windows")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_depth_heatmap(task: str, depth_accuracy: DepthAccuracy, path: Path) -> None:
    """A probe's answer accuracy by the depth of its fact (columns) and the budget (rows): the
    needle-in-a-haystack picture."""
    budgets = list(depth_accuracy.by_budget)
    grid = [[float("nan") if v is None else v for v in depth_accuracy.by_budget[w]] for w in budgets]
    bins = len(grid[0])
    columns = [f"{j / bins:.1f}-{(j + 1) / bins:.1f}" for j in range(bins)]
    title = f"{task}: answer accuracy ({depth_accuracy.condition})"
    plot_accuracy_grid(grid, [f"W={w}" for w in budgets], columns, "depth of the fact (fraction of T)", title, path)


def plot_accuracy_grid(
    grid: list[list[float]], rows: list[str], columns: list[str], xlabel: str, title: str, path: Path
) -> None:
    """Accuracies ``grid[row][column]`` in [0, 1] (NaN: not measured) as a red-to-green heatmap, each cell written."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(columns) + 2), 0.6 * len(rows) + 1.8), dpi=120)
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


Series = dict[str, tuple[list[float], list[float]]]


def plot_panels(
    path: Path, title: str, xlabel: str, panels: list[tuple[str, Series]], marks: dict[str, float] | None = None
) -> None:
    """One row of line charts sharing an x axis label: ``panels`` is ``[(ylabel, {label: (xs, ys)})]``; ``marks``
    draws a labelled vertical line at each x on every panel (the switch from the plain to the MC phase)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), dpi=110, squeeze=False)
    for ax, (ylabel, series) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in series.items():
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=label)
        for label, x in (marks or {}).items():
            ax.axvline(x, color="grey", linestyle="--", linewidth=1, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if any(xs for xs, _ in series.values()):
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
