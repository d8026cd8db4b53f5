"""Checkpoints: atomic, verified files, and the one compatibility check every reader applies."""

import dataclasses

import pytest
import torch

from mcfn.checkpoint import (
    CHECKPOINT_FORMAT,
    Checkpoint,
    load_checkpoint,
    run_state,
    save_checkpoint,
)
from mcfn.config import RunConfig
from mcfn.core.model import GPT
from mcfn.errors import UserError


def test_checkpoint_roundtrip_and_corruption(tmp_path):
    path = tmp_path / "checkpoint.pt"
    state = {"model": {"w": torch.arange(6.0)}, "step": 3, "config": {"a": {"b": 1}}}
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(6.0))

    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(path)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(path)
    path.write_bytes(b"hello")
    with pytest.raises(UserError, match="not an mcfn checkpoint"):
        load_checkpoint(path)
    with pytest.raises(UserError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"model": {}, "step": 1})
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr("os.fsync", broken_fsync)
    with pytest.raises(OSError):
        save_checkpoint(path, {"model": {}, "step": 2})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left


def small() -> RunConfig:
    cfg = RunConfig()
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layer=1, n_embd=16, vocab_size=64))


def written(path, cfg: RunConfig, corpus_key: str = "corpus-a", step: int = 3):
    model = GPT(cfg.model)
    save_checkpoint(path, run_state(step, model, [], cfg, corpus_key))
    return model


def test_a_checkpoint_of_another_format_is_refused_in_one_line_naming_both(tmp_path):
    path = tmp_path / "old.pt"
    written(path, small())
    state = load_checkpoint(path)
    save_checkpoint(path, {**state, "format": CHECKPOINT_FORMAT - 1})
    with pytest.raises(UserError, match=f"format {CHECKPOINT_FORMAT - 1}; .*format {CHECKPOINT_FORMAT} only") as e:
        Checkpoint.read(path)
    assert "\n" not in str(e.value)
    save_checkpoint(path, state)
    assert Checkpoint.read(tmp_path / "old.pt").step == 3


def test_a_checkpoint_reads_back_what_the_run_wrote(tmp_path):
    cfg = small()
    model = written(tmp_path / "checkpoint.pt", cfg, step=7)
    ckpt = Checkpoint.read(tmp_path)  # a run directory reads its checkpoint.pt
    assert (ckpt.step, ckpt.corpus_key, ckpt.cfg) == (7, "corpus-a", cfg)
    assert ckpt.state["model"].keys() == model.state_dict().keys()


def test_one_compatibility_check_names_the_reader_the_key_and_both_values(tmp_path):
    cfg = small()
    written(tmp_path / "checkpoint.pt", cfg)
    ckpt = Checkpoint.read(tmp_path)
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_embd=cfg.model.n_embd * 2))
    longer = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=cfg.data.seq_len * 2))
    ckpt.check_fits("--resume", "corpus-a", cfg, ("model", "data", "mc"))  # the same run fits
    ckpt.check_fits("--init-from", "corpus-a", longer, ("model",))  # only the named sections are compared
    with pytest.raises(
        UserError, match=rf"--init-from .* model.n_embd={cfg.model.n_embd}, this run has {wider.model.n_embd}"
    ):
        ckpt.check_fits("--init-from", "corpus-a", wider, ("model",))
    with pytest.raises(UserError, match=rf"--reference .* data.seq_len={cfg.data.seq_len}, the checkpoint has"):
        ckpt.check_fits("--reference", "corpus-a", longer, ("data.seq_len",), than="the checkpoint")
    ckpt.check_fits("--reference", "corpus-a", wider, ("data.seq_len",))  # one key, not its section
    with pytest.raises(UserError, match="--resume .* different corpus or tokenizer than this run"):
        ckpt.check_fits("--resume", "corpus-b", cfg, ("model",))
