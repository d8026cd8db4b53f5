"""A trained model back from its run directory, for evaluation and generation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mcfn.checkpoint import Checkpoint
from mcfn.config import RunConfig
from mcfn.core.policy import FocusPolicy
from mcfn.core.system import MegaContext
from mcfn.data.corpus import Corpus
from mcfn.errors import UserError
from mcfn.stage.candidates import read_run, run_system
from mcfn.stage.ship import shipped_policy


@dataclass
class Trained:
    model: nn.Module  # MegaContext, or GPT for a --no-mc run
    corpus: Corpus
    token_bytes: Tensor  # [vocab] bytes per token id, on the model's device
    checkpoint: Checkpoint  # what it was read from, without its payload (the weights are in the model)
    shipped: tuple[str, FocusPolicy] | None = None  # the candidate the run ships and its policy (MC runs)

    @property
    def cfg(self) -> RunConfig:
        return self.checkpoint.cfg

    @property
    def step(self) -> int:
        return self.checkpoint.step


def load_trained(path: Path, device: torch.device) -> Trained:
    """Load ``path`` (a run directory or its checkpoint file) onto ``device``, with its corpus and tokenizer, as
    every reader of a trained run does (:func:`~mcfn.stage.candidates.read_run`,
    :func:`~mcfn.stage.candidates.run_system`)."""
    ckpt, corpus = read_run(path)
    model, cfg = run_system(ckpt, device)
    token_bytes = corpus.tokenizer.token_bytes(cfg.model.vocab_size).to(device)
    shipped = shipped_policy(ckpt.state, model, cfg) if isinstance(model, MegaContext) else None
    # Keep the file's identity (path, config, step, corpus) for later checks, not its optimizer states.
    return Trained(model, corpus, token_bytes, dataclasses.replace(ckpt, state={}), shipped)


def load_shipped(path: Path, device: torch.device, lacks: str) -> tuple[Trained, str, FocusPolicy]:
    """:func:`load_trained` for a reader of a MegaContext run's working context (the evaluations over long
    histories, the needle grid, the decode benchmark): the run, the name of the policy it ships and that policy. A
    plain GPT's run (``--no-mc``) is refused with a :class:`~mcfn.errors.UserError` saying what it ``lacks``."""
    trained = load_trained(path, device)
    if not isinstance(trained.model, MegaContext) or trained.shipped is None:
        raise UserError(f"{path} holds a plain GPT (--no-mc run): {lacks}")
    return trained, *trained.shipped
