"""The evaluation's statistics over windows: one batch's scores per window (:func:`record`), pooled bits per byte,
the retained fraction with a bootstrap interval, paired gains with their standard errors, the rank correlation,
and one sweep row from them.

Every bootstrap resamples **documents**, keeping each one's windows together (a cluster bootstrap): windows of one
document are not independent, so an error that counted them as such would be too small. Where the windows' documents
are unknown each window counts as its own, which is the plain bootstrap over windows.

``retained_fraction = (recency − lens) / (recency − full)`` is the share of full context's gain over truncation
that the working context keeps. It is reported only where that gain is real: positive, with the lower end of
its bootstrap 95% interval over windows above zero; otherwise it is "n/a" (``null`` in JSON).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from einops import rearrange, repeat
from torch import Tensor

from mcfn.core.policy import BRANCHES, FULL, LENS, MATCH, RANDOM, RECENCY, RECENT, SHIPPED
from mcfn.core.preferences import pair_slots
from mcfn.core.step import bits_per_byte
from mcfn.evaluation.headroom import BEST_OF, best_of, candidate_slots, cross_fitted, per_chunk
from mcfn.evaluation.one_cut import NOGIST, Predictions
from mcfn.evaluation.result import Gain, Paired, Row, Utility


@dataclass
class Scores:
    """Per-window sums for one task at one budget, appended batch by batch: scored nats per condition,
    scored bytes, whether every answer token was the argmax, the probes' depths, and LensNet's rank pairs."""

    nats: dict[str, list[Tensor]] = field(default_factory=dict)
    correct: dict[str, list[Tensor]] = field(default_factory=dict)
    nbytes: list[Tensor] = field(default_factory=list)
    depth: list[Tensor] = field(default_factory=list)
    predicted: list[Tensor] = field(default_factory=list)
    measured: list[Tensor] = field(default_factory=list)
    docs: list[Tensor] = field(default_factory=list)  # each window's document, where known
    utility: list[Tensor] = field(default_factory=list)  # per state, LensNet's utility_corr (counterfactual edits)
    # Under generation's protocol: per refocusing condition, each window's refocuses, and the predictions they served.
    refocuses: dict[str, list[Tensor]] = field(default_factory=dict)
    served: list[Tensor] = field(default_factory=list)

    def add(self, name: str, nats: Tensor, correct: Tensor) -> None:
        self.nats.setdefault(name, []).append(nats.double().cpu())
        self.correct.setdefault(name, []).append(correct.double().cpu())

    def extend(self, other: Scores) -> None:
        """Append ``other``'s windows (a later batch) to these."""
        for name in other.nats:
            self.nats.setdefault(name, []).extend(other.nats[name])
            self.correct.setdefault(name, []).extend(other.correct[name])
        self.nbytes.extend(other.nbytes)
        self.depth.extend(other.depth)
        self.predicted.extend(other.predicted)
        self.measured.extend(other.measured)
        self.docs.extend(other.docs)
        self.utility.extend(other.utility)
        for name, counts in other.refocuses.items():
            self.refocuses.setdefault(name, []).extend(counts)
        self.served.extend(other.served)

    def refocus_rate(self) -> dict[str, float] | None:
        """Refocuses per prediction served, per refocusing condition (None under one cut)."""
        if not self.refocuses:
            return None
        served = float(torch.cat(self.served).sum())
        return {name: float(torch.cat(counts).sum()) / max(1.0, served) for name, counts in self.refocuses.items()}


BOOTSTRAP = 1000  # resamples of the documents for the gains' errors and the retained fraction's interval
BOOTSTRAP_SEED = 0


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rank correlation (Pearson over ranks; ties are broken by order, rare for float losses)."""
    if x.numel() < 3:
        return float("nan")
    rx = torch.argsort(torch.argsort(x)).double()
    ry = torch.argsort(torch.argsort(y)).double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()).clamp(min=1e-12))


def pooled_bpb(nats: Tensor, nbytes: Tensor) -> Tensor:
    """Over the last dimension (windows): total nats / (ln 2 · total bytes)."""
    return bits_per_byte(nats.sum(-1), nbytes.sum(-1))


class Clusters:
    """The windows grouped by document, and one fixed set of document resamples: ``[BOOTSTRAP, D]`` document indices
    drawn with replacement, the same for every statistic and run."""

    def __init__(self, docs: Tensor):
        self.slot = torch.unique(docs, return_inverse=True)[1]  # [N]: each window's document, 0..D-1
        D = int(self.slot.max()) + 1
        self.picks = torch.randint(0, D, (BOOTSTRAP, D), generator=torch.Generator().manual_seed(BOOTSTRAP_SEED))
        self.documents = D

    def sums(self, x: Tensor) -> Tensor:
        """``[D]``: the sum of a per-window quantity over each document's windows."""
        return x.new_zeros(self.documents).index_add(0, self.slot, x)

    def resampled_bpb(self, nats: Tensor, nbytes: Tensor) -> Tensor:
        """``[BOOTSTRAP]`` pooled bits per byte over each resample of documents."""
        return pooled_bpb(self.sums(nats)[self.picks], self.sums(nbytes)[self.picks])


