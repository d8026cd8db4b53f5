"""Working contexts: the shown nodes of every variant gathered into one packed ``[B·V, W]`` container."""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from tensordict import TensorClass
from torch import Tensor

from mcfn.core.model import GPT, LayerAttention, causal_attention, with_gist_kv
from mcfn.core.nodes import NodeTable
from mcfn.core.tree import Tree
from mcfn.typecheck import typechecked


class WorkingContext(TensorClass):
    """All variants of a batch, ``batch_size [B·V, W]``, valid entries first in increasing start order.

    Padding (``valid == False``) only follows the last valid entry (I3). Under causal attention a valid
    entry never sees padding, so padding cannot change it; padding has no target and no loss.
    """

    emb: Tensor  # [R, W, D] node embeddings (zero for padding)
    position: Tensor  # [R, W] float: centre of the span, start + (span - 1) / 2
    start: Tensor  # [R, W] int64: first token covered
    span: Tensor  # [R, W] int64: tokens covered, K**lod
    lod: Tensor  # [R, W] int64
    node: Tensor  # [R, W] int64: node id in the tree layout
    target: Tensor  # [R, W] int64: the token right after the span (I5); -1 for padding
    valid: Tensor  # [R, W] bool
    kv: Tensor | None = None  # [R, W, layers, 2, heads, head_dim]: the tree's pooled keys and values (carrier "kv")


@typechecked
def assemble(
    tree: Tree,
    shown: Bool[Tensor, "b v nodes"],
    window: Int[Tensor, "b t1"],
    nodes: NodeTable,
) -> WorkingContext:
    """Gather each variant's shown nodes, ordered by start, right-padded to ``W`` (``nodes.layout.W``)."""
    layout = nodes.layout
    B, V, W = shown.size(0), shown.size(1), layout.W
    start_of = nodes.start
    # Shown spans are disjoint, so sorting by start orders them; hidden nodes sort after every shown one.
    key = torch.where(shown, start_of, layout.T + 1)
    node = torch.topk(key, W, dim=-1, largest=False, sorted=True).indices  # [B, V, W]
    valid = torch.arange(W, device=shown.device) < shown.sum(-1, keepdim=True)
    node = torch.where(valid, node, 0)
    flat = rearrange(node, "b v w -> b (v w)")
    emb = gather_rows(tree.emb, flat)
    emb = emb * rearrange(valid, "b v w -> b (v w) 1")
    kv = None if tree.kv is None else rearrange(gather_rows(tree.kv, flat), "b (v w) ... -> (b v) w ...", v=V)
    start, span, lod = start_of[node], nodes.span[node], nodes.lod[node]
    target = torch.gather(window, 1, rearrange(start + span, "b v w -> b (v w)"))
    target = torch.where(valid, rearrange(target, "b (v w) -> b v w", v=V), -1)
    packed = {
        "emb": rearrange(emb, "b (v w) d -> (b v) w d", v=V),
        "position": (start + (span - 1) / 2).float(),
        "start": start,
        "span": span,
        "lod": lod,
        "node": node,
        "target": target,
        "valid": valid,
    }
    packed = {k: v if k == "emb" else rearrange(v, "b v w -> (b v) w") for k, v in packed.items()}
    return WorkingContext(**packed, kv=kv, batch_size=[B * V, W])


def gather_rows(x: Tensor, index: Int[Tensor, "b n"]) -> Tensor:
    """``x[b, index[b, i], ...]`` for a ``[B, nodes, ...]`` tensor: ``[B, n, ...]``."""
    return torch.gather(x, 1, index.view(*index.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))


def context_attention(wc: WorkingContext, attend: LayerAttention = causal_attention) -> LayerAttention:
    """How the base model attends over ``wc``: ``attend``, with the gists read through their pooled keys and
    values when the tree carries them (:func:`mcfn.core.model.with_gist_kv`)."""
    return with_gist_kv(attend, wc.kv, wc.lod > 0)


@typechecked
def context_hidden(base: GPT, wc: WorkingContext) -> Float[Tensor, "r w d"]:
    """The base model's final hidden states over the working contexts ``wc``, each read causally."""
    return base.hidden(wc.emb, wc.position, wc.span.float(), attend=context_attention(wc))


@typechecked
def tail_entries(x: Float[Tensor, "r w d"], first: Int[Tensor, " r"], tail: int) -> Float[Tensor, "r h d"]:
    """Each row's ``tail`` entries from ``first`` on: the tail, the last ``H`` valid entries of a working
    context (I4), or the last ``H`` positions of a plain window."""
    index = first[:, None] + torch.arange(tail, device=first.device)
    return gather_rows(x, index)
