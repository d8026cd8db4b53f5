"""The evaluation's report, formatted: per task and budget, answer accuracy, bits per byte, the retained fraction
with its interval and LensNet's rank correlation, as ``eval.json``, Markdown tables and PNG plots. The numbers
come from :func:`mcfn.tools.evaluation.evaluate`."""

from __future__ import annotations

import json
import math
from pathlib import Path

from mcfn.tools.eval_stats import GAINS
from mcfn.tools.evaluation import CONDITIONS

EVAL_JSON, EVAL_MD, EVAL_PNG = "eval.json", "eval.md", "eval_sweep.png"


def _cell(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def format_eval_table(report: dict) -> str:
    """Per task, two Markdown tables, generation's protocol (a refocus every ``R`` tokens) and one cut for the whole
    tail (``R = H``, the earlier protocol): a row per budget, the run's W first; bpb per condition (accuracy too for
    the probes), the retained fraction with its interval, and LensNet's rank correlation."""
    lines = [
        f"Held-out evaluation on the {report.get('split') or 'given'} split, T={report['T']}, scored on the last "
        f"H={report['H']} targets: {report['windows']} windows for corpus"
        + (f" from {report['documents']} documents" if report.get("documents") else "")
        + f", {report['n_windows_per_probe']} for each probe; standard errors by bootstrap over "
        f"{report.get('se', 'window')}s. Generation's protocol: every condition that chooses a cut refocuses every "
        f"R={report['refocus_every']} tokens, as train.generate does.",
        "",
        f"Generate with `--context {report['best_context']}`: its condition scored the lowest corpus bpb here."
        + (
            f" LensNet's utility_corr (its predicted worth of each single edit of its cut against the edit's measured "
            f"ΔNLL, per state, averaged): {_cell(report['utility_corr'])}."
            if report.get("utility_corr") is not None
            else ""
        ),
    ]
    for task, result in report["tasks"].items():
        if "skipped" in result:
            lines += ["", f"**{task}**: not scored: {result['skipped']}."]
            continue
        what = "answer accuracy / answer bpb" if "accuracy" in result else "tail bpb"
        lines += ["", f"**{task}** ({what}), refocused every R = {report['refocus_every']}:", ""]
        lines += protocol_table(result, report["W"])
        if "one_cut" in result:
            lines += ["", f"**{task}**, one cut (R = H = {report['H']}):", ""]
            lines += protocol_table(result["one_cut"], report["W"])
    if report.get("brief"):
        lines += ["", "A brief evaluation: the conditions and tasks that show the point. "
                  "`python -m train.eval --ckpt DIR` scores every condition, task and budget."]  # fmt: skip
    return "\n".join(lines) + "\n"


def protocol_table(result: dict, W: int) -> list[str]:
    """One protocol's rows of a task, its paired gains at ``W`` and its long-range tokens."""
    names = [c for c in (*CONDITIONS, "full_plain") if c in result["bpb"]]
    probe = "accuracy" in result
    lines = ["| W | " + " | ".join(names) + " | retained [95% CI] | lens_rank_corr |"]
    lines += ["|---:|" + "---:|" * (len(names) + 2)]
    for row in result["sweep"]:
        cells = [f"{row['accuracy'][c]:.2f} / {row['bpb'][c]:.3f}" if probe else _cell(row["bpb"][c]) for c in names]
        ci = row["retained_ci"]
        retained = _cell(row["retained_fraction"]) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        lines.append(f"| {row['W']} | " + " | ".join(cells) + f" | {retained} | {_cell(row.get('lens_rank_corr'))} |")
    gains = [f"{name} {g['bpb']:+.4f} ± {g['se']:.4f}" for name in GAINS if (g := result.get(name))]
    if gains:
        lines += ["", f"At W={W} (bpb, ± a bootstrap standard error): " + ", ".join(gains) + "."]
    if "longrange" in result:
        lr = result["longrange"]
        shown = ", ".join(f"{c} {_cell(lr['bpb'][c])}" for c in names if c in lr["bpb"])
        lines += ["", f"Long-range tokens ({lr['tokens']}: {lr['definition']}), "
                  f"bpb at W={W}: {shown}; retained {_cell(lr['retained_fraction'])}."]  # fmt: skip
    return lines


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
