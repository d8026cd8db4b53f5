"""The evaluation's report: per task and budget, answer accuracy, bits per byte and the retained fraction with
a bootstrap interval, LensNet's rank correlation; as ``eval.json``, a Markdown table and PNG plots.

``retained_fraction = (recency − lens) / (recency − full)`` is the share of full context's gain over truncation
that the working context keeps. It is reported only where that gain is real: positive, with the lower end of
its bootstrap 95% interval over windows above zero; otherwise it is "n/a" (``null`` in JSON).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from mcfn.core.system import MegaContext
from mcfn.data.probes import PROBES, ProbeBatch, make_probe, misfit
from mcfn.data.tokenizer import Tokenizer
from mcfn.seeding import derive_seed
from mcfn.tools.evaluation import CONDITIONS, LONG_RANGE_MARGIN, EvalSettings, Scores, score_batch

EVAL_JSON, EVAL_MD, EVAL_PNG = "eval.json", "eval.md", "eval_sweep.png"
BOOTSTRAP = 1000  # resamples of the windows for the retained fraction's interval
BOOTSTRAP_SEED = 0


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rank correlation (Pearson over ranks; ties are broken by order, rare for float losses)."""
    if x.numel() < 3:
        return float("nan")
    rx = torch.argsort(torch.argsort(x)).double()
    ry = torch.argsort(torch.argsort(y)).double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()).clamp(min=1e-12))


def bits_per_byte(nats: Tensor, nbytes: Tensor) -> Tensor:
    """Over the last dimension (windows): total nats / (ln 2 · total bytes)."""
    return nats.sum(-1) / (math.log(2) * nbytes.sum(-1).clamp(min=1))


def retained_with_interval(nats: dict[str, Tensor], nbytes: Tensor) -> tuple[float | None, list[float] | None]:
    """The retained fraction on scored bpb and its bootstrap 95% interval over windows, or None twice where
    ``recency − full`` is not positive beyond the noise (or there is no ``lens``)."""
    if "lens" not in nats or nbytes.sum() <= 0:
        return None, None
    g = torch.Generator().manual_seed(BOOTSTRAP_SEED)
    picks = torch.randint(0, nbytes.numel(), (BOOTSTRAP, nbytes.numel()), generator=g)
    resampled = {name: bits_per_byte(nats[name][picks], nbytes[picks]) for name in ("full", "recency", "lens")}
    gap = resampled["recency"] - resampled["full"]
    point_gap = float(bits_per_byte(nats["recency"], nbytes) - bits_per_byte(nats["full"], nbytes))
    if point_gap <= 0 or float(gap.quantile(0.025)) <= 0:
        return None, None
    point = float(bits_per_byte(nats["recency"] - nats["lens"], nbytes)) / point_gap
    fraction = (resampled["recency"] - resampled["lens"]) / gap
    return point, [float(fraction.quantile(0.025)), float(fraction.quantile(0.975))]


def paired_gain(nats: dict[str, Tensor], nbytes: Tensor, worse: str, better: str) -> dict[str, float] | None:
    """``bpb(worse) − bpb(better)`` on the same windows, and its standard error by bootstrap over windows."""
    if worse not in nats or better not in nats or nbytes.sum() <= 0:
        return None
    g = torch.Generator().manual_seed(BOOTSTRAP_SEED)
    picks = torch.randint(0, nbytes.numel(), (BOOTSTRAP, nbytes.numel()), generator=g)
    resampled = bits_per_byte(nats[worse][picks] - nats[better][picks], nbytes[picks])
    return {"bpb": float(bits_per_byte(nats[worse] - nats[better], nbytes)), "se": float(resampled.std())}


# Paired differences every sweep row reports: LensNet's gain over truncation and over the structured cut
# ``recent``, and what its gists are worth.
GAINS = {
    "lens_gain": ("recency", "lens"),
    "lens_over_recent": ("recent", "lens"),
    "gist_worth": ("lens_nogist", "lens"),
}


