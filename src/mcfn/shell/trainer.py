"""The trainer: one object that runs a training run over a :class:`~mcfn.shell.session.Session`.

Its state is everything the run holds while it loops: the session (data, task, optimizers, log), the
``progress`` it counts, the progress bar, the stop flag a signal sets, the batch prefetcher, the memory
history and the compile cache. Its methods are the run's steps, as torchtitan splits them:
:meth:`Trainer.forward_backward` (one batch, in micro-batches), :meth:`Trainer.optimizer_step` (one update) and
:meth:`Trainer.train` (validate, checkpoint, step, log, stop, until ``train.steps``).

The trainer reads tensors back from the step only at log and eval steps; everything between is device work.
Step ``s`` (0-based) trains on batch ``s`` with the parameters after ``s`` updates; its record in
``metrics.jsonl`` carries that step's loss, and the validation bits-per-byte of the same parameters when
it is an evaluation step (step 0, every ``eval_every``, and the end, ``step == steps``).

A process's share of the global batch runs as ``local / micro`` micro-batches of one fixed shape (one
compiled graph). Each micro-batch's loss is scaled by its share of the rows, so the accumulated gradient
is the gradient of the mean over the process's rows, whatever the micro-batch size.
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
from mcfn.core.flops import peak_flops, step_flops
from mcfn.core.outputs import StepOutput
from mcfn.core.system import MegaContext
from mcfn.data.corpus import cache_root
from mcfn.data.loader import Prefetcher
from mcfn.errors import RunAborted
from mcfn.evaluation.evaluate import probe_accuracy
from mcfn.shell.compile_cache import CompileCache, artifacts_path
from mcfn.shell.devices import resolve_device
from mcfn.shell.distributed import average_gradients, init_world, shutdown
from mcfn.shell.memory import SNAPSHOT_STEPS, MemoryHistory, check_memory_snapshot
from mcfn.shell.microbatch import check_micro_batch, fitting_micro_batch, out_of_memory_message
from mcfn.shell.optim import clip_gradients, current_lrs, lr_multiplier, set_lr_multiplier, skip_if_non_finite
from mcfn.shell.outcome import LOD_MAPS_NAME, finish, records_at_end
from mcfn.shell.session import Progress, Session, open_session, save_state, session_state
from mcfn.shell.stopping import StopRequest
from mcfn.shell.tasks import MCTask

LOD_LEGEND = "a character per block of K tokens: 0 tokens, 1 and up gists, · not covered"

MAX_BAD_STEPS = 3  # non-finite losses in a row that stop the run (each one skips its update)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def train(
    cfg: RunConfig,
    out_dir: Path,
    resume: bool = False,
    device_name: str = "auto",
    memory_snapshot: str = "",
    stop_after: int = 0,
) -> dict[str, Any]:
    """Train as configured, writing metrics, checkpoints, ``summary.json`` and the report to ``out_dir``, on the
    device ``device_name`` (auto | cpu | cuda | cuda:N); ``memory_snapshot``: a file (in ``out_dir`` unless
    absolute) for CUDA's memory history over the first steps (:mod:`mcfn.shell.memory`), empty: none;
    ``stop_after``: a step at which to checkpoint and stop, under the schedule of ``train.steps`` (0: none), e.g.
    a plain phase's end, to branch MC variants from (:mod:`mcfn.shell.init_from`)."""
    t_start = time.perf_counter()
    device = resolve_device(device_name)
    check_memory_snapshot(memory_snapshot, device)
    world = init_world(device.type)
    if world.size > 1 and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    try:
        session = open_session(cfg, out_dir, resume, device, world)
        trainer = Trainer(session, memory_snapshot, stop_after)
        return finish(session, trainer.train(), t_start, say, trainer.trained)
    finally:
        shutdown(world)


@dataclass
class StepResult:
    loss: Tensor
    out: StepOutput
    grad_norm: Tensor
    grad_norm_lens: Tensor
    stop_requested: bool  # by a signal, on any rank
    window: Tensor  # this process's rows of the batch
    lr_mult: float
    clock: list[float]  # perf_counter before the data, after it, after forward+backward, after the update


