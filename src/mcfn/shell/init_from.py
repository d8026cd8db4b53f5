"""Two-stage training: a new run whose base model starts from another run's trained weights (``--init-from``).

The first stage is typically a plain GPT trained at the full length ``T`` (``--no-mc``), which learns to read
long contexts; the second trains MegaContext from its base model. Only the base model's weights are taken
(GistNet, LensNet, the optimizers and the step count start afresh), and only from a run with the same
``[model]`` config and the same corpus and tokenizer: anything else is refused before training starts.

A **branch**: a checkpoint saved at exactly this run's ``train.plain_steps`` (another MegaContext run's plain phase
or a plain run, at the same ``[model]`` and ``[optim]``, corpus and tokenizer) starts this run there, its plain phase
done: the MegaContext phase runs from that base under the same learning-rate schedule, so that MC variants can be
compared on one base without training it again. The optimizers' state starts afresh, as in any ``--init-from``.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor, nn

from mcfn.checkpoint import Checkpoint
from mcfn.config import RunConfig
from mcfn.core.system import MegaContext

BASE_PREFIX = "base."  # a MegaContext checkpoint's base-model entries


def base_weights(model: dict[str, Tensor]) -> dict[str, Tensor]:
    """The base model's weights in a checkpoint's model state: a plain run's whole model, or a MegaContext
    run's ``base.*``."""
    if any(key.startswith(BASE_PREFIX) for key in model):
        return {key.removeprefix(BASE_PREFIX): value for key, value in model.items() if key.startswith(BASE_PREFIX)}
    return dict(model)


def init_base_from(model: nn.Module, cfg: RunConfig, corpus_key: str, path: Path) -> int:
    """Load ``path``'s (a run directory or its checkpoint) base weights into ``model``'s base; returns the step
    this run starts at: ``train.plain_steps`` for a branch (see the module's docstring), else 0."""
    ckpt = Checkpoint.read(path)
    branch = cfg.mc.enabled and cfg.train.plain_steps > 0 and ckpt.step == cfg.train.plain_steps
    ckpt.check_fits("--init-from", corpus_key, cfg, ("model", "optim") if branch else ("model",))
    base = model.base if isinstance(model, MegaContext) else model
    base.load_state_dict(base_weights(ckpt.state["model"]))
    return ckpt.step if branch else 0
