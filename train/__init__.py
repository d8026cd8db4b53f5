"""Entry points, run from the repository root as ``python -m train.<name>``, and the flags two of them share."""

from __future__ import annotations

import argparse


def add_rule_flags(group: argparse._ActionsContainer) -> None:
    """The refocus rule of a decode (``train.generate``, ``train.bench --decode``): by default the one the run ships
    with its policy (:mod:`mcfn.core.cadence`)."""
    group.add_argument(
        "--refocus-every",
        type=int,
        help="the most tokens decoded between refocuses (MC; default: the shipped rule's, else mc.refocus_every)",
    )
    group.add_argument(
        "--refocus-on",
        choices=("clock", "copy"),
        help="clock: a refocus every --refocus-every tokens; copy: also when a copy starts (mcfn.core.cadence); "
        "default: the rule the run ships with its policy",
    )


def add_reuse_flag(group: argparse._ActionsContainer) -> None:
    """What a refocus keeps of the KV cache (``train.generate``, ``train.needle``):
    :func:`mcfn.inference.contexts.kept_slots`."""
    group.add_argument(
        "--reuse",
        choices=("moved", "prefix"),
        default="moved",
        help="moved (default): a refocus keeps every cached entry the new context still holds, its keys rotated to its "
        "new place, and runs only the new ones; prefix: it keeps the entries up to the first that changed and runs the "
        "rest, exactly what the evaluation scores (train.reuse measures the difference)",
    )
