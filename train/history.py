"""Text over histories longer than the training window: ``python -m train.history --ckpt DIR [--length 4096]``.

Held-out windows of ``--length`` tokens, the last ``--scored`` of each fed through generation's own loop under the
run's shipped policy and rule, truncation and full context (``mcfn.evaluation.history``): bits per byte and each
one's gain over truncation, paired by document. Prints the table; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from mcfn.errors import UserError, exit_code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.history", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="run directory (or its checkpoint.pt)")
    p.add_argument("--split", choices=["test", "val"], default="test", help="the held-out split whose windows to score")
    p.add_argument("--length", type=int, default=4096, help="tokens a window: the history's length")
    p.add_argument("--scored", type=int, default=512, help="the last tokens of each window fed and scored")
    p.add_argument("--windows", type=int, default=64, help="windows (at most; one or two a document)")
    p.add_argument(
        "--context",
        action="append",
        dest="contexts",
        default=[],
        help="another scored policy to score under the shipped rule (repeatable): which part of a policy reads what",
    )
    p.add_argument("--json", type=Path, help="also write the result as JSON to this file")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from mcfn.core.cadence import resolved_rule, rule_name
    from mcfn.core.focus import Refocus
    from mcfn.core.policy import POLICIES
    from mcfn.data.corpus import held_out
    from mcfn.evaluation.held_out import HeldOut
    from mcfn.evaluation.history import history_table, history_text
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.restore import load_shipped

    if args.windows < 1 or not 0 < args.scored < args.length:
        raise UserError("--windows must be >= 1 and --scored within [1, --length)")
    scored = sorted(name for name, policy in POLICIES.items() if policy.scored)
    if unknown := [name for name in args.contexts if name not in scored]:
        raise UserError(f"--context {unknown[0]}: not a scored policy (one of {', '.join(scored)})")
    trained, shipped, policy = load_shipped(args.ckpt, resolve_device(args.device), "no working context to compare")
    cfg, tok = trained.cfg, trained.corpus.tokenizer
    name, split = held_out(trained.corpus, args.split)
    if len(split.tokens) < args.length:
        raise UserError(f"the {name} split holds {len(split.tokens):,} tokens, fewer than a window of {args.length:,}")
    held = HeldOut.drawn(split, name, args.length, args.windows, cfg.train.batch_size, trained.token_bytes, tok)
    on, every = resolved_rule(policy.rule, cfg.mc.refocus_every)
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[history] {line} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    result = history_text(
        trained.model, policy, Refocus(every, on=on), cfg.mc.refocus_every, held, args.scored, progress,
        tuple(POLICIES[name] for name in args.contexts),
    )  # fmt: skip
    T, W = cfg.data.seq_len, cfg.mc.budget
    print(f"Text over {args.length}-token histories (T/W = {args.length / W:g}; trained at T = {T}), {shipped} "
          f"refocusing {rule_name(on, every)}, {name} split:\n")  # fmt: skip
    print(history_table(result, shipped))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"shipped": shipped, "rule": rule_name(on, every), "split": name, **dataclasses.asdict(result)}
        args.json.write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
