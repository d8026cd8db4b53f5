"""Train LensNet on what each choice costs: ``python -m train.lens --run DIR [--rounds N] [--windows N] ...``
(the run's ``[lens_stage]`` settings, these flags on top).
``--reliability N`` measures instead how much signal the stage's labels carry (``mcfn.stage.labels``).

The LensNet stage (``mcfn.stage.rounds``) on an existing MegaContext run: rounds of counterfactual traces under
generation's protocol and LensNet training on them from the run's own, each round's policy measured on validation
windows; then the ship choice (``mcfn.stage.ship``) among truncation, ``match``, the run's own LensNet, its gated
variant and each round's, recorded in the checkpoint; ``train.eval --ckpt DIR`` scores it as ``shipped``.
Bad input (no checkpoint, a plain run, traces of another checkpoint) ends with a one-line ``error:`` message and
exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcfn.errors import exit_code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.lens", description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="the run directory (or its checkpoint.pt)")
    p.add_argument("--rounds", type=int, help="rounds of trace, train, measure (lens_stage.rounds, or 3)")
    p.add_argument("--windows", type=int, help="fresh training windows traced per round (lens_stage.windows)")
    p.add_argument(
        "--held-out",
        type=int,
        help="validation windows each round's policy is measured on (lens_stage.held_out)",
    )
    p.add_argument(
        "--reliability",
        type=int,
        metavar="N",
        help="instead of the stage: how much signal its labels carry, on N traced windows (lens_labels.json)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from mcfn.errors import UserError
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.trainer import say
    from mcfn.stage.rounds import run_stage
    from mcfn.stage.ship import ship_run

    if any(n is not None and n < 1 for n in (args.rounds, args.windows, args.held_out)):
        raise UserError("--rounds, --windows and --held-out must be >= 1")
    run_dir = args.run if args.run.is_dir() else args.run.parent
    if args.reliability is not None:
        from mcfn.stage.labels import label_reliability

        figures = label_reliability(run_dir, args.reliability, args.held_out, resolve_device(args.device), say)
        (run_dir / "lens_labels.json").write_text(json.dumps(figures, indent=2))
        return
    overrides = {"rounds": args.rounds, "windows": args.windows, "held_out": args.held_out}
    device = resolve_device(args.device)
    rounds, summary = run_stage(run_dir, device, say, **overrides)
    summary["ship"] = ship_run(run_dir, device, say, rounds=rounds).to_json()
    (run_dir / "lens_stage.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
