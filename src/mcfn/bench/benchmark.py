"""The MegaContext step against the plain GPT step on the same packed entries, measured in one run.

* **MC step**: ``process_batch`` forward + backward on ``[B, T+1]`` windows with fresh variant noise.
* **Plain step**: the same base model, forward + backward over ``[B·V, W]`` token entries (the shape of
  the packed working contexts) with the next-token loss on exactly as many positions as the MC step
  supervises (its valid entries). ``ratio_mc_over_plain`` is therefore the price of MegaContext
  around the base model: the tree, the variants, the assembly and the losses.

Both are warmed up first (the first call compiles; ``compile_s`` is its time beyond a normal step),
then timed alternately, step by step, so drift on a shared machine hits both alike; medians are
reported. On CUDA each step is timed with CUDA events; on the CPU with ``perf_counter``.

**Phases** are the step's own stages (:mod:`mcfn.core.system`), found by running the step once with a
recorder in place of its stage calls; each is then compiled on its own (with the same mode) and run
forward + backward on the inputs the step gave it: ``tree_ms`` (token embedding and GistNet over the
eligible blocks), ``variants_ms`` (sampling and the allocator, no gradient), ``assemble_ms`` (gather into
``[B·V, W]``), ``base_ms`` (base model over the packed entries, per-entry NLL), ``losses_ms`` (variant
losses and metrics from the NLL), and with LensNet ``lens_fwd_ms`` and ``lens_loss_ms``. A stage added to
the step is timed without a change here. Inside the whole compiled step the phases fuse, so their sum
can differ from ``mc_step_ms``; ``glue_frac`` = (variants + assemble + losses) / MC step.
"""

from __future__ import annotations

import resource
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch._dynamo
from torch import Tensor

from mcfn.bench.lens import lens_forward_ms
from mcfn.bench.timing import Rig, Timer, compiled_frames, graph_breaks_seen, time_phases
from mcfn.config import RunConfig
from mcfn.core.flops import peak_flops, step_flops
from mcfn.core.model import GPT
from mcfn.core.outputs import StepOutput
from mcfn.core.system import MegaContext, build_contexts, process_batch
from mcfn.typecheck import checks


def run_benchmark(
    cfg: RunConfig,
    vocab: int,
    device: torch.device,
    steps: int,
    warmup: int,
    compile_mode: str | None,
    phase_steps: int = 5,
    progress: Callable[[str], None] = lambda line: None,
    lens_entries: int = 0,
) -> dict[str, Any]:
    """Measure as described in the module docstring; ``compile_mode=None`` runs eagerly. ``progress`` gets each
    figure as ``key=value`` pairs as soon as it is known (the step times, then LensNet's forward over
    ``lens_entries`` entries when that is not 0, then each phase), so a run cut short still leaves them."""
    rig = Rig.of(cfg, vocab, device, compile_mode)
    cfg, system, autocast, compile_fn, weights = rig.cfg, rig.system, rig.autocast, rig.compile_fn, rig.weights
    layout, B, mc_inputs = system.layout, cfg.train.batch_size, rig.mc_inputs

    with torch.no_grad():
        supervised = build_contexts(system, *mc_inputs())[0].valid  # [B·V, W]: the positions the MC step trains on

    def plain_inputs():
        tokens = torch.randint(0, vocab, (B * layout.V, layout.W + 1), device=device, generator=rig.generator)
        return tokens[:, :-1], torch.where(supervised, tokens[:, 1:], -1)  # -1: no target

    mc_step = rig.training_call(partial(compile_fn(process_batch), system, weights=weights))
    plain_step_ = rig.training_call(partial(compile_fn(plain_entries_step), system.base))

    with autocast:  # one eager step: what autograd keeps for the backward
        saved_mb = saved_activation_bytes(partial(process_batch, system, *mc_inputs(), weights))[0] / 2**20
    system.zero_grad(set_to_none=True)
    timer = Timer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed = time_alternately(mc_step, mc_inputs, plain_step_, plain_inputs, timer, warmup, steps)
    early = early_figures(cfg, system, timed, device)
    progress(key_values(early))
    lens = {}
    if lens_entries:  # before the phases: one compile, where the phases are seven
        lens = lens_forward_ms(cfg, vocab, device, lens_entries, timer, compile_fn, steps, warmup)
        progress(key_values(lens))
    bound = partial(process_batch, system, *mc_inputs(), weights)
    phases = {}
    if phase_steps:
        phases = time_phases(bound, system, compile_fn, timer, autocast, warmup, phase_steps, progress)
    shapes = {"B": B, "T": layout.T, "K": layout.K, "LODmax": layout.L, "W": layout.W, "H": layout.H, "N": layout.N,
              "V": layout.V, "vocab": vocab, "n_layer": cfg.model.n_layer, "n_embd": cfg.model.n_embd,
              "gist_width": cfg.aux_width}  # fmt: skip
    result = benchmark_result(timed, phases, shapes, device, compile_mode, int(supervised.sum()))
    return result | lens | {"mfu": early["mfu"], "saved_activations_mb": saved_mb}


