"""The static shape of MegaContext and the tree's rules: sizes, per-node metadata, levels, groups, collapses.

Nodes are numbered level by level: LOD0 tokens ``0..T-1``, then the ``T/K`` LOD1 gists, then the
``T/K²`` LOD2 gists, and so on. A LODk node ``j`` covers ``[j·K^k, (j+1)·K^k)`` (I1), and its parent is
LOD(k+1) node ``j // K``; a parent's **group** is its ``K`` children.

A node is **eligible** when its span ends before the tail ``[T-H, T)``: only eligible gists can be
shown (I4), so only they are ever computed. At each level the eligible nodes are a prefix.

A cut may **leave text out**: an eligible LODmax gist can be *dropped* (the block's text is then not in the
working context at all, coarser than any gist, I7) and a left-out block can be *restored* as its LODmax gist.
So truncation, and every cut between it and full coverage, is a cut (when ``T - W`` is a multiple of
``K^L``, the recency baseline itself).

Every rule about the tree that the variants, the allocator, LensNet's targets and its budget term need
lives in :class:`NodeTable`, so they cannot drift apart (I6, I8): a collapse needs a complete group of
``K`` shown siblings whose parent is eligible; a drop needs a shown eligible gist of a droppable level.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.config import RunConfig
from mcfn.geometry import coarsest_cover_size


@dataclass(frozen=True)
class Layout:
    T: int  # tokens of history per sample
    K: int  # children per gist
    L: int  # highest level of detail
    W: int  # working-context capacity
    H: int  # supervised tail, LOD0 in every variant
    N: int  # compressed variants per sample
    # Nodes per level (T / K^k) and where each level begins in the node numbering: computed once, since dynamo traces
    # a property's Python at every read, and the choice's graph reads them thousands of times.
    level_sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    level_offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = tuple(self.T // self.K**k for k in range(self.L + 1))
        object.__setattr__(self, "level_sizes", sizes)
        object.__setattr__(self, "level_offsets", tuple(itertools.accumulate(sizes[:-1], initial=0)))

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Layout:
        mc = cfg.mc
        return cls(
            T=cfg.data.seq_len,
            K=mc.block_size,
            L=mc.lod_max,
            W=mc.budget,
            H=mc.tail,
            N=mc.variants,
        )

    @property
    def V(self) -> int:  # variants per sample, the recency baseline first
        return self.N + 1

    @property
    def n_nodes(self) -> int:
        return sum(self.level_sizes)

    @property
    def eligible_counts(self) -> tuple[int, ...]:
        """Eligible nodes per level (a prefix of each level); every token is eligible."""
        return (self.T,) + tuple((self.T - self.H) // self.K**k for k in range(1, self.L + 1))

    @property
    def top_span(self) -> int:
        """Tokens under one top-level (LODmax) gist."""
        return self.K**self.L

    @property
    def coarsest_cover(self) -> int:
        return coarsest_cover_size(self.T, self.K, self.L, self.H)

    @property
    def block_view_width(self) -> int:
        """Entries of :attr:`NodeTable.block_view`: every eligible LOD1 gist and the tokens none of them covers."""
        blocks = self.eligible_counts[1]
        return blocks + self.T - blocks * self.K


_NOT_PER_NODE = ("layout", "budget_given")


@dataclass(frozen=True)
class NodeTable:
    """Per-node metadata of a :class:`Layout`, each field ``[n_nodes]``, and the rules of the tree.

    The tensors depend on ``T``, ``K``, ``L`` and ``H`` only; ``layout`` also carries the budget ``W`` and
    the variant count ``N`` of whoever uses the table (:meth:`with_sizes` changes them). A fixed-shape refocus
    (:meth:`fixed`) gives the tail and the budget as tensors instead, so that one graph serves every view of a shape.
    """

    layout: Layout
    lod: Tensor  # int64
    start: Tensor  # int64: first token covered
    span: Tensor  # int64: K**lod
    parent: Tensor  # int64: the parent's node id; -1 at the top level
    eligible: Tensor  # bool: a token, or a gist that ends before the tail
    budget_given: Tensor | None = None  # int64 []: the budget, where :meth:`fixed` gives it as a tensor

    @classmethod
    def of(cls, layout: Layout, device: torch.device | None = None) -> NodeTable:
        lod, start, span, parent = [], [], [], []
        for k, size in enumerate(layout.level_sizes):  # built where it is used: a refocus builds one or two
            j = torch.arange(size, device=device)
            lod.append(torch.full((size,), k, device=device))
            start.append(j * layout.K**k)
            span.append(torch.full((size,), layout.K**k, device=device))
            up = layout.level_offsets[k + 1] + j // layout.K if k < layout.L else torch.full_like(j, -1)
            parent.append(up)
        lod, start, span, parent = (torch.cat(parts) for parts in (lod, start, span, parent))
        eligible = (lod == 0) | (start + span <= layout.T - layout.H)
        return cls(layout, lod, start, span, parent, eligible)

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_PER_NODE}

    def fixed(self, tail_start: Int[Tensor, ""], budget: Int[Tensor, ""]) -> NodeTable:
        """The same tree with the tail starting at token ``tail_start`` and the budget ``budget``, both tensors:
        a layout padded to a fixed shape (:mod:`mcfn.inference.choice`) whose ``H`` and ``W`` change at every
        refocus, so that neither is a constant of its graph. Every rule reads them from here (:attr:`budget`,
        :attr:`eligible`)."""
        eligible = (self.lod == 0) | (self.start + self.span <= tail_start)
        return dataclasses.replace(self, eligible=eligible, budget_given=budget)

    @property
    def budget(self) -> int | Tensor:
        """The most entries a cut may show: the layout's ``W``, or the tensor :meth:`fixed` gave."""
        return self.layout.W if self.budget_given is None else self.budget_given

    def with_sizes(self, **sizes: int) -> NodeTable:
        """The same tree for another budget ``W`` or variant count ``N``."""
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, **sizes))

    @property
    def coarsest(self) -> Bool[Tensor, " nodes"]:
        """The coarsest cut that covers ``[0, T)`` with the tail at LOD0 (nothing left out, no spare budget spent):
        every eligible node whose parent is not (eligibility holds for a parent only if for all its children)."""
        parent_eligible = (self.parent >= 0) & self.eligible[self.parent.clamp(min=0)]
        return self.eligible & ~parent_eligible

    def level(self, x: Tensor, k: int) -> Tensor:
        """The part of a ``[..., n_nodes]`` tensor that belongs to level ``k``."""
        lo = self.layout.level_offsets[k]
        return x[..., lo : lo + self.layout.level_sizes[k]]

    def groups(self, x: Tensor, k: int) -> Tensor:
        """Level ``k`` of a ``[..., n_nodes]`` tensor as ``[..., parents, K]``: each level-``k+1`` node's children."""
        return rearrange(self.level(x, k), "... (n k) -> ... n k", k=self.layout.K)

    def group_reduce(self, x: Tensor, reduce: str, empty: float | bool = 0) -> Tensor:
        """``[..., n_nodes]``: per node, ``reduce`` ("mean", "amax", "all") over its ``K`` children; ``empty``
        for tokens, which have none."""
        parts = [torch.full_like(self.level(x, 0), empty)]
        parts += [getattr(self.groups(x, k - 1), reduce)(-1) for k in range(1, self.layout.L + 1)]
        return torch.cat(parts, dim=-1)

    def children_of(self, chosen: Tensor) -> Tensor:
        """``[..., n_nodes]``: the children of every chosen node (chosen tokens have none)."""
        K, L = self.layout.K, self.layout.L
        parts = [self.level(chosen, k + 1).repeat_interleave(K, dim=-1) for k in range(L)]
        return torch.cat([*parts, torch.zeros_like(self.level(chosen, L))], dim=-1)

    def complete_groups(self, shown: Bool[Tensor, "*rows nodes"]) -> Bool[Tensor, "*rows nodes"]:
        """Per node, whether a cut shows all ``K`` of its children (False for tokens)."""
        return self.group_reduce(shown, "all", empty=False)

    def collapsible(self, shown: Bool[Tensor, "*rows nodes"]) -> Bool[Tensor, "*rows nodes"]:
        """The parents a collapse can restore: all ``K`` children shown, and eligible (never over the tail)."""
        return self.complete_groups(shown) & self.eligible

    def legal_collapse(self, node: Int[Tensor, "*rows w"], collapsible: Bool[Tensor, "*rows nodes"]) -> Tensor:
        """Per entry (node ids ``[..., w]``), whether it may take part in a collapse in its row: as one of a
        group, below LODmax, when its parent is ``collapsible`` there (``[..., n_nodes]``, the same leading
        dimensions), or on its own as a **drop** (:meth:`droppable_entry`: its span is then left out)."""
        return self.legal_group_collapse(node, collapsible) | self.droppable_entry(node)

    def legal_group_collapse(self, node: Int[Tensor, "*rows w"], collapsible: Bool[Tensor, "*rows nodes"]) -> Tensor:
        """Per entry, whether it is below LODmax and its parent is ``collapsible`` in its row."""
        parent = self.parent[node].clamp(min=0)
        return (self.lod[node] < self.layout.L) & collapsible.gather(-1, parent)

    def droppable_entry(self, node: Tensor) -> Tensor:
        """Per entry, whether it is an eligible gist that a cut may leave out: a top-level (LODmax) one."""
        return (self.lod[node] == self.layout.L) & self.eligible[node]

    @property
    def droppable(self) -> Bool[Tensor, " nodes"]:
        """Per node, whether a cut may leave it out (:meth:`droppable_entry` of every node id)."""
        return self.droppable_entry(torch.arange(self.layout.n_nodes, device=self.lod.device))

    def covered_inside(self, shown: Bool[Tensor, "*rows nodes"]) -> Bool[Tensor, "*rows nodes"]:
        """Per node, whether a cut shows the node itself or anything inside its span."""
        levels = [self.level(shown, 0)]
        for k in range(1, self.layout.L + 1):
            below = rearrange(levels[-1], "... (n k) -> ... n k", k=self.layout.K).any(-1)
            levels.append(below | self.level(shown, k))
        return torch.cat(levels, dim=-1)

    def covered_above(self, shown: Bool[Tensor, "*rows nodes"]) -> Bool[Tensor, "*rows nodes"]:
        """Per node, whether a cut shows one of its ancestors (then the node's text is in the cut, coarser)."""
        above = torch.zeros_like(self.level(shown, self.layout.L))
        levels = [above]
        for k in range(self.layout.L - 1, -1, -1):
            above = (above | self.level(shown, k + 1)).repeat_interleave(self.layout.K, dim=-1)
            levels.insert(0, above)
        return torch.cat(levels, dim=-1)

    def left_out(self, shown: Bool[Tensor, "*rows nodes"]) -> Bool[Tensor, "*rows nodes"]:
        """The largest droppable nodes whose text a cut leaves out (a ``[..., n_nodes]`` mask): what a restore
        shows. A node's text is out when neither it, nor anything inside it, nor an ancestor is shown; it is the
        largest such node when it is top-level or its parent's span has something shown inside it."""
        inside = self.covered_inside(shown)
        out = ~inside & ~self.covered_above(shown)
        parent_inside = inside.gather(-1, self.parent.clamp(min=0).expand_as(inside))
        largest = (self.lod == self.layout.L) | parent_inside
        return out & largest & self.droppable

    @property
    def block_view(self) -> Bool[Tensor, " nodes"]:
        """The one view every node is scored from (:func:`mcfn.core.focus.focus_scores`): each eligible LOD1 gist,
        and as tokens the text no eligible LOD1 gist covers (the tail, and a stream's newest partial block)."""
        blocks = (self.lod == 1) & self.eligible
        return blocks | ((self.lod == 0) & ~self.covered_above(blocks))

    def spread_block_scores(self, scores: Float[Tensor, "*rows nodes"]) -> Float[Tensor, "*rows nodes"]:
        """Every node's score from the :attr:`block_view`'s: a token takes its eligible LOD1 block's (its own
        where none covers it), a gist above LOD1 the best of its children's. A complete group then scores as its
        parent at every level, so one set of scores ranks every expansion, collapse and drop the same way from
        any cut, and repeated allocator steps settle instead of trading the same detail back and forth."""
        K = self.layout.K
        blocks = self.level(scores, 1)
        in_view = self.level(self.block_view, 0)  # tokens no eligible LOD1 gist covers keep their own score
        levels = [torch.where(in_view, self.level(scores, 0), blocks.repeat_interleave(K, dim=-1)), blocks]
        for _ in range(2, self.layout.L + 1):
            levels.append(rearrange(levels[-1], "... (n k) -> ... n k", k=K).amax(-1))
        return torch.cat(levels, dim=-1)

    def legal_expand(self, node: Int[Tensor, "*rows w"]) -> Tensor:
        """Per entry, whether it may be expanded: a gist (a token has no children)."""
        return self.lod[node] > 0
