"""The CUDA memory history (``train.run --memory-snapshot``): refused off CUDA, written once, after its steps."""

from __future__ import annotations

import torch

from mcfn.shell.memory import MemoryHistory
from train.run import main


def test_a_memory_snapshot_off_cuda_is_refused_before_anything_runs(tmp_path, profile, capsys):
    assert main(["--profile", str(profile), "--out", str(tmp_path / "run"), "--memory-snapshot", "mem.pickle"]) == 2
    assert "CUDA" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_memory_history_is_written_once_after_its_steps(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    history = MemoryHistory(tmp_path / "sub" / "mem.pickle", steps=2)
    assert calls[0][0] == "record" and calls[0][1]["max_entries"] > 0
    assert history.step_done() is None and len(calls) == 1
    assert "mem.pickle" in history.step_done()
    assert calls[1] == ("dump", str(tmp_path / "sub" / "mem.pickle")) and calls[2] == ("record", {"enabled": None})
    assert history.step_done() is None and history.close() is None and len(calls) == 3
    silent = MemoryHistory(None, steps=1)
    assert silent.step_done() is None and silent.close() is None and len(calls) == 3


def test_a_run_shorter_than_the_snapshot_writes_it_at_the_end(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append("record"))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append("dump"))
    history = MemoryHistory(tmp_path / "mem.pickle", steps=5)
    history.step_done()
    assert history.close() is not None and calls == ["record", "dump", "record"]
