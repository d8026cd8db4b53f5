"""The counterfactual LensNet's actions: single legal edits of a cut, what LensNet predicts each is worth, and the
ranking objective that teaches it their measured worth (``../shared/seeds/003``: "signed per-entry utilities whose
sign correlates with the counterfactual ΔNLL benefit of expanding that entry or collapsing the block").

An edit changes one decision of a refocused cut and keeps the budget by the allocator's own rules
(:mod:`mcfn.core.allocator`), so that it is a cut the allocator could have reached (I3, I6, I8):

* **expand** a shown gist into its ``K`` children, paid for (when the budget is full) by the collapse the allocator
  would give up first: the complete group whose parent scores lowest (not the expanded gist's own parent, whose
  group the expansion breaks);
* **collapse** one complete group into its parent, the ``K - 1`` entries it frees spent as the allocator spends
  free budget first: on the best-scoring shown gist;
* **drop** one shown droppable gist, leaving its span out (the one entry it frees stays free).

Each edit *gains* at most one node's detail and *gives up* at most one: ``gain`` and ``loss`` (``-1``: none). With
scores ``s`` over nodes (a complete group scores as its parent, :meth:`NodeTable.spread_block_scores`), LensNet's
predicted worth of an edit is ``s[gain] - s[loss]``: what the allocator weighs when it makes the same trade. The
label is the edit's measured ΔNLL, the policy cut's chunk NLL minus the edited cut's (> 0: the edit helps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.allocator import collapsed
from mcfn.core.nodes import NodeTable
from mcfn.typecheck import typechecked

EXPAND, COLLAPSE, DROP = 0, 1, 2  # an edit's kind


@dataclass(frozen=True)
class Edits:
    """``E`` single edits of one cut."""

    shown: Bool[Tensor, "e nodes"]  # each edited cut
    gain: Int[Tensor, " e"]  # the node whose detail the edit adds (an expanded gist); -1: none
    loss: Int[Tensor, " e"]  # the node whose detail it gives up (a collapsed group's parent, a dropped gist); -1: none
    kind: Int[Tensor, " e"]  # EXPAND, COLLAPSE or DROP


def one_hot(index: Int[Tensor, " e"], n: int) -> Bool[Tensor, "e n"]:
    return index[:, None] == torch.arange(n, device=index.device)


def lowest(candidates: Bool[Tensor, "e n"], scores: Float[Tensor, " n"]) -> tuple[Tensor, Tensor]:
    """Per row, the lowest-scoring candidate node, and whether there is one."""
    return torch.where(candidates, scores, torch.inf).argmin(-1), candidates.any(-1)


@typechecked
def single_edits(shown: Bool[Tensor, " nodes"], scores: Float[Tensor, " nodes"], nodes: NodeTable) -> Edits:
    """Every single legal edit of the cut ``shown`` (see the module docstring), with the allocator's ``scores``
    choosing what pays for an expansion and what a collapse's freed budget buys. An expansion nothing can pay for
    is left out. Eager code: the number of edits depends on the cut."""
    n, K, W = nodes.layout.n_nodes, nodes.layout.K, nodes.layout.W
    node = torch.arange(n, device=shown.device)
    free = W - int(shown.sum())
    parents = nodes.collapsible(shown)

    gist = torch.nonzero(shown & (nodes.lod > 0)).flatten()
    grown = (shown & ~one_hot(gist, n)) | nodes.children_of(one_hot(gist, n))
    payer, payable = lowest(parents & (node != nodes.parent[gist][:, None]), scores)
    must_pay = free < K - 1
    payer = torch.where(torch.tensor(must_pay), payer, -1)
    grown = torch.where(payer[:, None] >= 0, collapsed(grown, one_hot(payer, n), nodes), grown)
    keep = payable | (not must_pay)
    expand = Edits(grown[keep], gist[keep], payer[keep], torch.full_like(gist[keep], EXPAND))

    parent = torch.nonzero(parents).flatten()
    merged = collapsed(shown.expand(parent.numel(), -1), one_hot(parent, n), nodes)
    best, some = lowest(merged & (nodes.lod > 0) & ~one_hot(parent, n), -scores)
    bought = torch.where(some, best, -1)
    merged = torch.where(some[:, None], (merged & ~one_hot(best, n)) | nodes.children_of(one_hot(best, n)), merged)
    collapse = Edits(merged, bought, parent, torch.full_like(parent, COLLAPSE))

    dropped = torch.nonzero(shown & nodes.droppable).flatten()
    drop = Edits(shown & ~one_hot(dropped, n), torch.full_like(dropped, -1), dropped, torch.full_like(dropped, DROP))
    parts = (expand, collapse, drop)
    return Edits(*(torch.cat([getattr(p, f) for p in parts]) for f in ("shown", "gain", "loss", "kind")))


def edit_worth(
    scores: Float[Tensor, "*rows nodes"], gain: Int[Tensor, "*rows e"], loss: Int[Tensor, "*rows e"]
) -> Float[Tensor, "*rows e"]:
    """LensNet's predicted worth of each edit, ``s[gain] - s[loss]`` (a missing node counts 0)."""

    def at(index: Tensor) -> Tensor:
        return torch.where(index >= 0, scores.gather(-1, index.clamp(min=0)), 0.0)

    return at(gain) - at(loss)


@typechecked
def ranking_loss(
    predicted: Float[Tensor, "s e"], delta: Float[Tensor, "s e"], valid: Bool[Tensor, "s e"]
) -> Float[Tensor, ""]:
    """The pairwise ranking loss of each state's edits and the unedited cut (worth 0, measured 0): for every pair
    whose measured ΔNLL differs, the logistic loss of predicting them in the wrong order, weighted by how much they
    differ (``|Δ_i − Δ_j|``), so that the pairs that matter most teach most. Normalised by the total weight: its
    scale does not depend on the nats."""
    # The unedited cut is in every list, predicted and measured at 0: an edit's predicted worth must then be
    # positive exactly when it helps, which is what the allocator acts on, not only rank above the others.
    predicted, delta = (F.pad(x, (1, 0)) for x in (predicted, delta))
    valid = F.pad(valid, (1, 0), value=True)
    gap = delta[:, :, None] - delta[:, None, :]  # > 0: i measured better than j
    weight = gap.clamp(min=0) * (valid[:, :, None] & valid[:, None, :])
    margin = predicted[:, :, None] - predicted[:, None, :]
    return (weight * F.softplus(-margin)).sum() / weight.sum().clamp(min=1e-12)
