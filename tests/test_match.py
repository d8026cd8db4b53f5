"""``match``: the training-free n-gram copy focus and its per-block votes."""

from __future__ import annotations

import torch
from builders import make_system, rewritten_after
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.focus import focus_scores
from mcfn.core.match import match_scorer, match_votes, ngram_keys
from mcfn.core.system import tree_stage


def text_with(length: int, pieces: dict[int, list[int]], filler: int = 100) -> torch.Tensor:
    """``[1, length]`` distinct filler ids (no n-gram repeats) with ``pieces`` written at their positions."""
    tokens = torch.arange(filler, filler + length)
    for at, ids in pieces.items():
        tokens[at : at + len(ids)] = torch.tensor(ids)
    return tokens[None]


def test_a_unique_trigram_votes_where_its_copy_reads_next():
    """The trigram ending at the horizon (29) occurred once, ending at 4: a copy would read 4, 5, 6, 7 for the next
    four predictions, so block 1 (tokens 4..7) gets all four votes and nothing else gets any."""
    tokens = text_with(32, {2: [7, 8, 9], 27: [7, 8, 9]})
    votes = match_votes(tokens, torch.tensor([29]), block=4, reach=4, n=3, queries=1)
    torch.testing.assert_close(votes, torch.tensor([[0.0, 4.0, 0, 0, 0, 0, 0, 0]]))


def test_a_query_votes_after_its_newest_match_and_follows_the_query_back():
    """Of two earlier occurrences, the newest takes the query's whole vote (shared, a common n-gram would spread a
    little over every far block it recurs in); a query ``d`` tokens before the horizon votes ``d`` positions further
    on (its copy has already read ``d`` tokens by the horizon)."""
    tokens = text_with(48, {0: [7, 8, 9], 16: [7, 8, 9], 41: [7, 8, 9]})
    horizon = torch.tensor([45])  # the trigram ends at 43, two tokens before the horizon
    votes = match_votes(tokens, horizon, block=4, reach=4, n=3, queries=3)
    want = torch.zeros(1, 12)
    # matches end at 2 and 18; the newest one's copy reads from the horizon on from 18 + 2 = 20
    want[0, 5] = 4.0  # tokens 20..23
    torch.testing.assert_close(votes, want)
    more = match_votes(tokens, horizon, block=4, reach=4, n=3, queries=2)  # the query at 43 is not among the newest 2
    assert float(more.sum()) == 0.0


