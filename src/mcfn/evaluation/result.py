"""The evaluation's report as values: a :class:`Row` per budget, a :class:`ProtocolResult` per protocol of a task,
a :class:`TaskResult` (or :class:`Skipped`) per task, and the :class:`EvalReport` that holds them.

:func:`mcfn.evaluation.evaluate.evaluate` builds one; the tables (:mod:`mcfn.evaluation.report`), the plots
(:mod:`mcfn.evaluation.plots`), the run's report and its opening lines read its fields. ``to_json`` writes ``eval.json``
with the keys it has always had, so that what reads the file is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcfn.core.policy import policies
from mcfn.evaluation.batch import EvalSettings
from mcfn.evaluation.indexer_recall import IndexerRecall


@dataclass(frozen=True)
class Gain:
    """A paired difference ``bpb(worse) − bpb(better)`` on the same windows, and its bootstrap standard error."""

    bpb: float
    se: float


@dataclass(frozen=True)
class Paired:
    """Two policies ``a`` and ``b`` on the same windows (``a_over_b``): ``bpb(b) − bpb(a)`` (positive: ``a`` better)
    and, for a probe, ``accuracy(a) − accuracy(b)``, each with its bootstrap standard error over documents."""

    bpb: float
    se: float
    accuracy: float | None = None
    accuracy_se: float | None = None

    def to_json(self) -> dict[str, float]:
        out = {"bpb": self.bpb, "se": self.se}
        if self.accuracy is not None:
            out |= {"accuracy": self.accuracy, "accuracy_se": self.accuracy_se}
        return out


@dataclass(frozen=True)
class Utility:
    """LensNet's ``utility_corr``: per state, its predicted worth of each single edit of its cut against the edit's
    measured ΔNLL (Spearman), averaged over ``states``, with the mean's standard error (None from one state)."""

    corr: float
    se: float | None
    states: int


@dataclass(frozen=True)
class Row:
    """One budget ``W`` of one task and protocol: bpb per condition (and answer accuracy for a probe), the retained
    fraction with its 95% interval, the paired gains (:data:`~mcfn.evaluation.stats.GAINS`, None where a condition
    is missing), and where measured LensNet's rank and utility correlations."""

    W: int
    compression: float  # T / W
    bpb: dict[str, float]
    retained_fraction: float | None
    retained_ci: list[float] | None
    gains: dict[str, Gain | None]
    accuracy: dict[str, float] | None = None
    lens_rank_corr: float | None = None
    utility: Utility | None = None
    paired: dict[str, Paired] = field(default_factory=dict)  # "a_over_b" (mcfn.evaluation.stats.paired_differences)
    refocus_rate: dict[str, float] | None = None  # generation's protocol: refocuses per prediction, per condition

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "W": self.W,
            "compression": self.compression,
            "bpb": self.bpb,
            "retained_fraction": self.retained_fraction,
            "retained_ci": self.retained_ci,
            **{name: None if g is None else {"bpb": g.bpb, "se": g.se} for name, g in self.gains.items()},
        }
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        if self.lens_rank_corr is not None:
            out["lens_rank_corr"] = self.lens_rank_corr
        if self.utility is not None:
            u = self.utility
            out |= {"utility_corr": u.corr, "utility_corr_se": u.se, "utility_states": u.states}
        out["paired"] = {name: pair.to_json() for name, pair in self.paired.items()}
        if self.refocus_rate is not None:
            out["refocuses_per_token"] = self.refocus_rate
        return out


@dataclass(frozen=True)
class LongRange:
    """``corpus``'s long-range tokens at the headline budget (:mod:`mcfn.evaluation.long_range`)."""

    definition: str
    tokens: int
    row: Row

    def to_json(self) -> dict[str, Any]:
        return {"definition": self.definition, "tokens": self.tokens, **self.row.to_json()}


@dataclass(frozen=True)
class DepthAccuracy:
    """A probe's answer accuracy under ``condition`` by the depth of its fact (five slices; None: no window there),
    per budget."""

    condition: str
    by_budget: dict[int, list[float | None]]

    def to_json(self) -> dict[str, Any]:
        return {"condition": self.condition, "by_budget": {str(w): v for w, v in self.by_budget.items()}}


@dataclass(frozen=True)
class ProtocolResult:
    """One protocol's figures of a task: a row per budget, the headline budget first."""

    sweep: tuple[Row, ...]
    longrange: LongRange | None = None  # corpus only
    depth_accuracy: DepthAccuracy | None = None  # probes only
    indexer_recall: IndexerRecall | None = None  # corpus under generation's protocol only

    @property
    def head(self) -> Row:
        return self.sweep[0]

    def to_json(self) -> dict[str, Any]:
        out = {**self.head.to_json(), "sweep": [row.to_json() for row in self.sweep]}
        if self.longrange is not None:
            out["longrange"] = self.longrange.to_json()
        if self.depth_accuracy is not None:
            out["depth_accuracy"] = self.depth_accuracy.to_json()
        if self.indexer_recall is not None:
            out["indexer_recall"] = self.indexer_recall.to_json()
        return out


