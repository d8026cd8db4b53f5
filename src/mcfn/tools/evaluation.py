"""Held-out evaluation of a MegaContext model (DESIGN §7): does the working context keep what matters?

Every window is scored on its last ``H`` target positions, the part each working context shows at LOD0 (I4),
under these conditions at the same budget ``W``:

* ``full``: all ``T`` tokens at LOD0, the upper bound (no budget);
* ``recency``: the last ``W`` tokens at LOD0, nothing older (truncation);
* ``recent``: the training-free structured cut, full coverage with the newest detail first
  (:func:`mcfn.core.variants.recent_cut`): the bar a learned focus must clear on natural text;
* ``random``: a random compressed working context (the mean over ``M`` of them);
* ``attn``: the training-free focus, refocused by the base model's own attention (:mod:`mcfn.tools.attention`);
* ``lens``: LensNet's scores, read once from the block view (I12), and a few allocator steps from the
  coarsest full-coverage context (it may leave blocks out, down to truncation);
* ``lens_nogist``: the same working contexts as ``lens`` with every gist's embedding zeroed: ``lens_nogist −
  lens`` is what the gists are worth (the zeroed-gist ablation); positions and spans are kept;
* ``oracle``: per window, the best of the same ``M`` random contexts by measured loss on what is scored;
* ``full_plain``: with ``--reference``, a plain GPT trained at length ``T``: what a user would pick instead.

``attn`` and ``lens`` choose their cut from each window up to its **horizon** (I11), the first scored
prediction's position: the tail's first token on ``corpus``, the token before the answer on a probe. The cut
never depends on the tokens it is scored on.

That is one cut for all ``H`` tail predictions, the protocol every reported figure uses. With ``refocus_every = R``
(``train.eval --refocus-every R``, a measurement, not the protocol) ``attn`` and ``lens`` refocus every ``R`` tail
tokens as generation does: the predictions ``[cR, (c + 1)R)`` come from a cut chosen at horizon ``T - H + cR``.
Which far text the tail will copy is mostly not legible from before it (LABLOG, tenth session).

What is scored depends on the task (:mod:`mcfn.data.probes`): every tail token for ``corpus``, the answer
tokens of ``passkey``, ``kv-recall`` and ``copy``. ``corpus`` also scores its **long-range tokens**: tail
tokens that ``full`` predicts better than ``recency`` at the run's ``W`` by more than ``LONG_RANGE_MARGIN``
nats (in the spirit of LongPPL). A probe window counts as answered when every answer token is the greedy
argmax.

``lens_rank_corr`` is the Spearman correlation, over all pairs of a window's random contexts, between
LensNet's predicted preference and the measured gap in scored nats. LensNet's predicted preference of ``a``
over ``b`` is ``Σ s·y`` over ``b``'s entries with the I7 targets that move ``b`` towards ``a``, minus the same
with the roles swapped (:func:`mcfn.core.preferences.pair_margin`).

Everything runs eagerly under ``no_grad``: the evaluation sweeps several budgets, each its own shape. The
working contexts go through the training step's own stages (tree, assembly, the base model's forward).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial

import torch
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm import tqdm

from mcfn.core.context import WorkingContext, assemble, seen_until, tail_entries
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.preferences import pair_margin, pair_slots
from mcfn.core.step import split_window
from mcfn.core.system import MegaContext, refocus, tree_stage
from mcfn.core.tree import Tree
from mcfn.core.variants import compressed_cuts, draw_variant_noise, recency_cut, recent_cut
from mcfn.data.probes import PROBES, ProbeBatch, make_probe, misfit
from mcfn.data.tokenizer import Tokenizer
from mcfn.seeding import derive_seed
from mcfn.tools.attention import attention_scores
from mcfn.tools.eval_stats import Scores, accuracy_by_depth, summarise
from mcfn.typecheck import typechecked

CONDITIONS = ("full", "recency", "recent", "random", "attn", "lens", "lens_nogist", "oracle")
LONG_RANGE_MARGIN = 1.0  # nats: a tail token is long-range when full context beats recency by more than this


@dataclass(frozen=True)
class EvalSettings:
    budgets: tuple[int, ...]  # W per sweep row; the first is the headline
    random_contexts: int = 8  # M: random compressed contexts per window (random and oracle)
    refocus: int = 4  # allocator steps for the attn and lens conditions (L + 2 settle every case tried, I12)
    tasks: tuple[str, ...] = PROBES  # corpus first: the report's headline figures come from it
    probe_batches: int | None = None  # batches that carry each probe; None: all of them (corpus always has all)
    # Tail predictions per cut of the horizon-reading conditions (attn, lens): None, one cut for the whole tail (the
    # protocol); R < H, a refocus every R tail tokens, as generation refocuses every ``refocus_every`` tokens.
    refocus_every: int | None = None


def default_budgets(layout: Layout) -> tuple[int, ...]:
    """The run's own ``W`` first, then ``T/2, T/4, T/8`` where they fit above the coarsest cover."""
    sweep = [layout.W] + [layout.T // d for d in (2, 4, 8)]
    fits = [w for w in sweep if layout.coarsest_cover < w < layout.T]
    return tuple(dict.fromkeys(fits))


@typechecked
def tail_predictions(
    base: GPT, hidden: Float[Tensor, "r n d"], first: Int[Tensor, " r"], targets: Int[Tensor, "r h"]
) -> tuple[Float[Tensor, "r h"], Bool[Tensor, "r h"]]:
    """NLL and whether the argmax is right for the ``H`` entries of each row from ``first`` on (the tail)."""
    h = tail_entries(hidden, first, targets.size(1))
    return base.nll(h, targets), base.logits(h).argmax(-1) == targets


def context_predictions(
    system: MegaContext, tree: Tree, shown: Tensor, window: Tensor, nodes: NodeTable
) -> tuple[Tensor, Tensor, WorkingContext]:
    """Tail NLL and argmax hits ``[B, S, H]`` of the ``S`` working contexts ``shown [B, S, nodes]`` per window."""
    layout, base = nodes.layout, system.base
    wc = assemble(tree, shown, window, nodes)
    first = wc.valid.sum(-1) - layout.H  # the tail is the last H valid entries (I4)
    targets = repeat(split_window(window)[1][:, layout.T - layout.H :], "b h -> (b s) h", s=shown.size(1))
    nll, hit = tail_predictions(base, base.hidden(wc.emb, wc.position, wc.span.float()), first, targets)
    return *(rearrange(x, "(b s) h -> b s h", b=window.size(0)) for x in (nll, hit)), wc


def full_predictions(base: GPT, window: Tensor, tail: int) -> tuple[Tensor, Tensor]:
    """Tail NLL and argmax hits ``[B, H]`` with all ``T`` tokens at LOD0."""
    inputs, targets = split_window(window)
    first = torch.full((window.size(0),), inputs.size(1) - tail, device=window.device)
    return tail_predictions(base, base.token_hidden(inputs), first, targets[:, -tail:])


def budget_contexts(
    system: MegaContext,
    tree: Tree,
    window: Tensor,
    horizon: Tensor,
    nodes: NodeTable,
    settings: EvalSettings,
    generator,
) -> tuple[Tensor, dict[str, slice]]:
    """The working contexts scored at one budget, ``[B, S, nodes]``, and each condition's slots; ``attn`` and
    ``lens`` choose theirs from what lies up to ``horizon [B]``, the position of the first scored prediction."""
    B, M, device = window.size(0), settings.random_contexts, window.device
    noise = draw_variant_noise(nodes.with_sizes(N=M).layout, B, generator, device)
    parts = {
        "recency": recency_cut(nodes.layout, B, device),
        "recent": repeat(recent_cut(nodes.layout, device), "n -> b 1 n", b=B),
        "random": compressed_cuts(noise, nodes.with_sizes(N=M)),
        **focus_contexts(system, tree, window, horizon, nodes, settings),
    }
    slots, at = {}, 0
    for name, cut in parts.items():
        slots[name] = slice(at, at + cut.size(1))
        at += cut.size(1)
    return torch.cat(list(parts.values()), dim=1), slots


def focus_contexts(
    system: MegaContext, tree: Tree, window: Tensor, horizon: Tensor, nodes: NodeTable, settings: EvalSettings
) -> dict[str, Tensor]:
    """The cuts ``[B, 1, nodes]`` that read the window up to ``horizon [B]``: ``attn``, and ``lens`` with a LensNet;
    each refocused from the coarsest cut."""
    start = repeat(system.coarsest, "n -> b 1 n", b=window.size(0))
    attention = partial(attention_scores, system.base, nodes.layout.H)
    parts = {
        "attn": refocus(
            system, tree, window, start, nodes, iterations=settings.refocus, scorer=attention, horizon=horizon
        )
    }
    if system.lensnet is not None:
        parts["lens"] = refocus(system, tree, window, start, nodes, iterations=settings.refocus, horizon=horizon)
    return parts


@dataclass
class Predictions:
    """Every working context's tail predictions for one batch at one budget."""

    nll: Tensor  # [B, S, H]
    hit: Tensor  # [B, S, H] bool: the argmax is the target
    slots: dict[str, slice]  # each condition's contexts among the S
    preference: Tensor | None  # [B, P]: LensNet's preference between every pair of the random contexts


def gists_zeroed(tree: Tree, nodes: NodeTable) -> Tree:
    """``tree`` with every gist's embedding zeroed (tokens kept): what ``lens_nogist`` reads."""
    return Tree(emb=tree.emb * rearrange(nodes.lod == 0, "n -> 1 n 1"), batch_size=tree.batch_size)


def refocus_in_tail(
    system: MegaContext,
    tree: Tree,
    window: Tensor,
    horizon: Tensor,
    nodes: NodeTable,
    settings: EvalSettings,
    pred: Predictions,
) -> None:
    """With ``settings.refocus_every = R``: the tail's predictions ``[cR, (c + 1)R)`` of ``attn`` and ``lens`` (and
    ``lens_nogist``: the ``lens`` cut read with every gist zeroed) come from the cuts chosen at horizon
    ``T - H + cR`` (never before ``horizon``), for every chunk ``c ≥ 1``; ``pred`` holds chunk 0's. In place."""
    layout, R = nodes.layout, settings.refocus_every
    nogist = gists_zeroed(tree, nodes) if system.lensnet is not None else None
    for first in range(R, layout.H, R):
        at = horizon.clamp(min=layout.T - layout.H + first)
        columns = slice(first, first + R)
        cuts = focus_contexts(system, tree, window, at, nodes, settings)
        nll, hit, _ = context_predictions(system, tree, torch.cat(list(cuts.values()), dim=1), window, nodes)
        chunk = {name: (nll[:, i], hit[:, i]) for i, name in enumerate(cuts)}
        if nogist is not None:
            ablated = context_predictions(system, nogist, cuts["lens"], window, nodes)
            chunk["lens_nogist"] = (ablated[0][:, 0], ablated[1][:, 0])
        for name, (chunk_nll, chunk_hit) in chunk.items():
            pred.nll[:, pred.slots[name].start, columns] = chunk_nll[:, columns]
            pred.hit[:, pred.slots[name].start, columns] = chunk_hit[:, columns]


def predict_budget(
    system: MegaContext, tree: Tree, window: Tensor, horizon: Tensor, budget: int, settings: EvalSettings, generator
) -> Predictions:
    nodes = system.nodes.with_sizes(W=budget)
    shown, slots = budget_contexts(system, tree, window, horizon, nodes, settings, generator)
    nll, hit, wc = context_predictions(system, tree, shown, window, nodes)
    preference = None
    if system.lensnet is not None:
        ablated = context_predictions(system, gists_zeroed(tree, nodes), shown[:, slots["lens"]], window, nodes)
        slots["lens_nogist"] = slice(nll.size(1), nll.size(1) + ablated[0].size(1))
        nll, hit = torch.cat([nll, ablated[0]], dim=1), torch.cat([hit, ablated[1]], dim=1)
        B, S = shown.shape[:2]
        rows = rearrange(torch.arange(B * S, device=shown.device), "(b s) -> b s", b=B)[:, slots["random"]]
        random_wc, random = wc[rows.flatten()], shown[:, slots["random"]]
        i, j = pair_slots(random.size(1), B, random.device)
        seen = seen_until(random_wc, repeat(horizon, "b -> (b s)", s=random.size(1)))
        preference = pair_margin(system.lensnet(seen), random, i, j, random_wc, nodes)
    pred = Predictions(nll, hit, slots, preference)
    if settings.refocus_every is not None:
        refocus_in_tail(system, tree, window, horizon, nodes, settings, pred)
    return pred


def record(out: Scores, pred: Predictions, references: dict[str, tuple[Tensor, Tensor]], scored: Tensor, depth) -> None:
    """Append one batch's per-window scores to ``out``: ``scored [B, H]`` holds the bytes of each tail target
    that counts (0: not scored); ``references`` are the no-budget conditions' tail NLL and hits ``[B, H]``."""
    mask = scored > 0
    for name, (nll, hit) in references.items():
        out.add(name, (nll * mask).sum(-1), (hit | ~mask).all(-1))
    nats = (pred.nll * mask[:, None]).sum(-1)  # [B, S]
    correct = (pred.hit | ~mask[:, None]).all(-1)
    for name in ("recency", "recent", "attn", "lens", "lens_nogist"):
        if name in pred.slots:
            out.add(name, nats[:, pred.slots[name]][:, 0], correct[:, pred.slots[name]][:, 0])
    random_nats, random_correct = nats[:, pred.slots["random"]], correct[:, pred.slots["random"]]
    out.add("random", random_nats.mean(-1), random_correct.double().mean(-1))
    best = random_nats.argmin(-1, keepdim=True)
    out.add("oracle", random_nats.gather(1, best)[:, 0], random_correct.gather(1, best)[:, 0])
    out.nbytes.append(scored.sum(-1).double().cpu())
    out.depth.append(depth.double().cpu())
    if pred.preference is not None:
        i, j = pair_slots(random_nats.size(1), random_nats.size(0), random_nats.device)
        out.predicted.append(pred.preference.flatten().cpu())
        out.measured.append((random_nats.gather(1, j) - random_nats.gather(1, i)).flatten().cpu())  # > 0: i better


@torch.no_grad()
def score_batch(
    system: MegaContext,
    probe: ProbeBatch,
    token_bytes: Tensor,
    settings: EvalSettings,
    index: int,
    scores: dict[int, Scores],
    longrange: dict[int, Scores] | None = None,
    reference: GPT | None = None,
) -> None:
    """Score one batch of a task at every budget, appending to ``scores`` (and for ``corpus`` the long-range
    tokens' scores to ``longrange``). The same random contexts for every checkpoint on these windows."""
    layout, window = system.layout, probe.window
    tree = tree_stage(system, window)
    targets = split_window(window)[1][:, layout.T - layout.H :]
    scored = token_bytes[targets] * probe.answer[:, layout.T - layout.H :]  # [B, H] bytes of the scored targets
    horizon = probe.answer.long().argmax(-1)  # the first scored prediction's position: what a cut may be chosen from
    references = {"full": full_predictions(system.base, window, layout.H)}
    if reference is not None:
        references["full_plain"] = full_predictions(reference, window, layout.H)
    generator = torch.Generator(device=window.device)
    long_range = None
    for budget in settings.budgets:
        generator.manual_seed(derive_seed(budget, "eval_contexts", index))
        pred = predict_budget(system, tree, window, horizon, budget, settings, generator)
        record(scores[budget], pred, references, scored, probe.depth)
        if longrange is not None:
            if long_range is None:  # defined at the headline budget: what full context predicts much better
                gain = pred.nll[:, pred.slots["recency"]][:, 0] - references["full"][0]
                long_range = scored * (gain > LONG_RANGE_MARGIN)
            record(longrange[budget], pred, references, long_range, probe.depth)


def evaluate_tasks(
    system: MegaContext,
    windows: list[Tensor],
    token_bytes: Tensor,
    tokenizer: Tokenizer | None,
    settings: EvalSettings,
    reference: torch.nn.Module | None = None,
    progress=None,
) -> dict:
    """Score every task of ``settings`` on the held-out ``windows`` (each task writes its probe into them;
    ``corpus`` alone needs no tokenizer)."""
    was_training = system.training
    system.eval()
    layout, device = system.layout, token_bytes.device
    tasks: dict[str, dict] = {}
    for task in settings.tasks:
        reason = misfit(task, tokenizer, layout.T, layout.H)
        if reason is not None:  # a question longer than the scored tail: reported, not scored
            tasks[task] = {"skipped": reason}
            continue
        scores = {w: Scores() for w in settings.budgets}
        longrange = {w: Scores() for w in settings.budgets} if task == "corpus" else None
        batches = windows if task == "corpus" else windows[: settings.probe_batches]
        for index, batch in enumerate(batches):
            probe = make_probe(task, batch, tokenizer, layout.H, derive_seed(PROBES.index(task), "eval_probes", index))
            probe = ProbeBatch(probe.window.to(device), probe.answer.to(device), probe.depth)
            score_batch(system, probe, token_bytes, settings, index, scores, longrange, reference)
            if progress is not None:
                progress()
        rows = [summarise(scores[w], task, w, layout.T) for w in settings.budgets]
        tasks[task] = {**rows[0], "sweep": rows}
        if longrange is not None:
            head = longrange[settings.budgets[0]]
            tasks[task]["longrange"] = {
                "margin_nats": LONG_RANGE_MARGIN,
                "tokens": int(sum(int((b > 0).sum()) for b in head.nbytes)),
                **summarise(head, task, settings.budgets[0], layout.T),
            }
        if task != "corpus":
            condition = "lens" if system.lensnet is not None else "attn"
            tasks[task]["depth_accuracy"] = {
                "condition": condition,
                "by_budget": {str(w): accuracy_by_depth(scores[w], condition) for w in settings.budgets},
            }
    system.train(was_training)
    return tasks


def evaluate(
    system: MegaContext,
    windows: list[Tensor],
    token_bytes: Tensor,
    tokenizer: Tokenizer,
    settings: EvalSettings,
    reference: torch.nn.Module | None = None,
) -> dict:
    """The evaluation, the one entry point of ``train.eval`` and a run's final evaluation: :func:`evaluate_tasks`
    on the held-out ``windows`` with a progress bar on stderr. The headline keys come from ``corpus`` at the
    first budget, and ``tasks`` holds every task; :mod:`mcfn.tools.eval_report` formats it."""
    probes = len(windows[: settings.probe_batches])
    total = len(windows) + probes * (len(settings.tasks) - 1)  # batches; a skipped task's are never counted
    with tqdm(total=total, desc="eval", unit="batch", file=sys.stderr, dynamic_ncols=True) as bar:
        tasks = evaluate_tasks(system, windows, token_bytes, tokenizer, settings, reference, lambda: bar.update(1))
    head = tasks[settings.tasks[0]]
    layout = system.layout
    return {
        "T": layout.T,
        "W": settings.budgets[0],
        "H": layout.H,
        "bpb": head["bpb"],
        "retained_fraction": head["retained_fraction"],
        "lens_rank_corr": head.get("lens_rank_corr"),
        "sweep": [
            {
                "W": r["W"],
                "compression": r["compression"],
                **r["bpb"],
                "retained_fraction": r["retained_fraction"],
                "lens_rank_corr": r.get("lens_rank_corr"),
            }
            for r in head["sweep"]
        ],  # fmt: skip
        "n_windows": sum(b.size(0) for b in windows),
        "n_windows_per_probe": sum(b.size(0) for b in windows[: settings.probe_batches]),
        "random_contexts": settings.random_contexts,
        "refocus": settings.refocus,
        "refocus_every": settings.refocus_every,
        "tasks": tasks,
    }