def retained_with_interval(
    nats: dict[str, Tensor], nbytes: Tensor, clusters: Clusters
) -> tuple[float | None, list[float] | None]:
    """The retained fraction on scored bpb and its bootstrap 95% interval over documents, or None twice where
    ``recency − full`` is not positive beyond the noise (or there is no ``lens``)."""
    full, recency, lens = FULL.name, RECENCY.name, LENS.name
    if lens not in nats or nbytes.sum() <= 0:
        return None, None
    resampled = {name: clusters.resampled_bpb(nats[name], nbytes) for name in (full, recency, lens)}
    gap = resampled[recency] - resampled[full]
    point_gap = float(pooled_bpb(nats[recency], nbytes) - pooled_bpb(nats[full], nbytes))
    if point_gap <= 0 or float(gap.quantile(0.025)) <= 0:
        return None, None
    point = float(pooled_bpb(nats[recency] - nats[lens], nbytes)) / point_gap
    fraction = (resampled[recency] - resampled[lens]) / gap
    return point, [float(fraction.quantile(0.025)), float(fraction.quantile(0.975))]


def paired_gain(nats: dict[str, Tensor], nbytes: Tensor, worse: str, better: str, clusters: Clusters) -> Gain | None:
    """``bpb(worse) − bpb(better)`` on the same windows, and its standard error by bootstrap over documents."""
    if worse not in nats or better not in nats or nbytes.sum() <= 0:
        return None
    resampled = clusters.resampled_bpb(nats[worse] - nats[better], nbytes)
    return Gain(float(pooled_bpb(nats[worse] - nats[better], nbytes)), float(resampled.std()))


# Paired differences every sweep row reports: LensNet's and the n-gram match's gains over truncation, LensNet's over
# the structured cut ``recent``, and what its gists are worth.
GAINS = {
    "lens_gain": (RECENCY.name, LENS.name),
    "match_gain": (RECENCY.name, MATCH.name),
    "lens_over_recent": (RECENT.name, LENS.name),
    "gist_worth": (NOGIST, LENS.name),
}


# The policies every row compares pair by pair (:func:`paired_differences`), the more elaborate first; the evaluation
# adds its candidates' names (the ship choice's) before them.
PAIRED = (SHIPPED, LENS.name, BRANCHES.name, MATCH.name, RECENCY.name)


def paired_accuracy(correct: dict[str, Tensor], a: str, b: str, clusters: Clusters) -> tuple[float, float]:
    """``accuracy(a) − accuracy(b)`` on the same windows (each window's answer right or not) and its standard error
    by bootstrap over documents."""
    diff = correct[a] - correct[b]
    ones = torch.ones_like(diff)
    resampled = clusters.sums(diff)[clusters.picks].sum(-1) / clusters.sums(ones)[clusters.picks].sum(-1)
    return float(diff.mean()), float(resampled.std())


def paired_differences(
    nats: dict[str, Tensor], correct: dict[str, Tensor] | None, nbytes: Tensor, names: tuple[str, ...],
    clusters: Clusters,
) -> dict[str, Paired]:  # fmt: skip
    """For every pair of ``names`` scored here, ``a`` before ``b`` in ``names``, ``"a_over_b"``: ``bpb(b) − bpb(a)``
    on the same windows (positive: ``a`` better) with its error by document, and for a probe (``correct``) the
    difference of the share answered, ``accuracy(a) − accuracy(b)``, with its own."""
    present = [name for name in dict.fromkeys(names) if name in nats]
    out = {}
    for i, a in enumerate(present):
        for b in present[i + 1 :]:
            gain = paired_gain(nats, nbytes, b, a, clusters)
            if gain is None:
                continue
            accuracy = None if correct is None else paired_accuracy(correct, a, b, clusters)
            out[f"{a}_over_{b}"] = Paired(gain.bpb, gain.se, *(accuracy or (None, None)))
    return out


