"""What the evaluation's functions share: its settings (the budgets it sweeps among them, checked where they are made:
:func:`evaluation_budgets`), the brief judgement a run's end makes (:func:`brief_judgement`), and one held-out batch as
every condition is scored from it.

:class:`EvalBatch` carries the model, the batch's window, its summary tree (and the tree with every gist zeroed, for
``lens_nogist``), and each window's horizon, so that the two protocols (:mod:`mcfn.evaluation.one_cut`,
:mod:`mcfn.evaluation.refocused`) take one value instead of the same six arguments each, and return what they compute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

from mcfn.core.cadence import CLOCK, COPY_THRESHOLD, parse_rule
from mcfn.core.focus import REFOCUS_STEPS, WARM_STEPS, Refocus
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.policy import FocusPolicy, policies
from mcfn.core.stream_view import refocus_budget
from mcfn.core.system import MegaContext, tree_stage
from mcfn.core.tree import Tree
from mcfn.data.probes import PROBES
from mcfn.errors import UserError
from mcfn.evaluation.oracle import ORACLES

PROTOCOLS = ("refocus", "one_cut")  # generation's (the headline), and one cut for the whole tail (R = H)


@dataclass(frozen=True)
class EvalSettings:
    budgets: tuple[int, ...]  # W per sweep row; the first is the headline
    random_contexts: int = 8  # M: random compressed contexts per window (random and the best-of conditions)
    refocus: int = REFOCUS_STEPS  # allocator steps of a scored policy's cold refocus
    tasks: tuple[str, ...] = PROBES  # corpus first: the report's headline figures come from it
    probe_batches: int | None = None  # batches that carry each probe; None: all of them (corpus always has all)
    refocus_every: int = 16  # R (mc.refocus_every): generation's protocol refocuses every R tokens (at the latest)
    refocus_on: str = CLOCK  # when else it refocuses (mcfn.core.cadence): "clock", never; "copy", when a copy starts
    refocus_threshold: float = COPY_THRESHOLD  # the copy rule's threshold
    warm_steps: int = WARM_STEPS  # allocator steps of every refocus after a window's first, from the previous context
    # Only what a reader needs first (a run's final evaluation): full, recency, match, lens and branches under
    # generation's protocol; no random, structured or attention cuts, no best-of, no gist ablation, no one-cut protocol.
    brief: bool = False
    # Policies scored beside the registry's, each under its own name (mcfn.core.policy.renamed, lensnet_policy): the
    # run's shipped policy, or the candidates of the ship choice (mcfn.stage.ship). They refocus as generation does.
    candidates: tuple[FocusPolicy, ...] = ()
    # The oracles (mcfn.evaluation.oracle), under generation's protocol: diagnostics, two of them reading each
    # chunk's future, never policies (train.eval --oracle).
    oracle: bool = False

    def policies(self, system: MegaContext) -> list[FocusPolicy]:
        """What is scored on ``system``: the registry's policies it can run (a brief evaluation's only), then the
        candidates."""
        return [*policies(system, self.brief), *self.candidates]

    @property
    def names(self) -> tuple[str, ...]:
        """The conditions scored beside the registry's policies: the candidates', then the oracles' (with
        ``oracle``)."""
        return (*(policy.name for policy in self.candidates), *(ORACLES if self.oracle else ()))

    @property
    def protocols(self) -> tuple[str, ...]:
        """Generation's (the headline), and unless ``brief`` one cut for the whole tail (``R = H``)."""
        return PROTOCOLS[:1] if self.brief else PROTOCOLS

    @property
    def protocol(self) -> Refocus:
        """Generation's refocus as the evaluation runs it."""
        return Refocus(self.refocus_every, self.refocus, self.warm_steps, self.refocus_on, self.refocus_threshold)

    def rule_of(self, policy: FocusPolicy) -> Refocus:
        """The refocus rule ``policy`` is scored under: its own (:attr:`FocusPolicy.rule`), else the protocol's."""
        if policy.rule is None:
            return self.protocol
        on, every = parse_rule(policy.rule)
        return dataclasses.replace(self.protocol, on=on, every=every)

    def on_grid(self, policy: FocusPolicy) -> bool:
        """Whether ``policy`` refocuses on the evaluation's shared clock (every ``refocus_every`` tokens, the chunks
        every condition that is not a policy's own is scored in); else it runs its own rule
        (:func:`mcfn.evaluation.refocused.predict_cadenced`)."""
        rule = self.rule_of(policy)
        return rule.on == CLOCK and rule.every == self.refocus_every


