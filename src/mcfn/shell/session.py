"""Everything a training run holds while it runs, set up once: data, model, optimizers, restored state, log.

A checkpoint is the session's state at a step: the model, the optimizers, the torch RNG, the config and
the corpus key. Batch ``i`` is a pure function of the seed and ``i``, so the step is the data position.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mcfn.checkpoint import CHECKPOINT_NAME, Checkpoint, run_state, save_checkpoint
from mcfn.config import RunConfig
from mcfn.data.corpus import Corpus, prepare_corpus
from mcfn.data.loader import WindowSampler, validation_batches
from mcfn.data.mixture import MixedSampler, training_sampler
from mcfn.errors import UserError
from mcfn.shell.devices import autocast_for, padded_vocab
from mcfn.shell.distributed import World
from mcfn.shell.init_from import init_base_from
from mcfn.shell.optim import build_optimizers
from mcfn.shell.tasks import MCTask, PlainTask, build_task
from mcfn.shell.tracking import METRICS_NAME, MetricsLog

# Config sections that must match a checkpoint for --resume to continue the same run.
RESUME_MUST_MATCH = ("model", "data", "mc")


@dataclass
class Session:
    cfg: RunConfig  # with the model's vocabulary set from the tokenizer
    out_dir: Path
    device: torch.device
    world: World
    rows: slice  # this process's rows of every global batch
    corpus: Corpus
    sampler: WindowSampler | MixedSampler  # training batch i, a pure function of (seed, i)
    val_batches: list[Tensor]  # fixed held-out windows
    task: PlainTask | MCTask
    optimizers: list[torch.optim.Optimizer]
    log: MetricsLog
    start_step: int  # 0, or the step a resumed run continues from
    resumed: bool
    autocast: Callable  # bf16 autocast on CUDA, a null context elsewhere

    @property
    def model(self) -> torch.nn.Module:
        return self.task.model

    @property
    def token_bytes(self) -> Tensor:
        """``[vocab]`` bytes per token id, on the device."""
        return self.task.token_bytes

    @property
    def ckpt_path(self) -> Path:
        return self.out_dir / CHECKPOINT_NAME


def _restore(session: Session, ckpt: Checkpoint) -> None:
    session.model.load_state_dict(ckpt.state["model"])
    for opt, opt_state in zip(session.optimizers, ckpt.state["optimizers"], strict=True):
        opt.load_state_dict(opt_state)
    torch.set_rng_state(ckpt.state["rng"]["torch"])


def _previous_state(cfg: RunConfig, out_dir: Path, resume: bool, corpus_key: str) -> Checkpoint | None:
    """The checkpoint to continue from (``resume``), after checking it fits; refuses to overwrite a run."""
    path = out_dir / CHECKPOINT_NAME
    if resume:
        ckpt = Checkpoint.read(path)
        ckpt.check_fits("--resume", corpus_key, cfg, RESUME_MUST_MATCH)
        if ckpt.step > cfg.train.steps:
            raise UserError(f"checkpoint {path} is at step {ckpt.step}, beyond train.steps={cfg.train.steps}")
        return ckpt
    if path.exists() or (out_dir / METRICS_NAME).exists():
        raise UserError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out")
    return None


def open_session(cfg: RunConfig, out_dir: Path, resume: bool, device: torch.device, world: World) -> Session:
    """Data, model, optimizers and log for a run in ``out_dir``; a resumed run's state restored."""
    torch.manual_seed(cfg.train.seed)
    corpus = prepare_corpus(cfg.data)
    vocab = padded_vocab(corpus.tokenizer.vocab_size)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    # Windows first: a corpus too short for them is refused before anything is written.
    sampler = training_sampler(cfg, corpus)
    val_batches = validation_batches(corpus.val, cfg.data.seq_len + 1, cfg.train.eval_batches, cfg.train.batch_size)
    state = _previous_state(cfg, out_dir, resume, corpus.key)
    if world.size > 1:  # every rank has checked the directory before rank 0 writes to it
        torch.distributed.barrier()
    task = build_task(cfg, corpus.tokenizer.token_bytes(vocab).to(device), device)
    start_step = state.step if state is not None else 0
    if state is None and cfg.train.init_from:  # checked and loaded before anything is written
        start_step = init_base_from(task.model, cfg, corpus.key, Path(cfg.train.init_from))
    if world.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    wandb = cfg.train.wandb if world.is_main else "disabled"
    resume_step = start_step if resume else None
    log = MetricsLog(out_dir, cfg.to_dict(), wandb, "mcfn", resume_step, enabled=world.is_main)
    session = Session(
        cfg=cfg,
        out_dir=out_dir,
        device=device,
        world=world,
        rows=world.rows(cfg.train.batch_size),
        corpus=corpus,
        sampler=sampler,
        val_batches=val_batches,
        task=task,
        optimizers=build_optimizers(task.model, cfg.optim),
        log=log,
        start_step=start_step,
        resumed=resume,
        autocast=autocast_for(device),
    )
    if state is not None:
        _restore(session, state)
    if cfg.train.compile:
        task.compile(cfg.train.compile_mode)
    return session


def session_state(session: Session, step: int) -> dict[str, Any]:
    """What a checkpoint of the session as it is before step ``step`` holds (:func:`~mcfn.checkpoint.run_state`)."""
    return run_state(step, session.model, session.optimizers, session.cfg, session.corpus.key)


def save_state(session: Session, step: int) -> None:
    """Checkpoint the session as it is before step ``step`` (rank 0 only)."""
    if session.world.is_main:
        save_checkpoint(session.ckpt_path, session_state(session, step))


@dataclass
class Progress:
    """What the loop counts as it goes; :func:`~mcfn.shell.outcome.finish` turns it into the summary."""

    micro: int  # rows per forward/backward
    peak_step_s: float | None = None  # a step's FLOPs at the devices' peak rate, in seconds (known GPUs only)
    step_ms: list[float] = field(default_factory=list)  # logged steps after the first
    first_step_ms: float | None = None  # the first logged step, compilation included
    eval_s: list[float] = field(default_factory=list)
    first_bpb: float | None = None
    last_bpb: float | None = None
    skipped: int = 0  # updates skipped for a non-finite loss, in all
    bad_in_a_row: int = 0
    stopped_at: int | None = None  # set when a signal stopped the run early
    stopped_by: str | None = None  # that signal's name
    window_start: float = field(default_factory=time.perf_counter)  # throughput since the last logged step
    window_steps: int = 0
