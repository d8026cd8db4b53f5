"""LensNet's terms on the block view it is read from (``mcfn.core.view``): labels, wiring, one graph."""

from __future__ import annotations

import dataclasses

import torch
from compile_check import assert_one_graph_equals_eager
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mc import STEP_WEIGHTS, VOCAB, layouts, make_system

from mcfn.core.nodes import NodeTable
from mcfn.core.preferences import lod_map
from mcfn.core.system import focus_scores, process_batch_lens, tree_stage, view_scores
from mcfn.core.variants import draw_variant_noise, sample_variants
from mcfn.core.view import block_labels, view_blocks, view_losses

WEIGHTS = dataclasses.replace(STEP_WEIGHTS, view=torch.tensor(1.0), attention=torch.tensor(1.0))


@settings(deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_property_view_labels_say_where_the_better_variant_shows_more_detail(case, seed):
    """I7's polarity at the view's granularity: a block's label is 1 exactly where the better variant shows
    something inside the block at a finer LOD than the worse one does, 0 where coarser (left out is coarser than
    any gist), ½ where both show it equally fine; computed here token by token from the variants' LOD maps."""
    nodes = NodeTable.of(make_system(**case).layout)
    layout = nodes.layout
    g = torch.Generator().manual_seed(seed)
    shown = sample_variants(draw_variant_noise(layout, 2, g, torch.device("cpu")), nodes)
    tails = torch.rand(2, layout.V, generator=g)
    label, pair_w = block_labels(shown, tails, nodes, torch.tensor(0.5))
    per_token = lod_map(shown, nodes)  # [B, V, T]
    n = layout.eligible_counts[1]
    finest = per_token[..., : n * layout.K].unflatten(-1, (n, layout.K)).amin(-1)  # [B, V, n]
    pairs = [(i, j) for i in range(layout.V) for j in range(i + 1, layout.V)]
    for b in range(2):
        for p, (i, j) in enumerate(pairs):
            better, worse = (i, j) if tails[b, i] <= tails[b, j] else (j, i)
            expected = torch.full((n,), 0.5)
            expected[finest[b, better] < finest[b, worse]] = 1.0
            expected[finest[b, better] > finest[b, worse]] = 0.0
            assert torch.equal(label[b, p], expected)
            assert abs(float(pair_w[b, p]) - float(torch.tanh((tails[b, i] - tails[b, j]).abs() / 0.5))) < 1e-6


def test_view_pref_loss_pushes_a_block_the_better_variant_shows_raw_up_and_one_it_leaves_out_down():
    """Two variants: the better shows block 0 raw and leaves block 1 out, the worse the opposite. Descending
    ``loss_view_pref`` raises block 0's score and lowers block 1's; with the tails swapped it does the reverse
    (a label on the wrong side of the pair fails one of the two)."""
    system = make_system(T=32, K=4, L=1, W=16, H=8, N=1, leave_out="gist")
    nodes, layout = system.nodes, system.layout
    assert layout.eligible_counts[1] == 6
    node = torch.arange(layout.n_nodes)
    tokens_of = lambda block: (node < layout.T) & (node // layout.K == block)  # noqa: E731
    gist_of = lambda block: node == layout.level_offsets[1] + block  # noqa: E731
    rest = gist_of(2) | gist_of(3) | gist_of(4) | gist_of(5) | (node >= layout.T - layout.H) & (node < layout.T)
    first, second = rest | tokens_of(0), rest | tokens_of(1)
    shown = torch.stack([first, second])[None]  # [1, 2, nodes]: 0 raw and 1 out, then 1 raw and 0 out
    for tails, up, down in ((torch.tensor([[1.0, 2.0]]), 0, 1), (torch.tensor([[2.0, 1.0]]), 1, 0)):
        scores = torch.zeros(1, 6, requires_grad=True)
        view_losses(scores, shown, tails, None, nodes, WEIGHTS).total().backward()
        assert scores.grad[0, up] < 0 < scores.grad[0, down]  # gradient descent raises `up`, lowers `down`
        assert torch.all(scores.grad[0, 2:] == 0)  # both show blocks 2-5 the same: ties at score 0 are optimal


def test_view_attention_term_ranks_blocks_by_the_teachers_mass():
    """``loss_view_attn`` is lowest when the blocks' softmax matches the attention share under each block: from
    zero scores its gradient raises the block holding the mass and lowers the others; the LOD2 and token
    entries of ``mass`` are not read."""
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=1)
    nodes, layout = system.nodes, system.layout
    mass = torch.zeros(1, layout.n_nodes)
    mass[0, layout.level_offsets[1] + 2] = 3.0
    mass[0, : layout.T] = 100.0  # tokens: not the view's blocks
    mass[0, layout.level_offsets[2] :] = 100.0  # LOD2 gists: neither
    shown = torch.zeros(1, 2, layout.n_nodes, dtype=torch.bool)
    scores = torch.zeros(1, layout.eligible_counts[1], requires_grad=True)
    out = view_losses(scores, shown, torch.zeros(1, 2), mass, nodes, WEIGHTS)
    out.losses["loss_view_attn"].backward()
    assert scores.grad[0, 2] < 0 and torch.all(scores.grad[0, torch.arange(6) != 2] > 0)


def test_view_scores_are_what_focus_scores_spread_and_carry_lensnets_gradient():
    """The trained scores are the allocator's: ``focus_scores`` is ``view_scores`` spread, and the view term's
    gradient reaches LensNet (and nothing else) in the training step."""
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=2, lens={"view_weight": 1.0, "attention_weight": 1.0},
                         teacher={"full_weight": 1.0})  # fmt: skip
    assert system.use_view
    window = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    tree = tree_stage(system, window)
    raw = view_scores(system, tree, window, system.nodes)
    assert torch.equal(focus_scores(system, tree, window, system.nodes), system.nodes.spread_block_scores(raw))
    noise = draw_variant_noise(system.layout, 2, torch.Generator().manual_seed(1), torch.device("cpu"))
    out = process_batch_lens(system, window, noise, WEIGHTS)
    assert {"loss_view_pref", "loss_view_attn"} <= set(out.losses)
    system.zero_grad()
    (out.losses["loss_view_pref"] + out.losses["loss_view_attn"]).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in system.lensnet.parameters())
    others = [p for name, p in system.named_parameters() if not name.startswith("lensnet.")]
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in others)
    assert view_blocks(raw, system.nodes).shape == (2, system.layout.eligible_counts[1])


def test_the_lens_step_with_the_view_terms_is_one_graph_equal_to_eager(fresh_dynamo):
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=2, lens={"view_weight": 1.0, "attention_weight": 1.0},
                         teacher={"full_weight": 1.0})  # fmt: skip
    g = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(3):
        window = torch.randint(0, VOCAB, (2, 33), generator=g)
        batches.append((system, window, draw_variant_noise(system.layout, 2, g, torch.device("cpu")), WEIGHTS))
    assert_one_graph_equals_eager(
        process_batch_lens, batches, loss=lambda out: out.total(), params=system.lensnet.parameters()
    )
