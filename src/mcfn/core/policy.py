"""Focus policies: how a working context is chosen over a history. One registry, :data:`POLICIES`, which every
reader iterates: generation (``train.generate --context NAME``), both evaluation protocols, the report's opening
lines, the tables, the plots and the LensNet stage's comparisons. To add a policy, :func:`register` one.

A policy chooses its cut in one of five ways (:class:`Choice`):

* ``full``: every token at LOD0, no budget (the bar every other policy is measured against);
* ``recency``: truncation, the newest ``W - R`` tokens at each refocus;
* ``recent``: the fixed rule (the tail, then coarser with distance) and ``random``: ``M`` random compressed cuts,
  the evaluation's references (the best-of conditions pick among them); generation does not decode with them;
* a *scored* policy (``attn``, ``match``, ``lens`` and any registered one): every node scored once from the block
  view, read up to the horizon (I11), and the allocator settles a cut within the budget, cold from the coarsest
  cut (:data:`~mcfn.core.focus.REFOCUS_STEPS`) or warm from the previous context (:func:`~mcfn.core.focus.focus_cut`).

A scored policy's :attr:`FocusPolicy.scorer_of` builds its scorer for one view: ``(system, window, layout, reach,
scale)``, the window's tokens ``[g, >= layout.T]`` (only what lies up to each row's newest entry is read), the view's
layout, ``reach``, the number of predictions the cut serves (``R`` under generation's protocol, ``H`` under one cut),
and ``scale``, the length of the view that distances are measured over (``None``: ``layout.T``; a view padded to a
fixed shape, :mod:`mcfn.inference.choice`, gives its own as a tensor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial

from torch import Tensor

from mcfn.core.attention import attention_scores
from mcfn.core.branches import branch_scores
from mcfn.core.context import Scorer, WorkingContext
from mcfn.core.focus import Refocus, focus_cut, view_context
from mcfn.core.lensnet import LensNet
from mcfn.core.match import match_scorer
from mcfn.core.nodes import Layout
from mcfn.core.stream_view import StreamView
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.core.variants import recency_cut

ScorerOf = Callable[[MegaContext, Tensor, Layout, int, Tensor | None], Scorer]


class Choice(Enum):
    """How a policy chooses its cut."""

    FULL = "full"  # every token, no budget
    TRUNCATION = "truncation"  # the newest W - R tokens
    FIXED = "fixed"  # the fixed rule, mcfn.core.variants.recent_cut
    RANDOM = "random"  # M random compressed cuts
    SCORED = "scored"  # a scorer of the block view, settled by the allocator


@dataclass(frozen=True)
class FocusPolicy:
    """A named way to choose the working context (see the module's docstring)."""

    name: str
    choice: Choice
    scorer_of: ScorerOf | None = None  # a scored policy's scorer for one view
    needs_lensnet: bool = False  # scored by the run's LensNet: absent from a run without one
    brief: bool = True  # scored by a run's brief final evaluation (full, recency, match, lens, branches)
    # Its own refocus rule (mcfn.core.cadence.rule_name: "8", "copy16"), where it is not the protocol's: a candidate of
    # the ship choice, or a shipped policy, which ships with the rule it was chosen under.
    rule: str | None = None

    def __post_init__(self) -> None:
        if (self.choice is Choice.SCORED) != (self.scorer_of is not None):
            raise ValueError(f"focus policy {self.name!r}: a scored policy needs a scorer, and only a scored one")

    @property
    def scored(self) -> bool:
        return self.choice is Choice.SCORED

    @property
    def refocuses(self) -> bool:
        """Whether it chooses a cut within the budget at each refocus (truncation or a scored policy): what MC
        decoding can run, and what the best-of candidates and the report's ``best_context`` choose among."""
        return self.choice in (Choice.TRUNCATION, Choice.SCORED)

    @property
    def generates(self) -> bool:
        """Whether generation decodes with it (``train.generate --context``): a refocusing policy, or full context."""
        return self.refocuses or self.choice is Choice.FULL

    def available(self, system: MegaContext) -> bool:
        return system.lensnet is not None or not self.needs_lensnet

    def scorer(
        self, system: MegaContext, window: Tensor, layout: Layout, reach: int, scale: Tensor | None = None
    ) -> Scorer:
        assert self.scorer_of is not None, f"{self.name} is not a scored policy"
        return self.scorer_of(system, window, layout, reach, scale)

    def refocus(
        self,
        system: MegaContext,
        tree: Tree,
        window: Tensor,
        view: StreamView,
        protocol: Refocus,
        previous: WorkingContext | None = None,
    ) -> tuple[Tensor, WorkingContext]:
        """One refocus under generation's ``protocol``, the one the evaluation calls, and generation for truncation
        (a scored policy generates through :class:`~mcfn.inference.choice.FocusChoice`, which
        ``tests/test_choice.py`` holds to this cut in a stepped capacity): the view's cut ``[1, 1, view_nodes]``
        and the context ``[1, m]`` it gives (:func:`~mcfn.core.focus.view_context`).
        Truncation keeps the newest tokens the budget holds; a scored policy scores the view once and settles a cut,
        cold from the coarsest one or warm from ``previous`` (the last refocus's context) as ``protocol`` says.
        ``tree [1, view_nodes, D]`` and ``window [1, T + 1]`` are the view's; nothing past its newest real token is
        read."""
        assert self.refocuses, f"the {self.name} policy does not refocus"
        if self.choice is Choice.TRUNCATION:
            cut = recency_cut(view.layout, 1, window.device, view.real)
        else:
            carried = protocol.carried(previous)
            scorer = self.scorer(system, window, view.layout, protocol.every)
            cut = focus_cut(scorer, tree, window, view, protocol.steps_from(carried), carried)
        return cut, view_context(tree, cut, window, view)


POLICIES: dict[str, FocusPolicy] = {}  # by name, in the order the tables list them


def register(policy: FocusPolicy) -> FocusPolicy:
    if policy.name in POLICIES:
        raise ValueError(f"a focus policy named {policy.name!r} is registered already")
    POLICIES[policy.name] = policy
    return policy


def policies(system: MegaContext | None = None, brief: bool = False) -> list[FocusPolicy]:
    """The registered policies in order: those ``system`` can run (a scored one may need its LensNet), and with
    ``brief`` only those a brief evaluation scores."""
    return [p for p in POLICIES.values() if (system is None or p.available(system)) and (p.brief or not brief)]


def _attention(system: MegaContext, window: Tensor, layout: Layout, reach: int, scale: Tensor | None) -> Scorer:
    return partial(attention_scores, system.base, system.layout.H)


def _match(system: MegaContext, window: Tensor, layout: Layout, reach: int, scale: Tensor | None) -> Scorer:
    return match_scorer(window[:, : layout.T], layout.K, reach, layout.T if scale is None else scale)


def _lensnet(system: MegaContext, window: Tensor, layout: Layout, reach: int, scale: Tensor | None) -> Scorer:
    assert system.lensnet is not None, "the lens policy needs the run's LensNet"
    return system.lensnet.scorer(layout, window, system.base, scale, reach)


def _branches(system: MegaContext, window: Tensor, layout: Layout, reach: int, scale: Tensor | None) -> Scorer:
    learned, votes = (of(system, window, layout, reach, scale) for of in (_lensnet, _match))
    return lambda wc: branch_scores(learned(wc), votes(wc), wc)


FULL = register(FocusPolicy("full", Choice.FULL))
RECENCY = register(FocusPolicy("recency", Choice.TRUNCATION))
RECENT = register(FocusPolicy("recent", Choice.FIXED, brief=False))
RANDOM = register(FocusPolicy("random", Choice.RANDOM, brief=False))
SHIPPED = "shipped"  # the name the evaluation scores a run's shipped policy under (mcfn.stage.ship)


def renamed(policy: FocusPolicy, name: str) -> FocusPolicy:
    """``policy`` under another name: a candidate of the ship choice, or the run's shipped policy."""
    return dataclasses.replace(policy, name=name)


def lensnet_policy(name: str, lensnet: LensNet) -> FocusPolicy:
    """A scored policy named ``name`` that scores with ``lensnet`` instead of the system's own (a candidate LensNet:
    the run's own gated over ``match``, a round of the LensNet stage), the system's base, GistNet and tree unchanged."""

    def scorer_of(system: MegaContext, window: Tensor, layout: Layout, reach: int, scale: Tensor | None) -> Scorer:
        return lensnet.scorer(layout, window, system.base, scale, reach)

    return FocusPolicy(name, Choice.SCORED, scorer_of)


ATTN = register(FocusPolicy("attn", Choice.SCORED, _attention, brief=False))
MATCH = register(FocusPolicy("match", Choice.SCORED, _match))
LENS = register(FocusPolicy("lens", Choice.SCORED, _lensnet, needs_lensnet=True))
BRANCHES = register(FocusPolicy("branches", Choice.SCORED, _branches, needs_lensnet=True))