class Trainer:
    """A training run in progress (see the module docstring)."""

    def __init__(self, session: Session, memory_snapshot: str = "", stop_after: int = 0):
        s = self.s = session
        self.stop_after = stop_after
        cfg = s.cfg.train
        announce(s)
        self.progress = Progress(micro=self.choose_micro_batch(), peak_step_s=peak_step_seconds(s))
        self.prefetch = Prefetcher(s.sampler, cfg.batch_size, s.start_step, s.device, rows=s.rows)
        self.bar = tqdm(total=cfg.steps, initial=s.start_step, desc="train", unit="step", dynamic_ncols=True,
                        mininterval=0.5, file=sys.stderr, disable=not s.world.is_main)  # fmt: skip
        self.stop = StopRequest()
        snapshot = memory_snapshot and s.world.is_main
        self.history = MemoryHistory(s.out_dir / memory_snapshot if snapshot else None, SNAPSHOT_STEPS)
        self.compile_cache = open_compile_cache(s)
        self.unread_flags: list[tuple[int, Tensor]] = []  # (step, its update was skipped): read at logged steps
        # The state after the last step, where the run's end records something (the stage, the ship choice): the end
        # writes the checkpoint once, with them in it (mcfn.shell.outcome.finish), from this.
        self.trained: dict[str, Any] | None = None

    def train(self) -> Progress:
        """Evaluate, checkpoint, train, log, stop: one global step at a time until ``train.steps``."""
        s, cfg, progress = self.s, self.s.cfg.train, self.progress
        try:
            self.stop.install()
            for step in range(s.start_step, cfg.steps + 1):
                record: dict[str, Any] = {"step": step}
                last = step == cfg.steps
                validating = step % cfg.eval_every == 0 or last  # then a checkpoint, past the step it started at
                if validating and s.world.is_main:
                    record.update(self.validate(step))
                saved = validating and step > s.start_step
                if last and records_at_end(s) and s.world.is_main:  # the run's end writes it, with what it records
                    self.trained = session_state(s, step)
                elif saved:
                    save_state(s, step)
                if self.stop_after and step == self.stop_after and not last:  # --stop-after: checkpoint, leave
                    if not saved:
                        save_state(s, step)
                    progress.stopped_at, progress.stopped_by = step, "--stop-after"
                    s.log.log(record)
                    break
                if last:
                    s.log.log(record)
                    break
                logged = step % cfg.log_every == 0 or step == cfg.steps - 1
                result = self.optimizer_step(step, logged)
                if logged or result.stop_requested:
                    self.account_skips(step)
                if logged:
                    record.update(self.step_record(result, step))
                    record["time/log_ms"] = (time.perf_counter() - result.clock[-1]) * 1e3  # read-backs, formatting
                if s.world.is_main and (step % cfg.eval_every == 0 or step == cfg.steps - 1):
                    self.write_lod_maps(result.window, step)  # and after the last step: the report shows it
                self.bar.update(1)
                if self.compile_cache is not None and s.world.is_main:
                    self.compile_cache.save_if_new()
                if message := self.history.step_done():
                    self.bar.write(message, file=sys.stderr)
                if len(record) > 1:
                    s.log.log(record, result.out.histograms if logged else None)
                if result.stop_requested:  # finish the step, checkpoint it, and leave
                    progress.stopped_at, progress.stopped_by = step + 1, self.stop.name or "another process's signal"
                    save_state(s, progress.stopped_at)
                    break
        finally:
            self.close()
        return progress

    def close(self) -> None:
        if message := self.history.close():
            say(message)
        self.stop.restore()
        self.bar.close()
        self.prefetch.close()
        self.s.log.close()

    def forward_backward(self, window: Tensor, step: int, micro: int | None = None) -> tuple[Tensor, StepOutput]:
        """Backpropagate the mean loss over ``window`` (this process's rows of the global batch) in micro-batches
        of ``micro`` rows (default: the run's); returns the loss and the step's output, detached: loss terms and
        metrics averaged over micro-batches, histograms from the last one."""
        s = self.s
        micro = micro or self.progress.micro
        local, first_row = window.size(0), s.rows.start
        share = micro / local  # each micro-batch's part of the mean over the rows
        loss_sum: Tensor | float = 0.0
        scalars: list[dict[str, Tensor]] = []
        for lo in range(0, local, micro):
            # Compiled with CUDA graphs, a step's outputs live in buffers the next replay overwrites: mark each
            # micro-batch as a new step, and keep only fresh tensors (sums, clones) from it.
            torch.compiler.cudagraph_mark_step_begin()
            with s.autocast():
                out = s.task.train_step(window[lo : lo + micro], step, slice(first_row + lo, first_row + lo + micro))
            loss = out.total() * share
            loss.backward()
            loss_sum = loss_sum + loss.detach()
            scalars.append({k: v.detach() * share for k, v in (*out.losses.items(), *out.metrics.items())})
        assert isinstance(loss_sum, Tensor)  # at least one micro-batch ran
        mean = {k: sum(part[k] for part in scalars) for k in scalars[0]}
        histograms = {k: v.detach().clone() for k, v in out.histograms.items()}
        return loss_sum, StepOutput({k: mean[k] for k in out.losses}, {k: mean[k] for k in out.metrics}, histograms)

    def optimizer_step(self, step: int, logged: bool) -> StepResult:
        """One update: forward and backward over the micro-batches, the all-reduce, clipping, and the optimizers
        (a no-op where the loss or gradient is non-finite). Phase times are taken on logged steps only
        (synchronising the device there, never elsewhere)."""
        s = self.s
        mult = lr_multiplier(step, s.cfg.train.steps, s.cfg.optim)
        set_lr_multiplier(s.optimizers, mult)
        times = [clock(s, logged)]
        window = self.prefetch.next()
        times.append(clock(s, logged))
        try:
            loss, out = self.forward_backward(window, step)
        except torch.OutOfMemoryError:
            raise RunAborted(out_of_memory_message(self.progress.micro)) from None
        # With several processes: the mean gradient and loss, and whether any rank was signalled.
        signalled = self.stop.signum is not None
        loss, stop_requested = average_gradients(list(s.model.parameters()), loss, signalled, s.world)
        times.append(clock(s, logged))
        grad_norm, lens_norm = clip_gradients(s.model)
        # A non-finite loss or gradient makes the update a no-op on the device: no host sync here. The flag is
        # read back with the next logged step's metrics (account_skips).
        self.unread_flags.append((step, skip_if_non_finite(s.optimizers, loss, grad_norm)))
        for opt in s.optimizers:
            opt.step()
        s.model.zero_grad(set_to_none=True)
        self.progress.window_steps += 1
        times.append(clock(s, logged))
        return StepResult(loss, out, grad_norm, lens_norm, stop_requested, window, mult, times)

    def account_skips(self, step: int) -> None:
        """Read back the non-finite flags of the steps since the last call (one transfer) and count the skipped
        updates; after :data:`MAX_BAD_STEPS` in a row, checkpoint (skipped updates changed nothing: these are the
        last good parameters) and stop. Called at logged steps and before a signal's stop, so a run of bad steps
        is seen within ``train.log_every`` steps."""
        s, progress = self.s, self.progress
        if not self.unread_flags:
            return
        steps, flags = zip(*self.unread_flags, strict=True)
        self.unread_flags.clear()
        for bad_step, bad in zip(steps, torch.stack(flags).tolist(), strict=True):
            progress.bad_in_a_row = progress.bad_in_a_row + 1 if bad else 0
            if not bad:
                continue
            progress.skipped += 1
            self.bar.write(f"step {bad_step:5d} | non-finite loss: update skipped ({progress.skipped} so far)",
                           file=sys.stderr)  # fmt: skip
            if (run := progress.bad_in_a_row) >= MAX_BAD_STEPS:
                save_state(s, step + 1)
                s.log.log({"step": step, "train/skipped_steps": progress.skipped})
                raise RunAborted(
                    f"the loss was non-finite {run} steps in a row (steps {bad_step - run + 1}-{bad_step}); the last "
                    f"good parameters are checkpointed in {s.ckpt_path} (step {step + 1}). Lower the learning rates "
                    f"(optim.*_lr) or check the data"
                )

    def validate(self, step: int) -> dict[str, float]:
        """Validation bits per byte of the current parameters, shown on the bar and returned for the record with
        the time it took."""
        s, progress = self.s, self.progress
        s.model.eval()
        t0 = time.perf_counter()
        with s.autocast(), torch.no_grad():
            result = s.task.validate(s.val_batches)
            base = s.model.base if isinstance(s.model, MegaContext) else s.model
            passkey = probe_accuracy(base, s.val_batches, s.corpus.tokenizer, s.cfg.mc.tail)
        if passkey is not None:  # when retrieval forms: the pass key answered reading the whole window
            result["probe/passkey_full"] = passkey
        s.model.train()
        progress.eval_s.append(time.perf_counter() - t0)
        progress.last_bpb = result["val/bpb"]
        progress.first_bpb = progress.last_bpb if progress.first_bpb is None else progress.first_bpb
        shown = " | ".join(f"{k.removeprefix('val/')} {v:.4f}" for k, v in result.items())
        self.bar.write(f"step {step:5d} | {shown}", file=sys.stderr)
        return {**result, "time/val_s": progress.eval_s[-1]}

    def step_record(self, result: StepResult, step: int) -> dict[str, Any]:
        """A logged step's record: phase times, learning rates, throughput, and every loss term and metric, read
        back from the device in one transfer."""
        s, progress = self.s, self.progress
        t0, t_data, t_fwd_bwd, t_optim = result.clock
        norm = {"grad_norm": result.grad_norm, "grad_norm_lens": result.grad_norm_lens}
        scalars = {"loss": result.loss, **result.out.losses, **result.out.metrics, **norm}
        values = dict(zip(scalars, torch.stack([t.detach().float() for t in scalars.values()]).tolist(), strict=True))
        now = time.perf_counter()
        step_ms = (t_optim - t0) * 1e3  # data, forward + backward, update: logging is time/log_ms
        if progress.first_step_ms is None:
            progress.first_step_ms = step_ms
        else:
            progress.step_ms.append(step_ms)
        tokens_per_step = s.cfg.train.batch_size * s.cfg.data.seq_len
        tok_s = progress.window_steps * tokens_per_step / (now - progress.window_start)
        progress.window_start, progress.window_steps = time.perf_counter(), 0
        mult = result.lr_mult
        self.bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
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

    def write_lod_maps(self, window: Tensor, step: int) -> None:
        """Sample 0's working contexts at this step (MC runs), on the terminal and appended to ``lod_maps.txt``."""
        if not isinstance(self.s.task, MCTask):
            return
        maps = self.s.task.lod_maps(window, step)
        text = f"step {step}: sample 0's working contexts ({LOD_LEGEND})\n"
        text += "".join(f"  {name:>9} {line}\n" for name, line in maps)
        self.bar.write(text.rstrip("\n"), file=sys.stderr)
        with (self.s.out_dir / LOD_MAPS_NAME).open("a") as f:
            f.write(text)

    def choose_micro_batch(self) -> int:
        """``train.micro_batch_size``, or when it is 0: the whole local batch off GPU, else the largest that fits."""
        s = self.s
        local = s.rows.stop - s.rows.start
        if s.cfg.train.micro_batch_size:
            return check_micro_batch(s.cfg.train.micro_batch_size, local)
        if s.device.type != "cuda":
            return local
        probe = s.sampler.batch(s.start_step, s.cfg.train.batch_size)[s.rows].to(s.device)

        def try_step(micro: int) -> None:
            try:
                self.forward_backward(probe, s.start_step, micro)
            finally:
                s.model.zero_grad(set_to_none=True)

        micro = fitting_micro_batch(try_step, local)
        say(f"[run] micro-batch {micro} of {local} rows: the largest that fits")
        return micro