def summarise(scores: Scores, task: str, budget: int, T: int) -> dict:
    """One sweep row: bpb (and accuracy for probes) per condition, the retained fraction, the rank correlation."""
    nats = {name: torch.cat(parts) for name, parts in scores.nats.items()}
    nbytes = torch.cat(scores.nbytes)
    retained, interval = retained_with_interval(nats, nbytes)
    row = {
        "W": budget,
        "compression": T / budget,
        "bpb": {name: float(bits_per_byte(value, nbytes)) for name, value in nats.items()},
        "retained_fraction": retained,
        "retained_ci": interval,
        **{name: paired_gain(nats, nbytes, *pair) for name, pair in GAINS.items()},
    }
    if task != "corpus":
        row["accuracy"] = {name: float(torch.cat(parts).mean()) for name, parts in scores.correct.items()}
    if scores.predicted:
        row["lens_rank_corr"] = spearman(torch.cat(scores.predicted), torch.cat(scores.measured))
    return row


def accuracy_by_depth(scores: Scores, condition: str, bins: int = 5) -> list[float | None]:
    """A probe's accuracy under ``condition`` in ``bins`` equal slices of the depth of its fact."""
    depth, correct = torch.cat(scores.depth), torch.cat(scores.correct[condition])
    which = (depth * bins).long().clamp(max=bins - 1)
    return [float(correct[which == b].mean()) if (which == b).any() else None for b in range(bins)]


def evaluate_tasks(
    system: MegaContext,
    windows: list[Tensor],
    token_bytes: Tensor,
    tokenizer: Tokenizer | None,
    settings: EvalSettings,
    reference: torch.nn.Module | None = None,
    progress=None,
) -> dict:
    """Score every task of ``settings`` on the held-out ``windows`` (each task writes its probe into them;
    ``corpus`` alone needs no tokenizer)."""
    was_training = system.training
    system.eval()
    layout, device = system.layout, token_bytes.device
    tasks: dict[str, dict] = {}
    for task in settings.tasks:
        reason = misfit(task, tokenizer, layout.T, layout.H)
        if reason is not None:  # a question longer than the scored tail: reported, not scored
            tasks[task] = {"skipped": reason}
            continue
        scores = {w: Scores() for w in settings.budgets}
        longrange = {w: Scores() for w in settings.budgets} if task == "corpus" else None
        batches = windows if task == "corpus" else windows[: settings.probe_batches]
        for index, batch in enumerate(batches):
            probe = make_probe(task, batch, tokenizer, layout.H, derive_seed(PROBES.index(task), "eval_probes", index))
            probe = ProbeBatch(probe.window.to(device), probe.answer.to(device), probe.depth)
            score_batch(system, probe, token_bytes, settings, index, scores, longrange, reference)
            if progress is not None:
                progress()
        rows = [summarise(scores[w], task, w, layout.T) for w in settings.budgets]
        tasks[task] = {**rows[0], "sweep": rows}
        if longrange is not None:
            head = longrange[settings.budgets[0]]
            tasks[task]["longrange"] = {
                "margin_nats": LONG_RANGE_MARGIN,
                "tokens": int(sum(int((b > 0).sum()) for b in head.nbytes)),
                **summarise(head, task, settings.budgets[0], layout.T),
            }
        if task != "corpus":
            condition = "lens" if system.lensnet is not None else "attn"
            tasks[task]["depth_accuracy"] = {
                "condition": condition,
                "by_budget": {str(w): accuracy_by_depth(scores[w], condition) for w in settings.budgets},
            }
    system.train(was_training)
    return tasks


