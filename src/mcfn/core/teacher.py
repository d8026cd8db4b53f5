"""The full-window teacher: the base model over all ``T`` tokens at LOD0, beside the packed variants.

``loss_full`` (off unless ``mc.teacher.full_weight`` > 0): next-token NLL over every position of the whole
window. MC training alone never shows the base model more than ``W`` entries, so ``T`` tokens at LOD0 is out
of distribution for it and ``full`` ends up the *worst* evaluation column. With this term the base keeps
reading long contexts, and ``full`` is the upper bound it should be.

The same forward can also write out where the tail's attention goes, per tree node
(:mod:`mcfn.core.attention`): LensNet's auxiliary target. (Context distillation of the full window's tail
predictions into the gists was measured and retired: LABLOG.)

**A bounded teacher** (``mc.teacher.stretch = S``): the forward over all ``T`` tokens costs what a plain step at
length ``T`` costs, growing like ``T²``. With a stretch the teacher reads ``S`` tokens at their own positions: the
window's last ``S/2`` (the tail among them) and a far stretch of ``S/2`` tokens from a block boundary drawn anew
for every window and step (:func:`stretch_positions`). Its cost is fixed whatever ``T``; over
the steps it still reads every part of the window, at every distance from the tail; the attention target covers
the nodes the stretch read (the others are not judged, :func:`mcfn.core.attention.attention_target_loss`); and
``loss_full`` leaves out the tail, whose questions ask for far text the stretch mostly did not read.
"""

from __future__ import annotations

from functools import partial

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.attention import hidden_and_tail_attention, local_and_tail_attention, long_range_mass, node_mass
from mcfn.core.model import GPT, causal_attention
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.outputs import StepOutput
from mcfn.core.step import split_window
from mcfn.core.weights import LossWeights
from mcfn.typecheck import typechecked


@typechecked
def stretch_positions(layout: Layout, stretch: int, far: Float[Tensor, " b"]) -> Int[Tensor, "b s"]:
    """The window positions ``[B, S]`` the bounded teacher reads, in order: ``S/2`` tokens from a block boundary
    drawn uniformly (``far [B]`` in ``[0, 1)``) among those that end before the near half, then the window's last
    ``S/2`` tokens."""
    half, K = stretch // 2, layout.K
    starts = (layout.T - 2 * half) // K + 1  # far stretches that end before the near half begins
    start = (far * starts).long().clamp(max=starts - 1) * K
    offsets = torch.arange(half, device=far.device)
    near = (layout.T - half + offsets).expand(far.size(0), -1)
    return torch.cat([start[:, None] + offsets, near], dim=1)


def read_nodes(read: Int[Tensor, "b s"], layout: Layout) -> Bool[Tensor, "b nodes"]:
    """Per tree node, whether the positions ``read`` cover its whole span."""
    tokens = torch.zeros(read.size(0), layout.T, device=read.device).scatter(1, read, 1.0)
    return node_mass(tokens, layout) >= NodeTable.of(layout, read.device).span


@typechecked
def teacher_losses(
    base: GPT,
    window: Int[Tensor, "b t1"],
    recency_nll: Float[Tensor, "b h"],
    layout: Layout,
    weights: LossWeights,
    with_mass: bool = False,
    queries: Bool[Tensor, "b h"] | None = None,
    read: Int[Tensor, "b s"] | None = None,
    reach: int = 0,
) -> tuple[StepOutput, Float[Tensor, "b nodes"] | None, Bool[Tensor, "b nodes"] | None]:
    """``loss_full`` (weighted), with its unweighted value as a metric; and with ``with_mass``, the tail's
    long-range attention mass under every tree node ``[B, nodes]`` (else ``None``), weighted by how much better
    the full window predicts each tail target than the recency baseline (``recency_nll``, read off the packed
    forward: :func:`mcfn.core.losses.recency_tail_nll`), from the tail ``queries`` only where given (the chunk a
    window's in-tail horizon serves). With ``read`` (:func:`stretch_positions`, the tail last) it reads only those
    positions and returns the nodes it read whole ``[B, nodes]`` (``None``: all); with ``reach`` every token reads the
    ``reach`` tokens up to itself and the tail all (:func:`mcfn.core.attention.local_and_tail_attention`)."""
    inputs, targets = split_window(window)
    if read is None:
        positions = torch.arange(layout.T, device=window.device)[None]
    else:
        inputs, targets, positions = inputs.gather(1, read), targets.gather(1, read), read
    n, at = inputs.size(1), positions.float()
    attend = causal_attention if not reach else partial(local_and_tail_attention, reach, layout.H)
    if with_mass:  # a config constant: static under compile
        first = torch.full((inputs.size(0),), n - layout.H, device=inputs.device)
        full_hidden, attention = hidden_and_tail_attention(
            base, base.embed(inputs), at, torch.ones_like(at), first, layout.H, attend
        )
    else:
        full_hidden = base.hidden(base.embed(inputs), at, torch.ones_like(at), attend=attend)
    nll = base.nll(full_hidden, targets)  # [B, n]
    mass, seen = None, None
    if with_mass:
        if queries is not None:
            attention = attention * queries[..., None]
        token_mass = long_range_mass(attention, recency_nll, nll[:, n - layout.H :])  # [B, n]
        if read is not None:
            token_mass = torch.zeros(window.size(0), layout.T, device=window.device).scatter(1, read, token_mass)
            seen = read_nodes(read, layout)
        mass = node_mass(token_mass, layout)
    # A bounded teacher leaves the tail out of loss_full: its questions ask for far text the stretch mostly did not
    # read, and learning to answer them without it unlearns retrieval (LABLOG). The tail is the packed variants' loss.
    full_nll = nll.mean() if read is None else nll[:, : n - layout.H].mean()
    return StepOutput({"loss_full": weights.full * full_nll}, {"train/loss_full": full_nll}, {}), mass, seen
