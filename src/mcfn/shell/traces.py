"""Counterfactual traces: the labelled states of :mod:`mcfn.tools.counterfactual`, on disk, tied to what made them.

A trace file holds what LensNet needs to score each state again without rerunning the base model (the seed's
two-stage mode: LensNet in its own stage, from cached working contexts): every traced window's tokens and summary
tree, and per state (a window's chunk) the edits' nodes and their ΔNLL in fixed-capacity rows (a TensorDict of
``[S, E]`` fields with a ``valid`` mask).

The labels measure the base model and GistNet: a trace is tied to them by a fingerprint of their weights, the
checkpoint's step and its config outside ``[mc.lens]`` (what the policy may change). Reading a trace made by another
checkpoint or config is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import Tensor

from mcfn.core.system import MegaContext
from mcfn.errors import UserError
from mcfn.tools.counterfactual import TRACED, State

TRACE_FORMAT = 1
FINGERPRINTED = ("base.", "gistnet.")  # the modules whose weights the labels measure


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
