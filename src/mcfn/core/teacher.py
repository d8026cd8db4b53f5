"""The full-window teacher: the base model over all ``T`` tokens at LOD0, beside the packed variants.

Two loss terms come from this one extra forward (both off unless their weight in ``[mc.teacher]`` is > 0):

* ``loss_full``: next-token NLL over every position of the whole window. MC training alone never shows the
  base model more than ``W`` entries, so ``T`` tokens at LOD0 is out of distribution for it and ``full``
  ends up the *worst* evaluation column. With this term the base keeps reading long contexts, and
  ``full`` is the upper bound it should be.
* ``loss_distill``: context distillation into the gists. For every compressed variant, the KL divergence
  ``KL(p_full ‖ p_variant)`` over the tail's next-token distributions, with the full window's
  prediction as the (detached) target. The variant differs from the full window only where it shows
  gists instead of tokens, so the only way for GistNet (and the base reading gists) to close the gap is
  to carry what the hidden tokens told the base about the tail: a dense signal (a whole distribution per
  tail token) where next-token loss gives one index. The recency baseline is not distilled: it drops the
  far past instead of summarising it, and no gist can help it.

The same forward can also write out where the tail's attention goes, per tree node
(:mod:`mcfn.core.attention`): LensNet's auxiliary target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.attention import hidden_and_tail_attention, long_range_mass, node_mass
from mcfn.core.context import WorkingContext, tail_entries
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout
from mcfn.core.outputs import StepOutput
from mcfn.core.step import split_window
from mcfn.core.weights import LossWeights
from mcfn.typecheck import typechecked


@typechecked
def variant_tail_logprobs(
    base: GPT, hidden: Float[Tensor, "r w d"], wc: WorkingContext, layout: Layout
) -> Float[Tensor, "b v h c"]:
    """Log-probabilities of every variant's tail targets: the tail is the last ``H`` valid entries (I4)."""
    tail = tail_entries(hidden, wc.valid.sum(-1) - layout.H, layout.H)
    return rearrange(F.log_softmax(base.logits(tail), -1), "(b v) h c -> b v h c", v=layout.V)


@typechecked
def distill_kl(teacher: Float[Tensor, "b h c"], student: Float[Tensor, "b n h c"]) -> Float[Tensor, "b n h"]:
    """``KL(teacher ‖ student)`` per student and tail position, in nats; no gradient reaches the teacher."""
    target = teacher.detach()[:, None]
    return (target.exp() * (target - student)).sum(-1)


@typechecked
def teacher_losses(
    base: GPT,
    window: Int[Tensor, "b t1"],
    hidden: Float[Tensor, "r w d"],
    wc: WorkingContext,
    layout: Layout,
    weights: LossWeights,
    with_mass: bool = False,
) -> tuple[StepOutput, Float[Tensor, "b nodes"] | None]:
    """``loss_full`` and ``loss_distill`` (weighted), with their unweighted values as metrics; and with
    ``with_mass``, the tail's long-range attention mass under every tree node ``[B, nodes]`` (else ``None``)."""
    inputs, targets = split_window(window)
    tail_start = layout.T - layout.H
    if with_mass:  # a config constant: static under compile
        positions = torch.arange(layout.T, device=window.device, dtype=torch.float32)[None]
        first = torch.full((window.size(0),), tail_start, device=window.device)
        full_hidden, attention = hidden_and_tail_attention(
            base, base.embed(inputs), positions, torch.ones_like(positions), first, layout.H
        )
    else:
        full_hidden = base.token_hidden(inputs)
    nll = base.nll(full_hidden, targets)  # [B, T]
    teacher = F.log_softmax(base.logits(full_hidden[:, tail_start:]), -1)
    student = variant_tail_logprobs(base, hidden, wc, layout)
    kl = distill_kl(teacher, student[:, 1:]).mean()
    mass = None
    if with_mass:
        recency_nll = -student[:, 0].gather(-1, targets[:, tail_start:, None])[..., 0]
        mass = node_mass(long_range_mass(attention, recency_nll, nll[:, tail_start:]), layout)
    full_nll = nll.mean()
    out = StepOutput(
        {"loss_full": weights.full * full_nll, "loss_distill": weights.distill * kl},
        {"train/loss_full": full_nll, "mc/distill_kl": kl},
        {},
    )
    return out, mass