def test_ngram_keys_tell_ngrams_apart_and_match_equal_ones():
    tokens = torch.tensor([[5, 6, 7, 5, 6, 7, 6, 5, 7]])
    keys = ngram_keys(tokens, 3)
    assert keys[0, 2] == keys[0, 5] and len(set(keys[0, 2:].tolist())) == 6  # 7 trigrams, one repeated
    assert len(set(keys[0, :2].tolist()) | set(keys[0, 2:].tolist())) == 8  # the first n-1 match nothing


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.integers(24, 62), st.integers(1, 16), st.integers(8, 40))
def test_property_match_votes_read_nothing_after_the_horizon(seed: int, horizon: int, reach: int, queries: int):
    """Rewriting every token after the horizon changes no vote (I11): the queries, their matches and the positions
    voted on all lie at or before it. Three ids make matches common."""
    tokens = torch.randint(0, 3, (2, 64), generator=torch.Generator().manual_seed(seed))
    at = torch.tensor([horizon, 24 + horizon // 2])
    rewritten = rewritten_after(tokens, at, seed=seed + 1)
    assert not torch.equal(tokens, rewritten)
    before = match_votes(tokens, at, block=4, reach=reach, queries=queries)
    assert float(before.sum()) > 0, "with 3 ids (27 trigrams) and 8 queries some trigram repeats"
    torch.testing.assert_close(before, match_votes(rewritten, at, block=4, reach=reach, queries=queries))


def votes_by_scatter(tokens, horizon, block, reach, n, queries, lookahead):
    """The votes as the module docstring tells them, pair by pair: each query's vote scattered on the first position
    its newest earlier match's copy reads, then summed over the next ``reach``: the reference :func:`match_votes`,
    which reads every pair at a fixed offset instead, must equal."""
    B, T = tokens.shape
    keys, position = ngram_keys(tokens, n), torch.arange(T)
    query = horizon[:, None] + lookahead - torch.arange(queries)  # [B, Q]
    match = (keys[:, None, :] == keys.gather(1, query.clamp(min=0))[:, :, None]) & (position < query[:, :, None])
    match &= (query >= n - 1)[:, :, None] & (position <= horizon[:, None, None])
    newest = torch.where(match, position, -1).argmax(-1, keepdim=True)  # each query's newest match (any, if none)
    share = torch.zeros_like(match, dtype=torch.float).scatter(-1, newest, 1.0) * match
    first = position + (horizon[:, None] - query)[:, :, None]  # [B, Q, T]
    inside = (first <= horizon[:, None, None]) & (first >= 0)
    starts = torch.zeros(B, T + 1).scatter_add_(1, torch.where(inside, first, T).flatten(1), share.flatten(1))
    read = (position[None, :, None] - torch.arange(reach)).clamp(min=-1)  # [1, T, reach]: q, q - 1, ...
    votes = torch.where(
        read >= 0, starts[:, None, :T].expand(B, T, T).gather(2, read.clamp(min=0).expand(B, T, reach)), 0
    )
    votes = votes.sum(-1) * (position <= horizon[:, None])
    return votes[:, : T // block * block].view(B, T // block, block).sum(-1)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**16), st.integers(8, 70), st.sampled_from([2, 4, 8]), st.integers(1, 12), st.integers(2, 4),
    st.integers(1, 12), st.integers(0, 4),
)  # fmt: skip
def test_property_match_votes_are_every_pairs_share_scattered(seed, length, block, reach, n, queries, lookahead):
    """:func:`match_votes` equals :func:`votes_by_scatter` on random text of three ids (many matches) at any
    horizon, n-gram length, query count, reach and draft lookahead. Fails if a query's copy read from one position
    too early or late, or a match on the draft counted."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3, (2, length), generator=g)
    horizon = torch.randint(0, length - lookahead, (2,), generator=g)
    got = match_votes(tokens, horizon, block, reach, n, queries, lookahead)
    want = votes_by_scatter(tokens, horizon, block, reach, n, queries, lookahead)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_new_lensnet_with_the_match_prior_scores_as_match_does_and_learns_from_there():
    """``mc.lens.match_prior``: before it learns, LensNet's block-view scores are ``match``'s own (its votes and its
    recency prior) on every gist, so it cuts as ``match`` does; without the prior they are not, and the prior's
    head still gets a gradient, so training can move it."""
    from builders import make_system

    from mcfn.core.context import seen_until
    from mcfn.core.focus import focus_scores
    from mcfn.core.system import build_contexts, history_tree
    from mcfn.core.variants import draw_variant_noise

    T, K, H, R = 64, 4, 8, 4
    window = torch.randint(0, 4, (3, T + 1), generator=torch.Generator().manual_seed(0))  # 4 ids: many matches
    votes = match_votes(window[:, :T], torch.full((3,), T - H - 1), K, R)
    blocks = (T - H) // K  # the eligible LOD1 blocks, oldest first
    assert (votes[:, :blocks] > 0).any() and (votes[:, :blocks] == 0).any()
    for prior in ("sum", ""):
        system = make_system(T, K, 2, 24, H, N=2, seed=1, lens={"match_prior": prior}, refocus_every=R)
        nodes, tree = system.nodes, history_tree(system, window[:, :T])
        lensnet = focus_scores(system.lensnet.scorer(nodes.layout, window, system.base), tree, window, nodes)
        match = focus_scores(match_scorer(window[:, :T], K, R, T), tree, window, nodes)
        gists = nodes.eligible & (nodes.lod > 0)  # what every expansion, collapse and drop is decided on
        assert torch.allclose(lensnet[:, gists], match[:, gists], atol=1e-5) == bool(prior)
    noise = draw_variant_noise(system.layout, 3, torch.Generator().manual_seed(1), torch.device("cpu"))
    system = make_system(T, K, 2, 24, H, N=2, seed=1, lens={"match_prior": "sum"}, refocus_every=R)
    wc = seen_until(build_contexts(system, window, noise)[0], torch.full((9,), T - H))
    system.lensnet(wc, tokens=window[:, :T].repeat_interleave(3, 0)).square().sum().backward()
    assert system.lensnet.head.weight.grad.abs().sum() > 0, "the head starts at zero, not frozen there"


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(48, 62), st.integers(1, 16))
def test_property_I11_the_match_focus_scores_read_nothing_after_the_horizon(seed: int, horizon: int, reach: int):
    """``match`` as a focus scorer, as the evaluation and generation refocus with it: every node's score at a horizon
    is unchanged when every later token is rewritten (I11). Over 4 token ids its votes fire at every horizon, so a
    scorer that asks for votes one token past the horizon fails."""
    system = make_system(T=64, K=4, L=2, W=32, H=16, N=2, seed=seed % 7)
    window = torch.randint(0, 4, (1, 65), generator=torch.Generator().manual_seed(seed))
    at = torch.tensor([horizon])
    assert float(match_votes(window[:, :64], at, block=4, reach=reach).sum()) > 0, "the case needs votes"
    scores = []
    for w in (window, rewritten_after(window, at, seed=seed + 1)):
        scorer = match_scorer(w[:, :64], 4, reach, 64)
        scores.append(focus_scores(scorer, tree_stage(system, w), w, system.nodes, at))
    assert torch.equal(scores[0], scores[1])


def test_the_gated_prior_is_matchs_cut_where_lensnet_does_not_stand_out_and_adds_it_where_it_does():
    """``mc.lens.match_prior = "gated"``: a zero head scores as ``match`` does (nothing stands out); a LensNet
    trained without the prior, gated, adds its own score to ``match``'s on exactly the units that stand out of their
    row (:func:`~mcfn.core.lensnet.standing_out`), and nowhere else."""
    from builders import make_system, spread_lens

    from mcfn.core.context import seen_until
    from mcfn.core.lensnet import standing_out
    from mcfn.core.system import build_contexts
    from mcfn.core.units import block_units, pool_blocks, unit_capacity
    from mcfn.core.variants import draw_variant_noise

    T, K, H, R = 64, 4, 8, 4
    window = torch.randint(0, 4, (3, T + 1), generator=torch.Generator().manual_seed(0))
    own = spread_lens(make_system(T, K, 2, 24, H, N=2, seed=1, refocus_every=R), seed=3)
    zero = make_system(T, K, 2, 24, H, N=2, seed=1, lens={"match_prior": "gated"}, refocus_every=R)
    summed = make_system(T, K, 2, 24, H, N=2, seed=1, lens={"match_prior": "sum"}, refocus_every=R)
    gated = make_system(T, K, 2, 24, H, N=2, seed=1, lens={"match_prior": "gated"}, refocus_every=R)
    gated.lensnet.load_state_dict(own.lensnet.state_dict())
    summed.lensnet.load_state_dict(own.lensnet.state_dict())
    noise = draw_variant_noise(own.layout, 3, torch.Generator().manual_seed(1), torch.device("cpu"))
    entries = seen_until(build_contexts(own, window, noise)[0], torch.full((9,), T - H))
    units = unit_capacity(entries.batch_size[1], own.layout)
    wc = pool_blocks(entries, block_units(entries, K, units), units)  # what LensNet's transformer reads
    tokens = window[:, :T].repeat_interleave(3, 0)
    with torch.no_grad():
        learned = own.lensnet.score(wc, tokens)
        prior = zero.lensnet.score(wc, tokens)  # match's own: a zero head adds nothing
        torch.testing.assert_close(summed.lensnet.score(wc, tokens), prior + learned)
        out = standing_out(learned, wc.valid)
        assert out.any() and (wc.valid & ~out).any(), "the case needs units on both sides of the gate"
        torch.testing.assert_close(gated.lensnet.score(wc, tokens), prior + learned * out)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.floats(0.01, 100.0), st.floats(-50.0, 50.0))
def test_property_standing_out_ignores_a_rows_scale_and_offset(seed: int, scale: float, shift: float):
    """The gate reads how far a unit's score stands above its row, not its units: scaling a row's scores by a
    positive factor and shifting them picks the same units; padding never stands out; a flat row has none."""
    from mcfn.core.lensnet import standing_out

    g = torch.Generator().manual_seed(seed)
    learned = torch.randn(3, 20, generator=g) ** 3  # heavy tails: some units stand out
    valid = torch.rand(3, 20, generator=g) < 0.8
    picked = standing_out(learned, valid)
    torch.testing.assert_close(standing_out(learned * scale + shift, valid), picked, rtol=0, atol=0)
    assert not (picked & ~valid).any()
    assert not standing_out(torch.full((3, 20), shift), valid).any()
