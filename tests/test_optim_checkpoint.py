import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import ModelConfig, OptimConfig
from mcfn.core.model import GPT
from mcfn.errors import UserError
from mcfn.shell.checkpoint import load_checkpoint, save_checkpoint
from mcfn.shell.optim import Float32Muon, build_optimizers, lr_multiplier, set_lr_multiplier


def test_every_parameter_is_in_exactly_one_optimizer():
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64))
    muon, adamw = build_optimizers(model, OptimConfig())
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert not in_muon & in_adamw
    assert in_muon | in_adamw == {id(p) for p in model.parameters()}
    assert id(model.wte.weight) in in_adamw and id(model.lm_head.weight) in in_adamw
    assert isinstance(muon, torch.optim.Muon)


def test_learning_rates_are_tensors_updated_in_place():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    optimizers = build_optimizers(model, OptimConfig(matrix_lr=0.02))
    lr_tensor = optimizers[0].param_groups[0]["lr"]
    set_lr_multiplier(optimizers, 0.5)
    assert optimizers[0].param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.01)


@given(st.integers(1, 500), st.floats(0, 0.5), st.floats(0, 0.5), st.floats(0, 1))
def test_property_schedule_warms_up_holds_and_warms_down(total, warmup, warmdown, final):
    cfg = OptimConfig(warmup_frac=warmup, warmdown_frac=warmdown, final_lr_frac=final)
    mults = [lr_multiplier(s, total, cfg) for s in range(total)]
    assert all(0 <= m <= 1 + 1e-9 for m in mults)
    if round(warmdown * total) > 0:
        assert mults[-1] == pytest.approx(final)
    elif round(warmup * total) < total:
        assert mults[-1] == 1.0


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


def test_float32_muon_follows_torch_muon_and_shares_its_state_format():
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(48, 24))
    theirs = torch.nn.Parameter(ours.detach().clone())
    start = ours.detach().clone()
    opt_ours, opt_theirs = Float32Muon([ours], lr=0.02), torch.optim.Muon([theirs], lr=0.02)
    for _ in range(3):
        grad = torch.randn(48, 24)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    moved = (theirs - start).abs().max()
    assert moved > 0.01
    assert (ours - theirs).abs().max() < 0.05 * moved  # equal up to torch's bf16 rounding
    state = opt_theirs.state_dict()
    opt_ours.load_state_dict(state)  # checkpoints move freely between the two
    assert opt_ours.state_dict()["state"][0].keys() == state["state"][0].keys()


def test_cpu_training_gets_the_float32_muon():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    assert type(build_optimizers(model, OptimConfig())[0]) is Float32Muon


def test_a_checkpoint_of_another_format_is_refused_in_one_line_naming_both(tmp_path):
    from mcfn.shell.checkpoint import CHECKPOINT_FORMAT, load_run_state

    path = tmp_path / "old.pt"
    save_checkpoint(path, {"format": CHECKPOINT_FORMAT - 1, "model": {}, "step": 3})
    with pytest.raises(UserError, match=f"format {CHECKPOINT_FORMAT - 1}; .*format {CHECKPOINT_FORMAT} only") as e:
        load_run_state(path)
    assert "\n" not in str(e.value)
    save_checkpoint(path, {"format": CHECKPOINT_FORMAT, "model": {}, "step": 3})
    assert load_run_state(path)["step"] == 3
