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
  pick among each chunk's cuts (:mod:`mcfn.evaluation.headroom`), and ``lens_rank_corr`` compares LensNet's preference
  with each chunk's measured gap;
* ``lens_nogist``: the ``lens`` cuts read with every gist zeroed;
* with ``oracle`` (:mod:`mcfn.evaluation.oracle`), ``oracle_attn``, ``oracle_match``, ``horizon_attn``,
  ``draft_attn`` and ``draft_match``: cuts scored by full attention, of the chunk's own queries (which break I11 by
  design), of those up to its horizon, or of the chunk's with the model's own draft in place of its tokens
  (the last two read every history token at LOD0), and ``match`` reading that draft.

Nothing that chooses a chunk's cut reads anything after its horizon (I11, per chunk), but ``oracle_attn`` and
``oracle_match``. ``full`` is unchanged.

Each chunk's context is read in one forward, as generation reads it with its cache refilled in full
(``--reuse prefix``); generation's default keeps the cached entries a refocus still shows at their new slots, whose
upper layers read the context they were written in: :mod:`mcfn.evaluation.reuse` (``train.reuse``) measures the
difference on text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from einops import rearrange, repeat
from torch import Tensor

from mcfn.core.context import WorkingContext, assemble, seen_until
from mcfn.core.nodes import NodeTable
from mcfn.core.policy import LENS, Choice, FocusPolicy
from mcfn.core.preferences import pair_margin, pair_slots
from mcfn.core.stream_view import StreamView, refocus_budget
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.core.variants import recent_cut
from mcfn.evaluation.batch import EvalBatch
from mcfn.evaluation.chunks import ChunkView, chunk_predictions, chunk_view, refocus_rows
from mcfn.evaluation.counterfactual import label_edits, lens_view_scores, utility_corr
from mcfn.evaluation.indexer_recall import tail_attention
from mcfn.evaluation.one_cut import NOGIST, Predictions, stacked
from mcfn.evaluation.oracle import ORACLES, ChunkOracle, chunk_oracle, oracle_rows


@dataclass
class ChunkedPredictions(Predictions):
    """The tail predictions of one batch at one budget, each chunk of ``R`` from its own cuts, and those cuts; a
    policy on a rule of its own refocuses in chunks of its own (``chunks``)."""

    cuts: dict[str, list[list[Tensor]]] = field(kw_only=True)  # per focus condition, per row, each chunk's cut [nodes]
    chunks: dict[str, Tensor] = field(kw_only=True, default_factory=dict)  # [B, H] per policy on its own rule

    def chunk_of(self, name: str) -> Tensor:
        """``[B, H]``: each tail column's refocus under condition ``name`` (-1: unscored)."""
        return self.chunks.get(name, self.chunk)

    def refocus_counts(self) -> dict[str, Tensor]:
        """Per refocusing condition, the refocuses ``[B]`` each window made (its chunks)."""
        return {name: self.chunk_of(name).amax(-1) + 1 for name in self.cuts}


@dataclass(frozen=True)
class Chunk:
    """One chunk's predictions for the rows whose history is ``n`` tokens, and the cuts the focus conditions chose."""

    slots: dict[str, slice]  # each condition's contexts among the S
    nll: Tensor  # [g, S, k]: the k = min(R, T - n + 1) predictions after the horizon n - 1
    hit: Tensor  # [g, S, k] bool
    preference: Tensor | None  # [g, P]: LensNet's preference between every pair of the chunk's random cuts
    contexts: dict[str, list[WorkingContext]]  # per focus condition, per row: what the next refocus carries (warm)
    cuts: dict[str, Tensor]  # per focus condition: [g, nodes] each row's cut as a cut of the whole window
    utility: Tensor | None = None  # [g]: with ``batch.utility``, each row's utility_corr at this chunk


