"""The attention oracles: each chunk's cut from its own queries' full attention, scored only when asked."""

from __future__ import annotations

import torch
from builders import VOCAB, decisive, make_system, rewritten_after, spread_lens
from hypothesis import given, settings
from hypothesis import strategies as st

import mcfn.evaluation.refocused as refocused
from mcfn.core.context import assemble, seen_until
from mcfn.core.match import match_votes
from mcfn.core.nodes import NodeTable
from mcfn.core.policy import MATCH, POLICIES
from mcfn.core.system import tree_stage
from mcfn.evaluation.batch import EvalBatch, EvalSettings
from mcfn.evaluation.indexer_recall import tail_attention
from mcfn.evaluation.oracle import (
    DRAFT_ATTN,
    DRAFT_MATCH,
    HORIZON_ATTN,
    ORACLE_ATTN,
    ORACLE_MATCH,
    ORACLES,
    attention_scorer,
    chunk_mass,
    draft_mass,
    greedy_draft,
    oracle_policies,
)
from mcfn.evaluation.refocused import predict_chunked

T, K, L, W, H, R = 64, 4, 2, 32, 16, 4


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), horizon=st.integers(T - H, T - 1))
def test_property_the_attention_oracle_scores_each_entry_by_the_mass_on_its_own_tokens(seed, horizon):
    """Every valid entry of the block view (gists and tail tokens) scores the mass summed over exactly the tokens it
    covers; entries past the horizon score 0. Fails with a span read one token short."""
    system = make_system(T, K, L, W, H, N=2)
    nodes = NodeTable.of(system.layout, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (1, T + 1), generator=g)
    mass = torch.rand(1, T, generator=g)
    view = nodes.with_sizes(W=system.layout.block_view_width)
    with torch.no_grad():
        wc = assemble(tree_stage(system, window), nodes.block_view[None, None], window, view)
    wc = seen_until(wc, torch.tensor([horizon]))
    scores = attention_scorer(mass)(wc)
    for e in range(wc.valid.size(1)):
        start, span = int(wc.start[0, e]), int(wc.span[0, e])
        expected = float(mass[0, start : start + span].sum()) if bool(wc.valid[0, e]) else 0.0
        assert abs(float(scores[0, e]) - expected) < 1e-5, (e, start, span)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), horizon=st.integers(T - H, T - 1), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_property_oracle_match_adds_match_and_the_attention_each_over_its_rows_spread(seed, horizon, scale):
    """``oracle_match``'s score of every valid entry: ``match``'s score over the population standard deviation of
    the row's valid ``match`` scores, plus the attention mass on the entry's tokens over the deviation of those
    masses (either left as it is where it does not vary), both counted by hand; 0 elsewhere. So the attention's
    overall ``scale`` changes nothing. Fails where one term keeps its own scale or the other weighs more."""
    system = make_system(T, K, L, W, H, N=2)
    nodes = NodeTable.of(system.layout, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, 6, (1, T + 1), generator=g)  # a small alphabet: match votes somewhere
    mass = scale * torch.rand(1, T, generator=g)
    view = nodes.with_sizes(W=system.layout.block_view_width)
    with torch.no_grad():
        wc = seen_until(assemble(tree_stage(system, window), nodes.block_view[None, None], window, view),
                        torch.tensor([horizon]))  # fmt: skip
    policies = oracle_policies({"future": mass, "horizon": mass, "draft": mass}, window[:, :T], 0)
    scores = policies[ORACLE_MATCH].scorer_of(system, window, view.layout, R, None)(wc)[0]
    votes = POLICIES[MATCH.name].scorer_of(system, window, view.layout, R, None)(wc)[0]
    valid = wc.valid[0]
    spans = zip(wc.start[0].tolist(), wc.span[0].tolist(), strict=True)
    pooled = torch.tensor([float(mass[0, s : s + n].sum()) for s, n in spans])

    def over_spread(x):
        spread = float(x[valid].std(correction=0))
        return x / spread if spread > 0 else x

    expected = torch.where(valid, over_spread(votes) + over_spread(pooled), 0.0)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)


