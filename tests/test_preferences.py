"""LensNet's training signal (``core/preferences.py``): I6 legality and I7 polarity as properties, I7's absolute
direction from first principles, the metrics against a hand computation, and that LensNet learns from it in one
compiled graph. The allocator is in test_allocator, LensNet's units in test_lensnet.

I7's direction: two working contexts that differ in one block, ``coarse`` (the coarsest cut) and ``fine`` (the
same cut with one gist expanded into its ``K`` children). Whichever has the lower tail loss says what the other
should do there."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
from builders import TINY_VOCAB, VOCAB, decisive, expanded, layouts, make_system, tiny_profile_system
from compile_check import assert_one_graph_equals_eager
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import MCConfig
from mcfn.core.context import assemble
from mcfn.core.nodes import NodeTable
from mcfn.core.preferences import (
    lens_losses,
    lens_metrics,
    lod_map,
    pair_margin,
    pair_slots,
    preference_targets,
)
from mcfn.core.system import build_contexts, process_batch, tree_stage
from mcfn.core.tree import build_tree
from mcfn.core.variants import (
    coarsest_cut,
    draw_variant_noise,
    recency_cut,
    sample_variants,
)
from mcfn.core.weights import LossWeights
from mcfn.geometry import coarsest_cover_size

WEIGHTS = LossWeights.of(MCConfig(), torch.device("cpu"))


def random_setup(shape: dict, batch: int, seed: int):
    system = make_system(**shape, seed=seed)
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (batch, shape["T"] + 1), generator=g)
    noise = draw_variant_noise(system.layout, batch, g, torch.device("cpu"))
    with torch.no_grad():
        wc, shown, _ = build_contexts(system, window, noise)
    tails = torch.rand(batch, system.layout.V, generator=g) * 3
    return system, wc, shown, tails


cases = st.tuples(layouts(), st.integers(1, 2), st.integers(0, 2**16))


@given(cases)
def test_property_I6_legality_of_targets(case):
    shape, batch, seed = case
    system, wc, shown, tails = random_setup(shape, batch, seed)
    table, L = system.nodes, system.layout.L
    y, _, _, rows, *_ = preference_targets(shown, tails, wc, table, WEIGHTS.temperature)
    lod, node, valid = wc.lod[rows], wc.node[rows], wc.valid[rows]
    assert not ((y != 0) & ~valid).any(), "no target on padding (I3)"
    assert not ((y > 0) & (lod == 0)).any(), "never + on LOD0"
    droppable = table.droppable_entry(node)
    assert not ((y < 0) & (lod == L) & ~droppable).any(), "a - on LODmax (a drop) only on an eligible gist"
    parent = table.parent[node]
    i, j = pair_slots(shown.size(1), shown.size(0), shown.device)
    better = torch.where(rows % system.layout.V == j, i, j)  # the other slot of each pair
    covered = table.covered_inside(shown) | table.covered_above(shown)  # [B, V, nodes]
    for b in range(y.size(0)):
        for p in range(y.size(1)):
            out_in_better = ~covered[b, better[b, p]][node[b, p]]  # [W]: better shows none of the entry's text
            for e in ((y[b, p] < 0) & (lod[b, p] == L)).nonzero().flatten().tolist():
                assert out_in_better[e], "a drop target only where the better variant leaves out"
            collapsing = ((y[b, p] < 0) & (lod[b, p] < L) & ~(droppable[b, p] & out_in_better)).nonzero().flatten()
            for e in collapsing.tolist():  # not a drop, so a group collapse
                siblings = (parent[b, p] == parent[b, p, e]) & (lod[b, p] == lod[b, p, e]) & valid[b, p]
                assert int(siblings.sum()) == shape["K"], "a collapse acts on a complete group"
                assert (y[b, p][siblings] == -1).all(), "the collapse label is shared by every sibling"
            assert not (droppable[b, p] & (lod[b, p] < L)).any(), "below LODmax nothing is droppable"


def token_targets(y: torch.Tensor, rows: torch.Tensor, wc, T: int) -> torch.Tensor:
    """Per pair, each token's target: the target of the worse variant's entry covering it."""
    out = torch.zeros(*y.shape[:2], T, dtype=torch.int64)
    start, span, valid = wc.start[rows], wc.span[rows], wc.valid[rows]
    t = torch.arange(T)
    covered = (t >= start[..., None]) & (t < (start + span)[..., None]) & valid[..., None]  # [B, P, W, T]
    return (covered * y[..., None]).sum(2) + out


@given(cases)
def test_property_I7_polarity_swap_flips_identical_gives_none(case):
    shape, batch, seed = case
    system, wc, shown, tails = random_setup(shape, batch, seed)
    layout, table, T = system.layout, system.nodes, shape["T"]
    temperature = WEIGHTS.temperature
    y, _, _, rows, *_ = preference_targets(shown, tails, wc, table, temperature)
    y_swapped, _, _, rows_swapped, *_ = preference_targets(shown, -tails, wc, table, temperature)
    assert not torch.equal(rows, rows_swapped) or layout.V == 1
    fwd, back = token_targets(y, rows, wc, T), token_targets(y_swapped, rows_swapped, wc, T)
    assert ((fwd * back) <= 0).all(), "swapping the pair flips every sign"
    # Identical variants: every slot shows the same cut, so no pair has anything to teach.
    same = shown[:, 1:2].expand_as(shown).contiguous()
    same_wc = assemble(
        build_tree(system.gistnet, system.base.embed(torch.zeros(batch, T, dtype=torch.long)), layout),
        same,
        torch.zeros(batch, T + 1, dtype=torch.long),
        table,
    )
    y_same, _, _, _, *_ = preference_targets(same, tails, same_wc, table, temperature)
    assert (y_same == 0).all()


def test_a_winning_truncation_teaches_drops_on_the_old_blocks_and_detail_on_the_recent_one():
    """I7 with left-out text: recency (slot 0) beats the coarsest cut (slot 1). The coarsest cut's LODmax gists
    over text recency leaves out get a collapse target (a drop); the ones over text recency shows as tokens
    get an expand target; the tail's tokens tie."""
    system = make_system(T=64, K=4, L=2, W=32, H=8, N=1)
    layout, table = system.layout, system.nodes
    shown = torch.stack([recency_cut(layout, 1, torch.device("cpu"))[0, 0], coarsest_cut(layout, torch.device("cpu"))])
    window = torch.zeros(1, layout.T + 1, dtype=torch.long)
    tree = build_tree(system.gistnet, system.base.embed(window[:, : layout.T]), layout)
    wc = assemble(tree, shown[None], window, table)
    y, tie, _, rows, *_ = preference_targets(shown[None], torch.tensor([[0.0, 1.0]]), wc, table, WEIGHTS.temperature)
    assert int(rows[0, 0]) == 1  # the coarsest cut is the worse one
    node, valid = wc.node[rows][0, 0], wc.valid[rows][0, 0]
    lod2, lod1 = layout.level_offsets[2], layout.level_offsets[1]
    want = {lod2 + 0: -1, lod2 + 1: -1, lod2 + 2: 1, lod1 + 12: 1, lod1 + 13: 1}  # [0,16) [16,32) gone; [32,56) tokens
    for e in range(int(valid.sum())):
        assert int(y[0, 0, e]) == want.get(int(node[e]), 0), f"entry for node {int(node[e])}"
    assert tie[0, 0][: int(valid.sum())].sum() == layout.H  # the tail's tokens: shown alike by both


