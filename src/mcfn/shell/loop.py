"""The training loop: a few named steps around the core's pure step, over a :class:`~mcfn.shell.session.Session`.

The loop reads tensors back from the step only at log and eval steps; everything between is device work.
Step ``s`` (0-based) trains on batch ``s`` with the parameters after ``s`` updates; its record in
``metrics.jsonl`` carries that step's loss, and the validation bits-per-byte of the same parameters when
it is an evaluation step (step 0, every ``eval_every``, and the end, ``step == steps``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from mcfn.config import RunConfig
from mcfn.core.outputs import StepOutput
from mcfn.data.corpus import cache_root
from mcfn.data.loader import Prefetcher
from mcfn.errors import RunAborted
from mcfn.shell.compile_cache import CompileCache, artifacts_path
from mcfn.shell.devices import resolve_device
from mcfn.shell.distributed import average_gradients, init_world, shutdown
from mcfn.shell.memory import MemoryHistory, check_memory_snapshot
from mcfn.shell.microbatch import check_micro_batch, fitting_micro_batch, forward_backward, out_of_memory_message
from mcfn.shell.optim import current_lrs, lr_multiplier, set_lr_multiplier
from mcfn.shell.outcome import LOD_MAPS_NAME, finish
from mcfn.shell.session import Progress, Session, open_session, save_state
from mcfn.shell.stopping import StopRequest
from mcfn.shell.tasks import MCTask
from mcfn.tools.flops import peak_flops, step_flops

LOD_LEGEND = "a character per block of K tokens: 0 tokens, 1 and up gists, · not covered"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class StepResult:
    loss: Tensor
    out: StepOutput
    grad_norm: Tensor | None
    stop_requested: bool  # by a signal, on any rank
    window: Tensor  # this process's rows of the batch
    lr_mult: float
    clock: list[float]  # perf_counter before the data, after it, after forward+backward, after the update


def train(cfg: RunConfig, out_dir: Path, resume: bool = False) -> dict[str, Any]:
    """Train as configured, writing metrics, checkpoints, ``summary.json`` and the report to ``out_dir``."""
    t_start = time.perf_counter()
    device = resolve_device(cfg.train.device)
    check_memory_snapshot(cfg.train, device)
    world = init_world(device.type)
    if world.size > 1 and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    try:
        session = open_session(cfg, out_dir, resume, device, world)
        return finish(session, run_loop(session), t_start, say)
    finally:
        shutdown(world)


def run_loop(s: Session) -> Progress:
    """Evaluate, checkpoint, train, log, stop: one global step at a time until ``train.steps``."""
    cfg = s.cfg.train
    announce(s)
    progress = Progress(micro=choose_micro_batch(s), peak_step_s=peak_step_seconds(s))
    prefetch = Prefetcher(s.sampler, cfg.batch_size, s.start_step, s.device, rows=s.rows)
    bar = tqdm(total=cfg.steps, initial=s.start_step, desc="train", unit="step", dynamic_ncols=True,
               mininterval=0.5, file=sys.stderr, disable=not s.world.is_main)  # fmt: skip
    stop = StopRequest()
    snapshot = cfg.memory_snapshot and s.world.is_main
    history = MemoryHistory(s.out_dir / cfg.memory_snapshot if snapshot else None, cfg.memory_snapshot_steps)
    compile_cache = open_compile_cache(s)
    try:
        stop.install()
        for step in range(s.start_step, cfg.steps + 1):
            record: dict[str, Any] = {"step": step}
            last = step == cfg.steps
            if (step % cfg.eval_every == 0 or last) and s.world.is_main:
                record.update(evaluate(s, progress, step, bar))
            if step > s.start_step and (step % cfg.ckpt_every == 0 or last):
                save_state(s, step)
            if last:
                s.log.log(record)
                break
            logged = step % cfg.log_every == 0 or step == cfg.steps - 1
            result = optimizer_step(s, prefetch, step, progress, stop, logged, bar)
            if logged:
                record.update(step_record(s, result, progress, step, bar))
            if s.world.is_main and cfg.lod_map_every and step % cfg.lod_map_every == 0 and isinstance(s.task, MCTask):
                write_lod_maps(s, result.window, step, bar)
            bar.update(1)
            if compile_cache is not None and s.world.is_main:
                compile_cache.save_if_new()
            if message := history.step_done():
                bar.write(message, file=sys.stderr)
            if len(record) > 1:
                s.log.log(record, result.out.histograms if logged else None)
            if result.stop_requested:  # finish the step, checkpoint it, and leave
                progress.stopped_at, progress.stopped_by = step + 1, stop.name or "another process's signal"
                save_state(s, progress.stopped_at)
                break
    finally:
        if message := history.close():
            say(message)
        stop.restore()
        bar.close()
        prefetch.close()
        s.log.close()
    return progress


def open_compile_cache(s: Session) -> CompileCache | None:
    """Compiled runs hot-load torch's portable compile cache from beside the token cache (and keep it there)."""
    if not s.cfg.train.compile:
        return None
    cache = CompileCache(artifacts_path(s.cfg, cache_root(s.cfg.data) / s.corpus.key, s.device))
    if (message := cache.load()) and s.world.is_main:
        say(message)
    return cache


