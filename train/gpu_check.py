"""The GPU check: every GPU measurement in one call, each under its own time cap, within one budget.

``scripts/gpu_check.sh`` runs this (``python -m train.gpu_check --out DIR``). In order, each step a process of its
own (their commands: ``train.gpu_steps``), its output appended to ``DIR/gpu_check.log``; the step figures come
first, since a lease is short:

1. ``bench``: ``train.bench --profile gpu-h100`` (B = 8) compiled with ``default``: MC and plain step (forward +
   backward), their ratio, the MFU and peak memory, printed as soon as known (the phases, measured on 2026-11-26,
   are left out: seven compiles);
2. ``run``: a 100-step compiled ``gpu-h100`` run at B = 8: tokens/s, MFU, the median data, forward + backward and
   update times of a logged step (each phase synchronised), the step time and MFU from the throughput of the
   unlogged steps between logs (no synchronisation), graph breaks and recompiles (from ``TORCH_LOGS``): the step
   against the bench's forward + backward;
3. ``tests``: the CUDA tests (``pytest -m cuda``), in parallel processes where pytest-xdist is there: before the
   decode figures, since they hold the CUDA-graph decoding to eager's tokens;
4. ``decode``: ``train.bench --decode`` with the run's checkpoint on prompts of 16k and 128k tokens, MC
   against full context: tokens/s and the cost of a refocus (its choice and its refill; and with the refill in one
   chunk of the whole budget, ``mc_one_chunk``); ``decode_r64``: MC alone
   with a refocus every 64 tokens instead of the run's 16;
5. ``sweep``: with what time is left, ``--sweep-T`` of the ``gpu-h100`` model up to T = 65536, eagerly at B = 1.

After every step ``gpu_check.json`` (each step's status, seconds and figures) and ``gpu_check.md`` are rewritten,
so a call cut short still leaves what finished. A step past its cap is killed and marked ``timeout``; a step that
fails is marked ``failed`` with its exit code, and the next one runs. ``--dry`` runs the same steps on the CPU at
tiny shapes, eagerly, on a small corpus of this repository's own text, in about 40 s: CI runs it, so a
broken script is found here and not on a lent GPU.

Compiled artifacts travel between calls: inductor's and Triton's caches live under ``--work``; at the end they
are packed into ``DIR/compile-cache.tar.gz`` (when it fits the device tool's 16 MiB a file), and ``--cache-in``
unpacks such a file first, so a second call on a fresh machine skips most compiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from train.gpu_steps import Step, steps

REPO = Path(__file__).resolve().parents[1]
CACHE_LIMIT = 16 * 2**20  # the largest file the device tool brings back
PROMPT_CHARS = 1_000_000  # of Python's standard library: comfortably over 131,072 tokens at about 3.5 characters each


def write_prompt(path: Path, chars: int) -> None:
    """Python's own standard library as text: a prompt of real code that every machine with Python has."""
    parts, total = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(source.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= chars:
            break
    path.write_text("".join(parts), encoding="utf-8")


def figures(name: str, work: Path, log: str) -> dict[str, Any]:
    """What a finished step measured, read from the files it wrote and its log."""
    if name == "tests":
        tail = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
        return {"pytest": tail[-1].strip("= ") if tail else None}
    if name == "bench":
        bench = json.loads((work / "bench.json").read_text())
        keys = ("device", "mc_step_ms", "plain_step_ms", "ratio_mc_over_plain", "mfu", "peak_mem_mb", "compile_s",
                "graph_breaks", "recompiles", "tokens_per_s", "lens_entries", "lens_fwd_long_ms")  # fmt: skip
        return {k: bench.get(k) for k in keys} | {"phases": bench["phases"], "shapes": bench["shapes"]}
    if name == "run":
        summary = json.loads((work / "run" / "summary.json").read_text())
        keys = ("device", "steps", "micro_batch_size", "step_ms_median", "tokens_per_s", "mfu", "compile_s",
                "first_val_bpb", "final_val_bpb", "wall_s")  # fmt: skip
        mfu_per_step_ms = summary["mfu"] * summary["step_ms_median"] if summary.get("mfu") else None
        return (
            {k: summary.get(k) for k in keys}
            | step_phases(work / "run", mfu_per_step_ms)
            | {
                "graph_breaks": len(re.findall(r"Graph break", log)),
                "recompiles": len(re.findall(r"Recompiling function", log)),
            }
        )
    if name.startswith("decode"):
        rows = json.loads((work / f"{name}.json").read_text())
        flat = "; ".join(f"{r['prompt_tokens']}: {r['mc_tok_s']:.0f} / {r.get('full_tok_s', float('nan')):.0f}"
                         for r in rows)  # fmt: skip
        refocus = "; ".join(f"{r['prompt_tokens']}: {r['mc_refocus_ms_per_refocus']:.1f} "
                            f"({r['mc_focus_ms_per_refocus']:.1f})" + one_chunk(r) for r in rows)  # fmt: skip
        return {"tok_s_mc_over_full": flat, "refocus_ms_of_which_focus": refocus,
                "recompiles": len(re.findall(r"Recompiling function", log)), "rows": rows}  # fmt: skip
    return {"rows": json.loads((work / "sweep" / "bench_sweep.json").read_text())}


def one_chunk(row: dict[str, Any]) -> str:
    """A decode row's refocus milliseconds with the refill in one chunk, where that mode ran."""
    ms = row.get("mc_one_chunk_refocus_ms_per_refocus")
    return "" if ms is None else f", one-chunk refill {ms:.1f}"


def step_phases(run_dir: Path, mfu_per_step_ms: float | None) -> dict[str, float]:
    """Median data, forward + backward and update milliseconds of the run's logged steps after its first (which
    compiles): where a training step's time goes beyond the benchmark's forward + backward. And the step time of the
    throughput between logged steps (``train/tokens_per_s`` over the steps since the last log, none of them
    synchronised), with its MFU (``mfu_per_step_ms``: the MFU of a 1 ms step)."""
    from mcfn.shell.run_report import PHASES
    from mcfn.shell.tracking import read_metrics  # here: they bring torch, which only reading a run needs

    timed = [r for r in read_metrics(run_dir) if "time/step_ms" in r][1:]
    found = {
        f"{key.removeprefix('time/')}_median": statistics.median(r[key] for r in timed if key in r)
        for key in PHASES
        if any(key in r for r in timed)
    }
    windows = [1e3 * r["train/tokens_per_step"] / r["train/tokens_per_s"] for r in timed[1:]]  # past compilation
    if windows:
        found["throughput_step_ms"] = statistics.median(windows)
        if mfu_per_step_ms:
            found["throughput_mfu"] = mfu_per_step_ms / found["throughput_step_ms"]
    return found


def progress_figures(log: str) -> dict[str, Any]:
    """The ``[bench] key=value`` lines a step printed as it went: what a step cut short had measured."""
    found: dict[str, Any] = {}
    for line in log.splitlines():
        if line.startswith("[bench] "):
            for key, value in re.findall(r"(\w+)=(\S+)", line):
                try:
                    found[key] = float(value)
                except ValueError:
                    found[key] = value
    return found


def run_step(step: Step, seconds: float, work: Path, log_file: Path) -> dict[str, Any]:
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | step.env
    if step.fresh is not None:
        shutil.rmtree(step.fresh, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(step.argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds)
        status, out = ("ok" if done.returncode == 0 else f"failed (exit {done.returncode})"), done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        status = f"timeout (cap {seconds:.0f} s)"
        out = "".join(b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (e.stdout, e.stderr))
    row: dict[str, Any] = {"step": step.name, "status": status, "seconds": round(time.perf_counter() - t0, 1)}
    with log_file.open("a") as f:
        f.write(f"\n===== {step.name}: {status} in {row['seconds']} s\n$ {' '.join(step.argv)}\n{out}")
    if status == "ok":
        try:
            row["figures"] = figures(step.name, work, out)
        except (OSError, KeyError, ValueError) as e:
            row["status"] = f"ok, but its figures could not be read: {e}"
    elif partial := progress_figures(out):
        row["figures"] = {"partial": partial}
    return row


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check, {report['date']}", "", f"{report['device']}; {report['mode']}", "",
             "| step | status | seconds | figures |", "| --- | --- | ---: | --- |"]  # fmt: skip
    for row in report["steps"]:
        figs = row.get("figures", {})
        figs = {f"(partial) {k}": v for k, v in figs["partial"].items()} if "partial" in figs else figs
        short = ", ".join(f"{k} {fmt(v)}" for k, v in figs.items() if not isinstance(v, dict | list))
        lines.append(f"| {row['step']} | {row['status']} | {row['seconds']} | {short} |")
    for row in report["steps"]:
        for key in ("phases", "rows"):
            if key in row.get("figures", {}):
                lines += ["", f"{row['step']} {key}:", "```", json.dumps(row["figures"][key], indent=1), "```"]
    return "\n".join(lines) + "\n"


def fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def pack_caches(work: Path, out: Path) -> str:
    """Inductor's and Triton's caches as one file the device tool can bring back, or why not. Caches far over the
    limit are not compressed at all: on the H200, packing them ran past the call's end."""
    target = out / "compile-cache.tar.gz"
    raw = sum(f.stat().st_size for name in ("inductor", "triton") for f in (work / name).rglob("*") if f.is_file())
    if raw > 4 * CACHE_LIMIT:
        return f"not packed: {raw / 2**20:.0f} MiB of caches, far over the 16 MiB a file comes back"
    with tarfile.open(target, "w:gz") as tar:
        for name in ("inductor", "triton"):
            if (work / name).is_dir():
                tar.add(work / name, arcname=name)
    size = target.stat().st_size
    if size > CACHE_LIMIT:
        target.unlink()
        return f"not packed: {size / 2**20:.1f} MiB is over the 16 MiB a file comes back"
    return f"packed: {size / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="gpu_check.json, gpu_check.md and the log go here")
    p.add_argument("--work", type=Path, help="run directories and compile caches (default: a temporary folder)")
    p.add_argument("--budget", type=float, help="seconds for all steps (default 540; dry 480)")
    p.add_argument("--dry", action="store_true", help="the same steps on the CPU at tiny shapes, eagerly")
    p.add_argument("--only", help="comma-separated step names to run (default: all)")
    p.add_argument("--cache-in", type=Path, help="a compile-cache.tar.gz from an earlier call, unpacked first")
    args = p.parse_args(argv)
    # Dry: about 40 s on 2 idle cores; the caps only stop a hang, and leave room for a machine under load.
    budget = args.budget or (480.0 if args.dry else 540.0)
    work = args.work or Path(tempfile.mkdtemp(prefix="mcfn-gpu-check-"))
    args.out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if args.cache_in:
        with tarfile.open(args.cache_in) as tar:
            tar.extractall(work, filter="data")
    os.environ |= {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TRITON_CACHE_DIR": str(work / "triton"),
                   "MCFN_CACHE": str(work / "mcfn-cache")}  # fmt: skip
    write_prompt(work / "prompt.txt", 4_000 if args.dry else PROMPT_CHARS)
    import torch

    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)",
        "torch": torch.__version__,
        "mode": f"{'dry (CPU, tiny shapes, eager)' if args.dry else 'full'}, budget {budget:.0f} s",
        "steps": [],
    }
    wanted = set(args.only.split(",")) if args.only else None
    log_file, t0 = args.out / "gpu_check.log", time.perf_counter()
    for step in steps(args.dry, work):
        left = budget - (time.perf_counter() - t0)
        if wanted is not None and step.name not in wanted:
            continue
        if left < max(step.min_s, 5.0):
            report["steps"].append({"step": step.name, "status": f"skipped ({left:.0f} s left)", "seconds": 0})
        else:
            print(f"[gpu_check] {step.name}: up to {min(step.cap_s, left):.0f} s", file=sys.stderr, flush=True)
            report["steps"].append(run_step(step, min(step.cap_s, left), work, log_file))
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        (args.out / "gpu_check.md").write_text(markdown(report))
    report["compile_cache"] = pack_caches(work, args.out)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return 0 if all(row["status"] == "ok" for row in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
