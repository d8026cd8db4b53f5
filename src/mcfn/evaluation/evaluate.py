"""Held-out evaluation of a MegaContext model (DESIGN §7): does the working context keep what matters?

Every window is scored on its last ``H`` target positions, the part each working context shows at LOD0 (I4),
under these conditions at the same budget ``W``:

* ``full``: all ``T`` tokens at LOD0, the upper bound (no budget);
* ``recency``: the newest tokens at LOD0, nothing older (truncation);
* ``recent``: the training-free structured cut, full coverage with the newest detail first
  (:func:`mcfn.core.variants.recent_cut`): the bar a learned focus must clear on natural text;
* ``random``: a random compressed working context (the mean over ``M`` of them);
* ``attn``: the training-free focus, refocused by the base model's own attention
  (:func:`mcfn.core.attention.attention_scores`);
* ``match``: the training-free n-gram copy focus (:mod:`mcfn.core.match`);
* ``lens``: LensNet's scores, read once from the block view (I12), and a few allocator steps (it may leave blocks
  out, down to truncation);
* ``lens_nogist``: the same working contexts as ``lens`` with every gist's embedding zeroed: ``lens_nogist −
  lens`` is what the gists are worth (the zeroed-gist ablation); positions and spans are kept;
* ``best_of_random``, ``best_of_all`` (optimistic: picked per chunk on the tokens they are scored on) and
  ``best_of_all_oos`` (picked on the other half of each chunk): what a better choice of cut could gain
  (:mod:`mcfn.evaluation.headroom`);
* ``full_plain``: with ``--reference``, a plain GPT trained at length ``T``: what a user would pick instead.

Two protocols, both reported. The headline is **generation's** (:mod:`mcfn.evaluation.refocused`): every condition that
chooses a cut refocuses every ``R = mc.refocus_every`` tokens in generation's own layout, and the predictions of each
chunk of ``R`` come from the cut chosen at the chunk's horizon. The earlier one, **one cut** for all ``H`` tail
predictions (:mod:`mcfn.evaluation.one_cut`, ``R = H``), stays beside it so that earlier figures remain comparable.
A cut is chosen from each window up to its **horizon** (I11), the position of the first prediction it serves (the
tail's first token on ``corpus``, the token before the answer on a probe, and ``R`` further for each later chunk): it
never depends on the tokens it is scored on.

What is scored depends on the task (:mod:`mcfn.data.probes`): every tail token for ``corpus``, the answer
tokens of ``passkey``, ``kv-recall`` and ``copy``. ``corpus`` also scores its **long-range tokens**, defined by
the tokens alone (:mod:`mcfn.evaluation.long_range`): tail predictions whose trigram context occurred earlier in the
window, but only beyond the last ``W - R`` tokens at the run's ``W``. A probe window counts as answered when every
answer token is the greedy argmax.

``indexer_recall`` (``corpus``, under generation's protocol, at the headline budget): per refocusing policy, the
share of the far blocks full attention reads most per chunk that its cuts show in detail
(:mod:`mcfn.evaluation.indexer_recall`).

``utility_corr`` (``corpus``, under generation's protocol) is, per state (a window's chunk), the Spearman correlation
of LensNet's predicted worth of each single edit of its own cut with the edit's measured ΔNLL
(:mod:`mcfn.evaluation.counterfactual`), averaged over states.

``lens_rank_corr`` is the Spearman correlation, over all pairs of a chunk's random contexts, between
LensNet's predicted preference and the measured gap in scored nats. LensNet's predicted preference of ``a``
over ``b`` is ``Σ s·y`` over ``b``'s entries with the I7 targets that move ``b`` towards ``a``, minus the same
with the roles swapped (:func:`mcfn.core.preferences.pair_margin`).

Everything runs eagerly under ``no_grad``: the evaluation sweeps several budgets, each its own shape. The
working contexts go through the training step's own stages (tree, assembly, the base model's forward).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor
from tqdm import tqdm

from mcfn.core.model import GPT
from mcfn.core.nodes import Layout
from mcfn.core.policy import ATTN, FULL, LENS, policies
from mcfn.core.step import split_window
from mcfn.core.system import MegaContext
from mcfn.data.probes import ProbeBatch, evaluation_probe, misfit
from mcfn.data.tokenizer import Tokenizer
from mcfn.evaluation.batch import EvalBatch, EvalSettings
from mcfn.evaluation.headroom import BEST_OF
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.indexer_recall import IndexerRecall, chunk_recall, tail_attention
from mcfn.evaluation.long_range import far_context_tokens
from mcfn.evaluation.one_cut import NOGIST, predict_budget, tail_predictions
from mcfn.evaluation.refocused import ChunkedPredictions, predict_chunked
from mcfn.evaluation.result import (
    FULL_PLAIN,
    DepthAccuracy,
    EvalReport,
    LongRange,
    ProtocolResult,
    Skipped,
    TaskResult,
)
from mcfn.evaluation.stats import Scores, accuracy_by_depth, record, summarise
from mcfn.geometry import most_refocus_every
from mcfn.seeding import derive_seed


def conditions(candidates: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every condition an evaluation reports, in the tables' order: each focus policy, the ``candidates`` scored
    beside them (:attr:`EvalSettings.candidates`), then the gist ablation and the best-of conditions (``full_plain``,
    with ``--reference``, comes last)."""
    return (*(policy.name for policy in policies()), *candidates, NOGIST, *BEST_OF)


