"""LensNet's gate: its loss points each compressed variant's logit at whether it beat truncation, its gradient
reaches the gate head and nothing else, and the focus (evaluation, streaming) keeps its cut only where the gate
is open, truncation elsewhere."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from compile_check import assert_one_graph_equals_eager
from test_mc import VOCAB, decisive, make_system

from mcfn.config import LensConfig, MCConfig
from mcfn.core.context import assemble, seen_until
from mcfn.core.gate import gate_loss, gated
from mcfn.core.system import process_batch_lens, refocus, tail_horizon, tree_stage
from mcfn.core.variants import draw_variant_noise, recency_cut
from mcfn.core.weights import LossWeights
from mcfn.inference.streaming import StreamingTree, focused_context
from mcfn.tools.evaluation import EvalSettings, evaluate

SHAPE = {"T": 32, "K": 4, "L": 2, "W": 16, "H": 8, "N": 3}
GATE = {"gate_weight": 1.0}


def weights() -> LossWeights:
    return LossWeights.of(MCConfig(lens=LensConfig(**GATE)), torch.device("cpu"))


def test_gate_loss_pushes_each_cut_towards_whether_it_beat_truncation_by_how_much():
    """Slot 0 is the recency baseline and the slots before the last ``judged`` are random variants: neither gets a
    gradient. An allocator cut with a lower tail NLL than the baseline is pushed open, one with a higher NLL shut,
    a tie not at all, each in proportion to the gap; a label read one slot off, or with its sign flipped, fails."""
    tails = torch.tensor([[2.0, 9.0, 1.5, 2.5, 2.0], [1.0, 0.0, 3.0, 0.8, 1.0]])  # [B, V], slot 0 the baseline
    logit = torch.zeros(10, requires_grad=True)  # the packed [B·V] rows
    out = gate_loss(logit, tails, weights(), judged=3)
    out.losses["loss_gate"].backward()
    grad = logit.grad.view(2, 5)
    assert (grad[:, :2] == 0).all(), "the baseline and the random variant are not judged"
    assert grad[0, 2] < 0 and grad[1, 3] < 0, "cuts that beat truncation are pushed open"
    assert grad[0, 3] > 0 and grad[1, 2] > 0, "cuts that lost are pushed shut"
    assert grad[0, 4] == 0 and grad[1, 4] == 0, "a tie teaches nothing"
    assert grad[1, 2].abs() == pytest.approx(10 * grad[1, 3].abs()), "a gap of 2 nats weighs ten times 0.2"
    assert out.metrics["mc/gate_beats_recency"] == pytest.approx(2 / 6)
    assert out.metrics["mc/gate_open"] == 0  # logit 0 is shut


def test_where_cuts_look_alike_the_gate_opens_exactly_when_their_mean_gain_is_positive():
    """One logit for many cuts: training it on the loss alone ends open when the gains outweigh the losses, even
    when most cuts lose (a rare large win against frequent small losses), and shut otherwise."""
    for gains, should_open in (([3.0, -0.2, -0.2, -0.2], True), ([0.3, -0.2, -0.2, -0.2], False)):
        tails = torch.tensor([[0.0, -g] for g in gains])  # [B, 2]: each cut's NLL is the baseline's minus its gain
        logit = torch.zeros((), requires_grad=True)
        opt = torch.optim.SGD([logit], lr=1.0)
        for _ in range(300):
            opt.zero_grad()
            rows = torch.stack([torch.zeros(()), logit]).repeat(len(gains))  # [B·V]: the baseline, then the cut
            gate_loss(rows, tails, weights(), judged=1).losses["loss_gate"].backward()
            opt.step()
        assert (float(logit) > 0) == should_open, (gains, float(logit))


def test_loss_gate_is_a_term_of_the_lens_step_and_trains_the_gate_head_only():
    system = make_system(**SHAPE, lens=GATE)
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, VOCAB, (2, SHAPE["T"] + 1), generator=g)
    noise = draw_variant_noise(system.layout, 2, g, torch.device("cpu"))
    out = process_batch_lens(system, window, noise, weights())
    assert "loss_gate" in out.losses and "mc/gate_agreement" in out.metrics
    out.losses["loss_gate"].backward()
    assert system.lensnet.gate.weight.grad.abs().sum() > 0
    assert system.lensnet.in_proj.weight.grad.abs().sum() > 0, "the gate shares LensNet's transformer"
    assert all(p.grad is None or (p.grad == 0).all() for p in system.base.parameters()), "LensNet reads detached"
    assert system.lensnet.head.weight.grad is None or (system.lensnet.head.weight.grad == 0).all()


def test_without_gate_weight_there_is_no_gate():
    system = make_system(**SHAPE)
    assert system.lensnet.gate is None
    assert "lensnet.gate.weight" not in dict(system.named_parameters())


def gated_setup():
    system = decisive(make_system(**SHAPE, lens=GATE, seed=2))
    window = torch.randint(0, VOCAB, (6, SHAPE["T"] + 1), generator=torch.Generator().manual_seed(3))
    tree = tree_stage(system, window)
    start = system.coarsest.expand(6, 1, -1)
    horizon = tail_horizon(system.layout, 6, window.device)
    cut = refocus(system, tree, window, start, system.nodes, iterations=2, horizon=horizon)
    return system, window, tree, cut, horizon


SETUP = gated_setup()


@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.01, 100.0))
def test_property_I12_the_focus_keeps_its_cut_where_the_gate_is_open_and_truncation_elsewhere(seed, scale):
    """For any gate weights: each row is the refocused cut where the gate's logit (LensNet reading that cut up to
    its horizon) is above zero, the recency cut where it is not."""
    system, window, tree, cut, horizon = SETUP
    recency = recency_cut(system.layout, 6, window.device)
    weight = torch.randn(system.lensnet.gate.weight.shape, generator=torch.Generator().manual_seed(seed)) * scale
    with torch.no_grad():
        system.lensnet.gate.weight.copy_(weight)
        out, is_open = gated(system.lensnet, tree, window, cut, system.nodes, horizon)
        wc = assemble(tree, cut, window, system.nodes)
        logit = system.lensnet.judge(seen_until(wc, horizon))[1]
    assert torch.equal(is_open, logit > 0)
    for r in range(6):
        assert torch.equal(out[r], cut[r] if is_open[r] else recency[r])


def test_I12_both_branches_on_a_fixed_case():
    """A zero gate shuts every row (logit 0 is shut); with a weight or its negation some row is kept."""
    system, window, tree, cut, horizon = gated_setup()
    recency = recency_cut(system.layout, 6, window.device)
    assert not torch.equal(cut, recency), "the refocused cuts must differ from truncation for this to test anything"
    gate = system.lensnet.gate.weight
    with torch.no_grad():
        gate.zero_()
        shut, is_open = gated(system.lensnet, tree, window, cut, system.nodes, horizon)
    assert not is_open.any() and torch.equal(shut, recency)
    seen = torch.zeros(6, dtype=torch.bool)
    for sign in (1.0, -1.0):
        with torch.no_grad():
            gate.copy_(sign * torch.linspace(-1, 1, gate.numel()).view_as(gate))
            out, is_open = gated(system.lensnet, tree, window, cut, system.nodes, horizon)
        for r in range(6):
            assert torch.equal(out[r], cut[r] if is_open[r] else recency[r])
        seen |= is_open
    assert seen.any(), "the open branch was taken somewhere"


def test_the_evaluation_scores_lens_as_truncation_where_the_gate_is_shut():
    system = decisive(make_system(**SHAPE, lens=GATE, seed=1))
    with torch.no_grad():
        system.lensnet.gate.weight.zero_()
    windows = [torch.randint(0, VOCAB, (3, SHAPE["T"] + 1), generator=torch.Generator().manual_seed(i)) for i in (0, 1)]
    settings = EvalSettings(budgets=(SHAPE["W"],), random_contexts=3, refocus=2, tasks=("corpus",))
    report = evaluate(system, windows, torch.randint(1, 4, (VOCAB,)), None, settings)
    corpus = report["tasks"]["corpus"]
    assert corpus["lens_gate_open"] == 0
    assert corpus["bpb"]["lens"] == pytest.approx(corpus["bpb"]["recency"], rel=1e-6)
    assert corpus["bpb"]["ungated"] != pytest.approx(corpus["bpb"]["lens"], rel=1e-4), "the gate changed something"
    assert corpus["gate_gain"]["bpb"] == pytest.approx(corpus["bpb"]["ungated"] - corpus["bpb"]["lens"], abs=1e-9)


def test_a_shut_gate_streams_the_last_budget_tokens():
    system = decisive(make_system(**SHAPE, lens=GATE, seed=4))
    with torch.no_grad():
        system.lensnet.gate.weight.zero_()
    budget, n = SHAPE["W"] - 2, 5 * SHAPE["T"] + 3
    stream = StreamingTree(system, torch.device("cpu"))
    stream.append(torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(5)))
    for previous in (None, focused_context(system, stream, budget, steps=2)):
        wc = focused_context(system, stream, budget, steps=2, previous=previous)
        assert (wc.lod[0] == 0).all() and wc.start[0].tolist() == list(range(n - budget, n))


def test_the_gated_lens_step_compiles_to_one_graph_equal_to_eager(fresh_dynamo):
    system = make_system(**SHAPE, lens=GATE)
    g, w = torch.Generator().manual_seed(6), weights()
    batches = []
    for _ in range(3):
        window = torch.randint(0, VOCAB, (2, SHAPE["T"] + 1), generator=g)
        batches.append((system, window, draw_variant_noise(system.layout, 2, g, torch.device("cpu"), 1), w))
    assert_one_graph_equals_eager(process_batch_lens, batches, loss=lambda out: out.total(), params=system.parameters())
