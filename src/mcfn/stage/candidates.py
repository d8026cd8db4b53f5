"""What the stage and the ship choice start from: the run (its checkpoint, corpus and validation windows), its own
LensNet (the original, where a stage of an earlier mcfn replaced it in the checkpoint), and the candidate LensNets
built from weights: the run's own gated over ``match``'s cut, a stage round's, the shipped one
(:mod:`mcfn.stage.ship`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from mcfn.checkpoint import Checkpoint
from mcfn.config import RunConfig
from mcfn.core.lensnet import LensNet
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout
from mcfn.core.system import MegaContext, lensnet_of
from mcfn.data.corpus import Corpus, prepare_corpus
from mcfn.errors import UserError
from mcfn.evaluation.held_out import HeldOut
from mcfn.profile import config_from_saved

# The run's own LensNet gated over match's cut: its learned scores times this, where they stand out of their row
# (mcfn.core.lensnet.standing_out). Chosen on the selection windows of the five cpu-longrange bases among 16, 32, 64
# and 128: the larger, the more of the run's pass key it keeps, with the corpus at match's (LABLOG, twenty-fourth
# session).
GATED_SCALE = 128.0
GATED = "gated"  # the candidate's name


def read_run(run_dir: Path, purpose: str = "", corpus: Corpus | None = None) -> tuple[Checkpoint, Corpus]:
    """The saved run's checkpoint and corpus (``corpus``: the run's own, where already at hand), refused in one line
    where the run has no LensNet and ``purpose`` says what the caller would do with one, or where its config no
    longer rebuilds the corpus it was trained on (:func:`~mcfn.data.corpus.prepare_corpus` checks, before building).
    With :func:`run_system`, how every reader of a trained run loads it."""
    ckpt = Checkpoint.read(run_dir)
    if purpose and not (ckpt.cfg.mc.enabled and ckpt.cfg.mc.lens.enabled):
        raise UserError(f"{ckpt.path} has no LensNet {purpose} (a plain or --set mc.lens.enabled=false run)")
    if corpus is None:
        corpus = prepare_corpus(ckpt.cfg.data, trained_on=(ckpt.corpus_key, f"checkpoint {ckpt.path}"))
    return ckpt, corpus


def run_system(ckpt: Checkpoint, device: torch.device) -> tuple[MegaContext | GPT, RunConfig]:
    """The run's model in eval mode on ``device`` (the GPT of a ``--no-mc`` run) and its config; a MegaContext with
    the run's own LensNet (the original one, where a stage of an earlier mcfn replaced it)."""
    original = ckpt.state.get("lens_original")
    cfg = config_from_saved(original["config"]) if original else ckpt.cfg
    model = (MegaContext(cfg) if cfg.mc.enabled else GPT(cfg.model)).to(device)
    model.load_state_dict(ckpt.state["model"])
    if original:
        model.lensnet.load_state_dict(original["lensnet"])
    return model.eval(), cfg


def loaded_lensnet(
    cfg: RunConfig, layout: Layout, match_prior: str, weights: dict[str, Tensor], device: torch.device
) -> LensNet:
    """A LensNet of ``cfg``'s sizes over ``layout`` with ``match_prior`` and ``weights``, on ``device``, for scoring."""
    lensnet = lensnet_of(cfg, layout, match_prior).to(device)
    lensnet.load_state_dict(weights)
    return lensnet.eval()


def gated_lensnet(own: LensNet, cfg: RunConfig) -> LensNet:
    """The run's own LensNet gated over ``match``'s cut as a candidate: ``match``'s score, plus the run's LensNet's
    (times :data:`GATED_SCALE`) where it stands out; it cuts as ``match`` does except where the run's LensNet is
    sure, as at a pass key."""
    gated = loaded_lensnet(cfg, own.layout, "gated", own.state_dict(), own.head.weight.device)
    with torch.no_grad():
        gated.head.weight.mul_(GATED_SCALE)
        if gated.indexer:
            gated.index_weight.weight.mul_(GATED_SCALE)
    return gated


def validation_windows(corpus: Corpus, cfg: RunConfig, count: int, device: torch.device, purpose: str) -> HeldOut:
    """Up to ``count`` windows of the validation split (never the test split), drawn as the final evaluation draws
    its own, in batches of the run's size on ``device``; refused in one line where the split has none (``purpose``:
    what they were for)."""
    token_bytes = corpus.tokenizer.token_bytes(cfg.model.vocab_size).to(device)
    held = HeldOut.drawn(corpus.val, "validation", cfg.data.seq_len + 1, count, cfg.train.batch_size, token_bytes,
                         corpus.tokenizer)  # fmt: skip
    if not held.windows:
        raise UserError(f"the validation split has no window of T + 1 tokens {purpose}")
    return held
