"""LensNet: one signed score per working-context entry.

``> 0``: expanding this entry into its ``K`` children would lower the loss on what comes next.
``< 0``: this entry and its siblings can be collapsed into their parent at little cost.

A small **bidirectional** transformer (the GPT's block without the causal mask), so that old entries see the recent text
they are judged against. It reads a context only up to the horizon (I11): the tail it is scored on stays unseen. Padding
is masked out of attention, and each unit reads itself and the newest ``T/K`` units (all of a training context's;
:func:`~mcfn.core.units.newest_read`), so a 32k view costs 65 keys a unit. Units carry their (damped) rotary text
position, and three features are added to the input: a learned embedding of the LOD, and the log-span and distance back
from the newest entry (both scaled to [0, 1]; the distance in units of the training ``T``, every unit farther back than
``T`` at 1, so that no history is longer than those LensNet trained on). Units keep their text positions, not the base
model's position rule (:mod:`mcfn.core.positions`): rotated at their place in the row, LensNet's gated and branch
candidates lost the pass key on validation (0.86 and 0.68 against 0.95 and 0.90, LABLOG, thirty-seventh session), and at
text positions it still picks a key 32k tokens back. The inputs are the entries' embeddings, detached: the policy learns
to read the tree, not to reshape it. With ``mc.lens.match_prior`` the score is the match's own (:func:`match_prior`: its
votes plus its recency prior) plus what the transformer adds: all of it (``"sum"``, its head starting at zero, so that a
new LensNet cuts as ``match`` does), or only where it stands out from the rest of its row (``"gated"``,
:func:`standing_out`), so that a LensNet trained without the prior keeps ``match``'s cut on text and overrides it where
it is sure, as at a pass key. (A prior bounded to ``(-1, 2)``, every voted block above every unvoted one, cut worse than
truncation on text: LABLOG, issue 53.)

With ``mc.lens.indexer`` LensNet is a **query-aware indexer** over ``match`` (DeepSeek-V3.2's lightning indexer,
Landmark and InfLLM's per-block keys read by the current query): its query is the base model's own hidden states
over the newest :data:`QUERY_TOKENS` tokens before the horizon (:func:`horizon_query`, read alone, causally, so
nothing after the horizon enters it, I11), added to every unit's input and read against each unit's key (the
transformer's output) by ReLU dot products weighted per head by the query; each unit's input also holds ``match``'s
votes for ``n`` = 2, 3 and 4 (exact recurrence, which a mean embedding cannot show). The prior it adds to is
``match``'s score rescaled per row (:func:`rescaled`: the same order and signs, on the scale its losses train at; the
raw votes' counts made the attention target's KL 35-85 nats at the start). Its heads start at zero, so a new indexer
cuts exactly as ``match`` does (under either prior). Every cut it chooses (:meth:`LensNet.scorer`) keeps the newest
``(W - H) / 2`` tokens before the horizon at LOD0 (:func:`with_recent_window`, NSA's sliding branch; half of what
lies before the horizon in training): the learned choice spends the rest of the budget.

The transformer reads *units* instead of entries: each gist is a unit, and so
is each K-aligned block of shown tokens (their embeddings averaged), whose score every token of the block
shares. Every decision is block-level (a gist expands, a complete group of K collapses), and each unit
covers at least K tokens, so a cut over T tokens has at most ``T/K`` units whatever the budget ``W``.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from mcfn.core.context import Scorer, WorkingContext, read_end
from mcfn.core.match import NGRAM
from mcfn.core.model import GPT, ROPE_BASE, Block, rms_norm, rotary_tables
from mcfn.core.nodes import Layout
from mcfn.core.units import block_units, newest_read, pool_blocks, unit_capacity, unit_votes
from mcfn.typecheck import typechecked

QUERY_TOKENS = 32  # the newest tokens before the horizon whose base-model states are the indexer's query
VOTE_NGRAMS = (2, 3, 4)  # the n-gram lengths of the match votes the indexer reads per unit (NGRAM among them)
INDEX_HEADS, INDEX_DIM = 4, 32  # the lightning-indexer term's heads and their query-key width
RECENT_PRIORITY = 1.0e4  # added to the scores of the recent window's entries: above any other, order kept


GATE_Z = 2.0  # standard deviations above its row's mean where a gated prior lets LensNet's own score through


def row_moments(x: Float[Tensor, "r u"], valid: Bool[Tensor, "r u"]) -> tuple[Tensor, Tensor]:
    """Each row's mean and standard deviation over its valid entries, ``[R, 1]`` each."""
    n = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = (x * valid).sum(-1, keepdim=True) / n
    return mean, ((((x - mean) * valid) ** 2).sum(-1, keepdim=True) / n).sqrt()


