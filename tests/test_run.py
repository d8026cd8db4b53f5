"""The training shell end to end: outputs, learning, exact resume, and every bad input exiting with 2."""

import json
import math
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import tiny_sections

from mcfn.checkpoint import load_checkpoint
from mcfn.tracking import read_metrics
from train.run import main

REPO = Path(__file__).resolve().parents[1]


def write_profile(path: Path, sections: dict) -> Path:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    tomllib.loads(path.read_text())
    return path


@pytest.fixture
def profile(tmp_path, text_dir) -> Path:
    return write_profile(tmp_path / "tiny.toml", tiny_sections(f"text:{text_dir}"))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_training_writes_metrics_summary_and_learns(tmp_path, profile):
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "30", "--no-mc"]) == 0
    records = read_metrics(out)
    train_records = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_records] == list(range(30))
    assert all({"train/loss", "time/step_ms", "train/tokens_per_s"} <= r.keys() for r in train_records)
    evals = {r["step"]: r["val/bpb"] for r in records if "val/bpb" in r}
    assert sorted(evals) == [0, 10, 20, 30]
    assert evals[30] < evals[0] - 0.5, evals
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["final_val_bpb"] == evals[30] and summary["tokens_per_s"] > 0
    assert (out / "checkpoint.pt").is_file() and (out / "config.json").is_file()


def test_megacontext_run_logs_its_metrics(tmp_path, profile):
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "10"]) == 0
    records = read_metrics(out)
    step = records[1]
    for key in (
        "train/loss",
        "train/loss_lm",
        "train/loss_lod0",
        "train/grad_norm",
        "mc/lod_loss/1",
        "mc/lod_count/2",
        "mc/lod_delta/1",
        "mc/adv_delta_mean",
        "mc/adv_delta_p95",
        "mc/adv_delta_std",
        "mc/variants_per_sample",
        "mc/tokens_covered_mean",
    ):
        assert key in step, key
    assert not any(k.startswith("train/mc/") or k.startswith("train/train/") for k in step)
    assert step["mc/variants_per_sample"] == 3 and step["mc/tokens_covered_mean"] > 16
    assert {"val/bpb", "val/bpb_recency"} <= records[0].keys()
    assert json.loads((out / "summary.json").read_text())["mode"] == "mc"
    assert {"time/data_ms", "time/fwd_bwd_ms", "time/optim_ms", "train/lr/matrix", "train/lr/embedding"} <= step.keys()
    # The LOD map of step 0: recency (the last W=16 tokens: 4 blocks of K=4), then full-coverage cuts.
    maps = (out / "lod_maps.txt").read_text().splitlines()
    assert maps[0].startswith("step 0:") and len(maps) == 4
    assert maps[1].split()[-1] == "····0000" and all(set(line.split()[-1]) <= set("012") for line in maps[2:])
    report = (out / "report.md").read_text()
    for name in ("loss.png", "timings.png", "lensnet.png", "eval_sweep.png"):
        assert f"]({name})" in report and (out / name).stat().st_size > 1000, name
    assert "| 16 |" in report and "step 0:" in report  # the evaluation table and the LOD maps


def test_resumed_run_ends_exactly_like_the_uninterrupted_one(tmp_path, text_dir):
    # The schedule's horizon is train.steps; with no warmdown, the first half of a 24-step run and a
    # 12-step run train identically, so the resumed run must reproduce the straight one bit for bit.
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(f"text:{text_dir}", optim={"warmdown_frac": 0.0}, train={"ckpt_every": 12, "eval_every": 12}),
    )
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["--profile", str(profile), "--out", str(straight), "--steps", "24"]) == 0
    assert main(["--profile", str(profile), "--out", str(split), "--steps", "12"]) == 0
    assert main(["--profile", str(profile), "--out", str(split), "--steps", "24", "--resume"]) == 0
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [r["step"] for r in a]  # resumed records replace, never duplicate
    assert [r.get("train/loss") for r in a] == [r.get("train/loss") for r in b]
    assert a[-1]["val/bpb"] == b[-1]["val/bpb"]


def test_wandb_offline_needs_no_account(tmp_path, profile, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "3", "--wandb", "offline"]) == 0
    assert list((out / "wandb").glob("offline-run-*"))


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ")
    return err[-1]


