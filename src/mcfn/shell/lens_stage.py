"""The LensNet stage: LensNet learns from what each choice costs (issue 53, ``../shared/seeds/003``), and never
loses what the run's LensNet knew (issue 66).

After a run's plain and MC phases, the base model and GistNet are fixed, and LensNet is trained in rounds on its own
counterfactual traces (:mod:`mcfn.tools.counterfactual`, :mod:`mcfn.shell.traces`):

1. **trace**: walk fresh training windows (corpus text and the run's long-range tasks, half and half:
   :data:`TRACE_TASK_SHARE`) under generation's protocol with the current policy, and label every single edit of
   each chunk's cut with its ΔNLL;
2. **train**: a few epochs of the ranking loss (:func:`mcfn.core.edits.ranking_loss`) over every round's traces so
   far (a replay buffer), LensNet scoring each state again from the cached trees, without the base model. The
   whole cuts traced beside the edits carry more signal (``train.lens --reliability``) but taught a worse policy
   (LABLOG, twenty-fifth session), so the list holds the single edits;
3. **measure**: the policy on the *selection* windows (validation windows, never traced).

Rounds start from the run's own LensNet, the one its MC phase trained (kept in the checkpoint as ``lens_original``
the first time a stage writes back, so a second stage starts from it again). The candidates are the run's own,
``match``'s cut (a fresh LensNet with the match prior and a zero head), the run's own gated over ``match``'s cut
(its scores added to ``match``'s only where they stand out; :mod:`mcfn.shell.lens_candidates` builds these three)
and each round's, each judged as the run's final evaluation judges a policy on *selection* windows of the
validation split, and refused where it lost retrieval or trails ``match`` on text (:mod:`mcfn.shell.lens_judge`);
the lowest corpus bits per byte among the rest is kept, and when every one is refused the run's own stays. The
figures the stage reports for the kept policy and the run's own come from *report* windows, disjoint validation
windows that chose nothing. The stage reads no test split.
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

from mcfn.config import LensStageConfig, RunConfig
from mcfn.core.edits import edit_worth, ranking_loss
from mcfn.core.focus import Refocus, block_scores
from mcfn.core.policy import MATCH
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.data.corpus import Corpus
from mcfn.data.loader import evaluation_windows
from mcfn.errors import UserError
from mcfn.seeding import derive_seed
from mcfn.shell.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from mcfn.shell.lens_candidates import GATED, gated_system, match_system, read_run, run_system
from mcfn.shell.lens_judge import Judged, judge, judged_line, refusal
from mcfn.shell.traces import FIRST_TRACE_BATCH, Traces, fingerprint, probe_rows, trace, trace_sampler
from mcfn.tools.chunks import chunk_view
from mcfn.tools.counterfactual import State
from mcfn.tools.evaluation import HeldOut

TRACES_DIR = "lens_traces"


TRAIN_ROUNDS = 3  # rounds of train.lens where neither --rounds nor the run's lens_stage.rounds says how many
EPOCHS = 6  # passes of the ranking loss over every round's traces so far
LR = 1e-3  # LensNet's AdamW rate in the stage


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


def reference_candidates(stage: Stage, device: torch.device, say: Callable[[str], None]) -> dict[str, tuple]:
    """The candidates no round trains, each judged on the selection windows: the run's own LensNet, ``match``'s cut
    and the run's own gated over ``match``'s."""
    own_judged = stage.measure(stage.own)
    original = " (the original)" if "lens_original" in stage.ckpt.state else ""
    say(f"[lens] the run's own LensNet{original}: {judged_line(own_judged)}")
    candidates = {"run": (own_judged, stage.own, stage.cfg)}
    for name, build in ((MATCH.name, match_system), (GATED, gated_system)):
        system, cfg = build(stage.own, stage.cfg, device)
        candidates[name] = (stage.measure(system), system, cfg)
        say(f"[lens] {describe(name)}: {judged_line(candidates[name][0])}")
    return candidates


class Stage:
    """The stage on one run: the run's own system (fixed), the one it trains (starting from it), the sampler, the
    selection and report windows, and the traces so far."""

    def __init__(self, ckpt: Checkpoint, corpus: Corpus, settings: LensStageConfig, device: torch.device):
        self.ckpt, self.settings, self.device = ckpt, settings, device
        self.own, self.cfg = run_system(ckpt, device)
        self.system = copy.deepcopy(self.own)  # rounds start from the run's own LensNet
        self.protocol = Refocus(self.cfg.mc.refocus_every)  # as generation and the evaluation refocus
        self.made_by = fingerprint(self.system, ckpt.step, ckpt.state["config"])
        self.sampler = trace_sampler(self.cfg, corpus)
        # Validation windows, as the final evaluation draws them: the first half select the policy kept, the second
        # report it, so that no figure reported comes from a window that chose.
        h, batch = settings.held_out, self.cfg.train.batch_size
        windows, docs = (torch.cat(x) for x in evaluation_windows(corpus.val, self.cfg.data.seq_len + 1, 2 * h, 1))
        if windows.size(0) < 2:
            raise UserError("the validation split has too few windows for the LensNet stage to select and report")
        half = min(h, windows.size(0) // 2)
        token_bytes = corpus.tokenizer.token_bytes(self.cfg.model.vocab_size).to(device)
        self.held = {name: HeldOut(list(windows[part].to(device).split(batch)), token_bytes, corpus.tokenizer,
                                   list(docs[part].split(batch)), "validation")
                     for name, part in (("selection", slice(0, half)), ("report", slice(half, 2 * half)))}  # fmt: skip
        self.traces: list[Traces] = []

    def measure(self, system: MegaContext | None = None, split: str = "selection") -> Judged:
        """A policy (by default the stage's current one) on the selection (or report) windows."""
        return judge(self.system if system is None else system, self.held[split], self.cfg.mc.refocus_every)

    def round(self, r: int, run_dir: Path) -> tuple[dict[str, object], Judged]:
        """Trace fresh training windows with the current policy, save them, train on every round's traces; the
        round's figures and the trained policy on the selection windows."""
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


def run_stage(
    run_dir: Path,
    device: torch.device,
    say: Callable[[str], None],
    corpus: Corpus | None = None,
    **overrides: int | None,
) -> tuple[MegaContext, dict[str, object]]:
    """The stage on the run in ``run_dir`` (see the module docstring; ``corpus``: the run's, if already at hand), as
    its ``[lens_stage]`` says with ``overrides`` on top (:func:`stage_settings`): the system with the policy kept and
    the stage's figures, both also saved in the run's checkpoint."""
    ckpt, corpus = read_run(run_dir, "to train", corpus)
    settings = stage_settings(ckpt.cfg, **overrides)
    stage = Stage(ckpt, corpus, settings, device)
    candidates: dict[str | int, tuple[Judged, MegaContext | dict, RunConfig]] = reference_candidates(stage, device, say)
    own = candidates["run"][0]
    rounds = []
    for r in range(1, settings.rounds + 1):
        round_figures, held = stage.round(r, run_dir)
        seconds = round_figures["seconds"]
        rounds.append(round_figures)
        say(
            f"[lens] round {r}: {round_figures['states']} states traced in {seconds['trace']:.0f} s, trained in "
            f"{seconds['train']:.0f} s (loss {round_figures['loss']:.4f}); {judged_line(held)}"
        )
        candidates[r] = (held, copy.deepcopy(stage.system.lensnet.state_dict()), stage.cfg)
    refused = {name: why for name, (held, _, _) in candidates.items() if (why := refusal(held, own))}
    for name, why in refused.items():
        say(f"[lens] refused {describe(name)}: {why}")
    allowed = [name for name in candidates if name not in refused]
    kept = min(allowed, key=lambda name: candidates[name][0].lens_bpb) if allowed else "run"
    system, kept_cfg = kept_system(stage, candidates[kept][1:])
    why = "every candidate was refused, so " if not allowed else ""
    say(f"[lens] {why}kept {describe(kept)} ({candidates[kept][0].lens_bpb:.4f} bits per byte on the selection)")
    report = {"run": stage.measure(stage.own, "report")}
    report["kept"] = report["run"] if kept == "run" else stage.measure(system, "report")
    say(f"[lens] on the report windows, which chose nothing: kept {judged_line(report['kept'])}; the run's own "
        f"{judged_line(report['run'])}")  # fmt: skip
    summary = {"fingerprint": stage.made_by, "settings": dataclasses.asdict(settings) | {"epochs": EPOCHS, "lr": LR},
               "run_policy": own.to_json(), **{name: candidates[name][0].to_json() for name in (MATCH.name, GATED)},
               "rounds": rounds, "refused": {str(k): v for k, v in refused.items()},
               "kept_round": kept, "report": {k: v.to_json() for k, v in report.items()}}  # fmt: skip
    write_back(ckpt, stage, system, kept_cfg, summary)
    return system, summary


def kept_system(stage: Stage, kept: tuple[MegaContext | dict, RunConfig]) -> tuple[MegaContext, RunConfig]:
    """The system of the candidate kept: a system itself, or a round's LensNet weights in the stage's system."""
    policy, cfg = kept
    if isinstance(policy, MegaContext):
        return policy, cfg
    stage.system.lensnet.load_state_dict(policy)
    return stage.system, cfg


def describe(name: str | int) -> str:
    named = {"run": "the run's own LensNet", MATCH.name: "match's cut", GATED: "the run's own gated over match's cut"}
    return named.get(name, f"round {name}'s policy")


def write_back(ckpt: Checkpoint, stage: Stage, system: MegaContext, cfg: RunConfig, summary: dict) -> None:
    """The stage's figures and the policy kept (its LensNet and config) into the run's checkpoint, beside the run's
    original LensNet and config, written the first time and never replaced: a second stage starts from them."""
    state = load_checkpoint(ckpt.path)
    if "lens_original" not in state:
        lensnet = {k: v.cpu() for k, v in stage.own.lensnet.state_dict().items()}
        state["lens_original"] = {"lensnet": lensnet, "config": stage.cfg.to_dict()}
    state["model"] = {k: v.cpu() for k, v in system.state_dict().items()}
    state["config"] = cfg.to_dict()
    state["lens_stage"] = summary
    save_checkpoint(ckpt.path, state)
