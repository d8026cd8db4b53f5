"""``match``, a training-free focus: the far text that an n-gram copy would read next.

The far past pays by exact recall, and which far text a tail will copy becomes legible only a few tokens before
the copy (LABLOG). So: each of the newest ``queries`` positions ``j`` up to the horizon ``h`` looks up the newest
earlier position ``p`` whose n-gram (the tokens ``p - n + 1 .. p``) equals its own. If the text after ``p`` were being
copied, the prediction at ``h + t`` would read position ``p + (h - j) + t``; the query votes 1 on those positions for
``t`` in ``[0, reach)``, the tokens read before the next refocus. Only the newest match votes: votes shared among
every match (1 / their count each) put a little on every far block where a common n-gram recurs, more of them the
longer the history, each ranking above every unvoted block near the tail; the newest alone reads text better at
T/W = 4 on three corpora (LABLOG, forty-sixth session). A block's votes are the sum over its ``K``
positions (:func:`match_votes`, which LensNet can read as a feature). As a scorer (:func:`match_scorer`), a block
scores its votes plus a small recency prior in ``(-1, 0]``, so that a block any copy points at ranks above every
block none does, and the rest fall back to truncation's order, newest first.

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
    position = torch.arange(T, device=device)[None, :, None]  # [1, T, 1]
    query = horizon[:, None] + lookahead - torch.arange(queries, device=device)  # [B, Q], newest first
    ahead = torch.arange(queries, device=device) - lookahead  # [Q]: h - j, how far past its match a copy reads first
    # past[:, x, i]: the token n - 1 - i places before x; a strided view, no copy. Every comparison below reads it at
    # a fixed offset, so the compiled kernel's loads are contiguous (a scatter of every (query, position) pair took
    # 5-7 ms at 32k; LABLOG, forty-first session). The padding is never read where the mask holds.
    past = F.pad(tokens, (n - 1, 0)).unfold(1, n, 1)  # [B, T, n]
    said = [tokens.gather(1, (query - back).clamp(min=0))[:, None, :] for back in range(n)]  # [B, 1, Q] each
    # Each earlier position p whose n-gram is query j's (on text, never on the draft) ...
    match = (query[:, None, :] >= n - 1) & (position >= n - 1) & (position < query[:, None, :])  # [B, T, Q]
    if lookahead:  # a Python constant: the default graph is unchanged
        match = match & (position <= horizon[:, None, None])
    for back in range(n):
        match = match & (past[:, :, n - 1 - back : n - back] == said[back])
    # ... of which the newest starts a copy at x = p + ahead[j], the first position it reads from the horizon on.
    newest = torch.where(match, position, -1).amax(1, keepdim=True)  # [B, 1, Q]: -1 where nothing matches
    start = (newest >= 0) & (position == newest + ahead)  # [B, T, Q]
    now = position[:, :, 0] <= horizon[:, None]  # [B, T]
    running = (start.sum(-1).float() * now).cumsum(-1)  # the copies starting at or before each position
    votes = (running - F.pad(running, (reach, 0))[:, :T]) * now  # the starts in (q - reach, q]
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
