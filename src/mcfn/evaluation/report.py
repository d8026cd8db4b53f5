"""The evaluation's report, formatted: per task and budget, answer accuracy, bits per byte, the retained fraction
with its interval and LensNet's rank correlation, as ``eval.json``, Markdown tables and PNG plots. The numbers
come from :func:`mcfn.evaluation.evaluate.evaluate`."""

from __future__ import annotations

import json
import math
from pathlib import Path

from mcfn.evaluation.evaluate import conditions
from mcfn.evaluation.result import FULL_PLAIN, DepthAccuracy, EvalReport, ProtocolResult, Skipped, TaskResult
from mcfn.evaluation.stats import GAINS

EVAL_JSON, EVAL_MD, EVAL_PNG = "eval.json", "eval.md", "eval_sweep.png"


def _cell(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def format_eval_table(report: EvalReport) -> str:
    """Per task, two Markdown tables, generation's protocol (a refocus every ``R`` tokens) and one cut for the whole
    tail (``R = H``, the earlier protocol): a row per budget, the run's W first; bpb per condition (accuracy too for
    the probes), the retained fraction with its interval, and LensNet's rank correlation."""
    R, utility = report.settings.refocus_every, report.head.head.utility
    lines = [
        f"Held-out evaluation on the {report.split or 'given'} split, T={report.T}, scored on the last "
        f"H={report.H} targets: {report.windows} windows for corpus"
        + (f" from {report.documents} documents" if report.documents else "")
        + f", {report.windows_per_probe} for each probe; standard errors by bootstrap over "
        f"{report.se}s. Generation's protocol: every condition that "
        f"chooses a cut refocuses every R={R} tokens, as train.generate does.",
        "",
        (
            f"The run ships `{report.shipped}` (`train.generate` uses it when no `--context` is given), chosen on "
            "validation windows. "
            if report.shipped
            else ""
        )
        + f"Generate with `--context {report.best_context}`: its condition scored the lowest corpus bpb here."
        + (
            f" LensNet's utility_corr (its predicted worth of each single edit of its cut against the edit's measured "
            f"ΔNLL, per state, averaged): {_cell(utility.corr)}."
            if utility is not None
            else ""
        ),
    ]
    for task, result in report.tasks.items():
        if isinstance(result, Skipped):
            lines += ["", f"**{task}**: not scored: {result.reason}."]
            continue
        what = "tail bpb" if result.refocus.head.accuracy is None else "answer accuracy / answer bpb"
        lines += ["", f"**{task}** ({what}), refocused every R = {R}:", ""]
        lines += protocol_table(result.refocus, report.W, report.settings.names)
        if "one_cut" in result.protocols:
            lines += ["", f"**{task}**, one cut (R = H = {report.H}):", ""]
            lines += protocol_table(result.protocols["one_cut"], report.W, report.settings.names)
    if report.settings.brief:
        lines += ["", "A brief evaluation: the conditions and tasks that show the point. "
                  "`python -m train.eval --ckpt DIR` scores every condition, task and budget."]  # fmt: skip
    return "\n".join(lines) + "\n"


def protocol_table(result: ProtocolResult, W: int, candidates: tuple[str, ...] = ()) -> list[str]:
    """One protocol's rows of a task, its paired gains and differences at ``W`` and its long-range tokens."""
    names = [c for c in (*conditions(candidates), FULL_PLAIN) if c in result.head.bpb]
    lines = ["| W | " + " | ".join(names) + " | retained [95% CI] | lens_rank_corr |"]
    lines += ["|---:|" + "---:|" * (len(names) + 2)]
    for row in result.sweep:
        accuracy = row.accuracy
        cells = [_cell(row.bpb[c]) if accuracy is None else f"{accuracy[c]:.2f} / {row.bpb[c]:.3f}" for c in names]
        ci = row.retained_ci
        retained = _cell(row.retained_fraction) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        lines.append(f"| {row.W} | " + " | ".join(cells) + f" | {retained} | {_cell(row.lens_rank_corr)} |")
    gains = [f"{name} {g.bpb:+.4f} ± {g.se:.4f}" for name in GAINS if (g := result.head.gains[name])]
    if gains:
        lines += ["", f"At W={W} (bpb, ± a bootstrap standard error): " + ", ".join(gains) + "."]
    if result.head.paired:
        pairs = [f"{name} {pair.bpb:+.4f} ± {pair.se:.4f}" + ("" if pair.accuracy is None else
                 f" (answered {pair.accuracy:+.2f} ± {pair.accuracy_se:.2f})")
                 for name, pair in result.head.paired.items()]  # fmt: skip
        lines += ["", f"Paired on the same windows at W={W} (a_over_b: bpb(b) − bpb(a), positive where a is better): "
                  + ", ".join(pairs) + "."]  # fmt: skip
    if result.longrange is not None:
        lr = result.longrange
        shown = ", ".join(f"{c} {_cell(lr.row.bpb[c])}" for c in names if c in lr.row.bpb)
        lines += ["", f"Long-range tokens ({lr.tokens}: {lr.definition}), "
                  f"bpb at W={W}: {shown}; retained {_cell(lr.row.retained_fraction)}."]  # fmt: skip
    return lines


def _json_safe(value):
    """NaN as null: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def eval_json(report: EvalReport) -> str:
    """``eval.json``'s text (NaN written as null)."""
    return json.dumps(_json_safe(report.to_json()), indent=2)


def write_eval_outputs(report: EvalReport, out_dir: Path) -> str:
    """``eval.json``, ``eval.md`` (the tables), ``eval_sweep.png`` and a depth × budget accuracy heatmap per
    probe (``eval_depth_TASK.png``) in ``out_dir``; returns the tables."""
    from mcfn.evaluation.plots import plot_budget_sweep, plot_depth_heatmap  # matplotlib only when writing files

    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_eval_table(report)
    (out_dir / EVAL_JSON).write_text(eval_json(report))
    plot_budget_sweep(report, out_dir / EVAL_PNG)
    pictures = [f"![budget sweep]({EVAL_PNG})"]
    for task, depth in depth_accuracies(report).items():
        name = f"eval_depth_{task}.png"
        plot_depth_heatmap(task, depth, out_dir / name)
        pictures.append(f"![{task}: accuracy by depth and budget]({name})")
    (out_dir / EVAL_MD).write_text(f"# Evaluation\n\n{table}\n" + "\n".join(pictures) + "\n")
    return table


def depth_accuracies(report: EvalReport) -> dict[str, DepthAccuracy]:
    """Each probe's accuracy by depth and budget, under generation's protocol: what its heatmap shows."""
    return {
        task: result.refocus.depth_accuracy
        for task, result in report.tasks.items()
        if isinstance(result, TaskResult) and result.refocus.depth_accuracy is not None
    }
