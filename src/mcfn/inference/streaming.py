"""MegaContext over an unbounded stream: a tree that grows as tokens arrive, refocused within ``W``.

* :class:`StreamingTree` keeps every token id, its embedding and every complete gist. A LOD1 gist is
  built by GistNet the moment its block of ``K`` tokens completes, a LOD2 gist when its ``K`` LOD1
  gists are complete, and so on (one batched GistNet call per level per append).
* :func:`focused_context` builds a working context over the whole history ``[0, n)`` (or its most recent
  part, once even the coarsest full cover would not fit): it lays the static training machinery over the
  history, with the last ``H`` to ``H + K - 1`` tokens as the LOD0 tail, scores every node once with LensNet
  (:func:`~mcfn.core.system.focus_scores`), starts from the coarsest cut and settles it with the allocator,
  the procedure ``train.eval`` scores as ``lens``. Given the previous context instead, it starts warm: that
  context with the tokens that arrived since at LOD0 (:func:`carried_cut`), shrunk back within budget by
  collapsing the lowest-scoring groups (:func:`shrink_to_budget`) and settled with the same scores, so that a
  refocus where little has changed keeps most of the previous context (and the cache behind it).

The static machinery needs a history whose length is a multiple of ``K^L``: the view rounds it up with
*phantom* tokens after the newest one. They sit in the tail, so no gist ever covers them, the budget is
raised by their count so that they cost nothing, and they are dropped from the context before it is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.allocator import shrink
from mcfn.core.context import WorkingContext, assemble
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.system import MegaContext, focus_scores, settle
from mcfn.core.tree import Tree
from mcfn.core.variants import coarsest_cut
from mcfn.typecheck import typechecked


class GrowingRows:
    """Rows appended at the end of a buffer that doubles its capacity when full."""

    def __init__(self, width: int | None, dtype: torch.dtype, device: torch.device):
        shape = (16,) if width is None else (16, width)
        self.data, self.length = torch.zeros(shape, dtype=dtype, device=device), 0

    def append(self, rows: Tensor) -> None:
        need = self.length + rows.size(0)
        if need > self.data.size(0):
            grown = self.data.new_zeros((max(need, 2 * self.data.size(0)), *self.data.shape[1:]))
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : need] = rows
        self.length = need

    @property
    def rows(self) -> Tensor:
        return self.data[: self.length]


class StreamingTree:
    """Token ids, token embeddings and the complete gists of every level, for one stream."""

    def __init__(self, system: MegaContext, device: torch.device):
        self.system, self.layout = system, system.layout
        dim = system.base.cfg.n_embd
        self.tokens = GrowingRows(None, torch.int64, device)
        self.levels = [GrowingRows(dim, torch.float32, device) for _ in range(self.layout.L + 1)]

    def __len__(self) -> int:
        return self.tokens.length

    @torch.no_grad()
    def append(self, ids: Int[Tensor, " n"]) -> None:
        """Add tokens; build every gist whose block they complete, level by level."""
        K = self.layout.K
        self.tokens.append(ids)
        self.levels[0].append(self.system.base.embed(ids[None])[0])
        for k in range(1, self.layout.L + 1):
            below, level = self.levels[k - 1], self.levels[k]
            complete = below.length // K
            if complete > level.length:
                first, dim = level.length * K, below.data.size(1)
                children = below.rows[first : complete * K].view(-1, K, dim)
                features = self.features(first, complete * K) if k == 1 else None
                by_block = None if features is None else features.view(-1, K, dim)
                level.append(self.system.gistnet(children, level=k, features=by_block))

    def features(self, first: int, end: int) -> Tensor | None:
        """What LOD1's GistNet reads for tokens ``[first, end)``: ``None`` (their embeddings) unless the gists
        come from the base model's hidden states, which it computes here, each top-level block read on its own
        from its start as in training (:func:`mcfn.core.tree.block_hidden`)."""
        if not self.system.gist_from_hidden:
            return None
        top, parts = self.layout.top_span, []
        for block_start in range(first // top * top, end, top):
            tokens = self.tokens.rows[block_start : min(block_start + top, end)]
            hidden = self.system.base.token_hidden(tokens[None])[0]
            parts.append(hidden[max(first - block_start, 0) :])
        return torch.cat(parts)


@dataclass(frozen=True)
class StreamView:
    """Where the static layout lies over the stream: tokens ``[origin, origin + layout.T)``, of which the
    ones from ``origin + real`` on are phantoms."""

    layout: Layout
    origin: int
    real: int


def stream_view(n: int, layout: Layout, budget: int) -> StreamView:
    """The layout over a history of ``n`` tokens, or over its most recent part that ``budget`` entries can
    cover: past about ``budget·K^L`` tokens even the coarsest cover is too big, and the oldest top-level
    gists are dropped, ``K^L`` tokens at a time."""
    K, top = layout.K, layout.top_span
    tail_start = max(0, (n - layout.H) // K * K)

    def fitted(origin: int) -> tuple[Layout, int]:
        real = n - origin
        T = -(-real // top) * top
        H = T - (tail_start - origin)
        phantoms = T - real
        view = dataclasses.replace(layout, T=T, H=H, W=min(budget + phantoms, T), N=0)
        return view, view.coarsest_cover - phantoms

    origin = 0
    view, cover = fitted(origin)
    while cover > budget and origin + top <= tail_start:
        origin += top
        view, cover = fitted(origin)
    return StreamView(view, origin, n - origin)


def view_tree(stream: StreamingTree, view: StreamView) -> tuple[Tree, Tensor]:
    """The view's node embeddings ``[1, n_nodes, D]`` (zeros for phantoms and incomplete gists) and its
    token window ``[1, T + 1]`` (phantoms are token 0; nothing reads their targets)."""
    layout, origin = view.layout, view.origin
    parts = []
    for k, size in enumerate(layout.level_sizes):
        first = origin // layout.K**k
        rows = stream.levels[k].rows[first : first + size]
        parts.append(F.pad(rows, (0, 0, 0, size - rows.size(0))))
    window = F.pad(stream.tokens.rows[origin:], (0, layout.T + 1 - view.real))
    return Tree(emb=torch.cat(parts)[None], batch_size=[1]), window[None]


@typechecked
def carried_cut(previous: WorkingContext, view: StreamView, nodes: NodeTable) -> Bool[Tensor, "1 1 nodes"] | None:
    """The shown-node mask ``[1, 1, n_nodes]`` of the view that keeps ``previous`` (a ``[1, m]`` context from
    :func:`focused_context`, absolute starts) and shows every later token at LOD0, phantoms included; entries
    before the view's origin drop out, and the blocks ``previous`` left out come back as LODmax gists, so
    that LensNet judges them again. It may exceed the view's budget by the tokens that arrived and those
    gists. ``nodes`` is the view's table. ``None`` when ``previous`` cannot be carried: it ends before the origin."""
    layout = view.layout
    start, lod = previous.start[0] - view.origin, previous.lod[0]
    end = int(start[-1] + previous.span[0, -1])  # the first token ``previous`` did not cover
    if end < 0:
        return None
    offsets = torch.tensor(layout.level_offsets, device=start.device)
    kept = start >= 0
    node = offsets[lod[kept]] + start[kept] // layout.K ** lod[kept]
    shown = torch.zeros(layout.n_nodes, dtype=torch.bool, device=start.device)
    shown[node] = True
    shown[end : layout.T] = True  # LOD0 nodes are numbered first, by token
    return (shown | nodes.left_out(shown))[None, None]