@typechecked
def standing_out(learned: Float[Tensor, "r u"], valid: Bool[Tensor, "r u"]) -> Bool[Tensor, "r u"]:
    """Which units' scores lie more than :data:`GATE_Z` standard deviations above the mean of their row's valid
    units: where the gated prior adds LensNet's score to the match's. Unchanged by scaling or shifting a row's
    scores; none in a row whose scores are all equal (a new LensNet's zero head)."""
    mean, spread = row_moments(learned, valid)
    return valid & (learned - mean > GATE_Z * spread) & (spread > 0)


@torch.no_grad()
@typechecked
def horizon_query(base: GPT, tokens: Int[Tensor, "r t"], now: Int[Tensor, " r"]) -> Float[Tensor, "r q2"]:
    """The indexer's query ``[R, 2D]``: the base model's final hidden state at the newest token before ``now`` (one
    past each row's horizon) and their mean over the :data:`QUERY_TOKENS` up to it, the tokens read alone from
    position 0. Where the history is shorter the read starts at the window's first token; the positions after the
    horizon that the read then holds are never read by the ones kept (causal), so nothing after it enters (I11)."""
    count = min(QUERY_TOKENS, tokens.size(1))
    first = (now - count).clamp(min=0)
    at = torch.arange(count, device=tokens.device)
    hidden = base.token_hidden(tokens.gather(1, first[:, None] + at))  # [R, count, D]
    last = (now - 1 - first).clamp(min=0)  # the newest token's place in the read
    kept = (at[None] <= last[:, None]).float()
    mean = torch.einsum("rn,rnd->rd", kept, hidden.float()) / kept.sum(-1, keepdim=True)
    newest = hidden.gather(1, repeat(last, "r -> r 1 d", d=hidden.size(-1)))[:, 0].float()
    return torch.cat([newest, mean], dim=-1)


@typechecked
def recent_first(score: Scorer, recent: int, wc: WorkingContext) -> Float[Tensor, "r w"]:
    """``score``'s scores of ``wc`` with every entry whose span ends within the ``recent`` tokens before the horizon
    ranked above every other (their order kept): the allocator expands them first and collapses them last, so a cut
    keeps them at LOD0 while the budget holds them."""
    scores = score(wc)
    recent_entry = wc.start + wc.span > read_end(wc)[:, None] - recent
    return torch.where(wc.valid & recent_entry, scores + RECENT_PRIORITY, scores)


def with_recent_window(score: Scorer, recent: int) -> Scorer:
    """``score`` with the newest ``recent`` tokens first (:func:`recent_first`)."""
    return partial(recent_first, score, recent)


@typechecked
def rescaled(scores: Float[Tensor, "r u"], valid: Bool[Tensor, "r u"]) -> Float[Tensor, "r u"]:
    """Each row's valid ``scores`` over their standard deviation (unchanged where they are all equal): the same
    order and signs, so the same cut (the allocator compares a row's scores with each other and with the zero it
    gives nodes no view scores, never with a threshold of another scale), on the scale of the learned terms and the
    losses they train under (softmax, logistic, budget), whatever the votes' counts. Not centred: a shift would
    move them past that zero."""
    spread = row_moments(scores, valid)[1]
    return torch.where(valid, scores / torch.where(spread > 0, spread, 1.0), 0.0)