def announce(s: Session) -> None:
    cfg, world = s.cfg, s.world
    compiled = f" (compiled, {cfg.train.compile_mode})" if cfg.train.compile else ""
    processes = f" over {world.size} processes" if world.size > 1 else ""
    say(
        f"[run] {s.task.mode} mode, {s.model.num_params():,} parameters, vocab {cfg.model.vocab_size}, "
        f"T={cfg.data.seq_len}, B={cfg.train.batch_size}{processes}, {cfg.train.steps} steps on {s.device}"
        f"{compiled} -> {s.out_dir}"
    )
    if s.task.mode == "mc" and cfg.train.plain_steps:
        say(f"[run] plain phase: steps 0-{cfg.train.plain_steps - 1} train the base model alone on whole windows")
    if cfg.train.init_from and not s.resumed:
        say(f"[run] base model initialised from {cfg.train.init_from}")


def peak_step_seconds(s: Session) -> float | None:
    """How long a step would take at the peak FLOP/s of every device (MFU = this / the step time); None off a known
    GPU. Computed once per run."""
    peak = peak_flops(torch.cuda.get_device_name(s.device)) if s.device.type == "cuda" else None
    return step_flops(s.cfg, s.model) / (peak * s.world.size) if peak else None


def choose_micro_batch(s: Session) -> int:
    """``train.micro_batch_size``, or when it is 0: the whole local batch off GPU, else the largest that fits."""
    local = s.rows.stop - s.rows.start
    if s.cfg.train.micro_batch_size:
        return check_micro_batch(s.cfg.train.micro_batch_size, local)
    if s.device.type != "cuda":
        return local
    probe = s.sampler.batch(s.start_step, s.cfg.train.batch_size)[s.rows].to(s.device)

    def try_step(micro: int) -> None:
        try:
            forward_backward(s.task.train_step, probe, s.start_step, s.rows.start, micro, s.autocast)
        finally:
            s.model.zero_grad(set_to_none=True)

    micro = fitting_micro_batch(try_step, local)
    say(f"[run] micro-batch {micro} of {local} rows: the largest that fits")
    return micro


def evaluate(s: Session, progress: Progress, step: int, bar: tqdm) -> dict[str, float]:
    """Validation bits per byte of the current parameters, shown on the bar and returned for the record."""
    s.model.eval()
    t0 = time.perf_counter()
    with s.autocast():
        result = s.task.evaluate(s.val_batches)
    s.model.train()
    progress.eval_s.append(time.perf_counter() - t0)
    progress.last_bpb = result["val/bpb"]
    progress.first_bpb = progress.last_bpb if progress.first_bpb is None else progress.first_bpb
    shown = " | ".join(f"{k.removeprefix('val/')} {v:.4f}" for k, v in result.items())
    bar.write(f"step {step:5d} | {shown}", file=sys.stderr)
    return result


def clock(s: Session, sync: bool) -> float:
    """``perf_counter``, after the device's queued work when ``sync`` (so a phase's time is its own)."""
    if sync and s.device.type == "cuda":
        torch.cuda.synchronize(s.device)
    return time.perf_counter()


def optimizer_step(
    s: Session, prefetch: Prefetcher, step: int, progress: Progress, stop: StopRequest, logged: bool, bar: tqdm
) -> StepResult:
    """One update: forward and backward over the micro-batches, the all-reduce, clipping, and the optimizers
    unless the loss or gradient is non-finite. Phase times are taken on logged steps only (synchronising the
    device there, never elsewhere)."""
    mult = lr_multiplier(step, s.cfg.train.steps, s.cfg.optim)
    set_lr_multiplier(s.optimizers, mult)
    times = [clock(s, logged)]
    window = prefetch.next()
    times.append(clock(s, logged))
    try:
        loss, out = forward_backward(s.task.train_step, window, step, s.rows.start, progress.micro, s.autocast)
    except torch.OutOfMemoryError:
        raise RunAborted(out_of_memory_message(progress.micro)) from None
    # With several processes: the mean gradient and loss, and whether any rank was signalled.
    loss, stop_requested = average_gradients(list(s.model.parameters()), loss, stop.signum is not None, s.world)
    times.append(clock(s, logged))
    clip = s.cfg.optim.grad_clip
    grad_norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), clip) if clip > 0 else None
    # One host sync per step: a non-finite loss or gradient must not reach the weights.
    if bool(torch.isfinite(loss if grad_norm is None else loss + grad_norm)):
        for opt in s.optimizers:
            opt.step()
        progress.bad_in_a_row = 0
    else:
        skip_update(s, progress, step, bar)
    s.model.zero_grad(set_to_none=True)
    progress.window_steps += 1
    times.append(clock(s, logged))
    return StepResult(loss, out, grad_norm, stop_requested, window, mult, times)