def full_predictions(base: GPT, window: Tensor, tail: int) -> tuple[Tensor, Tensor]:
    """Tail NLL and argmax hits ``[B, H]`` with all ``T`` tokens at LOD0."""
    inputs, targets = split_window(window)
    first = torch.full((window.size(0),), inputs.size(1) - tail, device=window.device)
    return tail_predictions(base, base.token_hidden(inputs), first, targets[:, -tail:])


@torch.no_grad()
def probe_accuracy(base: GPT, windows: list[Tensor], tokenizer: Tokenizer, tail: int, task: str = "passkey"):
    """The share of held-out ``windows`` whose probe ``task`` the base model answers reading the whole window
    (``full``), the probes written as the evaluation writes them; ``None`` where the probe does not fit the tail.
    Tracked during training (``probe/passkey_full``), it shows when retrieval forms."""
    T = windows[0].size(1) - 1
    if misfit(task, tokenizer, T, tail) is not None:
        return None
    answered, device = [], base.wte.weight.device  # held-out windows stay on the CPU; the model may not
    for index, batch in enumerate(windows):
        probe = evaluation_probe(task, batch.cpu(), tokenizer, tail, index)
        hit = full_predictions(base, probe.window.to(device), tail)[1]
        answer = probe.answer[:, T - tail :].to(device)
        answered.append((hit | ~answer).all(-1))
    return float(torch.cat(answered).float().mean())


def protocol_budgets(settings: EvalSettings, layout: Layout, protocol: str) -> tuple[int, ...]:
    """The budgets a protocol is scored at: every one for ``one_cut``; for ``refocus``, those whose ``W - R`` holds
    a refocused cut (the headline always does: :func:`mcfn.evaluation.batch.evaluation_budgets`)."""
    if protocol == "one_cut":
        return settings.budgets
    most = partial(most_refocus_every, tail=layout.H, block=layout.K, lod_max=layout.L)
    return tuple(w for w in settings.budgets if settings.refocus_every <= most(w))