def test_a_chunks_masses_read_its_own_queries_and_those_up_to_its_horizon_and_leave_the_sink_out():
    """``attention`` holds the window's last H + R queries: chunk c's own are its columns R + (its tail columns),
    the horizon's the R ending at the chunk's first prediction. Fails with either set one query off."""
    attention = torch.rand(2, H + R, T)
    chunk = torch.tensor([[-1] * 4 + [0] * 4 + [1] * 4 + [2] * 4, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4])
    horizon = torch.tensor([T - H + 8, T - H + 4])  # chunk 1's first prediction in each row
    mass = chunk_mass(attention, chunk, 1, horizon, R, K)
    torch.testing.assert_close(mass["future"][0, K:], attention[0, R + 8 : R + 12, K:].sum(0))
    torch.testing.assert_close(mass["future"][1, K:], attention[1, R + 4 : R + 8, K:].sum(0))
    # row 0's chunk 1 starts at column R + 8 (position T - H + 8): the R queries up to it are columns 9 .. 12
    torch.testing.assert_close(mass["horizon"][0, K:], attention[0, 9 : R + 9, K:].sum(0))
    torch.testing.assert_close(mass["horizon"][1, K:], attention[1, 5 : R + 5, K:].sum(0))
    assert all((m[:, :K] == 0).all() for m in mass.values())


def chunk_on_block(targets: list[int]):
    """A stand-in for full attention in which chunk ``c``'s queries read only block ``targets[c]``."""

    def attention(base, window, layout, before):
        out = torch.zeros(window.size(0), before + layout.H, layout.T)
        for c, block in enumerate(targets):
            out[:, before + c * R : before + (c + 1) * R, block * K : (block + 1) * K] = 1.0
        return out

    return attention


def test_each_chunks_oracle_cut_shows_the_far_block_its_own_queries_read(monkeypatch):
    """With every chunk's queries reading one far block, a different one per chunk, ``oracle_attn`` shows chunk c's
    block at LOD0 in chunk c's cut, and ``oracle_match`` does too (the oracle's term, on the same scale as
    ``match``'s, decides where ``match`` votes nothing). Fails when a chunk's mass is read from another chunk's
    queries, or the oracles are left out of the conditions the evaluation scores."""
    targets = [2, 5, 8, 1]  # far blocks (the tail starts at block 12)
    monkeypatch.setattr(refocused, "tail_attention", chunk_on_block(targets))
    system = decisive(make_system(T, K, L, W, H, N=2, seed=1))
    window = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(3))
    # warm refocuses of L + 2 steps, as many as a cold one: one step opens one level, and block 1 lies in a LOD2
    # gist that chunk 2's cut keeps closed
    settings = EvalSettings((W,), 4, refocus=4, refocus_every=R, warm_steps=4, oracle=True, brief=True)
    with torch.no_grad():
        pred = predict_chunked(EvalBatch.of(system, settings, window, torch.full((2,), T - H)), W,
                               torch.Generator().manual_seed(0))  # fmt: skip
    assert set(ORACLES) <= set(pred.slots) and set(ORACLES) <= set(pred.cuts)
    for name in (ORACLE_ATTN, ORACLE_MATCH):
        for row in range(2):
            for c, cut in enumerate(pred.cuts[name][row]):
                block = slice(targets[c] * K, (targets[c] + 1) * K)
                assert cut[block].all(), (name, row, c)
    assert not pred.cuts["recency"][0][0][: 3 * K].any(), "the blocks lie beyond truncation's reach"


