"""A training-free focus: expand where the base model's own attention goes (as InfLLM and Quest pick blocks).

The bar a learned policy must clear. From the coarsest full-coverage context, the base model is run once
with its attention probabilities written out; each entry's score is the attention mass the tail's tokens
give it (summed over layers and heads), less the mean over the context's entries, and the focus allocator
expands the entries with the most mass and collapses the groups with the least, exactly as it does with
LensNet's scores.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.allocator import allocate, node_scores_of
from mcfn.core.context import WorkingContext, assemble
from mcfn.core.model import GPT, rms_norm, rotary_tables
from mcfn.core.nodes import NodeTable
from mcfn.core.tree import Tree
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
def attention_focus(
    base: GPT,
    tree: Tree,
    window: Int[Tensor, "b t1"],
    cut: Bool[Tensor, "b 1 nodes"],
    nodes: NodeTable,
    tail_start: int,
    iterations: int,
) -> Bool[Tensor, "b 1 nodes"]:
    """Refocus ``cut`` within ``nodes.layout.W`` by attention mass from the tokens at ``tail_start`` and after."""
    cut = cut[:, 0]
    for _ in range(iterations):
        wc = assemble(tree, cut[:, None], window, nodes)
        mass = attention_mass(base, wc, wc.valid & (wc.start >= tail_start))
        mean = mass.sum(-1, keepdim=True) / wc.valid.sum(-1, keepdim=True)
        scores = node_scores_of(torch.where(wc.valid, mass - mean, 0.0), wc.node, wc.valid, nodes.layout.n_nodes)
        cut = allocate(cut, scores, nodes)
    return rearrange(cut, "b n -> b 1 n")
