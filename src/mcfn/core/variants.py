"""Working-context variants: which tree nodes each of the ``V = 1 + N`` variants of a sample shows.

* Variant 0 is the **recency baseline**: the last ``W`` tokens at LOD0 and nothing older.
* Variants ``1..N`` are **compressed**: cuts through the tree in at most ``W`` entries with the tail at
  LOD0 (I2, I3, I4). Each starts from the coarsest cut, leaves out a random subset of the eligible
  top-level blocks (none to all but what the budget can fill with detail; each frees one entry), and
  spends the spare budget on expansions, top level first: at each level above LOD1 it expands a random share of
  what it could afford, among its shown nodes in a random order; at LOD1 it expands as many as still
  fit. So
  variants of a sample use about the same budget and differ in *where* the detail goes (which
  blocks are tokens, which are LOD1, which LOD2): their tail losses say where detail pays.

The randomness comes in as :class:`VariantNoise`, drawn by the caller on the device with a seeded
torch generator: :func:`sample_variants` is a pure function of it (I9), and it compiles to one graph
with no host sync. A cut is a set of *expanded* nodes; a node is shown when its parent is expanded
(top-level nodes: always) and it is not. Nodes that overlap the tail are always expanded.
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Bool, Float
from tensordict import TensorClass
from torch import Tensor

from mcfn.core.nodes import Layout, NodeTable
from mcfn.typecheck import typechecked


class VariantNoise(TensorClass):
    """Uniform noise for the compressed variants of a batch (batch_size ``[B, N]``)."""

    priority: Tensor  # [B, N, n_nodes]: expansion order among a level's shown nodes (higher first)
    # [B, N, L]: share of the affordable expansions taken at each level above LOD1 (LOD1's column is drawn, so that
    # the other draws stay those of the runs before, and unused: LOD1 expands as many as fit)
    share: Tensor
    explore: Tensor  # [B, N, I, n_nodes]: standard normal exploration noise for I allocator iterations
    leave_out: Tensor  # [B, N]: where between none and the most a variant may leave out its left-out count lies
    # [B, N]: a random variant whose draw lies below mc.voted_share expands the blocks match votes on first
    # (:func:`voted_first`); drawn last, so that the other draws stay those of the runs before
    prefer: Tensor


def draw_variant_noise(
    layout: Layout,
    batch: int,
    generator: torch.Generator,
    device: torch.device,
    alloc_iterations: int = 1,
) -> VariantNoise:
    """The noise of a batch: ``N`` variants per window, ``alloc_iterations`` exploration draws per variant."""
    shape = (batch, layout.N)
    priority = torch.rand(*shape, layout.n_nodes, generator=generator, device=device)
    share = torch.rand(*shape, layout.L, generator=generator, device=device)
    explore = torch.randn(*shape, alloc_iterations, layout.n_nodes, generator=generator, device=device)
    leave_out = torch.rand(*shape, generator=generator, device=device)
    prefer = torch.rand(*shape, generator=generator, device=device)
    return VariantNoise(priority=priority, share=share, explore=explore, leave_out=leave_out, prefer=prefer,
                        batch_size=list(shape))  # fmt: skip


@typechecked
def voted_nodes(votes: Float[Tensor, "b blocks"], layout: Layout) -> Bool[Tensor, "b nodes"]:
    """The nodes whose span holds a block that ``votes`` (``[B, T/K]``, one per LOD1 block: ``match``'s copy votes)
    is positive on: the block's tokens, the block, and every gist above it."""
    levels = [votes > 0]
    for _ in range(2, layout.L + 1):
        levels.append(rearrange(levels[-1], "b (n k) -> b n k", k=layout.K).any(-1))
    return torch.cat([levels[0].repeat_interleave(layout.K, dim=-1), *levels], dim=-1)


@typechecked
def voted_first(noise: VariantNoise, voted: Bool[Tensor, "b nodes"], share: float) -> VariantNoise:
    """Priority sampling: the noise with the priority of every voted node raised above every other's, in the
    variants whose ``prefer`` draw lies below ``share``; such a variant expands the text a copy would read first,
    at every level, and leaves it out last. The others, and the order among voted nodes, stay random: they explore."""
    preferred = rearrange(noise.prefer < share, "b n -> b n 1") & rearrange(voted, "b nodes -> b 1 nodes")
    return noise.replace(priority=noise.priority + preferred.float())


def top_by_priority(candidates: Tensor, priority: Tensor, count: Tensor) -> Tensor:
    """Per row, the ``count`` candidates with the highest priority (``count`` at most the candidates)."""
    keyed = torch.where(candidates, priority, float("-inf"))
    order = torch.argsort(keyed, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.size(-1), device=order.device).expand_as(order)
    )
    return candidates & (ranks < count.unsqueeze(-1))


