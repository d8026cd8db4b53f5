"""The packed forward and the numbers read off it: I3 for LensNet, I4 on the loss itself, gist positions and
spans, and the ΔNLL and LOD metrics against a hand computation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from test_mc import cases, contexts

from mcfn.core.context import WorkingContext, assemble
from mcfn.core.losses import tail_mask, tail_nll, variant_losses
from mcfn.core.nodes import Layout
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
def test_property_I4_the_loss_scores_the_same_H_targets_in_every_variant(case):
    """The tail the loss reads: in every row, exactly the entries of tokens T-H..T-1, whose targets are the
    window's last H tokens; the tail NLL is their mean NLL, whatever the padding."""
    shape, batch, seed = case
    system, window, wc = contexts(shape, batch, seed)
    T, H, V = shape["T"], shape["H"], shape["N"] + 1
    mask = tail_mask(wc, system.layout)
    for r in range(wc.batch_size[0]):
        assert wc.start[r][mask[r]].tolist() == list(range(T - H, T))
        assert (wc.lod[r][mask[r]] == 0).all()
        assert torch.equal(wc.target[r][mask[r]], window[r // V, T - H + 1 : T + 1])
    nll = torch.rand(wc.valid.shape, generator=torch.Generator().manual_seed(seed)) * wc.valid
    expected = torch.stack([nll[r][(wc.start[r] >= T - H) & wc.valid[r]].mean() for r in range(nll.size(0))])
    torch.testing.assert_close(tail_nll(nll, wc, system.layout).flatten(), expected)


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


def constructed_context() -> tuple[WorkingContext, Layout]:
    """B=2 samples, V=3 variants, W=4 entries: tokens (LOD0) and LOD1 gists, the last entry of row 5 padding."""
    layout = Layout(T=8, K=2, L=1, W=4, H=2, N=2)
    lod = torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]] * 2)
    valid = torch.ones(6, 4, dtype=torch.bool)
    valid[5, 3] = False
    span = 2**lod
    zeros = torch.zeros(6, 4, dtype=torch.int64)
    wc = WorkingContext(
        emb=torch.zeros(6, 4, 1), position=zeros.float(), start=zeros, span=span, lod=lod, node=zeros,
        target=zeros, valid=valid, batch_size=[6, 4],
    )  # fmt: skip
    return wc, layout


def test_delta_nll_and_lod_metrics_match_a_hand_computation():
    wc, layout = constructed_context()
    nll = torch.where(wc.lod == 1, 3.0, 1.0) * wc.valid  # gists predict worse than tokens: by 2 nats
    tails = torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 3.0]])  # [B, V]
    out = variant_losses(nll, tails, wc, layout).metrics
    delta = torch.tensor([1.0, -0.5, -1.0, 1.0])  # compressed minus baseline, per sample and variant
    assert float(out["mc/adv_delta_mean"]) == 0.125
    torch.testing.assert_close(out["mc/adv_delta_std"], delta.std(correction=0))
    assert float(out["mc/adv_delta_p95"]) == 1.0  # sorted -1, -0.5, 1, 1: the 95th percentile is 1
    assert float(out["mc/lod_delta/1"]) == 2.0 and float(out["mc/lod_delta/0"]) == 0.0
    assert float(out["mc/lod_loss/1"]) == 3.0 and float(out["mc/lod_loss/0"]) == 1.0
    assert float(out["mc/lod_count/1"]) == 6 / 6  # three gists in each sample's three rows: 6 over 6 rows
    assert float(out["mc/tail_loss_baseline"]) == 1.5 and float(out["mc/tail_loss_compressed"]) == 1.625


def test_lens_weights_map_each_setting_to_its_term():
    from mcfn.config import GistConfig, LensConfig, MCConfig, TeacherConfig
    from mcfn.core.weights import LossWeights

    lens = LensConfig(
        weight=2.0,
        pref_weight=3.0,
        budget_weight=5.0,
        temperature=13.0,
        attention_weight=17.0,
    )
    teacher = TeacherConfig(full_weight=19.0, distill_weight=23.0)
    mc = MCConfig(lens=lens, teacher=teacher, gist=GistConfig(recon_weight=29.0))
    weights = LossWeights.of(mc, torch.device("cpu"))
    expected = {
        "lens": 2.0,
        "pref": 3.0,
        "budget": 5.0,
        "temperature": 13.0,
        "attention": 17.0,
        "full": 19.0,
        "distill": 23.0,
        "recon": 29.0,
    }
    assert weights.values() == expected
    assert all(getattr(weights, name).ndim == 0 for name in expected)


def test_lens_metrics_match_a_hand_computation():
    """Three contexts of 4 slots (padded to 3, 2 and 1 entries); three pairs on the first: one with three
    targets, one with a single target, one with none. The numbers are chosen so that no metric comes out
    right by accident (the targeted scores do not sum to zero, P differs from W, ...)."""
    from mcfn.core.preferences import lens_metrics

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


def test_one_entry_at_a_level_is_its_own_mean():
    wc, layout = constructed_context()
    lod = wc.lod.clone()
    lod[:] = 0
    lod[2, 0] = 1  # a single gist in the whole batch
    wc.lod = lod
    nll = torch.where(lod == 1, 5.0, 1.0) * wc.valid
    out = variant_losses(nll, torch.zeros(2, 3), wc, layout).metrics
    assert float(out["mc/lod_loss/1"]) == 5.0 and float(out["mc/lod_delta/1"]) == 4.0
