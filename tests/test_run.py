"""The training shell end to end: outputs, learning, exact resume, and every bad input exiting with 2."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from builders import one_line_error, tiny_sections, write_profile

from mcfn.profile import config_from_saved
from mcfn.shell.outcome import git_commit
from mcfn.shell.tracking import read_metrics
from train.run import main

REPO = Path(__file__).resolve().parents[1]


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
    # What produced the run: the code's commit and the resolved config's hash (that of config.json).
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", summary["git_commit"])
    assert summary["config_hash"] == config_from_saved(json.loads((out / "config.json").read_text())).digest()


def test_git_commit_is_unknown_outside_a_checkout(tmp_path):
    assert git_commit(tmp_path) == "unknown"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", git_commit()), "this test runs inside the project's checkout"


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
    assert {"val/bpb", "val/bpb_recency", "time/val_s"} <= records[0].keys()
    assert json.loads((out / "summary.json").read_text())["mode"] == "mc"
    phases = ("time/data_ms", "time/fwd_bwd_ms", "time/optim_ms")
    assert {*phases, "time/log_ms", "train/lr/matrix", "train/lr/embedding"} <= step.keys()
    assert step["time/step_ms"] == pytest.approx(sum(step[k] for k in phases), rel=1e-3)  # logging apart
    # The LOD maps of step 0 and of the last step: recency (the last W=16 tokens: 4 blocks of K=4), then
    # full-coverage cuts.
    maps = (out / "lod_maps.txt").read_text().splitlines()
    assert maps[0].startswith("step 0:") and maps[4].startswith("step 9:") and len(maps) == 8
    assert maps[1].split()[-1] == "····0000" and all(set(line.split()[-1]) <= set("012") for line in maps[2:4])
    report = (out / "report.md").read_text()
    for name in ("loss.png", "timings.png", "lensnet.png", "eval_sweep.png"):
        assert f"]({name})" in report and (out / name).stat().st_size > 1000, name
    assert "| 16 |" in report and "step 9:" in report  # the evaluation table and the last step's LOD maps
    # Each kind of variant's share of loss_lm (baseline, sampled, allocator) sums to 1, and the report gives its mean.
    shares = [step[f"mc/loss_share/{kind}"] for kind in ("baseline", "sampled", "allocator")]
    assert all(0 < s < 1 for s in shares) and sum(shares) == pytest.approx(1.0, abs=1e-5)
    means = [sum(r[f"mc/loss_share/{kind}"] for r in records if "mc/loss_share/baseline" in r) / 10
             for kind in ("allocator", "baseline", "sampled")]  # fmt: skip
    assert (
        "12 working contexts a step; each kind's share of `loss_lm`, mean over the phase: "
        + ", ".join(
            f"{kind} {mean:.3f}" for kind, mean in zip(("allocator", "baseline", "sampled"), means, strict=True)
        )
        in report
    )


@pytest.mark.heavy(25)
def test_resumed_run_ends_exactly_like_the_uninterrupted_one(tmp_path, text_dir):
    # The schedule's horizon is train.steps; with no warmdown, the first half of a 24-step run and a
    # 12-step run train identically, so the resumed run must reproduce the straight one bit for bit.
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(
            f"text:{text_dir}", optim={"warmdown_frac": 0.0}, train={"eval_every": 12, "final_eval_batches": 0}
        ),
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


def test_bad_inputs_exit_2_with_one_line(tmp_path, text_dir, profile, capsys):
    out = str(tmp_path / "run")
    assert "does not exist" in one_line_error(
        ["--profile", str(profile), "--out", out, "--data", str(tmp_path / "nope")], capsys
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    assert "no documents" in one_line_error(["--profile", str(profile), "--out", out, "--data", str(empty)], capsys)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file")
    assert "cannot read" in one_line_error(["--profile", str(profile), "--out", out, "--data", str(garbage)], capsys)
    assert "fewer than data.seq_len" in one_line_error(
        ["--profile", str(profile), "--out", out, "--no-mc", "--set", "data.seq_len=100000"], capsys
    )
    from_flag = one_line_error(["--profile", str(profile), "--out", out, "--set", "train.nope=1"], capsys)
    assert "unknown key train.nope in the command line (--set)" in from_flag and str(profile) not in from_flag
    assert "unknown section [nonsense] in the command line" in one_line_error(
        ["--profile", str(profile), "--out", out, "--set", "nonsense.key=1"], capsys
    )
    in_file = tmp_path / "typo.toml"
    in_file.write_text(f'extends = "{profile}"\n[mc]\nnonsense = 1\n')
    assert f"unknown key mc.nonsense in {in_file}" in one_line_error(["--profile", str(in_file), "--out", out], capsys)
    assert "no profile" in one_line_error(["--profile", "missing-profile", "--out", out], capsys)
    assert "no checkpoint" in one_line_error(["--profile", str(profile), "--out", out, "--resume"], capsys)
    assert not (tmp_path / "run").exists()  # nothing was written for any of these


def test_bad_checkpoints_are_refused_without_touching_the_run(tmp_path, profile, capsys):
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "10"]) == 0
    before = snapshot(out)
    # Resuming with a different model is refused.
    assert "model.n_embd" in one_line_error(
        ["--profile", str(profile), "--out", str(out), "--steps", "20", "--resume", "--set", "model.n_embd=64"], capsys
    )
    # A fresh run into a directory that holds one is refused.
    assert "already holds a run" in one_line_error(["--profile", str(profile), "--out", str(out)], capsys)
    assert snapshot(out) == before
    # A corrupt checkpoint is refused, and nothing else changes.
    ckpt = out / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:-100])
    before = snapshot(out)
    assert "corrupt" in one_line_error(
        ["--profile", str(profile), "--out", str(out), "--steps", "20", "--resume"], capsys
    )
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


@pytest.mark.heavy(35)
def test_the_embedded_stdlib_default_trains(tmp_path):
    """The corpus every default run reads, from the standard library on disk, tokenized and learned from. The run's
    end (the ship choice and the final evaluation) is other tests' subject: here it would cost a minute."""
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(
            "stdlib",
            data={"vocab_size": 512, "min_doc_chars": 512, "val_fraction": 0.05},
            train={"final_eval_batches": 0},
        ),
    )
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "20"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_bpb"] < summary["first_val_bpb"]


