"""``train.eval``'s work: a trained run loaded from disk, evaluated on held-out windows, its outputs written."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from mcfn.core.cadence import CLOCK, COPY_THRESHOLD
from mcfn.core.focus import REFOCUS_STEPS
from mcfn.core.model import GPT
from mcfn.core.system import MegaContext
from mcfn.data.corpus import encode_source, held_out
from mcfn.data.probes import PROBES, misfit
from mcfn.errors import UserError
from mcfn.evaluation.batch import EvalSettings, evaluation_budgets
from mcfn.evaluation.evaluate import evaluate
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.report import write_eval_outputs
from mcfn.evaluation.result import EvalReport, Provenance
from mcfn.shell.devices import resolve_device
from mcfn.shell.restore import Trained, load_shipped, load_trained


def parse_tasks(names: list[str] | None) -> tuple[str, ...]:
    """The tasks to score, ``corpus`` first: the report's headline figures come from it."""
    chosen = list(dict.fromkeys(names or PROBES))
    unknown = [n for n in chosen if n not in PROBES]
    if unknown:
        raise UserError(f"unknown --task {unknown[0]!r} (known: {', '.join(PROBES)})")
    return ("corpus", *(n for n in chosen if n != "corpus"))


def parse_budgets(text: str | None) -> tuple[int, ...] | None:
    """``--budgets`` as integers (None: the defaults, which depend on the run)."""
    if text is None:
        return None
    try:
        budgets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"--budgets {text!r} must be comma-separated integers") from None
    if not budgets:
        raise UserError("--budgets is empty")
    return budgets


def load_reference(path: Path, trained: Trained, device: torch.device) -> GPT:
    """The plain model a user would pick instead: a ``--no-mc`` run on the same tokenizer and ``T``."""
    reference = load_trained(path, device)
    if isinstance(reference.model, MegaContext):
        raise UserError(f"--reference {path} is a MegaContext run; it must be a plain GPT (--no-mc) run")
    reference.checkpoint.check_fits("--reference", trained.corpus.key, trained.cfg, ("data.seq_len",), "the checkpoint")
    return reference.model


@dataclass(frozen=True)
class EvalRequest:
    """What ``train.eval`` is asked for, one field per flag (``python -m train.eval --help`` says each)."""

    ckpt: Path
    data: str | None = None
    out: Path | None = None
    batches: int | None = None
    budgets: str | None = None
    random_contexts: int = 8
    refocus: int = REFOCUS_STEPS
    refocus_every: int | None = None
    refocus_on: str = CLOCK
    refocus_threshold: float = COPY_THRESHOLD
    device: str = "auto"
    tasks: list[str] | None = None
    reference: Path | None = None
    split: str = "test"
    brief: bool = False
    oracle: bool = False


def evaluate_checkpoint(request: EvalRequest) -> tuple[EvalReport, str]:
    """``train.eval``: load, evaluate, write the outputs; returns the report and its table."""
    ckpt, data, tasks, reference = request.ckpt, request.data, request.tasks, request.reference
    random_contexts, refocus, refocus_every = request.random_contexts, request.refocus, request.refocus_every
    if random_contexts < 2:
        raise UserError("--random-contexts must be >= 2 (the rank correlation compares pairs)")
    if refocus < 1:
        raise UserError("--refocus must be >= 1")
    if request.batches is not None and request.batches < 1:
        raise UserError("--batches must be >= 1")
    chosen, budgets = parse_tasks(tasks), parse_budgets(request.budgets)
    device = resolve_device(request.device)
    trained, shipped, policy = load_shipped(ckpt, device, "train.eval compares MegaContext working contexts")
    cfg, layout, tok = trained.cfg, trained.model.layout, trained.corpus.tokenizer
    for name in tasks or ():  # a task asked for by name must fit; the default set skips what does not
        if (reason := misfit(name, tok, layout.T, layout.H)) is not None:
            raise UserError(f"--task {name}: {reason}")
    if data is None:
        name, split = held_out(trained.corpus, request.split)
    else:
        name, split = data, encode_source(data, tok, cfg.data.min_doc_chars)
    B = cfg.train.batch_size
    count = (request.batches or cfg.train.eval_batches) * B
    held = HeldOut.drawn(split, name, cfg.data.seq_len + 1, count, B, trained.token_bytes, tok)
    refocus_every = cfg.mc.refocus_every if refocus_every is None else refocus_every
    budgets = evaluation_budgets(layout, budgets, refocus_every)  # every request is checked before the work starts
    plain = load_reference(reference, trained, trained.token_bytes.device) if reference is not None else None
    settings = EvalSettings(
        budgets,
        random_contexts,
        refocus,
        chosen,
        refocus_every=refocus_every,
        refocus_on=request.refocus_on,
        refocus_threshold=request.refocus_threshold,
        brief=request.brief,
        candidates=(policy,),
        oracle=request.oracle,
    )
    report = evaluate(trained.model, held, settings, plain)
    provenance = Provenance(data or f"{cfg.data.source} ({name} split)", None if reference is None else str(reference))
    report = dataclasses.replace(report, checkpoint_step=trained.step, provenance=provenance, shipped=shipped)
    table = write_eval_outputs(report, request.out or (ckpt if ckpt.is_dir() else ckpt.parent))
    return report, table
