"""Two-stage training: a new run whose base model starts from another run's trained weights (``--init-from``).

The first stage is typically a plain GPT trained at the full length ``T`` (``--no-mc``), which learns to read
long contexts; the second trains MegaContext from its base model. Only the base model's weights are taken
(GistNet, LensNet, the optimizers and the step count start afresh), and only from a run with the same
``[model]`` config and the same corpus and tokenizer: anything else is refused before training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from mcfn.config import RunConfig
from mcfn.core.system import MegaContext
from mcfn.errors import UserError
from mcfn.profile import config_from_saved
from mcfn.shell.checkpoint import load_run_state, run_checkpoint

BASE_PREFIX = "base."  # a MegaContext checkpoint's base-model entries


def base_weights(state: dict[str, Any]) -> dict[str, Tensor]:
    """The base model's weights in a checkpoint: a plain run's whole model, or a MegaContext run's ``base.*``."""
    model = state["model"]
    if any(key.startswith(BASE_PREFIX) for key in model):
        return {key.removeprefix(BASE_PREFIX): value for key, value in model.items() if key.startswith(BASE_PREFIX)}
    return dict(model)


def check_same_base(saved: RunConfig, cfg: RunConfig, path: Path) -> None:
    trained = saved.flat()
    for key, value in cfg.flat().items():
        if key.startswith("model.") and trained.get(key) != value:
            raise UserError(
                f"--init-from {path} was trained with {key}={trained.get(key)!r}, this run has {value!r}: "
                "the base model must have the same [model] config"
            )


def init_base_from(model: nn.Module, cfg: RunConfig, corpus_key: str, path: Path) -> int:
    """Load ``path``'s (a run directory or its checkpoint) base weights into ``model``'s base; returns its step."""
    state = load_run_state(run_checkpoint(path))
    check_same_base(config_from_saved(state["config"]), cfg, path)
    if state.get("corpus_key") != corpus_key:
        raise UserError(f"--init-from {path} was trained on a different corpus or tokenizer than this run")
    base = model.base if isinstance(model, MegaContext) else model
    base.load_state_dict(base_weights(state))
    return int(state["step"])
