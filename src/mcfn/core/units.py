"""LensNet's units: what its transformer reads instead of entries. Each gist is a unit, and so is each K-aligned block
of shown tokens (their embeddings averaged), whose score every token of the block shares; a cut over ``T`` tokens
has at most ``T/K`` of them whatever the budget (I1, I8). ``match``'s votes summed per unit feed the indexer. A unit
reads itself and the newest ``T/K`` units (:func:`newest_read`): all of a training context's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.match import NGRAM, match_votes
from mcfn.core.nodes import Layout
from mcfn.typecheck import typechecked


def unit_capacity(width: int, layout: Layout) -> int:
    """The most units a cut of ``layout`` has in a row of ``width`` entries: at most one per K-aligned block."""
    return min(width, layout.T // layout.K)


@typechecked
def block_units(wc: WorkingContext, K: int, units: int) -> Int[Tensor, "r w"]:
    """Each entry's unit, numbered in entry order (so valid units are a prefix): a gist is a unit of its own,
    consecutive tokens of one K-aligned block share one. Padding goes to slot ``units``, which is dropped.
    A cut has at most ``T/K`` units (I1, I8); a row with more (not a cut) has its extra units dropped too."""
    block = wc.start // K
    after_token_of_block = F.pad((wc.lod[:, :-1] == 0) & (block[:, :-1] == block[:, 1:]), (1, 0), value=False)
    head = wc.valid & ((wc.lod > 0) | ~after_token_of_block)
    unit = (head.long().cumsum(-1) - 1).clamp(max=units)
    return torch.where(wc.valid, unit, units)


@typechecked
def unit_sums(x: Shaped[Tensor, "r w c"], unit: Int[Tensor, "r w"], units: int) -> Shaped[Tensor, "r u c"]:
    """Per unit, the sum of its entries' rows ``x`` (slot ``units``, padding, dropped)."""
    sums = x.new_zeros(x.size(0), units + 1, x.size(-1))
    return sums.scatter_add(1, repeat(unit, "r w -> r w c", c=x.size(-1)), x)[:, :units]


@typechecked
def pool_blocks(wc: WorkingContext, unit: Int[Tensor, "r w"], units: int) -> WorkingContext:
    """The units as a working context ``[R, units]``: mean embedding, the unit's first start, summed span
    (K for a block of tokens, the gist's own span), its first entry's LOD, position at the span centre."""
    first = (unit != F.pad(unit[:, :-1], (1, 0), value=-1)) & wc.valid
    columns = torch.stack((wc.valid.long(), wc.start * first, wc.span, wc.lod * first), dim=-1)  # exact in int64
    count, start, span, lod = unit_sums(columns, unit, units).unbind(-1)
    valid = count > 0
    emb = unit_sums(wc.emb.detach(), unit, units) / count.clamp(min=1)[..., None]
    span = span.clamp(min=1)
    return WorkingContext(
        emb=emb,
        position=(start + (span - 1) / 2).float(),
        start=start,
        span=span,
        lod=lod,
        node=torch.zeros_like(start),
        target=torch.full_like(start, -1),
        valid=valid,
        batch_size=[wc.batch_size[0], units],
    )


@typechecked
def unit_votes(
    wc: WorkingContext, tokens: Int[Tensor, "r t"], horizon: Int[Tensor, " r"], K: int, reach: int, n: int = NGRAM
) -> Float[Tensor, "r u"]:
    """The match votes (of ``n``-grams) on each unit's span ``[R, units]``, read from ``tokens`` up to ``horizon``."""
    votes = match_votes(tokens, horizon, K, reach, n)  # [R, t / K]
    running = F.pad(votes.cumsum(-1), (1, 0))
    first = (wc.start // K).clamp(max=votes.size(1))
    last = ((wc.start + wc.span) // K).clamp(max=votes.size(1))
    return (running.gather(1, last) - running.gather(1, first)).clamp(min=0) * wc.valid


@typechecked
def newest_read(
    q: Float[Tensor, "r h u e"], k: Float[Tensor, "r h u e"], v: Float[Tensor, "r h u e"], valid: Bool[Tensor, "r u"],
    newest: int,
) -> Float[Tensor, "r h u e"]:  # fmt: skip
    """LensNet's attention: each unit reads itself and the ``newest`` valid units of its row (valid units are a
    prefix), the recent text it is judged against. A row of at most ``newest`` units, as every training context is
    (``T/K``), reads all of them, exactly the bidirectional read; a long view's 4,096 units read 65 keys each instead
    of 4,096, which took 70 % of a refocus at 32k (LABLOG, thirty-eighth session)."""
    units = q.size(2)
    if units <= newest:  # a static shape: the whole row, as in training
        return F.scaled_dot_product_attention(q, k, v, attn_mask=rearrange(valid, "r u -> r 1 1 u"))
    first = valid.sum(-1, keepdim=True) - newest  # [r, 1]: the oldest of the newest, negative in a short row
    slot = first + torch.arange(newest, device=q.device)  # [r, m]
    index = repeat(slot.clamp(min=0), "r m -> r h m e", h=q.size(1), e=q.size(3))
    k_new, v_new = k.gather(2, index), v.gather(2, index)
    own = torch.arange(units, device=q.device)[None, :, None] == slot[:, None, :]  # [r, u, m]: itself, read once
    read = (slot >= 0)[:, None, :] & ~own
    scale = q.size(-1) ** -0.5
    scores = torch.einsum("rhue,rhme->rhum", q, k_new) * scale
    scores = scores.masked_fill(~read[:, None], float("-inf"))
    weights = torch.cat((scores, (q * k).sum(-1, keepdim=True) * scale), -1).softmax(-1)
    return torch.einsum("rhum,rhme->rhue", weights[..., :-1], v_new) + weights[..., -1:] * v
