"""The needle grid: ``python -m train.needle --ckpt DIR [--lengths 1024,4096,8192,32768] [--depths 0.1,0.5,0.9] ...``.

Prompts of held-out text with the pass-key fact at each depth and the question at the end, decoded greedily through
``train.generate``'s decode loop with the run's shipped policy and rule, and with full attention beside it
(:mod:`mcfn.evaluation.needle`). Prints the table and writes ``needle.json``, ``needle.md`` and the heatmap
``needle.png`` into ``--out`` (default: the run directory), and the grid into the run's ``report.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mcfn.errors import UserError, exit_code
from train import add_reuse_flag

SHIPPED = "shipped"  # --context's name for the policy and rule the run ships


def number_list(text: str, kind: type) -> tuple:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from mcfn.core.policy import policies
    from mcfn.evaluation.needle import DEPTHS, LENGTHS, PROMPTS

    p = argparse.ArgumentParser(prog="python -m train.needle", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="run directory (or its checkpoint.pt)")
    p.add_argument(
        "--split", choices=["test", "val"], default="test", help="the held-out split the haystacks come from"
    )
    p.add_argument("--lengths", type=lambda t: number_list(t, int), default=LENGTHS, help="prompt lengths in tokens")
    p.add_argument("--depths", type=lambda t: number_list(t, float), default=DEPTHS, help="the fact's depths in [0, 1]")
    p.add_argument("--prompts", type=int, default=PROMPTS, help="prompts a cell")
    p.add_argument("--seed", type=int, default=0, help="draws the haystacks and keys")
    p.add_argument(
        "--context",
        action="append",
        dest="contexts",
        choices=[SHIPPED, *(policy.name for policy in policies() if policy.generates)],
        help=f"a policy to grid (repeatable; {SHIPPED}: the run's, with its rule); default: {SHIPPED} and full",
    )
    p.add_argument("--out", type=Path, help="where the outputs go (default: the run directory)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--compile", action="store_true", help="compile the decoder's graphs, as train.generate --compile")
    add_reuse_flag(p)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    import torch

    from mcfn.core.cadence import decode_label, resolved_rule
    from mcfn.core.policy import FULL, POLICIES
    from mcfn.data.corpus import held_out
    from mcfn.evaluation.needle import cells_json, needle_grid, needle_table
    from mcfn.evaluation.plots import plot_accuracy_grid
    from mcfn.inference.decode import decoding_compiler
    from mcfn.inference.generation import generate_full, generate_mc
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.restore import load_shipped
    from mcfn.shell.run_report import with_needle_section

    if args.prompts < 1 or min(args.lengths) < 1 or not all(0.0 <= d <= 1.0 for d in args.depths):
        raise UserError("--prompts and --lengths must be >= 1 and --depths within [0, 1]")
    device = resolve_device(args.device)
    trained, shipped, shipped_policy = load_shipped(args.ckpt, device, "no working-context policy to grid")
    system, cfg = trained.model, trained.cfg
    compile_fn = decoding_compiler(cfg.train.compile_mode) if args.compile else None
    named = {SHIPPED: (f"shipped ({shipped})", shipped_policy)}
    wanted = [named.get(name) or (name, POLICIES[name]) for name in args.contexts or (SHIPPED, FULL.name)]

    def decoder(policy):
        if policy is FULL:
            return lambda prompt, n: generate_full(system.base, prompt, n, compile_fn=compile_fn)[0]
        on, every = resolved_rule(policy.rule, cfg.mc.refocus_every)
        return lambda prompt, n: generate_mc(
            system, prompt, n, every, compile_fn=compile_fn, policy=policy, on=on, reuse=args.reuse
        )[0]

    split_name, split = held_out(trained.corpus, args.split)
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[needle] {line} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    with torch.no_grad():
        decoders = {
            decode_label(name, policy.rule, cfg.mc.refocus_every, policy is FULL): decoder(policy)
            for name, policy in wanted
        }
        tok = trained.corpus.tokenizer
        cells = needle_grid(decoders, split, tok, args.lengths, args.depths, args.prompts, args.seed, device, progress)
    out = args.out or (args.ckpt if args.ckpt.is_dir() else args.ckpt.parent)
    out.mkdir(parents=True, exist_ok=True)
    heading = (f"Pass key by prompt length and the fact's depth, {args.prompts} prompts a cell of {split_name}-split "
               f"text, greedy through generation's decode loop (step {trained.step}, W = {system.layout.W}, "
               f"T = {system.layout.T}):")  # fmt: skip
    table = needle_table(cells)
    layout = system.layout
    result = {"split": split_name, "step": trained.step, "W": layout.W, "T": layout.T, "cells": cells_json(cells)}
    (out / "needle.json").write_text(json.dumps(result, indent=1))
    (out / "needle.md").write_text(f"{heading}\n\n{table}")
    grid, rows = [], []
    for label in dict.fromkeys(c.policy for c in cells):
        for length in args.lengths:
            rows.append(f"{label}, {length:,}")
            by_depth = {c.depth: c.accuracy for c in cells if c.policy == label and c.length == length}
            grid.append([by_depth[d] for d in args.depths])
    columns = [f"{d:.0%}" for d in args.depths]
    plot_accuracy_grid(grid, rows, columns, "depth of the fact", "needle: pass key accuracy", out / "needle.png")
    report = out / "report.md"
    if report.is_file():
        report.write_text(with_needle_section(report.read_text(), f"{heading}\n\n{table}\n![needle grid](needle.png)"))
    print(f"{heading}\n\n{table}")


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