@dataclass(frozen=True)
class TaskBatch:
    """One batch of a task as it is scored: what both protocols read, the bytes of the targets that count, and the
    no-budget references' predictions."""

    contexts: EvalBatch
    index: int  # the batch's position: it seeds the random contexts, the same for every checkpoint
    scored: Tensor  # [B, H] bytes of each scored target (0: not scored)
    longrange: Tensor | None  # [B, H] the same on the long-range tokens only (corpus), None elsewhere
    depth: Tensor  # [B] the probe's depth
    references: dict[str, tuple[Tensor, Tensor]]  # full (and full_plain): tail NLL and argmax hits [B, H]
    doc: Tensor | None  # [B] each window's document, where known

    @classmethod
    @torch.no_grad()
    def of(cls, system: MegaContext, probe: ProbeBatch, held_out: HeldOut, settings: EvalSettings, index: int,
           reference: GPT | None, corpus: bool) -> TaskBatch:  # fmt: skip
        """The cut of each window is chosen up to its first scored prediction (I11); ``corpus`` also scores its
        long-range tokens (defined by the tokens at the headline budget) and, with LensNet, ``utility_corr``."""
        layout, window = system.layout, probe.window
        targets = split_window(window)[1][:, layout.T - layout.H :]
        scored = held_out.token_bytes[targets] * probe.answer[:, layout.T - layout.H :]
        horizon = probe.answer.long().argmax(-1)
        utility = corpus and system.lensnet is not None and not settings.brief
        references = {FULL.name: full_predictions(system.base, window, layout.H)}
        if reference is not None:
            references[FULL_PLAIN] = full_predictions(reference, window, layout.H)
        near = settings.budgets[0] - settings.refocus_every  # what truncation keeps at a refocus, at the headline W
        longrange = scored * far_context_tokens(window, layout.H, near) if corpus else None
        doc = None if held_out.docs is None else held_out.docs[index]
        contexts = EvalBatch.of(system, settings, window, horizon, utility=utility)
        return cls(contexts, index, scored, longrange, probe.depth, references, doc)


@dataclass
class TaskScores:
    """One task's per-window scores, batch after batch: per ``(protocol, budget)`` on every scored target and, for
    ``corpus``, on its long-range tokens."""

    all: dict[tuple[str, int], Scores] = field(default_factory=dict)
    longrange: dict[tuple[str, int], Scores] = field(default_factory=dict)
    # corpus: each refocusing policy's indexer recall per window at the headline budget (mcfn.evaluation.indexer_recall)
    recall: dict[str, list[float]] = field(default_factory=dict)

    def extend(self, other: TaskScores) -> None:
        """Append ``other``'s windows (a later batch) to these."""
        for name, values in other.recall.items():
            self.recall.setdefault(name, []).extend(values)
        for mine, theirs in ((self.all, other.all), (self.longrange, other.longrange)):
            for key, scores in theirs.items():
                mine.setdefault(key, Scores()).extend(scores)


@torch.no_grad()
def score_batch(batch: TaskBatch) -> TaskScores:
    """One batch of a task scored at every budget under every protocol of its settings."""
    settings, layout = batch.contexts.settings, batch.contexts.system.layout
    generator = torch.Generator(device=batch.scored.device)
    out = TaskScores()
    for name in settings.protocols:
        predict = predict_budget if name == "one_cut" else predict_chunked
        for budget in protocol_budgets(settings, layout, name):
            generator.manual_seed(derive_seed(budget, "eval_contexts", batch.index))
            pred = predict(batch.contexts, budget, generator)
            out.all[name, budget] = record(pred, batch.references, batch.scored, batch.depth)
            if batch.longrange is not None and name == "refocus" and budget == settings.budgets[0]:
                out.recall = window_recalls(batch, pred, budget)
            if batch.longrange is not None:
                longrange = record(pred, batch.references, batch.longrange, batch.depth, per_state=False)
                out.longrange[name, budget] = longrange
    for scores in (*out.all.values(), *out.longrange.values()):
        scores.docs.extend([] if batch.doc is None else [batch.doc])
    return out


def window_recalls(batch: TaskBatch, pred: ChunkedPredictions, budget: int) -> dict[str, list[float]]:
    """Each refocusing policy's indexer recall per window of ``batch`` (the mean over its chunks that have far
    blocks; windows without any left out, the same for every policy)."""
    system, R = batch.contexts.system, batch.contexts.settings.refocus_every
    attention = tail_attention(system.base, batch.contexts.window, system.layout)
    out: dict[str, list[float]] = {name: [] for name in pred.cuts}
    for row in range(attention.size(0)):
        per_policy = {
            name: chunk_recall(attention[row], pred.chunk_of(name)[row], cuts[row], system.layout, budget - R, R)
            for name, cuts in pred.cuts.items()
        }
        for name, values in per_policy.items():
            if values:
                out[name].append(sum(values) / len(values))
    return out