def open_compile_cache(s: Session) -> CompileCache | None:
    """Compiled runs hot-load torch's portable compile cache from beside the token cache (and keep it there)."""
    if not s.cfg.train.compile:
        return None
    cache = CompileCache(artifacts_path(s.cfg, cache_root() / s.corpus.key, s.device))
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
    branched = cfg.train.init_from and not s.resumed and s.start_step == cfg.train.plain_steps > 0
    if s.task.mode == "mc" and cfg.train.plain_steps and not branched:
        say(f"[run] plain phase: steps 0-{cfg.train.plain_steps - 1} train the base model alone on whole windows")
    if branched:
        say(f"[run] branched from {cfg.train.init_from}'s plain phase: the MegaContext phase from step {s.start_step}")
    elif cfg.train.init_from and not s.resumed:
        say(f"[run] base model initialised from {cfg.train.init_from}")


def peak_step_seconds(s: Session) -> float | None:
    """How long a step would take at the peak FLOP/s of every device (MFU = this / the step time); None off a known
    GPU. Computed once per run."""
    peak = peak_flops(torch.cuda.get_device_name(s.device)) if s.device.type == "cuda" else None
    return step_flops(s.cfg, s.model) / (peak * s.world.size) if peak else None


def clock(s: Session, sync: bool) -> float:
    """``perf_counter``, after the device's queued work when ``sync`` (so a phase's time is its own)."""
    if sync and s.device.type == "cuda":
        torch.cuda.synchronize(s.device)
    return time.perf_counter()
