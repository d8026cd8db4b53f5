"""How a run ends: for an MC run, the LensNet stage and the ship choice on the system the trainer holds, the last
checkpoint written once with them in it (the end reads no checkpoint), and the held-out evaluation; then
``summary.json`` and the report.

``summary.json`` names what produced the run: the git commit of the code (``unknown`` outside a git
checkout) and a hash of the resolved config, so two run directories can be told apart or matched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor

from mcfn.checkpoint import save_checkpoint
from mcfn.core.policy import SHIPPED, FocusPolicy, renamed
from mcfn.core.system import MegaContext
from mcfn.data.corpus import held_out
from mcfn.evaluation.batch import brief_judgement
from mcfn.evaluation.evaluate import evaluate
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.report import write_eval_outputs
from mcfn.evaluation.result import EvalReport
from mcfn.shell.headline import summary_lines, trained_line
from mcfn.shell.run_report import write_report
from mcfn.shell.session import Progress, Session
from mcfn.shell.tracking import read_metrics
from mcfn.stage.rounds import stage_rounds
from mcfn.stage.ship import ship, shipped_record, validation, write_choice

SUMMARY_NAME = "summary.json"
LOD_MAPS_NAME = "lod_maps.txt"
REPO_DIR = Path(__file__).resolve().parents[3]


def git_commit(repo: Path = REPO_DIR) -> str:
    """The checked-out commit of the code (with ``-dirty`` when it has uncommitted changes), or ``unknown``."""
    try:
        run = lambda *args: subprocess.run(  # noqa: E731
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        commit = run("rev-parse", "HEAD")
        return commit + ("-dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


Shipped = tuple[str, FocusPolicy]  # the candidate a run ships, and its policy named "shipped"
FINAL_EVAL_PROBE_BATCHES = 8  # of the final evaluation's batches, those that also carry the pass key


def evaluates_at_end(s: Session) -> bool:
    """Whether the run ends with the ship choice and the final evaluation: an MC run with final evaluation batches."""
    return bool(s.cfg.train.final_eval_batches) and isinstance(s.model, MegaContext)


def ends_with_stage(s: Session) -> bool:
    """Whether the run ends with the LensNet stage: ``lens_stage.rounds`` on an MC run with LensNet."""
    return bool(s.cfg.lens_stage.rounds) and isinstance(s.model, MegaContext) and s.model.lensnet is not None


def records_at_end(s: Session) -> bool:
    """Whether the run's end records something in the last checkpoint (the stage's figures, the ship choice), so
    that the trainer leaves that checkpoint for the end to write."""
    return evaluates_at_end(s) or ends_with_stage(s)


def final_evaluation(s: Session, shipped: Shipped | None) -> tuple[EvalReport, list[str]] | None:
    """An MC run's end-of-run table on the test split, which nothing else reads: brief (full, recency, match, lens and
    the ``shipped`` policy at the run's own W, under generation's protocol, on the corpus and the pass key), on
    ``train.final_eval_batches · batch_size`` windows from as many documents as it has; ``train.eval`` scores
    everything else. With it, the report's summary lines (:mod:`mcfn.shell.headline`), or none without LensNet or
    where the pass key does not fit."""
    if not evaluates_at_end(s):
        return None
    window, cfg = s.cfg.data.seq_len + 1, s.cfg.train
    name, split = held_out(s.corpus, "test")
    count = cfg.final_eval_batches * cfg.batch_size
    held = HeldOut.drawn(split, name, window, count, cfg.batch_size, s.token_bytes, s.corpus.tokenizer)
    candidates = () if shipped is None else (shipped[1],)
    settings = brief_judgement(s.model.layout, s.cfg.mc.refocus_every, FINAL_EVAL_PROBE_BATCHES, candidates)
    report = dataclasses.replace(evaluate(s.model, held, settings), checkpoint_step=cfg.steps,
                                 shipped=None if shipped is None else shipped[0])  # fmt: skip
    if s.model.lensnet is None or shipped is None or report.scored("passkey") is None:
        return report, []
    example = held.windows[0][0].to(s.device)
    return report, summary_lines(s.model, shipped, example, s.corpus.tokenizer, s.cfg.mc.refocus_every, report)


def lens_stage(s: Session, say: Callable[[str], None]) -> tuple[dict[int, dict[str, Tensor]], dict | None]:
    """``lens_stage.rounds`` rounds of the counterfactual LensNet stage on the trained system: each round's LensNet
    (candidates of the ship choice) and its figures, or none and None without the stage."""
    if not ends_with_stage(s):
        return {}, None
    return stage_rounds(s.model, s.cfg, s.cfg.train.steps, s.corpus, s.out_dir, say)


def ship_policy(
    s: Session, rounds: dict[int, dict[str, Tensor]], say: Callable[[str], None]
) -> tuple[Shipped, dict[str, Any]]:
    """The ship choice (:mod:`mcfn.stage.ship`) on validation windows, written to ``ship.json``: the candidate
    shipped and its policy, named ``shipped``, and what the checkpoint records of it."""
    held = validation(s.corpus, s.cfg, s.device)
    shipped, verdict, report = ship(s.model, s.cfg, held, say, rounds)
    write_choice(s.out_dir, verdict, report)
    return (shipped.name, renamed(shipped.policy, SHIPPED)), shipped_record(shipped, verdict)


@contextmanager
def written_at_exit(s: Session, trained: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The checkpoint, written once as the block exits, from ``trained`` (the trainer's state at its last step) with
    what the block recorded in the dict it is given (the stage's figures, the choice): on an error too, with what
    was done by then, so no trained step is lost."""
    recorded: dict[str, Any] = {}
    try:
        yield recorded
    finally:
        save_checkpoint(s.ckpt_path, trained | {k: v for k, v in recorded.items() if v is not None})


