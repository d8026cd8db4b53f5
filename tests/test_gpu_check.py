"""The GPU check's script, on the CPU: its dry mode runs every step at tiny shapes (so a broken script is found in
CI, not on a lent GPU), and a step past its cap or failing is reported, with what it measured, while the rest go on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from train.gpu_check import Step, main, run_step

REPO = Path(__file__).resolve().parents[1]
STEPS = ["bench", "run", "tests", "decode", "decode_r64", "sweep"]


@pytest.mark.heavy(53)
def test_the_dry_check_runs_every_step_and_reports_each_figure(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry", "--out", str(out), "--work", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [row["step"] for row in report["steps"]] == STEPS
    assert all(row["status"] == "ok" for row in report["steps"])
    figures = {row["step"]: row["figures"] for row in report["steps"]}
    assert "skipped" in figures["tests"]["pytest"]  # the CUDA tests, collected and skipped off a GPU
    assert figures["bench"]["mc_step_ms"] > 0 and figures["bench"]["lens_entries"] == 512
    assert figures["run"]["steps"] == 3 and figures["run"]["graph_breaks"] == 0
    assert figures["run"]["fwd_bwd_ms_median"] > 0 and figures["run"]["optim_ms_median"] > 0
    assert {row["prompt_tokens"] for row in figures["decode"]["rows"]} == {256, 512}
    assert "one-chunk refill" in figures["decode"]["refocus_ms_of_which_focus"]
    assert [row["prompt_tokens"] for row in figures["decode_r64"]["rows"]] == [512]
    assert "full_tok_s" not in figures["decode_r64"]["rows"][0]  # MC alone
    assert {row["condition"] for row in figures["sweep"]["rows"]} == {"plain", "mc"}
    assert (out / "gpu_check.md").read_text().startswith("# GPU check")
    log = (out / "gpu_check.log").read_text()
    assert [line.split(":")[0] for line in log.splitlines() if line.startswith("===== ")] == [
        f"===== {s}" for s in STEPS
    ]


def test_a_step_past_its_cap_is_cut_keeping_what_it_measured(tmp_path):
    slow = "print('[bench] mc_step_ms=3.5 device=x', flush=True); import time; time.sleep(60)"
    row = run_step(Step("bench", 60, [sys.executable, "-c", slow]), 3, tmp_path, tmp_path / "log")
    assert row["status"].startswith("timeout") and row["seconds"] < 30
    assert row["figures"] == {"partial": {"mc_step_ms": 3.5, "device": "x"}}
    assert "mc_step_ms=3.5" in (tmp_path / "log").read_text()


def test_a_failing_step_is_reported_and_the_next_runs(tmp_path, monkeypatch):
    import train.gpu_check as gpu_check

    fail = Step("tests", 30, [sys.executable, "-c", "raise SystemExit(3)"])
    fresh = tmp_path / "run"
    (fresh / "old").mkdir(parents=True)
    ok = Step("tests", 30, [sys.executable, "-c", "print('1 passed in 0.1s')"], fresh=fresh)
    monkeypatch.setattr(gpu_check, "steps", lambda dry, work: [fail, ok])
    assert main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"), "--dry"]) == 1
    rows = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"]
    assert [r["status"] for r in rows] == ["failed (exit 3)", "ok"]
    assert rows[1]["figures"] == {"pytest": "1 passed in 0.1s"} and not fresh.exists()