def skip_update(s: Session, progress: Progress, step: int, bar: tqdm) -> None:
    """Count a non-finite step; after ``train.max_bad_steps`` in a row, checkpoint the last good state and stop."""
    progress.skipped += 1
    progress.bad_in_a_row += 1
    bar.write(f"step {step:5d} | non-finite loss: update skipped ({progress.skipped} so far)", file=sys.stderr)
    bad = progress.bad_in_a_row
    if bad < s.cfg.train.max_bad_steps:
        return
    s.model.zero_grad(set_to_none=True)
    save_state(s, step + 1)
    s.log.log({"step": step, "train/skipped_steps": progress.skipped})
    raise RunAborted(
        f"the loss was non-finite {bad} steps in a row (steps {step - bad + 1}-{step}); the last good parameters "
        f"are checkpointed in {s.ckpt_path} (step {step + 1}). Lower the learning rates (optim.*_lr), set "
        f"optim.grad_clip, or check the data"
    )


def step_record(s: Session, result: StepResult, progress: Progress, step: int, bar: tqdm) -> dict[str, Any]:
    """A logged step's record: phase times, learning rates, throughput, and every loss term and metric, read
    back from the device in one transfer."""
    t0, t_data, t_fwd_bwd, t_optim = result.clock
    out, grad_norm = result.out, result.grad_norm
    norm = {"grad_norm": grad_norm} if grad_norm is not None else {}
    scalars = {"loss": result.loss, **out.losses, **out.metrics, **norm}
    values = dict(zip(scalars, torch.stack([t.detach().float() for t in scalars.values()]).tolist(), strict=True))
    now = time.perf_counter()
    step_ms = (now - t0) * 1e3
    if progress.first_step_ms is None:
        progress.first_step_ms = step_ms
    else:
        progress.step_ms.append(step_ms)
    tokens_per_step = s.cfg.train.batch_size * s.cfg.data.seq_len
    tok_s = progress.window_steps * tokens_per_step / (now - progress.window_start)
    progress.window_start, progress.window_steps = time.perf_counter(), 0
    mult = result.lr_mult
    bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
    return {
        "time/data_ms": (t_data - t0) * 1e3,
        "time/fwd_bwd_ms": (t_fwd_bwd - t_data) * 1e3,
        "time/optim_ms": (t_optim - t_fwd_bwd) * 1e3,
        **current_lrs(s.optimizers, mult),
        "train/loss": values["loss"],
        "train/skipped_steps": progress.skipped,
        "time/step_ms": step_ms,
        "train/tokens_per_s": tok_s,
        # The effective batch: tokens of text per optimizer step, and the contexts the base model reads for them.
        "train/tokens_per_step": tokens_per_step,
        "train/variants_per_step": s.cfg.train.batch_size * s.task.contexts_per_window(step),
        # Model FLOPs utilisation on a known GPU: FLOPs per step over the step's duration, per device.
        **({"train/mfu": progress.peak_step_s / (step_ms / 1e3)} if progress.peak_step_s else {}),
        "train/lr_mult": mult,
        # Loss terms and the grad norm go under train/; metrics keep their own names (mc/..., train/...).
        **{k if "/" in k else f"train/{k}": v for k, v in values.items() if k != "loss"},
    }


def write_lod_maps(s: Session, window: Tensor, step: int, bar: tqdm) -> None:
    """Sample 0's working contexts at this step, on the terminal and appended to ``lod_maps.txt``."""
    assert isinstance(s.task, MCTask)
    maps = s.task.lod_maps(window, step)
    text = f"step {step}: sample 0's working contexts ({LOD_LEGEND})\n"
    text += "".join(f"  {name:>9} {line}\n" for name, line in maps)
    bar.write(text.rstrip("\n"), file=sys.stderr)
    with (s.out_dir / LOD_MAPS_NAME).open("a") as f:
        f.write(text)
