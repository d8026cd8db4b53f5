"""One chunk of generation's protocol, as the evaluation and the counterfactual traces both read it: the view that
generation lays over a history of ``n`` tokens (:func:`~mcfn.core.stream_view.stream_view`), the focus policies' refocus
in it (generation's own, :meth:`~mcfn.core.policy.FocusPolicy.refocus`), and the base model's NLL of the chunk's
predictions under any cut of the window.

A chunk at history ``n`` serves the predictions from position ``n - 1`` up to ``upto - 1``: its cut is chosen over
tokens ``[0, n)`` within ``W - R`` entries, and the tokens ``[n, upto)`` are read after it at LOD0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from torch import Tensor

from mcfn.core.context import WorkingContext, assemble, tail_entries
from mcfn.core.focus import Refocus
from mcfn.core.nodes import NodeTable
from mcfn.core.policy import FocusPolicy
from mcfn.core.stream_view import StreamView, stream_view, view_node_ids
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.core.variants import compressed_cuts, draw_variant_noise


@dataclass(frozen=True)
class ChunkView:
    """The view of ``g`` rows whose history is ``n`` tokens, read from their window's tree."""

    view: StreamView
    nodes: NodeTable  # the view's table
    window_nodes: NodeTable  # the window's, at the budget: what the chunk's predictions are scored under
    ids: Tensor  # [view_nodes]: each view node as a node id of the window's layout
    real: Tensor  # [view_nodes] bool: no phantom
    tree: Tree  # [g, view_nodes, D]
    window: Tensor  # [g, T_view + 1]
    n: int
    upto: int  # the chunk's last prediction reads up to token upto - 1
    every: int  # R: the tokens read after the cut

    @property
    def horizon(self) -> Tensor:
        """``[g]``: the newest real token, the last one a cut of this chunk may read (I11)."""
        return torch.full((self.window.size(0),), self.view.real - 1, device=self.window.device)

    def window_cut(self, view_cut: Tensor) -> Tensor:
        """A view's cut ``[..., view_nodes]`` as a cut of the window ``[..., nodes]``: its real entries (no
        phantom), then the tokens ``[n, upto)`` that generation would read after it at LOD0."""
        shown = torch.zeros(*view_cut.shape[:-1], self.window_nodes.layout.n_nodes, dtype=torch.bool,
                            device=view_cut.device)  # fmt: skip
        shown[..., self.ids] = self.real & view_cut
        shown[..., self.n : self.upto] = True  # LOD0 nodes are numbered first, by token
        return shown

    def random(self, count: int, rows: int, generator: torch.Generator) -> Tensor:
        """``[rows, count, view_nodes]``: random compressed cuts of the view."""
        nodes = self.nodes.with_sizes(N=count)
        return compressed_cuts(draw_variant_noise(nodes.layout, rows, generator, self.real.device), nodes)


def chunk_view(tree: Tree, window: Tensor, nodes: NodeTable, n: int, every: int) -> ChunkView:
    """The view of the rows of ``tree [g, n_nodes, D]`` and ``window [g, T + 1]`` (``nodes``: the window's layout at
    the budget) at history ``n``, refocused every ``every`` tokens."""
    layout = nodes.layout
    view = stream_view(n, layout, layout.W - every)
    ids = view_node_ids(view, layout, window.device)
    view_nodes = NodeTable.of(view.layout, window.device)
    view_tree = Tree(emb=tree.emb[:, ids], batch_size=[window.size(0)])
    view_window = window[:, view.origin : view.origin + view.layout.T + 1]
    upto = min(n + every - 1, layout.T)
    real = view_nodes.start < view.real
    return ChunkView(view, view_nodes, nodes, ids, real, view_tree, view_window, n, upto, every)


def refocus_rows(
    system: MegaContext,
    policy: FocusPolicy,
    tree: Tree,
    window: Tensor,
    view: StreamView,
    protocol: Refocus,
    carried: list[WorkingContext | None],
) -> tuple[Tensor, list[WorkingContext]]:
    """``policy``'s refocus of each row of the view (``tree [g, view_nodes, D]``, ``window [g, T + 1]``), the one
    generation calls (:meth:`~mcfn.core.policy.FocusPolicy.refocus`), warm from its ``carried`` context where the
    protocol says: the view's cuts ``[g, 1, view_nodes]``, and the contexts the next chunk carries."""
    cuts, contexts = [], []
    for i, previous in enumerate(carried):
        cut, context = policy.refocus(system, tree[i : i + 1], window[i : i + 1], view, protocol, previous)
        cuts.append(cut)
        contexts.append(context)
    return torch.cat(cuts), contexts


def chunk_predictions(
    system: MegaContext, tree: Tree, shown: Tensor, window: Tensor, cv: ChunkView
) -> tuple[Tensor, Tensor]:
    """NLL and argmax hits ``[g, S, k]`` of the chunk's ``k = upto - n + 1`` predictions from position ``n - 1`` on,
    for the ``S`` cuts ``shown [g, S, nodes]`` of the windows (``tree [g, n_nodes, D]``, ``window [g, T + 1]``),
    each ending with the tokens ``[n - 1, upto)``."""
    base, n, upto = system.base, cv.n, cv.upto
    k = upto - n + 1
    wc = assemble(tree, shown, window, cv.window_nodes)
    first = wc.valid.sum(-1) - k  # the last k valid entries are the tokens n - 1 .. upto - 1
    h = tail_entries(base.hidden(wc.emb, wc.position, wc.span.float()), first, k)
    targets = repeat(window[:, n : upto + 1], "g k -> (g s) k", s=shown.size(1))
    nll, hit = base.nll(h, targets), base.logits(h).argmax(-1) == targets
    return tuple(rearrange(x, "(g s) k -> g s k", g=shown.size(0)) for x in (nll, hit))