@typechecked
def compressed_cuts(noise: VariantNoise, nodes: NodeTable) -> Bool[Tensor, "b n nodes"]:
    """Shown-node masks of the ``N`` compressed variants. Each leaves out the lowest-priority eligible
    top-level blocks, as many as ``leave_out`` picks uniformly between none and :func:`most_left_out`, and
    spends the spare budget ``W - coarsest`` plus the entries the left-out blocks freed."""
    layout, priority, share = nodes.layout, noise.priority, noise.share
    rows = priority.shape[:-1]
    top_eligible = nodes.level(nodes.eligible, layout.L).expand(*rows, -1)
    n_left_out = (noise.leave_out * (most_left_out(layout) + 1)).floor().long().clamp(max=most_left_out(layout))
    left_out = top_by_priority(top_eligible, -nodes.level(priority, layout.L), n_left_out)
    slack = layout.W - layout.coarsest_cover + n_left_out
    cost = layout.K - 1  # entries an expansion adds
    expanded: dict[int, Tensor] = {}
    parent_expanded = ~left_out  # the top level's "parent" is the whole history, minus what is left out
    shown_levels: dict[int, Tensor] = {}
    for k in range(layout.L, 0, -1):
        eligible = nodes.level(nodes.eligible, k)
        candidates = parent_expanded & eligible
        affordable = torch.minimum(candidates.sum(-1), slack // cost)
        # LOD1 expands as many as fit; a level above a random share of what it can afford.
        take = affordable if k == 1 else (share[..., k - 1] * (affordable + 1)).floor().long().clamp(max=affordable)
        chosen = top_by_priority(candidates, nodes.level(priority, k), take)
        slack = slack - take * cost
        expanded[k] = chosen | (parent_expanded & ~eligible)  # nodes overlapping the tail are always expanded
        shown_levels[k] = parent_expanded & ~expanded[k]
        parent_expanded = expanded[k].repeat_interleave(layout.K, dim=-1)
    shown_levels[0] = parent_expanded
    return torch.cat([shown_levels[k] for k in range(layout.L + 1)], dim=-1)


def most_left_out(layout: Layout) -> int:
    """How many top-level blocks a compressed variant may leave out: all eligible ones but those that the
    budget beyond the tail can fill with detail, so that no variant wastes its budget."""
    top = layout.top_span
    kept = -(-(layout.W - layout.H) // top)
    return max(0, layout.eligible_counts[layout.L] - kept)


def coarsest_cut(layout: Layout, device: torch.device) -> Tensor:
    """``[n_nodes]``: the coarsest cut that covers ``[0, T)`` with the tail at LOD0 (no spare budget spent,
    nothing left out): :attr:`NodeTable.coarsest`."""
    return NodeTable.of(layout, device).coarsest


def recent_cut(layout: Layout, device: torch.device) -> Tensor:
    """``[n_nodes]``: the training-free structured cut ``recent``: from the coarsest cut, expand the newest
    shown gist while an expansion fits. Detail thus grows back from the tail, level by level, and every block
    keeps at least its coarsest gist: truncation's raw tokens, less what covering the rest costs. Eager code
    (a loop of at most ``W / (K - 1)`` steps), computed by the evaluation for every batch and budget."""
    nodes = NodeTable.of(layout, device)
    shown = coarsest_cut(layout, device).clone()
    end = nodes.start + nodes.span
    while layout.W - int(shown.sum()) >= layout.K - 1:
        gists = shown & (nodes.lod > 0)
        if not bool(gists.any()):
            break
        newest = int(torch.where(gists, end, -1).argmax())
        shown[newest] = False
        shown |= nodes.parent == newest
    return shown


@typechecked
def recency_cut(layout: Layout, batch: int, device: torch.device, real: int | None = None) -> Bool[Tensor, "b 1 nodes"]:
    """Truncation, ``[batch, 1, n_nodes]``: the newest tokens at LOD0 that the budget holds, and nothing older. Of a
    training window, tokens ``[T - W, T)``; of a streaming view whose tokens from ``real`` on are phantoms (its ``W``
    raised by their count, :func:`~mcfn.core.stream_view.stream_view`), ``[T - W, real)``: the newest
    ``W - (T - real)``."""
    node = torch.arange(layout.n_nodes, device=device)
    shown = (node < (layout.T if real is None else real)) & (node >= layout.T - layout.W)
    return shown.expand(batch, 1, layout.n_nodes)


@typechecked
def sample_variants(noise: VariantNoise, nodes: NodeTable) -> Bool[Tensor, "b v nodes"]:
    """Shown-node masks ``[B, V, n_nodes]``: the recency baseline, then the ``N`` compressed variants."""
    batch = noise.batch_size[0]
    return torch.cat([recency_cut(nodes.layout, batch, noise.priority.device), compressed_cuts(noise, nodes)], dim=1)
