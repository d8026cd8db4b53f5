"""A trained model back from its run directory, for evaluation and generation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mcfn.config import RunConfig
from mcfn.core.model import GPT
from mcfn.core.system import MegaContext
from mcfn.data.corpus import Corpus, prepare_corpus
from mcfn.errors import UserError
from mcfn.profile import config_from_saved
from mcfn.shell.checkpoint import load_run_state, run_checkpoint


@dataclass
class Trained:
    cfg: RunConfig
    model: nn.Module  # MegaContext, or GPT for a --no-mc run
    corpus: Corpus
    token_bytes: Tensor  # [vocab] bytes per token id, on the model's device
    step: int


def load_trained(path: Path, device: torch.device) -> Trained:
    """Load ``path`` (a run directory or its checkpoint file) onto ``device``, with its corpus and tokenizer."""
    ckpt = run_checkpoint(path)
    state = load_run_state(ckpt)
    cfg = config_from_saved(state["config"])
    corpus = prepare_corpus(cfg.data)
    if corpus.key != state.get("corpus_key"):
        raise UserError(
            f"checkpoint {ckpt} was trained on a corpus or tokenizer that this machine rebuilds differently"
        )
    model = (MegaContext(cfg) if cfg.mc.enabled else GPT(cfg.model)).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    token_bytes = corpus.tokenizer.token_bytes(cfg.model.vocab_size).to(device)
    return Trained(cfg=cfg, model=model, corpus=corpus, token_bytes=token_bytes, step=state["step"])