def summarise(s: Session, progress: Progress, t_start: float, final_eval: EvalReport | None) -> dict[str, Any]:
    median_ms = statistics.median(progress.step_ms) if progress.step_ms else progress.first_step_ms or 0.0
    tokens_per_step = s.cfg.train.batch_size * s.cfg.data.seq_len
    return {
        "steps": s.cfg.train.steps,
        "resumed_from": s.start_step if s.resumed else None,
        "stopped_at": progress.stopped_at,  # set when a signal stopped the run early (resume with --resume)
        "skipped_steps": progress.skipped,  # updates skipped for a non-finite loss
        "micro_batch_size": progress.micro,
        "mode": s.task.mode,
        "device": str(s.device),
        "compiled": s.cfg.train.compile,
        "params": s.model.num_params(),
        "git_commit": git_commit(),
        "config_hash": s.cfg.digest(),
        "first_val_bpb": progress.first_bpb,
        "final_val_bpb": progress.last_bpb,
        "step_ms_median": median_ms,
        "tokens_per_s": tokens_per_step / (median_ms / 1e3) if median_ms else None,
        # Model FLOPs utilisation of the median step on a known GPU (mcfn.core.flops); None elsewhere.
        "mfu": progress.peak_step_s / (median_ms / 1e3) if progress.peak_step_s and median_ms else None,
        # The first step (and first eval) include compilation; the rest do not.
        "compile_s": max(0.0, ((progress.first_step_ms or 0.0) - median_ms) / 1e3),
        "eval_s_total": sum(progress.eval_s),
        "wall_s": time.perf_counter() - t_start,
        "eval": None if final_eval is None else headline_figures(final_eval),
    }


def headline_figures(report: EvalReport) -> dict[str, Any]:
    """``summary.json``'s ``eval``: the final evaluation's corpus figures at the run's W."""
    head = report.head.head
    return {"W": report.W, "bpb": head.bpb, "retained_fraction": head.retained_fraction,
            "lens_rank_corr": head.lens_rank_corr}  # fmt: skip


def finish(
    s: Session, progress: Progress, t_start: float, say: Callable[[str], None], trained: dict[str, Any] | None
) -> dict[str, Any]:
    """Choose the shipped policy and write the checkpoint (``trained``: the trainer's state at its last step, left
    for the end to write, where the run ends with the choice), evaluate (unless stopped early), write
    ``summary.json`` and the report; returns the summary."""
    if not s.world.is_main:
        return {"steps": s.cfg.train.steps, "rank": s.world.rank, "stopped_at": progress.stopped_at}
    stage, shipped, t_eval = None, None, time.perf_counter()
    if trained is not None:  # the run's end, on the system the trainer holds; the checkpoint is read nowhere
        with written_at_exit(s, trained) as recorded:
            rounds, stage = lens_stage(s, say)
            recorded["lens_stage"] = stage
            t_eval = time.perf_counter()
            if evaluates_at_end(s):
                shipped, recorded["shipped"] = ship_policy(s, rounds, say)
    evaluated = None if progress.stopped_at is not None else final_evaluation(s, shipped)
    final_eval, headline = evaluated or (None, [])
    if final_eval is not None:
        say(f"\n{write_eval_outputs(final_eval, s.out_dir)}")
    summary = summarise(s, progress, t_start, final_eval)
    summary["lens_stage"] = stage
    summary["shipped"] = None if shipped is None else shipped[0]
    summary["final_eval_s"] = time.perf_counter() - t_eval if final_eval is not None else None
    tmp = s.out_dir / f"{SUMMARY_NAME}.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, s.out_dir / SUMMARY_NAME)
    if progress.stopped_at is not None:
        say(
            f"[run] stopped by {progress.stopped_by} after step {progress.stopped_at}; checkpoint written; "
            f"continue with --resume --out {s.out_dir}"
        )
        return summary
    maps_path = s.out_dir / LOD_MAPS_NAME
    last_maps = maps_path.read_text().split("step ")[-1] if maps_path.exists() else None
    tokens_per_step = s.cfg.train.batch_size * s.cfg.data.seq_len
    maps = last_maps and f"step {last_maps}"
    if headline:
        headline = [trained_line(s.cfg, summary), *headline]
    report = write_report(s.out_dir, read_metrics(s.out_dir), summary, tokens_per_step, final_eval, maps, headline)
    say(f"[run] report: {report}")
    say(
        f"[run] done: val bpb {progress.first_bpb:.4f} -> {progress.last_bpb:.4f}, "
        f"{summary['tokens_per_s'] or 0:,.0f} tok/s (median step {summary['step_ms_median']:.0f} ms), "
        f"summary in {s.out_dir / SUMMARY_NAME}"
    )
    return summary
