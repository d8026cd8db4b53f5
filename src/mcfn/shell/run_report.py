"""``DIR/report.md`` at the end of a run: what it did, how fast, how well, with PNG plots of the metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcfn.evaluation.plots import Series, plot_panels
from mcfn.evaluation.report import EVAL_PNG, depth_accuracies, format_eval_table
from mcfn.evaluation.result import EvalReport

REPORT_NAME = "report.md"
PHASES = ("time/data_ms", "time/fwd_bwd_ms", "time/optim_ms", "time/log_ms")


def _series(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    rows = [(r["step"] * scale, r[key]) for r in records if key in r]
    return [x for x, _ in rows], [y for _, y in rows]


def mc_phase(record: dict[str, Any]) -> bool:
    """Whether a logged step trained MegaContext (its metrics carry ``mc/``), not the plain GPT alone."""
    return any(key.startswith("mc/") for key in record)


def language_model_loss(records: list[dict[str, Any]], scale: float) -> Series:
    """The base model's next-token loss over whole windows, continuous across the phases: ``train/loss_lm`` in the
    plain phase, the full-window teacher's ``train/loss_full`` (the same loss, unweighted) in the MC phase."""
    plain = [r for r in records if "train/loss_lm" in r and not mc_phase(r)]
    mc = [r for r in records if mc_phase(r)]
    return {"plain phase: train/loss_lm": _series(plain, "train/loss_lm", scale),
            "MC phase: train/loss_full": _series(mc, "train/loss_full", scale)}  # fmt: skip


def mc_terms(records: list[dict[str, Any]], scale: float) -> Series:
    """The MC phase's own loss terms (the variants' tail loss, reconstruction, LensNet's, ...) and their sum."""
    mc = [r for r in records if mc_phase(r)]
    keys = sorted({k for r in mc for k in r if k.startswith("train/loss") and k != "train/loss_full"})
    return {key: _series(mc, key, scale) for key in keys}


def plot_loss_and_timings(out_dir: Path, records: list[dict[str, Any]], tokens_per_step: float) -> None:
    """``loss.png`` (the language-model loss across both phases with the switch marked, the MC phase's own terms,
    validation bpb and the pass key against tokens) and ``timings.png`` (phase times per step)."""
    val_keys = sorted({k for r in records for k in r if k.startswith("val/")})
    panels = [("language-model loss (nats)", language_model_loss(records, tokens_per_step))]
    terms = mc_terms(records, tokens_per_step)
    if terms:
        panels.append(("MC phase: loss terms (nats)", terms))
    panels.append(("val bits per byte", {k: _series(records, k, tokens_per_step) for k in val_keys}))
    if any("probe/passkey_full" in r for r in records):  # when retrieval forms
        panels.append(
            ("pass key answered, full window", {"passkey": _series(records, "probe/passkey_full", tokens_per_step)})
        )
    switch = next((r["step"] * tokens_per_step for r in records if mc_phase(r)), None)
    marks = {} if switch is None else {"MC phase starts": switch}
    plot_panels(out_dir / "loss.png", "Loss, validation bits per byte and retrieval", "tokens", panels, marks)
    timed = [r for r in records if "time/step_ms" in r][1:]  # the first logged step includes compilation
    plot_panels(
        out_dir / "timings.png",
        "Phase times per logged step (the first, which compiles, left out)",
        "step",
        [("ms", {k.removeprefix("time/"): _series(timed, k) for k in (*PHASES, "time/step_ms")})],
    )


def lensnet_section(out_dir: Path, records: list[dict[str, Any]]) -> list[str]:
    """``lensnet.png`` and its report section, for runs that trained LensNet (else nothing)."""
    if not any("mc/preference_agreement" in r for r in records):
        return []
    lens: Series = {
        "preference agreement": _series(records, "mc/preference_agreement"),
        "score std per context": _series(records, "mc/policy_score_std_mean"),
        "|score| mean": _series(records, "mc/policy_score_abs_mean"),
    }
    plot_panels(out_dir / "lensnet.png", "LensNet", "step", [("value", lens)])
    return [
        "",
        "## LensNet",
        "",
        "Share of preference targets whose sign LensNet's score matches, and the spread of its scores.",
        "",
        "![LensNet agreement and score spread](lensnet.png)",
    ]