def test_bad_inputs_exit_2_with_one_line(tmp_path, text_dir, profile, capsys):
    out = str(tmp_path / "run")
    assert "does not exist" in _error(
        ["--profile", str(profile), "--out", out, "--data", str(tmp_path / "nope")], capsys
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    assert "no documents" in _error(["--profile", str(profile), "--out", out, "--data", str(empty)], capsys)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file")
    assert "cannot read" in _error(["--profile", str(profile), "--out", out, "--data", str(garbage)], capsys)
    assert "fewer than data.seq_len" in _error(
        ["--profile", str(profile), "--out", out, "--no-mc", "--set", "data.seq_len=100000"], capsys
    )
    assert "unknown key train.nope" in _error(
        ["--profile", str(profile), "--out", out, "--set", "train.nope=1"], capsys
    )
    assert "no profile" in _error(["--profile", "missing-profile", "--out", out], capsys)
    assert "no checkpoint" in _error(["--profile", str(profile), "--out", out, "--resume"], capsys)
    assert not (tmp_path / "run").exists()  # nothing was written for any of these


def test_bad_checkpoints_are_refused_without_touching_the_run(tmp_path, profile, capsys):
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "10"]) == 0
    before = snapshot(out)
    # Resuming with a different model is refused.
    assert "model.n_embd" in _error(
        ["--profile", str(profile), "--out", str(out), "--steps", "20", "--resume", "--set", "model.n_embd=64"], capsys
    )
    # A fresh run into a directory that holds one is refused.
    assert "already holds a run" in _error(["--profile", str(profile), "--out", str(out)], capsys)
    assert snapshot(out) == before
    # A corrupt checkpoint is refused, and nothing else changes.
    ckpt = out / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:-100])
    before = snapshot(out)
    assert "corrupt" in _error(["--profile", str(profile), "--out", str(out), "--steps", "20", "--resume"], capsys)
    assert snapshot(out) == before


def test_exit_code_and_message_from_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "train.run", "--set", "train.steps=-1", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: invalid value for train.steps: must be >= 1"


def test_the_embedded_stdlib_default_trains(tmp_path):
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(
            "stdlib",
            data={"vocab_size": 512, "tokenizer_train_chars": 2_000_000, "min_doc_chars": 512, "val_fraction": 0.05},
        ),
    )
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "20"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_bpb"] < summary["first_val_bpb"]


def test_compiled_run_prints_no_graph_break(tmp_path, profile):
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.run",
            "--profile",
            str(profile),
            "--out",
            str(tmp_path / "run"),
            "--compile",
            "--steps",
            "4",
            "--set",
            "train.compile_mode='default'",
            "--set",
            "train.eval_every=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "graph break" not in proc.stderr.lower() and "recompil" not in proc.stderr.lower(), proc.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["compiled"] is True


def _train_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in read_metrics(out) if "train/loss" in r]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path, text_dir, sig):
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(
            f"text:{text_dir}", optim={"warmdown_frac": 0.0}, train={"ckpt_every": 100000, "eval_every": 100000}
        ),
    )
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.run", "--profile", str(profile), "--out", str(stopped), "--steps", "100000"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while len(_train_records(stopped)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert f"stopped by {sig.name}" in err
    step = load_checkpoint(stopped / "checkpoint.pt")["step"]
    assert step == _train_records(stopped)[-1]["step"] + 1  # the step in flight was finished and saved
    total = step + 3
    assert main(["--profile", str(profile), "--out", str(stopped), "--steps", str(total), "--resume"]) == 0
    assert main(["--profile", str(profile), "--out", str(straight), "--steps", str(total)]) == 0
    assert [r["train/loss"] for r in _train_records(stopped)] == [r["train/loss"] for r in _train_records(straight)]


def _poison_steps(monkeypatch, bad: set[int]) -> None:
    """Make the task's loss NaN on the given steps (as an overflow would)."""
    import mcfn.trainer

    real = mcfn.trainer.build_task

    def build(*args, **kwargs):
        task = real(*args, **kwargs)
        step_fn = task.train_step

        def poisoned(window, step, rows):
            out = step_fn(window, step, rows)
            if step in bad:
                out["loss_lm"] = out["loss_lm"] * float("nan")
            return out

        task.train_step = poisoned
        return task

    monkeypatch.setattr(mcfn.trainer, "build_task", build)


def test_non_finite_loss_skips_the_update_and_is_counted(tmp_path, profile, monkeypatch):
    clean, poisoned = tmp_path / "clean", tmp_path / "poisoned"
    assert main(["--profile", str(profile), "--out", str(clean), "--steps", "6", "--no-mc"]) == 0
    _poison_steps(monkeypatch, {2})
    assert main(["--profile", str(profile), "--out", str(poisoned), "--steps", "6", "--no-mc"]) == 0
    records = {r["step"]: r for r in read_metrics(poisoned) if "train/loss" in r}
    assert records[1]["train/skipped_steps"] == 0 and records[2]["train/skipped_steps"] == 1
    assert all(math.isfinite(records[s]["train/loss"]) for s in (3, 4, 5))
    assert json.loads((poisoned / "summary.json").read_text())["skipped_steps"] == 1
    # The skipped step changed nothing: the weights after it equal the weights the clean run had after step 1.
    a = {r["step"]: r["train/loss"] for r in read_metrics(clean) if "train/loss" in r}
    assert records[1]["train/loss"] == a[1] and records[3]["train/loss"] != a[3]


