"""The full-window teacher: the base model over all ``T`` tokens at LOD0, beside the packed variants.

``loss_full`` (off unless ``mc.teacher.full_weight`` > 0): next-token NLL over every position of the whole
window. MC training alone never shows the base model more than ``W`` entries, so ``T`` tokens at LOD0 is out
of distribution for it and ``full`` ends up the *worst* evaluation column. With this term the base keeps
reading long contexts, and ``full`` is the upper bound it should be.

The same forward can also write out where the tail's attention goes, per tree node
(:mod:`mcfn.core.attention`): LensNet's auxiliary target. (Context distillation of the full window's tail
predictions into the gists was measured and retired: LABLOG.)
"""

from __future__ import annotations

from functools import partial

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.attention import (
    AttentionTarget,
    hidden_and_tail_attention,
    local_and_tail_attention,
    long_range_mass,
    node_mass,
)
from mcfn.core.model import GPT, causal_attention
from mcfn.core.nodes import Layout
from mcfn.core.outputs import StepOutput
from mcfn.core.step import split_window
from mcfn.core.weights import LossWeights
from mcfn.typecheck import typechecked


@typechecked
def teacher_losses(
    base: GPT,
    window: Int[Tensor, "b t1"],
    recency_nll: Float[Tensor, "b h"],
    layout: Layout,
    weights: LossWeights,
    target: AttentionTarget | None = None,
    reach: int = 0,
) -> tuple[StepOutput, Float[Tensor, "b nodes"] | None]:
    """``loss_full`` (weighted), with its unweighted value as a metric; and with a ``target``, the tail's
    long-range attention mass under every tree node ``[B, nodes]`` (else ``None``), weighted by how much better
    the full window predicts each tail target than the recency baseline (``recency_nll``, read off the packed
    forward: :func:`mcfn.core.losses.recency_tail_nll`), without the target's sink. With
    ``reach`` every token reads the ``reach`` tokens up to itself and the tail all
    (:func:`mcfn.core.attention.local_and_tail_attention`)."""
    inputs, targets = split_window(window)
    at = torch.arange(layout.T, device=window.device, dtype=torch.float32)[None]
    attend = causal_attention if not reach else partial(local_and_tail_attention, reach, layout.H)
    if target is not None:  # a config constant: static under compile
        first = torch.full((inputs.size(0),), layout.T - layout.H, device=inputs.device)
        full_hidden, attention = hidden_and_tail_attention(
            base, base.embed(inputs), at, torch.ones_like(at), first, layout.H, attend
        )
    else:
        full_hidden = base.hidden(base.embed(inputs), at, torch.ones_like(at), attend=attend)
    nll = base.nll(full_hidden, targets)  # [B, T]
    mass = None
    if target is not None:
        mass = node_mass(long_range_mass(attention, recency_nll, nll[:, layout.T - layout.H :], target.sink), layout)
    full_nll = nll.mean()
    return StepOutput({"loss_full": weights.full * full_nll}, {"train/loss_full": full_nll}, {}), mass