def key_values(figures: dict[str, Any]) -> str:
    """A progress line: ``key=value`` pairs, floats to four significant figures."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())


def early_figures(cfg: RunConfig, system: MegaContext, timed: dict, device: torch.device) -> dict[str, Any]:
    """What the timed steps alone tell, reported before the phases compile: a benchmark cut short keeps these."""
    peak_mb = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None  # None off a known GPU
    mfu = step_flops(cfg, system) / peak / (timed["mc_ms"] / 1e3) if peak else None
    return {
        "mfu": mfu,
        "mc_step_ms": timed["mc_ms"],
        "plain_step_ms": timed["plain_ms"],
        "ratio_mc_over_plain": timed["mc_ms"] / timed["plain_ms"],
        "first_steps_s": timed["first_ms"] / 1e3,
        "recompiles": timed["recompiles"],
        "graph_breaks": graph_breaks_seen(),
        "peak_mem_mb": peak_mb,
    }


def saved_activation_bytes(step: Callable[[], StepOutput]) -> tuple[int, StepOutput]:
    """Bytes of the distinct storages autograd keeps for the backward of ``step()`` (run eagerly: a compiled
    graph hides them), and its output."""
    kept: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return sum(kept.values()), out


def time_alternately(mc_step, mc_inputs, plain_step, plain_inputs, timer: Timer, warmup: int, steps: int) -> dict:
    """Both steps warmed up (the first call compiles), then timed in turn, step by step, so drift on a shared
    machine hits both alike; the recompiles counted after warm-up."""
    first_mc = timer(mc_step, mc_inputs())
    first_plain = timer(plain_step, plain_inputs())
    for _ in range(warmup - 1):
        mc_step(mc_inputs())
        plain_step(plain_inputs())
    frames_after_warmup = compiled_frames()
    mc_ms, plain_ms = [], []
    for _ in range(steps):
        inputs, tokens = mc_inputs(), plain_inputs()
        mc_ms.append(timer(mc_step, inputs))
        plain_ms.append(timer(plain_step, tokens))
    return {
        "mc_ms": statistics.median(mc_ms),
        "plain_ms": statistics.median(plain_ms),
        "first_ms": first_mc + first_plain,
        "recompiles": compiled_frames() - frames_after_warmup,
        "steps": steps,
    }


def benchmark_result(
    timed: dict, phases: dict, shapes: dict, device: torch.device, compile_mode: str | None, supervised: int
) -> dict[str, Any]:
    mc_med, plain_med = timed["mc_ms"], timed["plain_ms"]
    glue = phases["variants_ms"] + phases["assemble_ms"] + phases["losses_ms"] if phases else float("nan")
    cuda = device.type == "cuda"
    # Peak memory in MB: the CUDA allocator's, or the process's resident set on the CPU.
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "compiled": compile_mode is not None,
        "compile_mode": compile_mode,
        "shapes": shapes,
        "steps_timed": timed["steps"],
        "mc_step_ms": mc_med,
        "plain_step_ms": plain_med,
        "ratio_mc_over_plain": mc_med / plain_med,
        "phases": phases,
        "glue_ms": glue,
        "glue_frac": glue / mc_med,
        "supervised_entries": supervised,
        # The first call of each step compiles; eager runs have nothing to report here.
        "compile_s": max(0.0, (timed["first_ms"] - mc_med - plain_med) / 1e3) if compile_mode else None,
        "graph_breaks": graph_breaks_seen(),
        "recompiles": timed["recompiles"],
        "peak_mem_mb": peak,
        "tokens_per_s": shapes["B"] * shapes["T"] / (mc_med / 1e3),
        "entries_per_s": shapes["B"] * shapes["V"] * shapes["W"] / (mc_med / 1e3),
    }


def plain_entries_step(model: GPT, tokens: Tensor, targets: Tensor) -> StepOutput:
    """The plain GPT's next-token loss, averaged over the positions with a target (``targets >= 0``)."""
    nll = model.nll(model.token_hidden(tokens), targets)
    return StepOutput({"loss_lm": nll.sum() / (targets >= 0).sum()}, {}, {})


