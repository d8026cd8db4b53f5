"""A refocus over a history longer than the budget's coarsest cover reaches (issue 100): the view holds the whole
history (up to ``view_blocks``), and which top-level gists are left out is the scores' choice, so generation reads
a far block its policy picks however long the history."""

from __future__ import annotations

import dataclasses

import torch
from builders import VOCAB, adversarial, adversarial_scores, check_cut, decisive, layouts, make_system
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.allocator import coarsest_within_budget
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.policy import MATCH
from mcfn.core.stream_view import stream_view, view_blocks
from mcfn.inference.generation import generate_mc

T, K, L, W, H = 64, 4, 2, 32, 8
REFOCUS = 4


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(4, 24), adversarial, st.integers(0, 2**16))
def test_property_the_coarsest_cut_within_budget_leaves_out_the_lowest_scoring_top_gists(shape, longer, kind, seed):
    """On a layout whose coarsest cover is over budget (a history ``longer`` top-level blocks past it), the start is a
    cut (I2–I4) within budget, and every top-level gist it leaves out scores at most every one it keeps."""
    layout = Layout(**shape)
    layout = dataclasses.replace(layout, T=layout.T + longer * layout.top_span, N=0)
    layout = dataclasses.replace(layout, W=max(layout.H + layout.K * layout.L, layout.coarsest_cover - longer))
    nodes = NodeTable.of(layout)
    scores = adversarial_scores(kind, (1, layout.n_nodes), seed)
    cut = coarsest_within_budget(scores, nodes)[0]
    check_cut(cut, layout)
    left_out = nodes.coarsest[None] & ~cut
    assert not (left_out & ~nodes.droppable).any(), "only top-level gists are left out"
    assert int(left_out.sum()) == max(0, layout.coarsest_cover - layout.W)
    kept = cut & nodes.droppable
    if left_out.any() and kept.any():
        assert scores[left_out].max() <= scores[kept].min()


def test_the_coarsest_cut_within_budget_is_the_coarsest_where_it_fits():
    layout = Layout(T=T, K=K, L=L, W=W, H=H, N=0)
    nodes = NodeTable.of(layout)
    scores = torch.randn(1, layout.n_nodes, generator=torch.Generator().manual_seed(0))
    assert torch.equal(coarsest_within_budget(scores, nodes)[0, 0], nodes.coarsest)


def test_a_view_holds_the_whole_history_up_to_its_blocks():
    layout = Layout(T=T, K=K, L=L, W=W, H=H, N=0)
    budget, top = W - REFOCUS, layout.top_span
    most = view_blocks(layout, budget)
    assert stream_view(most * top, layout, budget).origin == 0
    assert stream_view(most * top + 3 * top, layout, budget).origin == 3 * top


def test_generation_reads_a_far_block_its_policy_picks_past_the_coarsest_covers_reach():
    """``match`` over a history four times longer than the budget's coarsest cover reaches (28 entries of 16-token
    gists): the prompt ends by starting to repeat a distinct stretch near its beginning, and the first refocus shows
    that stretch's continuation as tokens (a view that started later, as before, could not)."""
    system = decisive(make_system(T, K, L, W, H, N=2, seed=3))
    g = torch.Generator().manual_seed(5)
    stretch = torch.arange(VOCAB - 12, VOCAB)  # ids the filler never uses
    filler = torch.randint(0, VOCAB - 12, (4 * (W - REFOCUS) * 16,), generator=g)
    prompt = torch.cat([torch.randint(0, VOCAB - 12, (40,), generator=g), stretch, filler, stretch[:4]])
    layouts_seen: list[str] = []
    generate_mc(system, prompt, 1, REFOCUS, policy=MATCH, on_refocus=lambda n, text: layouts_seen.append(text))
    continuation = slice((40 + 4) // K, (40 + 4 + REFOCUS) // K)  # what a copy reads next, before the next refocus
    assert layouts_seen and all(c == "0" for c in layouts_seen[0][continuation]), layouts_seen[0][:20]
    assert "·" in layouts_seen[0], "the history is past what the budget covers: something is left out"
