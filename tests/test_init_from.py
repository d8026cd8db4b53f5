"""Two-stage training: ``--init-from RUN_DIR`` loads exactly another run's base weights, or refuses with exit 2."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from builders import one_line_error, tiny_sections, write_profile

from mcfn.checkpoint import CHECKPOINT_NAME, Checkpoint, load_checkpoint
from mcfn.core.system import MegaContext
from mcfn.profile import resolve
from mcfn.shell.init_from import base_weights, init_base_from
from mcfn.shell.tracking import read_metrics
from train.run import main


def mc_system(profile, vocab: int, seed: int = 0) -> MegaContext:
    cfg = resolve(str(profile), [])
    torch.manual_seed(seed)
    return MegaContext(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))), cfg


def test_init_from_loads_exactly_the_base_weights(tmp_path, profile):
    plain = tmp_path / "plain"
    assert main(["--profile", str(profile), "--out", str(plain), "--steps", "5", "--no-mc"]) == 0
    state = load_checkpoint(plain / CHECKPOINT_NAME)
    trained = state["model"]
    vocab = trained["wte.weight"].size(0)
    system, cfg = mc_system(profile, vocab)
    fresh, _ = mc_system(profile, vocab)
    cfg = dataclasses.replace(cfg, model=system.base.cfg)
    assert init_base_from(system, cfg, state["corpus_key"], plain) == 0  # not a branch: the run starts at 0
    for name, value in system.base.state_dict().items():
        assert torch.equal(value, trained[name]), name
    for part in ("gistnet", "lensnet"):  # everything else is left as initialised
        for (name, a), (_, b) in zip(
            getattr(system, part).state_dict().items(), getattr(fresh, part).state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), f"{part}.{name}"
    # A MegaContext run's checkpoint gives its base model's weights, under the plain names.
    mc_state = {"model": {**{f"base.{k}": v for k, v in trained.items()}, "gistnet.w": torch.zeros(1)}}
    assert base_weights(mc_state["model"]).keys() == trained.keys()


def test_a_two_stage_run_trains_and_says_where_it_started(tmp_path, profile, capsys):
    plain = tmp_path / "plain"
    assert main(["--profile", str(profile), "--out", str(plain), "--steps", "5", "--no-mc"]) == 0
    out = tmp_path / "mc"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "3", "--init-from", str(plain)]) == 0
    assert f"base model initialised from {plain}" in capsys.readouterr().err
    trained = load_checkpoint(plain / CHECKPOINT_NAME)["model"]["wte.weight"]
    assert not torch.equal(load_checkpoint(out / CHECKPOINT_NAME)["model"]["base.wte.weight"], trained), "then trains"


@pytest.mark.heavy(21)
def test_a_branch_starts_after_the_plain_phase_of_the_run_it_comes_from(tmp_path, profile, capsys):
    """A checkpoint saved at exactly ``train.plain_steps`` starts an MC run there: its steps are the MC phase's
    only, under the same schedule; a checkpoint at any other step starts from 0, as a plain ``--init-from``."""
    whole = tmp_path / "plain"
    phase = ["--profile", str(profile), "--steps", "5", "--set", "train.plain_steps=3"]
    assert main([*phase, "--out", str(whole), "--stop-after", "3"]) == 0  # its plain phase only, saved at step 3
    assert "stopped by --stop-after after step 3" in capsys.readouterr().err
    assert Checkpoint.read(whole).step == 3 and not (whole / "eval.json").exists()
    assert "--stop-after" in one_line_error([*phase, "--out", str(tmp_path / "x"), "--stop-after", "5"], capsys)
    branch = tmp_path / "branch"
    args = ["--profile", str(profile), "--out", str(branch), "--steps", "5", "--init-from", str(whole)]
    assert main([*args, "--set", "train.plain_steps=3"]) == 0
    assert f"branched from {whole}'s plain phase: the MegaContext phase from step 3" in capsys.readouterr().err
    records = [r for r in read_metrics(branch) if "train/loss_lm" in r]
    assert [r["step"] for r in records] == [3, 4] and all("mc/lod_delta/1" in r for r in records)
    other = tmp_path / "other"
    assert main([*args[:3], str(other), *args[4:], "--set", "train.plain_steps=2"]) == 0  # saved at 3, not 2
    assert [r["step"] for r in read_metrics(other) if "train/loss_lm" in r] == [0, 1, 2, 3, 4]


def test_mismatched_runs_are_refused_with_exit_2(tmp_path, profile, text_dir, capsys):
    plain = tmp_path / "plain"
    assert main(["--profile", str(profile), "--out", str(plain), "--steps", "5", "--no-mc"]) == 0
    out = tmp_path / "mc"
    message = one_line_error(["--profile", str(profile), "--out", str(out), "--init-from", str(plain),
                      "--set", "model.n_embd=64"], capsys)  # fmt: skip
    assert "--init-from" in message and "model.n_embd=32" in message and "64" in message
    other = write_profile(tmp_path / "other.toml", tiny_sections(f"text:{text_dir}", data={"vocab_size": 300}))
    assert "different corpus or tokenizer" in one_line_error(
        ["--profile", str(other), "--out", str(out), "--init-from", str(plain)], capsys
    )
    assert "no checkpoint" in one_line_error(
        ["--profile", str(profile), "--out", str(out), "--init-from", str(tmp_path)], capsys
    )
    assert not out.exists(), "nothing is written for a refused run"


def test_a_plain_phase_trains_the_base_alone_then_megacontext(tmp_path, profile, capsys):
    """``train.plain_steps``: the two-stage recipe in one run. The first steps log only the plain loss (the
    base model alone over whole windows), the rest the MegaContext step's terms and metrics, and the
    effective-batch telemetry says which."""
    out = tmp_path / "run"
    assert main(["--profile", str(profile), "--out", str(out), "--steps", "6", "--set", "train.plain_steps=3"]) == 0
    assert "plain phase: steps 0-2" in capsys.readouterr().err
    records = [r for r in read_metrics(out) if "train/loss_lm" in r]
    assert [("mc/lod_delta/1" in r) for r in records] == [False] * 3 + [True] * 3
    # The effective batch: B·T tokens every step; B whole windows in the plain phase, then B·V working contexts.
    assert [r["train/tokens_per_step"] for r in records] == [4 * 32] * 6
    assert [r["train/variants_per_step"] for r in records] == [4] * 3 + [4 * 3] * 3
    assert "plain_steps" in one_line_error(["--profile", str(profile), "--out", str(tmp_path / "x"), "--steps", "3",
                                    "--set", "train.plain_steps=3"], capsys)  # fmt: skip
