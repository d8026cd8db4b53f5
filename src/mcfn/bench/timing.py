"""What every timing of a training step shares (:mod:`mcfn.bench.benchmark`, :mod:`mcfn.bench.sweep`): a wall or
CUDA-event timer, the compile counters, a :class:`Rig` that builds a fresh system with its random inputs, and the
step's phases, each compiled and timed on its own.

**Phases** are the step's own stages (:mod:`mcfn.core.system`), found by running the step once with a recorder in
place of its stage calls; each is then compiled on its own (with the same mode) and run forward + backward on the
inputs the step gave it. A stage added to the step is timed without a change here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch._dynamo
from tensordict import TensorDictBase, is_tensorclass
from torch import Tensor

from mcfn.config import RunConfig
from mcfn.core.outputs import StepOutput
from mcfn.core.step import compile_step
from mcfn.core.system import MegaContext
from mcfn.core.timing_hook import recording
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights


class Timer:
    """Milliseconds of a callable, synchronised properly for the device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[..., Any], *args: Any) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t0) * 1e3


def graph_breaks_seen() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def compiled_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


@dataclasses.dataclass
class Rig:
    """What every timing of a step sets up (this benchmark, the sweep's points): a fresh MegaContext of the config
    with the tokenizer's vocabulary on ``device``, random inputs from one seeded generator, the autocast and the
    compile wrapper (``compile_mode`` None: eager)."""

    cfg: RunConfig
    system: MegaContext
    generator: torch.Generator
    autocast: torch.autocast
    compile_fn: Callable[[Callable], Callable]
    weights: LossWeights
    device: torch.device

    @classmethod
    def of(cls, cfg: RunConfig, vocab: int, device: torch.device, compile_mode: str | None) -> Rig:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
        torch.manual_seed(cfg.train.seed)
        system = MegaContext(cfg).to(device)
        return cls(
            cfg,
            system,
            torch.Generator(device=device).manual_seed(cfg.train.seed),
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"),
            partial(compile_step, mode=compile_mode) if compile_mode else (lambda f: f),
            LossWeights.of(cfg.mc, device),
            device,
        )

    def windows(self) -> Tensor:
        """``[B, T + 1]`` random token ids."""
        layout, vocab = self.system.layout, self.cfg.model.vocab_size
        shape = (self.cfg.train.batch_size, layout.T + 1)
        return torch.randint(0, vocab, shape, device=self.device, generator=self.generator)

    def mc_inputs(self) -> tuple:
        """A batch of windows and its variant noise, what ``process_batch`` takes after the system."""
        B, layout = self.cfg.train.batch_size, self.system.layout
        return self.windows(), draw_variant_noise(layout, B, self.generator, self.device, self.cfg.mc.alloc.iterations)

    def training_call(self, fn: Callable[..., StepOutput]) -> Callable[[tuple], None]:
        """One training step of ``fn`` on its arguments: forward under the autocast, backward, gradients dropped."""

        def step(args: tuple) -> None:
            with self.autocast:
                out = fn(*args)
            out.total().backward()
            self.system.zero_grad(set_to_none=True)

        return step


class StageRecorder:
    """Installed with :func:`mcfn.core.timing_hook.recording`: calls each stage and records its name, function and
    inputs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Callable, tuple]] = []

    def __call__(self, name: str, fn: Callable, *args: Any) -> Any:
        self.calls.append((name, fn, args))
        return fn(*args)


def _leaf(x: Any) -> Any:
    """An input cut off from the step that made it; what carried a gradient there carries one here."""
    if isinstance(x, Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    if is_tensorclass(x) or isinstance(x, TensorDictBase):
        return x.apply(lambda t: t.detach().requires_grad_(t.requires_grad))
    return x


def _backward_scalar(out: Any) -> Tensor | None:
    """A scalar to backpropagate from a stage's output: the loss of a StepOutput, the mean square of any
    tensor that carries a gradient; None when nothing does (the variants)."""
    if isinstance(out, StepOutput):
        return out.total()
    if isinstance(out, tuple):
        parts = [p for p in map(_backward_scalar, out) if p is not None]
        return sum(parts) if parts else None
    if is_tensorclass(out) or isinstance(out, TensorDictBase):
        return _backward_scalar(tuple(out.to_tensordict().values()))
    if isinstance(out, Tensor) and out.requires_grad:
        return out.float().square().mean()
    return None


def time_phases(
    step: Callable,
    system: MegaContext,
    compile_fn,
    timer: Timer,
    autocast,
    warmup: int,
    steps: int,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, float]:
    """Median forward + backward milliseconds of each stage of ``step`` (a step with its inputs bound), each
    passed to ``progress`` as ``NAME_ms=VALUE`` as soon as it is timed."""
    recorder = StageRecorder()
    with autocast, recording(recorder):
        step()
    system.zero_grad(set_to_none=True)
    phases = {}
    for name, fn, args in recorder.calls:
        compiled, leaves = compile_fn(fn), tuple(_leaf(a) for a in args)

        def run_stage(compiled=compiled, leaves=leaves):
            with autocast:
                out = compiled(*leaves)
            loss = _backward_scalar(out)
            if loss is not None:
                loss.backward()

        for _ in range(warmup):
            run_stage()
        phases[f"{name}_ms"] = statistics.median(timer(run_stage) for _ in range(steps))
        progress(f"{name}_ms={phases[f'{name}_ms']:.3f}")
        system.zero_grad(set_to_none=True)
    return phases
