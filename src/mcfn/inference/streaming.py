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
import torch.nn.functional as F
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
    layout, origin = view.layout if capacity is None else capacity, view.origin
    parts = []
    for k, size in enumerate(layout.level_sizes):
        level, first = stream.levels[k], origin // layout.K**k
        rows = level.data[first : min(first + size, level.length)]  # one slice of the buffer: a refocus's operators
        parts.append(F.pad(rows, (0, 0, 0, size - rows.size(0))))
    window = F.pad(stream.tokens.data[origin : len(stream)], (0, layout.T + 1 - view.real))
    return Tree(emb=torch.cat(parts)[None], batch_size=[1]), window[None]


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
