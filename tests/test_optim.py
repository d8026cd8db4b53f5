"""The optimizers: every parameter in one group, tensor learning rates, the schedule, the batched Muon, the skip of
a non-finite step on the device."""

import pytest
import torch
from builders import make_system
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import ModelConfig, OptimConfig
from mcfn.core.model import GPT
from mcfn.shell.optim import (
    FINAL_LR_FRAC,
    BatchedMuon,
    build_optimizers,
    clip_gradients,
    lr_multiplier,
    set_lr_multiplier,
    skip_if_non_finite,
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
    optimizers = build_optimizers(model, OptimConfig())
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


def muon_pair(ns_dtype: torch.dtype) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], BatchedMuon]:
    """Matrices of three shapes (two of one, a tall one), twice: ours under :class:`BatchedMuon`, theirs to step
    with torch's Muon."""
    torch.manual_seed(0)
    shapes = [(24, 24), (24, 24), (48, 24), (24, 96)]
    ours = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs, BatchedMuon(ours, ns_dtype, lr=0.02, weight_decay=0.01)


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_batched_muon_follows_torch_muon_and_shares_its_state_format(ns_dtype):
    """Same-shape matrices stepped at once give torch's per-matrix Muon: equal up to float rounding where both
    iterate in bf16 (as on a GPU), and up to torch's bf16 rounding where ours iterates in fp32 (on a CPU)."""
    ours, theirs, opt_ours = muon_pair(ns_dtype)
    opt_theirs = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.01)
    start = [p.detach().clone() for p in theirs]
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b, s0 in zip(ours, theirs, start, strict=True):
        moved = (b - s0).abs().max()
        assert moved > 0.01
        assert (a - b).abs().max() < (0.02 if ns_dtype == torch.bfloat16 else 0.05) * moved
    state = opt_theirs.state_dict()
    opt_ours.load_state_dict(state)  # checkpoints move freely between the two
    assert opt_ours.state_dict()["state"][0].keys() == state["state"][0].keys()


def test_a_non_finite_step_changes_no_parameter_and_no_optimizer_state_and_reads_nothing_back():
    """With the flag up (a NaN loss), both optimizers step on the device and leave the parameters and their
    moments as they were; the next finite step updates as if the bad one had never come."""
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    twin = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    twin.load_state_dict(model.state_dict())
    ours, clean = build_optimizers(model, OptimConfig()), build_optimizers(twin, OptimConfig())
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))

    def step(net, optimizers, loss_scale: float) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        (loss * loss_scale).backward()
        bad = skip_if_non_finite(optimizers, loss * loss_scale, torch.tensor(1.0))
        for opt in optimizers:
            opt.step()
        net.zero_grad(set_to_none=True)
        return bad

    assert not step(model, ours, 1.0) and not step(twin, clean, 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in st.items()} for opt in ours for st in opt.state.values()]
    assert step(model, ours, float("nan"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = [st for opt in ours for st in opt.state.values()]
    assert all(torch.equal(m[k], a[k]) for m, a in zip(moments, after, strict=True) for k in m)
    step(model, ours, 1.0)
    step(twin, clean, 1.0)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_cpu_training_gets_the_batched_muon_in_float32_and_fused_adamw():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    muon, adamw = build_optimizers(model, OptimConfig())
    assert type(muon) is BatchedMuon and muon.ns_dtype == torch.float32 and adamw.defaults["fused"] is True


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
