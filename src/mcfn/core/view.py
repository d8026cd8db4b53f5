"""LensNet learns on the view it is read from (``mc.lens.view_weight``).

Every refocus scores the nodes from one fixed view, the block view (every eligible LOD1 gist, the tail as
tokens; I12, :func:`mcfn.core.system.focus_scores`). The preference and attention terms of
:mod:`mcfn.core.preferences` and :mod:`mcfn.core.attention` train LensNet on the *variants'* entries instead:
raw recent tokens, compressed mixtures, the allocator's cut. A LensNet trained on one kind of input and read
on another ranks the blocks of the view with whatever it happens to do there. These terms score the block
view itself, with gradient, and give each of its ``n`` LOD1 blocks a label from every pair of variants:

* ``loss_view_pref``: Bradley–Terry with ties on the block's score ``s_b``. For a pair whose better variant
  shows block ``b`` finer than the worse one (the finest LOD anywhere in ``b``'s span, ``L + 1`` where it is left
  out), the label is 1 (more detail here paid), coarser 0, the same ½; each pair weighted by
  ``tanh(|ΔNLL| / τ)`` as the entry-wise term is. This is I7's target polarity at the view's granularity.
* ``loss_view_attn`` (with the teacher's attention, ``mc.lens.attention_weight``): the cross-entropy from the
  tail's long-range attention share under each block to the softmax of the blocks' scores.

The allocator reads exactly these scores (spread to every level), so what the terms teach is what it uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from jaxtyping import Bool, Float
from torch import Tensor

from mcfn.core.nodes import NodeTable
from mcfn.core.outputs import StepOutput
from mcfn.core.preferences import WEIGHT_FLOOR_PER_SAMPLE, node_min_lod, ordered_pairs
from mcfn.core.weights import LossWeights
from mcfn.typecheck import typechecked


def view_blocks(x: Tensor, nodes: NodeTable) -> Tensor:
    """The eligible LOD1 blocks' slice ``[..., n]`` of a per-node tensor ``[..., nodes]``."""
    lo, n = nodes.layout.level_offsets[1], nodes.layout.eligible_counts[1]
    return x[..., lo : lo + n]


@typechecked
def block_labels(
    shown: Bool[Tensor, "b v nodes"], tails: Float[Tensor, "b v"], nodes: NodeTable, temperature: Tensor
) -> tuple[Float[Tensor, "b p n"], Float[Tensor, "b p"]]:
    """Per pair of variants and eligible LOD1 block, the label ``[B, P, n]`` (1: the better variant shows the block
    finer, 0: coarser, ½: the same) and each pair's weight ``[B, P]``."""
    better, worse, pair_w = ordered_pairs(tails, temperature)
    finest = view_blocks(node_min_lod(shown, nodes), nodes)  # [B, V, n]
    n = finest.size(-1)
    at_better = finest.gather(1, repeat(better, "b p -> b p n", n=n))
    at_worse = finest.gather(1, repeat(worse, "b p -> b p n", n=n))
    return (1 + torch.sign(at_worse - at_better).float()) / 2, pair_w


@typechecked
def view_losses(
    block_scores: Float[Tensor, "b n"],
    shown: Bool[Tensor, "b v nodes"],
    tails: Float[Tensor, "b v"],
    mass: Float[Tensor, "b nodes"] | None,
    nodes: NodeTable,
    weights: LossWeights,
) -> StepOutput:
    """``loss_view_pref`` and, given the teacher's attention ``mass``, ``loss_view_attn`` (module docstring)."""
    label, pair_w = block_labels(shown, tails, nodes, weights.temperature)
    s = rearrange(block_scores, "b n -> b 1 n")
    bt = label * F.softplus(-s) + (1 - label) * F.softplus(s)  # [B, P, n]
    floor = WEIGHT_FLOOR_PER_SAMPLE * shown.size(0)
    pref = (pair_w[..., None] * bt).sum() / (pair_w.sum() * bt.size(-1)).clamp(min=floor)
    agree = ((s > 0) == (label > 0.5)) & (label != 0.5)
    decided = (label != 0.5).float() * pair_w[..., None]
    metrics = {"mc/view_pref": pref, "mc/view_agreement": (agree * decided).sum() / decided.sum().clamp(min=1e-6)}
    out = StepOutput({"loss_view_pref": weights.view * pref}, metrics, {})
    if mass is None:
        return out
    share = view_blocks(mass, nodes)
    target = share / share.sum(-1, keepdim=True).clamp(min=1e-9)
    cross = -(target * torch.log_softmax(block_scores, -1)).sum(-1).mean()
    return out.merge(StepOutput({"loss_view_attn": weights.view * weights.attention * cross}, {}, {}))
