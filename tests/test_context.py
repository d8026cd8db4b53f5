"""The packed working contexts (``core/context.py``): I3 (padding touches nothing valid, in LensNet and the base
model), gists at their span's centre with the packed forward reading their spans, and I11 (a cut is chosen from
nothing after its horizon)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from builders import awake, cases, contexts, padded_contexts, rewritten_after
from hypothesis import given
from hypothesis import strategies as st

from mcfn.core.context import assemble, seen_until
from mcfn.core.focus import refocus
from mcfn.core.policy import ATTN, LENS
from mcfn.core.system import base_stage, tree_stage
from mcfn.core.variants import coarsest_cut


@given(cases)
def test_property_I3_valid_entries_ignore_padding_in_lensnet_and_the_base_model(case):
    shape, batch, seed = case
    system, window, _ = contexts(shape, batch, seed)
    wc = padded_contexts(awake(system), window)
    pad = ~wc.valid
    assert pad.any()
    g = torch.Generator().manual_seed(seed)
    noisy = wc.clone()
    noisy.emb = torch.where(pad[..., None], torch.randn(wc.emb.shape, generator=g) * 10, wc.emb)
    noisy.position = torch.where(pad, torch.rand(wc.position.shape, generator=g) * 1e4, wc.position)
    noisy.span = torch.where(pad, torch.randint(1, 64, wc.span.shape, generator=g), wc.span)
    noisy.lod = torch.where(pad, torch.randint(0, shape["L"] + 1, wc.lod.shape, generator=g), wc.lod)
    with torch.no_grad():
        scores, scores_noisy = system.lensnet(wc), system.lensnet(noisy)
        nll, nll_noisy = (system.base.nll(base_stage(system, x), x.target) for x in (wc, noisy))
    torch.testing.assert_close(scores[wc.valid], scores_noisy[wc.valid])
    assert (scores_noisy[pad] == 0).all()
    torch.testing.assert_close(nll[wc.valid], nll_noisy[wc.valid])
    assert (nll_noisy[pad] == 0).all()


@given(cases)
def test_property_gists_sit_at_their_span_centre_and_the_packed_forward_reads_their_spans(case):
    """Entry positions are span centres, and the packed forward over padded rows equals a direct forward over
    each row's valid entries at those positions and spans."""
    shape, batch, seed = case
    system, window, wc = contexts(shape, batch, seed)
    awake(system)
    valid = wc.valid
    torch.testing.assert_close(wc.position[valid], (wc.start + (wc.span - 1) / 2).float()[valid])
    base = system.base
    with torch.no_grad():
        packed = base.nll(base_stage(system, wc), wc.target)
        for r in range(wc.batch_size[0]):
            n = int(valid[r].sum())
            position = (wc.start[r, :n] + (wc.span[r, :n] - 1) / 2).float()[None]
            logits = base.logits(base.hidden(wc.emb[r : r + 1, :n], position, wc.span[r : r + 1, :n].float()))
            targets = window[r // (shape["N"] + 1)][wc.start[r, :n] + wc.span[r, :n]]
            direct = F.cross_entropy(logits[0], targets, reduction="none")
            torch.testing.assert_close(packed[r, :n], direct, atol=1e-5, rtol=1e-5)


def assert_chosen_before(shape: dict, batch: int, seed: int, horizon: torch.Tensor) -> None:
    """Rewriting every token after ``horizon [batch]`` changes neither what :func:`seen_until` lets a scorer read
    nor the cuts that LensNet or the ``attn`` focus choose from the coarsest cut."""
    system, window, _ = contexts(shape, batch, seed)
    system = awake(system).eval()
    H = shape["H"]
    rewritten = rewritten_after(window, horizon, seed=1)
    start = coarsest_cut(system.layout, torch.device("cpu"))[None, None].expand(batch, 1, -1)
    both = [(tree_stage(system, w), w) for w in (window, rewritten)]
    for policy in (LENS, ATTN):
        cuts = [
            refocus(
                policy.scorer(system, w, system.layout, H), tree, w, start, system.nodes, iterations=2, horizon=horizon
            )
            for tree, w in both
        ]
        assert torch.equal(*cuts), policy.name
    seen = [seen_until(assemble(tree, start, w, system.nodes), horizon) for tree, w in both]
    assert torch.equal(seen[0].valid, seen[1].valid) and not (seen[0].valid & (seen[0].start > horizon[:, None])).any()
    with torch.no_grad():
        torch.testing.assert_close(system.lensnet(seen[0]), system.lensnet(seen[1]))


@given(cases, st.data())
def test_property_I11_a_cut_is_chosen_from_nothing_after_its_horizon(case, data):
    """I11 on any tree shape, at any horizon inside the tail (the first scored prediction's position)."""
    shape, batch, seed = case
    T, H = shape["T"], shape["H"]
    horizon = data.draw(st.lists(st.integers(T - H, T - 1), min_size=batch, max_size=batch))
    assert_chosen_before(shape, batch, seed, torch.tensor(horizon))


def test_I11_on_a_shape_where_the_tail_would_change_the_cuts():
    """A shape with room to choose (many of Hypothesis' smallest draw none): read past the horizon, both scorers'
    cuts would change here (checked by taking ``seen_until`` out of :func:`refocus`)."""
    shape = {"T": 64, "K": 4, "L": 2, "W": 32, "H": 8, "N": 2}
    assert_chosen_before(shape, 2, 3, torch.tensor([56, 60]))
