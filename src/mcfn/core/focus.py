"""The one refocus path: how a working context is chosen for the predictions that follow a horizon.

Generation (:mod:`mcfn.inference.generation`), streaming and the held-out evaluation (``train.eval``) call the same
function, :func:`focus_cut`, so what the evaluation scores is what generation computes (the project's protocol:
``mc.refocus_every = R`` tokens between refocuses). A refocus over a history of ``n`` tokens:

* lays the static layout over the history (:mod:`mcfn.core.stream_view`: the LOD0 tail, phantom tokens after the
  newest one, a budget of ``W - R`` raised by the phantoms' count);
* scores every node once from the block view read up to the newest real token (I11, I12,
  :func:`focus_scores`), with a focus policy's scorer (:mod:`mcfn.core.policy`: LensNet or a training-free one);
* starts cold from the coarsest cut, or warm from the previous refocus's context carried over
  (:func:`carried_cut`) and shrunk back within budget (:func:`shrink_to_budget`), and settles it with the allocator.

:func:`view_context` turns the cut into the ``[1, m]`` context generation reads (phantoms dropped, absolute
positions); the evaluation appends the teacher-forced tokens instead of decoded ones
(:func:`mcfn.core.stream_view.view_node_ids` maps a view's nodes onto a training window's tree).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.allocator import allocate, coarsest_within_budget, left_out_to_budget, node_scores_of, shrink
from mcfn.core.cadence import CLOCK, COPY_THRESHOLD, RefocusWatch, rule_name
from mcfn.core.context import Scorer, WorkingContext, assemble, seen_until
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.stream_view import StreamView
from mcfn.core.tree import Tree
from mcfn.typecheck import typechecked

REFOCUS_STEPS = 4  # allocator steps of a cold refocus, from the coarsest cut: L + 2 settle every case tried (I12)
WARM_STEPS = 1  # allocator steps of a warm one, from the previous context


def tail_horizon(layout: Layout, rows: int, device: torch.device) -> Int[Tensor, " r"]:
    """``[rows]``: each row's horizon (I11) at the tail's first token, the first prediction a training cut serves."""
    return torch.full((rows,), layout.T - layout.H, device=device)


@typechecked
def block_scores(
    scorer: Scorer,
    tree: Tree,
    window: Int[Tensor, "b t1"],
    nodes: NodeTable,
    horizon: Int[Tensor, " b"] | None = None,
    width: int | None = None,
) -> Float[Tensor, "b nodes"]:
    """Every node's score ``[B, nodes]``, read once from one fixed view, the :attr:`NodeTable.block_view`
    (every eligible LOD1 gist, the tail as tokens), up to ``horizon [B]`` (:func:`seen_until`; by default the
    start of the tail, the first prediction the cut serves), and spread to every level
    (:meth:`NodeTable.spread_block_scores`). ``scorer`` gives signed scores per entry (a focus policy's, e.g.
    :meth:`LensNet.scorer`). With the gradient: the counterfactual LensNet stage trains through it; a refocus
    calls :func:`focus_scores`. ``width``: the block view's entries, its first by start (by default all,
    :attr:`Layout.block_view_width`; a view padded to a fixed shape keeps the most its real tokens can fill, so
    that the phantoms past them are left out and score 0, as padding does).

    Why one view: scores read from the cut being refocused judge each node against what that cut shows, so a
    context of far gists asks for the recent text back and a context of recent text asks for the far gists,
    and the refocus would alternate between the two forever."""
    B = window.size(0)
    horizon = tail_horizon(nodes.layout, B, window.device) if horizon is None else horizon
    view = nodes.with_sizes(W=nodes.layout.block_view_width if width is None else width)
    wc = assemble(tree, repeat(nodes.block_view, "n -> b 1 n", b=B), window, view)
    scores = node_scores_of(scorer(seen_until(wc, horizon)), wc.node, wc.valid, nodes.layout.n_nodes)
    return nodes.spread_block_scores(scores)


def focus_scores(*args, **kwargs) -> Tensor:
    """:func:`block_scores` (the same arguments) without the gradient: what a refocus reads."""
    with torch.no_grad():
        return block_scores(*args, **kwargs)


@typechecked
def settle(
    cut: Bool[Tensor, "b a nodes"],
    scores: Float[Tensor, "b nodes"],
    nodes: NodeTable,
    steps: int,
    explore: Float[Tensor, "b a i nodes"] | None = None,
    noise: float = 0.0,
) -> Bool[Tensor, "b a nodes"]:
    """``steps`` allocator steps on ``A`` cuts per sample with fixed ``scores``, plus ``noise`` times the exploration
    noise ``explore`` (then one step per ``i``). Without noise the cut stops changing within a few steps."""
    B = cut.size(0)
    steps = explore.size(2) if explore is not None else steps
    rows = repeat(scores, "b n -> (b a) n", a=cut.size(1))
    cut = rearrange(cut, "b a n -> (b a) n")
    for step in range(steps):
        noisy = rows if explore is None else rows + noise * rearrange(explore[:, :, step], "b a n -> (b a) n")
        cut = allocate(cut, noisy, nodes)
    return rearrange(cut, "(b a) n -> b a n", b=B)


@typechecked
def refocus(
    scorer: Scorer,
    tree: Tree,
    window: Int[Tensor, "b t1"],
    cut: Bool[Tensor, "b a nodes"],
    nodes: NodeTable,
    explore: Tensor | None = None,
    iterations: int = 1,
    horizon: Int[Tensor, " b"] | None = None,
    noise: float = 0.0,
) -> Bool[Tensor, "b a nodes"]:
    """Refocus ``A`` working contexts per sample within ``nodes.layout.W``: :func:`focus_scores` once, then
    ``iterations`` allocator steps (:func:`settle`, with ``noise`` times ``explore [B, A, I, nodes]`` if given).
    ``nodes`` may be another layout's (a streaming view). Training's allocator and the one-cut evaluation call it."""
    scores = focus_scores(scorer, tree, window, nodes, horizon)
    return settle(cut, scores, nodes, iterations, explore, noise)


@dataclass(frozen=True)
class Refocus:
    """Generation's protocol, which the evaluation and the LensNet stage run too: a refocus every ``every`` tokens
    (``on = "clock"``), or when a copy starts and at the latest every ``every`` tokens (``on = "copy"``, with the
    copy evidence's ``threshold``: :mod:`mcfn.core.cadence`); the first with ``steps`` allocator steps from the
    coarsest cut, later ones with ``warm_steps`` from the previous context (0: cold every time). Each cut is chosen
    within ``W - every`` entries, room for the most tokens read before the next refocus."""

    every: int
    steps: int = REFOCUS_STEPS
    warm_steps: int = WARM_STEPS
    on: str = CLOCK
    threshold: float = COPY_THRESHOLD

    @property
    def name(self) -> str:
        """The rule as flags and reports spell it (``16``, ``copy16``)."""
        return rule_name(self.on, self.every)

    def watch(self, tokens: Iterable[int]) -> RefocusWatch:
        """The decider of a stream whose history so far is ``tokens``."""
        return RefocusWatch(self.on, self.every, self.threshold, tokens)

    def carried(self, previous: WorkingContext | None) -> WorkingContext | None:
        """What a refocus starts from: the previous refocus's context (warm), or None (cold: the first refocus, or
        every one where ``warm_steps`` is 0). Generation keeps the cache behind a carried context."""
        return previous if self.warm_steps else None

    def steps_from(self, carried: WorkingContext | None) -> int:
        return self.steps if carried is None else self.warm_steps


SHRINKS = 1  # shrink calls a carried cut gets beyond one per level: each can complete groups one level up


@typechecked
def carried_cut(
    previous: WorkingContext, origin: int | Tensor, nodes: NodeTable
) -> tuple[Bool[Tensor, "1 1 nodes"], Bool[Tensor, ""]]:
    """The shown-node mask ``[1, 1, n_nodes]`` of the view (from token ``origin`` on; ``nodes`` is its table)
    that keeps ``previous`` (a ``[1, m]`` context, absolute starts, valid entries first: :func:`view_context`'s or
    a fixed-shape refocus's) and shows every later token at LOD0, phantoms included; entries before the origin
    drop out, and the blocks ``previous`` left out come back as LODmax gists, so that the scores judge them
    again. It may exceed the view's budget by the tokens that arrived and those gists. Also whether ``previous``
    can be carried at all: it ends at or after the origin. No host sync: a refocus compiled whole calls it."""
    layout, valid = nodes.layout, previous.valid[0]
    start = previous.start[0] - origin
    end = torch.where(valid, start + previous.span[0], -1).amax()  # the first token ``previous`` did not cover
    offsets = torch.tensor(layout.level_offsets, device=start.device)
    kept = valid & (start >= 0)
    node = torch.where(kept, offsets[previous.lod[0]] + start.clamp(min=0) // previous.span[0], layout.n_nodes)
    shown = torch.zeros(layout.n_nodes + 1, dtype=torch.bool, device=start.device).index_fill(0, node, True)
    token = torch.arange(layout.n_nodes, device=start.device)
    shown = shown[: layout.n_nodes] | ((token >= end) & (token < layout.T))  # LOD0 nodes come first, by token
    return (shown | nodes.left_out(shown))[None, None], end >= 0


@typechecked
def shrink_to_budget(
    cut: Bool[Tensor, "1 1 nodes"], scores: Float[Tensor, "1 nodes"], nodes: NodeTable
) -> tuple[Bool[Tensor, "1 1 nodes"], Bool[Tensor, ""]]:
    """A carried cut ``[1, 1, n_nodes]`` (over budget by the new tokens) brought within budget by
    :func:`~mcfn.core.allocator.shrink` with the view's ``scores``, and whether it got there. ``L + SHRINKS``
    calls, a fixed count (a call within budget changes nothing): a call short of complete groups collapses all it
    has, which can complete groups one level up for the next, so past ``L`` calls nothing is left to collapse; where
    that is still over (a long history's carry), the lowest-scoring top-level gists are left out
    (:func:`left_out_to_budget`)."""
    shown = cut[0]
    for _ in range(nodes.layout.L + SHRINKS):
        shown = shrink(shown, scores, nodes)
    shown = left_out_to_budget(shown, scores, nodes)  # a long history's carry: collapsing alone may not fit it
    return shown[None], shown.sum() <= nodes.budget


@typechecked
def start_cut(
    previous: WorkingContext | None, origin: int | Tensor, scores: Float[Tensor, "1 nodes"], nodes: NodeTable
) -> Bool[Tensor, "1 1 nodes"]:
    """Where a refocus's allocator starts: the coarsest cut within budget (cold, ``previous`` None), or ``previous``
    carried over and shrunk within budget (warm), the coarsest again where it cannot be (a choice by value, not by
    branch)."""
    coarsest = coarsest_within_budget(scores, nodes)
    if previous is None:
        return coarsest
    carried, can_carry = carried_cut(previous, origin, nodes)
    shrunk, within = shrink_to_budget(carried, scores, nodes)
    return torch.where(can_carry & within, shrunk, coarsest)


@typechecked
def chosen_cut(
    scorer: Scorer,
    tree: Tree,
    window: Int[Tensor, "1 t1"],
    nodes: NodeTable,
    horizon: Int[Tensor, " 1"],
    origin: int | Tensor,
    steps: int,
    previous: WorkingContext | None = None,
    width: int | None = None,
) -> Bool[Tensor, "1 1 nodes"]:
    """The refocus's choice: scores read up to ``horizon`` from the block view (``width``: :func:`block_scores`),
    then ``steps`` allocator steps from :func:`start_cut`. :func:`focus_cut` calls it on a view's own layout, a
    fixed-shape refocus (:mod:`mcfn.inference.choice`) on the view padded to its capacity: the same cut."""
    scores = focus_scores(scorer, tree, window, nodes, horizon, width)
    return settle(start_cut(previous, origin, scores, nodes), scores, nodes, steps)


@torch.no_grad()
@typechecked
def focus_cut(
    scorer: Scorer,
    tree: Tree,
    window: Int[Tensor, "1 t1"],
    view: StreamView,
    steps: int,
    previous: WorkingContext | None = None,
) -> Bool[Tensor, "1 1 nodes"]:
    """The refocus: the view's cut ``[1, 1, n_nodes]`` within its budget, ``steps`` allocator steps from the
    coarsest cut, or with ``previous`` (the last refocus's :func:`view_context`) from that context carried over and
    shrunk within budget: a warm start (:func:`chosen_cut`). ``tree`` and ``window`` are the view's
    (``[1, n_nodes, D]``, ``[1, T + 1]``); nothing after the newest real token is read. ``scorer`` gives signed
    scores per entry (a scored focus policy's, :mod:`mcfn.core.policy`)."""
    nodes = NodeTable.of(view.layout, window.device)
    horizon = torch.tensor([view.real - 1], device=window.device)  # the newest real token, no phantom (I11)
    return chosen_cut(scorer, tree, window, nodes, horizon, view.origin, steps, previous)


@typechecked
def chosen_context(
    tree: Tree,
    cut: Bool[Tensor, "1 1 nodes"],
    window: Int[Tensor, "1 t1"],
    nodes: NodeTable,
    real: int | Tensor,
    origin: int | Tensor,
    width: int,
) -> WorkingContext:
    """The context ``[1, width]`` a cut of a view gives: its first ``width`` entries by start (at least every real
    one), the phantoms among them (from token ``real`` of the view on) made padding; starts and positions absolute
    (the view begins at token ``origin``); a view of fewer nodes than ``width`` is padded to it. Fixed-shape: a
    refocus compiled whole returns it."""
    wc = assemble(tree, cut, window, nodes.with_sizes(W=min(width, nodes.layout.n_nodes)))
    pad = (0, width - wc.batch_size[1])  # a shape, not a value: static under compile
    fields = {
        "emb": F.pad(wc.emb, (0, 0, *pad)),
        "position": F.pad(wc.position + origin, pad),
        "start": F.pad(wc.start + origin, pad),
        "span": F.pad(wc.span, pad, value=1),
        "lod": F.pad(wc.lod, pad),
        "node": F.pad(wc.node, pad),
        "target": F.pad(wc.target, pad, value=-1),
        "valid": F.pad(wc.valid & (wc.start < real), pad),
    }
    return WorkingContext(**fields, batch_size=[1, width])


def valid_prefix(wc: WorkingContext) -> WorkingContext:
    """A ``[1, w]`` context's valid entries ``[1, m]`` (they come first, I3): one host read of their count."""
    return wc[:, : int(wc.valid.sum())]


@typechecked
def view_context(
    tree: Tree, cut: Bool[Tensor, "1 1 nodes"], window: Int[Tensor, "1 t1"], view: StreamView
) -> WorkingContext:
    """The context ``[1, m]`` a cut of the view gives (valid entries only, ``m`` within the refocus budget):
    phantoms dropped, starts and positions absolute (:func:`chosen_context` over the view's budget)."""
    nodes = NodeTable.of(view.layout, window.device)
    return valid_prefix(chosen_context(tree, cut, window, nodes, view.real, view.origin, view.layout.W))
