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
from mcfn.distributed import World, average_gradients, init_world, shutdown
from mcfn.errors import RunAborted, UserError
from mcfn.evaluation import EvalSettings, default_budgets, run_evaluation, write_eval_outputs
from mcfn.flops import peak_flops, step_flops
from mcfn.mc.system import MegaContext
from mcfn.microbatch import check_micro_batch, fitting_micro_batch, forward_backward, out_of_memory_message
from mcfn.optim import build_optimizers, current_lrs, lr_multiplier, set_lr_multiplier
from mcfn.report import write_report
from mcfn.stopping import StopRequest
from mcfn.tasks import MCTask, build_task
from mcfn.tracking import METRICS_NAME, MetricsLog

CHECKPOINT_FORMAT = 1
SUMMARY_NAME = "summary.json"
LOD_MAPS_NAME = "lod_maps.txt"
LOD_LEGEND = "a character per block of K tokens: 0 tokens, 1 and up gists, · not covered"
# Config sections that must match a checkpoint for --resume to continue the same run.
RESUME_MUST_MATCH = ("model", "data", "mc")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device is {name} but torch sees no CUDA device")
    return torch.device(name)


def choose_micro_batch(
    cfg: RunConfig, task, sampler: WindowSampler, rows: slice, step: int, device: torch.device, autocast
) -> int:
    """``train.micro_batch_size``, or when it is 0: the whole local batch off GPU, else the largest that fits."""
    local = rows.stop - rows.start
    if cfg.train.micro_batch_size:
        return check_micro_batch(cfg.train.micro_batch_size, local)
    if device.type != "cuda":
        return local
    probe = sampler.batch(step, cfg.train.batch_size)[rows].to(device)

    def try_step(micro: int) -> None:
        try:
            forward_backward(task.train_step, probe, step, rows.start, micro, autocast)
        finally:
            task.model.zero_grad(set_to_none=True)

    micro = fitting_micro_batch(try_step, local)
    say(f"[run] micro-batch {micro} of {local} rows: the largest that fits")
    return micro


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def phase_clock(device: torch.device, sync: bool) -> float:
    """``perf_counter``, after the device's queued work when ``sync`` (so a phase's time is its own)."""
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
    world = init_world(device.type)
    if world.size > 1 and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    try:
        return _train(cfg, out_dir, resume, device, world, t_start)
    finally:
        shutdown(world)


