"""How the LensNet stage measures its policy after each round: as the run's final evaluation judges one (generation's
protocol at the run's ``W``, bits per byte on the corpus beside ``match``'s, pass key accuracy). Which policy the run
ships is chosen afterwards, by paired errors (:mod:`mcfn.stage.ship`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mcfn.core.policy import LENS, MATCH
from mcfn.core.system import MegaContext
from mcfn.evaluation.batch import BRIEF_TASKS, brief_judgement
from mcfn.evaluation.evaluate import evaluate
from mcfn.evaluation.held_out import HeldOut


@dataclass(frozen=True)
class Judged:
    """A policy on held-out windows as the final evaluation judges it: LensNet's corpus bits per byte beside
    ``match``'s, and its pass key accuracy over ``probes`` windows (None where the pass key does not fit)."""

    lens_bpb: float
    match_bpb: float
    passkey: float | None
    probes: int

    def to_json(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


def judge(system: MegaContext, held: HeldOut, refocus_every: int) -> Judged:
    """``system``'s LensNet under generation's protocol at its ``W``, on the corpus and the pass key of ``held``."""
    settings = brief_judgement(system.layout, refocus_every, probe_batches=len(held.windows))
    report = evaluate(system, held, settings)
    corpus, passkey = report.corpus.refocus.head, report.scored(BRIEF_TASKS[1])
    accuracy = passkey.refocus.head.accuracy if passkey is not None else None
    lens, match = LENS.name, MATCH.name
    return Judged(corpus.bpb[lens], corpus.bpb[match], None if accuracy is None else accuracy[lens],
                  sum(w.size(0) for w in held.windows))  # fmt: skip


def judged_line(judged: Judged) -> str:
    passkey = "" if judged.passkey is None else f", pass key {judged.passkey:.2f} over {judged.probes} windows"
    return f"corpus {judged.lens_bpb:.4f} bits per byte (match {judged.match_bpb:.4f}){passkey}"
