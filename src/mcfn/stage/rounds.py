"""The LensNet stage: LensNet learns from what each choice costs (issue 53, ``../shared/seeds/003``), and never
loses what the run's LensNet knew (issue 66).

After a run's plain and MC phases, the base model and GistNet are fixed, and LensNet is trained in rounds on its own
counterfactual traces (:mod:`mcfn.evaluation.counterfactual`, :mod:`mcfn.stage.traces`):

1. **trace**: walk fresh training windows (corpus text and the run's long-range tasks, half and half:
   :data:`TRACE_TASK_SHARE`) under generation's protocol with the current policy, and label every single edit of
   each chunk's cut with its ΔNLL;
2. **train**: a few epochs of the ranking loss (:func:`mcfn.core.edits.ranking_loss`) over every round's traces so
   far (a replay buffer), LensNet scoring each state again from the cached trees, without the base model. The
   whole cuts traced beside the edits carry more signal (``train.lens --reliability``) but taught a worse policy
   (LABLOG, twenty-fifth session), so the list holds the single edits;
3. **measure**: the policy on validation windows (never traced).

Rounds start from the run's own LensNet, the one its MC phase trained (a checkpoint written by an earlier mcfn, whose
stage replaced it, keeps it as ``lens_original``, and the stage starts from that). The stage changes nothing the
run evaluates or generates with: each round's LensNet is a candidate of the ship choice (:mod:`mcfn.stage.ship`),
judged beside truncation, ``match``, the run's own and the run's own gated over ``match``'s cut by paired errors on
validation windows. The stage reads no test split.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from mcfn.checkpoint import save_checkpoint
from mcfn.config import LensStageConfig, RunConfig
from mcfn.core.edits import edit_worth, ranking_loss
from mcfn.core.focus import Refocus, block_scores
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.data.corpus import Corpus
from mcfn.evaluation.chunks import chunk_view
from mcfn.evaluation.counterfactual import State
from mcfn.seeding import derive_seed
from mcfn.stage.candidates import read_run, run_system, validation_windows
from mcfn.stage.judge import Judged, judge, judged_line
from mcfn.stage.traces import FIRST_TRACE_BATCH, RANDOM_CUTS, Traces, fingerprint, probe_rows, trace, trace_sampler

TRACES_DIR = "lens_traces"


TRAIN_ROUNDS = 3  # rounds of train.lens where neither --rounds nor the run's lens_stage.rounds says how many
EPOCHS = 6  # passes of the ranking loss over every round's traces so far
LR = 1e-3  # LensNet's AdamW rate in the stage
STATES_PER_BATCH = 16  # traced states (chunks of one history length) per step of the ranking loss; as first built


def utility_summary(states: list[State]) -> dict[str, float]:
    """The mean of the states' ``utility_corr`` with its standard error."""
    corr = torch.tensor([s.utility_corr for s in states], dtype=torch.float64)
    corr = corr[corr.isfinite()]
    return {"utility_corr": float(corr.mean()), "se": float(corr.std() / corr.numel() ** 0.5), "states": len(states)}


