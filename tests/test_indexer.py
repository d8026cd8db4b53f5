"""LensNet as a query-aware indexer over ``match`` (``mc.lens.indexer``): it starts exactly where ``match`` is, reads
its query and its votes up to the horizon only (I11), learns from there, keeps a recent window at LOD0, and the
MegaContext step with it is one graph."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from builders import STEP_WEIGHTS, make_system, rewritten_after, spread_lens
from compile_check import assert_one_graph_equals_eager
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.attention import AttentionTarget
from mcfn.core.focus import focus_scores, refocus
from mcfn.core.lensnet import QUERY_TOKENS, horizon_query, rescaled, with_recent_window
from mcfn.core.match import match_scorer
from mcfn.core.policy import LENS
from mcfn.core.system import process_batch, tree_stage
from mcfn.core.variants import coarsest_cut, draw_variant_noise

T, K, H, R, W = 64, 4, 8, 4, 24


def indexer_system(seed: int, **lens):
    """An indexer over ``match``; its recent window is (W - H) / 2 = 8 tokens."""
    return make_system(T, K, 2, W, H, N=2, seed=seed, refocus_every=R,
                       lens={"match_prior": "sum", "indexer": True, **lens})  # fmt: skip


def repetitive(seed: int, rows: int = 1) -> torch.Tensor:
    """``[rows, T + 1]`` windows over 4 token ids: n-grams recur everywhere, so ``match`` votes at every horizon."""
    return torch.randint(0, 4, (rows, T + 1), generator=torch.Generator().manual_seed(seed))


def cold_cut(scorer, system, window, horizon):
    start = coarsest_cut(system.layout, window.device)[None, None].expand(window.size(0), 1, -1)
    tree = tree_stage(system, window)
    return refocus(scorer, tree, window, start, system.nodes, iterations=4, horizon=horizon)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.integers(T - H, T - 1))
def test_property_an_untrained_indexer_cuts_as_match_does(seed: int, horizon: int):
    """A new indexer's learned terms are zero (its heads start there), so its scores are ``match``'s rescaled per
    row (the same order and spacing) and its cut is ``match``'s, with the same recent window kept; a difference in
    what the two read (votes, distance, scale) or a learned term that is not zero shows."""
    system = indexer_system(seed % 5).eval()
    window, at = repetitive(seed), torch.tensor([horizon])
    match = match_scorer(window[:, :T], K, R, T)
    nodes, tree = system.nodes, tree_stage(system, window)
    gists = nodes.eligible & (nodes.lod > 0)  # what every expansion, collapse and drop is decided on
    own = partial(system.lensnet, layout=system.layout, tokens=window[:, :T], base=system.base)  # no recent window
    scores = [focus_scores(scorer, tree, window, nodes, at)[:, gists] for scorer in (own, match)]
    scores = [rescaled(x, torch.ones_like(x, dtype=torch.bool)) for x in scores]
    torch.testing.assert_close(*scores, atol=1e-4, rtol=0)  # match's order and spacing: an affine map of its scores
    lens = LENS.scorer(system, window, system.layout, R)
    match = with_recent_window(match, system.lensnet.recent)
    assert torch.equal(cold_cut(lens, system, window, at), cold_cut(match, system, window, at))


def test_the_recent_window_is_kept_at_lod0_where_match_alone_would_not():
    """With ``recent`` the newest tokens before the horizon are shown at LOD0 in every cut (the budget holds them);
    ``match`` alone spends that budget on the far blocks its votes point at."""
    lod0 = slice(0, T)  # the node table's first T nodes are the tokens
    shown_recent = []
    for seed in range(8):
        system = indexer_system(0).eval()
        assert system.lensnet.recent == 8
        window, at = repetitive(seed), torch.tensor([T - H - 1])
        cut = cold_cut(LENS.scorer(system, window, system.layout, R), system, window, at)
        recent_tokens = torch.arange(T)[lod0] >= T - H - 8
        assert cut[0, 0, lod0][recent_tokens].all(), seed
        match = cold_cut(match_scorer(window[:, :T], K, R, T), system, window, at)
        shown_recent.append(bool(match[0, 0, lod0][recent_tokens].all()))
    assert not all(shown_recent), "the case shows what the window adds"


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.integers(T - H, T - 1))
def test_property_I11_the_indexer_reads_nothing_after_the_horizon(seed: int, horizon: int):
    """A trained-looking indexer (large random weights, its heads on): its cut at a horizon is unchanged when every
    later token is rewritten, its query included (I11)."""
    system = spread_lens(indexer_system(seed % 5), seed).eval()
    window, at = repetitive(seed), torch.tensor([horizon])
    cuts = [cold_cut(LENS.scorer(system, w, system.layout, R), system, w, at)
            for w in (window, rewritten_after(window, at, seed=seed + 1))]  # fmt: skip
    assert torch.equal(*cuts)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, T))
def test_property_I11_the_query_comes_from_nothing_after_the_horizon(seed: int, now: int):
    """The query at a horizon (``now`` = one past it) is the same whatever follows it, and changes with the token at
    the horizon itself: it reads up to the horizon, no less and no further."""
    system = indexer_system(seed % 5)
    window = torch.randint(0, 32, (1, T), generator=torch.Generator().manual_seed(seed))
    at = torch.tensor([now])
    query = horizon_query(system.base, window, at)
    torch.testing.assert_close(query, horizon_query(system.base, rewritten_after(window, at - 1, seed + 1), at))
    changed = window.clone()
    changed[0, now - 1] = (window[0, now - 1] + 1) % 32
    assert not torch.allclose(query, horizon_query(system.base, changed, at)), "the newest token is read"
    if now > QUERY_TOKENS:  # beyond the query's reach, a token changes nothing
        older = window.clone()
        older[0, now - QUERY_TOKENS - 1] = (window[0, now - QUERY_TOKENS - 1] + 1) % 32
        torch.testing.assert_close(query, horizon_query(system.base, older, at))


def test_an_indexer_learns_from_match_the_step_reaching_every_term():
    """The step's losses reach the indexer's weights: first its per-head weights (zero at the start), then, once
    they are not zero, its query and key projections; its query is read from the base model without a gradient."""
    system = make_system(T, K, 2, W, H, N=2, seed=1, refocus_every=R, teacher={"full_weight": 1.0},
                         lens={"match_prior": "sum", "indexer": True, "attention_weight": 1.0})  # fmt: skip
    assert system.attention_target == AttentionTarget(near=(W - H) // 2, sink=K)  # what its choice decides
    lens, window = system.lensnet, repetitive(0, rows=3)
    noise = draw_variant_noise(system.layout, 3, torch.Generator().manual_seed(1), torch.device("cpu"))
    process_batch(system, window, noise, STEP_WEIGHTS).total().backward()
    assert lens.index_weight.weight.grad.abs().sum() > 0
    with torch.no_grad():
        lens.index_weight.weight.normal_(std=0.1)
    system.zero_grad()
    process_batch(system, window, noise, STEP_WEIGHTS).total().backward()
    for proj in (lens.index_query, lens.index_key, lens.query_in):
        assert proj.weight.grad.abs().sum() > 0
    assert not horizon_query(system.base, window[:, :T], torch.tensor([T - H] * 3)).requires_grad


@pytest.mark.heavy(30)
@pytest.mark.usefixtures("fresh_dynamo")
def test_the_step_with_the_indexer_is_one_graph_and_equals_eager():
    """With the teacher's attention target over the entries before its recent window too."""
    system = make_system(T, K, 2, W, H, N=2, seed=2, refocus_every=R, teacher={"full_weight": 1.0},
                         lens={"match_prior": "sum", "indexer": True, "attention_weight": 1.0})  # fmt: skip
    with torch.no_grad():
        system.lensnet.index_weight.weight.normal_(std=0.1)  # its term on, so the graph computes it
    batches = [
        (system, repetitive(seed, rows=2), draw_variant_noise(system.layout, 2, torch.Generator().manual_seed(seed),
                                                              torch.device("cpu")), STEP_WEIGHTS)
        for seed in range(3)
    ]  # fmt: skip
    assert_one_graph_equals_eager(
        process_batch, batches, loss=lambda out: out.total(), params=list(system.parameters())
    )
