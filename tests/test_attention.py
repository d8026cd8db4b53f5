"""The tail's attention mass as LensNet's auxiliary target: the mass is the model's own attention, each node
holds the mass under its span, and ``loss_lens_attn`` pulls LensNet's ranking towards it (not away)."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, decisive, make_system, random_batch
from compile_check import assert_one_graph_equals_eager
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.config import LensConfig, MCConfig, TeacherConfig
from mcfn.core.attention import (
    LONG_RANGE_FLOOR,
    AttentionTarget,
    attention_target_loss,
    hidden_and_tail_attention,
    long_range_mass,
    node_mass,
)
from mcfn.core.nodes import Layout
from mcfn.core.system import build_contexts, process_batch
from mcfn.core.weights import LossWeights
from mcfn.errors import UserError
from mcfn.profile import build_config

SHAPE = dict(T=32, K=4, L=2, W=16, H=8, N=2)
WITH_ATTENTION = dict(teacher={"full_weight": 1.0}, lens={"attention_weight": 1.0})


def system_configs() -> dict:
    return {"teacher": TeacherConfig(full_weight=1.0), "lens": LensConfig(attention_weight=1.0)}


def test_hidden_states_are_the_models_and_each_tail_query_spreads_one_unit_per_layer_and_head_causally():
    system = decisive(make_system(**SHAPE))
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32, dtype=torch.float32)[None]
    first = torch.tensor([24, 20])
    hidden, attention = hidden_and_tail_attention(
        system.base, system.base.embed(tokens), positions, torch.ones_like(positions), first, 8
    )
    torch.testing.assert_close(hidden, system.base.token_hidden(tokens), atol=1e-5, rtol=1e-5)
    heads = system.base.cfg.n_layer * system.base.cfg.n_head
    torch.testing.assert_close(attention.sum(-1), torch.full((2, 8), float(heads)))
    query = first[:, None] + torch.arange(8)
    assert (attention[torch.arange(32)[None, None] > query[..., None]] == 0).all()  # causal
    assert attention[0, 0, :25].min() > 0 and attention.grad_fn is None


def test_each_query_weighs_by_what_the_far_past_is_worth_to_it():
    attention = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # query 0 reads entry 0, query 1 entry 1
    recency = torch.tensor([[3.0, 1.0]], requires_grad=True)
    full = torch.tensor([[1.0, 2.0]])  # the far past helps query 0 by 2 nats and hurts query 1
    mass = long_range_mass(attention, recency, full)
    torch.testing.assert_close(mass, torch.tensor([[2.0 + LONG_RANGE_FLOOR, LONG_RANGE_FLOOR, 0.0]]))
    assert mass.grad_fn is None


def test_the_teachers_mass_covers_the_window_once_per_level():
    """Each level of the tree splits the same (weighted) mass: every token's under exactly one node a level."""
    from mcfn.core.losses import recency_tail_nll
    from mcfn.core.teacher import teacher_losses

    system = decisive(make_system(**SHAPE, **WITH_ATTENTION))
    window, noise = random_batch(system)
    with torch.no_grad():
        wc, _, _ = build_contexts(system, window, noise)
        hidden = system.base.hidden(wc.emb, wc.position, wc.span.float())
        recency_nll = recency_tail_nll(system.base.nll(hidden, wc.target), wc, system.layout)
        weights = LossWeights.of(MCConfig(**system_configs()), torch.device("cpu"))
        _, mass = teacher_losses(system.base, window, recency_nll, system.layout, weights, system.attention_target)
    layout = system.layout
    totals = [mass[:, o : o + n].sum(-1) for o, n in zip(layout.level_offsets, layout.level_sizes, strict=True)]
    for total in totals[1:]:
        torch.testing.assert_close(total, totals[0])
    heads = system.base.cfg.n_layer * system.base.cfg.n_head
    assert (totals[0] >= heads * layout.H * LONG_RANGE_FLOOR - 1e-4).all()


def test_a_node_holds_the_mass_of_the_tokens_under_its_span():
    layout = Layout(T=16, K=4, L=2, W=8, H=4, N=1)
    token_mass = torch.arange(16.0)[None]
    nodes = node_mass(token_mass, layout)
    assert nodes.shape == (1, layout.n_nodes)
    torch.testing.assert_close(nodes[0, 16:20], torch.tensor([6.0, 22.0, 38.0, 54.0]))  # LOD1: sums of 4 tokens
    torch.testing.assert_close(nodes[0, 20], torch.tensor(120.0))  # LOD2: the whole window


def constructed_case(system, seed: int = 0):
    window, noise = random_batch(system, seed=seed)
    with torch.no_grad():
        wc, _, _ = build_contexts(system, window, noise)
    mass = torch.rand(window.size(0), system.layout.n_nodes, generator=torch.Generator().manual_seed(seed)) + 0.1
    return wc, mass


