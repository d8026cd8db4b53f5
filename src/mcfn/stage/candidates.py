"""The LensNets the stage and the ship choice start from: the run's own (the original, where a stage of an earlier
mcfn replaced it in the checkpoint), and the run's own gated over ``match``'s cut (:mod:`mcfn.stage.ship`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mcfn.checkpoint import Checkpoint
from mcfn.config import RunConfig
from mcfn.core.system import MegaContext
from mcfn.data.corpus import Corpus, prepare_corpus
from mcfn.errors import UserError
from mcfn.profile import config_from_saved

# The run's own LensNet gated over match's cut: its learned scores times this, where they stand out of their row
# (mcfn.core.lensnet.standing_out). Chosen on the selection windows of the five cpu-longrange bases among 16, 32, 64
# and 128: the larger, the more of the run's pass key it keeps, with the corpus at match's (LABLOG, twenty-fourth
# session).
GATED_SCALE = 128.0
GATED = "gated"  # the candidate's name


def with_match_prior(cfg: RunConfig) -> RunConfig:
    """``cfg`` with LensNet's score gated over ``match``'s (``mc.lens.match_prior = "gated"``)."""
    lens = dataclasses.replace(cfg.mc.lens, match_prior="gated")
    return dataclasses.replace(cfg, mc=dataclasses.replace(cfg.mc, lens=lens))


def read_run(run_dir: Path, purpose: str, corpus: Corpus | None = None) -> tuple[Checkpoint, Corpus]:
    """The run's checkpoint and corpus (``corpus``: the run's own, where a run ends with the stage), refused in one
    line where the run has no LensNet (``purpose``: what the caller would do with it) or its config no longer
    rebuilds the corpus it was trained on (:func:`~mcfn.data.corpus.prepare_corpus` checks, before building)."""
    ckpt = Checkpoint.read(run_dir)
    if not ckpt.cfg.mc.enabled or not ckpt.cfg.mc.lens.enabled:
        raise UserError(f"{ckpt.path} has no LensNet {purpose} (a plain or --set mc.lens.enabled=false run)")
    if corpus is None:
        corpus = prepare_corpus(ckpt.cfg.data, trained_on=(ckpt.corpus_key, f"checkpoint {ckpt.path}"))
    return ckpt, corpus


def run_system(ckpt: Checkpoint, device: torch.device) -> tuple[MegaContext, RunConfig]:
    """The run's system with its own LensNet (the original one, where an earlier stage replaced it) and config."""
    original = ckpt.state.get("lens_original")
    cfg = config_from_saved(original["config"]) if original else ckpt.cfg
    system = MegaContext(cfg).to(device)
    system.load_state_dict(ckpt.state["model"])
    if original:
        system.lensnet.load_state_dict(original["lensnet"])
    return system.eval(), cfg


def under_match_prior(own: MegaContext, cfg: RunConfig, device: torch.device) -> tuple[MegaContext, RunConfig]:
    """The run's system, its own LensNet included, with the match prior on (:func:`with_match_prior`)."""
    cfg = with_match_prior(cfg)
    system = MegaContext(cfg).to(device)
    system.load_state_dict(own.state_dict())
    return system, cfg


def gated_system(own: MegaContext, cfg: RunConfig, device: torch.device) -> tuple[MegaContext, RunConfig]:
    """The run's own LensNet gated over ``match``'s cut as a candidate: ``match``'s score, plus the run's LensNet's
    (times :data:`GATED_SCALE`) where it stands out; it cuts as ``match`` does except where the run's LensNet is
    sure, as at a pass key."""
    system, cfg = under_match_prior(own, cfg, device)
    with torch.no_grad():
        system.lensnet.head.weight.mul_(GATED_SCALE)
    return system.eval(), cfg
