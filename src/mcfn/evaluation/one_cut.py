"""The evaluation's earlier protocol, kept beside generation's for comparison: one cut for all ``H`` tail predictions
(``R = H``), chosen at the first scored prediction's position. Generation refocuses every ``R`` tokens instead
(:mod:`mcfn.evaluation.refocused`); under one cut nothing a policy may read beat truncation on natural text, because
which far text a tail will copy is mostly not legible from before it (LABLOG has the measurements)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.context import WorkingContext, assemble, seen_until, tail_entries
from mcfn.core.focus import refocus
from mcfn.core.model import GPT
from mcfn.core.nodes import NodeTable
from mcfn.core.policy import LENS, RANDOM, Choice
from mcfn.core.preferences import pair_margin, pair_slots
from mcfn.core.step import split_window
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.core.variants import compressed_cuts, draw_variant_noise, recency_cut, recent_cut
from mcfn.evaluation.batch import EvalBatch
from mcfn.typecheck import typechecked

NOGIST = f"{LENS.name}_nogist"  # the lens policy's cuts read with every gist zeroed: what the gists are worth


@typechecked
def tail_predictions(
    base: GPT, hidden: Float[Tensor, "r n d"], first: Int[Tensor, " r"], targets: Int[Tensor, "r h"]
) -> tuple[Float[Tensor, "r h"], Bool[Tensor, "r h"]]:
    """NLL and whether the argmax is right for the ``H`` entries of each row from ``first`` on (the tail)."""
    h = tail_entries(hidden, first, targets.size(1))
    return base.nll(h, targets), base.logits(h).argmax(-1) == targets


def context_predictions(
    system: MegaContext, tree: Tree, shown: Tensor, window: Tensor, nodes: NodeTable
) -> tuple[Tensor, Tensor, WorkingContext]:
    """Tail NLL and argmax hits ``[B, S, H]`` of the ``S`` working contexts ``shown [B, S, nodes]`` per window."""
    layout, base = nodes.layout, system.base
    wc = assemble(tree, shown, window, nodes)
    first = wc.valid.sum(-1) - layout.H  # the tail is the last H valid entries (I4)
    targets = repeat(split_window(window)[1][:, layout.T - layout.H :], "b h -> (b s) h", s=shown.size(1))
    nll, hit = tail_predictions(base, base.hidden(wc.emb, wc.position, wc.span.float()), first, targets)
    return *(rearrange(x, "(b s) h -> b s h", b=window.size(0)) for x in (nll, hit)), wc


def budget_contexts(batch: EvalBatch, nodes: NodeTable, generator: torch.Generator) -> tuple[Tensor, dict[str, slice]]:
    """The working contexts scored at one budget, ``[B, S, nodes]``, and each policy's slots; the scored policies
    choose theirs from what lies up to each window's horizon, each refocused from the coarsest cut."""
    system, window = batch.system, batch.window
    B, M, device = window.size(0), batch.settings.random_contexts, window.device
    parts = {}
    for policy in batch.settings.policies(system):
        if policy.choice is Choice.TRUNCATION:
            parts[policy.name] = recency_cut(nodes.layout, B, device)
        elif policy.choice is Choice.FIXED:
            parts[policy.name] = repeat(recent_cut(nodes.layout, device), "n -> b 1 n", b=B)
        elif policy.choice is Choice.RANDOM:
            noise = draw_variant_noise(nodes.with_sizes(N=M).layout, B, generator, device)
            parts[policy.name] = compressed_cuts(noise, nodes.with_sizes(N=M))
        elif policy.scored:
            start = repeat(system.coarsest, "n -> b 1 n", b=B)
            scorer = policy.scorer(system, window, nodes.layout, nodes.layout.H)  # one cut serves all H
            steps, horizon = batch.settings.refocus, batch.horizon
            parts[policy.name] = refocus(scorer, batch.tree, window, start, nodes, iterations=steps, horizon=horizon)
    return stacked(parts)


def stacked(parts: dict[str, Tensor]) -> tuple[Tensor, dict[str, slice]]:
    """Each condition's cuts ``[B, S_c, nodes]`` side by side ``[B, S, nodes]``, and each condition's slots."""
    slots, at = {}, 0
    for name, cut in parts.items():
        slots[name] = slice(at, at + cut.size(1))
        at += cut.size(1)
    return torch.cat(list(parts.values()), dim=1), slots


@dataclass
class Predictions:
    """Every working context's tail predictions for one batch at one budget, under one cut for the whole tail
    (``chunk`` all 0) or a cut per chunk of ``R`` tail tokens
    (:class:`mcfn.evaluation.refocused.ChunkedPredictions`)."""

    nll: Tensor  # [B, S, H]
    hit: Tensor  # [B, S, H] bool: the argmax is the target
    slots: dict[str, slice]  # each condition's contexts among the S
    chunk: Tensor  # [B, H] int64: the chunk of each tail column (-1: before the horizon, never scored)
    preference: Tensor | None  # [B, C, P]: LensNet's preference between every pair of a chunk's random contexts
    utility: Tensor | None = None  # [B, C] float64: each chunk's utility_corr (NaN: not measured; None: not asked)

    def refocus_counts(self) -> dict[str, Tensor]:
        """Per refocusing condition, the refocuses ``[B]`` each window made: none under one cut."""
        return {}


def predict_budget(batch: EvalBatch, budget: int, generator: torch.Generator) -> Predictions:
    """Every condition's tail predictions at ``budget``, each from one cut for the whole tail."""
    system, window, horizon = batch.system, batch.window, batch.horizon
    nodes = batch.nodes(budget)
    shown, slots = budget_contexts(batch, nodes, generator)
    nll, hit, wc = context_predictions(system, batch.tree, shown, window, nodes)
    preference = None
    if system.lensnet is not None:
        ablated = context_predictions(system, batch.nogist, shown[:, slots[LENS.name]], window, nodes)
        slots[NOGIST] = slice(nll.size(1), nll.size(1) + ablated[0].size(1))
        nll, hit = torch.cat([nll, ablated[0]], dim=1), torch.cat([hit, ablated[1]], dim=1)
        B, S = shown.shape[:2]
        rows = rearrange(torch.arange(B * S, device=shown.device), "(b s) -> b s", b=B)[:, slots[RANDOM.name]]
        random_wc, random = wc[rows.flatten()], shown[:, slots[RANDOM.name]]
        i, j = pair_slots(random.size(1), B, random.device)
        seen = seen_until(random_wc, repeat(horizon, "b -> (b s)", s=random.size(1)))
        tokens = repeat(window[:, : nodes.layout.T], "b t -> (b s) t", s=random.size(1))
        preference = pair_margin(system.lensnet(seen, tokens=tokens, base=system.base), random, i, j, random_wc, nodes)
    chunk = torch.zeros(nll.size(0), nll.size(-1), dtype=torch.int64, device=nll.device)
    return Predictions(nll, hit, slots, chunk, None if preference is None else preference[:, None])
