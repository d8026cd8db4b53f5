"""``train.eval``'s work: a trained run loaded from disk, evaluated on held-out windows, its outputs written."""

from __future__ import annotations

from pathlib import Path

from mcfn.core.nodes import Layout
from mcfn.core.system import MegaContext
from mcfn.data.corpus import encode_source
from mcfn.data.loader import validation_batches
from mcfn.errors import UserError
from mcfn.shell.restore import load_trained
from mcfn.tools.evaluation import EvalSettings, default_budgets, run_evaluation, write_eval_outputs


def parse_budgets(text: str | None, layout: Layout) -> tuple[int, ...]:
    if text is None:
        return default_budgets(layout)
    try:
        budgets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"--budgets {text!r} must be comma-separated integers") from None
    for w in budgets:
        if not layout.coarsest_cover <= w <= layout.T:
            raise UserError(
                f"budget {w} is outside [{layout.coarsest_cover}, {layout.T}]: the coarsest full-coverage context "
                f"needs {layout.coarsest_cover} entries and T={layout.T}"
            )
    if not budgets:
        raise UserError("--budgets is empty")
    return budgets


def evaluate_checkpoint(
    ckpt: Path,
    data: str | None = None,
    out_dir: Path | None = None,
    batches: int | None = None,
    budgets: str | None = None,
    random_contexts: int = 8,
    refocus: int = 4,
    device: str = "auto",
) -> tuple[dict, str]:
    """``train.eval``: load, evaluate, write the outputs; returns the report and its table."""
    from mcfn.shell.loop import resolve_device

    if random_contexts < 2:
        raise UserError("--random-contexts must be >= 2 (the rank correlation compares pairs)")
    if refocus < 1:
        raise UserError("--refocus must be >= 1")
    trained = load_trained(ckpt, resolve_device(device))
    if not isinstance(trained.model, MegaContext):
        raise UserError(f"{ckpt} holds a plain GPT (--no-mc run); train.eval compares MegaContext working contexts")
    cfg, layout = trained.cfg, trained.model.layout
    split = (
        trained.corpus.val if data is None else encode_source(data, trained.corpus.tokenizer, cfg.data.min_doc_chars)
    )
    n_batches = batches or cfg.train.eval_batches
    if n_batches < 1:
        raise UserError("--batches must be >= 1")
    windows = validation_batches(split, cfg.data.seq_len + 1, n_batches, cfg.train.batch_size)
    settings = EvalSettings(parse_budgets(budgets, layout), random_contexts, refocus)
    report = run_evaluation(trained.model, windows, trained.token_bytes, settings)
    report["checkpoint_step"] = trained.step
    report["data"] = data or f"{cfg.data.source} (validation split)"
    table = write_eval_outputs(report, out_dir or (ckpt if ckpt.is_dir() else ckpt.parent))
    return report, table
