"""LensNet's units: the units it reads are the cut's gists and its K-aligned blocks of tokens,
at most T/K of them, and every entry's score is its unit's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from builders import awake, cases, contexts, make_system, padded_contexts
from hypothesis import given
from hypothesis import strategies as st

from mcfn.core.context import WorkingContext
from mcfn.core.units import block_units, newest_read, pool_blocks


def block_contexts(shape: dict, batch: int, seed: int):
    system, window, wc = contexts(shape, batch, seed)
    return awake(system), window, wc


@given(cases)
def test_property_block_units_are_the_cuts_gists_and_its_aligned_token_blocks(case):
    """Pooled, every cut is again a cut in start order (gaps only where whole top-level blocks are left out), in
    at most T/K units: each gist
    alone (its own start, span, LOD and embedding), each K-aligned block of tokens as one unit at LOD0 with
    the mean of their embeddings (span K; the recency baseline may begin inside a block); positions are the
    span centres."""
    shape, batch, seed = case
    system, _, wc = block_contexts(shape, batch, seed)
    T, K = shape["T"], shape["K"]
    units = min(shape["W"], T // K)
    unit = block_units(wc, K, units)
    pooled = pool_blocks(wc, unit, units)
    assert (pooled.valid[:, :-1] >= pooled.valid[:, 1:]).all(), "valid units are a prefix"
    for r in range(wc.batch_size[0]):
        n, m = int(wc.valid[r].sum()), int(pooled.valid[r].sum())
        starts, spans, lods = (x[r, :m].tolist() for x in (pooled.start, pooled.span, pooled.lod))
        first = starts[0]  # the recency baseline begins at T - W; the others at 0 or after left-out blocks
        top = K ** shape["L"]
        ends = [a + s for a, s in zip(starts, spans, strict=True)]
        for end, following in zip(ends[:-1], starts[1:], strict=True):
            assert end == following or (end % top == 0 and following > end and (following - end) % top == 0), (
                "units follow each other, or a gap is whole left-out top-level blocks"
            )
        assert starts[-1] + spans[-1] == T
        assert m == sum(k > 0 for k in wc.lod[r, :n].tolist()) + sum(
            s % K == 0 for s, k in zip(wc.start[r, :n].tolist(), wc.lod[r, :n].tolist(), strict=True) if k == 0
        ) + (first % K != 0)
        for e in range(n):
            u = int(unit[r, e])
            if wc.lod[r, e] > 0:
                assert (starts[u], spans[u], lods[u]) == (int(wc.start[r, e]), int(wc.span[r, e]), int(wc.lod[r, e]))
                torch.testing.assert_close(pooled.emb[r, u], wc.emb[r, e])
            else:
                assert lods[u] == 0 and starts[u] // K == int(wc.start[r, e]) // K
                members = (unit[r] == u) & wc.valid[r]
                torch.testing.assert_close(pooled.emb[r, u], wc.emb[r][members].mean(0))
        assert all(s == K for s, k, a in zip(spans, lods, starts, strict=True) if k == 0 and a % K == 0)
        torch.testing.assert_close(pooled.position[r, :m], pooled.start[r, :m] + (pooled.span[r, :m] - 1) / 2)
        assert m <= T // K


@given(cases)
def test_property_I3_every_entry_scores_its_unit_and_padding_changes_nothing(case):
    """An entry's score is its unit's score from the transformer over the units; padding entries score 0 and
    whatever they hold leaves the valid entries' scores as they were."""
    shape, batch, seed = case
    system, window, wc = block_contexts(shape, batch, seed)
    T, K = shape["T"], shape["K"]
    lens = system.lensnet
    with torch.no_grad():
        scores = lens(wc)
        units = min(shape["W"], T // K)
        unit = block_units(wc, K, units)
        direct = lens.score(pool_blocks(wc, unit, units))
    for r in range(wc.batch_size[0]):
        n = int(wc.valid[r].sum())
        torch.testing.assert_close(scores[r, :n], direct[r, unit[r, :n]])
    assert (scores[~wc.valid] == 0).all()
    padded = padded_contexts(system, window)
    pad = ~padded.valid
    g = torch.Generator().manual_seed(seed)
    noisy = padded.clone()
    noisy.emb = torch.where(pad[..., None], torch.randn(padded.emb.shape, generator=g) * 10, padded.emb)
    noisy.start = torch.where(pad, torch.randint(0, T, padded.start.shape, generator=g), padded.start)
    noisy.lod = torch.where(pad, torch.randint(0, shape["L"] + 1, padded.lod.shape, generator=g), padded.lod)
    with torch.no_grad():
        clean, dirty = lens(padded), lens(noisy)
    torch.testing.assert_close(clean[padded.valid], dirty[padded.valid])
    assert (dirty[pad] == 0).all()


@given(cases)
def test_property_I3_lensnets_padding_units_change_no_valid_units_score(case):
    """LensNet reads units, not entries: whatever its padding units hold (embedding, start, span, level), the valid
    units' scores stay as they were. Perturbing padding entries cannot show this, since they are dropped before the
    units are pooled. Fails with the transformer's key mask over the units taken out."""
    from hypothesis import assume

    shape, batch, seed = case
    system, _, wc = block_contexts(shape, batch, seed)
    units = min(shape["W"], shape["T"] // shape["K"])
    pooled = pool_blocks(wc, block_units(wc, shape["K"], units), units)
    pad = ~pooled.valid
    assume(bool(pad.any()))
    g = torch.Generator().manual_seed(seed)
    noisy = pooled.clone()
    noisy.emb = torch.where(pad[..., None], torch.randn(pooled.emb.shape, generator=g) * 10, pooled.emb)
    noisy.start = torch.where(pad, torch.randint(0, shape["T"], pooled.start.shape, generator=g), pooled.start)
    noisy.span = torch.where(pad, torch.randint(1, shape["K"] + 1, pooled.span.shape, generator=g), pooled.span)
    noisy.position = torch.where(pad, noisy.start + (noisy.span - 1) / 2, pooled.position)
    noisy.lod = torch.where(pad, torch.randint(0, shape["L"] + 1, pooled.lod.shape, generator=g), pooled.lod)
    with torch.no_grad():
        clean, dirty = system.lensnet.score(pooled), system.lensnet.score(noisy)
    torch.testing.assert_close(clean[pooled.valid], dirty[pooled.valid])


@given(
    st.integers(1, 3), st.integers(1, 3), st.integers(2, 24), st.integers(1, 24), st.integers(0, 2**16),
)  # fmt: skip
def test_property_lensnets_units_read_themselves_and_the_newest_units(rows, heads, units, newest, seed):
    """Each valid unit's attention is SDPA's over itself and its row's ``newest`` newest valid units, written as an
    explicit mask; a row of at most ``newest`` valid units reads all of them, as the bidirectional read does. Fails
    with the own unit read twice, or the newest counted from the padded end of the row."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, units, 4, generator=g) for _ in range(3))
    n = torch.randint(1, units + 1, (rows, 1), generator=g)
    valid = torch.arange(units)[None] < n
    out = newest_read(q, k, v, valid, newest)
    read = (valid & (torch.arange(units)[None] >= n - newest))[:, None, :] | torch.eye(units, dtype=torch.bool)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=read[:, None])
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None])
    for row in range(rows):
        m = int(n[row])
        torch.testing.assert_close(out[row, :, :m], expected[row, :, :m])
        if m <= newest:
            torch.testing.assert_close(out[row, :, :m], whole[row, :, :m])


def test_a_long_views_units_read_the_newest_so_an_old_units_neighbours_change_nothing():
    """Past the training context's ``T/K`` units (a long view's row), an old unit's score reads only itself and the
    newest units: changing the other old units leaves it as it was, and changing a newest unit changes it."""
    shape = {"T": 32, "K": 4, "L": 2, "W": 16, "H": 8, "N": 1}
    system = awake(make_system(**shape, seed=0))
    newest = shape["T"] // shape["K"]
    units = 3 * newest  # a view three times the training window
    g = torch.Generator().manual_seed(1)
    start = torch.arange(units)[None] * shape["K"]
    row = WorkingContext(
        emb=torch.randn(1, units, system.base.lm_head.in_features, generator=g), position=(start + 1.5).float(),
        start=start, span=torch.full_like(start, shape["K"]), lod=torch.zeros_like(start), node=torch.zeros_like(start),
        target=torch.full_like(start, -1), valid=torch.ones(1, units, dtype=torch.bool), batch_size=[1, units],
    )  # fmt: skip
    others, recent = row.clone(), row.clone()
    others.emb = others.emb.clone()
    others.emb[:, 1 : units - newest] = torch.randn(1, units - newest - 1, others.emb.size(-1), generator=g)
    recent.emb = recent.emb.clone()
    recent.emb[:, -1] += 1.0
    with torch.no_grad():
        lens = system.lensnet
        base, with_others, with_recent = lens.score(row), lens.score(others), lens.score(recent)
    torch.testing.assert_close(base[:, 0], with_others[:, 0])
    assert not torch.allclose(base[:, 0], with_recent[:, 0])