@dataclass(frozen=True)
class TaskResult:
    """A scored task: generation's protocol (``refocus``, the headline) and, unless brief, ``one_cut``."""

    protocols: dict[str, ProtocolResult]

    @property
    def refocus(self) -> ProtocolResult:
        return self.protocols["refocus"]

    def to_json(self) -> dict[str, Any]:
        others = {name: result.to_json() for name, result in self.protocols.items() if name != "refocus"}
        return {**self.refocus.to_json(), **others}


@dataclass(frozen=True)
class Skipped:
    """A task whose question does not fit the scored tail: reported, not scored."""

    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"skipped": self.reason}


@dataclass(frozen=True)
class Provenance:
    """What ``train.eval`` says of its inputs: the data and the plain reference it scored (None: no reference)."""

    data: str
    reference: str | None


FULL_PLAIN = "full_plain"  # with --reference: a plain GPT at length T, what a user would pick instead


@dataclass(frozen=True)
class EvalReport:
    """The whole evaluation: every task on the held-out windows, at every budget of ``settings``."""

    settings: EvalSettings
    T: int
    H: int
    split: str | None  # where the windows came from (test or val); None: given by the caller
    windows: int  # corpus windows
    documents: int | None  # the documents they came from; None: unknown, so errors are by window
    windows_per_probe: int
    tasks: dict[str, TaskResult | Skipped]  # corpus first
    checkpoint_step: int | None = None
    provenance: Provenance | None = None
    shipped: str | None = None  # the candidate the run ships (mcfn.stage.ship), scored as "shipped"; None: not scored

    @property
    def W(self) -> int:
        return self.settings.budgets[0]

    @property
    def se(self) -> str:
        """What the bootstrap errors resample: documents where they are known, else windows."""
        return "window" if self.documents is None else "document"

    @property
    def corpus(self) -> TaskResult:
        """The first task, corpus, which is always scored: the headline figures come from it."""
        first = self.tasks[self.settings.tasks[0]]
        assert isinstance(first, TaskResult), "corpus is always scored"
        return first

    @property
    def head(self) -> ProtocolResult:
        """The headline: the corpus under generation's protocol."""
        return self.corpus.refocus

    @property
    def best_context(self) -> str:
        """The focus policy within the budget that scored the lowest corpus bpb, by its ``train.generate --context``
        name: the policy to generate with."""
        bpb = self.head.head.bpb
        chosen = [p.name for p in policies() if p.refocuses and p.name in bpb]
        return min(chosen, key=bpb.__getitem__)

    def scored(self, task: str) -> TaskResult | None:
        """``task``'s result, or None where it was skipped or not asked for."""
        result = self.tasks.get(task)
        return result if isinstance(result, TaskResult) else None

    def to_json(self) -> dict[str, Any]:
        """``eval.json``'s keys, in their order."""
        head, settings = self.head.head, self.settings
        out: dict[str, Any] = {} if self.shipped is None else {"shipped": self.shipped}
        out |= {
            "split": self.split,
            "windows": self.windows,
            "documents": self.documents,
            "se": self.se,
            "T": self.T,
            "W": self.W,
            "H": self.H,
            "bpb": head.bpb,
            "retained_fraction": head.retained_fraction,
            "lens_rank_corr": head.lens_rank_corr,
            "utility_corr": None if head.utility is None else head.utility.corr,
            "best_context": self.best_context,
            "sweep": [sweep_row(row) for row in self.head.sweep],
            "n_windows_per_probe": self.windows_per_probe,
            "random_contexts": settings.random_contexts,
            "refocus": settings.refocus,
            "refocus_every": settings.refocus_every,
            "warm_steps": settings.warm_steps,
        }
        for name, result in self.corpus.protocols.items():
            if name != "refocus":
                row = result.head
                out[name] = {"bpb": row.bpb, "retained_fraction": row.retained_fraction,
                             "lens_rank_corr": row.lens_rank_corr}  # fmt: skip
        if settings.brief:
            out["brief"] = True  # a full evaluation's file is as it always was
        if settings.oracle:
            out["oracle"] = True  # oracle_attn and oracle_match read each chunk's future: diagnostics, not policies
        out["tasks"] = {name: result.to_json() for name, result in self.tasks.items()}
        if self.checkpoint_step is not None:
            out["checkpoint_step"] = self.checkpoint_step
        if self.provenance is not None:
            out |= {"data": self.provenance.data, "reference": self.provenance.reference}
        return out


def sweep_row(row: Row) -> dict[str, Any]:
    """One budget of the headline task as ``eval.json``'s top-level ``sweep`` lists it: bpb per condition, flat."""
    return {"W": row.W, "compression": row.compression, **row.bpb, "retained_fraction": row.retained_fraction,
            "lens_rank_corr": row.lens_rank_corr}  # fmt: skip