def match_prior(votes: Float[Tensor, "r u"], back: Float[Tensor, "r u"]) -> Float[Tensor, "r u"]:
    """The match's own score (:func:`mcfn.core.match.match_scorer`): its copy votes on the unit, minus the distance
    ``back`` over the view's length, so that a new LensNet with the prior cuts exactly as ``match`` does."""
    return votes - back


class LensNet(nn.Module):
    def __init__(
        self,
        d_model: int,
        width: int,
        n_layer: int,
        n_head: int,
        layout: Layout,
        match_reach: int = 0,
        match_prior: str = "",
        indexer: bool = False,
    ):
        super().__init__()
        if match_prior and match_reach < 1:
            raise ValueError("the match prior needs the predictions a cut serves (mc.refocus_every)")
        if indexer and not match_prior:
            raise ValueError("the indexer is a residual over match: it needs the match prior")
        self.layout, self.head_dim = layout, width // n_head
        self.match_reach = match_reach  # the predictions a cut serves (mc.refocus_every), for the match's votes
        self.match_prior = match_prior
        self.indexer = indexer
        # The indexer's recent window: half of what lies before the horizon in training (the tail holds H of W).
        self.recent = (layout.W - layout.H) // 2 if indexer else 0
        self.in_proj = nn.Linear(d_model, width, bias=False)
        self.lod_emb = nn.Parameter(torch.zeros(layout.L + 1, width))
        self.feature_proj = nn.Linear(2 + len(VOTE_NGRAMS) * indexer, width, bias=False)
        self.blocks = nn.ModuleList(Block(width, n_head) for _ in range(n_layer))
        self.head = nn.Linear(width, 1, bias=False)
        if indexer:
            self.query_in = nn.Linear(2 * d_model, width, bias=False)  # the query, added to every unit's input
            self.index_query = nn.Linear(2 * d_model, INDEX_HEADS * INDEX_DIM, bias=False)
            self.index_key = nn.Linear(width, INDEX_HEADS * INDEX_DIM, bias=False)
            self.index_weight = nn.Linear(2 * d_model, INDEX_HEADS, bias=False)  # per head, from the query
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = math.sqrt(3.0 / self.in_proj.in_features)
        nn.init.uniform_(self.in_proj.weight, -bound, bound)
        nn.init.normal_(self.lod_emb, std=0.02)
        nn.init.normal_(self.feature_proj.weight, std=0.02)
        for block in self.blocks:
            block.reset_parameters()
        nn.init.normal_(self.head.weight, std=0.0 if self.match_prior else 0.01)  # with the prior: match's cut
        if self.indexer:
            for proj in (self.query_in, self.index_query, self.index_key):
                nn.init.uniform_(proj.weight, -math.sqrt(3.0 / proj.in_features), math.sqrt(3.0 / proj.in_features))
            nn.init.zeros_(self.index_weight.weight)  # a new indexer adds nothing: match's cut

    @typechecked
    def forward(
        self,
        wc: WorkingContext,
        layout: Layout | None = None,
        tokens: Int[Tensor, "r t"] | None = None,
        base: GPT | None = None,
        query: Float[Tensor, "r q2"] | None = None,
        scale: Int[Tensor, ""] | None = None,
        reach: int | None = None,
    ) -> Float[Tensor, "r w"]:
        """Scores ``[R, W]`` of the entries of ``wc``, a cut of ``layout`` (by default the training one); with the
        match prior, ``tokens`` are each row's window (only what lies up to its newest entry is read); the indexer
        also reads ``base`` (its :func:`horizon_query` over them) unless given the ``query`` of each row's horizon.
        ``scale``: the length of the view read, which the prior's distance is over (by default ``layout.T``);
        ``reach``: the predictions a cut serves, which the match votes run over (by default ``mc.refocus_every``)."""
        layout = self.layout if layout is None else layout
        units = unit_capacity(wc.batch_size[1], layout)
        unit = block_units(wc, layout.K, units)
        if self.indexer and query is None:  # a config constant: static under compile
            if base is None or tokens is None:
                raise ValueError("LensNet's indexer reads the base model's states over the window's tokens")
            query = horizon_query(base, tokens, read_end(wc))
        scale = layout.T if scale is None else scale
        scores = F.pad(self.score(pool_blocks(wc, unit, units), tokens, scale, query, reach), (0, 1))  # padding: 0
        return scores.gather(1, unit) * wc.valid

    def scorer(
        self,
        layout: Layout,
        window: Int[Tensor, "r t"],
        base: GPT,
        scale: Int[Tensor, ""] | None = None,
        reach: int | None = None,
    ) -> Scorer:
        """The ``lens`` focus policy's scorer of the working contexts of ``layout`` over ``window``'s rows, reading
        ``base`` where the indexer does; with the indexer's recent window, every cut keeps the newest tokens at
        LOD0. ``scale``: the length of the view read (by default ``layout.T``; a view padded to a fixed shape gives
        its own, :mod:`mcfn.inference.choice`); ``reach``: the predictions each cut serves under the refocus rule
        (by default the run's ``mc.refocus_every``)."""
        score = partial(self, layout=layout, tokens=window[:, : layout.T], base=base, scale=scale, reach=reach)
        return with_recent_window(score, self.recent) if self.recent else score

    def score(
        self,
        wc: WorkingContext,
        tokens: Tensor | None = None,
        scale: int | Tensor | None = None,
        query: Tensor | None = None,
        reach: int | None = None,
    ) -> Float[Tensor, "r w"]:
        """The transformer over the rows of ``wc`` (units), one score per valid one; ``scale``: the length of the
        layout read (the prior's distance is over it, as ``match``'s is; by default the training ``T``); ``query``:
        the indexer's; ``reach``: the match votes' (by default ``match_reach``)."""
        T, L = self.layout.T, self.layout.L
        end = wc.start + wc.span
        # Distance back from the last entry read (the newest token before the horizon, I11), in units of the
        # training T: in training that is the tail's first token; while streaming, the newest real token.
        now = read_end(wc)[:, None]
        back = ((now - end).float() / T).clamp(max=1.0)  # the match's recency prior is its negative
        features = [torch.log2(wc.span.float()) / max(1.0, math.log2(self.layout.K) * L), back]
        if self.match_prior and tokens is None:
            raise ValueError("LensNet's match prior needs the window's tokens")
        # The match votes per n-gram length, each computed once: the indexer's features, and the prior's (n = NGRAM).
        lengths = VOTE_NGRAMS if self.indexer else (NGRAM,) if self.match_prior else ()  # config constants: static
        reach = self.match_reach if reach is None else reach
        votes = {n: unit_votes(wc, tokens, now[:, 0] - 1, self.layout.K, reach, n) for n in lengths}
        if self.indexer:
            features += [torch.log1p(votes[n]) for n in VOTE_NGRAMS]
        x = (
            self.in_proj(rms_norm(wc.emb.detach()))
            + self.lod_emb[wc.lod]
            + self.feature_proj(torch.stack(features, -1))
        )
        if self.indexer:
            x = x + self.query_in(rms_norm(query))[:, None]
        cos, sin = rotary_tables(wc.position, wc.span.float(), self.head_dim, ROPE_BASE)
        attend = partial(newest_read, valid=wc.valid, newest=self.layout.T // self.layout.K)
        for block in self.blocks:
            x = block(x, cos, sin, attend)
        x = rms_norm(x)
        learned = self.head(x).squeeze(-1)
        if self.indexer:
            q = rearrange(self.index_query(rms_norm(query)), "r (h e) -> r h e", h=INDEX_HEADS)
            k = rearrange(self.index_key(x), "r u (h e) -> r u h e", h=INDEX_HEADS)
            relevance = F.relu(torch.einsum("rhe,ruhe->ruh", q, k)) / math.sqrt(INDEX_DIM)
            learned = learned + torch.einsum("ruh,rh->ru", relevance, self.index_weight(rms_norm(query)))
        if self.match_prior:  # a config constant: static under compile
            if self.match_prior == "gated":
                learned = learned * standing_out(learned, wc.valid)
            prior = match_prior(votes[NGRAM], (now - end).float() / (T if scale is None else scale))
            learned = learned + (rescaled(prior, wc.valid) if self.indexer else prior)
        return learned * wc.valid
