"""LensNet's training signal: pairwise preferences between the variants of a sample, all pairs at once.

For a pair of variants of one sample, ``a`` is the one with the lower tail NLL and ``c`` the other.
Each entry ``e`` of ``c`` at LOD ``k`` gets a target from how much detail ``a`` shows over the same
text (I7), with "not covered at all" counting as coarser than any gist:

* ``+1`` (expand) where ``a`` shows more detail somewhere in ``e``'s span: ``min lod_a(span) < k``;
* ``-1`` (collapse) where ``a`` is coarser over the **whole group** ``e`` belongs to, the span of its
  parent: ``min lod_a(parent span) > k``. The label is computed from the parent, so every sibling shares it.
  ``-1`` also where ``e`` is a droppable gist (an eligible LODmax gist) and ``a`` leaves its whole span out: a
  drop, a label of that entry alone;
* no target where ``a`` shows the same node: a **tie**.

Legality (I6) masks the rest: no ``+`` on LOD0, a ``-`` below LODmax only where the entry's complete
aligned group of ``K`` siblings is in ``c`` and its parent is eligible (collapsing into a parent that
overlaps the tail is not an action the allocator can take), and a ``-`` as a drop only on a droppable gist.

Each pair is weighted by how much it teaches, ``w = tanh(|ΔNLL| / τ)``: 0 for variants that score the
same, approaching 1 for a clear winner; ``τ`` (0.5 nats, :data:`mcfn.core.weights.TEMPERATURE`) sets the scale.

Losses over the flat ``[B, P, W]`` pair/entry tensors (no Python loop over samples, pairs or entries):

* ``loss_pref``: Bradley–Terry with ties, the logistic loss of ``σ(s)`` against the label ``(1 + y)/2``:
  1 for expand, 0 for collapse and ½ for a tie, ``Σ w·[q·softplus(-s) + (1-q)·softplus(s)] / max(Σ w, B/4)``
  over the targeted and tied entries: a weighted mean whenever the batch holds at least a quarter of an
  entry's worth of weight per sample, and close to zero when every pair is a near-tie (``w ≈ 0``, where
  even which variant is better is decided by rounding), instead of that noise blown up to full size.
  Ties matter: without them an entry that is rarely told to collapse would mostly see "expand" and its
  score would grow whether detail there paid often or rarely. With them the optimum is the log-odds of
  "detail here helped", which ranks.
* ``loss_budget``: per working context, the net span (in units of ``T``) that the scores push to expand,
  ``Σ relu(s)·span`` over legal expansions minus ``Σ relu(-s)·span`` over legal collapses, summed per
  row with ``scatter_add``; its mean square keeps expansion and collapse pressure balanced, so the
  allocator does not drift towards all-detail or all-gist.
"""

from __future__ import annotations

from itertools import combinations
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.nodes import NodeTable
from mcfn.core.outputs import HIST_BINS, HIST_RANGE, StepOutput
from mcfn.core.weights import LossWeights
from mcfn.typecheck import typechecked

# The preference loss divides by max(Σw, floor), floor = this × samples: 1 for the default 4 samples. Per
# sample, so that when the floor binds, the mean over processes or micro-batches of their losses is the
# loss of the whole batch.
WEIGHT_FLOOR_PER_SAMPLE = 0.25


@typechecked
def lod_map(shown: Bool[Tensor, "b v nodes"], nodes: NodeTable) -> Int[Tensor, "b v t"]:
    """Per token, the LOD at which a variant shows it; ``L + 1`` where the variant does not cover it."""
    layout = nodes.layout
    out = torch.full((*shown.shape[:2], layout.T), layout.L + 1, device=shown.device, dtype=torch.int64)
    for k in range(layout.L + 1):
        out = torch.where(nodes.level(shown, k).repeat_interleave(layout.K**k, dim=-1), k, out)
    return out


@typechecked
def node_min_lod(shown: Bool[Tensor, "b v nodes"], nodes: NodeTable) -> Int[Tensor, "b v nodes"]:
    """For every node, the finest LOD a variant shows anywhere inside the node's span."""
    levels = [lod_map(shown, nodes)]
    for _ in range(nodes.layout.L):
        levels.append(rearrange(levels[-1], "b v (n k) -> b v n k", k=nodes.layout.K).amin(-1))
    return torch.cat(levels, dim=-1)