def test_non_finite_losses_in_a_row_stop_with_a_checkpoint(tmp_path, profile, monkeypatch, capsys):
    out = tmp_path / "run"
    _poison_steps(monkeypatch, {3, 4, 5})
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "10", "--no-mc"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the loss was non-finite 3 steps in a row (steps 3-5)")
    state = load_checkpoint(out / "checkpoint.pt")
    assert state["step"] == 6
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    # Resuming goes on past the bad batches, from the last good parameters.
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "10", "--no-mc", "--resume"]) == 0


def test_sigkill_at_any_moment_resumes_from_the_last_complete_checkpoint_exactly(tmp_path, text_dir):
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(f"text:{text_dir}", optim={"warmdown_frac": 0.0}, train={"ckpt_every": 3, "eval_every": 100000}),
    )
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.run", "--profile", str(profile), "--out", str(killed), "--steps", "100000"],
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while len(_train_records(killed)) < 10 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.37)  # somewhere inside a step, a log write or a checkpoint write
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    step = load_checkpoint(killed / "checkpoint.pt")["step"]  # complete and verified, never partial
    assert step >= 9 and step % 3 == 0
    total = step + 4
    assert main(["--profile", str(profile), "--out", str(killed), "--steps", str(total), "--resume"]) == 0
    assert main(["--profile", str(profile), "--out", str(straight), "--steps", str(total)]) == 0
    assert [r["step"] for r in _train_records(killed)] == list(range(total))
    assert [r["train/loss"] for r in _train_records(killed)] == [r["train/loss"] for r in _train_records(straight)]
    assert not list(killed.glob(".checkpoint.pt.*"))  # no temporary file left behind


@pytest.mark.parametrize("mode", ["mc", "plain"])
def test_two_processes_with_gloo_train_like_one(tmp_path, text_dir, mode):
    """torchrun with 2 CPU processes: each takes half of every global batch, gradients are averaged, and the
    losses follow the 1-process run's: up to float rounding for the plain GPT; for MegaContext, LensNet
    included, the losses are weighted means over entries per process, so the runs differ by that
    weighting only."""
    sections = tiny_sections(f"text:{text_dir}", train={"eval_every": 100000})
    profile = write_profile(tmp_path / "p.toml", sections)
    one, two = tmp_path / "one", tmp_path / "two"
    flags = ["--profile", str(profile), "--steps", "8"] + (["--no-mc"] if mode == "plain" else [])
    assert main([*flags, "--out", str(one)]) == 0
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*launch, "-m", "train.run", *flags, "--out", str(two)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "over 2 processes" in proc.stderr
    a, b = _train_records(one), _train_records(two)
    assert [r["step"] for r in b] == list(range(8))  # rank 0 alone wrote the log, once per step
    tolerance = 1e-4 if mode == "plain" else 2e-2
    for ra, rb in zip(a, b, strict=True):
        assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=tolerance), (ra["step"], ra, rb)
    assert load_checkpoint(two / "checkpoint.pt")["step"] == 8
    assert (two / "summary.json").is_file()


@pytest.mark.parametrize("mode", ["mc", "plain"])
def test_micro_batches_accumulate_to_the_whole_batch(tmp_path, text_dir, mode):
    sections = tiny_sections(f"text:{text_dir}", train={"eval_every": 100000})
    profile = write_profile(tmp_path / "p.toml", sections)
    flags = ["--profile", str(profile), "--steps", "5"] + (["--no-mc"] if mode == "plain" else [])
    assert main([*flags, "--out", str(tmp_path / "whole")]) == 0
    assert main([*flags, "--out", str(tmp_path / "micro"), "--set", "train.micro_batch_size=1"]) == 0
    a, b = _train_records(tmp_path / "whole"), _train_records(tmp_path / "micro")
    tolerance = 1e-4 if mode == "plain" else 2e-2  # MC: a mean over valid entries per micro-batch
    assert [r["train/loss"] for r in b] == pytest.approx([r["train/loss"] for r in a], rel=tolerance)
    assert json.loads((tmp_path / "micro" / "summary.json").read_text())["micro_batch_size"] == 1
    assert main([*flags, "--out", str(tmp_path / "bad"), "--set", "train.micro_batch_size=3"]) == 2


def test_automatic_micro_batch_halves_until_it_fits():
    from mcfn.microbatch import fitting_micro_batch

    tried = []

    def try_step(micro):
        tried.append(micro)
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    assert fitting_micro_batch(try_step, 16) == 2 and tried == [16, 8, 4, 2]


def test_out_of_memory_names_the_micro_batch_to_try(tmp_path, profile, monkeypatch, capsys):
    import mcfn.trainer

    real = mcfn.trainer.build_task

    def build(*args, **kwargs):
        task = real(*args, **kwargs)

        def exhausted(window, step, rows):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        task.train_step = exhausted
        return task

    monkeypatch.setattr(mcfn.trainer, "build_task", build)
    assert main(["--profile", str(profile), "--out", str(tmp_path / "run"), "--steps", "3"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "error: out of GPU memory at micro-batch 4; try --set train.micro_batch_size=2 (gradients accumulate, "
        "so the global batch stays train.batch_size)"
    )