def predict_chunked(batch: EvalBatch, budget: int, generator: torch.Generator) -> ChunkedPredictions:
    """Every condition's tail predictions ``[B, S, H]`` at ``budget`` under generation's protocol; LensNet's edits
    are labelled (``batch.utility``) at the headline budget only, the one the LensNet stage trains at."""
    if budget != batch.settings.budgets[0]:
        batch = dataclasses.replace(batch, utility=False)
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
    utility = torch.full((B, n_chunks), torch.nan, dtype=torch.float64)
    settings = batch.settings
    own = [p for p in settings.policies(system) if p.refocuses and not settings.on_grid(p)]
    grid = [p for p in settings.policies(system) if p not in own and p.choice is not Choice.FULL]  # full: a reference
    focuses = [policy.name for policy in grid if policy.refocuses]
    attention = None
    if batch.settings.oracle:  # the oracles read each chunk's own queries' full attention
        focuses += ORACLES
        attention = tail_attention(system.base, window, layout, before=R)  # and the R queries ahead of the tail
    previous: dict[str, list[WorkingContext | None]] = {name: [None] * B for name in focuses}
    cuts: dict[str, list[list[Tensor]]] = {name: [[] for _ in range(B)] for name in focuses}
    for c in range(n_chunks if grid or settings.oracle else 0):
        at = horizon + c * R
        for n in sorted(set((at[at < T] + 1).tolist())):
            rows = torch.nonzero(at + 1 == n).flatten()
            carried = {name: [previous[name][row] for row in rows.tolist()] for name in focuses}
            oracle = None
            if attention is not None:
                oracle = chunk_oracle(system.base, attention[rows], window[rows], chunk[rows], c, n, R, layout)
            part = predict_chunk(batch, rows, n, nodes, generator, carried, oracle, grid)
            if slots is None:
                slots = part.slots
                nll = torch.zeros(B, part.nll.size(1), H, device=device)
                hit = torch.zeros(B, part.nll.size(1), H, dtype=torch.bool, device=device)
            columns = n - 1 - (T - H) + torch.arange(part.nll.size(-1), device=device)
            nll[rows[:, None], :, columns[None]] = rearrange(part.nll, "g s k -> g k s")
            hit[rows[:, None], :, columns[None]] = rearrange(part.hit, "g s k -> g k s")
            if part.preference is not None:
                preference[rows, c] = part.preference
            if part.utility is not None:
                utility[rows.cpu(), c] = part.utility
            for name, contexts in part.contexts.items():
                for i, row in enumerate(rows.tolist()):
                    previous[name][row] = contexts[i]
                    cuts[name][row].append(part.cuts[name][i])
    if nll is None:  # no condition on the shared clock: every policy on a rule of its own, no oracle
        slots, nll, hit = {}, torch.zeros(B, 0, H, device=device), torch.zeros(B, 0, H, dtype=torch.bool, device=device)
    chunks = {}
    for policy in own:  # each on its own rule: a column of its own
        part = predict_cadenced(batch, budget, policy)
        slots[policy.name] = slice(nll.size(1), nll.size(1) + 1)
        nll, hit = torch.cat([nll, part.nll[:, None]], 1), torch.cat([hit, part.hit[:, None]], 1)
        chunks[policy.name], cuts[policy.name] = part.chunk, part.cuts
    with_lens = system.lensnet is not None and not batch.settings.brief  # the random cuts' preferences
    return ChunkedPredictions(
        nll,
        hit,
        slots,
        chunk,
        preference if with_lens else None,
        utility if batch.utility else None,
        cuts=cuts,
        chunks=chunks,
    )


@dataclass(frozen=True)
class Cadenced:
    """One policy's tail predictions under a refocus rule of its own, and where it refocused."""

    nll: Tensor  # [B, H]
    hit: Tensor  # [B, H] bool
    chunk: Tensor  # [B, H] int64: each tail column's refocus, -1 where unscored
    cuts: list[list[Tensor]]  # per row, each refocus's cut of the window [nodes]


def predict_cadenced(batch: EvalBatch, budget: int, policy: FocusPolicy) -> Cadenced:
    """``policy``'s tail predictions at ``budget`` under its rule (:meth:`EvalSettings.rule_of`), as generation
    computes them: each row refocuses at its first scored prediction, then whenever its
    :class:`~mcfn.core.cadence.RefocusWatch` (the one generation asks) says, fed the window's tokens one at a time,
    and each refocus's cut serves the predictions up to the next. Rows that refocus at the same history are read
    together."""
    system, window, horizon = batch.system, batch.window, batch.horizon
    layout, rule = system.layout, batch.settings.rule_of(policy)
    T, H = layout.T, layout.H
    B, device = window.size(0), window.device
    nodes = batch.nodes(budget)
    refocus_budget(nodes.layout, rule.every)
    nll = torch.zeros(B, H, device=device)
    hit = torch.zeros(B, H, dtype=torch.bool, device=device)
    chunk = torch.full((B, H), -1, dtype=torch.int64, device=device)
    due = (horizon + 1).tolist()  # each row's next refocus: the history it is chosen over
    tokens = window.tolist()
    watches = [rule.watch(tokens[row][: due[row]]) for row in range(B)]
    previous: list[WorkingContext | None] = [None] * B
    cuts: list[list[Tensor]] = [[] for _ in range(B)]
    while pending := [n for n in due if n <= T]:
        n = min(pending)
        rows = [row for row in range(B) if due[row] == n]
        index = torch.tensor(rows, device=device)
        cv = chunk_view(batch.tree[index], window[index], nodes, n, rule.every)
        view_cuts, contexts = refocus_rows(
            system, policy, cv.tree, cv.window, cv.view, rule, [previous[row] for row in rows]
        )
        shown = cv.window_cut(view_cuts)
        part_nll, part_hit = chunk_predictions(system, batch.tree[index], shown, window[index], cv)
        for i, row in enumerate(rows):
            watch = watches[row]
            watch.refocused(contexts[i])
            # The cut serves the predictions from n - 1 up to the token after which the next refocus is due.
            due[row] = next((t + 1 for t in range(n, min(cv.upto, T - 1) + 1) if watch.due(tokens[row][t])), T + 1)
            served = due[row] - n  # at most the chunk's k = upto - n + 1 predictions
            columns = slice(n - 1 - (T - H), n - 1 - (T - H) + served)
            nll[row, columns], hit[row, columns] = part_nll[i, 0, :served], part_hit[i, 0, :served]
            chunk[row, columns] = len(cuts[row])
            previous[row] = contexts[i]
            cuts[row].append(shown[i, 0])
    return Cadenced(nll, hit, chunk, cuts)