def test_scores_ranked_as_the_attention_beat_scores_ranked_against_it():
    """The KL is 0 exactly when the softmax of the scores is the attention share; reversing the ranking costs."""
    system = make_system(**SHAPE)
    wc, mass = constructed_case(system)
    layout = system.layout
    entry_mass = mass.repeat_interleave(layout.V, 0).gather(1, wc.node.clamp(min=0))
    candidates = wc.valid & (wc.start < layout.T - layout.H)
    aligned = torch.where(candidates, entry_mass.log(), 0.0)
    one = torch.tensor(1.0)
    best = attention_target_loss(aligned, wc, mass, layout, one)
    reversed_ = attention_target_loss(-aligned, wc, mass, layout, one)
    assert float(best.metrics["mc/lens_attn_kl"]) == pytest.approx(0.0, abs=1e-5)
    assert float(reversed_.metrics["mc/lens_attn_kl"]) > 0.1
    assert float(reversed_.losses["loss_lens_attn"]) > float(best.losses["loss_lens_attn"])
    shifted = attention_target_loss(aligned + 3.0, wc, mass, layout, one)  # listwise: the offset is free
    torch.testing.assert_close(shifted.losses["loss_lens_attn"], best.losses["loss_lens_attn"])
    tail_only = torch.where(candidates, aligned, 100.0)  # the tail's scores are not part of the target
    torch.testing.assert_close(attention_target_loss(tail_only, wc, mass, layout, one).losses["loss_lens_attn"],
                               best.losses["loss_lens_attn"])  # fmt: skip
    torch.testing.assert_close(attention_target_loss(aligned, wc, mass, layout, 0.5 * one).losses["loss_lens_attn"],
                               0.5 * best.losses["loss_lens_attn"])  # fmt: skip


def test_the_attention_target_trains_lensnet_and_only_lensnet():
    system = decisive(make_system(**SHAPE, **WITH_ATTENTION))
    window, noise = random_batch(system, seed=3)
    weights = LossWeights.of(MCConfig(**system_configs()), torch.device("cpu"))
    out = process_batch(system, window, noise, weights)
    assert "loss_lens_attn" in out.losses and float(out.metrics["mc/lens_attn_kl"].detach()) > 0
    system.zero_grad(set_to_none=True)
    out.losses["loss_lens_attn"].backward()
    grads = {
        name: sum(float(p.grad.abs().sum()) for p in getattr(system, name).parameters() if p.grad is not None)
        for name in ("base", "gistnet", "lensnet")
    }
    assert grads["lensnet"] > 0 and grads["base"] == 0 and grads["gistnet"] == 0


def test_without_the_weight_there_is_no_attention_term():
    system = decisive(make_system(**SHAPE, teacher={"full_weight": 1.0}))
    window, noise = random_batch(system)
    out = process_batch(system, window, noise, LossWeights.of(MCConfig(), torch.device("cpu")))
    assert "loss_lens_attn" not in out.losses


def test_the_attention_target_needs_the_teacher():
    with pytest.raises(UserError, match="mc.lens.attention_weight"):
        build_config({"mc": {"lens": {"attention_weight": 1.0}}})


@pytest.mark.heavy(20)
def test_the_step_with_the_attention_target_is_one_graph_equal_to_eager(fresh_dynamo):
    system = decisive(make_system(**SHAPE, **WITH_ATTENTION))
    weights = LossWeights.of(MCConfig(**system_configs()), torch.device("cpu"))
    batches = [(system, *random_batch(system, seed=i), weights) for i in range(3)]
    assert_one_graph_equals_eager(process_batch, batches)


def test_the_indexers_target_leaves_the_sink_and_its_recent_window_out_and_reads_every_tail_query():
    """The indexer's target (its recent window of ``recent`` tokens) leaves those tokens' entries and the first block
    out; the mass is every tail query's as before, with nothing on the sink's tokens. Any other LensNet's target
    reads every entry before the tail. Fails with the sink left in or a query dropped."""
    layout = Layout(T=32, K=4, L=2, W=16, H=8, N=1)
    assert AttentionTarget.of(4, layout) == AttentionTarget(near=4, sink=4)
    assert AttentionTarget.of(0, layout) == AttentionTarget()
    generator = torch.Generator().manual_seed(0)
    attention = torch.rand(2, layout.H, layout.T, generator=generator)
    recency, full = torch.rand(2, layout.H, generator=generator) + 1.0, torch.rand(2, layout.H, generator=generator)
    mass = long_range_mass(attention, recency, full, sink=4)
    weight = (recency - full).clamp(min=0) + LONG_RANGE_FLOOR
    expected = torch.einsum("bh,bht->bt", weight, attention)
    torch.testing.assert_close(mass[:, 4:], expected[:, 4:])
    assert (mass[:, :4] == 0).all()
    torch.testing.assert_close(long_range_mass(attention, recency, full), expected)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), near=st.sampled_from([4, 12]))
def test_property_a_far_target_is_blind_to_the_scores_it_leaves_out(seed: int, near: int):
    """With ``near`` tokens before the horizon left out, ``loss_lens_attn`` depends on no score of an entry ending
    within them (nor of the tail), and on the scores of the entries before them; their gradient is exactly zero.
    With ``near`` = 12 the bound cuts a LOD2 gist's span (as the indexer's 32 tokens cut a 64-token gist at T = 512).
    Fails with the candidates' bound read from the entry's start instead of its end, or ``near`` ignored."""
    system = make_system(T=64, K=4, L=2, W=24, H=8, N=3)
    wc, mass = constructed_case(system, seed % 7)
    layout, one = system.layout, torch.tensor(1.0)
    scores = torch.randn(wc.batch_size[0], wc.batch_size[1], generator=torch.Generator().manual_seed(seed))
    scores.requires_grad_(True)
    attention_target_loss(scores, wc, mass, layout, one, near).losses["loss_lens_attn"].backward()
    left_out = wc.start + wc.span > layout.T - layout.H - near
    assert (scores.grad[left_out] == 0).all()
    assert (scores.grad[wc.valid & ~left_out] != 0).any()
    assert (left_out & wc.valid & (wc.start < layout.T - layout.H)).any()  # the case leaves some real entry out
