"""Attention oracles: what a LensNet fitted exactly to full attention's choice of blocks would cut, and how much of
it the signals legible at the horizon carry.

Issue 79's signal is full attention of the next ``R`` predictions, pooled per unit and distilled into LensNet's
scores. These conditions skip the distillation: per chunk of ``R`` predictions under generation's protocol, each
block-view entry is scored by the full window's attention of *that chunk's own* queries (summed over layers and
heads, the :func:`~mcfn.evaluation.indexer_recall.tail_attention` the recall reads), pooled over the entry's
tokens, the window's first block scored 0 (the attention sink, which the recall and the indexer's target leave out);
then the allocator every scored policy uses settles the cut, cold or warm as generation does.

* ``oracle_attn``: those scores alone;
* ``oracle_match``: ``match``'s scores and those, each over its row's standard deviation
  (:func:`~mcfn.core.lensnet.rescaled`), summed: the indexer's residual over ``match`` with its learned term
  replaced by its target;
* ``horizon_attn``: as ``oracle_attn``, but the mass from the ``R`` newest queries *up to* the chunk's horizon.
  Causal attention keeps it within I11, yet it reads every history token's keys at LOD0, which a stream does not
  keep: it says how much of the oracle's margin the base model's own queries at the horizon already carry;
* ``draft_attn``: as ``oracle_attn``, with the base model's own greedy draft of the chunk's ``R - 1`` tokens after
  the horizon in place of the real ones (a lookahead query, as FLARE drafts one): within I11, reading the history
  at LOD0 as ``horizon_attn`` does;
* ``draft_match``: ``match`` reading that draft as if it were text (its queries end at the draft's last token,
  :func:`~mcfn.core.match.match_votes`'s ``lookahead``): within I11, and a stream could run it (the draft costs
  ``R - 1`` token steps a refocus).

The first two read the chunk's future (its own predictions' attention), the next two the whole history in
detail, and every draft here is made under full attention, so none is a policy: nothing generation, the ship choice
or the best-of conditions iterate holds them, and only ``train.eval --oracle`` scores them. ``oracle_attn`` is the
cut of a perfect fit of the target (not a bound on every LensNet: one scoring otherwise could cut better); the others
say how much of it the horizon's own signals carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from mcfn.core.attention import text_attention
from mcfn.core.context import Scorer, WorkingContext
from mcfn.core.focus import Refocus
from mcfn.core.lensnet import rescaled
from mcfn.core.match import match_scorer
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout
from mcfn.core.policy import MATCH, Choice, FocusPolicy
from mcfn.core.stream_view import StreamView
from mcfn.core.system import MegaContext
from mcfn.evaluation.chunks import ChunkView
from mcfn.typecheck import typechecked

ORACLE_ATTN, ORACLE_MATCH, HORIZON_ATTN = "oracle_attn", "oracle_match", "horizon_attn"
DRAFT_ATTN, DRAFT_MATCH = "draft_attn", "draft_match"
ORACLES = (ORACLE_ATTN, ORACLE_MATCH, HORIZON_ATTN, DRAFT_ATTN, DRAFT_MATCH)


def without_sink(mass: Float[Tensor, "b n"], block: int, T: int) -> Float[Tensor, "b t"]:
    """``mass`` over the first ``n <= T`` tokens as mass over all ``T``, the first ``block`` (the sink) zeroed."""
    return F.pad(mass[:, block:], (block, T - mass.size(1)))


@typechecked
def chunk_mass(
    attention: Float[Tensor, "b q t"], chunk: Int[Tensor, "b h"], c: int, horizon: Int[Tensor, " b"], R: int, block: int
) -> dict[str, Float[Tensor, "b t"]]:
    """Per row, the attention mass on each token (the first ``block``, the sink, zeroed) of chunk ``c``'s own
    queries (``"future"``; ``chunk``: each of the last ``h`` columns' chunk, -1 where unscored) and of the ``R``
    newest queries up to its ``horizon`` (``"horizon"``): ``attention``'s ``q`` queries are the window's last."""
    q, T = attention.shape[1:]
    position = T - q + torch.arange(q, device=attention.device)
    own = F.pad(chunk == c, (q - chunk.size(1), 0), value=False)
    ahead = (position[None] <= horizon[:, None]) & (position[None] > horizon[:, None] - R)
    return {name: without_sink((attention * which[..., None]).sum(1), block, T)
            for name, which in (("future", own), ("horizon", ahead))}  # fmt: skip


@dataclass(frozen=True)
class ChunkOracle:
    """What the oracles read for one chunk's rows: the attention masses over the window's tokens (``"future"``,
    ``"horizon"``: :func:`chunk_mass`; ``"draft"``: :func:`draft_mass`), ``[g, T]`` each, and the window with the
    model's draft of the chunk in place of its tokens, ``[g, T]``, the draft ``lookahead`` tokens long."""

    mass: dict[str, Tensor]
    drafted: Tensor
    lookahead: int

    def row(self, i: int, view: StreamView) -> tuple[dict[str, Tensor], Tensor]:
        """Row ``i``'s masses ``[1, T_view]`` and drafted tokens ``[1, >= T_view]`` from the view's origin (0 past
        the window's end; the tokens long enough to hold the draft)."""
        length = max(view.layout.T, view.real + self.lookahead)
        return {k: in_view(m[i : i + 1], view.origin, view.layout.T) for k, m in self.mass.items()}, in_view(
            self.drafted[i : i + 1], view.origin, length
        )


def in_view(x: Shaped[Tensor, "g t"], origin: int, length: int) -> Shaped[Tensor, "g tv"]:
    """``x`` over the window's tokens as over the view's ``length`` from its ``origin``, 0 past the window's end."""
    part = x[:, origin : origin + length]
    return F.pad(part, (0, length - part.size(1)))


def attention_scorer(mass: Float[Tensor, "1 tv"]) -> Scorer:
    """``oracle_attn``'s scorer: each valid entry scores the mass on its tokens."""

    @typechecked
    def score(wc: WorkingContext) -> Float[Tensor, "r w"]:
        total = F.pad(mass.cumsum(-1), (1, 0))
        end = (wc.start + wc.span).clamp(max=mass.size(-1))
        pooled = total.gather(1, end) - total.gather(1, wc.start.clamp(max=mass.size(-1)))
        return torch.where(wc.valid, pooled, 0.0)

    return score


def summed_scorer(first: Scorer, second: Scorer) -> Scorer:
    """``oracle_match``'s: two scorers' scores, each over its row's standard deviation, added."""

    def score(wc: WorkingContext) -> Tensor:
        return rescaled(first(wc), wc.valid) + rescaled(second(wc), wc.valid)

    return score


@torch.no_grad()
@typechecked
def greedy_draft(base: GPT, window: Int[Tensor, "g t1"], n: int, R: int, T: int) -> Int[Tensor, "g t"]:
    """The window's first ``T`` tokens with the chunk's tokens after the horizon ``n - 1`` (``n .. n + R - 2``,
    within ``T``) replaced by the base model's greedy guesses, each reading the real tokens and the guesses before
    it."""
    tokens = window[:, :T].clone()
    for p in range(n - 1, min(n - 1 + R, T) - 1):
        tokens[:, p + 1] = base.logits(base.token_hidden(tokens[:, : p + 1])[:, -1:]).argmax(-1)[:, 0]
    return tokens


@torch.no_grad()
@typechecked
def draft_mass(base: GPT, drafted: Int[Tensor, "g t"], n: int, R: int, layout: Layout) -> Float[Tensor, "g t"]:
    """``draft_attn``'s mass: the full attention, over the tokens of ``drafted`` (:func:`greedy_draft`), of the
    chunk's query positions ``n - 1`` .. ``n + R - 2`` (within the window)."""
    end = min(n - 1 + R, layout.T)  # one past the chunk's last query position
    return without_sink(text_attention(base, drafted[:, :end], end - n + 1).sum(1), layout.K, layout.T)


def chunk_oracle(
    base: GPT, attention: Tensor, window: Tensor, chunk: Tensor, c: int, n: int, R: int, layout: Layout
) -> ChunkOracle:
    """Everything the oracles read for chunk ``c`` of the rows whose history is ``n`` tokens (``attention``: the
    window's last ``H + R`` queries', :func:`~mcfn.evaluation.indexer_recall.tail_attention`)."""
    horizon = torch.full((window.size(0),), n - 1, device=window.device)
    mass = chunk_mass(attention, chunk, c, horizon, R, layout.K)
    drafted = greedy_draft(base, window, n, R, layout.T)
    mass["draft"] = draft_mass(base, drafted, n, R, layout)
    return ChunkOracle(mass, drafted, min(n - 1 + R, layout.T) - n)


def oracle_policies(mass: dict[str, Tensor], drafted: Tensor, lookahead: int) -> dict[str, FocusPolicy]:
    """The oracles as scored policies of one row's view, from its chunk's :meth:`ChunkOracle.row`, for that row's
    refocus only."""
    future = mass["future"]

    def attention_of(kind: str):
        return lambda system, window, layout, reach, scale: attention_scorer(mass[kind])

    def match_of(system: MegaContext, window: Tensor, layout, reach: int, scale: Tensor | None) -> Scorer:
        return summed_scorer(MATCH.scorer(system, window, layout, reach, scale), attention_scorer(future))

    def draft_match_of(system: MegaContext, window: Tensor, layout, reach: int, scale: Tensor | None) -> Scorer:
        return match_scorer(drafted, layout.K, reach, layout.T if scale is None else scale, lookahead)

    return {
        ORACLE_ATTN: FocusPolicy(ORACLE_ATTN, Choice.SCORED, attention_of("future")),
        ORACLE_MATCH: FocusPolicy(ORACLE_MATCH, Choice.SCORED, match_of),
        HORIZON_ATTN: FocusPolicy(HORIZON_ATTN, Choice.SCORED, attention_of("horizon")),
        DRAFT_ATTN: FocusPolicy(DRAFT_ATTN, Choice.SCORED, attention_of("draft")),
        DRAFT_MATCH: FocusPolicy(DRAFT_MATCH, Choice.SCORED, draft_match_of),
    }


def oracle_rows(
    system: MegaContext, cv: ChunkView, protocol: Refocus, oracle: ChunkOracle, carried: dict[str, list]
) -> tuple[dict[str, Tensor], dict[str, list]]:
    """Each oracle's refocus of each row of the chunk's view, warm from its ``carried`` contexts as the protocol
    says: per oracle, the cuts ``[g, 1, view_nodes]`` and the contexts the next chunk carries."""
    cuts: dict[str, list[Tensor]] = {name: [] for name in ORACLES}
    contexts: dict[str, list] = {name: [] for name in ORACLES}
    for i in range(cv.window.size(0)):
        mass, drafted = oracle.row(i, cv.view)
        tree, window = cv.tree[i : i + 1], cv.window[i : i + 1]
        for name, policy in oracle_policies(mass, drafted, oracle.lookahead).items():
            cut, context = policy.refocus(system, tree, window, cv.view, protocol, carried[name][i])
            cuts[name].append(cut)
            contexts[name].append(context)
    return {name: torch.cat(c) for name, c in cuts.items()}, contexts
