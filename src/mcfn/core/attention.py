"""Where the base model's attention goes: a target for LensNet, and the training-free ``attn`` focus.

The base model's forward with, beside its hidden states, the **attention** of the tail's entries: each tail
query's probabilities over the entries, summed over layers and heads. The hidden states come from the
fused attention as in :meth:`mcfn.core.model.GPT.hidden`; the probabilities are the same attention written
out for the tail's rows only, detached.

``loss_lens_attn`` (weight ``mc.lens.attention_weight``) turns the full window's attention into a dense
auxiliary signal for LensNet. The pairwise preferences tell LensNet which of two working contexts predicted
the tail better, a few bits per pair that mostly say "recent text matters"; the teacher's forward over all
``T`` tokens tells it, for every node of the tree, how much the tail reads the text under it. Most tail
tokens are predicted from recent text, so a plain sum over the tail's queries drowns the few that fetch
from far back (a pass key's answer among 64 tail tokens). Each query is therefore weighted by what the far
past is worth to it (as LongPPL picks its key tokens): the recency baseline's NLL on its target less the
full window's, floored at ``LONG_RANGE_FLOOR`` nats so a window without any long-range token still gives
a (recency-like) target. Per working context, LensNet's scores over the entries outside the tail, through
a softmax, are fitted to the share of that weighted mass under each entry's span (a cross-entropy,
reported as the KL divergence): a listwise, shift-invariant target, so it ranks the entries and leaves the
scores' offset to the preference loss.

Which entries the target reads is an :class:`AttentionTarget`: every entry before the tail, or for the query-aware
indexer only what its learned choice decides (:meth:`AttentionTarget.of`): the entries older than its recent
window, which every cut keeps at LOD0 anyway, with the first block's attention sink left out (as the indexer's recall
leaves it out). On the two design bases that took the indexer's text from 0.015 bpb behind ``match`` to 0.007 on
validation; fitted to the first ``R`` predictions alone it lost the pass key, and over the entries older than what
truncation shows it read less (LABLOG, twenty-ninth session).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.model import GPT, LayerAttention, causal_attention
from mcfn.core.nodes import Layout
from mcfn.core.outputs import StepOutput
from mcfn.typecheck import typechecked

LONG_RANGE_FLOOR = 0.1  # nats: a tail query's weight in the attention target when the far past does not help it


@dataclass(frozen=True)
class AttentionTarget:
    """What of the teacher's attention LensNet's scores are fitted to: the tail's, with the first ``sink`` tokens'
    share left out, over the entries that end at least ``near`` tokens before the horizon."""

    near: int = 0
    sink: int = 0

    @classmethod
    def of(cls, recent: int, layout: Layout) -> AttentionTarget:
        """The target of a LensNet whose cuts keep the ``recent`` tokens before the horizon at LOD0 (the indexer's
        window; 0: none): the entries before them, the sink left out; without a window, every entry."""
        return cls(near=recent, sink=layout.K) if recent else cls()


@typechecked
def long_range_mass(
    attention: Float[Tensor, "b h t"], recency_nll: Float[Tensor, "b h"], full_nll: Float[Tensor, "b h"], sink: int = 0
) -> Float[Tensor, "b t"]:
    """The tail's attention over the window, each query weighted by how much the far past lowers its NLL, with
    nothing on the first ``sink`` tokens."""
    weight = (recency_nll - full_nll).detach().clamp(min=0) + LONG_RANGE_FLOOR
    mass = torch.einsum("bh,bht->bt", weight, attention)
    return mass * (torch.arange(mass.size(1), device=mass.device) >= sink)


@typechecked
def hidden_and_tail_attention(
    base: GPT,
    emb: Float[Tensor, "r n d"],
    positions: Float[Tensor, "#r n"],
    spans: Float[Tensor, "#r n"],
    first: Int[Tensor, " r"],
    tail: int,
    attend: LayerAttention = causal_attention,
) -> tuple[Float[Tensor, "r n d"], Float[Tensor, "r h n"]]:
    """Final hidden states (normed, with gradient) and, for each of the ``tail`` query entries from ``first``
    on, its causal attention probabilities over the entries, summed over layers and heads (detached). ``attend``
    is how every entry attends (causally over all before it by default; the tail's read-out always reads all)."""
    query = first[:, None] + torch.arange(tail, device=emb.device)  # [r, h]
    future = torch.arange(emb.size(1), device=emb.device)[None, None, :] > query[:, :, None]  # [r, h, n]
    pick = rearrange(query, "r h -> r 1 h 1")
    per_layer = []

    def attend_and_read_out(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q_tail = q.detach().gather(2, pick.expand(-1, q.size(1), -1, q.size(-1)))  # [r, heads, h, e]
        logits = (q_tail @ k.detach().transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(
            future[:, None], -torch.inf
        )
        per_layer.append(torch.softmax(logits, -1).sum(1))
        return attend(layer, q, k, v)

    hidden = base.hidden(emb, positions, spans, attend=attend_and_read_out)
    return hidden, sum(per_layer)  # summed in layer order, as a running total would


@torch.no_grad()
@typechecked
def text_attention(base: GPT, tokens: Int[Tensor, "b n"], queries: int) -> Float[Tensor, "b q n"]:
    """Full attention's reading of a text: each of the last ``queries`` positions' causal attention over the
    ``tokens``, all at LOD0, summed over layers and heads (:func:`hidden_and_tail_attention`)."""
    at = torch.arange(tokens.size(1), device=tokens.device, dtype=torch.float32)[None]
    first = torch.full((tokens.size(0),), tokens.size(1) - queries, device=tokens.device)
    return hidden_and_tail_attention(base, base.embed(tokens), at, torch.ones_like(at), first, queries)[1]


@torch.no_grad()
@typechecked
def attention_mass(base: GPT, wc: WorkingContext, tail: int) -> Float[Tensor, "r w"]:
    """Per entry, the causal attention probability mass it receives from the last ``tail`` valid entries (the
    tail, I4, or as many as a row has), summed over queries, layers and heads (:func:`hidden_and_tail_attention`)."""
    count = wc.valid.sum(-1)
    first = (count - tail).clamp(min=0)
    attention = hidden_and_tail_attention(base, wc.emb, wc.position, wc.span.float(), first, tail)[1]
    is_query = (first[:, None] + torch.arange(tail, device=first.device)) < count[:, None]  # [r, tail]
    return torch.einsum("rh,rhn->rn", is_query.float(), attention) * wc.valid


@typechecked
def attention_scores(base: GPT, tail: int, wc: WorkingContext) -> Float[Tensor, "r w"]:
    """The ``attn`` focus's scorer: each entry's attention mass from the last ``tail`` entries, less the context's
    mean (bind ``base`` and ``tail`` with ``partial``). The bar a learned policy must clear: expand where the base
    model's own attention goes (as InfLLM and Quest pick blocks), read from the coarsest full-coverage context up to
    the horizon (I11); read past it, the tail's own tokens would pick the far blocks that hold them."""
    mass = attention_mass(base, wc, tail)
    mean = mass.sum(-1, keepdim=True) / wc.valid.sum(-1, keepdim=True)
    return torch.where(wc.valid, mass - mean, 0.0)


def local_and_tail_attention(window: int, tail: int, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention ``[b, h, n, e]`` in which every entry reads the ``window`` entries up to itself, and the last
    ``tail`` entries read every entry before them: a cost of about ``2·n·window + tail·n`` scores instead of
    ``n²/2``. Each block of ``window`` queries reads its own block and the one before it (``n`` a multiple of
    ``window``); with ``window >= n`` it is plain causal attention."""
    n = q.size(2)
    if window >= n:
        return causal_attention(layer, q, k, v)
    blocks = partial(rearrange, pattern="b h (m s) e -> b h m s e", s=window)
    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    before = partial(F.pad, pad=(0, 0, 0, 0, 1, 0))  # block m - 1 beside block m (zeros before the first)
    keys = torch.cat([before(kb)[:, :, :-1], kb], dim=3)
    values = torch.cat([before(vb)[:, :, :-1], vb], dim=3)
    i = torch.arange(window, device=q.device)[:, None]
    j = torch.arange(2 * window, device=q.device)[None] - window  # key offset from its block's start
    m = torch.arange(n // window, device=q.device)[:, None, None]
    allowed = (j <= i) & (i - j < window) & ((m > 0) | (j >= 0))  # [m, s, 2s]: causal, within the window, real
    local = rearrange(F.scaled_dot_product_attention(qb, keys, values, attn_mask=allowed), "b h m s e -> b h (m s) e")
    query = n - tail + torch.arange(tail, device=q.device)
    reads = torch.arange(n, device=q.device)[None] <= query[:, None]  # [tail, n]
    tail_out = F.scaled_dot_product_attention(q[:, :, n - tail :], k, v, attn_mask=reads)
    return torch.cat([local[:, :, : n - tail], tail_out], dim=2)


@typechecked
def node_mass(token_mass: Float[Tensor, "b t"], layout: Layout) -> Float[Tensor, "b nodes"]:
    """Every tree node's share of the mass: the sum over the tokens of its span, level after level."""
    levels = [token_mass]
    for _ in range(layout.L):
        levels.append(rearrange(levels[-1], "b (n k) -> b n k", k=layout.K).sum(-1))
    return torch.cat(levels, dim=-1)


@typechecked
def attention_target_loss(
    scores: Float[Tensor, "r w"],
    wc: WorkingContext,
    mass: Float[Tensor, "b nodes"],
    layout: Layout,
    weight: Float[Tensor, ""],
    near: int = 0,
) -> StepOutput:
    """``loss_lens_attn``: per working context, the cross-entropy from the tail's attention share under each
    entry outside the tail (and ending at least ``near`` tokens before it) to the softmax of LensNet's scores over
    those entries, averaged over contexts; ``mc/lens_attn_kl`` is the same as a KL divergence (0 when the scores
    rank as the attention does)."""

    def per_entry(per_node: Tensor) -> Tensor:  # [B, nodes] -> [B·V, W]: each entry's node's value
        rows = rearrange(per_node, "b n -> b 1 n").expand(-1, layout.V, -1).flatten(0, 1)
        return rows.gather(1, wc.node.clamp(min=0))

    candidates = wc.valid & (wc.start + wc.span <= layout.T - layout.H - near)
    entry_mass = torch.where(candidates, per_entry(mass), 0.0)
    target = entry_mass / entry_mass.sum(-1, keepdim=True).clamp(min=1e-9)
    log_q = torch.log_softmax(scores.masked_fill(~candidates, -torch.inf), -1)
    cross = -(target * torch.where(candidates, log_q, 0.0)).sum(-1)
    entropy = -(target * torch.log(target.clamp(min=1e-12))).sum(-1)
    return StepOutput({"loss_lens_attn": weight * cross.mean()}, {"mc/lens_attn_kl": (cross - entropy).mean()}, {})
