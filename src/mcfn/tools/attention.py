"""A training-free focus: expand where the base model's own attention goes (as InfLLM and Quest pick blocks).

The bar a learned policy must clear. From the coarsest full-coverage context, read up to the horizon (I11),
the base model is run once with its attention probabilities written out; each entry's score is the attention
mass the last ``H`` entries it reads give it (summed over layers and heads), less the mean over the context's
entries. Read past the horizon, the tail's own tokens would pick the far blocks that hold them. With these scores in
LensNet's place, :func:`~mcfn.core.focus.refocus` and the focus allocator expand the entries with the most
mass and collapse the groups with the least.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from mcfn.core.attention import hidden_and_tail_attention
from mcfn.core.context import WorkingContext
from mcfn.core.model import GPT
from mcfn.typecheck import typechecked


@torch.no_grad()
@typechecked
def attention_mass(base: GPT, wc: WorkingContext, tail: int) -> Float[Tensor, "r w"]:
    """Per entry, the causal attention probability mass it receives from the last ``tail`` valid entries (the
    tail, I4, or as many as a row has), summed over queries, layers and heads
    (:func:`mcfn.core.attention.hidden_and_tail_attention`)."""
    count = wc.valid.sum(-1)
    first = (count - tail).clamp(min=0)
    attention = hidden_and_tail_attention(base, wc.emb, wc.position, wc.span.float(), first, tail)[1]
    is_query = (first[:, None] + torch.arange(tail, device=first.device)) < count[:, None]  # [r, tail]
    return torch.einsum("rh,rhn->rn", is_query.float(), attention) * wc.valid


@typechecked
def attention_scores(base: GPT, tail: int, wc: WorkingContext) -> Float[Tensor, "r w"]:
    """A training-free scorer for :func:`mcfn.core.focus.refocus`: each entry's attention mass from the last
    ``tail`` entries, less the context's mean (bind ``base`` and ``tail`` with ``partial``)."""
    mass = attention_mass(base, wc, tail)
    mean = mass.sum(-1, keepdim=True) / wc.valid.sum(-1, keepdim=True)
    return torch.where(wc.valid, mass - mean, 0.0)