def summarise(scores: Scores, task: str, budget: int, T: int, candidates: tuple[str, ...] = ()) -> Row:
    """One sweep row: bpb (and accuracy for probes) per condition, the retained fraction, the gains, the paired
    differences among ``candidates`` and :data:`PAIRED`, the rank and utility correlations where measured."""
    nats = {name: torch.cat(parts) for name, parts in scores.nats.items()}
    nbytes = torch.cat(scores.nbytes)
    clusters = Clusters(torch.cat(scores.docs) if scores.docs else torch.arange(nbytes.numel()))
    retained, interval = retained_with_interval(nats, nbytes, clusters)
    correct = None if task == "corpus" else {name: torch.cat(parts) for name, parts in scores.correct.items()}
    utility = None
    if scores.utility and (per_state := torch.cat(scores.utility)).numel():
        n = per_state.numel()
        utility = Utility(float(per_state.mean()), float(per_state.std() / n**0.5) if n > 1 else None, n)
    return Row(
        W=budget,
        compression=T / budget,
        bpb={name: float(pooled_bpb(value, nbytes)) for name, value in nats.items()},
        retained_fraction=retained,
        retained_ci=interval,
        gains={name: paired_gain(nats, nbytes, *pair, clusters) for name, pair in GAINS.items()},
        accuracy=None if correct is None else {name: float(value.mean()) for name, value in correct.items()},
        paired=paired_differences(nats, correct, nbytes, (*candidates, *PAIRED), clusters),
        lens_rank_corr=spearman(torch.cat(scores.predicted), torch.cat(scores.measured)) if scores.predicted else None,
        utility=utility,
        refocus_rate=scores.refocus_rate(),
    )


def accuracy_by_depth(scores: Scores, condition: str, bins: int = 5) -> list[float | None]:
    """A probe's accuracy under ``condition`` in ``bins`` equal slices of the depth of its fact."""
    depth, correct = torch.cat(scores.depth), torch.cat(scores.correct[condition])
    which = (depth * bins).long().clamp(max=bins - 1)
    return [float(correct[which == b].mean()) if (which == b).any() else None for b in range(bins)]


def record(
    pred: Predictions,
    references: dict[str, tuple[Tensor, Tensor]],
    scored: Tensor,
    depth: Tensor,
    per_state: bool = True,
) -> Scores:
    """One batch's per-window scores: ``scored [B, H]`` holds the bytes of each tail target that counts (0: not
    scored); ``references`` are the no-budget conditions' tail NLL and hits ``[B, H]``. The best-of conditions pick
    per chunk (:mod:`mcfn.evaluation.headroom`), and the rank pairs are compared chunk by chunk. ``per_state``: also the
    per-state figures (``utility_corr``), which belong to a batch, not to a subset of its tokens."""
    out = Scores()
    mask = scored > 0
    for name, (nll, hit) in references.items():
        out.add(name, (nll * mask).sum(-1), (hit | ~mask).all(-1))
    nats = (pred.nll * mask[:, None]).sum(-1)  # [B, S]
    correct = (pred.hit | ~mask[:, None]).all(-1)
    for name, slots in pred.slots.items():  # each single-cut condition (the random cuts: add_random)
        if name != RANDOM.name:
            out.add(name, nats[:, slots][:, 0], correct[:, slots][:, 0])
    out.nbytes.append(scored.sum(-1).double().cpu())
    out.depth.append(depth.double().cpu())
    if counts := pred.refocus_counts():
        out.refocuses = {name: [count.double().cpu()] for name, count in counts.items()}
        out.served = [(pred.chunk >= 0).sum(-1).double().cpu()]
    if per_state and pred.utility is not None:
        out.utility.append(pred.utility[pred.utility.isfinite()])
    if RANDOM.name in pred.slots:  # not in a brief evaluation
        add_random(out, pred, nats, correct, mask, scored)
    return out


def add_random(out: Scores, pred: Predictions, nats: Tensor, correct: Tensor, mask: Tensor, scored: Tensor) -> None:
    """The random cuts' scores, the best-of conditions over them (and over all cuts), and LensNet's rank pairs:
    ``nats, correct [B, S]`` per context, ``mask, scored [B, H]`` the scored targets and their bytes."""
    random_nats, random_correct = nats[:, pred.slots[RANDOM.name]], correct[:, pred.slots[RANDOM.name]]
    out.add(RANDOM.name, random_nats.mean(-1), random_correct.double().mean(-1))
    candidates = candidate_slots(pred)  # the random cuts first
    all_nats, all_wrong, chunk_bytes = per_chunk(pred, mask, scored, candidates)  # [B, S, C], [B, S, C], [B, C]
    M = random_nats.size(1)
    chunk_nats, chunk_wrong = all_nats[:, :M], all_wrong[:, :M]
    best_of_random, best_of_all, best_of_all_oos = BEST_OF
    out.add(best_of_random, *best_of(chunk_nats, chunk_wrong))
    out.add(best_of_all, *best_of(all_nats, all_wrong))
    out.add(best_of_all_oos, *cross_fitted(pred, mask, scored, candidates))
    if pred.preference is not None:
        B, M, C = chunk_nats.shape
        i, j = pair_slots(M, B, random_nats.device)
        index = repeat(i, "b p -> b p c", c=C), repeat(j, "b p -> b p c", c=C)
        measured = rearrange(chunk_nats.gather(1, index[1]) - chunk_nats.gather(1, index[0]), "b p c -> b c p")
        scored_chunk = repeat(chunk_bytes > 0, "b c -> b c p", p=i.size(1))
        out.predicted.append(pred.preference[scored_chunk].cpu())
        out.measured.append(measured[scored_chunk].cpu())  # > 0: i better
