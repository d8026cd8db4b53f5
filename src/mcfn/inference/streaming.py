"""MegaContext over an unbounded stream: a tree that grows as tokens arrive, refocused within ``W``.

* :class:`StreamingTree` keeps every token id, its embedding and every complete gist. A LOD1 gist is
  built by GistNet the moment its block of ``K`` tokens completes, a LOD2 gist when its ``K`` LOD1
  gists are complete, and so on (one batched GistNet call per level per append).
* :func:`focused_context` builds a focus policy's working context over the whole history ``[0, n)`` (or its most
  recent part, once even the coarsest full cover would not fit) by the one refocus path,
  :meth:`mcfn.core.policy.FocusPolicy.refocus`, the procedure ``train.eval`` scores: truncation, or a scored
  policy's cut cold from the coarsest one or warm from the previous context carried over, so that a refocus where
  little has changed keeps most of the previous context (and the cache behind it).

The static machinery needs a history whose length is a multiple of ``K^L``: the view rounds it up with
*phantom* tokens after the newest one (:func:`mcfn.core.stream_view.stream_view`). They sit in the tail, so no gist ever
covers them, the budget is raised by their count so that they cost nothing, and they are dropped from the context
before it is used.
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.focus import Refocus
from mcfn.core.nodes import Layout
from mcfn.core.policy import FocusPolicy
from mcfn.core.stream_view import StreamView, stream_view
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree


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
                level.append(self.system.gistnet(children, level=k))


def view_tree(stream: StreamingTree, view: StreamView, capacity: Layout | None = None) -> tuple[Tree, Tensor]:
    """The view's node embeddings ``[1, n_nodes, D]`` (zeros for phantoms and incomplete gists) and its
    token window ``[1, T + 1]`` (phantoms are token 0; nothing reads their targets), laid in its own layout or in
    ``capacity``, a longer one from the same origin (:mod:`mcfn.inference.choice`)."""
    return LaidView(stream)(view, capacity)


class LaidView:
    """:func:`view_tree` of one stream, kept from one refocus to the next: while the layout's length and the view's
    origin stay, each row is written once, when it arrives (the stream only appends), instead of the whole tree
    copied at every refocus (at 32k: 1.9 ms a refocus laid whole, 0.05 ms written as rows arrive; LABLOG, fortieth
    session). Where the origin moves on at the same length, the rows kept are copied down into a second pair of
    buffers kept for it (:meth:`_moved_on`). The tensors it returns are its buffers, written in place at later
    calls."""

    def __init__(self, stream: StreamingTree):
        self.stream = stream
        self.laid_for: tuple[int, int] | None = None  # (T, origin) of the buffers
        self.emb, self.window = torch.empty(0), torch.empty(0, dtype=torch.int64)
        self.spare = (self.emb, self.window)  # the other pair of the same shape, once the origin has moved on
        self.written: list[int] = []  # per level, then the tokens: the rows written, from the view's first

    def __call__(self, view: StreamView, capacity: Layout | None = None) -> tuple[Tree, Tensor]:
        stream, layout, origin = self.stream, view.layout if capacity is None else capacity, view.origin
        if self.laid_for is not None and self.laid_for[0] == layout.T and origin > self.laid_for[1]:
            self._moved_on(layout, origin)
        elif self.laid_for != (layout.T, origin):
            self.laid_for, self.written = (layout.T, origin), [0] * (layout.L + 2)
            self.emb = stream.levels[0].data.new_zeros(1, layout.n_nodes, stream.levels[0].data.size(1))
            self.window = stream.tokens.data.new_zeros(1, layout.T + 1)
            self.spare = (torch.empty(0), torch.empty(0, dtype=torch.int64))
        sources = [*stream.levels, stream.tokens]
        places = zip(sources, self._firsts(layout, origin), self._targets(layout), strict=True)
        for k, (rows, first, target) in enumerate(places):
            end = min(rows.length - first, target.size(0))  # the rows of the view there are now
            if end > self.written[k]:
                target[self.written[k] : end] = rows.data[first + self.written[k] : first + end]
                self.written[k] = end
        return Tree(emb=self.emb, batch_size=[1]), self.window

    def _moved_on(self, layout: Layout, origin: int) -> None:
        """The buffers for ``origin``, later than the laid one at the same length: each part's rows that stay in the
        view copied down from the current pair into the spare one (allocated at the first move, then reused), the
        rest zeroed, and the pairs swapped. Laying them afresh instead (new zeroed pages, every row written again)
        cost 26 ms at 32k whenever the origin moved: once every ``K^L`` tokens decoded there (LABLOG, forty-first
        session)."""
        if self.spare[0].shape != self.emb.shape:
            self.spare = (torch.empty_like(self.emb), torch.empty_like(self.window))
        old, new = self._targets(layout), self._targets(layout, *self.spare)
        was = self._firsts(layout, self.laid_for[1])
        moves = zip(self._firsts(layout, origin), was, old, new, strict=True)
        for k, (first, before, source, target) in enumerate(moves):
            kept = max(0, self.written[k] - (first - before))
            target[:kept] = source[first - before : first - before + kept]
            target[kept:] = 0
            self.written[k] = kept
        self.spare, (self.emb, self.window) = (self.emb, self.window), self.spare
        self.laid_for = (layout.T, origin)

    def _firsts(self, layout: Layout, origin: int) -> list[int]:
        """Each level's first row in the view from ``origin``, then the first token's."""
        return [origin // layout.K**k for k in range(layout.L + 1)] + [origin]

    def _targets(self, layout: Layout, emb: Tensor | None = None, window: Tensor | None = None) -> list[Tensor]:
        """Where each level's rows go in ``emb`` (by default the current buffer), then the tokens in ``window``."""
        emb, window = self.emb if emb is None else emb, self.window if window is None else window
        levels = zip(layout.level_offsets, layout.level_sizes, strict=True)
        return [emb[0, at : at + n] for at, n in levels] + [window[0]]


@torch.no_grad()
def focused_context(
    system: MegaContext,
    stream: StreamingTree,
    budget: int,
    policy: FocusPolicy,
    protocol: Refocus,
    previous: WorkingContext | None = None,
) -> WorkingContext:
    """A working context ``[1, m]`` (valid entries only, ``m <= budget``) over the stream's history: ``policy``'s
    refocus (:meth:`~mcfn.core.policy.FocusPolicy.refocus`, the one the evaluation calls; generation calls this for
    truncation, and :class:`~mcfn.inference.choice.FocusChoice` for a scored policy) in the view of its
    newest tokens, warm from ``previous`` (this function's last answer for a shorter history) where ``protocol``
    says. Positions and starts are absolute token positions."""
    view = stream_view(len(stream), system.layout, budget)
    tree, window = view_tree(stream, view)
    return policy.refocus(system, tree, window, view, protocol, previous)[1]