def test_the_oracles_are_never_policies_and_are_scored_only_when_asked():
    assert not set(ORACLES) & set(POLICIES)
    assert set(ORACLES) <= set(EvalSettings((W,), oracle=True).names)
    assert not set(ORACLES) & set(EvalSettings((W,)).names)
    system = decisive(make_system(T, K, L, W, H, N=2, seed=1))
    window = torch.randint(0, VOCAB, (1, T + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        pred = predict_chunked(EvalBatch.of(system, EvalSettings((W,), 4, refocus_every=R, brief=True), window,
                                            torch.full((1,), T - H)), W, torch.Generator().manual_seed(0))  # fmt: skip
    assert not set(ORACLES) & set(pred.slots)


def test_the_horizons_and_the_drafts_attention_read_nothing_after_the_horizon_and_the_chunks_own_does():
    """Rewriting every token after chunk c's horizon changes none of ``horizon_attn``'s and ``draft_attn``'s cuts of
    chunks 0..c (I11),
    and changes some of ``oracle_attn``'s (it reads the chunk's own predictions: the test can see a leak). Fails
    with the horizon's queries taken one past it."""
    system = spread_lens(decisive(make_system(T, K, L, W, H, N=2, seed=1)), seed=2)
    settings = EvalSettings((W,), 4, refocus=4, refocus_every=R, oracle=True, brief=True)

    def cuts(window):
        with torch.no_grad():
            batch = EvalBatch.of(system, settings, window, torch.full((2,), T - H))
            return predict_chunked(batch, W, torch.Generator().manual_seed(0)).cuts

    window = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(6))
    base, leaked = cuts(window), 0
    for c in range(H // R):
        other = cuts(rewritten_after(window, torch.full((2,), T - H + c * R), seed=7 + c))
        for row in range(2):
            for k in range(c + 1):
                for name in (HORIZON_ATTN, DRAFT_ATTN, DRAFT_MATCH):
                    assert torch.equal(base[name][row][k], other[name][row][k]), (name, row, c, k)
                leaked += not torch.equal(base[ORACLE_ATTN][row][k], other[ORACLE_ATTN][row][k])
    assert leaked > 0


def test_the_draft_is_the_oracle_where_the_model_guesses_every_token_right():
    """A window whose tokens after the horizon are the base model's own greedy continuation: ``draft_attn``'s mass
    equals ``oracle_attn``'s (the chunk's own queries over the real tokens), for every chunk. And it never reads the
    real tokens after the horizon: rewriting them leaves it unchanged. Fails with the draft one token late (the
    guess of token p + 1 made from the tokens up to p - 1)."""
    system = decisive(make_system(T, K, L, W, H, N=2, seed=1))
    base, layout = system.base, system.layout
    window = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(4))
    horizon = T - H
    with torch.no_grad():
        for p in range(horizon, T):  # the greedy continuation after the horizon
            window[:, p + 1] = base.logits(base.token_hidden(window[:, : p + 1])[:, -1:]).argmax(-1)[:, 0]
        attention = tail_attention(base, window, layout, before=R)
        chunk = (torch.arange(H) // R).expand(2, -1)
        for c in range(H // R):
            n = horizon + c * R + 1
            future = chunk_mass(attention, chunk, c, torch.full((2,), n - 1), R, K)["future"]
            draft = draft_mass(base, greedy_draft(base, window, n, R, T), n, R, layout)
            torch.testing.assert_close(draft, future, atol=1e-5, rtol=1e-5)
            rewritten = rewritten_after(window, torch.full((2,), n - 1), seed=c)
            torch.testing.assert_close(draft_mass(base, greedy_draft(base, rewritten, n, R, T), n, R, layout), draft)


def test_a_lookahead_match_votes_for_the_text_after_an_earlier_occurrence_of_the_drafts_trigram():
    """The draft (positions after the horizon) ends in a trigram written once far back: ``match`` with the draft's
    ``lookahead`` votes for the text a copy of it reads there (the earlier occurrence's block), ``match`` at the
    horizon votes nothing; a trigram repeated within the draft alone votes nothing (a match is on text). Fails with
    the queries left at the horizon, or with matches allowed on the draft."""
    Tn, h, draft = 64, 47, 6
    tokens = torch.arange(100, 100 + Tn)[None].clone()  # no trigram repeats
    tokens[0, 10:13] = torch.tensor([1, 2, 3])  # far back
    tokens[0, h + 4 : h + 7] = torch.tensor([1, 2, 3])  # the draft's last three tokens
    votes = match_votes(tokens, torch.tensor([h]), K, R, lookahead=draft)
    assert match_votes(tokens, torch.tensor([h]), K, R).sum() == 0
    # the query at h + 6 matched p = 12: the chunk's predictions h .. h + R - 1 read p + (h - j) + t = 6 + t
    assert votes.sum() > 0 and votes[0, 6 // K] > 0 and (votes[0, (6 + R) // K + 1 :] == 0).all()
    inner = torch.arange(100, 100 + Tn)[None].clone()
    inner[0, h + 1 : h + 4] = torch.tensor([1, 2, 3])
    inner[0, h + 4 : h + 7] = torch.tensor([1, 2, 3])  # the same trigram twice, both in the draft
    assert match_votes(inner, torch.tensor([h]), K, R, lookahead=draft).sum() == 0