@typechecked
def shrink_to_budget(
    cut: Bool[Tensor, "1 1 nodes"], scores: Float[Tensor, "1 nodes"], nodes: NodeTable
) -> Bool[Tensor, "1 1 nodes"] | None:
    """A carried cut ``[1, 1, n_nodes]`` (over budget by the new tokens) brought within budget by
    :func:`~mcfn.core.allocator.shrink` with the view's ``scores``, repeated while each call still frees room;
    ``None`` if it cannot get within budget."""
    shown, size = cut[0], int(cut.sum())
    while size > nodes.layout.W:
        shown = shrink(shown, scores, nodes)
        size, before = int(shown.sum()), size
        if size == before:
            return None
    return shown[None]


@torch.no_grad()
def focused_context(
    system: MegaContext, stream: StreamingTree, budget: int, steps: int, previous: WorkingContext | None = None
) -> WorkingContext:
    """A working context ``[1, m]`` (valid entries only, ``m <= budget``) over the stream's history, ``steps``
    allocator steps from the coarsest cut, or with ``previous`` (this function's last answer for a shorter
    history) from that context brought within budget (:func:`shrink_to_budget`): a warm start. Positions and
    starts are absolute token positions."""
    view = stream_view(len(stream), system.layout, budget)
    layout = view.layout
    tree, window = view_tree(stream, view)
    nodes = NodeTable.of(layout, window.device)
    horizon = torch.tensor([view.real - 1], device=window.device)  # LensNet reads every real token, no phantom
    cut = None
    scores = None if system.lensnet is None else focus_scores(system, tree, window, nodes, horizon)
    if scores is not None and previous is not None:
        carried = carried_cut(previous, view, nodes)
        cut = None if carried is None else shrink_to_budget(carried, scores, nodes)
    if cut is None:
        cut = coarsest_cut(layout, window.device)[None, None]
    if scores is not None:
        cut = settle(cut, scores, nodes, steps)
    wc = assemble(tree, cut, window, nodes)[0]
    keep = wc.valid & (wc.start < view.real)
    m = int(keep.sum())
    wc = wc[:m]
    wc.start += view.origin
    wc.position += view.origin
    return wc[None]