def gists_zeroed(tree: Tree, nodes: NodeTable) -> Tree:
    """``tree`` with every gist's embedding zeroed (tokens kept): what ``lens_nogist`` reads."""
    return Tree(emb=tree.emb * rearrange(nodes.lod == 0, "n -> 1 n 1"), batch_size=tree.batch_size)


def default_budgets(layout: Layout) -> tuple[int, ...]:
    """The budgets an evaluation sweeps by default: the run's own ``W`` first, then ``T/2, T/4, T/8`` where they fit
    above the coarsest cover."""
    sweep = [layout.W] + [layout.T // d for d in (2, 4, 8)]
    fits = [w for w in sweep if layout.coarsest_cover < w < layout.T]
    return tuple(dict.fromkeys(fits))


def evaluation_budgets(layout: Layout, budgets: tuple[int, ...] | None, refocus_every: int) -> tuple[int, ...]:
    """The budgets an evaluation of ``layout`` sweeps (``None``: :func:`default_budgets`), the first its headline,
    refused in one line where one lies outside ``[coarsest cover, T]`` or the headline cannot refocus every ``R``
    (:func:`~mcfn.core.stream_view.refocus_budget`)."""
    budgets = default_budgets(layout) if budgets is None else budgets
    for w in budgets:
        if not layout.coarsest_cover <= w <= layout.T:
            raise UserError(
                f"budget {w} is outside [{layout.coarsest_cover}, {layout.T}]: the coarsest full-coverage context "
                f"needs {layout.coarsest_cover} entries and T={layout.T}"
            )
    refocus_budget(dataclasses.replace(layout, W=budgets[0]), refocus_every)
    return budgets


BRIEF_TASKS = ("corpus", "passkey")  # how a run judges a policy: natural text, and the retrieval truncation cannot do


def brief_judgement(
    layout: Layout, refocus_every: int, probe_batches: int | None = None, candidates: tuple[FocusPolicy, ...] = ()
) -> EvalSettings:
    """The brief judgement each reader at a run's end makes (the ship choice, the LensNet stage's judge, the final
    evaluation): the corpus and the pass key at the run's own ``W`` under generation's protocol, ``candidates``
    scored beside the brief conditions."""
    budgets = evaluation_budgets(layout, (layout.W,), refocus_every)
    return EvalSettings(budgets, tasks=BRIEF_TASKS, probe_batches=probe_batches, refocus_every=refocus_every,
                        brief=True, candidates=candidates)  # fmt: skip


@dataclass(frozen=True)
class EvalBatch:
    """One held-out batch of ``B`` windows, ready to score at any budget."""

    system: MegaContext
    settings: EvalSettings
    window: Tensor  # [B, T + 1] token ids (with the task's probe written in)
    horizon: Tensor  # [B] int64: each window's first scored prediction's position, what a cut is chosen up to (I11)
    tree: Tree  # [B, n_nodes, D]: the summary tree the working contexts read
    nogist: Tree  # [B, n_nodes, D]: the same with every gist zeroed
    utility: bool = False  # also label each edit of LensNet's cuts (utility_corr), under generation's protocol

    @classmethod
    @torch.no_grad()
    def of(
        cls, system: MegaContext, settings: EvalSettings, window: Tensor, horizon: Tensor, utility: bool = False
    ) -> EvalBatch:
        tree = tree_stage(system, window)
        return cls(system, settings, window, horizon, tree, gists_zeroed(tree, system.nodes), utility)

    def nodes(self, budget: int) -> NodeTable:
        """The node table of the training layout at ``budget``."""
        return self.system.nodes.with_sizes(W=budget)
