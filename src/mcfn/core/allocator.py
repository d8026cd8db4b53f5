"""The focus allocator: from LensNet scores and a working context, a new working context within ``W``.

It works on the shown-node mask ``[R, n_nodes]`` of a cut through the tree, and one call is one
refocus step, fixed-shape and vectorized. Scores are compared with each other, never with a fixed
threshold: a LensNet trained on pairwise preferences ranks entries well while its zero point drifts,
and a rule that waits for a sign would leave truncation out of reach whenever old text scores, say,
-0.05 and the gists next to the tail -0.8.

1. **Expansions** are candidates among the shown gists (LOD ≥ 1). Each turns one entry into its ``K``
   children and costs ``K - 1`` entries.
2. **Collapses** are candidates among the complete groups: a parent whose ``K`` children are all shown and
   which is eligible (never over the tail). Each turns ``K`` entries into one and frees ``K - 1``. A group
   is scored by its **best** child: collapsing it gives up that child's detail too.
3. **Drops** are candidates among the shown eligible LODmax gists outside the groups collapsed: each leaves its
   span out of the context and frees one entry.
4. The free budget is filled first, with the highest-scoring expansions, whatever their sign. Then the
   i-th best expansion that does not fit is paid for by the i-th lowest collapse while it scores higher;
   what is still unpaid, by drops: an expansion is taken while it scores higher than every one of the
   ``K - 1`` lowest remaining drops that pay for it. The count never exceeds ``W``.
5. **Restores**: budget still free after that (less than one expansion, or nothing left to expand) shows
   left-out text again, each time the largest droppable node whose text is out, newest first: the budget is
   used as fully as the tree allows.

No two actions touch the same node: the expansions taken rank above every collapse and drop paid, and a
group or a block of drops scores at least as high as any candidate inside it, so a node that is both
expanded and paid would have to score higher than itself. The expansions paid for by drops exclude the
children of the groups collapsed, and the drops exclude the gists expanded and the groups collapsed. The
result is again a cut, its text covered exactly once or left out in the spans of droppable gists, with the
tail at LOD0 (I8). From the coarsest cut, repeated steps reach truncation whenever LensNet scores old text below
recent gists.

:func:`shrink` brings a cut that grew past ``W`` (a streaming context carried over to a longer history,
its new tokens at LOD0) back within it, by collapses alone.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
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
    cost = nodes.layout.K - 1
    # Hidden nodes' scores are never read: candidates are shown gists and complete groups of shown children.
    can_expand = shown & (nodes.lod > 0)
    can_collapse = nodes.collapsible(shown)
    group_score = nodes.group_reduce(node_scores, "amax")
    free = nodes.budget - shown.sum(-1)
    fill = torch.minimum(can_expand.sum(-1), free // cost)

    best_first = ranked(can_expand, node_scores, nodes, descending=True)
    rank = torch.arange(best_first.size(-1), device=shown.device)
    swaps = (at(best_first, fill[:, None] + rank, -torch.inf) > ranked(can_collapse, group_score, nodes)).sum(-1)
    expand = top_gists(can_expand, node_scores, fill + swaps, nodes)
    collapse = top_gists(can_collapse, -group_score, swaps, nodes)

    unpaid = can_expand & ~expand & ~nodes.children_of(collapse)
    can_drop = shown & nodes.droppable & ~expand & ~nodes.children_of(collapse)
    left = free - fill * cost  # below one expansion's cost whenever anything is unpaid
    highest_paid = at(ranked(can_drop, node_scores, nodes), (rank[None] + 1) * cost - left[:, None] - 1, torch.inf)
    by_drops = (ranked(unpaid, node_scores, nodes, descending=True) > highest_paid).sum(-1)
    expand = expand | top_gists(unpaid, node_scores, by_drops, nodes)
    drop = top_gists(can_drop, -node_scores, (by_drops * cost - left).clamp(min=0), nodes)
    after = collapsed((shown & ~expand) | nodes.children_of(expand), collapse, nodes) & ~drop
    return restored(after, nodes)


def ranked(candidates: Tensor, scores: Tensor, nodes: NodeTable, descending: bool = False) -> Float[Tensor, "r gists"]:
    """Per row, the candidates' scores sorted (lowest first, or highest first), candidates being gists (levels
    ``1..L``, whose slots alone it sorts); the other slots come last, as ``+inf`` (lowest first) or ``-inf``, so that
    no comparison takes them."""
    blank = -torch.inf if descending else torch.inf
    return torch.where(gists(candidates, nodes), gists(scores, nodes), blank).sort(-1, descending=descending).values


def top_gists(candidates: Tensor, priority: Tensor, count: Tensor, nodes: NodeTable) -> Bool[Tensor, "r nodes"]:
    """:func:`~mcfn.core.variants.top_by_priority` where every candidate is a gist. Every set the allocator ranks is
    one (expansions, collapses, drops and restores), so it sorts levels ``1..L`` alone: at ``K = 8`` an eighth of
    the nodes, where the tokens' slots made most of a refocus's sorting at 32k."""
    top = top_by_priority(gists(candidates, nodes), gists(priority, nodes), count)
    return torch.cat([torch.zeros_like(candidates[..., : candidates.size(-1) - top.size(-1)]), top], dim=-1)


def gists(x: Tensor, nodes: NodeTable) -> Tensor:
    """The gists' part (levels ``1..L``) of a ``[..., n_nodes]`` tensor: the tokens come first."""
    return x[..., nodes.layout.level_offsets[1] :]


