"""A training-free focus: expand where the base model's own attention goes (as InfLLM and Quest pick blocks).

The bar a learned policy must clear. From the coarsest full-coverage context, the base model is run once
with its attention probabilities written out; each entry's score is the attention mass the tail's tokens
give it (summed over layers and heads), less the mean over the context's entries. With these scores in
LensNet's place, :func:`~mcfn.core.system.refocus` and the focus allocator expand the entries with the most
mass and collapse the groups with the least.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.model import GPT, rms_norm, rotary_tables
from mcfn.typecheck import typechecked


@typechecked
@torch.no_grad()
def attention_mass(base: GPT, wc: WorkingContext, queries: Bool[Tensor, "r w"]) -> Float[Tensor, "r w"]:
    """Per entry, the causal attention probability mass it receives from the ``queries`` entries, summed over
    layers and heads: the base model's forward written out, since fused attention keeps its weights."""
    cos, sin = rotary_tables(wc.position, wc.span.float(), base.cfg.head_dim, base.cfg.rope_base)
    n = wc.valid.size(1)
    causal = torch.ones(n, n, dtype=torch.bool, device=wc.valid.device).tril()
    mass = torch.zeros_like(wc.position)
    x = rms_norm(wc.emb)
    for block in base.blocks:
        q, k, v = block.attn.qkv(rms_norm(x), cos, sin)
        probs = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~causal, -torch.inf), -1)
        mass += torch.einsum("rhqk,rq->rk", probs, queries.float())
        x = x + block.attn.project(probs @ v)
        x = x + block.mlp(rms_norm(x))
    return mass * wc.valid


@typechecked
def attention_scores(base: GPT, tail_start: int, wc: WorkingContext) -> Float[Tensor, "r w"]:
    """A training-free scorer for :func:`mcfn.core.system.refocus`: each entry's attention mass from the tokens
    at ``tail_start`` and after, less the context's mean (bind ``base`` and ``tail_start`` with ``partial``)."""
    mass = attention_mass(base, wc, wc.valid & (wc.start >= tail_start))
    mean = mass.sum(-1, keepdim=True) / wc.valid.sum(-1, keepdim=True)
    return torch.where(wc.valid, mass - mean, 0.0)
