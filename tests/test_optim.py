"""The optimizers: every parameter in one group, tensor learning rates, the schedule, the float32 Muon."""

import pytest
import torch
from builders import make_system
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import ModelConfig, OptimConfig
from mcfn.core.model import GPT
from mcfn.shell.optim import (
    FINAL_LR_FRAC,
    Float32Muon,
    build_optimizers,
    clip_gradients,
    lr_multiplier,
    set_lr_multiplier,
)


def test_every_parameter_is_in_exactly_one_optimizer():
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64))
    muon, adamw = build_optimizers(model, OptimConfig())
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert not in_muon & in_adamw
    assert in_muon | in_adamw == {id(p) for p in model.parameters()}
    assert id(model.wte.weight) in in_adamw and id(model.lm_head.weight) in in_adamw
    assert isinstance(muon, torch.optim.Muon)
    gain_group = next(g for g in adamw.param_groups if g["name"] == "gain")
    assert {id(p) for p in gain_group["params"]} == {id(b.attn.gain) for b in model.blocks}


def test_learning_rates_are_tensors_updated_in_place():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    optimizers = build_optimizers(model, OptimConfig(matrix_lr=0.02))
    lr_tensor = optimizers[0].param_groups[0]["lr"]
    set_lr_multiplier(optimizers, 0.5)
    assert optimizers[0].param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.01)


@given(st.integers(1, 500), st.floats(0, 1))
def test_property_schedule_holds_then_warms_down(total, warmdown):
    cfg = OptimConfig(warmdown_frac=warmdown)
    mults = [lr_multiplier(s, total, cfg) for s in range(total)]
    assert all(FINAL_LR_FRAC - 1e-9 <= m <= 1.0 for m in mults)
    assert all(a >= b - 1e-12 for a, b in zip(mults, mults[1:], strict=False))  # never rises
    steps_down = round(warmdown * total)
    assert mults[: total - steps_down] == [1.0] * (total - steps_down)
    if steps_down > 0:
        assert mults[-1] == pytest.approx(FINAL_LR_FRAC)


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


def test_a_lensnet_gradient_spike_does_not_scale_the_base_models_step():
    """LensNet and the rest are clipped apart: a LensNet gradient 1000 times the clip leaves the base model's
    gradient (within the clip) as it was, and LensNet's is brought to the clip; the joint norm is reported."""
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=2)
    for name, p in system.named_parameters():
        p.grad = torch.full_like(p, 1000.0 if name.startswith("lensnet.") else 1e-4)
    rest = [p for name, p in system.named_parameters() if not name.startswith("lensnet.")]
    rest_before = torch.cat([p.grad.flatten() for p in rest]).clone()
    joint, lens = clip_gradients(system, 1.0)
    assert torch.equal(torch.cat([p.grad.flatten() for p in rest]), rest_before)
    lens_after = torch.cat([p.grad.flatten() for p in system.lensnet.parameters()]).norm()
    torch.testing.assert_close(lens_after, torch.tensor(1.0), rtol=1e-4, atol=0)
    assert float(lens) > 1000 and float(joint) >= float(lens)
