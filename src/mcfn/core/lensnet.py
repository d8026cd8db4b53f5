"""LensNet: one signed score per working-context entry.

``> 0``: expanding this entry into its ``K`` children would lower the loss on what comes next.
``< 0``: this entry and its siblings can be collapsed into their parent at little cost.

A small **bidirectional** transformer (the GPT's block without the causal mask), so that old entries
see the recent text they are judged against. It reads a context only up to the horizon (I11): the tail
it is scored on stays unseen. Padding is masked out of attention. Entries carry
their (damped) rotary position, and three features added to the input: a learned embedding of the
LOD, and the log-span and distance back from the newest entry (both scaled to about [0, 1]). The inputs are the
entries' embeddings, detached: the policy learns to read the tree, not to reshape it. With
``mc.lens.match_prior`` the score is the match's own (:func:`match_prior`: its votes plus its recency prior) plus
what the transformer adds: all of it (``"sum"``, its head starting at zero, so that a new LensNet cuts as ``match``
does), or only where it stands out from the rest of its row (``"gated"``, :func:`standing_out`), so that a LensNet
trained without the prior keeps ``match``'s cut on text and overrides it where it is sure, as at a pass key. (A
prior bounded to ``(-1, 2)``, every voted block above every unvoted one, cut worse than truncation on text: LABLOG,
issue 53.)

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
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor, nn

from mcfn.core.context import Scorer, WorkingContext
from mcfn.core.match import match_votes
from mcfn.core.model import ROPE_BASE, Block, bidirectional, rms_norm, rotary_tables
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
    wc: WorkingContext, tokens: Int[Tensor, "r t"], horizon: Int[Tensor, " r"], K: int, reach: int
) -> Float[Tensor, "r u"]:
    """The match votes on each unit's span ``[R, units]``, read from ``tokens`` up to ``horizon``."""
    votes = match_votes(tokens, horizon, K, reach)  # [R, t / K]
    running = F.pad(votes.cumsum(-1), (1, 0))
    first = (wc.start // K).clamp(max=votes.size(1))
    last = ((wc.start + wc.span) // K).clamp(max=votes.size(1))
    return (running.gather(1, last) - running.gather(1, first)).clamp(min=0) * wc.valid


GATE_Z = 2.0  # standard deviations above its row's mean where a gated prior lets LensNet's own score through


@typechecked
def standing_out(learned: Float[Tensor, "r u"], valid: Bool[Tensor, "r u"]) -> Bool[Tensor, "r u"]:
    """Which units' scores lie more than :data:`GATE_Z` standard deviations above the mean of their row's valid
    units: where the gated prior adds LensNet's score to the match's. Unchanged by scaling or shifting a row's
    scores; none in a row whose scores are all equal (a new LensNet's zero head)."""
    n = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = (learned * valid).sum(-1, keepdim=True) / n
    spread = ((((learned - mean) * valid) ** 2).sum(-1, keepdim=True) / n).sqrt()
    return valid & (learned - mean > GATE_Z * spread) & (spread > 0)


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
    ):
        super().__init__()
        if match_prior and match_reach < 1:
            raise ValueError("the match prior needs the predictions a cut serves (mc.refocus_every)")
        self.layout, self.head_dim = layout, width // n_head
        self.match_reach = match_reach  # the predictions a cut serves (mc.refocus_every), for the match's votes
        self.match_prior = match_prior
        self.in_proj = nn.Linear(d_model, width, bias=False)
        self.lod_emb = nn.Parameter(torch.zeros(layout.L + 1, width))
        self.feature_proj = nn.Linear(2, width, bias=False)
        self.blocks = nn.ModuleList(Block(width, n_head) for _ in range(n_layer))
        self.head = nn.Linear(width, 1, bias=False)
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

    @typechecked
    def forward(
        self, wc: WorkingContext, layout: Layout | None = None, tokens: Int[Tensor, "r t"] | None = None
    ) -> Float[Tensor, "r w"]:
        """Scores ``[R, W]`` of the entries of ``wc``, a cut of ``layout`` (by default the training one); with the
        match prior, ``tokens`` are each row's window (only what lies up to its newest entry is read)."""
        layout = self.layout if layout is None else layout
        units = unit_capacity(wc.batch_size[1], layout)
        unit = block_units(wc, layout.K, units)
        scores = F.pad(self.score(pool_blocks(wc, unit, units), tokens, layout.T), (0, 1))  # padding scores 0
        return scores.gather(1, unit) * wc.valid

    def scorer(self, layout: Layout, window: Int[Tensor, "r t"]) -> Scorer:
        """The ``lens`` focus policy's scorer of the working contexts of ``layout`` over ``window``'s rows."""
        return partial(self, layout=layout, tokens=window[:, : layout.T])

    def score(self, wc: WorkingContext, tokens: Tensor | None = None, scale: int = 0) -> Float[Tensor, "r w"]:
        """The transformer over the rows of ``wc`` (units), one score per valid one; ``scale``: the length of the
        layout read (the prior's distance is over it, as ``match``'s is)."""
        T, L = self.layout.T, self.layout.L
        end = wc.start + wc.span
        # Distance back from the last entry read (the newest token before the horizon, I11), in units of the
        # training T: in training that is the tail's first token; while streaming, the newest real token.
        now = torch.where(wc.valid, end, 0).amax(-1, keepdim=True)
        back = (now - end).float() / T  # in [0, 1): the match's recency prior is its negative
        features = torch.stack([torch.log2(wc.span.float()) / max(1.0, math.log2(self.layout.K) * L), back], dim=-1)
        x = self.in_proj(rms_norm(wc.emb.detach())) + self.lod_emb[wc.lod] + self.feature_proj(features)
        cos, sin = rotary_tables(wc.position, wc.span.float(), self.head_dim, ROPE_BASE)
        attend = partial(bidirectional, mask=rearrange(wc.valid, "r w -> r 1 1 w"))  # valid keys only
        for block in self.blocks:
            x = block(x, cos, sin, attend)
        learned = self.head(rms_norm(x)).squeeze(-1)
        if self.match_prior:  # a config constant: static under compile
            if tokens is None:
                raise ValueError("LensNet's match prior needs the window's tokens")
            if self.match_prior == "gated":
                learned = learned * standing_out(learned, wc.valid)
            votes = unit_votes(wc, tokens, now[:, 0] - 1, self.layout.K, self.match_reach)
            learned = learned + match_prior(votes, (now - end).float() / (scale or T))
        return learned * wc.valid
