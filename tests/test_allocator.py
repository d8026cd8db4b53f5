"""The focus allocator and the cuts it works on: I2 and I8 as properties, truncation reachable, the ``recent`` cut."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch._dynamo
from builders import adversarial, adversarial_scores, cases, check_cut, expanded, make_system
from einops import rearrange
from hypothesis import given

from mcfn.core import allocator
from mcfn.core.allocator import allocate, node_scores_of, shrink
from mcfn.core.nodes import NodeTable
from mcfn.core.variants import (
    coarsest_cut,
    draw_variant_noise,
    most_left_out,
    recency_cut,
    recent_cut,
    sample_variants,
)
from mcfn.geometry import coarsest_cover_size


def check_actions(before: torch.Tensor, after: torch.Tensor, table, K: int) -> None:
    """Only legal actions (I6, I8): every node that appeared is a child of a gist that was shown and is gone
    (an expansion), a parent that was hidden, whose complete group of K children was shown and is all gone
    (a collapse), or a droppable gist whose text was left out (a restore); every node that disappeared is
    accounted for by one of those, or is a droppable gist whose text is now left out (a drop)."""
    explained = torch.zeros_like(before)
    was_covered = table.covered_inside(before) | table.covered_above(before)
    is_out = ~(table.covered_inside(after) | table.covered_above(after))
    droppable = table.droppable
    for r, n in (before & ~after & (table.lod > 0)).nonzero().tolist():
        if is_out[r, n]:  # dropped (else expanded or collapsed, explained below)
            assert bool(droppable[n]), "only a droppable gist is dropped"
            explained[r, n] = True
    for r, n in (after & ~before).nonzero().tolist():
        parent = int(table.parent[n])
        children = table.parent == n
        if parent >= 0 and before[r, parent] and not after[r, parent]:
            explained[r, parent] = True  # expanded: its children appear
        elif not was_covered[r, n]:
            assert bool(droppable[n]), "only a droppable gist is restored"  # its text was left out
        else:
            assert int(children.sum()) == K and before[r, children].all() and not after[r, children].any(), (
                "a node appeared that is neither an expanded gist's child nor a collapsed complete group's parent"
            )
            explained[r, children] = True
    assert torch.equal(before & ~after, explained), "a node disappeared without a legal action"


def starting_cuts(system, batch: int, seed: int) -> torch.Tensor:
    """Legal cuts to start from, ``[batch * V, n_nodes]``: the coarsest cut ``batch`` times, then ``batch`` samples'
    ``V - 1`` compressed variants."""
    layout = system.layout
    noise = draw_variant_noise(layout, batch, torch.Generator().manual_seed(seed), torch.device("cpu"))
    return torch.cat(
        [
            coarsest_cut(layout, torch.device("cpu"))[None].expand(batch, -1),
            rearrange(sample_variants(noise, system.nodes)[:, 1:], "b v n -> (b v) n"),
        ]
    )


@given(cases, adversarial)
def test_property_I8_allocator_keeps_every_invariant_and_fills_the_budget(case, kind):
    shape, batch, seed = case
    system = make_system(**shape, seed=seed)
    layout, table = system.layout, system.nodes
    cut = starting_cuts(system, batch, seed)
    for it in range(layout.L + 1):
        before = cut
        cut = allocate(cut, adversarial_scores(kind, cut.shape, seed + it), table)
        check_cut(cut, layout)
        check_actions(before, cut, table, layout.K)
    # As fully as the tree allows: no room for one more expansion, or nothing left to expand; and no room
    # for a restore, or nothing left out.
    free = layout.W - cut.sum(-1)
    gists_left = (cut & (table.lod > 0)).sum(-1)
    assert ((free < layout.K - 1) | (gists_left == 0)).all()
    assert ((free == 0) | (table.left_out(cut).sum(-1) == 0)).all()


@given(cases, adversarial)
def test_property_the_allocator_ranking_gists_alone_chooses_as_ranking_every_node(case, kind):
    """The allocator sorts only the gists' slots (every set it ranks is gists): its cuts, from variants and the
    coarsest cut, and :func:`shrink`'s to a smaller budget, are the cuts of the same rules ranking all the nodes,
    ties ("equal" scores) included. Fails if a candidate set held a token, or a slice lost a level."""
    shape, batch, seed = case
    system = make_system(**shape, seed=seed)
    layout, table = system.layout, system.nodes
    cut = starting_cuts(system, batch, seed)
    small = table.with_sizes(W=layout.coarsest_cover)
    for it in range(layout.L + 1):
        scores = adversarial_scores(kind, cut.shape, seed + it)
        with mock.patch.object(allocator, "gists", lambda x, nodes: x):
            every_node = allocate(cut, scores, table), shrink(cut, scores, small)
        assert torch.equal(allocate(cut, scores, table), every_node[0])
        assert torch.equal(shrink(cut, scores, small), every_node[1])
        cut = every_node[0]


@given(cases)
def test_property_I2_compressed_variants_leave_out_only_whole_eligible_spans(case):
    """Every compressed variant is a cut (I2–I4). It leaves out at most :func:`most_left_out` top-level blocks,
    each freeing one entry for detail, and with the noise at its top exactly that many."""
    shape, batch, seed = case
    layout = make_system(**shape, seed=seed).layout
    table = NodeTable.of(layout)
    noise = draw_variant_noise(layout, batch, torch.Generator().manual_seed(seed), torch.device("cpu"))
    cuts = sample_variants(noise, table)[:, 1:]
    check_cut(rearrange(cuts, "b n x -> (b n) x"), layout)
    n_left_out = table.left_out(cuts).sum(-1)
    assert (n_left_out <= most_left_out(layout)).all()
    noise.leave_out = torch.full_like(noise.leave_out, 0.999)
    assert (table.left_out(sample_variants(noise, table)[:, 1:]).sum(-1) == most_left_out(layout)).all()


@pytest.mark.parametrize("offset", [0.0, -1000.0, 1000.0])
def test_allocator_reaches_truncation_when_scores_fall_with_age_whatever_their_sign(offset):
    """From the coarsest cut, with every node scored by where it ends, three allocator steps give exactly the
    recency cut: old blocks left out, the rest expanded to tokens. Only the order counts: the same scores
    shifted all below zero, or all above, give the same cut. Truncation is a cut the policy can reach (I8)."""
    layout = make_system(T=64, K=4, L=2, W=32, H=8, N=1).layout
    table = NodeTable.of(layout)
    end = (table.start + table.span).float()
    scores = (torch.where(end > layout.T - layout.W, end, -100.0 + end) + offset)[None]
    cut = coarsest_cut(layout, torch.device("cpu"))[None]
    for _ in range(3):
        before, cut = cut, allocate(cut, scores, table)
        check_cut(cut, layout)
        check_actions(before, cut, table, layout.K)
    assert torch.equal(cut, recency_cut(layout, 1, torch.device("cpu"))[:, 0])


def test_recent_cut_is_the_newest_detail_first_built_by_hand():
    """T=64, K=4, L=2, H=8, W=22: the coarsest cut (13 entries) expands its newest gist while one fits: LOD1
    [52,56), then LOD1 [48,52), then LOD2 [32,48): LOD2 [0,16) [16,32), LOD1 [32,48) and tokens [48,64)."""
    layout = make_system(T=64, K=4, L=2, W=22, H=8, N=1).layout
    want = torch.zeros(layout.n_nodes, dtype=torch.bool)
    want[48:64] = True
    want[layout.level_offsets[1] + 8 : layout.level_offsets[1] + 12] = True
    want[layout.level_offsets[2] + 0 : layout.level_offsets[2] + 2] = True
    assert int(want.sum()) == 22
    assert torch.equal(recent_cut(layout, torch.device("cpu")), want)
    check_cut(want[None], layout)


@given(cases, adversarial)
def test_property_I8_allocator_shrink_gets_back_within_any_budget_by_collapses_alone(case, kind):
    """From legal cuts, any smaller budget down to the coarsest cover: each call collapses the
    ``ceil(excess / (K - 1))`` lowest-mean complete groups (all there are, if fewer), whatever their sign, and
    nothing else; repeated calls reach the budget. Rows already within it never change."""
    shape, batch, seed = case
    system = make_system(**shape, seed=seed)
    layout, table = system.layout, system.nodes
    noise = draw_variant_noise(layout, batch, torch.Generator().manual_seed(seed), torch.device("cpu"))
    cut = rearrange(sample_variants(noise, table)[:, 1:], "b v n -> (b v) n")  # the compressed variants
    budget = layout.coarsest_cover + seed % (layout.W - layout.coarsest_cover + 1)
    small = table.with_sizes(W=budget)
    for it in range(layout.T):
        scores = adversarial_scores(kind, cut.shape, seed + it)
        after = shrink(cut, scores, small)
        check_cut(after, layout)
        groups = table.collapsible(cut)
        chosen = after & ~cut
        assert (chosen <= groups).all(), "only complete groups collapse"
        excess = (cut.sum(-1) - budget).clamp(min=0)
        want = torch.minimum(-(-excess // (layout.K - 1)), groups.sum(-1))
        assert torch.equal(chosen.sum(-1), want)
        assert torch.equal(after.sum(-1), cut.sum(-1) - want * (layout.K - 1))
        mean = table.group_reduce(scores, "mean")
        worst_kept = torch.where(groups & ~chosen, mean, float("inf")).amin(-1)
        assert (torch.where(chosen, mean, float("-inf")).amax(-1) <= worst_kept).all(), "the lowest groups go first"
        if torch.equal(after, cut):
            break
        cut = after
    assert (cut.sum(-1) <= budget).all()


def test_allocator_shrink_collapses_positive_groups_when_it_must_and_leaves_a_cut_within_budget():
    """Unlike :func:`allocate`, :func:`shrink` collapses groups whose children all want detail, since the cut
    must fit; a cut within the budget stays as it is."""
    layout = make_system(T=64, K=4, L=2, W=22, H=8, N=1).layout
    nodes = NodeTable.of(layout)
    cut = lod2_cut(layout, [0, 1, 2])  # 3 LOD2 gists expanded: 12 LOD1 + 2 LOD1 + 8 tokens = 22 entries
    assert int(cut.sum()) == 22
    scores = torch.ones(1, layout.n_nodes)
    lod1 = layout.level_offsets[1]
    scores[0, lod1 + 4 : lod1 + 8] = 0.5  # the second LOD2 gist's children: the lowest mean
    assert torch.equal(shrink(cut, scores, nodes), cut)
    assert torch.equal(shrink(cut, scores, nodes.with_sizes(W=19)), lod2_cut(layout, [0, 2]))
    assert torch.equal(shrink(cut, scores, nodes.with_sizes(W=18)), lod2_cut(layout, [2]))  # 7 over: two groups


def test_allocator_expands_the_best_and_collapses_the_worst_to_make_room():
    layout = make_system(T=64, K=4, L=2, W=22, H=8, N=1).layout
    table = NodeTable.of(layout)
    cut = coarsest_cut(layout, torch.device("cpu"))[None]  # 3 LOD2 + 2 LOD1 + 8 tokens = 13 entries
    assert int(cut.sum()) == coarsest_cover_size(64, 4, 2, 8) == 13
    lod2 = layout.level_offsets[2]
    scores = torch.zeros(1, layout.n_nodes)
    scores[0, lod2 + 1] = 5.0  # expand the second LOD2 gist first
    cut = allocate(cut, scores, table)  # 13 + 3 = 16 entries; free 6 -> two expansions fit
    assert not cut[0, lod2 + 1] and cut[0, layout.level_offsets[1] + 4 : layout.level_offsets[1] + 8].all()
    assert int(cut.sum()) == layout.W  # the spare budget went to the best-scoring expansions
    # The budget is full: a strongly positive LOD1 gist gets its room from the most negative complete group.
    lod1 = layout.level_offsets[1]
    gist = int((cut[0, lod1 : lod1 + layout.level_sizes[1]].nonzero().flatten() + lod1)[0])
    groups = [
        p
        for p in range(lod1, lod1 + layout.level_sizes[1])
        if cut[0, (p - lod1) * 4 : (p - lod1) * 4 + 4].all() and table.eligible[p]
    ]
    scores = torch.zeros(1, layout.n_nodes)
    scores[0, gist] = 9.0
    scores[0, (groups[0] - lod1) * 4 : (groups[0] - lod1) * 4 + 4] = -5.0
    swapped = allocate(cut, scores, table)
    check_cut(swapped, layout)
    assert not swapped[0, gist] and swapped[0, (gist - lod1) * 4 : (gist - lod1) * 4 + 4].all()
    assert swapped[0, groups[0]] and int(swapped.sum()) == layout.W


def lod2_cut(layout, gists: list[int]) -> torch.Tensor:
    """The coarsest cut with the given LOD2 gists (by index within their level) expanded into their LOD1 children."""
    nodes, cut = NodeTable.of(layout), coarsest_cut(layout, torch.device("cpu"))[None]
    for j in gists:
        cut = expanded(cut, layout.level_offsets[2] + j, nodes)
    return cut


def test_allocator_pays_for_positive_expansions_beyond_the_free_budget_by_collapses():
    """Room for one expansion, two positive gists, one negative complete group: both gists expand, the group
    collapses, and the budget ends full."""
    layout = make_system(T=64, K=4, L=2, W=19, H=8, N=1).layout
    nodes, lod2 = NodeTable.of(layout), layout.level_offsets[2]
    cut = lod2_cut(layout, [0])  # 16 entries: free 3, one expansion's worth
    scores = torch.zeros(1, layout.n_nodes)
    scores[0, lod2 + 1], scores[0, lod2 + 2] = 0.5, 0.25  # positive, if only just
    scores[0, nodes.parent == lod2] = -0.5  # the complete group of LOD2 gist 0's children: negative, if only just
    assert torch.equal(allocate(cut, scores, nodes), lod2_cut(layout, [1, 2]))


def test_allocator_swaps_when_an_expansion_outscores_a_group_whatever_the_signs():
    """The budget is full and every score is negative: the best gist (-0.5) still takes the room of the group
    whose best child scores -5; against a group whose best child ties it, nothing swaps."""
    layout = make_system(T=64, K=4, L=2, W=19, H=8, N=1).layout
    nodes, lod2 = NodeTable.of(layout), layout.level_offsets[2]
    cut = lod2_cut(layout, [1, 2])  # 19 entries: the budget is full
    scores = torch.full((1, layout.n_nodes), -1.0)
    scores[0, lod2] = -0.5  # LOD2 gist 0: the best expansion, if below zero
    scores[0, nodes.parent == lod2 + 1] = -5.0
    assert torch.equal(allocate(cut, scores, nodes), lod2_cut(layout, [0, 2]))
    scores[0, nodes.parent == lod2 + 1] = -0.5
    scores[0, nodes.parent == lod2 + 2] = -0.5
    assert torch.equal(allocate(cut, scores, nodes), cut)


def test_allocator_scores_a_group_by_its_best_child_and_never_reads_hidden_nodes():
    """A group whose children average -2.75 but whose best child scores 1.0 keeps its detail against a gist
    scoring 1.0: collapsing it would give up that child. At 0.99 it pays for the expansion. Scores of nodes
    the cut hides are never read."""
    layout = make_system(T=64, K=4, L=2, W=16, H=8, N=1).layout
    nodes, lod2 = NodeTable.of(layout), layout.level_offsets[2]
    cut = lod2_cut(layout, [1])  # 16 entries: the budget is full, one complete group (LOD2 gist 1's children)
    scores = torch.where(cut, 0.0, -9.0)  # hidden nodes: anything
    scores[0, lod2] = 1.0  # LOD2 gist 0 wants to expand
    children = (nodes.parent == lod2 + 1).nonzero().flatten()
    scores[0, children] = torch.tensor([-5.0, -5.0, -5.0, 1.0])
    assert torch.equal(allocate(cut, scores, nodes), cut)
    scores[0, children[-1]] = 0.99
    assert torch.equal(allocate(cut, scores, nodes), lod2_cut(layout, [0]))


def test_allocator_pays_for_each_unpaid_expansion_by_the_lowest_group_while_it_scores_higher():
    """Room for one expansion; gists at 0.5, 0.4, 0.3 and the rest at -3.5; groups at -5, -4, -3. The first
    gist fills the room, the next two take the two lowest groups, and the third group (-3) stays: the next
    expansion (-3.5) does not outscore it."""
    layout = make_system(T=128, K=4, L=2, W=29, H=8, N=1).layout
    nodes, lod2 = NodeTable.of(layout), layout.level_offsets[2]
    cut = lod2_cut(layout, [0, 1, 2])  # 17 + 3 * 3 = 26 entries: free 3
    scores = torch.full((1, layout.n_nodes), -3.5)
    scores[0, lod2 + 3 : lod2 + 6] = torch.tensor([0.5, 0.4, 0.3])
    for j, value in enumerate((-5.0, -4.0, -3.0)):
        scores[0, nodes.parent == lod2 + j] = value
    assert torch.equal(allocate(cut, scores, nodes), lod2_cut(layout, [2, 3, 4, 5]))


def test_allocator_pays_by_drops_only_while_the_expansion_outscores_every_drop_it_takes():
    """No complete group and the budget full: an expansion costs K - 1 = 3 drops. The LOD1 gist at -1
    outscores the three oldest blocks (-9, -8, -7) and takes their entries. The next best expansion, a block at
    -2, would need the next three lowest, the highest of which ties it: a tie does not swap."""
    layout = make_system(T=128, K=4, L=2, W=17, H=8, N=1).layout
    nodes, lod2 = NodeTable.of(layout), layout.level_offsets[2]
    cut = coarsest_cut(layout, torch.device("cpu"))[None]  # 7 LOD2 + 2 LOD1 + 8 tokens = 17: full
    assert int(cut.sum()) == layout.W
    scores = torch.full((1, layout.n_nodes), -9.0)
    scores[0, lod2 : lod2 + 7] = torch.tensor([-9.0, -8.0, -7.0, -3.0, -2.5, -2.0, -2.0])
    scores[0, layout.level_offsets[1] + 28 : layout.level_offsets[1] + 30] = torch.tensor([-1.0, -9.5])
    after = allocate(cut, scores, nodes)
    check_cut(after, layout)
    want = cut.clone()
    want[0, lod2 : lod2 + 3] = False  # the three oldest blocks left out
    want = expanded(want, layout.level_offsets[1] + 28, nodes)
    assert torch.equal(after, want)


def test_node_scores_land_on_their_nodes_and_padding_is_dropped():
    scores = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    node = torch.tensor([[5, 1, 0], [2, 3, 0]])
    valid = torch.tensor([[True, True, False], [True, False, False]])
    expected = torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(node_scores_of(scores, node, valid, 7), expected)  # an odd node count (K=3 trees have them)
