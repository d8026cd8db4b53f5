"""Losses and in-graph metrics of the packed variant forward, from per-entry NLL.

* ``loss_lm`` averages the next-token NLL over **every valid entry of every variant**: the baseline's
  tokens, and the compressed variants' tokens and gists (a gist predicts the token after its span, I5).
  This is what trains the base model to read gists and GistNet to write them.
* The **tail NLL** of a variant is its mean NLL over the last ``H`` tokens, LOD0 in every variant (I4),
  so all variants of a sample are scored on the same targets. ``ΔNLL = tail(compressed) - tail(baseline)``
  per compressed variant: positive when compression costs, negative when the older context it shows
  in compressed form beats the baseline's extra recent tokens.
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Bool, Float
from torch import Tensor

from mcfn.core.context import WorkingContext, tail_entries
from mcfn.core.nodes import Layout
from mcfn.core.outputs import StepOutput
from mcfn.typecheck import typechecked


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


@typechecked
def tail_mask(wc: WorkingContext, layout: Layout) -> Bool[Tensor, "r w"]:
    """The entries of the last ``H`` tokens (LOD0 in every variant, I4)."""
    return wc.valid & (wc.start >= layout.T - layout.H)


@typechecked
def tail_nll(nll: Float[Tensor, "r w"], wc: WorkingContext, layout: Layout) -> Float[Tensor, "b v"]:
    tail = tail_mask(wc, layout)
    return rearrange((nll * tail).sum(-1) / layout.H, "(b v) -> b v", v=layout.V)


@typechecked
def recency_tail_nll(nll: Float[Tensor, "r w"], wc: WorkingContext, layout: Layout) -> Float[Tensor, "b h"]:
    """The recency baseline's (slot 0's) NLL at each of the last ``H`` targets: its last ``H`` valid entries."""
    baseline = slice(None, None, layout.V)
    first = wc.valid[baseline].sum(-1) - layout.H
    return tail_entries(nll[baseline, :, None], first, layout.H)[..., 0]


@typechecked
def variant_losses(
    nll: Float[Tensor, "r w"], tails: Float[Tensor, "b v"], wc: WorkingContext, layout: Layout
) -> StepOutput:
    """``loss_lm`` and the variant metrics (all tensors; nothing is read back here)."""
    valid = wc.valid
    delta = tails[:, 1:] - tails[:, :1]  # [B, N]
    baseline = rearrange(torch.arange(wc.batch_size[0], device=nll.device) % layout.V == 0, "r -> r 1")
    lod0_loss = _masked_mean(nll, valid & (wc.lod == 0))
    out = {
        "train/loss_lod0": _masked_mean(nll, valid & baseline),
        "mc/tail_loss_baseline": tails[:, 0].mean(),
        "mc/tail_loss_compressed": tails[:, 1:].mean(),
        "mc/adv_delta_mean": delta.mean(),
        "mc/adv_delta_p95": torch.quantile(delta.flatten(), 0.95),
        "mc/adv_delta_std": delta.flatten().std(correction=0),
        "mc/variants_per_sample": torch.tensor(float(layout.V), device=nll.device),
        "mc/tokens_covered_mean": (wc.span * valid).sum(-1).float().mean(),
    }
    rows = valid.size(0)
    for k in range(layout.L + 1):
        at_k = valid & (wc.lod == k)
        loss_k = _masked_mean(nll, at_k)
        out[f"mc/lod_loss/{k}"] = loss_k
        out[f"mc/lod_count/{k}"] = at_k.sum() / rows
        # How much worse an entry at LODk predicts its next token than a token entry does, on average.
        out[f"mc/lod_delta/{k}"] = loss_k - lod0_loss
    return StepOutput({"loss_lm": _masked_mean(nll, valid)}, out, {})


@typechecked
def loss_shares(
    nll: Float[Tensor, "r w"], valid: Bool[Tensor, "r w"], layout: Layout, allocated: int
) -> dict[str, Tensor]:
    """Each kind of variant's share of ``loss_lm`` (its summed NLL over the sum of all): the recency baseline (slot
    0), the random compressed variants, and the allocator's (the last ``allocated`` slots) where there are any."""
    per_slot = rearrange((nll * valid).sum(-1), "(b v) -> v b", v=layout.V).sum(-1)  # [V]
    total = per_slot.sum().clamp(min=torch.finfo(per_slot.dtype).tiny)
    kinds = {"recency": per_slot[:1], "random": per_slot[1 : layout.V - allocated]}
    if allocated:
        kinds["allocator"] = per_slot[layout.V - allocated :]
    return {f"mc/loss_share/{kind}": part.sum() / total for kind, part in kinds.items()}
