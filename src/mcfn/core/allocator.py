"""The focus allocator: from LensNet scores and a working context, a new working context within ``W``.

It works on the shown-node mask ``[R, n_nodes]`` of a cut through the tree, and one call is one
refocus step, fixed-shape and vectorized:

1. **Expansions** are candidates among the shown gists (LOD ≥ 1; a shown gist is always eligible). Each
   turns one entry into its ``K`` children and costs ``K - 1`` entries.
2. **Collapses** are candidates among the complete groups: a parent whose ``K`` children are all shown,
   whose children all score below zero (the group's label is shared), and which is eligible (never over
   the tail). Each turns ``K`` entries into one and frees ``K - 1``; the group's score is its children's mean.
3. **Drops** are candidates among the shown eligible LODmax gists that score below zero: each leaves its
   block out of the context and frees one entry.
4. The free budget is filled first, with the highest-scoring expansions, whatever their sign. Positive
   expansions that do not fit are then paid for by collapsing the most negative groups, one group for
   one expansion, and what collapses cannot pay for, by dropping the most negative LODmax gists,
   ``K - 1`` of them for one expansion, so the count never exceeds ``W``.
5. **Restores**: budget still free after that (less than one expansion, or nothing left to expand) shows
   left-out blocks again as their LODmax gists, newest first: the budget is used as fully as the tree allows.

A collapsing group's children and a dropped gist all score below zero, and only positive expansions are
paid for, so no two actions touch the same node. The result is again a cut, each top-level block either
covered exactly once or left out, with the tail at LOD0 (I8). From the coarsest cut, repeated steps reach
truncation when LensNet asks for it: recent gists expanded, old blocks left out.

:func:`shrink` brings a cut that grew past ``W`` (a streaming context carried over to a longer history,
its new tokens at LOD0) back within it, by collapses alone.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mcfn.core.nodes import NodeTable
from mcfn.core.variants import top_by_priority
from mcfn.typecheck import typechecked


@typechecked
def allocate(
    shown: Bool[Tensor, "r nodes"],
    node_scores: Float[Tensor, "r nodes"],
    nodes: NodeTable,
) -> Bool[Tensor, "r nodes"]:
    """One refocus step (see the module docstring)."""
    layout = nodes.layout
    cost = layout.K - 1
    # Hidden nodes' scores are never read: candidates are shown gists and complete groups of shown children.
    can_expand = shown & (nodes.lod > 0)
    can_collapse = nodes.collapsible(shown) & (nodes.group_reduce(node_scores, "amax") < 0)
    can_drop = droppable(shown, nodes) & (node_scores < 0)
    group_score = nodes.group_reduce(node_scores, "mean")

    free = layout.W - shown.sum(-1)
    n_expand = can_expand.sum(-1)
    fill = torch.minimum(n_expand, free // cost)
    wanted = (can_expand & (node_scores > 0)).sum(-1)
    unpaid = (wanted - fill).clamp(min=0)
    swaps = torch.minimum(unpaid, can_collapse.sum(-1))
    left = free - fill * cost  # below one expansion's cost whenever anything is unpaid
    by_drops = torch.minimum(unpaid - swaps, (left + can_drop.sum(-1)) // cost)
    drops = (by_drops * cost - left).clamp(min=0)
    expand = top_by_priority(can_expand, node_scores, fill + swaps + by_drops)
    collapse = top_by_priority(can_collapse, -group_score, swaps)
    drop = top_by_priority(can_drop, -node_scores, drops)
    after = collapsed((shown & ~expand) | nodes.children_of(expand), collapse, nodes) & ~drop
    return restored(after, nodes)


def droppable(shown: Bool[Tensor, "r nodes"], nodes: NodeTable) -> Bool[Tensor, "r nodes"]:
    """The shown gists a drop can leave out: eligible LODmax gists."""
    return shown & nodes.droppable_entry(torch.arange(nodes.layout.n_nodes, device=shown.device))


def restored(shown: Bool[Tensor, "r nodes"], nodes: NodeTable) -> Bool[Tensor, "r nodes"]:
    """``shown`` with as many left-out blocks as its free budget allows shown again as LODmax gists, newest first."""
    free = (nodes.layout.W - shown.sum(-1)).clamp(min=0)
    absent = nodes.left_out(shown)
    return shown | top_by_priority(absent, nodes.start.float(), torch.minimum(free, absent.sum(-1)))


@typechecked
def shrink(
    shown: Bool[Tensor, "r nodes"],
    node_scores: Float[Tensor, "r nodes"],
    nodes: NodeTable,
) -> Bool[Tensor, "r nodes"]:
    """Collapse the ``ceil(excess / (K - 1))`` complete groups with the lowest mean score, whatever its sign,
    in every row over ``W``; rows within ``W`` are unchanged. A row with fewer complete groups than that
    collapses all it has and stays over: a further call may find the groups those collapses completed."""
    cost = nodes.layout.K - 1
    needed = ((shown.sum(-1) - nodes.layout.W).clamp(min=0) + cost - 1) // cost
    candidates = nodes.collapsible(shown)
    count = torch.minimum(needed, candidates.sum(-1))
    return collapsed(shown, top_by_priority(candidates, -nodes.group_reduce(node_scores, "mean"), count), nodes)


def collapsed(shown: Tensor, parents: Tensor, nodes: NodeTable) -> Tensor:
    """``shown [r, nodes]`` with each chosen parent (a complete group's) in place of its ``K`` children."""
    return (shown & ~nodes.children_of(parents)) | parents


@typechecked
def node_scores_of(
    entry_scores: Float[Tensor, "r w"], node: Tensor, valid: Tensor, n_nodes: int
) -> Float[Tensor, "r nodes"]:
    """Scatter per-entry scores onto node ids (padding goes to a dropped extra slot)."""
    index = torch.where(valid, node, n_nodes)
    out = entry_scores.new_zeros(entry_scores.size(0), n_nodes + 1)
    return out.scatter(1, index, entry_scores)[:, :n_nodes]
