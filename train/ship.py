"""Choose the focus policy a run ships: ``python -m train.ship --run DIR``.

Every MegaContext run makes this choice at its end (``mcfn.stage.ship``): truncation, ``match``, the run's own
LensNet and the run's own gated over ``match``'s cut, each also under the other refocus rules within the profile's
cap, scored on validation windows under generation's protocol and judged by paired errors; the choice is recorded in
the checkpoint (and in ``ship.json`` beside it, with the validation evaluation it read), where ``train.eval`` scores
it as ``shipped`` and ``train.generate`` decodes with it when no ``--context`` is given. This command makes it again
on a saved run (one trained before the choice existed ships ``lens`` until then). Bad input ends with a one-line
``error:`` and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcfn.errors import exit_code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.ship", description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="the run directory (or its checkpoint.pt)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.trainer import say
    from mcfn.stage.ship import ship_run

    run_dir = args.run if args.run.is_dir() else args.run.parent
    ship_run(run_dir, resolve_device(args.device), say)  # ship.json: the verdict and the evaluation it read


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
