"""The evaluation under generation's protocol: what ``train.generate`` computes, under teacher forcing.

Generation refocuses every ``R = mc.refocus_every`` tokens (:mod:`mcfn.core.focus`): the cut is chosen over the
history up to the newest token within ``W - R`` entries, and the next ``R`` tokens are read after it at LOD0. Here
the scored predictions are split into **chunks** of ``R``: chunk ``c`` starts at horizon ``h_c = h + cR`` (``h``,
the first scored prediction's position) and its predictions ``h_c .. h_c + R - 1`` come from the cut chosen over
tokens ``[0, h_c]`` followed by the tokens ``h_c + 1 .. h_c + R - 1`` (teacher-forced in place of decoded ones).
Every condition that chooses a cut chooses it per chunk, in the view that generation lays over that history:

* ``attn``, ``match`` and ``lens`` call :func:`~mcfn.core.focus.focus_cut`, the function generation calls: the
  first chunk cold from the coarsest cut (``refocus`` allocator steps), every later one warm from the previous
  chunk's context (``warm_steps``), as generation starts its first refocus and its later ones;
* ``recency``: the newest ``W - R`` tokens, so that both sides predict the same targets from as many entries;
* ``recent`` (the fixed rule) and ``random`` (``M`` random cuts): the view's own, per chunk; the best-of conditions
  pick among each chunk's cuts (:mod:`mcfn.tools.headroom`), and ``lens_rank_corr`` compares LensNet's preference
  with each chunk's measured gap;
* ``lens_nogist``: the ``lens`` cuts read with every gist zeroed.

Nothing that chooses a chunk's cut reads anything after its horizon (I11, per chunk). ``full`` is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from einops import rearrange, repeat
from torch import Tensor

from mcfn.core.context import WorkingContext, assemble, seen_until, tail_entries
from mcfn.core.focus import Refocus, StreamView, focus_cut, refocus_budget, stream_view, view_context, view_node_ids
from mcfn.core.match import match_scorer
from mcfn.core.nodes import NodeTable
from mcfn.core.preferences import pair_margin, pair_slots
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.core.variants import compressed_cuts, draw_variant_noise, recent_cut
from mcfn.tools.attention import attention_scores
from mcfn.tools.eval_batch import EvalBatch
from mcfn.tools.one_cut import Predictions, stacked

FOCUSES = ("attn", "match", "lens")  # the conditions that refocus with focus_cut


@dataclass
class ChunkedPredictions(Predictions):
    """The tail predictions of one batch at one budget, each chunk of ``R`` from its own cuts, and those cuts."""

    cuts: dict[str, list[list[Tensor]]]  # per focus condition, per row, each chunk's full-window cut [nodes]


def focus_scorer(system: MegaContext, name: str, window: Tensor, view: StreamView, reach: int):
    """The scorer of focus condition ``name`` for one row's view ``window [1, T + 1]`` (``None``: LensNet's)."""
    if name == "attn":
        return partial(attention_scores, system.base, system.layout.H)
    if name == "match":
        return match_scorer(window[:, : view.layout.T], view.layout.K, reach, view.layout.T)
    return None


def full_cut(view_cut: Tensor, real: Tensor, ids: Tensor, nodes: NodeTable, n: int, upto: int) -> Tensor:
    """A view's cut ``[..., view_nodes]`` as a cut of the window ``[..., nodes]``: its real entries (``real
    [view_nodes]``: no phantom), then the tokens ``[n, upto)`` that generation would read after it at LOD0."""
    real = real & view_cut
    shown = torch.zeros(*view_cut.shape[:-1], nodes.layout.n_nodes, dtype=torch.bool, device=view_cut.device)
    shown[..., ids] = real
    shown[..., n:upto] = True  # LOD0 nodes are numbered first, by token
    return shown


def recency_of(nodes: NodeTable, n: int, upto: int, budget: int, rows: int) -> Tensor:
    """``[rows, 1, nodes]``: the newest ``budget`` tokens before ``n``, then the tokens ``[n, upto)``."""
    node = torch.arange(nodes.layout.n_nodes, device=nodes.lod.device)
    return ((node >= max(0, n - budget)) & (node < upto)).expand(rows, 1, -1)


@dataclass(frozen=True)
class Chunk:
    """One chunk's predictions for the rows whose history is ``n`` tokens, and the cuts the focus conditions chose."""

    slots: dict[str, slice]  # each condition's contexts among the S
    nll: Tensor  # [g, S, k]: the k = min(R, T - n + 1) predictions after the horizon n - 1
    hit: Tensor  # [g, S, k] bool
    preference: Tensor | None  # [g, P]: LensNet's preference between every pair of the chunk's random cuts
    contexts: dict[str, list[WorkingContext]]  # per focus condition, per row: what the next refocus carries (warm)
    cuts: dict[str, Tensor]  # per focus condition: [g, nodes] each row's cut as a cut of the whole window


