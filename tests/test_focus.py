"""The focus's scores: every node scored from one fixed view, the block view, so that the allocator settles (I12)."""

from __future__ import annotations

import torch
from builders import adversarial, adversarial_scores, cases, check_cut
from einops import rearrange
from hypothesis import given

from mcfn.core.allocator import allocate
from mcfn.core.focus import settle
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.variants import coarsest_cut, draw_variant_noise, sample_variants


def spread_case(case, kind: str):
    """A layout of ``case``, its coarsest cut and one compressed variant per sample, and scores
    of the ``kind`` spread from the block view."""
    shape, batch, seed = case
    layout = Layout(**shape)
    table = NodeTable.of(layout)
    noise = draw_variant_noise(layout, batch, torch.Generator().manual_seed(seed), torch.device("cpu"))
    variants = rearrange(sample_variants(noise, table)[:, 1:], "b v n -> (b v) n")
    start = torch.cat([coarsest_cut(layout, torch.device("cpu"))[None].expand(batch, -1), variants])
    return layout, table, start, table.spread_block_scores(adversarial_scores(kind, start.shape, seed))


@given(cases, adversarial)
def test_property_I12_allocator_settles_under_scores_spread_from_the_block_view(case, kind):
    """With every node scored from the block view, repeated allocator steps stop changing the cut within
    ``2 (L + 1)`` steps, from the coarsest cut or any variant, at a cut that keeps every invariant. Scores read
    from each new cut instead traded the same detail back and forth forever (LABLOG, 2026-11-25, seventh
    session)."""
    layout, table, start, scores = spread_case(case, kind)
    settled = settle(start[:, None], scores, table, 2 * (layout.L + 1))[:, 0]
    check_cut(settled, layout)
    assert torch.equal(allocate(settled, scores, table), settled)


@given(cases, adversarial)
def test_property_spread_scores_give_every_complete_group_its_parents_score(case, kind):
    """:meth:`NodeTable.spread_block_scores`: the block view's own scores stay (its LOD1 gists, and the tokens no
    eligible LOD1 gist covers); the tokens of an eligible block take its score, and a gist above LOD1 the best of
    its children's, so every group the allocator may collapse scores as the parent it collapses into."""
    layout, table, _, scores = spread_case(case, kind)
    raw = adversarial_scores(kind, scores.shape, case[2])
    in_view = table.block_view
    assert torch.equal(scores[:, in_view], raw[:, in_view])
    parents = (table.lod >= 2) | ((table.lod == 1) & table.eligible)
    assert torch.equal(table.group_reduce(scores, "amax")[:, parents], scores[:, parents])


def test_block_view_is_every_eligible_lod1_gist_and_the_tail_built_by_hand():
    """T=16, K=2, L=2, H=4: LOD1 gists [0,2) .. [10,12) and tokens 12..15, 10 entries: a cut of that width."""
    layout = Layout(T=16, K=2, L=2, W=10, H=4, N=1)
    table = NodeTable.of(layout)
    want = torch.zeros(layout.n_nodes, dtype=torch.bool)
    want[12:16] = True
    want[layout.level_offsets[1] : layout.level_offsets[1] + 6] = True
    assert torch.equal(table.block_view, want) and layout.block_view_width == 10
    check_cut(table.block_view[None], layout)
