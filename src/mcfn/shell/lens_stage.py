"""The LensNet stage: LensNet learns from what each choice costs (issue 53, ``../shared/seeds/003``).

After a run's plain and MC phases, the base model and GistNet are fixed, and LensNet is trained in rounds on its own
counterfactual traces (:mod:`mcfn.tools.counterfactual`, :mod:`mcfn.shell.traces`):

1. **trace**: walk fresh training windows (the run's own mix: corpus text and long-range tasks) under generation's
   protocol with the current policy, and label every single edit of each chunk's cut with its ΔNLL;
2. **train**: a few epochs of the ranking loss (:func:`mcfn.core.edits.ranking_loss`) over every round's traces so
   far (a replay buffer), LensNet scoring each state again from the cached trees, without the base model;
3. **measure**: the held-out ``utility_corr`` on validation windows never traced.

LensNet starts afresh with the match prior (``mc.lens.match_prior``): round 1's policy is ``match``'s cut, and
what the labels teach is added to it, so that where they say nothing the policy keeps ``match``'s order (and past
every copy, truncation's). The trained LensNet and the stage's figures go back into the run's checkpoint, with
``mc.lens.match_prior`` set, so that ``train.eval`` and ``train.generate`` read the new policy.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mcfn.config import RunConfig
from mcfn.core.edits import edit_worth, ranking_loss
from mcfn.core.focus import Refocus, block_scores
from mcfn.core.system import MegaContext, tree_stage
from mcfn.core.tree import Tree
from mcfn.data.corpus import Corpus, prepare_corpus
from mcfn.errors import UserError
from mcfn.seeding import derive_seed
from mcfn.shell.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from mcfn.shell.session import training_sampler
from mcfn.shell.traces import Traces, fingerprint
from mcfn.tools.chunks import chunk_view
from mcfn.tools.counterfactual import TRACED, State, trace_window

TRACES_DIR = "lens_traces"
FIRST_TRACE_BATCH = 1_000_000  # training batches from here on are the stage's: never read by the MC phase


@dataclass(frozen=True)
class StageSettings:
    rounds: int = 3  # trace, train, measure
    windows: int = 64  # training windows traced per round
    held_out: int = 32  # validation windows whose states give the round's utility_corr
    epochs: int = 6  # passes over every round's traces so far
    lr: float = 1e-3
    states_per_batch: int = 16
    random_cuts: int = 2  # random candidates per state, beside the policy, its edits, match and recency


def with_match_prior(cfg: RunConfig) -> RunConfig:
    lens = dataclasses.replace(cfg.mc.lens, match_prior=True)
    return dataclasses.replace(cfg, mc=dataclasses.replace(cfg.mc, lens=lens))


@torch.no_grad()
def trace(
    system: MegaContext, batches: list[torch.Tensor], protocol: Refocus, random_cuts: int, seed: int, bar: tqdm
) -> tuple[torch.Tensor, torch.Tensor, list[State]]:
    """Every window of ``batches`` walked with the current policy: the windows, their trees and the states."""
    windows, trees, states = [], [], []
    generator = torch.Generator().manual_seed(seed)
    for batch in batches:
        tree = tree_stage(system, batch)
        for i in range(batch.size(0)):
            index = len(windows)
            states += trace_window(system, tree[i : i + 1], batch[i : i + 1], protocol, random_cuts, generator, index)
            windows.append(batch[i])
            trees.append(tree.emb[i])
            bar.update(1)
    return torch.stack(windows), torch.stack(trees), states


def utility_summary(states: list[State]) -> dict[str, float]:
    """The mean of the states' ``utility_corr`` with its standard error, and the policy's mean chunk NLL beside
    ``match``'s and ``recency``'s on the same states."""
    corr = torch.tensor([s.utility_corr for s in states], dtype=torch.float64)
    corr = corr[corr.isfinite()]
    nll = {name: float(torch.stack([s.labelled.nll[name][0] for s in states]).mean()) for name in
           TRACED}  # fmt: skip
    return {"utility_corr": float(corr.mean()), "se": float(corr.std() / corr.numel() ** 0.5), "states": len(states),
            **{f"nll_{k}": v for k, v in nll.items()}}  # fmt: skip


def train_on_traces(
    system: MegaContext, traces: list[Traces], settings: StageSettings, protocol: Refocus, seed: int, bar: tqdm
) -> float:
    """``settings.epochs`` passes of the ranking loss over the states of ``traces``, in batches of states that share
    a history length (one view); returns the last epoch's mean loss."""
    lensnet, nodes = system.lensnet, system.nodes
    optimizer = torch.optim.AdamW(lensnet.parameters(), lr=settings.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    groups = [(t, torch.nonzero(t.states["n"] == n).flatten()) for t in traces for n in t.states["n"].unique()]
    lensnet.train()
    losses: list[float] = []
    for _ in range(settings.epochs):
        losses = []
        batches = [
            (t, rows[order[i : i + settings.states_per_batch]])
            for t, rows in groups
            for order in [torch.randperm(rows.numel(), generator=generator)]
            for i in range(0, rows.numel(), settings.states_per_batch)
        ]
        for b in torch.randperm(len(batches), generator=generator).tolist():
            t, rows = batches[b]
            states = t.states[rows]
            windows = t.windows[states["window"]]
            cv = chunk_view(Tree(emb=t.trees[states["window"]], batch_size=[rows.numel()]), windows, nodes,
                            int(states["n"][0]), protocol.every)  # fmt: skip
            scores = block_scores(lensnet.scorer(cv.nodes.layout, cv.window), cv.tree, cv.window, cv.nodes, cv.horizon)
            loss = ranking_loss(edit_worth(scores, states["gain"], states["loss"]), states["delta"], states["valid"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}")
    lensnet.eval()
    return sum(losses) / max(1, len(losses))


def stage_system(ckpt: Checkpoint, cfg: RunConfig, device: torch.device) -> MegaContext:
    """The run's system under ``cfg`` (its config with the match prior) with a fresh LensNet: its first policy is
    ``match``'s cut."""
    torch.manual_seed(derive_seed(cfg.train.seed, "lens_stage", 0))
    system = MegaContext(cfg).to(device)
    system.load_state_dict(ckpt.state["model"])
    system.lensnet.reset_parameters()  # the match prior's head starts at zero
    return system.eval()


class Stage:
    """The stage on one run: its fixed system, sampler and held-out windows, and the traces so far."""

    def __init__(self, ckpt: Checkpoint, corpus: Corpus, settings: StageSettings, device: torch.device):
        self.ckpt, self.settings, self.device = ckpt, settings, device
        self.cfg = cfg = with_match_prior(ckpt.cfg)
        self.system = stage_system(ckpt, cfg, device)
        self.protocol = Refocus(cfg.mc.refocus_every)  # as generation and the evaluation refocus
        self.made_by = fingerprint(self.system, ckpt.step, ckpt.state["config"])
        self.sampler = training_sampler(cfg, corpus)
        # Held out: the run's own mix (text and long-range tasks) over the validation split, so that a policy that
        # loses retrieval is not kept for what it gains on text.
        held_out = training_sampler(cfg, corpus, held_out=True)
        self.val_windows = [held_out.batch(i, 1).to(device) for i in range(settings.held_out)]
        self.traces: list[Traces] = []

    def measure(self, r: int | str, system: MegaContext | None = None) -> dict[str, float]:
        """A policy (by default the stage's current one) on the held-out windows: its utility_corr and chunk NLLs."""
        system = self.system if system is None else system
        with tqdm(total=len(self.val_windows), desc=f"lens {r}: held out", unit="window", file=sys.stderr) as bar:
            states = trace(system, self.val_windows, self.protocol, self.settings.random_cuts, 0, bar)[2]
        return utility_summary(states)

    def round(self, r: int, run_dir: Path) -> dict[str, object]:
        """Trace fresh training windows with the current policy, save them, train on every round's traces."""
        settings, seed = self.settings, self.cfg.train.seed
        started = time.perf_counter()
        first = FIRST_TRACE_BATCH + (r - 1) * settings.windows
        batches = [self.sampler.batch(first + i, 1).to(self.device) for i in range(settings.windows)]
        with tqdm(total=settings.windows, desc=f"lens round {r}: trace", unit="window", file=sys.stderr) as bar:
            windows, trees, states = trace(self.system, batches, self.protocol, settings.random_cuts,
                                           derive_seed(seed, "lens_traces", r), bar)  # fmt: skip
        traced = time.perf_counter()
        path = run_dir / TRACES_DIR / f"round{r}.pt"
        self.traces.append(Traces.of(windows, trees, states, self.made_by, r))
        self.traces[-1].save(path)
        with tqdm(total=settings.epochs, desc=f"lens round {r}: train", unit="epoch", file=sys.stderr) as bar:
            loss = train_on_traces(self.system, self.traces, settings, self.protocol,
                                   derive_seed(seed, "lens_stage", r), bar)  # fmt: skip
        trained = time.perf_counter()
        held = self.measure(r)
        seconds = {"trace": traced - started, "train": trained - traced, "held_out": time.perf_counter() - trained}
        return {"round": r, "states": len(states), "traced_utility_corr": utility_summary(states)["utility_corr"],
                "loss": loss, "held_out": held, "seconds": seconds}  # fmt: skip


def run_stage(
    run_dir: Path,
    settings: StageSettings,
    device: torch.device,
    say: Callable[[str], None],
    corpus: Corpus | None = None,
) -> tuple[MegaContext, dict[str, object]]:
    """The stage on the run in ``run_dir`` (see the module docstring; ``corpus``: the run's, if already at hand):
    the trained system and the stage's figures, both also saved in the run's checkpoint. The policy kept is the one
    with the lowest held-out chunk NLL among the run's own LensNet (``"run"``), ``match``'s cut (round 0) and each
    round's."""
    if settings.rounds < 1 or settings.windows < 1 or settings.held_out < 1 or settings.epochs < 0:
        raise UserError("the LensNet stage needs rounds, windows and held-out windows >= 1, and epochs >= 0")
    ckpt = Checkpoint.read(run_dir)
    if not ckpt.cfg.mc.enabled or not ckpt.cfg.mc.lens.enabled:
        raise UserError(f"{ckpt.path} has no LensNet to train (a plain or --set mc.lens.enabled=false run)")
    corpus = prepare_corpus(ckpt.cfg.data) if corpus is None else corpus
    ckpt.check_fits("the LensNet stage's checkpoint", corpus.key, than="the corpus its config rebuilds")
    stage = Stage(ckpt, corpus, settings, device)
    own = MegaContext(ckpt.cfg).to(device)
    own.load_state_dict(ckpt.state["model"])
    run_policy = stage.measure("run", own.eval())
    say(f"[lens] the run's own LensNet: {held_out_line(run_policy)}")
    before = stage.measure(0)
    say(f"[lens] before training (match's cut): {held_out_line(before)}")
    best = (before["nll_lens"], 0, copy.deepcopy(stage.system.lensnet.state_dict()))
    rounds = []
    for r in range(1, settings.rounds + 1):
        figures = stage.round(r, run_dir)
        held, seconds = figures["held_out"], figures["seconds"]
        rounds.append(figures)
        say(
            f"[lens] round {r}: {figures['states']} states traced in {seconds['trace']:.0f} s, trained in "
            f"{seconds['train']:.0f} s (loss {figures['loss']:.4f}); {held_out_line(held)}"
        )
        if held["nll_lens"] < best[0]:
            best = (held["nll_lens"], r, copy.deepcopy(stage.system.lensnet.state_dict()))
    kept, system = ("run", own) if run_policy["nll_lens"] <= best[0] else (best[1], stage.system)
    if kept != "run":
        system.lensnet.load_state_dict(best[2])
    which = "the run's own LensNet" if kept == "run" else f"round {kept}'s policy"
    say(f"[lens] kept {which} (held-out chunk NLL {min(best[0], run_policy['nll_lens']):.4f})")
    summary = {"fingerprint": stage.made_by, "settings": dataclasses.asdict(settings), "run_policy": run_policy,
               "before": before, "rounds": rounds, "kept_round": kept}  # fmt: skip
    write_back(ckpt, None if kept == "run" else (system, stage.cfg), summary)
    return system, summary


def write_back(ckpt: Checkpoint, policy: tuple[MegaContext, RunConfig] | None, summary: dict) -> None:
    """The stage's figures into the run's checkpoint, and the policy kept with its config unless it is the run's."""
    state = load_checkpoint(ckpt.path)
    if policy is not None:
        system, cfg = policy
        state["model"] = {k: v.cpu() for k, v in system.state_dict().items()}
        state["config"] = cfg.to_dict()
    state["lens_stage"] = summary
    save_checkpoint(ckpt.path, state)


def held_out_line(held: dict[str, float]) -> str:
    return (
        f"held-out utility_corr {held['utility_corr']:.3f} ± {held['se']:.3f} over {held['states']} states; "
        f"chunk NLL lens {held['nll_lens']:.4f}, match {held['nll_match']:.4f}, recency {held['nll_recency']:.4f}"
    )
