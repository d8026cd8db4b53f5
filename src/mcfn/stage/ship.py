"""Which focus policy a run ships (issue 78): chosen on validation windows by paired errors, with a rule fixed here
before any run, and recorded in the checkpoint for ``train.eval`` (scored as ``shipped``), ``train.generate`` (its
policy when no ``--context`` is given) and the report's opening lines.

The candidates, simplest first: ``recency`` (truncation), ``match`` (the n-gram copy focus), ``lens`` (the run's own
LensNet), ``gated`` (the run's own LensNet gated over ``match``'s cut: :func:`~mcfn.stage.candidates.gated_lensnet`),
``branches`` (LensNet's sure picks, then ``match``'s votes: :mod:`mcfn.core.branches`) and, where the LensNet stage ran,
each of its rounds' LensNets (``round1``, ...), each scored one also under the other refocus rules (issue 90,
:func:`ship_rules`: ``match@copy16`` refocuses when a copy starts, at the latest every 16 tokens; ``match@8``, every 8),
so that a run ships its policy with the rule it refocuses by. They are scored in one evaluation under generation's
protocol at the run's ``W`` on the corpus and the pass key of the *validation* split (the test split is never read
here), so every difference between two of them is paired, window by window, with its bootstrap error over documents
(:func:`mcfn.evaluation.stats.paired_differences`). The rule (:func:`choose`):

0. refuse a candidate under a rule of its own that refocuses more than ``mc.refocus_cap`` times a token on the
   corpus (the decode cost the profile allows; the run's own clock is the profile's choice and never refused);
1. refuse a candidate whose pass key accuracy is more than :data:`PASSKEY_SE` paired standard errors below the best
   candidate's (where the pass key fits the run's tail);
2. of the rest, take the lowest corpus bits per byte, and then the simplest candidate whose corpus bits per byte lie
   within one paired standard error of it (a tie goes to the simpler policy).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcfn.checkpoint import save_checkpoint
from mcfn.config import RunConfig
from mcfn.core.cadence import CLOCK, COPY, rule_name
from mcfn.core.policy import BRANCHES, LENS, MATCH, POLICIES, RECENCY, SHIPPED, FocusPolicy, lensnet_policy, renamed
from mcfn.core.system import MegaContext
from mcfn.data.corpus import Corpus
from mcfn.evaluation.batch import BRIEF_TASKS, brief_judgement
from mcfn.evaluation.evaluate import evaluate
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.result import EvalReport, Row
from mcfn.stage.candidates import GATED, gated_lensnet, loaded_lensnet, read_run, run_system, validation_windows

PASSKEY_SE = 2.0  # a candidate this many paired standard errors below the best candidate's pass key is refused
TIE_SE = 1.0  # within this many paired standard errors of the lowest corpus bpb, the simpler candidate is shipped
SHIP_WINDOWS = 128  # validation windows the choice reads (fewer where the split has fewer), each also a pass key


@dataclass(frozen=True)
class Candidate:
    """A policy the run may ship with the refocus rule it ships with: how the evaluation scores it (a policy under
    the candidate's name, or the registry's own for ``recency``, ``match`` and ``lens`` on the run's clock) and what
    the checkpoint keeps to rebuild it."""

    name: str
    policy: FocusPolicy
    runs: str  # the registered policy it refocuses as: recency, match or lens
    match_prior: str = ""  # its LensNet's prior ("" or "gated"), where it runs a LensNet of its own
    lensnet: dict[str, torch.Tensor] | None = None  # that LensNet's weights; None: none, or the run's own

    @property
    def extra(self) -> bool:
        """Whether the evaluation scores it beside the registry's policies (a LensNet other than the run's own, or
        a rule other than the run's clock)."""
        return self.lensnet is not None or self.policy.rule is not None

    def record(self) -> dict[str, Any]:
        """What the checkpoint keeps (``shipped``): enough to rebuild the policy with :func:`shipped_policy`."""
        out: dict[str, Any] = {"name": self.name, "policy": self.runs, "match_prior": self.match_prior}
        if self.policy.rule is not None:
            out["rule"] = self.policy.rule
        if self.lensnet is not None:
            out["lensnet"] = {k: v.detach().cpu().clone() for k, v in self.lensnet.items()}
        return out

    def under(self, rule: str) -> Candidate:
        """This candidate refocusing under ``rule`` (:func:`~mcfn.core.cadence.rule_name`), named ``name@rule``."""
        name = f"{self.name}@{rule}"
        return dataclasses.replace(self, name=name, policy=dataclasses.replace(self.policy, name=name, rule=rule))


def ship_rules(cfg: RunConfig) -> tuple[list[str], dict[str, str]]:
    """The refocus rules a candidate may ship with beside the run's own clock ``R``: the clock at ``R/2`` and
    ``R/4``, and the copy event at the latest every ``R``; and the rules refused before scoring (``@8``: every
    candidate under it), where the clock's refocuses per token alone exceed the profile's cap (``mc.refocus_cap``),
    with why."""
    R, cap = cfg.mc.refocus_every, cfg.mc.refocus_cap
    rules, refused = [], {}
    for every in (R // 2, R // 4):
        if every >= 1 and 1 / every > cap:
            refused[f"@{rule_name(CLOCK, every)}"] = (
                f"refocuses {1 / every:.3f} times a token, over the cap of {cap:.3f}"
            )
        elif every >= 1:
            rules.append(rule_name(CLOCK, every))
    return [*rules, rule_name(COPY, R)], refused


def candidates(system: MegaContext, cfg: RunConfig, rounds: dict[int, dict[str, torch.Tensor]]) -> list[Candidate]:
    """The run's candidates, simplest first: truncation, ``match``, its own LensNet, its own gated over ``match``'s
    cut, the branches over both, then each round of the LensNet stage (``rounds``: its LensNet's weights by round);
    each scored one also under every rule of :func:`ship_rules` within the cap, right after it (the run's clock is the
    simpler)."""
    out = [Candidate(RECENCY.name, RECENCY, RECENCY.name), Candidate(MATCH.name, MATCH, MATCH.name)]
    if system.lensnet is not None:
        device = next(system.parameters()).device
        out.append(Candidate(LENS.name, LENS, LENS.name))
        gated = gated_lensnet(system.lensnet, cfg)
        out.append(Candidate(GATED, lensnet_policy(GATED, gated), LENS.name, "gated", gated.state_dict()))
        out.append(Candidate(BRANCHES.name, BRANCHES, BRANCHES.name))
        prior = cfg.mc.lens.match_prior  # a round trains the run's own LensNet, its prior included
        for r, weights in rounds.items():
            name = f"round{r}"
            lensnet = loaded_lensnet(cfg, system.layout, prior, weights, device)
            out.append(Candidate(name, lensnet_policy(name, lensnet), LENS.name, prior, weights))
    rules = ship_rules(cfg)[0]
    # Truncation's cut never reads an event, and refocusing it more often only shortens what it shows.
    return [ruled for c in out for ruled in (c, *(c.under(r) for r in rules if c.policy.scored))]


@dataclass(frozen=True)
class Verdict:
    """The choice: the candidate shipped, those refused (with why) and, per candidate, its validation figures."""

    shipped: str
    refused: dict[str, str]
    figures: dict[str, dict[str, float | None]]  # per candidate: corpus bpb, pass key, refocuses per token

    def to_json(self) -> dict[str, Any]:
        return {"shipped": self.shipped, "refused": self.refused, "figures": self.figures}


SHIP_EVAL_NAME = "ship.json"  # the choice's validation evaluation, beside the run's eval.json (which reads test)


def write_choice(run_dir: Path, verdict: Verdict, report: EvalReport) -> None:
    """The verdict and the whole validation evaluation it was read from (eval.json's shape: paired differences,
    long-range tokens, indexer recall), for design choices that must never read the test split."""
    (run_dir / SHIP_EVAL_NAME).write_text(json.dumps({"verdict": verdict.to_json(), **report.to_json()}, indent=2))


def paired(row: Row, a: str, b: str) -> tuple[float, float, float | None, float | None]:
    """``row``'s paired difference of ``a`` over ``b`` whichever order it was recorded in: ``bpb(b) − bpb(a)`` and
    its error, ``accuracy(a) − accuracy(b)`` and its error."""
    if (pair := row.paired.get(f"{a}_over_{b}")) is not None:
        return pair.bpb, pair.se, pair.accuracy, pair.accuracy_se
    pair = row.paired[f"{b}_over_{a}"]
    return -pair.bpb, pair.se, None if pair.accuracy is None else -pair.accuracy, pair.accuracy_se


def choose(
    names: list[str], corpus: Row, passkey: Row | None, cap: float = math.inf, capped: frozenset[str] = frozenset()
) -> Verdict:
    """The rule of the module's docstring over ``names`` (simplest first), from the corpus row and the pass key row
    (None where the pass key does not fit) of one evaluation that scored them all on the same windows; a candidate
    of ``capped`` (a rule other than the run's own clock, which its profile chose) refocusing more than ``cap`` times
    a token on the corpus is refused first."""
    rate = corpus.refocus_rate or {}
    refused = {name: f"refocuses {rate[name]:.3f} times a token, over the cap of {cap:.3f}"
               for name in names if name in capped and rate.get(name, 0.0) > cap}  # fmt: skip
    if passkey is not None and passkey.accuracy is not None:
        accuracy = passkey.accuracy
        best = max((name for name in names if name not in refused), key=lambda name: accuracy[name])
        for name in (name for name in names if name not in refused):
            _, _, behind, se = paired(passkey, best, name) if name != best else (0.0, 0.0, 0.0, 0.0)
            assert behind is not None and se is not None, "a probe's row carries paired accuracies"
            if behind > PASSKEY_SE * se:
                refused[name] = (f"answers the pass key {accuracy[name]:.2f}, {behind:.2f} ± {se:.2f} below "
                                 f"{best}'s {accuracy[best]:.2f}")  # fmt: skip
    allowed = [name for name in names if name not in refused]
    lowest = min(allowed, key=lambda name: corpus.bpb[name])
    shipped = next(name for name in allowed if name == lowest or _ties(corpus, name, lowest))
    figures = {name: {"corpus_bpb": corpus.bpb[name],
                      "passkey": None if passkey is None or passkey.accuracy is None else passkey.accuracy[name],
                      "refocuses_per_token": rate.get(name)}
               for name in names}  # fmt: skip
    return Verdict(shipped, refused, figures)


def _ties(corpus: Row, simpler: str, lowest: str) -> bool:
    """Whether ``simpler``'s corpus bpb lies within :data:`TIE_SE` paired standard errors of ``lowest``'s."""
    worse, se, _, _ = paired(corpus, lowest, simpler)
    return worse <= TIE_SE * se


def validation(corpus: Corpus, cfg: RunConfig, device: torch.device) -> HeldOut:
    """The choice's windows: up to :data:`SHIP_WINDOWS` of the validation split, as the final evaluation draws its
    own from the test split (which the choice never reads)."""
    return validation_windows(corpus, cfg, SHIP_WINDOWS, device, "to choose the shipped policy on")


def ship(
    system: MegaContext,
    cfg: RunConfig,
    held: HeldOut,
    say: Callable[[str], None],
    rounds: dict[int, dict[str, torch.Tensor]] | None = None,
) -> tuple[Candidate, Verdict, EvalReport]:
    """Score every candidate on ``held`` (validation windows) in one brief evaluation and apply the rule; says the
    verdict in a few lines. Returns the candidate shipped, the verdict and the evaluation."""
    pool = candidates(system, cfg, rounds or {})
    settings = brief_judgement(system.layout, cfg.mc.refocus_every, candidates=tuple(c.policy for c in pool if c.extra))
    report = evaluate(system, held, settings)
    capped = frozenset(c.name for c in pool if c.policy.rule is not None)
    verdict = choose([c.name for c in pool], report.head.head, _passkey_row(report), cfg.mc.refocus_cap, capped)
    verdict = dataclasses.replace(verdict, refused=ship_rules(cfg)[1] | verdict.refused)
    for name, why in verdict.refused.items():
        say(f"[ship] refused {name}: {why}")
    figures = verdict.figures[verdict.shipped]
    answered = "" if figures["passkey"] is None else f", pass key {figures['passkey']:.2f}"
    say(f"[ship] shipping {verdict.shipped} (validation, {sum(w.size(0) for w in held.windows)} windows: corpus "
        f"{figures['corpus_bpb']:.4f} bits per byte{answered})")  # fmt: skip
    return next(c for c in pool if c.name == verdict.shipped), verdict, report


def _passkey_row(report: EvalReport) -> Row | None:
    result = report.scored(BRIEF_TASKS[1])
    return None if result is None else result.refocus.head


def shipped_policy(state: dict[str, Any], system: MegaContext, cfg: RunConfig) -> tuple[str, FocusPolicy]:
    """The shipped candidate's name and its policy, named ``shipped``, from a checkpoint's ``state``; a checkpoint
    saved before the choice existed ships ``lens`` (or ``match`` without LensNet)."""
    record = state.get("shipped")
    if record is None:
        default = LENS if system.lensnet is not None else MATCH
        return default.name, renamed(default, SHIPPED)
    if "lensnet" not in record:
        policy = renamed(POLICIES[record["policy"]], SHIPPED)
    else:
        device = next(system.parameters()).device
        lensnet = loaded_lensnet(cfg, system.layout, record["match_prior"], record["lensnet"], device)
        policy = lensnet_policy(SHIPPED, lensnet)
    return record["name"], dataclasses.replace(policy, rule=record.get("rule"))  # shipped with its rule


def shipped_record(shipped: Candidate, verdict: Verdict) -> dict[str, Any]:
    """What a checkpoint's ``shipped`` holds: the candidate (:meth:`Candidate.record`) and the verdict that chose it."""
    return shipped.record() | {"verdict": verdict.to_json()}


def ship_run(
    run_dir: Path,
    device: torch.device,
    say: Callable[[str], None],
    corpus: Corpus | None = None,
    rounds: dict[int, dict[str, torch.Tensor]] | None = None,
) -> Verdict:
    """The choice on a saved run (``train.ship``, and ``train.lens`` after its rounds), recorded in its checkpoint."""
    ckpt, corpus = read_run(run_dir, "to choose a policy among", corpus)
    system, cfg = run_system(ckpt, device)
    shipped, verdict, report = ship(system, cfg, validation(corpus, cfg, device), say, rounds)
    save_checkpoint(ckpt.path, ckpt.state | {"shipped": shipped_record(shipped, verdict)})
    write_choice(run_dir, verdict, report)
    return verdict
