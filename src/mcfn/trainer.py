"""The imperative shell around the pure step: data, optimizer, schedule, evaluation, logging, checkpoints.

The loop reads tensors back from the step only at log and eval steps; everything between is device work.
Step ``s`` (0-based) trains on batch ``s`` with the parameters after ``s`` updates; its record in
``metrics.jsonl`` carries that step's loss, and the validation bits-per-byte of the same parameters when
it is an evaluation step (step 0, every ``eval_every``, and the end, ``step == steps``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mcfn.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from mcfn.config import RunConfig
from mcfn.data.corpus import prepare_corpus
from mcfn.data.loader import Prefetcher, WindowSampler, validation_batches
from mcfn.errors import UserError
from mcfn.optim import build_optimizers, lr_multiplier, set_lr_multiplier
from mcfn.step import total_loss
from mcfn.stopping import StopRequest
from mcfn.tasks import build_task
from mcfn.tracking import METRICS_NAME, MetricsLog

CHECKPOINT_FORMAT = 1
SUMMARY_NAME = "summary.json"
# Config sections that must match a checkpoint for --resume to continue the same run.
RESUME_MUST_MATCH = ("model", "data", "mc")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device is {name} but torch sees no CUDA device")
    return torch.device(name)


def padded_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def _check_resumable(state: dict[str, Any], cfg: RunConfig, corpus_key: str, path: Path) -> None:
    if state.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"checkpoint {path} has format {state.get('format')}, expected {CHECKPOINT_FORMAT}")
    saved, current = state["config"], cfg.to_dict()
    for section in RESUME_MUST_MATCH:
        diff = [k for k in current[section] if saved.get(section, {}).get(k) != current[section][k]]
        if diff:
            k = diff[0]
            raise UserError(
                f"checkpoint {path} was written with {section}.{k}={saved[section].get(k)!r}, "
                f"this run has {current[section][k]!r}; it cannot be resumed with a different "
                f"{section} config"
            )
    if state["corpus_key"] != corpus_key:
        raise UserError(f"checkpoint {path} was trained on a different corpus or tokenizer")
    if state["step"] > cfg.train.steps:
        raise UserError(f"checkpoint {path} is at step {state['step']}, beyond train.steps={cfg.train.steps}")


@dataclasses.dataclass
class Timings:
    step_ms: list[float] = dataclasses.field(default_factory=list)
    first_step_ms: float | None = None
    eval_s: list[float] = dataclasses.field(default_factory=list)


def train(cfg: RunConfig, out_dir: Path, resume: bool = False) -> dict[str, Any]:
    """Train as configured, writing metrics, checkpoints and ``summary.json`` to ``out_dir``."""
    t_start = time.perf_counter()
    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)

    corpus = prepare_corpus(cfg.data)
    vocab = padded_vocab(corpus.tokenizer.vocab_size)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    window = cfg.data.seq_len + 1
    sampler = WindowSampler(corpus.train, window, cfg.train.seed)
    val_batches = validation_batches(corpus.val, window, cfg.train.eval_batches, cfg.train.batch_size)
    token_bytes = corpus.tokenizer.token_bytes(vocab).to(device)

    ckpt_path = out_dir / CHECKPOINT_NAME
    state = None
    if resume:
        state = load_checkpoint(ckpt_path)
        _check_resumable(state, cfg, corpus.key, ckpt_path)
    elif ckpt_path.exists() or (out_dir / METRICS_NAME).exists():
        raise UserError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out")

    task = build_task(cfg, token_bytes, device)
    model = task.model
    optimizers = build_optimizers(model, cfg.optim)
    start_step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        torch.set_rng_state(state["rng"]["torch"])
        start_step = state["step"]

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    log = MetricsLog(
        out_dir, cfg.to_dict(), cfg.train.wandb, cfg.train.wandb_project, resume_step=start_step if resume else None
    )

    if cfg.train.compile:
        task.compile(cfg.train.compile_mode)
    autocast = (
        partial(torch.autocast, "cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext
    )

    def evaluate() -> dict[str, float]:
        model.eval()
        t0 = time.perf_counter()
        with autocast():
            result = task.evaluate(val_batches)
        model.train()
        timings.eval_s.append(time.perf_counter() - t0)
        return result

    def checkpoint(step: int) -> None:
        save_checkpoint(
            ckpt_path,
            {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "data_position": step,  # batch index of the next step: the sampler is a function of it
                "model": model.state_dict(),
                "optimizers": [opt.state_dict() for opt in optimizers],
                "rng": {"torch": torch.get_rng_state()},
                "config": cfg.to_dict(),
                "corpus_key": corpus.key,
            },
        )

    steps, tokens_per_step = cfg.train.steps, cfg.train.batch_size * cfg.data.seq_len
    print(
        f"[run] {task.mode} mode, {model.num_params():,} parameters, vocab {vocab}, T={cfg.data.seq_len}, "
        f"B={cfg.train.batch_size}, {steps} steps on {device}"
        f"{' (compiled, ' + cfg.train.compile_mode + ')' if cfg.train.compile else ''} -> {out_dir}",
        file=sys.stderr,
        flush=True,
    )
    timings = Timings()
    prefetch = Prefetcher(sampler, cfg.train.batch_size, start_step, device)
    bar = tqdm(
        total=steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5, file=sys.stderr
    )
    first_bpb = last_bpb = None
    stopped_at = None
    window_start, window_steps = time.perf_counter(), 0
    stop = StopRequest()
    try:
        stop.install()
        for step in range(start_step, steps + 1):
            record: dict[str, Any] = {"step": step}
            last = step == steps
            if step % cfg.train.eval_every == 0 or last:
                result = evaluate()
                last_bpb = result["val/bpb"]
                first_bpb = last_bpb if first_bpb is None else first_bpb
                record.update(result)
                shown = " | ".join(f"{k.removeprefix('val/')} {v:.4f}" for k, v in result.items())
                bar.write(f"step {step:5d} | {shown}", file=sys.stderr)
            if step > start_step and (step % cfg.train.ckpt_every == 0 or last):
                checkpoint(step)
            if last:
                log.log(record)
                break

            mult = lr_multiplier(step, steps, cfg.optim)
            set_lr_multiplier(optimizers, mult)
            t0 = time.perf_counter()
            window_batch = prefetch.next()
            with autocast():
                out = task.train_step(window_batch, step)
            loss = total_loss(out)
            loss.backward()
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                if cfg.optim.grad_clip > 0
                else None
            )
            for opt in optimizers:
                opt.step()
            model.zero_grad(set_to_none=True)
            window_steps += 1

            if step % cfg.train.log_every == 0 or step == steps - 1:
                # The one host sync per logged step: every loss term and metric comes back together.
                scalars = {k: v for k, v in out.items() if v.ndim == 0}
                names = ["loss", *scalars] + (["grad_norm"] if grad_norm is not None else [])
                tensors = [loss, *scalars.values()] + ([grad_norm] if grad_norm is not None else [])
                values = dict(zip(names, torch.stack([t.detach().float() for t in tensors]).tolist(), strict=True))
                loss_value = values["loss"]
                now = time.perf_counter()
                step_ms = (now - t0) * 1e3
                if timings.first_step_ms is None:
                    timings.first_step_ms = step_ms
                else:
                    timings.step_ms.append(step_ms)
                tok_s = window_steps * tokens_per_step / (now - window_start)
                record.update(
                    {
                        "train/loss": loss_value,
                        "time/step_ms": step_ms,
                        "train/tokens_per_s": tok_s,
                        "train/lr_mult": mult,
                    }
                )
                # Loss terms and the grad norm go under train/; metrics keep their own names (mc/..., train/...).
                record.update({k if "/" in k else f"train/{k}": v for k, v in values.items() if k != "loss"})
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
                window_start, window_steps = time.perf_counter(), 0
            bar.update(1)
            if len(record) > 1:
                log.log(record, {k: v for k, v in out.items() if v.ndim == 1} if "train/loss" in record else None)
            if stop.signum is not None:  # finish the step, checkpoint it, and leave
                stopped_at = step + 1
                checkpoint(stopped_at)
                break
    finally:
        stop.restore()
        bar.close()
        prefetch.close()
        log.close()

    median_ms = statistics.median(timings.step_ms) if timings.step_ms else timings.first_step_ms or 0.0
    summary = {
        "steps": steps,
        "resumed_from": start_step if resume else None,
        "stopped_at": stopped_at,  # set when a signal stopped the run early (resume with --resume)
        "mode": task.mode,
        "device": str(device),
        "compiled": cfg.train.compile,
        "params": model.num_params(),
        "first_val_bpb": first_bpb,
        "final_val_bpb": last_bpb,
        "step_ms_median": median_ms,
        "tokens_per_s": tokens_per_step / (median_ms / 1e3) if median_ms else None,
        # The first step (and first eval) include compilation; the rest do not.
        "compile_s": max(0.0, ((timings.first_step_ms or 0.0) - median_ms) / 1e3),
        "eval_s_total": sum(timings.eval_s),
        "wall_s": time.perf_counter() - t_start,
    }
    tmp = out_dir / f"{SUMMARY_NAME}.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out_dir / SUMMARY_NAME)
    if stopped_at is not None:
        print(
            f"[run] stopped by {stop.name} after step {stopped_at}; checkpoint written; continue with "
            f"--resume --out {out_dir}",
            file=sys.stderr,
            flush=True,
        )
        return summary
    print(
        f"[run] done: val bpb {first_bpb:.4f} -> {last_bpb:.4f}, {summary['tokens_per_s'] or 0:,.0f} tok/s "
        f"(median step {median_ms:.0f} ms), summary in {out_dir / SUMMARY_NAME}",
        file=sys.stderr,
        flush=True,
    )
    return summary
