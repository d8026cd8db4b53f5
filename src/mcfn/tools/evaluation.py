"""Held-out evaluation of a MegaContext model (DESIGN §7): does the working context keep what matters?

Every window is scored on its last ``H`` target positions, the part each working context shows at LOD0 (I4),
under these conditions at the same budget ``W``:

* ``full``: all ``T`` tokens at LOD0, the upper bound (no budget);
* ``recency``: the newest tokens at LOD0, nothing older (truncation);
* ``recent``: the training-free structured cut, full coverage with the newest detail first
  (:func:`mcfn.core.variants.recent_cut`): the bar a learned focus must clear on natural text;
* ``random``: a random compressed working context (the mean over ``M`` of them);
* ``attn``: the training-free focus, refocused by the base model's own attention (:mod:`mcfn.tools.attention`);
* ``match``: the training-free n-gram copy focus (:mod:`mcfn.core.match`);
* ``lens``: LensNet's scores, read once from the block view (I12), and a few allocator steps (it may leave blocks
  out, down to truncation);
* ``lens_nogist``: the same working contexts as ``lens`` with every gist's embedding zeroed: ``lens_nogist −
  lens`` is what the gists are worth (the zeroed-gist ablation); positions and spans are kept;
* ``best_of_random``, ``best_of_all`` (optimistic: picked per chunk on the tokens they are scored on) and
  ``best_of_all_oos`` (picked on the other half of each chunk): what a better choice of cut could gain
  (:mod:`mcfn.tools.headroom`);
* ``full_plain``: with ``--reference``, a plain GPT trained at length ``T``: what a user would pick instead.

Two protocols, both reported. The headline is **generation's** (:mod:`mcfn.tools.refocused`): every condition that
chooses a cut refocuses every ``R = mc.refocus_every`` tokens in generation's own layout, and the predictions of each
chunk of ``R`` come from the cut chosen at the chunk's horizon. The earlier one, **one cut** for all ``H`` tail
predictions (:mod:`mcfn.tools.one_cut`, ``R = H``), stays beside it so that earlier figures remain comparable. A cut
is chosen from each window up to its **horizon** (I11), the position of the first prediction it serves (the tail's
first token on ``corpus``, the token before the answer on a probe, and ``R`` further for each later chunk): it never
depends on the tokens it is scored on.

What is scored depends on the task (:mod:`mcfn.data.probes`): every tail token for ``corpus``, the answer
tokens of ``passkey``, ``kv-recall`` and ``copy``. ``corpus`` also scores its **long-range tokens**, defined by
the tokens alone (:mod:`mcfn.tools.long_range`): tail predictions whose trigram context occurred earlier in the
window, but only beyond the last ``W - R`` tokens at the run's ``W``. A probe window counts as answered when every
answer token is the greedy argmax.

``utility_corr`` (``corpus``, under generation's protocol) is, per state (a window's chunk), the Spearman correlation
of LensNet's predicted worth of each single edit of its own cut with the edit's measured ΔNLL
(:mod:`mcfn.tools.counterfactual`), averaged over states.

``lens_rank_corr`` is the Spearman correlation, over all pairs of a chunk's random contexts, between
LensNet's predicted preference and the measured gap in scored nats. LensNet's predicted preference of ``a``
over ``b`` is ``Σ s·y`` over ``b``'s entries with the I7 targets that move ``b`` towards ``a``, minus the same
with the roles swapped (:func:`mcfn.core.preferences.pair_margin`).

Everything runs eagerly under ``no_grad``: the evaluation sweeps several budgets, each its own shape. The
working contexts go through the training step's own stages (tree, assembly, the base model's forward).
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial

import torch
from torch import Tensor
from tqdm import tqdm

from mcfn.core.focus import refocus_budget
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout
from mcfn.core.step import split_window
from mcfn.core.system import MegaContext
from mcfn.data.probes import ProbeBatch, evaluation_probe, misfit
from mcfn.data.tokenizer import Tokenizer
from mcfn.geometry import most_refocus_every
from mcfn.seeding import derive_seed
from mcfn.tools.eval_batch import EvalBatch, EvalSettings
from mcfn.tools.eval_stats import Scores, accuracy_by_depth, record, summarise
from mcfn.tools.long_range import far_context_tokens
from mcfn.tools.one_cut import predict_budget, tail_predictions
from mcfn.tools.refocused import predict_chunked

CONDITIONS = ("full", "recency", "recent", "random", "attn", "match", "lens", "lens_nogist", "best_of_random",
              "best_of_all", "best_of_all_oos")  # fmt: skip


def default_budgets(layout: Layout) -> tuple[int, ...]:
    """The run's own ``W`` first, then ``T/2, T/4, T/8`` where they fit above the coarsest cover."""
    sweep = [layout.W] + [layout.T // d for d in (2, 4, 8)]
    fits = [w for w in sweep if layout.coarsest_cover < w < layout.T]
    return tuple(dict.fromkeys(fits))


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


PARTS = ("all", "longrange")  # what a task's scores cover: every scored target, and (corpus) the long-range ones


def protocol_budgets(settings: EvalSettings, layout: Layout, protocol: str) -> tuple[int, ...]:
    """The budgets a protocol is scored at: every one for ``one_cut``; for ``refocus``, those whose ``W - R`` holds
    a refocused cut (the run's own always does: :func:`check_settings`)."""
    if protocol == "one_cut":
        return settings.budgets
    most = partial(most_refocus_every, tail=layout.H, block=layout.K, lod_max=layout.L)
    return tuple(w for w in settings.budgets if settings.refocus_every <= most(w))


def check_settings(settings: EvalSettings, layout: Layout) -> None:
    """Refuse, in one line naming the valid range, an ``R`` that the headline budget cannot refocus with."""
    refocus_budget(dataclasses.replace(layout, W=settings.budgets[0]), settings.refocus_every)


@torch.no_grad()
def score_batch(
    system: MegaContext,
    probe: ProbeBatch,
    token_bytes: Tensor,
    settings: EvalSettings,
    index: int,
    reference: GPT | None = None,
    with_longrange: bool = False,
) -> dict[str, dict[str, dict[int, Scores]]]:
    """One batch of a task scored at every budget under both protocols: ``{"all": {protocol: {budget: Scores}}}``,
    and ``with_longrange`` (``corpus``) ``"longrange"`` the same on the long-range tokens (defined by the tokens at the
    headline budget, :func:`~mcfn.tools.long_range.far_context_tokens`). The same random contexts for every checkpoint
    on these windows."""
    layout, window = system.layout, probe.window
    targets = split_window(window)[1][:, layout.T - layout.H :]
    scored = token_bytes[targets] * probe.answer[:, layout.T - layout.H :]  # [B, H] bytes of the scored targets
    horizon = probe.answer.long().argmax(-1)  # the first scored prediction's position: what a cut may be chosen from
    utility = with_longrange and system.lensnet is not None and not settings.brief
    batch = EvalBatch.of(system, settings, window, horizon, utility=utility)
    references = {"full": full_predictions(system.base, window, layout.H)}
    if reference is not None:
        references["full_plain"] = full_predictions(reference, window, layout.H)
    generator = torch.Generator(device=window.device)
    parts = PARTS if with_longrange else PARTS[:1]
    out: dict[str, dict[str, dict[int, Scores]]] = {part: {p: {} for p in settings.protocols} for part in parts}
    near = settings.budgets[0] - settings.refocus_every  # what truncation keeps at a refocus, at the headline W
    long_range = scored * far_context_tokens(window, layout.H, near) if with_longrange else None
    for name in settings.protocols:
        predict = predict_budget if name == "one_cut" else predict_chunked
        for budget in protocol_budgets(settings, layout, name):
            generator.manual_seed(derive_seed(budget, "eval_contexts", index))
            pred = predict(batch, budget, generator)
            out["all"][name][budget] = record(pred, references, scored, probe.depth)
            if long_range is not None:
                out["longrange"][name][budget] = record(pred, references, long_range, probe.depth, per_state=False)
    return out


def summarise_task(
    settings: EvalSettings, layout: Layout, task: str, scores: dict[int, Scores], longrange, protocol: str, lens: bool
) -> dict:
    """One protocol's report of a task: the headline budget's figures, the sweep, long-range tokens, depths."""
    budgets = protocol_budgets(settings, layout, protocol)
    rows = [summarise(scores[w], task, w, layout.T) for w in budgets]
    result = {**rows[0], "sweep": rows}
    if longrange is not None:
        head = longrange[budgets[0]]
        result["longrange"] = {
            "definition": f"trigram context seen only beyond the last W - R = {budgets[0] - settings.refocus_every} "
            "tokens",
            "tokens": int(sum(int((b > 0).sum()) for b in head.nbytes)),
            **summarise(head, task, budgets[0], layout.T),
        }
    if task != "corpus":
        condition = "lens" if lens else "attn"
        result["depth_accuracy"] = {
            "condition": condition,
            "by_budget": {str(w): accuracy_by_depth(scores[w], condition) for w in budgets},
        }
    return result


def score_tasks(
    system: MegaContext,
    windows: list[Tensor],
    token_bytes: Tensor,
    tokenizer: Tokenizer | None,
    settings: EvalSettings,
    reference: torch.nn.Module | None = None,
    progress=None,
    docs: list[Tensor] | None = None,
) -> dict:
    """Score every task of ``settings`` on the held-out ``windows`` (each task writes its probe into them;
    ``corpus`` alone needs no tokenizer). Each task's figures are generation's protocol's, with the one-cut
    protocol's under ``one_cut``. ``docs``: each window's document, batch by batch, for errors by document (without
    them each window counts as its own)."""
    was_training = system.training
    system.eval()
    layout, device = system.layout, token_bytes.device
    check_settings(settings, layout)
    tasks: dict[str, dict] = {}
    for task in settings.tasks:
        reason = misfit(task, tokenizer, layout.T, layout.H)
        if reason is not None:  # a question longer than the scored tail: reported, not scored
            tasks[task] = {"skipped": reason}
            continue
        scores = {part: {p: {w: Scores() for w in settings.budgets} for p in settings.protocols} for part in PARTS}
        batches = windows if task == "corpus" else windows[: settings.probe_batches]
        for index, batch in enumerate(batches):
            probe = evaluation_probe(task, batch, tokenizer, layout.H, index)
            probe = ProbeBatch(probe.window.to(device), probe.answer.to(device), probe.depth)
            scored = score_batch(system, probe, token_bytes, settings, index, reference, task == "corpus")
            for part, by_protocol in scored.items():
                for p, by_budget in by_protocol.items():
                    for w, one_batch in by_budget.items():
                        one_batch.docs.extend([] if docs is None else [docs[index]])
                        scores[part][p][w].extend(one_batch)
            if progress is not None:
                progress()
        longrange = scores["longrange"] if task == "corpus" else None
        per_protocol = {
            p: summarise_task(
                settings, layout, task, scores["all"][p], None if longrange is None else longrange[p], p,
                system.lensnet is not None,
            )
            for p in settings.protocols
        }  # fmt: skip
        tasks[task] = {**per_protocol.pop("refocus"), **per_protocol}
    system.train(was_training)
    return tasks


def sweep_row(row: dict) -> dict:
    """One budget of the headline task as ``eval.json``'s top-level ``sweep`` lists it: bpb per condition, flat."""
    return {"W": row["W"], "compression": row["compression"], **row["bpb"],
            "retained_fraction": row["retained_fraction"], "lens_rank_corr": row.get("lens_rank_corr")}  # fmt: skip


GENERATION_CONTEXTS = {"lens": "focus", "match": "match", "recency": "recency"}  # condition: train.generate --context


def best_context(bpb: dict[str, float]) -> str:
    """The ``train.generate --context`` whose condition scored the lowest bpb: the policy to generate with."""
    return GENERATION_CONTEXTS[min((c for c in GENERATION_CONTEXTS if c in bpb), key=bpb.__getitem__)]


def evaluate(
    system: MegaContext,
    windows: list[Tensor],
    token_bytes: Tensor,
    tokenizer: Tokenizer,
    settings: EvalSettings,
    reference: torch.nn.Module | None = None,
    docs: list[Tensor] | None = None,
    split: str | None = None,
) -> dict:
    """The evaluation, the one entry point of ``train.eval`` and a run's final evaluation: :func:`score_tasks`
    on the held-out ``windows`` with a progress bar on stderr. The headline keys come from ``corpus`` at the
    first budget, and ``tasks`` holds every task; :mod:`mcfn.tools.eval_report` formats it. ``docs`` (each
    window's document) makes every error a bootstrap over documents; ``split`` names where the windows came from."""
    probes = len(windows[: settings.probe_batches])
    total = len(windows) + probes * (len(settings.tasks) - 1)  # batches; a skipped task's are never counted
    with tqdm(total=total, desc="eval", unit="batch", file=sys.stderr, dynamic_ncols=True) as bar:
        tasks = score_tasks(system, windows, token_bytes, tokenizer, settings, reference, lambda: bar.update(1), docs)
    head = tasks[settings.tasks[0]]
    layout = system.layout
    return {
        "split": split,
        "windows": sum(b.size(0) for b in windows),
        "documents": None if docs is None else int(torch.cat(docs).unique().numel()),
        "se": "document" if docs is not None else "window",
        "T": layout.T,
        "W": settings.budgets[0],
        "H": layout.H,
        "bpb": head["bpb"],
        "retained_fraction": head["retained_fraction"],
        "lens_rank_corr": head.get("lens_rank_corr"),
        "utility_corr": head.get("utility_corr"),
        "best_context": best_context(head["bpb"]),
        "sweep": [sweep_row(r) for r in head["sweep"]],
        "n_windows_per_probe": sum(b.size(0) for b in windows[: settings.probe_batches]),
        "random_contexts": settings.random_contexts,
        "refocus": settings.refocus,
        "refocus_every": settings.refocus_every,
        "warm_steps": settings.warm_steps,
        **{
            p: {key: head[p].get(key) for key in ("bpb", "retained_fraction", "lens_rank_corr")}
            for p in settings.protocols[1:]
        },
        **({"brief": True} if settings.brief else {}),  # a full evaluation's file is as it always was
        "tasks": tasks,
    }