def _train(
    cfg: RunConfig, out_dir: Path, resume: bool, device: torch.device, world: World, t_start: float
) -> dict[str, Any]:
    torch.manual_seed(cfg.train.seed)
    rows = world.rows(cfg.train.batch_size)

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
    if world.size > 1:  # every rank has checked the directory before rank 0 writes to it
        torch.distributed.barrier()

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

    if world.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    log = MetricsLog(
        out_dir,
        cfg.to_dict(),
        cfg.train.wandb if world.is_main else "disabled",
        cfg.train.wandb_project,
        resume_step=start_step if resume else None,
        enabled=world.is_main,
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
        if not world.is_main:
            return
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
    say(
        f"[run] {task.mode} mode, {model.num_params():,} parameters, vocab {vocab}, T={cfg.data.seq_len}, "
        f"B={cfg.train.batch_size}{f' over {world.size} processes' if world.size > 1 else ''}, {steps} steps on "
        f"{device}{' (compiled, ' + cfg.train.compile_mode + ')' if cfg.train.compile else ''} -> {out_dir}"
    )
    # Model FLOPs utilisation on a known GPU: mean FLOPs per step over the step's duration, per device.
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    flops = step_flops(cfg, model)
    micro = choose_micro_batch(cfg, task, sampler, rows, start_step, device, autocast)
    timings = Timings()
    prefetch = Prefetcher(sampler, cfg.train.batch_size, start_step, device, rows=rows)
    params = list(model.parameters())
    bar = tqdm(
        total=steps,
        initial=start_step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
        disable=not world.is_main,
    )
    first_bpb = last_bpb = None
    stopped_at = None
    skipped = bad_in_a_row = 0  # updates skipped for a non-finite loss: in all, and in a row
    window_start, window_steps = time.perf_counter(), 0
    stop = StopRequest()
    try:
        stop.install()
        for step in range(start_step, steps + 1):
            record: dict[str, Any] = {"step": step}
            last = step == steps
            if (step % cfg.train.eval_every == 0 or last) and world.is_main:
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
            logged = step % cfg.train.log_every == 0 or step == steps - 1
            # Phase times on logged steps only (synchronising the device there, never elsewhere).
            t0 = phase_clock(device, logged)
            window_batch = prefetch.next()
            t_data = phase_clock(device, logged)
            try:
                loss, out = forward_backward(task.train_step, window_batch, step, rows.start, micro, autocast)
            except torch.OutOfMemoryError:
                raise RunAborted(out_of_memory_message(micro)) from None
            # With several processes: the mean gradient and loss, and whether any rank was signalled.
            loss, stop_requested = average_gradients(params, loss, stop.signum is not None, world)
            t_fwd_bwd = phase_clock(device, logged)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip) if cfg.optim.grad_clip > 0 else None
            # One host sync per step: a non-finite loss or gradient must not reach the weights.
            if bool(torch.isfinite(loss if grad_norm is None else loss + grad_norm)):
                for opt in optimizers:
                    opt.step()
                bad_in_a_row = 0
            else:
                skipped += 1
                bad_in_a_row += 1
                bar.write(f"step {step:5d} | non-finite loss: update skipped ({skipped} so far)", file=sys.stderr)
                if bad_in_a_row >= cfg.train.max_bad_steps:
                    model.zero_grad(set_to_none=True)
                    checkpoint(step + 1)
                    log.log({"step": step, "train/skipped_steps": skipped})
                    raise RunAborted(
                        f"the loss was non-finite {bad_in_a_row} steps in a row (steps {step - bad_in_a_row + 1}-"
                        f"{step}); the last good parameters are checkpointed in {ckpt_path} (step {step + 1}). "
                        f"Lower the learning rates (optim.*_lr), set optim.grad_clip, or check the data"
                    )
            model.zero_grad(set_to_none=True)
            window_steps += 1

            if logged:
                t_optim = phase_clock(device, logged)
                record.update(
                    {
                        "time/data_ms": (t_data - t0) * 1e3,
                        "time/fwd_bwd_ms": (t_fwd_bwd - t_data) * 1e3,
                        "time/optim_ms": (t_optim - t_fwd_bwd) * 1e3,
                        **current_lrs(optimizers, mult),
                    }
                )
                # Every loss term and metric comes back in one transfer.
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
                        "train/skipped_steps": skipped,
                        "time/step_ms": step_ms,
                        "train/tokens_per_s": tok_s,
                        **({"train/mfu": flops / (step_ms / 1e3) / (peak * world.size)} if peak else {}),
                        "train/lr_mult": mult,
                    }
                )
                # Loss terms and the grad norm go under train/; metrics keep their own names (mc/..., train/...).
                record.update({k if "/" in k else f"train/{k}": v for k, v in values.items() if k != "loss"})
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
                window_start, window_steps = time.perf_counter(), 0
            if (
                world.is_main
                and cfg.train.lod_map_every
                and step % cfg.train.lod_map_every == 0
                and isinstance(task, MCTask)
            ):
                maps = task.lod_maps(window_batch, step)
                text = f"step {step}: sample 0's working contexts ({LOD_LEGEND})\n"
                text += "".join(f"  {name:>9} {line}\n" for name, line in maps)
                bar.write(text.rstrip("\n"), file=sys.stderr)
                with (out_dir / LOD_MAPS_NAME).open("a") as f:
                    f.write(text)
            bar.update(1)
            if len(record) > 1:
                log.log(record, {k: v for k, v in out.items() if v.ndim == 1} if "train/loss" in record else None)
            if stop_requested:  # finish the step, checkpoint it, and leave
                stopped_at = step + 1
                checkpoint(stopped_at)
                break
    finally:
        stop.restore()
        bar.close()
        prefetch.close()
        log.close()

    if not world.is_main:
        return {"steps": steps, "rank": world.rank, "stopped_at": stopped_at}
    final_eval = None
    if stopped_at is None and cfg.train.final_eval and isinstance(model, MegaContext):
        settings = EvalSettings(default_budgets(model.layout))
        windows = validation_batches(corpus.val, window, cfg.train.final_eval_batches, cfg.train.batch_size)
        final_eval = run_evaluation(model, windows, token_bytes, settings)
        final_eval["checkpoint_step"] = steps
        table = write_eval_outputs(final_eval, out_dir)
        say(f"\n{table}")

    median_ms = statistics.median(timings.step_ms) if timings.step_ms else timings.first_step_ms or 0.0
    summary = {
        "steps": steps,
        "resumed_from": start_step if resume else None,
        "stopped_at": stopped_at,  # set when a signal stopped the run early (resume with --resume)
        "skipped_steps": skipped,  # updates skipped for a non-finite loss
        "micro_batch_size": micro,
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
        "eval": None
        if final_eval is None
        else {k: final_eval[k] for k in ("W", "bpb", "retained_fraction", "lens_rank_corr")},
    }
    tmp = out_dir / f"{SUMMARY_NAME}.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out_dir / SUMMARY_NAME)
    if stopped_at is not None:
        say(
            f"[run] stopped by {stop.name} after step {stopped_at}; checkpoint written; continue with "
            f"--resume --out {out_dir}"
        )
        return summary
    maps_path = out_dir / LOD_MAPS_NAME
    last_maps = maps_path.read_text().split("step ")[-1] if maps_path.exists() else None
    report = write_report(out_dir, summary, tokens_per_step, final_eval, last_maps and f"step {last_maps}")
    say(f"[run] report: {report}")
    say(
        f"[run] done: val bpb {first_bpb:.4f} -> {last_bpb:.4f}, {summary['tokens_per_s'] or 0:,.0f} tok/s "
        f"(median step {median_ms:.0f} ms), summary in {out_dir / SUMMARY_NAME}"
    )
    return summary
