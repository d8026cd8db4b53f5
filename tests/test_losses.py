"""The language-model losses and their metrics (``core/losses.py``): I4 on the loss itself, and the ΔNLL and
LOD metrics against a hand computation."""

from __future__ import annotations

import pytest
import torch
from builders import cases, contexts
from hypothesis import given

from mcfn.core.context import WorkingContext
from mcfn.core.losses import loss_shares, tail_mask, tail_nll, variant_losses
from mcfn.core.nodes import Layout


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


def test_one_entry_at_a_level_is_its_own_mean():
    wc, layout = constructed_context()
    lod = wc.lod.clone()
    lod[:] = 0
    lod[2, 0] = 1  # a single gist in the whole batch
    wc.lod = lod
    nll = torch.where(lod == 1, 5.0, 1.0) * wc.valid
    out = variant_losses(nll, torch.zeros(2, 3), wc, layout).metrics
    assert float(out["mc/lod_loss/1"]) == 5.0 and float(out["mc/lod_delta/1"]) == 4.0


def test_each_kinds_share_of_the_loss_is_its_nll_over_the_whole():
    """``mc/loss_share/*`` against a loop over rows: the baseline (slot 0), the sampled slots and the allocator's (the
    last ones); padding counts for nothing."""
    layout = Layout(T=16, K=4, L=1, W=8, H=4, N=3)
    rows, width = 2 * layout.V, 8
    g = torch.Generator().manual_seed(0)
    nll = torch.rand(rows, width, generator=g)
    valid = torch.rand(rows, width, generator=g) < 0.7
    shares = loss_shares(nll, valid, layout, allocated=1)
    sums = [0.0] * 3
    for r in range(rows):
        slot = r % layout.V
        kind = 0 if slot == 0 else (2 if slot == layout.V - 1 else 1)
        sums[kind] += float((nll[r] * valid[r]).sum())
    for kind, value in zip(("baseline", "sampled", "allocator"), sums, strict=True):
        assert float(shares[f"mc/loss_share/{kind}"]) == pytest.approx(value / sum(sums), rel=1e-5)
    assert "mc/loss_share/allocator" not in loss_shares(nll, valid, layout, allocated=0)