def _seconds(value: float | None) -> str:
    return "n/a (eager)" if value is None else f"{value:.1f} s"


def format_table(result: dict[str, Any]) -> str:
    s = result["shapes"]
    lines = [
        f"device {result['device']}  compiled {result['compiled']} ({result['compile_mode']})  "
        f"B={s['B']} T={s['T']} K={s['K']} LODmax={s['LODmax']} W={s['W']} H={s['H']} N={s['N']} "
        f"D={s['n_embd']} layers={s['n_layer']} vocab={s['vocab']}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| MC step (fwd+bwd) | {result['mc_step_ms']:.1f} ms |",
        f"| plain step, same [B·V, W] entries | {result['plain_step_ms']:.1f} ms |",
        f"| **ratio MC / plain** | **{result['ratio_mc_over_plain']:.3f}** |",
    ]
    lines += [f"| phase {k.removesuffix('_ms')} | {v:.1f} ms |" for k, v in result["phases"].items()]
    lines += [
        f"| glue (variants + assemble + losses) | {result['glue_ms']:.1f} ms "
        f"= {100 * result['glue_frac']:.1f}% of MC step |",
        f"| compile | {_seconds(result['compile_s'])} |",
        f"| graph breaks / recompiles | {result['graph_breaks']} / {result['recompiles']} |",
        f"| peak memory | {result['peak_mem_mb']:.0f} MB |",
        f"| saved for backward (eager step) | {result['saved_activations_mb']:.0f} MB |",
        f"| tokens/s (history) | {result['tokens_per_s']:,.0f} |",
    ]
    if result.get("mfu") is not None:
        lines.append(f"| MFU (MC step, bf16 peak) | {result['mfu']:.3f} |")
    if result.get("lens_fwd_long_ms") is not None:
        lines.append(f"| LensNet forward, {result['lens_entries']} entries | {result['lens_fwd_long_ms']:.2f} ms |")
    return "\n".join(lines)


def typecheck_cost(
    cfg: RunConfig, vocab: int, device: torch.device, steps: int, evaluate_batch: Callable[[MegaContext, Tensor], None]
) -> dict[str, float]:
    """What the eager runtime shape checks cost: an eager training step (forward + backward, LensNet live) and
    ``evaluate_batch``, the held-out evaluation of one batch (``train.bench`` hands it in: the benchmarks do not import
    the evaluation), each timed with the checks on and off in turn, medians of ``steps``."""
    rig = Rig.of(cfg, vocab, device, None)
    system, (window, noise) = rig.system, rig.mc_inputs()
    step = partial(rig.training_call(process_batch), (system, window, noise, rig.weights))
    evaluation = partial(evaluate_batch, system, window)

    timer, out = Timer(device), {}
    for name, fn in (("step", step), ("eval", evaluation)):
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(steps + 1):  # the first pair warms up
            for enabled in (True, False):
                with checks(enabled):
                    times[enabled].append(timer(fn))
        on, off = (statistics.median(times[e][1:]) for e in (True, False))
        out |= {f"{name}_ms_checked": on, f"{name}_ms_unchecked": off, f"{name}_overhead": on / off - 1}
    return out
