"""How a training step's cost grows with the history ``T``: ``python -m train.bench --sweep-T 512,1024,...``.

At the profile's ``W``, for each ``T`` and each condition:

* ``plain``: the plain GPT's step over the whole window, ``[B, T]`` tokens with full attention;
* ``mc``: the MegaContext step (LensNet's loss live) with the full-window teacher off;
* ``mc_teacher``: with the profile's teacher and its attention target on (the long-range recipe; over all ``T``
  tokens unless the profile or a ``--set`` bounds it);
* ``mc_bounded``: with the teacher bounded: every token reads the ``S`` tokens up to itself, the tail reads all of
  them (``mc.teacher.window``, the bound that kept the headline numbers at T = 512);
* ``mc_sparse``: ``mc`` with GistNet's gradient bounded to ``G`` blocks a level (``mc.gist.grad_blocks``), so
  that nothing but the tree's gradient-free forward grows with ``T``.

Each point is compiled (``fullgraph=True, dynamic=False``), warmed up, and timed over several steps (the median);
it reports history tokens per second (``B·T`` over the step time), peak memory, and for the MC steps the share of
the tree build, LensNet (forward and loss) and the teacher, each stage timed on its own as in
:mod:`mcfn.bench.benchmark`. The tree's depth grows with ``T``: each ``T`` takes the profile's ``mc.lod_max`` or
the smallest deeper one whose coarsest cover leaves at least half of the budget beyond the tail free.

Each point runs in a process of its own, so its peak memory is its own (the resident set on the CPU, the
allocator's peak on CUDA), and a point that runs out of memory or past ``cap_s`` seconds is reported as such
while the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mcfn.bench.timing import Rig, Timer, compiled_frames, graph_breaks_seen, time_phases
from mcfn.config import RunConfig
from mcfn.core.reconstruction import RECON_TOKENS
from mcfn.core.step import plain_step
from mcfn.core.system import MegaContext, process_batch
from mcfn.errors import UserError
from mcfn.geometry import coarsest_cover_size

CONDITIONS = ("plain", "mc", "mc_teacher", "mc_bounded", "mc_sparse")
SHARES = {"tree": ("tree_ms",), "lens": ("lens_fwd_ms", "lens_loss_ms"), "teacher": ("teacher_ms",)}


def sweep_lod_max(T: int, cfg: RunConfig) -> int:
    """The profile's ``mc.lod_max``, or the smallest deeper one whose coarsest cover at ``T`` leaves at least half
    of the budget beyond the tail free (and divides ``T``)."""
    mc = cfg.mc
    for L in range(mc.lod_max, 12):
        cover = coarsest_cover_size(T, mc.block_size, L, mc.tail)
        if T % mc.block_size**L == 0 and cover - mc.tail <= (mc.budget - mc.tail) // 2:
            return L
    raise UserError(f"no tree depth fits T={T} into mc.budget={mc.budget} with room to spare")


def point_config(cfg: RunConfig, T: int, condition: str, window: int, grad_blocks: int) -> RunConfig:
    """The config of one point: ``T`` tokens, its tree depth, the teacher and GistNet's gradient as the condition
    has them."""
    mc = cfg.mc
    full, attention = (0.0, 0.0) if condition in ("plain", "mc", "mc_sparse") else (1.0, 1.0)
    bound = window if condition == "mc_bounded" else mc.teacher.window
    teacher = dataclasses.replace(mc.teacher, full_weight=full, window=bound)
    gist = dataclasses.replace(mc.gist, grad_blocks=grad_blocks) if condition == "mc_sparse" else mc.gist
    mc = dataclasses.replace(
        mc,
        lod_max=sweep_lod_max(T, cfg),
        teacher=teacher,
        gist=gist,
        lens=dataclasses.replace(mc.lens, attention_weight=attention),
    )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=T), mc=mc)


def measure_point(
    cfg: RunConfig, condition: str, vocab: int, device: torch.device, steps: int, warmup: int, mode: str | None
) -> dict[str, Any]:
    """One point, measured in this process (the sweep runs each in a process of its own)."""
    rig = Rig.of(cfg, vocab, device, mode)
    cfg, system, compile_fn = rig.cfg, rig.system, rig.compile_fn
    layout, B, autocast = system.layout, cfg.train.batch_size, rig.autocast

    def inputs() -> tuple:
        return (system.base, rig.windows()) if condition == "plain" else (system, *rig.mc_inputs(), rig.weights)

    step = rig.training_call(compile_fn(plain_step if condition == "plain" else process_batch))
    timer = Timer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, step_ms, recompiles = warm_and_time(step, inputs, timer, warmup, steps)
    shares = {}
    if condition != "plain":
        phases = time_phases(partial(process_batch, *inputs()), system, compile_fn, timer, autocast, 1, 2)
        shares = {**stage_shares(phases, step_ms), "phases_ms": phases}
    timing = {"step_ms": step_ms, "tokens_per_s": B * layout.T / (step_ms / 1e3), "peak_mem_mb": peak_memory_mb(device),
              "compile_s": max(0.0, (first - step_ms) / 1e3) if mode else 0.0, "graph_breaks": graph_breaks_seen(),
              "recompiles": recompiles}  # fmt: skip
    return {"T": layout.T, "condition": condition, "status": "ok", **timing, **point_shape(cfg, system, condition),
            **shares}  # fmt: skip


def point_shape(cfg: RunConfig, system: MegaContext, condition: str) -> dict[str, Any]:
    """What a point measured beside ``T``: the tree's depth and size, and the bounds on the teacher, the
    reconstruction and GistNet's gradient."""
    plain, mc = condition == "plain", cfg.mc
    return {
        "lod_max": system.layout.L,
        "n_nodes": system.layout.n_nodes,
        "teacher_tokens": system.layout.T if mc.teacher.enabled else 0,
        "teacher_window": mc.teacher.window,
        # None: no reconstruction (the plain step never has one)
        "recon_tokens": RECON_TOKENS if mc.gist.recon_weight > 0 and not plain else None,
        "grad_blocks": None if plain else system.grad_blocks,  # 0: the exact backward (or no bite)
    }


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak: the CUDA allocator's, or on the CPU the resident set's (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def warm_and_time(step: Callable, inputs: Callable, timer: Timer, warmup: int, steps: int) -> tuple[float, float, int]:
    """The first call's milliseconds (it compiles), the median of ``steps`` after ``warmup``, and the recompiles."""
    first = timer(step, inputs())
    for _ in range(warmup - 1):
        step(inputs())
    frames = compiled_frames()
    step_ms = statistics.median(timer(step, inputs()) for _ in range(steps))
    return first, step_ms, compiled_frames() - frames


def stage_shares(phases: dict[str, float], step_ms: float) -> dict[str, float]:
    """The tree's, LensNet's and the teacher's share of a step, from its stages timed on their own."""
    return {f"{name}_share": sum(phases.get(k, 0.0) for k in keys) / step_ms for name, keys in SHARES.items()}


def run_sweep(
    profile: str,
    overrides: list[str],
    lengths: list[int],
    window: int,
    steps: int,
    warmup: int,
    eager: bool,
    cap_s: float,
    progress: Callable[[str], None] = lambda line: None,
    conditions: tuple[str, ...] = CONDITIONS,
    warm_first: bool = False,
    *,
    grad_blocks: int,
    device: str = "auto",
) -> list[dict[str, Any]]:
    """Every (T, condition) point, each in a process of its own (``train.bench --sweep-point``). With
    ``warm_first`` every point is first compiled at once, each in its own process with one compile thread, to
    fill the inductor caches the timed points then hit: on a many-core host with a short lease the compiles
    overlap instead of queueing (their timings are thrown away). ``device``: where each point runs (``--device``)."""
    points = [(T, condition) for T in lengths for condition in conditions]

    def command(T: int, condition: str, timed: bool) -> list[str]:
        spec = {"profile": profile, "overrides": overrides, "T": T, "condition": condition, "window": window,
                "grad_blocks": grad_blocks, "steps": steps if timed else 1, "warmup": warmup if timed else 1,
                "eager": eager, "device": device}  # fmt: skip
        return [sys.executable, "-m", "train.bench", "--sweep-point", json.dumps(spec)]

    if warm_first:
        progress(f"warm: {warm_caches([command(T, c, False) for T, c in points], cap_s)} of {len(points)} compiled")
    rows = []
    for T, condition in points:
        try:
            done = subprocess.run(command(T, condition, True), capture_output=True, text=True, timeout=cap_s)
            row = point_outcome(done, T, condition)
        except subprocess.TimeoutExpired:
            row = {"T": T, "condition": condition, "status": f"over the {cap_s:g} s cap"}
        progress(format_row(row))
        rows.append(row)
    return rows


def warm_caches(commands: list[list[str]], cap_s: float) -> int:
    """Run every command at once, one compile thread each, and wait up to ``cap_s`` seconds in all; how many
    finished cleanly (those still running then are killed: the timed pass compiles what they had not)."""
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for c in commands]
    deadline, finished = time.monotonic() + cap_s, 0
    for process in running:
        try:
            finished += process.wait(timeout=max(0.0, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return finished


def point_outcome(done: subprocess.CompletedProcess, T: int, condition: str) -> dict[str, Any]:
    """A point's row from its process: its JSON, or why there is none."""
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    err = done.stderr.strip().splitlines()
    memory = done.returncode in (-9, 137) or any("out of memory" in line.lower() for line in err[-5:])
    status = "out of memory" if memory else f"failed: {err[-1] if err else done.returncode}"
    return {"T": T, "condition": condition, "status": status}


def format_row(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"T={row['T']:>6} {row['condition']:<11} {row['status']}"
    shares = " ".join(f"{k.removesuffix('_share')} {row[k]:.0%}" for k in row if k.endswith("_share"))
    return (
        f"T={row['T']:>6} {row['condition']:<11} {row['step_ms']:9.1f} ms  {row['tokens_per_s']:10,.0f} tok/s  "
        f"{row['peak_mem_mb']:8.0f} MB  L={row['lod_max']}  {shares}"
    )


def format_sweep_table(rows: list[dict[str, Any]]) -> str:
    """One Markdown row per ``T``: each condition's step time and history tokens per second, and MC's ratios."""
    by_t: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_t.setdefault(row["T"], {})[row["condition"]] = row
    head = "| T | L | " + " | ".join(f"{c} ms (tok/s, MB)" for c in CONDITIONS) + " | bounded / plain tok/s |"
    lines = [head, "|" + "---:|" * (len(CONDITIONS) + 3)]
    for T, cells in sorted(by_t.items()):
        ok = {c: r for c, r in cells.items() if r["status"] == "ok"}
        L = next((r["lod_max"] for r in ok.values() if r["condition"] != "plain"), "")
        shown = [
            f"{ok[c]['step_ms']:.0f} ({ok[c]['tokens_per_s']:,.0f}, {ok[c]['peak_mem_mb']:.0f})" if c in ok
            else cells.get(c, {}).get("status", "–")
            for c in CONDITIONS
        ]  # fmt: skip
        ratio = (
            f"{ok['mc_bounded']['tokens_per_s'] / ok['plain']['tokens_per_s']:.2f}"
            if "mc_bounded" in ok and "plain" in ok
            else "–"
        )
        lines.append(f"| {T} | {L} | " + " | ".join(shown) + f" | {ratio} |")
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    """History tokens per second and peak memory against ``T``, log axes, one line per condition."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    for condition in CONDITIONS:
        ok = sorted((r for r in rows if r["condition"] == condition and r["status"] == "ok"), key=lambda r: r["T"])
        if ok:
            Ts = [r["T"] for r in ok]
            speed.plot(Ts, [r["tokens_per_s"] for r in ok], "o-", label=condition)
            memory.plot(Ts, [r["peak_mem_mb"] for r in ok], "o-", label=condition)
    for ax, label in ((speed, "history tokens / s (B·T / step)"), (memory, "peak memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("history T (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle("Training step cost against the history's length")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
