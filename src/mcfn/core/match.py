"""``match``, a training-free focus: the far text that an n-gram copy would read next.

The far past pays by exact recall, and which far text a tail will copy becomes legible only a few tokens before
the copy (LABLOG). So: each of the newest ``queries`` positions ``j`` up to the horizon ``h`` looks
up every earlier position ``p`` whose n-gram (the tokens ``p - n + 1 .. p``) equals its own. If the text after ``p``
were being copied, the prediction at ``h + t`` would read position ``p + (h - j) + t``; each match votes
``1 / (the matches of j's n-gram)`` on those positions for ``t`` in ``[0, reach)``, the tokens read before the next
refocus. A block's votes are the sum over its ``K`` positions (:func:`match_votes`, which LensNet can read as a
feature). As a scorer (:func:`match_scorer`), a block scores its votes plus a small recency prior in ``(-1, 0]``,
so that a block any copy points at ranks above every block none does, and the rest fall back to truncation's
order, newest first.

Everything read lies at or before the horizon (I11): queries, their matches and the votes' positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.context import WorkingContext, read_end
from mcfn.typecheck import typechecked

NGRAM = 3  # n: trigrams (chosen on training windows against n = 2; LABLOG)
QUERIES = 32  # the newest positions up to the horizon that look up their n-gram
KEY_BASE = 65537  # above every token id (data.vocab_size <= 65536)


@typechecked
def ngram_keys(tokens: Int[Tensor, "b t"], n: int) -> Int[Tensor, "b t"]:
    """Per position ``p``, a key of the n-gram ending there (``tokens[p - n + 1 .. p]``); ``-1 - p`` before the
    first full n-gram, which matches nothing. Exact for ids below ``KEY_BASE`` up to trigrams; longer n-grams wrap
    around int64, which keeps equal n-grams equal and makes a collision of two others vanishingly rare."""
    key = tokens.clone()
    for back in range(1, n):
        key = key * KEY_BASE + F.pad(tokens, (back, 0))[:, : tokens.size(1)]
    first = torch.arange(tokens.size(1), device=tokens.device) < n - 1
    return torch.where(first, -1 - torch.arange(tokens.size(1), device=tokens.device), key)


@typechecked
def match_votes(
    tokens: Int[Tensor, "b t"],
    horizon: Int[Tensor, " b"],
    block: int,
    reach: int,
    n: int = NGRAM,
    queries: int = QUERIES,
    lookahead: int = 0,
) -> Float[Tensor, "b blocks"]:
    """The copy votes on each block of ``block`` tokens, ``[B, t // block]``, read from ``tokens`` up to ``horizon``
    (inclusive): see the module docstring. ``reach``: the predictions a cut serves (``mc.refocus_every``).
    ``lookahead``: the queries end that many positions past the horizon, on tokens that are a draft of what
    follows it (the evaluation's ``draft_match``, :mod:`mcfn.evaluation.oracle`); the votes stay on text up to it."""
    B, T = tokens.shape
    device = tokens.device
    keys = ngram_keys(tokens, n)
    position = torch.arange(T, device=device)
    query = horizon[:, None] + lookahead - torch.arange(queries, device=device)  # [B, Q], newest first
    ok = query >= n - 1
    query_key = keys.gather(1, query.clamp(min=0))
    earlier = position[None, None, :] < query[:, :, None]  # p < j
    if lookahead:  # a Python constant: the default graph is unchanged
        earlier = earlier & (position <= horizon[:, None])[:, None]  # a match on text, never on the draft
    match = (keys[:, None, :] == query_key[:, :, None]) & earlier & ok[:, :, None]  # [B, Q, T]
    weight = match.float() / match.sum(-1, keepdim=True).clamp(min=1)
    # The first position each match's copy reads, p + (h - j); its votes run over the next ``reach`` positions.
    first = position[None, None, :] + (horizon[:, None] - query)[:, :, None]
    inside = first <= horizon[:, None, None]
    if lookahead:  # a draft's query reads before its match: a copy's start can fall before the first token
        inside = inside & (first >= 0)
    starts = torch.zeros(B, T + reach + 1, device=device).scatter_add_(
        1, torch.where(inside, first, T + reach).flatten(1), (weight * inside).flatten(1)
    )
    running = starts.cumsum(-1)
    votes = running[:, :T] - F.pad(running, (reach, 0))[:, :T]  # the starts in (q - reach, q]
    votes = votes * (position[None] <= horizon[:, None])
    return votes[:, : T // block * block].view(B, T // block, block).sum(-1)


def match_scorer(tokens: Int[Tensor, "b t"], block: int, reach: int, scale: int | Tensor, lookahead: int = 0):
    """A scorer for :func:`~mcfn.core.focus.focus_cut` (and :func:`~mcfn.core.focus.refocus`) of the working
    contexts of ``tokens``' rows: each entry of the block view scores its block's :func:`match_votes` (read up to the
    newest entry it is given, and ``lookahead`` draft tokens past it) plus a recency prior in ``(-1, 0]``, the
    distance back from that entry over ``scale`` tokens."""

    @typechecked
    def score(wc: WorkingContext) -> Float[Tensor, "r w"]:
        end = wc.start + wc.span
        now = read_end(wc)  # one past the horizon: seen_until cut the rest
        votes = match_votes(tokens, now - 1, block, reach, lookahead=lookahead)
        blocks = votes.size(1)
        index = (wc.start // block).clamp(max=blocks - 1)
        prior = -(now[:, None] - end).float() / scale
        return torch.where(wc.valid, votes.gather(1, index) + prior, 0.0)

    return score
