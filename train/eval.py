"""Evaluate a checkpoint: ``python -m train.eval --ckpt DIR [--data SPEC] [--json FILE] ...``.

Tail bits per byte on held-out windows under full / recency / random / match / lens / best-of working contexts,
at the checkpoint's budget and a sweep of budgets (see ``mcfn.evaluation.evaluate``). Prints the table and writes
``eval.json``, ``eval.md`` and ``eval_sweep.png`` into ``--out`` (default: the checkpoint's directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcfn.errors import exit_code


def add_refocus_arguments(p: argparse.ArgumentParser) -> None:
    """How every condition that chooses a cut refocuses: generation's protocol, its steps, cadence and rule."""
    from mcfn.core.cadence import CLOCK, COPY_THRESHOLD, RULES
    from mcfn.core.focus import REFOCUS_STEPS

    p.add_argument(
        "--refocus", type=int, default=REFOCUS_STEPS, help="allocator steps of a scored policy's cold refocus"
    )
    p.add_argument(
        "--refocus-every",
        type=int,
        help="R: every condition that chooses a cut refocuses every R tail tokens, as generation does (default: the "
        "run's mc.refocus_every; the one-cut table is reported beside it)",
    )
    p.add_argument(
        "--refocus-on",
        choices=RULES,
        default=CLOCK,
        help="clock: a refocus every R tokens; copy: also when a copy starts, at the latest every R "
        "(mcfn.core.cadence). The shipped policy is scored under the rule it ships with",
    )
    p.add_argument("--refocus-threshold", type=float, default=COPY_THRESHOLD, help="the copy rule's evidence threshold")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.eval", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="run directory (or its checkpoint.pt)")
    p.add_argument(
        "--split",
        choices=["test", "val"],
        default="test",
        help="the run's held-out split to read: test (the default, read by nothing else; validation where the run has "
        "no test document) or val (the split design choices are made on)",
    )
    p.add_argument("--data", help="evaluate on the documents of this source instead of one of the run's splits")
    p.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    p.add_argument("--out", type=Path, help="where eval.md and eval_sweep.png go (default: the run directory)")
    p.add_argument(
        "--batches", type=int, help="held-out batches of train.batch_size windows (default train.eval_batches)"
    )
    p.add_argument("--budgets", help="comma-separated W values to sweep (default: the run's W, then T/2, T/4, T/8)")
    p.add_argument("--random-contexts", type=int, default=8, help="random cuts per window (random, best_of_*)")
    add_refocus_arguments(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--task",
        action="append",
        dest="tasks",
        metavar="NAME",
        help="corpus | passkey | kv-recall | copy (repeatable; default: every task; corpus always runs)",
    )
    p.add_argument("--reference", type=Path, help="a --no-mc run on the same data: scored as full_plain")
    p.add_argument(
        "--brief",
        action="store_true",
        help="what a run's final evaluation scores: full, recency, match, lens and the shipped policy under "
        "generation's protocol (no random, attention or fixed cuts, no best-of, no one-cut table)",
    )
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also score oracle_attn, oracle_match, horizon_attn, draft_attn and draft_match (mcfn.evaluation.oracle): "
        "cuts from full attention (of each chunk's own queries, reading the future; of those up to its "
        "horizon; over the model's own draft of the chunk) and match over that draft; diagnostics, never policies",
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from mcfn.evaluation.report import eval_json
    from mcfn.shell.checkpoint_evaluation import EvalRequest, evaluate_checkpoint

    flags = vars(args).copy()
    flags.pop("json")
    report, table = evaluate_checkpoint(EvalRequest(**flags))
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(eval_json(report))


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
