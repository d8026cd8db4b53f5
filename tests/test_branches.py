"""One policy in branches (mcfn.core.branches): LensNet's few sure picks lead, match's votes order the rest."""

from __future__ import annotations

import torch
from builders import make_system, spread_lens
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.branches import LEAD, branch_scores
from mcfn.core.context import WorkingContext
from mcfn.core.focus import focus_scores
from mcfn.core.policy import MATCH, POLICIES
from mcfn.core.system import tree_stage


def block_view(lods: list[int], valid: list[bool]) -> WorkingContext:
    n = len(lods)
    zeros = torch.zeros(1, n, dtype=torch.int64)
    return WorkingContext(
        emb=torch.zeros(1, n, 4), position=torch.arange(n).float()[None], start=torch.arange(n)[None],
        span=torch.ones(1, n, dtype=torch.int64), lod=torch.tensor([lods]), node=zeros, target=zeros - 1,
        valid=torch.tensor([valid]), batch_size=[1, n],
    )  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.floats(-5, 5), st.floats(-1, 20)), min_size=1, max_size=24),
    st.integers(1, 3),
    st.sampled_from([0.0, 1.0, 1.5]),
)
def test_property_branches_lead_with_lensnets_sure_far_picks_and_their_neighbours_ranked_by_confidence(
    entries, picks, sure_z
):
    """The legality of a combined score: the leads are LensNet's ``picks`` highest far (gist) entries that stand more
    than ``sure_z`` standard deviations above the row's far entries (computed here by hand) and the far entry after
    each, never a tail token or padding; a lead scores LEAD plus its own z, so leads rank by LensNet's confidence;
    every other entry keeps match's score, so match orders the rest."""
    lods, valid, learned, votes = (list(column) for column in zip(*entries, strict=True))
    out = branch_scores(torch.tensor([learned]), torch.tensor([votes]), block_view(lods, valid), picks, sure_z)[0]
    far = [i for i, (lod, ok) in enumerate(zip(lods, valid, strict=True)) if ok and lod > 0]
    if len({learned[i] for i in far}) < len(far):
        return  # ties among the far scores: which of them top-k keeps is arbitrary
    mean = sum(learned[i] for i in far) / max(1, len(far))
    spread = (sum((learned[i] - mean) ** 2 for i in far) / max(1, len(far))) ** 0.5
    top = sorted(far, key=lambda i: -learned[i])[:picks]
    # float32 against float64: leave out the entries within rounding of the bar
    near = [i for i in top if abs(learned[i] - mean - sure_z * spread) < 1e-4]
    if near or spread < 1e-6:
        return
    picked = {i for i in top if learned[i] - mean > sure_z * spread}
    led = picked | {i + 1 for i in picked if i + 1 in far}
    for i in range(len(entries)):
        expected = LEAD + (learned[i] - mean) / spread if i in led else votes[i]
        assert abs(float(out[i]) - expected) < 1e-2, (i, float(out[i]), expected)


def test_branches_node_scores_are_matchs_but_where_lensnets_pick_leads():
    """On tiny systems whose LensNets score widely, the branches policy's node scores (read from the block view and
    spread to every level, as a refocus reads them) equal match's everywhere but where LensNet's sure pick (or the
    block after it) leads; some LensNet among them is sure of a pick. Fails with the lead added to every pick, sure
    or not, or match's scores replaced instead of led."""
    T, led, systems = 256, 0, 12  # long enough for a far entry 3 SDs above the rest (SURE_Z): 3 of these 12
    for seed in range(systems):
        system = spread_lens(make_system(T, 4, 2, 32, 16, N=2, seed=0), seed=seed)
        window = torch.randint(0, 100, (1, T + 1), generator=torch.Generator().manual_seed(seed))
        tree = tree_stage(system, window)
        scores = {
            p.name: focus_scores(p.scorer(system, window, system.layout, 4), tree, window, system.nodes)
            for p in (POLICIES["branches"], MATCH)
        }
        differ = scores["branches"] != scores["match"]
        assert bool((scores["branches"][differ] > LEAD / 2).all())
        led += int(differ.any())
    assert 0 < led < systems, "the test needs LensNets that are sure of a pick and ones that are not"