def at(values: Tensor, index: Int[Tensor, "r m"], outside: float) -> Tensor:
    """``values[r, index]``, and ``outside`` where the index lies past either end."""
    inside = (index >= 0) & (index < values.size(-1))
    return torch.where(inside, values.gather(-1, index.clamp(0, values.size(-1) - 1)), outside)


def restored(shown: Bool[Tensor, "r nodes"], nodes: NodeTable) -> Bool[Tensor, "r nodes"]:
    """``shown`` with as much left-out text as its free budget allows shown again, newest first, each piece as the
    largest droppable node whose text is out (:meth:`NodeTable.left_out`)."""
    free = (nodes.budget - shown.sum(-1)).clamp(min=0)
    absent = nodes.left_out(shown)
    return shown | top_gists(absent, nodes.start.float(), torch.minimum(free, absent.sum(-1)), nodes)


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
    needed = ((shown.sum(-1) - nodes.budget).clamp(min=0) + cost - 1) // cost
    candidates = nodes.collapsible(shown)
    count = torch.minimum(needed, candidates.sum(-1))
    return collapsed(shown, top_gists(candidates, -nodes.group_reduce(node_scores, "mean"), count, nodes), nodes)


@typechecked
def coarsest_within_budget(scores: Float[Tensor, "1 nodes"], nodes: NodeTable) -> Bool[Tensor, "1 1 nodes"]:
    """The coarsest cut, and where a long history's coarsest cover is over budget, with its lowest-scoring top-level
    gists left out (ties: the oldest first) until it fits: which far text a refocus can read is the scores' choice,
    not the history's length (a view that started later instead could never read a pass key 8k tokens back)."""
    return left_out_to_budget(nodes.coarsest[None], scores, nodes)[None]


@typechecked
def left_out_to_budget(
    shown: Bool[Tensor, "1 nodes"], scores: Float[Tensor, "1 nodes"], nodes: NodeTable
) -> Bool[Tensor, "1 nodes"]:
    """``shown`` with as many of its shown top-level gists left out as it is over budget, the lowest-scoring first
    (ties: the oldest); unchanged within budget."""
    excess = (shown.sum(-1) - nodes.budget).clamp(min=0)
    return shown & ~top_gists(shown & nodes.droppable, -scores, excess, nodes)


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