def predict_chunked(batch: EvalBatch, budget: int, generator: torch.Generator) -> ChunkedPredictions:
    """Every condition's tail predictions ``[B, S, H]`` at ``budget`` under generation's protocol."""
    system, window, horizon = batch.system, batch.window, batch.horizon
    layout = system.layout
    T, H, R = layout.T, layout.H, batch.settings.refocus_every
    B, device = window.size(0), window.device
    nodes = batch.nodes(budget)
    refocus_budget(nodes.layout, R)
    first = horizon - (T - H)  # the first scored tail column per row
    column = torch.arange(H, device=device)
    chunk = torch.where(column[None] >= first[:, None], (column[None] - first[:, None]) // R, -1)
    n_chunks = int(chunk.max()) + 1
    M = batch.settings.random_contexts
    slots, nll, hit = None, None, None
    preference = torch.zeros(B, n_chunks, M * (M - 1) // 2, device=device)
    previous: dict[str, list[WorkingContext | None]] = {name: [None] * B for name in FOCUSES}
    cuts: dict[str, list[list[Tensor]]] = {name: [[] for _ in range(B)] for name in FOCUSES}
    for c in range(n_chunks):
        at = horizon + c * R
        for n in sorted(set((at[at < T] + 1).tolist())):
            rows = torch.nonzero(at + 1 == n).flatten()
            carried = {name: [previous[name][row] for row in rows.tolist()] for name in FOCUSES}
            part = predict_chunk(batch, rows, n, nodes, generator, carried)
            if slots is None:
                slots = part.slots
                nll = torch.zeros(B, part.nll.size(1), H, device=device)
                hit = torch.zeros(B, part.nll.size(1), H, dtype=torch.bool, device=device)
            columns = n - 1 - (T - H) + torch.arange(part.nll.size(-1), device=device)
            nll[rows[:, None], :, columns[None]] = rearrange(part.nll, "g s k -> g k s")
            hit[rows[:, None], :, columns[None]] = rearrange(part.hit, "g s k -> g k s")
            if part.preference is not None:
                preference[rows, c] = part.preference
            for name, contexts in part.contexts.items():
                for i, row in enumerate(rows.tolist()):
                    previous[name][row] = contexts[i]
                    cuts[name][row].append(part.cuts[name][i])
    return ChunkedPredictions(nll, hit, slots, chunk, preference if system.lensnet is not None else None, cuts)


def predict_chunk(
    batch: EvalBatch,
    rows: Tensor,
    n: int,
    nodes: NodeTable,
    generator: torch.Generator,
    carried: dict[str, list[WorkingContext | None]],
) -> Chunk:
    """One chunk for the ``rows`` whose history is ``n`` tokens: every condition's predictions of the tokens after
    the horizon ``n - 1``; the focus conditions refocus warm from the contexts ``carried`` (per row; ``None``: cold)."""
    system, tree, window = batch.system, batch.tree, batch.window
    protocol, M = batch.settings.protocol, batch.settings.random_contexts
    layout, R = nodes.layout, protocol.every
    budget, upto = layout.W - R, min(n + R - 1, layout.T)
    view = stream_view(n, layout, budget)
    ids = view_node_ids(view, layout, window.device)
    view_nodes = NodeTable.of(view.layout, window.device)
    real = view_nodes.start < view.real
    view_tree = Tree(emb=tree.emb[rows][:, ids], batch_size=[rows.numel()])
    view_window = window[rows, view.origin : view.origin + view.layout.T + 1]
    parts: dict[str, Tensor] = {
        "recency": recency_of(nodes, n, upto, budget, rows.numel()),
        "recent": full_cut(recent_cut(view.layout, window.device), real, ids, nodes, n, upto).expand(
            rows.numel(), 1, -1
        ),
    }
    noise = draw_variant_noise(view_nodes.with_sizes(N=M).layout, rows.numel(), generator, window.device)
    random_view = compressed_cuts(noise, view_nodes.with_sizes(N=M))
    parts["random"] = full_cut(random_view, real, ids, nodes, n, upto)
    contexts: dict[str, list[WorkingContext]] = {}
    for name in FOCUSES if system.lensnet is not None else FOCUSES[:-1]:
        view_cuts, contexts[name] = refocus_rows(system, name, view_tree, view_window, view, protocol, carried[name])
        parts[name] = full_cut(view_cuts, real, ids, nodes, n, upto)
    shown, slots = stacked(parts)
    nll, hit = chunk_predictions(system, tree[rows], shown, window[rows], nodes, n, upto)
    preference = None
    if system.lensnet is not None:
        ablated = chunk_predictions(system, batch.nogist[rows], parts["lens"], window[rows], nodes, n, upto)
        slots["lens_nogist"] = slice(shown.size(1), shown.size(1) + 1)
        nll, hit = torch.cat([nll, ablated[0]], 1), torch.cat([hit, ablated[1]], 1)
        preference = random_preferences(system, view_tree, random_view, view_window, view_nodes, view)
    cuts = {name: parts[name][:, 0] for name in contexts}
    return Chunk(slots, nll, hit, preference, contexts, cuts)


def refocus_rows(
    system: MegaContext,
    name: str,
    tree: Tree,
    window: Tensor,
    view: StreamView,
    protocol: Refocus,
    carried: list[WorkingContext | None],
) -> tuple[Tensor, list[WorkingContext]]:
    """Focus condition ``name``'s refocus of each row of the view (``tree [g, view_nodes, D]``, ``window [g, T + 1]``),
    warm from its ``carried`` context where there is one: the view's cuts ``[g, 1, view_nodes]``, and the contexts
    the next chunk carries."""
    cuts, contexts = [], []
    for i, prior in enumerate(carried):
        one_tree, one_window = tree[i : i + 1], window[i : i + 1]
        scorer = focus_scorer(system, name, one_window, view, protocol.every)
        warm = prior if protocol.warm_steps else None
        steps = protocol.steps if warm is None else protocol.warm_steps
        cut = focus_cut(system.lensnet, one_tree, one_window, view, steps, warm, scorer)
        contexts.append(view_context(one_tree, cut, one_window, view))
        cuts.append(cut)
    return torch.cat(cuts), contexts


def chunk_predictions(
    system: MegaContext, tree: Tree, shown: Tensor, window: Tensor, nodes: NodeTable, n: int, upto: int
) -> tuple[Tensor, Tensor]:
    """NLL and argmax hits ``[g, S, k]`` of the ``k = upto - n + 1`` predictions from position ``n - 1`` on, for the
    ``S`` cuts ``shown [g, S, nodes]`` (each ending with the tokens ``[n - 1, upto)``)."""
    base, k = system.base, upto - n + 1
    wc = assemble(tree, shown, window, nodes)
    first = wc.valid.sum(-1) - k  # the last k valid entries are the tokens n - 1 .. upto - 1
    h = tail_entries(base.hidden(wc.emb, wc.position, wc.span.float()), first, k)
    targets = repeat(window[:, n : upto + 1], "g k -> (g s) k", s=shown.size(1))
    nll, hit = base.nll(h, targets), base.logits(h).argmax(-1) == targets
    return tuple(rearrange(x, "(g s) k -> g s k", g=shown.size(0)) for x in (nll, hit))


def random_preferences(
    system: MegaContext, tree: Tree, random: Tensor, window: Tensor, nodes: NodeTable, view: StreamView
) -> Tensor:
    """LensNet's preference ``[g, P]`` between every pair of a chunk's random cuts, read up to the horizon (I11)."""
    M = random.size(1)
    wc = assemble(tree, random, window, nodes.with_sizes(N=M))
    i, j = pair_slots(M, random.size(0), random.device)
    seen = seen_until(wc, torch.full((wc.batch_size[0],), view.real - 1, device=random.device))
    tokens = repeat(window[:, : nodes.layout.T], "g t -> (g m) t", m=M)
    return pair_margin(system.lensnet(seen, layout=nodes.layout, tokens=tokens), random, i, j, wc, nodes)
