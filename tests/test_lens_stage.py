"""The LensNet stage (``train.lens``): it starts from the run's own LensNet, keeps the original beside what it writes,
refuses a policy that loses what the run's LensNet knew, selects on windows that report nothing, and reads no test
split."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from mcfn.data.corpus import prepare_corpus
from mcfn.shell import lens_stage, traces
from mcfn.shell.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from mcfn.shell.lens_judge import Judged, refusal
from mcfn.shell.lens_stage import run_stage
from train.lens import main as lens_main

TINY = ["--rounds", "2", "--windows", "2", "--held-out", "2"]


def test_a_candidate_that_loses_the_pass_key_or_trails_match_on_the_corpus_is_refused():
    own = Judged(lens_bpb=1.30, match_bpb=1.25, passkey=0.94, probes=32)
    forgets = Judged(lens_bpb=1.20, match_bpb=1.25, passkey=0.50, probes=32)  # better on text, retrieval lost
    level = Judged(lens_bpb=1.22, match_bpb=1.25, passkey=0.91, probes=32)  # within 2 SE of the run's own
    trails = Judged(lens_bpb=1.28, match_bpb=1.25, passkey=0.97, probes=32)  # retrieves, but worse than match
    assert "pass key" in refusal(forgets, own)
    assert refusal(level, own) is None
    assert "corpus" in refusal(trails, own)
    assert "corpus" in refusal(own, own)  # the run's own may be refused too: then it stays, and the stage says why


def lensnet_weights(state: dict) -> dict[str, torch.Tensor]:
    return {k.removeprefix("lensnet."): v for k, v in state.items() if k.startswith("lensnet.")}


def test_the_stage_starts_from_the_run_keeps_its_original_and_a_second_stage_finds_it(decoding_run, tmp_path):
    """``train.lens`` twice on a tiny run: the policy kept is the lowest selection NLL among the candidates not
    refused (the run's own, match's cut, the run's own gated over it, each round's); the checkpoint carries the run's
    original LensNet and config beside the policy kept; a second stage measures the same original (its figures equal
    the first's)."""
    run = tmp_path / "run"
    shutil.copytree(decoding_run[0], run)
    before = Checkpoint.read(run)
    assert lens_main(["--run", str(run), *TINY]) == 0
    first = json.loads((run / "lens_stage.json").read_text())
    assert [r["round"] for r in first["rounds"]] == [1, 2]
    assert sorted(p.name for p in (run / "lens_traces").iterdir()) == ["round1.pt", "round2.pt"]
    means = {
        "run": first["run_policy"]["lens_bpb"],
        "match": first["match"]["lens_bpb"],
        "gated": first["gated"]["lens_bpb"],
    }
    means |= {r["round"]: r["selection"]["lens_bpb"] for r in first["rounds"]}
    allowed = [name for name in means if str(name) not in first["refused"]]
    assert first["kept_round"] == (min(allowed, key=means.get) if allowed else "run")
    after = Checkpoint.read(run)
    original = after.state["lens_original"]
    assert all(torch.equal(v, original["lensnet"][k]) for k, v in lensnet_weights(before.state["model"]).items())
    assert original["config"] == before.state["config"]
    changed = [k for k in before.state["model"] if not torch.equal(before.state["model"][k], after.state["model"][k])]
    assert all(k.startswith("lensnet.") for k in changed)
    assert after.cfg.mc.lens.match_prior == ("gated" if first["kept_round"] in ("match", "gated") else "")
    # Whatever this stage kept, make the checkpoint's LensNet differ from the original, as a kept round's would.
    state = load_checkpoint(run / "checkpoint.pt")
    state["model"] = {k: v + 0.1 if k.startswith("lensnet.") and v.is_floating_point() else v
                      for k, v in state["model"].items()}  # fmt: skip
    save_checkpoint(run / "checkpoint.pt", state)
    assert lens_main(["--run", str(run), *TINY]) == 0
    second = json.loads((run / "lens_stage.json").read_text())
    assert second["run_policy"] == first["run_policy"]  # the original again, not the first stage's policy
    assert Checkpoint.read(run).state["lens_original"]["config"] == before.state["config"]


def test_the_stage_writes_back_the_weights_of_the_round_it_kept(decoding_run, tmp_path, monkeypatch):
    """With round 1 the best on the selection windows and round 2 trained further, the checkpoint's LensNet is round
    1's, byte for byte, not the last round's: the kept round's weights are a copy, not the live network's."""
    run = tmp_path / "run"
    shutil.copytree(decoding_run[0], run)
    bpb = {"run": 9.0, "match": 8.0, 1: 1.0, 2: 5.0}  # round 1 best; match's own bits per byte 10: none refused

    def measure(self, system=None, split="selection"):
        if system is self.own:
            name = "run"
        else:  # no system: the stage's own, the current round's policy; another: match's cut (or, reported, the kept)
            name = "match" if system is not None else len(self.traces)
        return Judged(lens_bpb=bpb[name], match_bpb=10.0, passkey=None, probes=0)

    after_round, train_round = {}, lens_stage.Stage.round

    def round_and_keep(self, r, run_dir):
        figures = train_round(self, r, run_dir)
        after_round[r] = {k: v.clone() for k, v in self.system.lensnet.state_dict().items()}
        return figures

    monkeypatch.setattr(lens_stage.Stage, "measure", measure)
    monkeypatch.setattr(lens_stage.Stage, "round", round_and_keep)
    _, summary = run_stage(run, torch.device("cpu"), print, rounds=2, windows=2, held_out=1)
    assert summary["kept_round"] == 1 and not summary["refused"]
    written = lensnet_weights(Checkpoint.read(run).state["model"])
    assert any(not torch.equal(after_round[1][k], after_round[2][k]) for k in written), "round 2 must differ"
    assert all(torch.equal(written[k], after_round[1][k]) for k in written)


class Unread:
    """A split that fails the test when anything reads it."""

    def __getattr__(self, name):
        pytest.fail(f"the LensNet stage read the test split ({name})")


def test_selection_report_and_traced_windows_are_disjoint_and_the_test_split_is_never_read(
    decoding_run, tmp_path, monkeypatch
):
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
    rows = {name: {tuple(row.tolist()) for w in stage.held[name].windows for row in w} for name in stage.held}
    rows["traced"] = {tuple(w.tolist()) for w in stage.traces[0].windows}
    assert all(len(r) == 3 for r in rows.values()) and stage.held["selection"].split == "validation"
    assert not (
        rows["selection"] & rows["report"] or rows["selection"] & rows["traced"] or rows["report"] & rows["traced"]
    )


def test_the_stage_refuses_a_run_without_a_checkpoint_in_one_line(tmp_path, capsys):
    def one_line(argv) -> str:
        assert lens_main(argv) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert one_line(["--run", str(tmp_path)]).startswith("error: no checkpoint")
    assert one_line(["--run", str(tmp_path), "--rounds", "0"]).startswith("error: ")


def test_a_run_with_lens_stage_rounds_ends_with_the_stage_then_evaluates_its_policy(tmp_path, profile):
    """``lens_stage.rounds``: the run's last checkpoint goes through the stage before the final evaluation, which
    then scores the policy the stage kept and says which context to generate with. The final evaluation is brief:
    its edits are not labelled (``train.eval`` labels them, ``test_report_has_every_condition_and_the_headline``)."""
    from train.run import main as run_main

    out = tmp_path / "run"
    overrides = ["--set", "lens_stage.rounds=1", "--set", "train.final_eval_batches=2"]
    assert run_main(["--profile", str(profile), "--out", str(out), "--steps", "2", *overrides]) == 0
    stage = json.loads((out / "summary.json").read_text())["lens_stage"]
    assert [r["round"] for r in stage["rounds"]] == [1] and stage["kept_round"] in ("run", "match", 1)
    report = json.loads((out / "eval.json").read_text())
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
