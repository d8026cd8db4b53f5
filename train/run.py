"""Train a model: ``python -m train.run [--profile NAME] [--compile] [--steps N] [--out DIR] ...``.

Profile values come first, then the flags below, then any ``--set section.key=value`` overrides.
Bad input (profile, data, checkpoint) ends with a one-line ``error:`` message and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from mcfn.errors import UserError, exit_code
from mcfn.profile import DEFAULT_PROFILE, parse_override, resolve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.run", description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profiles/NAME.toml or a path to a .toml file")
    p.add_argument("--compile", action="store_true", help="compile the step with torch.compile (fullgraph)")
    p.add_argument("--steps", type=int, help="training steps (train.steps)")
    p.add_argument("--out", type=Path, help="run directory (default runs/<profile>-<time>)")
    p.add_argument("--data", help="data source: stdlib | text:DIR | jsonl:PATH | parquet:PATH | PATH")
    p.add_argument("--seed", type=int, help="random seed (train.seed)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--wandb", choices=["offline", "online", "disabled"], help="wandb mode (default offline)")
    p.add_argument("--no-mc", action="store_true", help="train the plain GPT on the same data instead of MegaContext")
    p.add_argument(
        "--init-from", metavar="RUN_DIR", help="start the base model from this run's weights (train.init_from)"
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        metavar="STEP",
        help="checkpoint at this step and stop, under train.steps' schedule (a plain phase's end to branch from)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: CUDA where there is one)")
    p.add_argument(
        "--memory-snapshot",
        metavar="FILE",
        default="",
        help="CUDA only: record the allocator's history over the first steps into FILE, in the run directory "
        "unless absolute",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any profile value, e.g. --set train.batch_size=8 (repeatable)",
    )
    return p.parse_args(argv)


def flag_settings(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """The config settings the flags set, by (section, key); None where a flag is not given."""
    return {
        ("train", "steps"): args.steps,
        ("train", "seed"): args.seed,
        ("data", "source"): args.data,
        ("train", "wandb"): args.wandb,
        ("train", "compile"): True if args.compile else None,
        ("mc", "enabled"): False if args.no_mc else None,
        ("train", "init_from"): args.init_from,
    }


def run(args: argparse.Namespace) -> None:
    flags = flag_settings(args)
    overrides = [(s, k, v) for (s, k), v in flags.items() if v is not None]
    overrides += [parse_override(o) for o in args.overrides]
    cfg = resolve(args.profile, overrides)
    if args.resume and args.out is None:
        raise UserError("--resume needs --out DIR, the run to continue")
    if args.stop_after and not 0 < args.stop_after < cfg.train.steps:
        raise UserError(f"--stop-after {args.stop_after} must lie between 0 and train.steps={cfg.train.steps}")
    profile_name = Path(args.profile).stem
    out = args.out or Path("runs") / f"{profile_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    from mcfn.shell.trainer import train  # heavy imports after the arguments are known to be good

    train(cfg, out, resume=args.resume, device_name=args.device, memory_snapshot=args.memory_snapshot,
          stop_after=args.stop_after)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