def pair_slots(slots: int, batch: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """All unordered pairs ``i < j`` of ``slots`` variant slots, as ``[batch, P]`` index tensors ``i`` and ``j``."""
    pairs = list(combinations(range(slots), 2))
    i = torch.tensor([a for a, _ in pairs], device=device).expand(batch, -1)
    j = torch.tensor([b for _, b in pairs], device=device).expand(batch, -1)
    return i, j


@typechecked
def detail_targets(
    shown: Bool[Tensor, "b v nodes"],
    better: Int[Tensor, "b p"],
    worse: Int[Tensor, "b p"],
    wc: WorkingContext,
    nodes: NodeTable,
) -> tuple[Int[Tensor, "b p w"], Bool[Tensor, "b p w"], Int[Tensor, "b p"]]:
    """For pairs of variant slots, the I7 targets on the ``worse`` variant's entries that would move it
    towards ``better``: ``y [B, P, W]`` in {-1, 0, 1}, the ties (valid entries ``better`` shows unchanged)
    and ``rows [B, P]``, the ``worse`` variants' rows in the packed ``[B·V, W]`` batch."""
    B, V = shown.size(0), shown.size(1)
    rows = torch.arange(B, device=shown.device)[:, None] * V + worse  # [B, P]
    node, lod, valid = wc.node[rows], wc.lod[rows], wc.valid[rows]  # [B, P, W]
    group = nodes.parent[node].clamp(min=0)  # a group collapse is read over the parent's span
    mins = node_min_lod(shown, nodes)  # [B, V, nodes]
    mins_better = mins.gather(1, repeat(better, "b p -> b p n", n=mins.size(-1)))  # [B, P, nodes]
    finest_inside = mins_better.gather(2, node)
    finer_inside = finest_inside < lod
    coarser_over_group = mins_better.gather(2, group) > lod
    collapsible = nodes.collapsible(shown)  # [B, V, nodes]
    collapsible_in_worse = collapsible.gather(1, repeat(worse, "b p -> b p n", n=collapsible.size(-1)))
    left_out_by_better = finest_inside > nodes.layout.L  # better shows nothing of this entry's span
    expand = valid & nodes.legal_expand(node) & finer_inside
    as_group = nodes.legal_group_collapse(node, collapsible_in_worse) & coarser_over_group
    collapse = valid & (as_group | (nodes.droppable_entry(node) & left_out_by_better))
    return expand.long() - collapse.long(), valid & (finest_inside == lod), rows


def ordered_pairs(tails: Float[Tensor, "b v"], temperature: Tensor) -> tuple[Tensor, Tensor, Float[Tensor, "b p"]]:
    """Every pair of variant slots as ``better, worse [B, P]`` by tail NLL, with its weight ``w [B, P]``."""
    i, j = pair_slots(tails.size(1), tails.size(0), tails.device)
    tails = tails.detach()
    ti, tj = tails.gather(1, i), tails.gather(1, j)
    better, worse = torch.where(ti <= tj, i, j), torch.where(ti <= tj, j, i)
    return better, worse, torch.tanh((ti - tj).abs() / temperature)


class PairTargets(NamedTuple):
    """What LensNet's preference loss learns from, for every pair ``[B, P]`` of variant slots."""

    target: Int[Tensor, "b p w"]  # I7's signed target on each entry of the worse slot's context
    tie: Bool[Tensor, "b p w"]  # entries both slots show alike, labelled 1/2
    weight: Float[Tensor, "b p"]  # tanh of the NLL gap over the temperature
    rows: Int[Tensor, "b p"]  # the worse slot's row in the packed contexts
    better: Int[Tensor, "b p"]  # the slot of lower tail NLL
    worse: Int[Tensor, "b p"]


@typechecked
def preference_targets(
    shown: Bool[Tensor, "b v nodes"],
    tails: Float[Tensor, "b v"],
    wc: WorkingContext,
    nodes: NodeTable,
    temperature: Tensor,
) -> PairTargets:
    """Targets on the worse variant's entries for every pair (:func:`detail_targets`, with the better
    variant the one of lower tail NLL) and the pair weights ``w [B, P]``."""
    better, worse, weight = ordered_pairs(tails, temperature)
    target, tie, rows = detail_targets(shown, better, worse, wc, nodes)
    return PairTargets(target, tie, weight, rows, better, worse)


@typechecked
def pair_margin(
    scores: Float[Tensor, "r w"],
    shown: Bool[Tensor, "b v nodes"],
    i: Int[Tensor, "b p"],
    j: Int[Tensor, "b p"],
    wc: WorkingContext,
    nodes: NodeTable,
) -> Float[Tensor, "b p"]:
    """LensNet's preference of slot ``i`` over slot ``j``, ``[B, P]``: ``Σ s·y`` over ``j``'s entries with the I7
    targets that move ``j`` towards ``i``, minus the same with the roles swapped."""
    return pull_towards(scores, shown, i, j, wc, nodes) - pull_towards(scores, shown, j, i, wc, nodes)


def pull_towards(
    scores: Tensor, shown: Tensor, to: Tensor, moved: Tensor, wc: WorkingContext, nodes: NodeTable
) -> Tensor:
    """``Σ s·y [B, P]`` over slot ``moved``'s entries with the I7 targets that move it towards slot ``to``."""
    y, _, rows = detail_targets(shown, to, moved, wc, nodes)
    return (scores[rows] * y).sum(-1)


@typechecked
def budget_term(scores: Float[Tensor, "r w"], shown: Bool[Tensor, "b v nodes"], wc: WorkingContext, nodes: NodeTable):
    """Mean square over working contexts of the net span (in units of ``T``) the scores push to expand:
    ``Σ relu(s)·span`` over legal expansions minus ``Σ relu(-s)·span`` over legal collapses."""
    collapsible = rearrange(nodes.collapsible(shown), "b v n -> (b v) n")
    legal_expand = wc.valid & nodes.legal_expand(wc.node)
    legal_collapse = wc.valid & nodes.legal_collapse(wc.node, collapsible)
    push = (F.relu(scores) * legal_expand - F.relu(-scores) * legal_collapse) * wc.span.float() / nodes.layout.T
    row_id = repeat(torch.arange(scores.size(0), device=scores.device), "r -> (r w)", w=scores.size(1))
    net = torch.zeros(scores.size(0), device=scores.device).scatter_add(0, row_id, push.flatten())
    return net.square().mean()


@typechecked
def lens_losses(
    scores: Float[Tensor, "r w"],
    shown: Bool[Tensor, "b v nodes"],
    tails: Float[Tensor, "b v"],
    wc: WorkingContext,
    nodes: NodeTable,
    weights: LossWeights,
) -> StepOutput:
    """``loss_lens`` (weighted sum of the terms), each term as a metric, and the LensNet metrics."""
    target, tie, pair_w, rows, _, _ = preference_targets(shown, tails, wc, nodes, weights.temperature)
    s = scores[rows]  # [B, P, W]
    y = target.float()
    w = pair_w[..., None] * y.abs()  # [B, P, W]: zero where there is no target
    label = (1 + y) / 2  # 1 expand, 0 collapse, 1/2 tie
    labelled = (y != 0) | tie
    bt = label * F.softplus(-s) + (1 - label) * F.softplus(s)
    w_pref = pair_w[..., None] * labelled
    floor = WEIGHT_FLOOR_PER_SAMPLE * shown.size(0)
    pref = (w_pref * bt).sum() / w_pref.sum().clamp(min=floor)
    budget = budget_term(scores, shown, wc, nodes)

    metrics = {"mc/lens_pref": pref, "mc/lens_budget": budget}
    total = weights.pref * pref + weights.budget * budget
    metrics["mc/lens_loss"] = total
    out = StepOutput({"loss_lens": total}, metrics, {})
    return out.merge(lens_metrics(scores, wc.valid, s, y, w))


def lens_metrics(scores: Tensor, valid: Tensor, s: Tensor, y: Tensor, w: Tensor) -> StepOutput:
    targeted = y != 0
    n_targets = targeted.sum().clamp(min=1)
    agreement = ((torch.sign(s) == y) & targeted).sum() / n_targets
    # Pearson correlation between the score and the weighted signed target, over targeted entries.
    sv, tv = s * targeted, y * w
    ms, mt = sv.sum() / n_targets, tv.sum() / n_targets
    ds, dt = (s - ms) * targeted, (tv - mt) * targeted
    # Square roots of clamped sums: these metrics are not trained, but a compiled joint backward still multiplies
    # their zero tangents by sqrt's derivative, which at exactly zero is infinite and would make NaN gradients.
    norms = ds.square().sum().clamp(min=1e-16).sqrt() * dt.square().sum().clamp(min=1e-16).sqrt()
    corr = (ds * dt).sum() / norms.clamp(min=1e-8)
    n_valid = valid.sum(-1).clamp(min=1)
    row_mean = (scores * valid).sum(-1) / n_valid
    row_std = (((scores - row_mean[:, None]) * valid).square().sum(-1) / n_valid).clamp(min=1e-16).sqrt()
    # In float32: under CUDA autocast the scores are bfloat16, which CUDA's histc refuses and whose counts would
    # round above 256. Padding lands outside the range.
    hist_input = torch.where(valid, scores.detach().float(), 2 * HIST_RANGE)
    metrics = {
        "mc/preference_agreement": agreement,
        "mc/pref_span_corr": corr,
        "mc/policy_score_abs_mean": (scores.abs() * valid).sum() / valid.sum(),
        "mc/policy_score_std_mean": row_std.mean(),
        "mc/preference_pair_count": (targeted.any(-1)).sum().float(),
        "mc/lens_targets_per_pair": targeted.sum(-1).float().mean(),
    }
    return StepOutput({}, metrics, {"hist/policy_score": torch.histc(hist_input, HIST_BINS, -HIST_RANGE, HIST_RANGE)})
