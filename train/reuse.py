"""What keeping the KV cache at a refocus costs on text: ``python -m train.reuse --ckpt DIR [--split test]``.

Teacher-forced decoding through generation's own loop with the run's shipped policy and rule, once keeping only the
cache's prefix (the full refill the evaluation scores) and once keeping every entry the new context still holds
(generation's default), on the same held-out windows (``mcfn.evaluation.reuse``). Prints the table; ``--json``
writes it.
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
    p = argparse.ArgumentParser(prog="python -m train.reuse", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="run directory (or its checkpoint.pt)")
    p.add_argument("--split", choices=["test", "val"], default="test", help="the held-out split whose windows to score")
    p.add_argument("--windows", type=int, default=128, help="windows of T + 1 tokens (at most)")
    p.add_argument("--json", type=Path, help="also write the result as JSON to this file")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from mcfn.core.cadence import resolved_rule, rule_name
    from mcfn.core.focus import Refocus
    from mcfn.data.corpus import held_out
    from mcfn.evaluation.held_out import HeldOut
    from mcfn.evaluation.reuse import reuse_cost, reuse_table
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.restore import load_shipped

    if args.windows < 1:
        raise UserError("--windows must be >= 1")
    trained, shipped, policy = load_shipped(args.ckpt, resolve_device(args.device), "no working context's cache")
    cfg, tok = trained.cfg, trained.corpus.tokenizer
    name, split = held_out(trained.corpus, args.split)
    held = HeldOut.drawn(split, name, cfg.data.seq_len + 1, args.windows, cfg.train.batch_size, trained.token_bytes,
                         tok)  # fmt: skip
    if not held.windows:
        raise UserError(f"the {name} split has no window of T + 1 = {cfg.data.seq_len + 1} tokens")
    on, every = resolved_rule(policy.rule, cfg.mc.refocus_every)
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[reuse] {line} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    cost = reuse_cost(trained.model, policy, Refocus(every, on=on), held, progress)
    print(f"Keeping the cache at a refocus, {shipped} refocusing {rule_name(on, every)}, {name} split:\n")
    print(reuse_table(cost))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"shipped": shipped, "rule": rule_name(on, every), "split": name, **dataclasses.asdict(cost)}
        args.json.write_text(json.dumps(record, indent=1))


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
