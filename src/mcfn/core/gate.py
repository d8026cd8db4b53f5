"""The gate: does a cut beat truncation? One logit per working context, LensNet's second head.

Why: on natural text at this scale a cut that covers the far past with gists, or swaps recent tokens for far
ones, mostly loses to truncation (LABLOG 2026-11-25, seventh session), while on a retrieval task it wins by
whole answers. The entry scores say *where* detail pays; the gate says *whether* spending the budget on the far
past pays at all, from what the cut shows up to its horizon (I11). The focus keeps its cut where the gate is
open (logit > 0) and shows the recency cut, truncation at the same budget, where it is shut (:func:`gated`).

Training signal, free in every step: the tail NLL of each cut the allocator built (the last ``mc.alloc.variants``
slots, LensNet's own cuts, which the gate will judge) against the recency baseline's, slot 0 of the same
sample. With ``d = NLL_recency − NLL_cut`` (> 0: the cut won), ``loss_gate`` is the logistic loss of the cut's
logit against ``d > 0``, each example weighted by ``|d|``. Weighted so, the loss is least where the logit's odds
are ``E[d⁺] / E[d⁻]`` over the cuts that look alike to LensNet: the gate opens exactly where the cut's expected
gain over truncation is positive. A pass key fetched wins whole answers while a cut on ordinary text loses a
little; an unweighted label would count them alike and shut the gate on both (LABLOG 2026-11-25, seventh
session).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.context import assemble, seen_until
from mcfn.core.nodes import NodeTable
from mcfn.core.outputs import StepOutput
from mcfn.core.preferences import WEIGHT_FLOOR_PER_SAMPLE
from mcfn.core.tree import Tree
from mcfn.core.variants import recency_cut
from mcfn.core.weights import LossWeights
from mcfn.typecheck import typechecked


@typechecked
def gate_loss(gate: Float[Tensor, " r"], tails: Float[Tensor, "b v"], weights: LossWeights, judged: int) -> StepOutput:
    """``loss_gate`` over the last ``judged`` variant slots of the packed ``[B·V]`` rows (the allocator's own
    cuts, what the gate will judge), and its metrics: the weighted agreement of the logit's sign with the
    outcome, how often the gate is open, and how often those cuts beat truncation."""
    logit = rearrange(gate, "(b v) -> b v", v=tails.size(1))[:, -judged:]
    won = (tails[:, :1] - tails[:, -judged:]).detach()  # [B, judged], > 0: the cut beat the recency baseline
    w = won.abs()
    q = (won > 0).float()
    bt = q * F.softplus(-logit) + (1 - q) * F.softplus(logit)
    floor = WEIGHT_FLOOR_PER_SAMPLE * tails.size(0)
    loss = (w * bt).sum() / w.sum().clamp(min=floor)
    metrics = {
        "mc/gate_loss": loss,
        "mc/gate_agreement": (((logit > 0) == (won > 0)).float() * w).sum() / w.sum().clamp(min=1e-6),
        "mc/gate_open": (logit > 0).float().mean(),
        "mc/gate_beats_recency": q.mean(),
    }
    return StepOutput({"loss_gate": weights.gate * loss}, metrics, {})


@typechecked
def gated(
    lensnet,
    tree: Tree,
    window: Int[Tensor, "b t1"],
    cut: Bool[Tensor, "b 1 nodes"],
    nodes: NodeTable,
    horizon: Int[Tensor, " b"],
    fallback: Bool[Tensor, "b 1 nodes"] | None = None,
) -> tuple[Bool[Tensor, "b 1 nodes"], Bool[Tensor, " b"]]:
    """Per sample, ``cut`` where the gate, reading it up to ``horizon``, is open, else ``fallback`` (by default
    the recency cut of ``nodes``' layout); and whether it was open ``[B]``."""
    wc = assemble(tree, cut, window, nodes)
    _, logit = lensnet.judge(seen_until(wc, horizon), layout=nodes.layout)
    fallback = recency_cut(nodes.layout, cut.size(0), cut.device) if fallback is None else fallback
    is_open = logit > 0
    return torch.where(is_open[:, None, None], cut, fallback), is_open
