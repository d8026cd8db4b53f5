"""Train LensNet on what each choice costs: ``python -m train.lens --run DIR [--rounds N] [--windows N] ...``.
``--reliability N`` measures instead how much signal the stage's labels carry (``mcfn.shell.lens_labels``).

The LensNet stage (``mcfn.shell.lens_stage``) on an existing MegaContext run: rounds of counterfactual traces under
generation's protocol and LensNet training on them from the run's own, each round's policy measured on selection
windows; the policy kept (never one that loses what the run's LensNet knew) goes back into the run's checkpoint,
beside the original LensNet; ``train.eval --ckpt DIR`` then scores it. Bad input (no checkpoint, a
plain run, traces of another checkpoint) ends with a one-line ``error:`` message and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcfn.errors import exit_code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from mcfn.shell.lens_stage import StageSettings

    d = StageSettings()
    p = argparse.ArgumentParser(prog="python -m train.lens", description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="the run directory (or its checkpoint.pt)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds of trace, train, measure")
    p.add_argument("--windows", type=int, default=d.windows, help="fresh training windows traced per round")
    p.add_argument(
        "--held-out",
        type=int,
        default=d.held_out,
        help="validation windows that select the kept policy (as many report it)",
    )
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes over every round's traces so far")
    p.add_argument("--lr", type=float, default=d.lr, help="LensNet's AdamW learning rate")
    p.add_argument(
        "--reliability",
        type=int,
        metavar="N",
        help="instead of the stage: how much signal its labels carry, on N traced windows (lens_labels.json)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.lens_stage import StageSettings, run_stage
    from mcfn.shell.trainer import say

    run_dir = args.run if args.run.is_dir() else args.run.parent
    if args.reliability is not None:
        from mcfn.shell.lens_labels import label_reliability

        figures = label_reliability(run_dir, args.reliability, args.held_out, resolve_device(args.device), say)
        (run_dir / "lens_labels.json").write_text(json.dumps(figures, indent=2))
        return
    settings = StageSettings(args.rounds, args.windows, args.held_out, args.epochs, args.lr)
    _, summary = run_stage(run_dir, settings, resolve_device(args.device), say)
    (run_dir / "lens_stage.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