def variants_section(records: list[dict[str, Any]]) -> list[str]:
    """The MC phase's working contexts a step and each kind's share of ``loss_lm`` (``mc/loss_share/*``), mean over
    its logged steps; nothing for a run without them."""
    mc = [r for r in records if "mc/loss_share/baseline" in r]
    if not mc:
        return []
    kinds = sorted({k.removeprefix("mc/loss_share/") for r in mc for k in r if k.startswith("mc/loss_share/")})
    shares = ", ".join(f"{kind} {sum(r[f'mc/loss_share/{kind}'] for r in mc) / len(mc):.3f}" for kind in kinds)
    contexts = mc[-1].get("train/variants_per_step")
    per_step = "" if contexts is None else f"{contexts:.0f} working contexts a step; "
    return ["", "## Variants", "", f"MC phase ({len(mc)} logged steps): {per_step}each kind's share of `loss_lm`, "
            f"mean over the phase: {shares}."]  # fmt: skip


def write_report(
    out_dir: Path,
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    tokens_per_step: int,
    eval_report: EvalReport | None,
    lod_maps: str | None,
    headline: list[str] | None = None,
) -> Path:
    """Plots of the run's metric ``records`` (``metrics.jsonl``), with the summary, evaluation and latest LOD
    maps, as Markdown; it opens with the ``headline`` lines (:mod:`mcfn.shell.headline`), where given."""
    plot_loss_and_timings(out_dir, records, float(tokens_per_step))
    sections = [f"# Run report: {out_dir.name}", ""]
    if headline:
        sections += [*(f"- {line}" for line in headline), "", "## Run", ""]
    sections += [
        f"{summary['mode']} mode on {summary['device']}, {summary['params']:,} parameters, "
        f"{summary['steps']} steps{' (compiled)' if summary['compiled'] else ''}. Median step "
        f"{summary['step_ms_median']:.0f} ms, {summary['tokens_per_s'] or 0:,.0f} tokens/s, compile "
        f"{summary['compile_s']:.0f} s, wall {summary['wall_s']:.0f} s, {summary['skipped_steps']} skipped updates.",
        f"Validation bpb {summary['first_val_bpb']:.4f} → {summary['final_val_bpb']:.4f}.",
        "",
        "## Loss",
        "",
        "![loss and validation bpb against tokens](loss.png)",
        "",
        "## Phase timings",
        "",
        "Data wait, forward + backward and optimizer per logged step (`time/*` in `metrics.jsonl`).",
        "",
        "![phase timings](timings.png)",
    ]
    sections += variants_section(records)
    sections += lensnet_section(out_dir, records)
    if eval_report is not None:
        sections += ["", "## Evaluation", "", format_eval_table(eval_report), f"![budget sweep]({EVAL_PNG})"]
        sections += [
            f"![{task}: accuracy by depth and budget](eval_depth_{task}.png)" for task in depth_accuracies(eval_report)
        ]
    if lod_maps:
        sections += ["", "## Working contexts at the last map", "", "```", lod_maps.rstrip(), "```"]
    path = out_dir / REPORT_NAME
    path.write_text("\n".join(sections) + "\n")
    return path


NEEDLE_HEADING = "## Needle grid"


def with_needle_section(report: str, grid: str) -> str:
    """``report.md``'s text with its needle-grid section (``train.needle``'s table) put last, in place of any earlier
    one: the grid runs after the run's end and may run again."""
    kept = report.split(f"\n{NEEDLE_HEADING}\n")[0].rstrip("\n")
    return f"{kept}\n\n{NEEDLE_HEADING}\n\n{grid.rstrip()}\n"