def predict_chunk(
    batch: EvalBatch,
    rows: Tensor,
    n: int,
    nodes: NodeTable,
    generator: torch.Generator,
    carried: dict[str, list[WorkingContext | None]],
    oracle: ChunkOracle | None = None,
    policies: list[FocusPolicy] | None = None,
) -> Chunk:
    """One chunk for the ``rows`` whose history is ``n`` tokens: every condition's predictions of the tokens after
    the horizon ``n - 1``; the focus conditions refocus warm from the contexts ``carried`` (per row; ``None``: cold).
    With ``oracle`` (what the chunk's oracles read), they refocus too (:mod:`mcfn.evaluation.oracle`).
    With ``batch.utility``, each row's LensNet cut is also labelled edit by edit
    (:mod:`mcfn.evaluation.counterfactual`). ``policies``: the conditions on the shared clock (by default every one
    of the settings')."""
    system, tree, window = batch.system, batch.tree[rows], batch.window[rows]
    protocol, M, brief = batch.settings.protocol, batch.settings.random_contexts, batch.settings.brief
    cv, g = chunk_view(tree, window, nodes, n, protocol.every), rows.numel()
    parts: dict[str, Tensor] = {}
    contexts: dict[str, list[WorkingContext]] = {}
    view_cuts: dict[str, Tensor] = {}
    for policy in batch.settings.policies(system) if policies is None else policies:
        if policy.refocuses:  # truncation and the scored policies: generation's refocus
            view_cuts[policy.name], contexts[policy.name] = refocus_rows(
                system, policy, cv.tree, cv.window, cv.view, protocol, carried[policy.name]
            )
            parts[policy.name] = cv.window_cut(view_cuts[policy.name])
        elif policy.choice is Choice.FIXED:
            parts[policy.name] = cv.window_cut(recent_cut(cv.view.layout, window.device)).expand(g, 1, -1)
        elif policy.choice is Choice.RANDOM:
            random_view = cv.random(M, g, generator)
            parts[policy.name] = cv.window_cut(random_view)
    if oracle is not None:
        oracle_cuts, oracle_contexts = oracle_rows(system, cv, protocol, oracle, carried)
        view_cuts.update(oracle_cuts)
        contexts.update(oracle_contexts)
        parts.update({name: cv.window_cut(cut) for name, cut in oracle_cuts.items()})
    shown, slots = stacked(parts)
    nll, hit = chunk_predictions(system, tree, shown, window, cv)
    preference, utility = None, None
    if system.lensnet is not None and not brief:
        ablated = chunk_predictions(system, batch.nogist[rows], parts[LENS.name], window, cv)
        slots[NOGIST] = slice(shown.size(1), shown.size(1) + 1)
        nll, hit = torch.cat([nll, ablated[0]], 1), torch.cat([hit, ablated[1]], 1)
        preference = random_preferences(system, cv.tree, random_view, cv.window, cv.nodes, cv.view)
        if batch.utility:
            utility = edit_correlations(system, tree, window, cv, view_cuts[LENS.name][:, 0])
    cuts = {name: parts[name][:, 0] for name in contexts}
    return Chunk(slots, nll, hit, preference, contexts, cuts, utility)


def edit_correlations(system: MegaContext, tree: Tree, window: Tensor, cv: ChunkView, policy: Tensor) -> Tensor:
    """``[g]``: per row, the Spearman correlation of LensNet's predicted worth of each edit of its cut ``policy
    [g, view_nodes]`` with the edit's measured ΔNLL (:func:`~mcfn.evaluation.counterfactual.utility_corr`)."""
    scores = lens_view_scores(system, cv)
    corr = []
    for i in range(policy.size(0)):
        labelled = label_edits(system, tree[i : i + 1], window[i : i + 1], cv, policy[i], scores[i])
        corr.append(utility_corr(labelled, scores[i]))
    return torch.tensor(corr, dtype=torch.float64)


def random_preferences(
    system: MegaContext, tree: Tree, random: Tensor, window: Tensor, nodes: NodeTable, view: StreamView
) -> Tensor:
    """LensNet's preference ``[g, P]`` between every pair of a chunk's random cuts, read up to the horizon (I11)."""
    M = random.size(1)
    wc = assemble(tree, random, window, nodes.with_sizes(N=M))
    i, j = pair_slots(M, random.size(0), random.device)
    seen = seen_until(wc, torch.full((wc.batch_size[0],), view.real - 1, device=random.device))
    tokens = repeat(window[:, : nodes.layout.T], "g t -> (g m) t", m=M)
    return pair_margin(
        system.lensnet(seen, layout=nodes.layout, tokens=tokens, base=system.base), random, i, j, wc, nodes
    )
