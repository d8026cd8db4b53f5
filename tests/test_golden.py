"""Golden per-step losses (as torchtitan keeps them): the first 10 steps of a tiny fixed MegaContext run,
eager on the CPU, against ``tests/golden/tiny_mc_losses.json``.

Any change to the model, the step, the data pipeline or the optimizer that moves a number shows up here.
Each golden run is repeated under two ATen kernel capabilities: the portable ``default`` kernels (a subprocess with
``ATEN_CPU_CAPABILITY=default``) and the machine's own (in this process), so a file regenerated on one CPU cannot pin
that CPU's rounding.
When a change is *meant* to alter the numbers, regenerate the file (it is written from the portable ``default``
kernels, not from any one machine's vector ones) and commit it with the change:

    MCFN_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py

and say in the commit message why the losses moved.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import tiny_sections, write_profile

from mcfn.shell.tracking import read_metrics
from train.run import main

GOLDEN_DIR = Path(__file__).parent / "golden"
REPO = Path(__file__).parent.parent
KEYS = ("train/loss", "train/loss_lm", "train/loss_lens", "train/grad_norm")
STEPS = 10
# Kernel capabilities each golden run is repeated under; "native" is the machine's own, in this process. The
# tolerances below were set from the spread of default, AVX2 and AVX-512, which spans every x86 CPU's kernels.
CAPABILITIES = ("default", "native")
REGEN_CAPABILITY = "default"
# Relative tolerance per key: float rounding only. LensNet's loss is the one ill-conditioned number: a function
# of score and loss differences between near-identical variants, it moved by up to 1e-3 (relative) between two
# CPUs of the CI's kind with the same code, where loss_lm stayed bit-identical (LABLOG, ninth session). A
# wiring change moves it by far more.
REL = {"train/loss_lens": 2e-3}
ABS = 1e-5
# Step 0's LensNet loss is not a golden quantity at that tolerance: LensNet starts with a zero head, so every
# pair of variants is a near-tie and the loss (about 5e-5) is rounding's choice. Measured on one AMD EPYC
# (2026-11-27): tiny 2.69e-5 / 6.91e-5 / 4.83e-5 and teacher 1.51e-5 / 5.75e-5 / 3.61e-5 under the default,
# AVX2 and AVX-512 kernels, a spread of 4.2e-5. It is held only to "near zero": below 2e-4, three times the
# largest value seen (a LensNet that does not start level gives losses of 1e-2 and more). From step 1 on
# every key is compared at the tolerances above.
NEAR_TIE = {("train/loss_lens", 0): 2e-4}
# Step 1's LensNet loss still carries step 0's near-tie (LensNet's first update follows rounding's choice there): on
# an Intel Xeon with AVX-512-FP16 and AMX (2026-12-01) its native kernels moved it by 2.1e-3 relative, every other
# key and step by at most 2.8e-4 (loss_lens at step 2) and 2.4e-5 (the rest). Held at 5e-3 at that one step.
REL_AT = {("train/loss_lens", 1): 5e-3}
# Each run: its golden file, what it sets beyond the tiny sections, and the keys it adds. ``teacher`` is the
# ``cpu-longrange`` MC step shrunk: the full-window teacher, LensNet's attention target, reconstruction, and the
# allocator's variant without exploration noise; its attention target was wired one query off once and no test saw.
RUNS = {
    "tiny": ("tiny_mc_losses.json", {}, ()),
    "teacher": (
        "tiny_mc_teacher_losses.json",
        {
            "gist": {"recon_weight": 0.5},
            "lens": {"attention_weight": 1.0},
            "alloc": {"iterations": 4, "noise": 0.0},
            "teacher": {"full_weight": 1.0},
        },
        ("train/loss_full", "train/loss_lens_attn", "train/loss_recon"),
    ),
}


def golden_run(run_dir: Path, text_dir: Path, name: str, capability: str) -> dict[str, list[float]]:
    """The first ``STEPS`` steps' losses of run ``name`` under ``capability`` (a fresh interpreter with
    ``ATEN_CPU_CAPABILITY`` set; "native": this process, whose kernels are the machine's own)."""
    _, mc, extra_keys = RUNS[name]
    sections = tiny_sections(f"text:{text_dir}", train={"final_eval_batches": 0})
    sections["mc"].update(mc)
    profile = write_profile(run_dir / "golden.toml", sections)
    argv = ["--profile", str(profile), "--out", str(run_dir / "run"), "--steps", str(STEPS)]
    if capability == "native":
        assert main(argv) == 0
    else:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        command = [sys.executable, "-m", "train.run", *argv]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(run_dir / "run")
    losses = {key: [r[key] for r in records if key in r and r["step"] < STEPS] for key in KEYS + extra_keys}
    assert all(len(v) == STEPS for v in losses.values()), {k: len(v) for k, v in losses.items()}
    return losses


def assert_golden(losses: dict[str, list[float]], golden: dict[str, list[float]]) -> None:
    for key, values in losses.items():
        for step, (value, want) in enumerate(zip(values, golden[key], strict=True)):
            if (bound := NEAR_TIE.get((key, step))) is not None:
                assert abs(value) < bound and abs(want) < bound, (key, step, value, want)
            else:
                rel = REL_AT.get((key, step), REL.get(key, 2e-4))
                assert value == pytest.approx(want, rel=rel, abs=ABS), (key, step, value, want)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("name", list(RUNS))
def test_first_ten_steps_match_the_golden_losses(tmp_path, text_dir, name, capability):
    losses = golden_run(tmp_path, text_dir, name, capability)
    path = GOLDEN_DIR / RUNS[name][0]
    if os.environ.get("MCFN_REGEN_GOLDEN") == "1" and capability == REGEN_CAPABILITY:
        path.write_text(json.dumps(losses, indent=1) + "\n")
    assert_golden(losses, json.loads(path.read_text()))


def test_a_one_percent_change_to_a_loss_weight_fails_the_golden_check():
    """The tolerances leave the check sharp: the tiny run's total loss with LensNet's term 1 % heavier (the
    golden losses' own terms, recombined) is refused, and so is a 1 % change to the language-model loss."""
    golden = json.loads((GOLDEN_DIR / RUNS["tiny"][0]).read_text())
    lens_terms = zip(golden["train/loss"], golden["train/loss_lens"], strict=True)
    heavier_lens = {**golden, "train/loss": [total + 0.01 * lens for total, lens in lens_terms]}
    lighter_lm = {**golden, "train/loss_lm": [v * 0.99 for v in golden["train/loss_lm"]]}
    for planted in (heavier_lens, lighter_lm):
        with pytest.raises(AssertionError):
            assert_golden(planted, golden)
    assert_golden(golden, golden)
