"""Working contexts: the shown nodes of every variant gathered into one packed ``[B·V, W]`` container."""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
from tensordict import TensorClass
from torch import Tensor

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


Scorer = Callable[[WorkingContext], Tensor]  # a focus policy's signed scores [r, w] of a context's entries


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
    emb = torch.gather(tree.emb, 1, repeat(flat, "b n -> b n d", d=tree.emb.size(-1)))
    emb = emb * rearrange(valid, "b v w -> b (v w) 1")
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
    return WorkingContext(**packed, batch_size=[B * V, W])


@typechecked
def seen_until(wc: WorkingContext, horizon: Int[Tensor, " r"]) -> WorkingContext:
    """``wc`` with every entry that starts after ``horizon[r]`` made padding: what a scorer may read when the cut
    it chooses serves the predictions from position ``horizon`` on. A cut chosen from text that it is then
    scored on would be picked with the answers in view (a selector that sees the tail's tokens picks the far
    blocks that hold them). Starts increase along a row, so the valid entries stay a prefix (I3)."""
    valid = wc.valid & (wc.start <= horizon[:, None])
    return WorkingContext(
        emb=wc.emb * valid[..., None],
        position=wc.position,
        start=wc.start,
        span=wc.span,
        lod=wc.lod,
        node=wc.node,
        target=torch.where(valid, wc.target, -1),
        valid=valid,
        batch_size=wc.batch_size,
    )


@typechecked
def read_end(wc: WorkingContext) -> Int[Tensor, " r"]:
    """One past the newest token a row's valid entries cover: after :func:`seen_until`, one past the horizon, the
    position a scorer's distances and reads are measured from."""
    return torch.where(wc.valid, wc.start + wc.span, 0).amax(-1)


@typechecked
def tail_entries(x: Float[Tensor, "r w d"], first: Int[Tensor, " r"], tail: int) -> Float[Tensor, "r h d"]:
    """Each row's ``tail`` entries from ``first`` on: the tail, the last ``H`` valid entries of a working
    context (I4), or the last ``H`` positions of a plain window."""
    index = first[:, None] + torch.arange(tail, device=first.device)
    return x.gather(1, repeat(index, "r h -> r h d", d=x.size(-1)))
