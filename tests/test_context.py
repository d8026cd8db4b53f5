"""The packed working contexts (``core/context.py``): I3 (padding touches nothing valid, in LensNet and the base
model), and gists at their span's centre with the packed forward reading their spans."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from test_mc import cases, contexts

from mcfn.core.context import WorkingContext, assemble
from mcfn.core.system import MegaContext, base_stage, tree_stage
from mcfn.core.variants import coarsest_cut


def awake(system: MegaContext) -> MegaContext:
    """Output projections start at zero, so a new model's attention changes nothing: wake them up, so that
    what an entry attends to (padding, positions, spans) shows in the outputs."""
    with torch.no_grad():
        for name, p in system.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, std=0.3)
    return system


def padded_contexts(system: MegaContext, window: torch.Tensor) -> WorkingContext:
    """Every sample's coarsest cut in rows of T slots: mostly padding."""
    nodes = system.nodes.with_sizes(W=system.layout.T)
    cut = coarsest_cut(system.layout, torch.device("cpu"))[None, None].expand(window.size(0), 1, -1)
    with torch.no_grad():
        return assemble(tree_stage(system, window), cut, window, nodes)


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
            logits = base.forward_entries(wc.emb[r : r + 1, :n], position, wc.span[r : r + 1, :n].float())
            targets = window[r // (shape["N"] + 1)][wc.start[r, :n] + wc.span[r, :n]]
            direct = F.cross_entropy(logits[0], targets, reduction="none")
            torch.testing.assert_close(packed[r, :n], direct, atol=1e-5, rtol=1e-5)