def summarise_task(scores: TaskScores, task: str, settings: EvalSettings, layout: Layout, lens: bool) -> TaskResult:
    """A task's report per protocol: the headline budget's figures and the sweep, the long-range tokens (corpus),
    the accuracy by depth (probes; ``lens``'s, or without LensNet ``attn``'s)."""
    protocols = {}
    for name in settings.protocols:
        budgets = protocol_budgets(settings, layout, name)
        rows = tuple(summarise(scores.all[name, w], task, w, layout.T, settings.names) for w in budgets)
        longrange = depth = None
        if (name, budgets[0]) in scores.longrange:
            head = scores.longrange[name, budgets[0]]
            longrange = LongRange(
                f"trigram context seen only beyond the last W - R = {budgets[0] - settings.refocus_every} tokens",
                int(sum(int((b > 0).sum()) for b in head.nbytes)),
                summarise(head, task, budgets[0], layout.T, settings.names),
            )
        if task != "corpus":
            condition = LENS.name if lens else ATTN.name
            depth = DepthAccuracy(condition, {w: accuracy_by_depth(scores.all[name, w], condition) for w in budgets})
        recall = IndexerRecall.of(scores.recall) if name == "refocus" else None
        protocols[name] = ProtocolResult(rows, longrange, depth, recall)
    return TaskResult(protocols)


def score_tasks(
    system: MegaContext,
    held_out: HeldOut,
    settings: EvalSettings,
    reference: torch.nn.Module | None = None,
    progress: Callable[[], None] | None = None,
) -> dict[str, TaskResult | Skipped]:
    """Score every task of ``settings`` on the ``held_out`` windows (each task writes its probe into them)."""
    was_training = system.training
    system.eval()
    layout, device = system.layout, held_out.token_bytes.device
    tasks: dict[str, TaskResult | Skipped] = {}
    for task in settings.tasks:
        reason = misfit(task, held_out.tokenizer, layout.T, layout.H)
        if reason is not None:  # a question longer than the scored tail: reported, not scored
            tasks[task] = Skipped(reason)
            continue
        scores = TaskScores()
        batches = held_out.windows if task == "corpus" else held_out.windows[: settings.probe_batches]
        for index, windows in enumerate(batches):
            probe = evaluation_probe(task, windows, held_out.tokenizer, layout.H, index)
            probe = ProbeBatch(probe.window.to(device), probe.answer.to(device), probe.depth)
            batch = TaskBatch.of(system, probe, held_out, settings, index, reference, task == "corpus")
            scores.extend(score_batch(batch))
            if progress is not None:
                progress()
        tasks[task] = summarise_task(scores, task, settings, layout, system.lensnet is not None)
    system.train(was_training)
    return tasks


def evaluate(
    system: MegaContext, held_out: HeldOut, settings: EvalSettings, reference: torch.nn.Module | None = None
) -> EvalReport:
    """The evaluation, the one entry point of ``train.eval`` and a run's final evaluation: :func:`score_tasks`
    on the ``held_out`` windows with a progress bar on stderr. The headline figures come from ``corpus`` at the first
    budget, which must refocus every ``R``: every caller checks its settings' budgets as it makes them
    (:func:`mcfn.evaluation.batch.evaluation_budgets`). :mod:`mcfn.evaluation.report` formats the report."""
    windows = held_out.windows
    probes = len(windows[: settings.probe_batches])
    total = len(windows) + probes * (len(settings.tasks) - 1)  # batches; a skipped task's are never counted
    with tqdm(total=total, desc="eval", unit="batch", file=sys.stderr, dynamic_ncols=True) as bar:
        tasks = score_tasks(system, held_out, settings, reference, lambda: bar.update(1))
    return EvalReport(
        settings,
        T=system.layout.T,
        H=system.layout.H,
        split=held_out.split,
        windows=sum(b.size(0) for b in windows),
        documents=None if held_out.docs is None else int(torch.cat(held_out.docs).unique().numel()),
        windows_per_probe=sum(b.size(0) for b in windows[: settings.probe_batches]),
        tasks=tasks,
    )
