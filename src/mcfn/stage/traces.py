"""Counterfactual traces: which windows the LensNet stage walks, how, and the labelled states of
:mod:`mcfn.evaluation.counterfactual` on disk, tied to what made them.

The stage's windows are training batches from :data:`FIRST_TRACE_BATCH` on (never read by the MC phase), half of them
with one of the run's long-range tasks (:data:`TRACE_TASK_SHARE`), each walked under generation's protocol with the
current policy (:func:`trace`).

A trace file holds what LensNet needs to score each state again without rerunning the base model (the seed's
two-stage mode: LensNet in its own stage, from cached working contexts): every traced window's tokens and summary
tree, and per state (a window's chunk) the edits' nodes and their ΔNLL in fixed-capacity rows (a TensorDict of
``[S, E]`` fields with a ``valid`` mask).

The labels measure the base model and GistNet: a trace is tied to them by a fingerprint of their weights, the
checkpoint's step and its config outside ``[mc.lens]`` (what the policy may change). Reading a trace made by another
checkpoint or config is refused in one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import Tensor
from tqdm import tqdm

from mcfn.config import RunConfig
from mcfn.core.focus import Refocus
from mcfn.core.system import MegaContext, tree_stage
from mcfn.data.corpus import Corpus
from mcfn.data.loader import WindowSampler
from mcfn.data.mixture import MixedSampler, training_sampler
from mcfn.errors import UserError
from mcfn.evaluation.counterfactual import TRACED, State, trace_window

TRACE_FORMAT = 1
FINGERPRINTED = ("base.", "gistnet.")  # the modules whose weights the labels measure
FIRST_TRACE_BATCH = 1_000_000  # training batches from here on are the stage's: never read by the MC phase
# The share of traced windows that carry a long-range task, whatever the run's data.mix > 0 (1 in the default, where
# every training window has one): the rest are corpus text, on which the judge weighs a policy against match.
RANDOM_CUTS = 2  # random candidates per traced state, beside the policy, its edits, match and recency; not tuned
TRACE_TASK_SHARE = 0.5


def trace_sampler(cfg: RunConfig, corpus: Corpus) -> WindowSampler | MixedSampler:
    """The stage's training windows: the run's corpus and tasks, :data:`TRACE_TASK_SHARE` of them with a task (none
    for a run trained without tasks, whose tail may not fit them)."""
    share = TRACE_TASK_SHARE if cfg.data.mix > 0 else 0.0
    return training_sampler(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, mix=share)), corpus)


def probe_rows(sampler: WindowSampler | MixedSampler, first: int, count: int) -> torch.Tensor:
    """Which of the one-window batches ``first .. first + count - 1`` carry a long-range task ``[count]``."""
    if not isinstance(sampler, MixedSampler):
        return torch.zeros(count, dtype=torch.bool)
    return torch.tensor([sampler.tasked(first + i, 1)[0] for i in range(count)])


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


def fingerprint(system: MegaContext, step: int, config: dict) -> str:
    """What a trace is tied to: the weights of the base model and GistNet, the step, the config outside ``mc.lens``."""
    digest = hashlib.sha256(f"{step}".encode())
    settings = {section: values for section, values in config.items() if section != "mc"}
    settings["mc"] = {key: value for key, value in config["mc"].items() if key != "lens"}
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for name, tensor in sorted(system.state_dict().items()):
        if name.startswith(FINGERPRINTED):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class Traces:
    """Labelled states of ``N`` windows: ``windows [N, T + 1]``, ``trees [N, n_nodes, D]``, ``states [S]``."""

    windows: Tensor
    trees: Tensor
    states: TensorDict  # window, n [S]; gain, loss, delta, valid [S, E]; nll_lens, nll_match, nll_recency [S]
    fingerprint: str
    round: int = 0  # the policy round that made them (0: LensNet's first policy)

    @classmethod
    def of(cls, windows: Tensor, trees: Tensor, states: list[State], fingerprint: str, round: int = 0) -> Traces:
        """Pack ``states`` into fixed-capacity rows, ``E`` the most edits of any state."""
        E = max(s.labelled.delta.numel() for s in states)

        def padded(x: Tensor, fill: float) -> Tensor:
            return torch.cat([x.cpu(), x.new_full((E - x.numel(),), fill).cpu()])

        rows = {
            "window": torch.tensor([s.window for s in states]),
            "n": torch.tensor([s.n for s in states]),
            "gain": torch.stack([padded(s.labelled.edits.gain, -1) for s in states]),
            "loss": torch.stack([padded(s.labelled.edits.loss, -1) for s in states]),
            "delta": torch.stack([padded(s.labelled.delta.float(), 0.0) for s in states]),
            "valid": torch.stack([torch.arange(E) < s.labelled.delta.numel() for s in states]),
            **{f"nll_{name}": torch.tensor([float(s.labelled.nll[name][0]) for s in states])
               for name in TRACED},
        }  # fmt: skip
        return cls(windows.cpu(), trees.cpu(), TensorDict(rows, batch_size=[len(states)]), fingerprint, round)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "format": TRACE_FORMAT,
                "fingerprint": self.fingerprint,
                "round": self.round,
                "windows": self.windows,
                "trees": self.trees,
                "states": self.states.to_dict(),
            },
            path,
        )

    @classmethod
    def load(cls, path: Path, expected: str) -> Traces:
        """The traces at ``path``, refused in one line unless they were made by the checkpoint and config whose
        fingerprint is ``expected``."""
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise UserError(f"no traces at {path}") from None
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
            raise UserError(f"traces {path} cannot be read: {e}") from None
        if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
            raise UserError(f"traces {path} are not mcfn traces of format {TRACE_FORMAT}")
        if data["fingerprint"] != expected:
            raise UserError(
                f"traces {path} were made by another checkpoint or config (fingerprint {data['fingerprint']}, this "
                f"run's is {expected}): trace this run again"
            )
        states = TensorDict(data["states"], batch_size=[data["states"]["n"].numel()])
        return cls(data["windows"], data["trees"], states, data["fingerprint"], data["round"])