def run_evaluation(
    system: MegaContext,
    windows: list[Tensor],
    token_bytes: Tensor,
    tokenizer: Tokenizer,
    settings: EvalSettings,
    reference: torch.nn.Module | None = None,
) -> dict:
    """The evaluation report (:func:`evaluate_tasks` with a progress bar on stderr); today's headline keys come
    from ``corpus`` at the run's ``W``, and ``tasks`` holds every task."""
    probes = len(windows[: settings.probe_batches])
    total = len(windows) + probes * (len(settings.tasks) - 1)  # batches; a skipped task's are never counted
    with tqdm(total=total, desc="eval", unit="batch", file=sys.stderr, dynamic_ncols=True) as bar:
        tasks = evaluate_tasks(system, windows, token_bytes, tokenizer, settings, reference, lambda: bar.update(1))
    head = tasks[settings.tasks[0]]
    layout = system.layout
    return {
        "T": layout.T,
        "W": settings.budgets[0],
        "H": layout.H,
        "bpb": head["bpb"],
        "retained_fraction": head["retained_fraction"],
        "lens_rank_corr": head.get("lens_rank_corr"),
        "sweep": [
            {
                "W": r["W"],
                "compression": r["compression"],
                **r["bpb"],
                "retained_fraction": r["retained_fraction"],
                "lens_rank_corr": r.get("lens_rank_corr"),
            }
            for r in head["sweep"]
        ],  # fmt: skip
        "n_windows": sum(b.size(0) for b in windows),
        "n_windows_per_probe": sum(b.size(0) for b in windows[: settings.probe_batches]),
        "random_contexts": settings.random_contexts,
        "refocus": settings.refocus,
        "tasks": tasks,
    }


def _cell(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def format_eval_table(report: dict) -> str:
    """Per task, one Markdown table: a row per budget, the run's W first; bpb per condition (accuracy too for
    the probes), the retained fraction with its interval, and LensNet's rank correlation."""
    lines = [
        f"Held-out evaluation, T={report['T']}, scored on the last H={report['H']} targets: {report['n_windows']} "
        f"windows for corpus, {report['n_windows_per_probe']} for each probe."
    ]
    for task, result in report["tasks"].items():
        if "skipped" in result:
            lines += ["", f"**{task}**: not scored: {result['skipped']}."]
            continue
        names = [c for c in (*CONDITIONS, "full_plain") if c in result["bpb"]]
        probe = "accuracy" in result
        what = "answer accuracy / answer bpb" if probe else "tail bpb"
        lines += ["", f"**{task}** ({what}):", ""]
        lines += ["| W | " + " | ".join(names) + " | retained [95% CI] | lens_rank_corr |"]
        lines += ["|---:|" + "---:|" * (len(names) + 2)]
        for row in result["sweep"]:
            cells = [
                f"{row['accuracy'][c]:.2f} / {row['bpb'][c]:.3f}" if probe else _cell(row["bpb"][c]) for c in names
            ]
            ci = row["retained_ci"]
            retained = _cell(row["retained_fraction"]) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
            lines.append(
                f"| {row['W']} | " + " | ".join(cells) + f" | {retained} | {_cell(row.get('lens_rank_corr'))} |"
            )
        gains = [f"{name} {g['bpb']:+.4f} ± {g['se']:.4f}" for name in GAINS if (g := result.get(name))]
        if gains:
            lines += ["", f"At W={report['W']} (bpb, ± a bootstrap standard error): " + ", ".join(gains) + "."]
        if "longrange" in result:
            lr = result["longrange"]
            shown = ", ".join(f"{c} {_cell(lr['bpb'][c])}" for c in names if c in lr["bpb"])
            lines += ["", f"Long-range tokens ({lr['tokens']}, full beats recency by > {lr['margin_nats']} nats), "
                      f"bpb at W={report['W']}: {shown}; retained {_cell(lr['retained_fraction'])}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _json_safe(value):
    """NaN as null: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def write_eval_outputs(report: dict, out_dir: Path) -> str:
    """``eval.json``, ``eval.md`` (the tables), ``eval_sweep.png`` and a depth × budget accuracy heatmap per
    probe (``eval_depth_TASK.png``) in ``out_dir``; returns the tables."""
    from mcfn.tools.plots import plot_budget_sweep, plot_depth_heatmap  # matplotlib only when writing files

    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_eval_table(report)
    (out_dir / EVAL_JSON).write_text(json.dumps(_json_safe(report), indent=2))
    plot_budget_sweep(report, out_dir / EVAL_PNG)
    pictures = [f"![budget sweep]({EVAL_PNG})"]
    for task, result in report["tasks"].items():
        if "depth_accuracy" in result:
            name = f"eval_depth_{task}.png"
            plot_depth_heatmap(task, result["depth_accuracy"], out_dir / name)
            pictures.append(f"![{task}: accuracy by depth and budget]({name})")
    (out_dir / EVAL_MD).write_text(f"# Evaluation\n\n{table}\n" + "\n".join(pictures) + "\n")
    return table
