"""How the LensNet stage judges a candidate policy: as the run's final evaluation judges one (generation's protocol
at the run's ``W``, bits per byte on the corpus beside ``match``'s, pass key accuracy), and when it refuses one: a
policy that lost retrieval, or one behind ``match`` on text (issue 66)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mcfn.core.focus import evaluation_budgets
from mcfn.core.policy import LENS, MATCH
from mcfn.core.system import MegaContext
from mcfn.tools.eval_batch import EvalSettings
from mcfn.tools.evaluation import HeldOut, evaluate

PROBE_SE = 2.0  # a candidate this many standard errors below the run's own LensNet on the pass key is refused
JUDGED_TASKS = ("corpus", "passkey")  # as the run's final evaluation judges a policy


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
    budgets = evaluation_budgets(system.layout, (system.layout.W,), refocus_every)
    settings = EvalSettings(budgets, tasks=JUDGED_TASKS, probe_batches=len(held.windows),
                            refocus_every=refocus_every, brief=True)  # fmt: skip
    report = evaluate(system, held, settings)
    corpus, passkey = report.corpus.refocus.head, report.scored(JUDGED_TASKS[1])
    accuracy = passkey.refocus.head.accuracy if passkey is not None else None
    lens, match = LENS.name, MATCH.name
    return Judged(corpus.bpb[lens], corpus.bpb[match], None if accuracy is None else accuracy[lens],
                  sum(w.size(0) for w in held.windows))  # fmt: skip


def refusal(candidate: Judged, own: Judged) -> str | None:
    """Why ``candidate`` may not be kept, or None: a pass key accuracy more than :data:`PROBE_SE` standard errors
    (of the difference of two proportions) below the run's own, or corpus bits per byte above ``match``'s."""
    if candidate.passkey is not None and own.passkey is not None:
        p, q, n = candidate.passkey, own.passkey, candidate.probes
        se = math.sqrt((p * (1 - p) + q * (1 - q)) / n)
        if q - p > max(PROBE_SE * se, 0.0):
            return f"answers the pass key {p:.2f} against the run's own {q:.2f} (± {se:.2f})"
    if candidate.lens_bpb > candidate.match_bpb:
        return f"{candidate.lens_bpb:.4f} bits per byte on the corpus against match's {candidate.match_bpb:.4f}"
    return None


def judged_line(judged: Judged) -> str:
    passkey = "" if judged.passkey is None else f", pass key {judged.passkey:.2f} over {judged.probes} windows"
    return f"corpus {judged.lens_bpb:.4f} bits per byte (match {judged.match_bpb:.4f}){passkey}"
