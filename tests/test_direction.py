"""I7 from first principles: the absolute direction of LensNet's targets and of a gradient step on them.

Two working contexts that differ in one block: ``coarse`` (the coarsest cut) and ``fine`` (the same cut with one
gist expanded into its ``K`` children). Whichever has the lower tail loss says what the other should do there.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given
from hypothesis import strategies as st
from test_allocator import expanded
from test_lens import WEIGHTS
from test_mc import VOCAB, layouts, make_system

from mcfn.config import coarsest_cover_size
from mcfn.core.context import assemble
from mcfn.core.preferences import lens_losses, pair_slots, preference_targets
from mcfn.core.system import tree_stage
from mcfn.core.variants import coarsest_cut
from mcfn.tools.evaluation import predicted_preference


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


cases = st.tuples(roomy_layouts(), st.integers(0, 2**8), st.integers(0, 2**16))


@given(cases)
def test_property_I7_more_detail_that_helped_is_an_expand_target_and_the_reverse_a_collapse(case):
    shape, pick, seed = case
    system, shown, wc, gist = coarse_and_fine(shape, pick, seed)
    nodes, temperature = system.nodes, WEIGHTS.temperature
    # The fine context is better: the coarse one is told to expand exactly that gist, and nothing else.
    y, _, _, rows = preference_targets(shown, torch.tensor([[2.0, 1.0]]), wc, nodes, temperature)
    assert int(rows[0, 0]) == 0, "targets land on the worse (coarse) context"
    expected = (wc.node[0] == gist) & wc.valid[0]
    assert torch.equal(y[0, 0], expected.long())
    # The coarse context is better: the fine one is told to collapse the gist's K children, and nothing else.
    y, _, _, rows = preference_targets(shown, torch.tensor([[1.0, 2.0]]), wc, nodes, temperature)
    assert int(rows[0, 0]) == 1, "targets land on the worse (fine) context"
    children = (nodes.parent[wc.node[1]] == gist) & wc.valid[1]
    assert int(children.sum()) == shape["K"]
    assert torch.equal(y[0, 0], -children.long())


@given(cases, st.booleans())
def test_property_I7_a_gradient_step_moves_every_targeted_score_toward_its_target(case, fine_is_better):
    """One pair at a time, so no entry gets two targets; the pair always has targets (the expanded block)."""
    shape, pick, seed = case
    system, shown, wc, _ = coarse_and_fine(shape, pick, seed)
    tails = torch.tensor([[2.0, 1.0]] if fine_is_better else [[1.0, 2.0]])
    scores = torch.randn(2, shape["W"], generator=torch.Generator().manual_seed(seed)).requires_grad_()
    weights = dataclasses.replace(WEIGHTS, budget=torch.tensor(0.0))
    lens_losses(scores, shown, tails, wc, system.nodes, weights).losses["loss_lens"].backward()
    y, _, _, rows = preference_targets(shown, tails, wc, system.nodes, weights.temperature)
    targeted = y != 0
    assert targeted.any()
    step = -scores.grad[rows]  # gradient descent direction on the worse context's entries
    assert ((step * y)[targeted] > 0).all()


@given(cases)
def test_property_lens_rank_corr_reads_a_preference_for_the_first_slot_as_positive(case):
    """The evaluation correlates LensNet's preference of slot i over slot j with the measured gap
    ``nats[j] - nats[i]`` (positive when i is better): both must be positive when i is the fine context and
    LensNet scores its expanded gist as worth expanding."""
    shape, pick, seed = case
    system, shown, wc, gist = coarse_and_fine(shape, pick, seed)
    swapped = shown.flip(1)  # slot 0 fine, slot 1 coarse
    wc = wc[torch.tensor([1, 0])]
    scores = torch.where(wc.node == gist, 1.0, 0.0) * wc.valid  # "expand the gist"; nothing else matters
    preference = predicted_preference(scores, swapped, wc, system.nodes)
    i, j = pair_slots(2, 1, torch.device("cpu"))
    assert i.tolist() == [[0]] and j.tolist() == [[1]] and float(preference[0, 0]) > 0
