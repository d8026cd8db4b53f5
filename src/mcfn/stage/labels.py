"""How much signal the LensNet stage's labels carry on one run (issue 66, item 2):
``python -m train.lens --run DIR --reliability N``.

The run's own LensNet walks two sets of ``N`` windows under generation's protocol, as a stage round traces them:
the stage's own training windows (its first round's, beyond every batch the MC phase read: half of them with a
long-range task) and corpus text, validation windows past the ones the stage
selects and reports on (:func:`reliability_windows`). Every state's single-edit ΔNLL labels are measured twice, from
disjoint random halves of the
chunk's predictions (:mod:`mcfn.stage.reliability`), and so is the attention label on the same windows. The figures
per set and label kind: the split-half agreement with its error (over windows for the training set, over documents
for the validation set), what it allows a predictor, the seconds it took, and the run's own LensNet's
``utility_corr`` with the ΔNLL labels on the same states, with the same clustering.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from mcfn.config import RunConfig
from mcfn.core.focus import Refocus
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.data.corpus import Split
from mcfn.data.loader import evaluation_windows
from mcfn.errors import UserError
from mcfn.evaluation.counterfactual import State
from mcfn.evaluation.indexer_recall import tail_attention
from mcfn.seeding import derive_seed
from mcfn.stage.candidates import read_run, run_system
from mcfn.stage.carried import carried_delta_by_token
from mcfn.stage.reliability import (
    attention_reliability,
    attention_utility,
    delta_reliability,
    single_edit_reliability,
    whole_cut_reliability,
)
from mcfn.stage.traces import FIRST_TRACE_BATCH, RANDOM_CUTS, trace, trace_sampler


def label_reliability(
    run_dir: Path, windows: int, held_out: int | None, device: torch.device, say: Callable[[str], None]
) -> dict:
    """The split-half reliability of the single-edit ΔNLL and attention labels on ``windows`` traced training
    windows and as many validation windows of the run in ``run_dir`` (after the ``2 · held_out`` the stage selects
    and reports on; None: the run's ``lens_stage.held_out``), and how well each predicts the measured ΔNLL."""
    if windows < 2:
        raise UserError("the labels' reliability needs at least 2 traced windows (its error is over windows)")
    ckpt, corpus = read_run(run_dir, "whose labels to measure")
    system, cfg = run_system(ckpt, device)
    sampler = trace_sampler(cfg, corpus)
    training = [sampler.batch(FIRST_TRACE_BATCH + i, 1) for i in range(windows)]
    held_out = cfg.lens_stage.held_out if held_out is None else held_out
    rows, docs = reliability_windows(corpus.val, cfg.data.seq_len + 1, windows, 2 * held_out, cfg.train.seed)
    sets = {
        "training windows (the stage's: half with a task)": (training, list(range(windows))),
        "validation windows (corpus text)": (list(rows[:, None]), docs.tolist()),
    }
    return {name: measure_set(system, cfg, [b.to(device) for b in batches], clusters, name, say)
            for name, (batches, clusters) in sets.items()}  # fmt: skip


def measure_set(
    system: MegaContext, cfg: RunConfig, batches: list[Tensor], clusters: list[int], name: str, say: Callable
) -> dict[str, dict]:
    """Every label kind on one set of windows (each ``[1, T + 1]``, its error over ``clusters``)."""
    halves_seed = derive_seed(cfg.train.seed, "label_halves", 0)
    started = time.perf_counter()
    protocol = Refocus(cfg.mc.refocus_every)
    windows, trees, states = traced(system, batches, protocol, cfg, name)
    edits = single_edit_reliability(states, halves_seed, clusters)
    whole = whole_cut_reliability(states, halves_seed, clusters)  # from the same traced forward as the edits
    edit_s = time.perf_counter() - started
    two = delta_reliability(two_chunk_labels(system, windows, trees, states, protocol, clusters), halves_seed)
    two_s = time.perf_counter() - started
    utility = cluster_mean([(clusters[st.window], st.utility_corr) for st in states])
    started = time.perf_counter()
    attentions = [tail_attention(system.base, window, system.layout)[0] for window in batches]  # read by both below
    attention, beyond = attention_reliability(attentions, system.nodes, halves_seed, clusters)
    attention_s = time.perf_counter() - started
    by_window = [[st for st in states if st.window == w] for w in range(len(batches))]
    attention_worth = cluster_mean([
        (clusters[w], corr)
        for w, chosen in enumerate(by_window)
        for corr in attention_utility(attentions[w], chosen, system.nodes, cfg.mc.refocus_every)
    ])  # fmt: skip
    measured = {  # each kind: its reliability, the seconds it took, and its further figures
        "single-edit ΔNLL": (edits, edit_s, {"utility_corr": utility[0], "utility_se": utility[1]}),
        "two-chunk ΔNLL": (two, two_s, {}),
        "whole cuts": (whole, edit_s, {}),
        "attention": (attention, attention_s, {"utility_corr": attention_worth[0], "utility_se": attention_worth[1]}),
        "attention beyond position": (beyond, attention_s, {}),
    }
    for kind, (r, seconds, _) in measured.items():
        say(
            f"[labels] {name}, {kind}: split-half agreement {r.half:+.3f} ± {r.se:.3f} over {r.windows} "
            f"clusters ({r.states} states, {seconds:.0f} s); full-length {r.full:+.3f}, "
            f"a predictor's ceiling {r.ceiling:.2f}"
        )
    say(
        f"[labels] {name}: the ΔNLL labels' rank correlation with the run's LensNet's predicted worth "
        f"{utility[0]:+.3f} ± {utility[1]:.3f}; with the attention label's worth {attention_worth[0]:+.3f} "
        f"± {attention_worth[1]:.3f}"
    )
    return {kind: r.to_json() | {"seconds": seconds} | more for kind, (r, seconds, more) in measured.items()}


def traced(
    system: MegaContext, batches: list[torch.Tensor], protocol: Refocus, cfg: RunConfig, name: str
) -> tuple[Tensor, Tensor, list[State]]:
    """The windows ``[N, T + 1]``, their trees ``[N, n_nodes, D]`` and their traced states."""
    with tqdm(total=len(batches), desc=f"labels: {name}", unit="window", file=sys.stderr) as bar:
        # The random candidates are drawn as the stage's first round draws them.
        random_seed = derive_seed(cfg.train.seed, "lens_traces", 1)
        return trace(system, batches, protocol, RANDOM_CUTS, random_seed, bar)


def two_chunk_labels(
    system: MegaContext, windows: Tensor, trees: Tensor, states: list[State], protocol: Refocus, clusters: list[int]
) -> list[tuple[int, Tensor]]:
    """Each state's edits labelled over its chunk and the next (:mod:`mcfn.stage.carried`), with its cluster; the
    last chunk of each window has no next one and is left out."""
    return [
        (clusters[state.window],
         carried_delta_by_token(system, Tree(emb=trees[state.window][None], batch_size=[1]),
                                windows[state.window][None], protocol, state, following))
        for state, following in zip(states, states[1:], strict=False)
        if following.window == state.window
    ]  # fmt: skip


def cluster_mean(values: list[tuple[int, float]]) -> tuple[float, float]:
    """The mean of ``(cluster, value)`` pairs and its standard error over clusters (windows or documents: each
    cluster's values are averaged first, since they are not independent); NaN values (below three edits) left out."""
    by_cluster: dict[int, list[float]] = {}
    for cluster, value in values:
        if value == value:
            by_cluster.setdefault(cluster, []).append(value)
    means = torch.tensor([sum(v) / len(v) for v in by_cluster.values()], dtype=torch.float64)
    if means.numel() < 2:
        return float(means.mean()) if means.numel() else float("nan"), float("nan")
    return float(means.mean()), float(means.std() / means.numel() ** 0.5)


def reliability_windows(split: Split, length: int, count: int, skip: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` validation windows ``[count, length]`` and each one's document: those the final evaluation would
    draw after the ``skip`` the stage selects and reports on, or, where the split has too few of them (C++'s has
    47), windows at random positions of its text, which may overlap the stage's windows: the measurement chooses
    nothing."""
    rows, docs = (torch.cat(x) for x in evaluation_windows(split, length, skip + count, 1))
    if rows.size(0) >= skip + count:
        return rows[skip:], docs[skip:]
    if len(split.tokens) < length:
        raise UserError(f"the validation split has {len(split.tokens)} tokens, fewer than one window of {length}")
    generator = torch.Generator().manual_seed(derive_seed(seed, "label_halves", 1))
    starts = torch.randint(len(split.tokens) - length + 1, (count,), generator=generator)
    rows = torch.stack([torch.from_numpy(split.tokens[s : s + length].astype(np.int64)) for s in starts.tolist()])
    return rows, torch.from_numpy(np.searchsorted(split.doc_offsets, starts.numpy(), side="right") - 1)
