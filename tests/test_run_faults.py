"""Runs that stop, fail or split: signals, kills, non-finite losses, several processes, micro-batches and
running out of memory."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from builders import tiny_sections, write_profile

from mcfn.checkpoint import load_checkpoint
from mcfn.shell.tracking import read_metrics
from train.run import main

REPO = Path(__file__).resolve().parents[1]


def _train_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in read_metrics(out) if "train/loss" in r]


@pytest.mark.heavy(22)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path, text_dir, sig):
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(
            f"text:{text_dir}", optim={"warmdown_frac": 0.0}, train={"eval_every": 100000, "final_eval_batches": 0}
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
    import mcfn.shell.session

    real = mcfn.shell.session.build_task

    def build(*args, **kwargs):
        task = real(*args, **kwargs)
        step_fn = task.train_step

        def poisoned(window, step, rows):
            out = step_fn(window, step, rows)
            if step in bad:
                out.losses["loss_lm"] = out.losses["loss_lm"] * float("nan")
            return out

        task.train_step = poisoned
        return task

    monkeypatch.setattr(mcfn.shell.session, "build_task", build)


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


@pytest.mark.heavy(23)
def test_sigkill_at_any_moment_resumes_from_the_last_complete_checkpoint_exactly(tmp_path, text_dir):
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(
            f"text:{text_dir}", optim={"warmdown_frac": 0.0}, train={"eval_every": 3, "final_eval_batches": 0}
        ),
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


@pytest.mark.heavy(25)
@pytest.mark.parametrize("mode", ["mc", "plain"])
def test_two_processes_with_gloo_train_like_one(tmp_path, text_dir, mode):
    """torchrun with 2 CPU processes: each takes half of every global batch, gradients are averaged, and the
    losses follow the 1-process run's: up to float rounding for the plain GPT; for MegaContext, LensNet
    included, the losses are weighted means over entries per process, so the runs differ by that
    weighting only."""
    sections = tiny_sections(f"text:{text_dir}", train={"eval_every": 100000, "final_eval_batches": 0})
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
    sections = tiny_sections(f"text:{text_dir}", train={"eval_every": 100000, "final_eval_batches": 0})
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
    from mcfn.shell.microbatch import fitting_micro_batch

    tried = []

    def try_step(micro):
        tried.append(micro)
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    assert fitting_micro_batch(try_step, 16) == 2 and tried == [16, 8, 4, 2]


def test_out_of_memory_names_the_micro_batch_to_try(tmp_path, profile, monkeypatch, capsys):
    import mcfn.shell.session

    real = mcfn.shell.session.build_task

    def build(*args, **kwargs):
        task = real(*args, **kwargs)

        def exhausted(window, step, rows):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        task.train_step = exhausted
        return task

    monkeypatch.setattr(mcfn.shell.session, "build_task", build)
    assert main(["--profile", str(profile), "--out", str(tmp_path / "run"), "--steps", "3"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "error: out of GPU memory at micro-batch 4; try --set train.micro_batch_size=2 (gradients accumulate, "
        "so the global batch stays train.batch_size)"
    )


def test_a_run_whose_ship_choice_fails_still_writes_its_trained_checkpoint(tmp_path, profile, monkeypatch):
    """The run's end writes the last checkpoint once, after the ship choice; where the choice fails, the trained
    state is written all the same (without a choice), and resuming it at the same step makes the choice."""
    from mcfn.shell import outcome

    def fails(*_):
        raise RuntimeError("the ship choice failed")

    out = tmp_path / "run"
    run = ["--profile", str(profile), "--out", str(out), "--steps", "2", "--set", "train.final_eval_batches=1"]
    with monkeypatch.context() as patched:
        patched.setattr(outcome, "ship_policy", fails)
        with pytest.raises(RuntimeError, match="the ship choice failed"):
            main(run)
    state = load_checkpoint(out / "checkpoint.pt")
    assert state["step"] == 2 and "shipped" not in state
    assert main([*run, "--resume"]) == 0
    shipped = json.loads((out / "eval.json").read_text())["shipped"]
    assert load_checkpoint(out / "checkpoint.pt")["shipped"]["name"] == shipped
