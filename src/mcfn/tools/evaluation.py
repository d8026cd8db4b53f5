"""Held-out evaluation of a MegaContext model (DESIGN §7): does the working context beat truncation?

For every window, the bits per byte of its last ``H`` tokens, predicted at the same budget ``W`` under:

* ``full``: all ``T`` tokens at LOD0, the upper bound (no budget);
* ``recency``: the last ``W`` tokens at LOD0, nothing older;
* ``random``: a random compressed working context (the mean over ``M`` of them);
* ``lens``: LensNet and the allocator, refocused a few times from the coarsest full-coverage context;
* ``oracle``: per window, the best of the same ``M`` random contexts by measured tail loss.

``retained_fraction = (recency − lens) / (recency − full)`` is the share of full context's gain over
truncation that the working context keeps. ``lens_rank_corr`` is the Spearman correlation, over all pairs
of a window's random contexts, between LensNet's predicted preference and the measured tail-loss gap.
LensNet's predicted preference of ``a`` over ``b`` is how much its scores favour turning each into the
other: ``Σ s·y`` over ``b``'s entries with the I7 targets that move ``b`` towards ``a``, minus the same
with the roles swapped (:func:`mcfn.core.preferences.detail_targets`).

Everything runs eagerly under ``no_grad``: the evaluation sweeps several budgets, each its own shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm import tqdm

from mcfn.core.context import WorkingContext, assemble
from mcfn.core.losses import tail_mask
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.preferences import detail_targets, pair_slots
from mcfn.core.step import byte_sums, split_window
from mcfn.core.system import MegaContext, base_stage, lens_stage, refocus, tree_stage
from mcfn.core.tree import Tree
from mcfn.core.variants import compressed_cuts, draw_variant_noise, recency_cut
from mcfn.seeding import derive_seed
from mcfn.typecheck import typechecked

CONDITIONS = ("full", "recency", "random", "lens", "oracle")


@dataclass(frozen=True)
class EvalSettings:
    budgets: tuple[int, ...]  # W per sweep row; the first is the headline
    random_contexts: int = 8  # M: random compressed contexts per window (random and oracle)
    refocus: int = 4  # allocator iterations for the lens condition


@dataclass
class BudgetTotals:
    """Running sums for one budget: tail nats per condition, tail bytes, and the rank-correlation pairs."""

    nats: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CONDITIONS, 0.0))
    predicted: list[Tensor] = dataclasses.field(default_factory=list)
    measured: list[Tensor] = dataclasses.field(default_factory=list)


def default_budgets(layout: Layout) -> tuple[int, ...]:
    """The run's own ``W`` first, then ``T/2, T/4, T/8`` where they fit above the coarsest cover."""
    sweep = [layout.W] + [layout.T // d for d in (2, 4, 8)]
    fits = [w for w in sweep if layout.coarsest_cover < w < layout.T]
    return tuple(dict.fromkeys(fits))


@torch.no_grad()
def full_context_sums(system: MegaContext, window: Int[Tensor, "b t1"], token_bytes: Tensor) -> tuple[Tensor, Tensor]:
    """Tail nats and bytes per window with all ``T`` tokens at LOD0."""
    layout, base = system.layout, system.base
    inputs, targets = split_window(window)
    nll = base.nll(base.token_hidden(inputs), targets)
    tail = (torch.arange(layout.T, device=window.device) >= layout.T - layout.H).expand_as(targets)
    return byte_sums(nll, targets, token_bytes, tail)


@typechecked
def predicted_preference(
    scores: Float[Tensor, "r w"], shown: Bool[Tensor, "b m nodes"], wc: WorkingContext, nodes: NodeTable
) -> Float[Tensor, "b p"]:
    """LensNet's preference of slot ``i`` over slot ``j`` for every pair ``i < j`` of a window's contexts."""
    i, j = pair_slots(shown.size(1), shown.size(0), shown.device)
    y_j, _, rows_j = detail_targets(shown, i, j, wc, nodes)  # move j towards i
    y_i, _, rows_i = detail_targets(shown, j, i, wc, nodes)  # move i towards j
    return (scores[rows_j] * y_j).sum(-1) - (scores[rows_i] * y_i).sum(-1)


@torch.no_grad()
def budget_sums(
    system: MegaContext,
    tree: Tree,
    window: Int[Tensor, "b t1"],
    token_bytes: Tensor,
    budget: int,
    settings: EvalSettings,
    generator: torch.Generator,
) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """Tail nats per window and condition at budget ``budget`` (``full`` excepted; every condition scores the
    same tail bytes, counted once by :func:`full_context_sums`), and the predicted and measured preferences
    of every pair of random contexts."""
    B, M = window.size(0), settings.random_contexts
    nodes = system.nodes.with_sizes(W=budget, N=M)
    noise = draw_variant_noise(nodes.layout, B, generator, window.device)
    random = compressed_cuts(noise, nodes)  # [B, M, nodes]
    shown = torch.cat([recency_cut(nodes.layout, B, window.device), random], dim=1)
    if system.lensnet is not None:
        start = repeat(system.coarsest, "n -> b 1 n", b=B)
        shown = torch.cat([shown, refocus(system, tree, window, start, nodes, iterations=settings.refocus)], dim=1)
    # The training step's own stages, at this budget: assembly and the packed base forward.
    wc = assemble(tree, shown, window, nodes)
    nll = base_stage(system, wc)
    nats, _ = byte_sums(nll, wc.target, token_bytes, tail_mask(wc, nodes.layout))
    nats = rearrange(nats, "(b v) -> b v", b=B)
    per_window = {"recency": nats[:, 0], "random": nats[:, 1 : 1 + M].mean(-1), "oracle": nats[:, 1 : 1 + M].amin(-1)}
    predicted = measured = torch.zeros(0, device=window.device)
    if system.lensnet is not None:
        per_window["lens"] = nats[:, -1]
        slots = rearrange(torch.arange(B * shown.size(1), device=window.device), "(b v) -> b v", b=B)[:, 1 : 1 + M]
        random_wc = wc[slots.flatten()]
        predicted = predicted_preference(lens_stage(system, random_wc), random, random_wc, nodes).flatten()
        i, j = pair_slots(M, B, window.device)
        random_nats = nats[:, 1 : 1 + M]
        measured = (random_nats.gather(1, j) - random_nats.gather(1, i)).flatten()  # > 0: the first is better
    return per_window, predicted, measured


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rank correlation (Pearson over ranks; ties are broken by order, rare for float losses)."""
    if x.numel() < 3:
        return float("nan")
    rx = torch.argsort(torch.argsort(x)).double()
    ry = torch.argsort(torch.argsort(y)).double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()).clamp(min=1e-12))


def bpb(nats: float, nbytes: float) -> float:
    return nats / (math.log(2) * max(nbytes, 1.0))


def retained_fraction(row: dict[str, float]) -> float:
    gap = row["recency"] - row["full"]
    return (row["recency"] - row["lens"]) / gap if abs(gap) > 1e-12 else float("nan")


@torch.no_grad()
def evaluate_mc(
    system: MegaContext, batches: list[Tensor], token_bytes: Tensor, settings: EvalSettings, progress=None
) -> dict:
    """The evaluation report: headline row at ``settings.budgets[0]`` plus the sweep (see the module doc)."""
    was_training = system.training
    system.eval()
    device = token_bytes.device
    layout = system.layout
    totals = {w: BudgetTotals() for w in settings.budgets}
    full_nats = total_bytes = 0.0
    generator = torch.Generator(device=device)
    for index, batch in enumerate(batches):
        window = batch.to(device)
        tree = tree_stage(system, window)
        nats, nbytes = full_context_sums(system, window, token_bytes)
        full_nats += float(nats.double().sum())
        total_bytes += float(nbytes.double().sum())
        for w, acc in totals.items():
            # The same random contexts for every checkpoint evaluated on these windows at this budget.
            generator.manual_seed(derive_seed(w, "eval_contexts", index))
            per_window, predicted, measured = budget_sums(system, tree, window, token_bytes, w, settings, generator)
            for name, value in per_window.items():
                acc.nats[name] += float(value.double().sum())
            acc.predicted.append(predicted.cpu())
            acc.measured.append(measured.cpu())
        if progress is not None:
            progress(index + 1, len(batches))
    system.train(was_training)

    has_lens = system.lensnet is not None
    sweep = []
    for w, acc in totals.items():
        row = {"W": w, "compression": layout.T / w, "full": bpb(full_nats, total_bytes)}
        row.update({name: bpb(acc.nats[name], total_bytes) for name in CONDITIONS if name != "full"})
        if has_lens:
            row["retained_fraction"] = retained_fraction(row)
            row["lens_rank_corr"] = spearman(torch.cat(acc.predicted), torch.cat(acc.measured))
        else:
            row["lens"] = row["retained_fraction"] = row["lens_rank_corr"] = float("nan")
        sweep.append(row)
    head = sweep[0]
    return {
        "T": layout.T,
        "W": head["W"],
        "H": layout.H,
        "bpb": {name: head[name] for name in CONDITIONS},
        "retained_fraction": head["retained_fraction"],
        "lens_rank_corr": head["lens_rank_corr"],
        "sweep": sweep,
        "n_windows": sum(b.size(0) for b in batches),
        "random_contexts": settings.random_contexts,
        "refocus": settings.refocus,
    }


def _cell(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4f}"


def format_eval_table(report: dict) -> str:
    """The sweep as a Markdown table, one row per budget, headline first, then the headline figures."""
    lines = [
        f"Tail bits per byte (last H={report['H']} tokens of {report['n_windows']} held-out windows, T={report['T']}):",
        "",
        "| W | T/W | " + " | ".join(CONDITIONS) + " | retained | lens_rank_corr |",
        "|---:|---:|" + "---:|" * (len(CONDITIONS) + 2),
    ]
    for row in report["sweep"]:
        cells = [str(row["W"]), f"{row['compression']:.0f}", *(_cell(row[c]) for c in CONDITIONS)]
        cells += [_cell(row["retained_fraction"]), _cell(row["lens_rank_corr"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"At W={report['W']}: retained_fraction = {_cell(report['retained_fraction'])}, "
        f"lens_rank_corr = {_cell(report['lens_rank_corr'])} "
        f"(random/oracle over {report['random_contexts']} contexts, lens with {report['refocus']} refocus steps).",
    ]
    return "\n".join(lines) + "\n"


EVAL_JSON, EVAL_MD, EVAL_PNG = "eval.json", "eval.md", "eval_sweep.png"


def write_eval_outputs(report: dict, out_dir: Path) -> str:
    """``eval.json``, ``eval.md`` (the table) and ``eval_sweep.png`` in ``out_dir``; returns the table."""
    from mcfn.tools.plots import plot_budget_sweep  # matplotlib only when writing files

    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_eval_table(report)
    (out_dir / EVAL_JSON).write_text(json.dumps(report, indent=2))
    (out_dir / EVAL_MD).write_text(f"# Evaluation\n\n{table}\n![budget sweep]({EVAL_PNG})\n")
    plot_budget_sweep(report, out_dir / EVAL_PNG)
    return table


def run_evaluation(system: MegaContext, windows: list[Tensor], token_bytes: Tensor, settings: EvalSettings) -> dict:
    """:func:`evaluate_mc` with a progress bar on stderr."""
    with tqdm(total=len(windows), desc="eval", unit="batch", file=sys.stderr, dynamic_ncols=True) as bar:
        return evaluate_mc(system, windows, token_bytes, settings, progress=lambda done, total: bar.update(1))