def train_on_traces(
    system: MegaContext, traces: list[Traces], settings: LensStageConfig, protocol: Refocus, seed: int, bar: tqdm
) -> float:
    """:data:`EPOCHS` passes of the ranking loss over the states of ``traces``, in batches of states that share
    a history length (one view); returns the last epoch's mean loss."""
    lensnet, nodes = system.lensnet, system.nodes
    optimizer = torch.optim.AdamW(lensnet.parameters(), lr=LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    groups = [(t, torch.nonzero(t.states["n"] == n).flatten()) for t in traces for n in t.states["n"].unique()]
    lensnet.train()
    losses: list[float] = []
    for _ in range(EPOCHS):
        losses = []
        batches = [
            (t, rows[order[i : i + STATES_PER_BATCH]])
            for t, rows in groups
            for order in [torch.randperm(rows.numel(), generator=generator)]
            for i in range(0, rows.numel(), STATES_PER_BATCH)
        ]
        for b in torch.randperm(len(batches), generator=generator).tolist():
            t, rows = batches[b]
            states = t.states[rows]
            windows = t.windows[states["window"]]
            cv = chunk_view(Tree(emb=t.trees[states["window"]], batch_size=[rows.numel()]), windows, nodes,
                            int(states["n"][0]), protocol.every)  # fmt: skip
            scores = block_scores(
                lensnet.scorer(cv.nodes.layout, cv.window, system.base), cv.tree, cv.window, cv.nodes, cv.horizon
            )
            loss = ranking_loss(edit_worth(scores, states["gain"], states["loss"]), states["delta"], states["valid"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.4f}")
    lensnet.eval()
    return sum(losses) / max(1, len(losses))


class Stage:
    """The stage on one run: the run's own system (fixed), the one it trains (starting from it), the sampler, the
    validation windows it measures on, and the traces so far."""

    def __init__(
        self, own: MegaContext, cfg: RunConfig, step: int, corpus: Corpus, settings: LensStageConfig,
        device: torch.device,
    ):  # fmt: skip
        self.settings, self.device, self.cfg = settings, device, cfg
        self.own = own.eval()
        self.system = copy.deepcopy(self.own)  # rounds start from the run's own LensNet
        self.protocol = Refocus(cfg.mc.refocus_every)  # as generation and the evaluation refocus
        self.made_by = fingerprint(self.system, step, cfg.to_dict())
        self.sampler = trace_sampler(cfg, corpus)
        # Validation windows, as the final evaluation draws them, on which each round's policy is measured.
        purpose = "for the LensNet stage to measure its rounds on"
        self.held = validation_windows(corpus, cfg, settings.held_out, device, purpose)
        self.traces: list[Traces] = []

    def measure(self, system: MegaContext | None = None) -> Judged:
        """A policy (by default the stage's current one) on the stage's validation windows."""
        return judge(self.system if system is None else system, self.held, self.cfg.mc.refocus_every)

    def round(self, r: int, run_dir: Path) -> tuple[dict[str, object], Judged]:
        """Trace fresh training windows with the current policy, save them, train on every round's traces; the
        round's figures and the trained policy on the validation windows."""
        settings, seed = self.settings, self.cfg.train.seed
        started = time.perf_counter()
        first = FIRST_TRACE_BATCH + (r - 1) * settings.windows
        batches = [self.sampler.batch(first + i, 1).to(self.device) for i in range(settings.windows)]
        with tqdm(total=settings.windows, desc=f"lens round {r}: trace", unit="window", file=sys.stderr) as bar:
            windows, trees, states = trace(self.system, batches, self.protocol, RANDOM_CUTS,
                                           derive_seed(seed, "lens_traces", r), bar)  # fmt: skip
        traced = time.perf_counter()
        path = run_dir / TRACES_DIR / f"round{r}.pt"
        self.traces.append(Traces.of(windows, trees, states, self.made_by, r))
        self.traces[-1].save(path)
        with tqdm(total=EPOCHS, desc=f"lens round {r}: train", unit="epoch", file=sys.stderr) as bar:
            loss = train_on_traces(self.system, self.traces, settings, self.protocol,
                                   derive_seed(seed, "lens_stage", r), bar)  # fmt: skip
        trained = time.perf_counter()
        held = self.measure()
        seconds = {"trace": traced - started, "train": trained - traced, "held_out": time.perf_counter() - trained}
        probes = int(probe_rows(self.sampler, first, settings.windows).sum())
        return {"round": r, "states": len(states), "traced_probe_windows": probes, "loss": loss,
                "traced_utility": utility_summary(states), "selection": held.to_json(),
                "seconds": seconds}, held  # fmt: skip


def stage_settings(cfg: RunConfig, **overrides: int | None) -> LensStageConfig:
    """The run's ``[lens_stage]`` with ``overrides`` (``train.lens``'s flags; None: the run's) on top, and
    :data:`TRAIN_ROUNDS` rounds where neither says how many."""
    settings = dataclasses.replace(cfg.lens_stage, **{k: v for k, v in overrides.items() if v is not None})
    return settings if settings.rounds else dataclasses.replace(settings, rounds=TRAIN_ROUNDS)


def stage_rounds(
    system: MegaContext,
    cfg: RunConfig,
    step: int,
    corpus: Corpus,
    run_dir: Path,
    say: Callable[[str], None],
    **overrides: int | None,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, object]]:
    """The stage (see the module docstring) on ``system``, the run's own at ``step`` with its config and corpus, as
    its ``[lens_stage]`` says with ``overrides`` on top (:func:`stage_settings`), its traces saved in ``run_dir``:
    each round's LensNet weights, the candidates of the ship choice (:mod:`mcfn.stage.ship`), and the stage's
    figures. ``system`` itself is not trained: the rounds train a copy."""
    settings = stage_settings(cfg, **overrides)
    stage = Stage(system, cfg, step, corpus, settings, next(system.parameters()).device)
    own = stage.measure(stage.own)
    say(f"[lens] the run's own LensNet: {judged_line(own)}")
    rounds, weights = [], {}
    for r in range(1, settings.rounds + 1):
        round_figures, held = stage.round(r, run_dir)
        seconds = round_figures["seconds"]
        rounds.append(round_figures)
        say(
            f"[lens] round {r}: {round_figures['states']} states traced in {seconds['trace']:.0f} s, trained in "
            f"{seconds['train']:.0f} s (loss {round_figures['loss']:.4f}); {judged_line(held)}"
        )
        weights[r] = copy.deepcopy(stage.system.lensnet.state_dict())
    summary = {"fingerprint": stage.made_by, "settings": dataclasses.asdict(settings) | {"epochs": EPOCHS, "lr": LR},
               "run_policy": own.to_json(), "rounds": rounds}  # fmt: skip
    return weights, summary


def run_stage(
    run_dir: Path,
    device: torch.device,
    say: Callable[[str], None],
    corpus: Corpus | None = None,
    **overrides: int | None,
) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, object]]:
    """:func:`stage_rounds` on the saved run in ``run_dir`` (``train.lens``; ``corpus``: the run's, if at hand), its
    figures recorded in the run's checkpoint."""
    ckpt, corpus = read_run(run_dir, "to train", corpus)
    system, cfg = run_system(ckpt, device)
    weights, summary = stage_rounds(system, cfg, ckpt.step, corpus, run_dir, say, **overrides)
    save_checkpoint(ckpt.path, ckpt.state | {"lens_stage": summary})
    return weights, summary
