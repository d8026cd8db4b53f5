"""How much signal a LensNet label carries: two independent estimates of each state's labels, and how well they agree.

A label kind gives every traced state a list of labels (one per candidate: for the single-edit ΔNLL, one per edit,
with the unedited cut's 0 as the anchor). Its *split-half reliability* compares two estimates of the same labels
made from disjoint random halves of the predictions they average (each chunk's ``k`` predictions split at random,
so that neither half is systematically the later one). Agreement is measured as the ranking loss
(:func:`mcfn.core.edits.ranking_loss`) uses the labels: over every pair of candidates, whether the two estimates
order them alike, each pair weighted by how far apart the estimates put them (``|a_i − a_j| + |b_i − b_j|``, the
loss's ``|Δ_i − Δ_j|`` for either half). Noise scores 0, identical estimates 1. Pooled over states as a ratio (each
state counts by its pairs' weight, as the loss normalises by the total weight), with a jackknife standard error
over windows (the states of one window are not independent). Spearman–Brown turns the half-length figure into the
full label's, and ``sqrt`` of that bounds the correlation any predictor can reach with the labels (for a
correlation; for this agreement, about).

Label kinds measured (``python -m train.lens --reliability N``):

* **single-edit ΔNLL** (the LensNet stage's today): per state, each single edit of LensNet's cut scored by the chunk's
  mean NLL against the unedited cut's; the halves are random halves of the chunk's ``R`` predictions;
* **two-chunk ΔNLL**: the same edits with their context carried into the next chunk's warm refocus, as generation
  carries it (:mod:`mcfn.stage.carried`), labelled over both chunks' predictions; the halves split all of them;
* **whole cuts** (REFRAG's group-relative reward, at the chunk's scale): per state, the whole cuts traced beside the
  edits (LensNet's, ``match``'s, ``recency`` and the random ones), each rewarded by minus its mean NLL over the
  chunk's predictions less the group's mean; the halves as above;
* **attention**: the base model's own attention over the whole window at LOD0, from the tail's ``H`` predictions,
  summed under each gist's span (what ``mc.lens.attention_weight`` trains on, unweighted; DeepSeek's indexer and
  Locret's heads learn from such a target); the halves are random halves of the tail's predictions, the items the
  gists outside the tail (the allocator's candidates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.attention import node_mass
from mcfn.core.edits import edit_worth
from mcfn.core.nodes import NodeTable
from mcfn.core.stream_view import stream_view, view_node_ids
from mcfn.evaluation.counterfactual import State
from mcfn.evaluation.stats import spearman
from mcfn.typecheck import typechecked


@typechecked
def pair_agreement(a: Float[Tensor, " e"], b: Float[Tensor, " e"]) -> tuple[float, float]:
    """Two estimates of one state's ``e`` labels: the weighted sum of the pairs' order agreement (+1 alike, −1
    opposite, 0 where either ties) and the total weight."""
    da, db = a[:, None] - a[None], b[:, None] - b[None]
    weight = da.abs() + db.abs()
    return float((weight * torch.sign(da) * torch.sign(db)).sum()), float(weight.sum())


def random_halves(k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Two disjoint random halves of ``k`` predictions' indices, ``k // 2`` each (an odd one left out), so that
    neither half is systematically the later one."""
    order = torch.randperm(k, generator=generator)
    return order[: k // 2], order[k // 2 : 2 * (k // 2)]


@typechecked
def split_halves(
    delta_by_token: Float[Tensor, "e k"], generator: torch.Generator
) -> tuple[Float[Tensor, " e1"], Float[Tensor, " e1"]]:
    """The single-edit ΔNLL of each edit from two disjoint random halves of the chunk's ``k`` predictions, the
    unedited cut (ΔNLL 0) first in both."""
    halves = (half.to(delta_by_token.device) for half in random_halves(delta_by_token.size(1), generator))
    anchor = delta_by_token.new_zeros(1)
    a, b = (torch.cat([anchor, delta_by_token[:, half].mean(-1)]) for half in halves)
    return a, b


@dataclass(frozen=True)
class Reliability:
    half: float  # the split-half agreement, pooled over states
    se: float  # its jackknife standard error over clusters (windows, or documents)
    full: float  # Spearman–Brown: the agreement of two full-length estimates
    ceiling: float  # sqrt(full): about the most a predictor's correlation with these labels can reach
    states: int
    windows: int  # clusters

    def to_json(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def pooled(parts: Sequence[tuple[int, float, float]]) -> Reliability:
    """``(window, agreement sum, weight)`` per state: the pooled agreement, its jackknife SE over windows, and what
    it implies for full-length labels."""
    windows = sorted({w for w, _, _ in parts})
    num = {w: 0.0 for w in windows}
    den = {w: 0.0 for w in windows}
    for w, n, d in parts:
        num[w] += n
        den[w] += d
    total_num, total_den = sum(num.values()), sum(den.values())
    half = total_num / total_den if total_den > 0 else math.nan
    g = len(windows)
    if g > 1:
        leave_one_out = [(total_num - num[w]) / (total_den - den[w]) for w in windows if total_den > den[w]]
        mean = sum(leave_one_out) / len(leave_one_out)
        se = math.sqrt((g - 1) / g * sum((x - mean) ** 2 for x in leave_one_out))
    else:
        se = math.nan
    full = 2 * half / (1 + half) if half > -1 else math.nan
    ceiling = math.sqrt(full) if full >= 0 else 0.0
    return Reliability(half, se, full, ceiling, len(parts), g)


def delta_reliability(labels: Sequence[tuple[int, Tensor]], seed: int) -> Reliability:
    """The split-half reliability of ΔNLL labels given by prediction, ``(cluster, [e, k])`` per state, the unedited
    cut's 0 the anchor in each list; the error is over the clusters."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for cluster, by_token in labels:
        a, b = split_halves(by_token.float().cpu(), generator)
        parts.append((cluster, *pair_agreement(a, b)))
    return pooled(parts)


def single_edit_reliability(states: Sequence[State], seed: int, clusters: Sequence[int]) -> Reliability:
    """The split-half reliability of today's label, each edit's ΔNLL over the chunk, on traced states; the error is
    over ``clusters[state.window]`` (each window itself, or its document)."""
    return delta_reliability([(clusters[state.window], state.labelled.delta_by_token) for state in states], seed)


@typechecked
def whole_cut_rewards(nll_by_token: Float[Tensor, "c k"], half: Int[Tensor, " h"]) -> Float[Tensor, " c"]:
    """Each whole cut's reward from the predictions ``half``: minus its mean NLL there, less the group's mean."""
    reward = -nll_by_token[:, half].mean(-1)
    return reward - reward.mean()


def whole_cut_reliability(states: Sequence[State], seed: int, clusters: Sequence[int]) -> Reliability:
    """The split-half reliability of group-relative whole-cut rewards on traced states (their cuts scored over the
    chunk), the error over ``clusters[state.window]``."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for state in states:
        nll = state.labelled.cuts_by_token.float().cpu()
        a, b = (whole_cut_rewards(nll, half) for half in random_halves(nll.size(1), generator))
        parts.append((clusters[state.window], *pair_agreement(a, b)))
    return pooled(parts)


@typechecked
def attention_halves(
    attention: Float[Tensor, "h t"], nodes: NodeTable, generator: torch.Generator
) -> tuple[Float[Tensor, " g"], Float[Tensor, " g"]]:
    """The attention label of the gists outside the tail from two disjoint random halves of the tail's predictions
    (``attention``: a row of :func:`mcfn.evaluation.indexer_recall.tail_attention`; :func:`random_halves`, as the
    ΔNLL labels split theirs): the mean attention mass a query puts under each gist's span, per half."""
    gists = (nodes.lod > 0) & nodes.eligible
    halves = (half.to(attention.device) for half in random_halves(attention.size(0), generator))
    a, b = (node_mass(attention[half].mean(0)[None], nodes.layout)[0, gists] for half in halves)
    return a, b


def attention_reliability(
    attentions: Sequence[Tensor], nodes: NodeTable, seed: int, clusters: Sequence[int]
) -> tuple[Reliability, Reliability]:
    """The split-half reliability of the attention label over windows (each's ``tail_attention``), one state
    each, its error over ``clusters`` (each window's): as it is, and beyond position (each gist's mean over the
    windows taken out of both halves: what every window's attention shares, mostly the recent gists' larger share,
    is then no signal about this window)."""
    generator = torch.Generator().manual_seed(seed)
    halves = [attention_halves(attention, nodes, generator) for attention in attentions]
    position = torch.stack([(a + b) / 2 for a, b in halves]).mean(0)
    pairs = list(zip(halves, clusters, strict=True))
    raw = pooled([(c, *pair_agreement(a, b)) for (a, b), c in pairs])
    beyond = pooled([(c, *pair_agreement(a - position, b - position)) for (a, b), c in pairs])
    return raw, beyond


def attention_utility(attention: Tensor, states: Sequence[State], nodes: NodeTable, every: int) -> list[float]:
    """Whether the attention label is worth learning: per state of one window (``attention``: its
    ``tail_attention``), the rank correlation of each single edit's worth *as the attention label judges it*
    with its measured ΔNLL (``utility_corr`` with the attention mass in place of LensNet's scores: the mass the
    chunk's own predictions put under the node an edit gains, minus under the one it gives up)."""
    layout = nodes.layout
    tail_start = layout.T - layout.H
    correlations = []
    for state in states:
        # The chunk at history n predicts from position n - 1 to upto - 1 (mcfn.evaluation.chunks), all in the tail.
        queries = slice(state.n - 1 - tail_start, min(state.n + every - 1, layout.T) - tail_start)
        mass = node_mass(attention[queries].sum(0)[None], layout)[0]
        view = stream_view(state.n, layout, layout.W - every)
        in_view = mass[view_node_ids(view, layout, attention.device)]
        worth = edit_worth(in_view, state.labelled.edits.gain, state.labelled.edits.loss)
        correlations.append(spearman(worth.double().cpu(), state.labelled.delta.double().cpu()))
    return correlations
