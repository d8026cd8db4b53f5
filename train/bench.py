"""Benchmark the MegaContext step against the plain GPT step: ``python -m train.bench --profile NAME``.

Random tokens at the profile's shapes (compute does not depend on the text, so no corpus is needed);
compiled by default (``--eager`` to compare). Prints a table and writes ``--json FILE``. What is
measured and how is in :mod:`mcfn.tools.benchmark`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcfn.errors import UserError
from mcfn.profile import parse_override, resolve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="bench-ref")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each kind (medians are reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    p.add_argument("--eager", action="store_true", help="do not compile")
    p.add_argument(
        "--typecheck-cost",
        action="store_true",
        help="instead: time an eager step and evaluation with the runtime shape checks on and off",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = resolve(args.profile, [parse_override(o) for o in args.overrides] + [("mc", "enabled", True)])
        if args.steps < 1 or args.warmup < 1:
            raise UserError("--steps and --warmup must be >= 1")
        from mcfn.shell.devices import padded_vocab, resolve_device
        from mcfn.tools.benchmark import format_table, run_benchmark, typecheck_cost

        vocab, device = padded_vocab(cfg.data.vocab_size), resolve_device(cfg.train.device)
        if args.typecheck_cost:
            result = typecheck_cost(cfg, vocab, device, args.steps)
        else:
            result = run_benchmark(
                cfg, vocab, device, args.steps, args.warmup, None if args.eager else cfg.train.compile_mode
            )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["profile"] = args.profile
    text = "\n".join(f"{k}: {v}" for k, v in result.items()) if args.typecheck_cost else format_table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
