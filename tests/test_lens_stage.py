"""The LensNet stage (``train.lens``): it starts from the run's own LensNet (the original, in a checkpoint an earlier
stage rewrote), leaves the run's weights as they were, hands each round's LensNet to the ship choice as a copy, and
reads no test split."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from mcfn.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from mcfn.data.corpus import prepare_corpus
from mcfn.stage import rounds as lens_stage
from mcfn.stage import traces
from mcfn.stage.rounds import run_stage
from train.lens import main as lens_main

TINY = ["--rounds", "2", "--windows", "2", "--held-out", "2"]


def lensnet_weights(state: dict) -> dict[str, torch.Tensor]:
    return {k.removeprefix("lensnet."): v for k, v in state.items() if k.startswith("lensnet.")}


@pytest.mark.heavy(27)
def test_the_stage_leaves_the_run_as_it_was_ships_a_candidate_and_starts_from_an_original(decoding_run, tmp_path):
    """``train.lens`` on a tiny run: the checkpoint's weights and config are unchanged (the stage's rounds are
    candidates, not replacements), the ship choice among truncation, match, the run's own, the gated one and each
    round's is recorded; on a checkpoint whose LensNet an earlier stage replaced (``lens_original`` beside it), the
    stage starts from the original again (its figures equal the first stage's)."""
    run = tmp_path / "run"
    shutil.copytree(decoding_run[0], run)
    before = Checkpoint.read(run)
    assert lens_main(["--run", str(run), *TINY]) == 0
    first = json.loads((run / "lens_stage.json").read_text())
    assert [r["round"] for r in first["rounds"]] == [1, 2]
    assert sorted(p.name for p in (run / "lens_traces").iterdir()) == ["round1.pt", "round2.pt"]
    after = Checkpoint.read(run)
    assert all(torch.equal(v, after.state["model"][k]) for k, v in before.state["model"].items())
    assert after.state["config"] == before.state["config"] and "lens_original" not in after.state
    scored = ["match", "lens", "gated", "branches", "round1", "round2"]  # each also under the copy rule
    R = after.cfg.mc.refocus_every
    candidates = {"recency", *scored, *(f"{name}@copy{R}" for name in scored)}
    assert set(first["ship"]["figures"]) == candidates and after.state["shipped"]["name"] in candidates
    assert after.state["shipped"]["name"] == first["ship"]["shipped"]
    # A checkpoint of an earlier mcfn: its model's LensNet replaced by a stage, the original kept beside it.
    state = load_checkpoint(run / "checkpoint.pt")
    state["lens_original"] = {"lensnet": lensnet_weights(state["model"]), "config": state["config"]}
    state["model"] = {k: v + 0.1 if k.startswith("lensnet.") and v.is_floating_point() else v
                      for k, v in state["model"].items()}  # fmt: skip
    save_checkpoint(run / "checkpoint.pt", state)
    assert lens_main(["--run", str(run), *TINY]) == 0
    second = json.loads((run / "lens_stage.json").read_text())
    assert second["run_policy"] == first["run_policy"]  # the original again, not the replaced one


def test_the_round_shipped_is_its_own_weights_and_the_run_keeps_its_original(decoding_run, tmp_path, monkeypatch):
    """When the choice ships round 1 after round 2 trained further, the checkpoint's shipped LensNet is round 1's
    byte for byte (a copy, not the live network's), and the run's own LensNet in the checkpoint is the one it had
    before the stage."""
    from mcfn.stage import ship

    run = tmp_path / "run"
    shutil.copytree(decoding_run[0], run)
    before = lensnet_weights(Checkpoint.read(run).state["model"])
    after_round, train_round = {}, lens_stage.Stage.round

    def round_and_keep(self, r, run_dir):
        figures = train_round(self, r, run_dir)
        after_round[r] = {k: v.clone() for k, v in self.system.lensnet.state_dict().items()}
        return figures

    def round_one(names, corpus, passkey, *_):
        return ship.Verdict("round1", {}, {name: {"corpus_bpb": 1.0, "passkey": None} for name in names})

    monkeypatch.setattr(lens_stage.Stage, "round", round_and_keep)
    monkeypatch.setattr(ship, "choose", round_one)
    assert lens_main(["--run", str(run), *TINY]) == 0
    state = Checkpoint.read(run).state
    written = state["shipped"]["lensnet"]
    assert state["shipped"]["name"] == "round1" and state["shipped"]["match_prior"] == ""
    assert any(not torch.equal(after_round[1][k], after_round[2][k]) for k in written), "round 2 must differ"
    assert all(torch.equal(written[k], after_round[1][k]) for k in written)
    assert all(torch.equal(v, lensnet_weights(state["model"])[k]) for k, v in before.items())


class Unread:
    """A split that fails the test when anything reads it."""

    def __getattr__(self, name):
        pytest.fail(f"the LensNet stage read the test split ({name})")


def test_measured_and_traced_windows_are_disjoint_and_the_test_split_is_never_read(decoding_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(decoding_run[0], run)
    ckpt = Checkpoint.read(run)
    corpus = dataclasses.replace(prepare_corpus(ckpt.cfg.data), test=Unread())
    seen = {}
    real = lens_stage.Stage.__init__

    def keep(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen["stage"] = self

    monkeypatch.setattr(lens_stage.Stage, "__init__", keep)
    run_stage(run, torch.device("cpu"), print, corpus, rounds=1, windows=3, held_out=3)
    stage = seen["stage"]
    measured = {tuple(row.tolist()) for w in stage.held.windows for row in w}
    traced = {tuple(w.tolist()) for w in stage.traces[0].windows}
    assert len(measured) == len(traced) == 3 and stage.held.split == "validation" and not measured & traced


def test_the_stage_refuses_a_run_without_a_checkpoint_in_one_line(tmp_path, capsys):
    def one_line(argv) -> str:
        assert lens_main(argv) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert one_line(["--run", str(tmp_path)]).startswith("error: no checkpoint")
    assert one_line(["--run", str(tmp_path), "--rounds", "0"]).startswith("error: ")


@pytest.mark.heavy(26)
def test_a_run_with_lens_stage_rounds_ends_with_the_stage_then_ships_and_evaluates(tmp_path, profile, monkeypatch):
    """``lens_stage.rounds``: the trained system goes through the stage, then the ship choice (its round among the
    candidates), then the final evaluation, which scores the shipped policy and says which context to generate
    with; the run's end reads no checkpoint, and writes the last one once, with the stage and the choice in it.
    The final evaluation is brief:
    its edits are not labelled (``train.eval`` labels them, ``test_report_has_every_condition_and_the_headline``)."""
    import sys

    import mcfn.checkpoint
    import mcfn.shell.trainer  # noqa: F401 - the run's modules, imported before their references are spied on
    from train.run import main as run_main

    def unread(path):
        pytest.fail(f"the run read the checkpoint {path}")

    written, save = [], mcfn.checkpoint.save_checkpoint

    def keep(path, state):
        written.append((state["step"], sorted(state)))
        save(path, state)

    spies = {mcfn.checkpoint.load_checkpoint: unread, save: keep}
    for module in [m for name, m in sys.modules.items() if name.startswith("mcfn")]:
        for name in ("load_checkpoint", "save_checkpoint"):
            if (spy := spies.get(getattr(module, name, None))) is not None:
                monkeypatch.setattr(module, name, spy)
    out = tmp_path / "run"
    overrides = ["--set", "lens_stage.rounds=1", "--set", "train.final_eval_batches=2", "--set", "train.eval_every=1"]
    assert run_main(["--profile", str(profile), "--out", str(out), "--steps", "2", *overrides]) == 0
    trained = ["config", "corpus_key", "data_position", "format", "model", "optimizers", "rng", "step"]
    assert written == [(1, trained), (2, sorted([*trained, "lens_stage", "shipped"]))], written
    stage = json.loads((out / "summary.json").read_text())["lens_stage"]
    assert [r["round"] for r in stage["rounds"]] == [1]
    report = json.loads((out / "eval.json").read_text())
    assert report["shipped"] in ("recency", "match", "lens", "gated", "round1") and "shipped" in report["bpb"]
    judged = json.loads((out / "ship.json").read_text())["verdict"]["figures"]
    assert {"lens", "match", "round1", "round1@copy2"} <= judged.keys()  # the round is judged, under each rule
    assert report["brief"] and report["utility_corr"] is None and "lens" in report["bpb"]
    assert report["best_context"] in ("lens", "match", "recency")  # what a brief evaluation scores within W
    assert f"Generate with `--context {report['best_context']}`" in (out / "eval.md").read_text()


def test_the_stage_traces_corpus_text_and_tasks_half_and_half_whatever_the_runs_mix(decoding_run):
    """With ``data.mix`` 1 every training window of the run carries a task; the stage's traces are half corpus text,
    where its judge weighs a policy against match."""
    from mcfn.data.corpus import prepare_corpus

    cfg = Checkpoint.read(decoding_run[0]).cfg
    corpus = prepare_corpus(cfg.data)
    for mix, expected in ((1.0, traces.TRACE_TASK_SHARE), (0.3, traces.TRACE_TASK_SHARE), (0.0, 0.0)):
        data = dataclasses.replace(cfg.data, mix=mix, mix_tasks="repeat")  # a task the tiny run's tail fits
        sampler = traces.trace_sampler(dataclasses.replace(cfg, data=data), corpus)
        share = float(traces.probe_rows(sampler, traces.FIRST_TRACE_BATCH, 400).float().mean())
        assert abs(share - expected) < 0.08, (mix, share)


def test_a_run_with_the_stage_and_no_final_evaluation_records_the_stage_and_ships_nothing(tmp_path, profile):
    """``lens_stage.rounds`` without ``train.final_eval_batches``: the run's end still runs the stage, and its last
    checkpoint carries the stage's figures and no ship choice."""
    from train.run import main as run_main

    out = tmp_path / "run"
    overrides = ["--set", "lens_stage.rounds=1", "--set", "lens_stage.windows=2", "--set", "lens_stage.held_out=2",
                 "--set", "train.final_eval_batches=0"]  # fmt: skip
    assert run_main(["--profile", str(profile), "--out", str(out), "--steps", "2", *overrides]) == 0
    state = Checkpoint.read(out).state
    assert state["step"] == 2 and [r["round"] for r in state["lens_stage"]["rounds"]] == [1]
    assert "shipped" not in state and not (out / "ship.json").exists()