@pytest.mark.heavy(65)
@pytest.mark.xdist_group("tiny-step")
def test_compiled_run_prints_no_graph_break_and_a_second_run_loads_the_compile_cache(tmp_path, profile):
    """A compiled run saves torch's portable compile cache beside the token cache; the next run of the same
    profile loads it (and still shows no graph break or recompile)."""
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles"}

    def compiled_run(name: str) -> subprocess.CompletedProcess:
        flags = ["--compile", "--steps", "4", "--set", "train.compile_mode='default'", "--set", "train.eval_every=2"]
        command = [sys.executable, "-m", "train.run", "--profile", str(profile), "--out", str(tmp_path / name)]
        proc = subprocess.run(command + flags, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "graph break" not in proc.stderr.lower() and "recompil" not in proc.stderr.lower(), proc.stderr[-2000:]
        assert json.loads((tmp_path / name / "summary.json").read_text())["compiled"] is True
        return proc

    before = set(Path(os.environ["MCFN_CACHE"]).glob("*/compile-*.bin"))
    assert "compile cache loaded" not in compiled_run("first").stderr
    saved = set(Path(os.environ["MCFN_CACHE"]).glob("*/compile-*.bin")) - before
    assert len(saved) == 1 and next(iter(saved)).stat().st_size > 0
    assert f"compile cache loaded from {next(iter(saved))}" in compiled_run("second").stderr