@pytest.mark.heavy(16)
def test_lensnet_learns_where_detail_pays():
    """A toy with a known answer: a variant's tail loss falls with the detail it shows over one block
    (tokens 20..23), and nothing else matters. After 800 steps on the entry-wise preference term alone, LensNet
    scores the coarsest context's entry that covers that block first, far above chance."""
    system = make_system(T=64, K=4, L=2, W=32, H=8, N=3, n_embd=64)
    layout, table = system.layout, system.nodes
    lens = system.lensnet
    opt = torch.optim.Adam(lens.parameters(), lr=3e-3)
    zero, one = torch.tensor(0.0), torch.tensor(1.0)
    weights = dataclasses.replace(WEIGHTS, budget=zero, pref=one)
    block = slice(20, 24)  # tokens 20..23: inside the second LOD2 gist of the coarsest context
    g = torch.Generator().manual_seed(0)
    B = 8
    for _ in range(800):  # at 400 steps some seeds had not converged yet (0.47-1.0 over seeds 0-3)
        window = torch.randint(0, VOCAB, (B, 65), generator=g)
        noise = draw_variant_noise(layout, B, g, torch.device("cpu"))
        with torch.no_grad():
            tree = build_tree(system.gistnet, system.base.embed(window[:, :64]), layout)
            shown = sample_variants(noise, NodeTable.of(layout))
            wc = assemble(tree, shown, window, table)
        detail = (layout.L - lod_map(shown, table)[..., block].amin(-1)).float() / layout.L  # [B, V]
        tails = 2.0 - detail + 0.01 * torch.rand(B, layout.V, generator=g)  # near-ties weigh ~0.02
        loss = lens_losses(lens(wc), shown, tails, wc, table, weights).losses["loss_lens"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    window = torch.randint(0, VOCAB, (32, 65), generator=g)
    with torch.no_grad():
        tree = build_tree(system.gistnet, system.base.embed(window[:, :64]), layout)
        cut = coarsest_cut(layout, torch.device("cpu"))[None, None].expand(32, 1, -1)
        wc = assemble(tree, cut, window, table)
        scores = lens(wc)
    expandable = wc.valid & (wc.lod > 0)
    best = torch.where(expandable, scores, float("-inf")).argmax(-1)
    covers = (wc.start <= 20) & (wc.start + wc.span >= 24)
    hit = covers.gather(1, best[:, None]).float().mean()
    chance = 1 / expandable.sum(-1).float().mean()
    assert hit >= 0.6 and hit > 3 * chance, (hit, chance)  # 0.97-1.0 over seeds 0-3; chance is 0.2


@pytest.mark.heavy(14)
@pytest.mark.xdist_group("tiny-step")
def test_lens_step_is_one_graph_without_recompiles_and_equals_eager(fresh_dynamo):
    """Compiled for real (inductor, the backend training uses), on the tiny profile's system and batch, against
    eager. The model tells variants apart (``decisive``): at init their losses tie to 1e-6, and rounding would pick
    the pairs' winners, so the targets, differently in each backend."""
    system, B = tiny_profile_system()
    system = decisive(system)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(21):
        window = torch.randint(0, TINY_VOCAB, (B, system.layout.T + 1), generator=g)
        batches.append((system, window, draw_variant_noise(system.layout, B, g, torch.device("cpu")), WEIGHTS))
    assert_one_graph_equals_eager(process_batch, batches, backend="inductor", loss=lambda out: out.total())


def roomy_layouts():
    """Layouts whose budget leaves room for one expansion of the coarsest cut."""
    cover = lambda s: coarsest_cover_size(s["T"], s["K"], s["L"], s["H"])  # noqa: E731
    return layouts().filter(lambda s: s["W"] >= cover(s) + s["K"] - 1)


def coarse_and_fine(shape: dict, pick: int, seed: int):
    """The system, the two cuts as slots ``[coarse, fine]`` of one sample, their contexts, and the gist expanded."""
    system = make_system(**shape, seed=seed)
    nodes = system.nodes
    coarse = coarsest_cut(system.layout, torch.device("cpu"))
    gists = (coarse & (nodes.lod > 0)).nonzero().flatten()
    gist = int(gists[pick % gists.numel()])
    fine = expanded(coarse, gist, nodes)
    shown = torch.stack([coarse, fine])[None]  # [1, 2, nodes]
    window = torch.randint(0, VOCAB, (1, shape["T"] + 1), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        wc = assemble(tree_stage(system, window), shown, window, nodes)
    return system, shown, wc, gist


roomy_cases = st.tuples(roomy_layouts(), st.integers(0, 2**8), st.integers(0, 2**16))


@given(roomy_cases)
def test_property_I7_more_detail_that_helped_is_an_expand_target_and_the_reverse_a_collapse(case):
    shape, pick, seed = case
    system, shown, wc, gist = coarse_and_fine(shape, pick, seed)
    nodes, temperature = system.nodes, WEIGHTS.temperature
    # The fine context is better: the coarse one is told to expand exactly that gist, and nothing else.
    y, _, _, rows, *_ = preference_targets(shown, torch.tensor([[2.0, 1.0]]), wc, nodes, temperature)
    assert int(rows[0, 0]) == 0, "targets land on the worse (coarse) context"
    expected = (wc.node[0] == gist) & wc.valid[0]
    assert torch.equal(y[0, 0], expected.long())
    # The coarse context is better: the fine one is told to collapse the gist's K children, and nothing else.
    y, _, _, rows, *_ = preference_targets(shown, torch.tensor([[1.0, 2.0]]), wc, nodes, temperature)
    assert int(rows[0, 0]) == 1, "targets land on the worse (fine) context"
    children = (nodes.parent[wc.node[1]] == gist) & wc.valid[1]
    assert int(children.sum()) == shape["K"]
    assert torch.equal(y[0, 0], -children.long())


@given(roomy_cases, st.booleans())
def test_property_I7_a_gradient_step_moves_every_targeted_score_toward_its_target(case, fine_is_better):
    """One pair at a time, so no entry gets two targets; the pair always has targets (the expanded block)."""
    shape, pick, seed = case
    system, shown, wc, _ = coarse_and_fine(shape, pick, seed)
    tails = torch.tensor([[2.0, 1.0]] if fine_is_better else [[1.0, 2.0]])
    scores = torch.randn(2, shape["W"], generator=torch.Generator().manual_seed(seed)).requires_grad_()
    weights = dataclasses.replace(WEIGHTS, budget=torch.tensor(0.0))
    lens_losses(scores, shown, tails, wc, system.nodes, weights).losses["loss_lens"].backward()
    y, _, _, rows, *_ = preference_targets(shown, tails, wc, system.nodes, weights.temperature)
    targeted = y != 0
    assert targeted.any()
    step = -scores.grad[rows]  # gradient descent direction on the worse context's entries
    assert ((step * y)[targeted] > 0).all()


@given(roomy_cases)
def test_property_lens_rank_corr_reads_a_preference_for_the_first_slot_as_positive(case):
    """The evaluation correlates LensNet's preference of slot i over slot j with the measured gap
    ``nats[j] - nats[i]`` (positive when i is better): both must be positive when i is the fine context and
    LensNet scores its expanded gist as worth expanding."""
    shape, pick, seed = case
    system, shown, wc, gist = coarse_and_fine(shape, pick, seed)
    swapped = shown.flip(1)  # slot 0 fine, slot 1 coarse
    wc = wc[torch.tensor([1, 0])]
    scores = torch.where(wc.node == gist, 1.0, 0.0) * wc.valid  # "expand the gist"; nothing else matters
    i, j = pair_slots(2, 1, torch.device("cpu"))
    preference = pair_margin(scores, swapped, i, j, wc, system.nodes)
    assert i.tolist() == [[0]] and j.tolist() == [[1]] and float(preference[0, 0]) > 0


def test_lens_metrics_match_a_hand_computation():
    """Three contexts of 4 slots (padded to 3, 2 and 1 entries); three pairs on the first: one with three
    targets, one with a single target, one with none. The numbers are chosen so that no metric comes out
    right by accident (the targeted scores do not sum to zero, P differs from W, ...)."""
    scores = torch.tensor([[1.0, -2.0, 0.75, 0.0], [3.0, -1.0, 9.0, 9.0], [2.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False], [True, False, False, False]])
    s = scores[:1].expand(3, 4)[None]  # [B=1, P=3, W=4]: every pair's worse context is row 0
    y = torch.tensor([[[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    w = torch.tensor([[[0.05, 0.025, 0.1, 0.0], [0.0, 0.0, 0.05, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    out = lens_metrics(scores, valid, s, y, w)
    m = {k: float(v) for k, v in out.metrics.items()}
    assert m["mc/preference_agreement"] == 0.75  # the score's sign matches 3 of the 4 targets (not -2.0)
    assert m["mc/preference_pair_count"] == 2.0 and abs(m["mc/lens_targets_per_pair"] - 4 / 3) < 1e-6
    assert abs(m["mc/policy_score_abs_mean"] - (1 + 2 + 0.75 + 3 + 1 + 2) / 6) < 1e-6
    rows = [torch.tensor([1.0, -2.0, 0.75]), torch.tensor([3.0, -1.0]), torch.tensor([2.0])]
    assert abs(m["mc/policy_score_std_mean"] - float(sum(r.std(correction=0) for r in rows) / 3)) < 1e-6
    targeted_s, signed = torch.tensor([1.0, -2.0, 0.75, 0.75]), torch.tensor([0.05, 0.025, 0.1, 0.05])
    assert abs(m["mc/pref_span_corr"] - float(torch.corrcoef(torch.stack([targeted_s, signed]))[0, 1])) < 1e-5
    counts = out.histograms["hist/policy_score"]
    # Bins of width 0.25 from -4: -2.0 in bin 8, -1.0 in 12, 0.75 in 19, 1.0 in 20, 2.0 in 24, 3.0 in 28;
    # the padding (9.0 and the zeros) is not counted.
    assert counts.nonzero().flatten().tolist() == [8, 12, 19, 20, 24, 28] and float(counts.sum()) == 6
    one = lens_metrics(scores, valid, s[:, :1], torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]), w[:, :1])
    assert float(one.metrics["mc/preference_agreement"]) == 1.0  # a single target, and it agrees


def test_the_score_histogram_counts_bfloat16_scores_exactly_in_float32():
    """Under CUDA autocast LensNet's scores are bfloat16: CUDA's histc refuses that dtype (the MC step failed on an
    H200 until the histogram read float32), and bfloat16 counts round above 256 (1001 would read 1000)."""
    n = 1001
    scores = torch.full((1, n), 0.3).bfloat16()
    valid = torch.ones(1, n, dtype=torch.bool)
    zero = torch.zeros(1, 1, n)
    counts = lens_metrics(scores, valid, scores.float()[None], zero, zero).histograms["hist/policy_score"]
    assert counts.dtype == torch.float32 and float(counts.sum()) == n
