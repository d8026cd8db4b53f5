"""Streaming generation: the tree grows with the text, the working context stays within W, and the KV
cache decodes exactly what recomputing the context from scratch decodes."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, decisive, make_system, spread_lens
from compile_check import one_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.focus import (
    Refocus,
    carried_cut,
    focus_cut,
    focus_scores,
    shrink_to_budget,
    start_cut,
    view_context,
)
from mcfn.core.match import match_scorer
from mcfn.core.nodes import NodeTable
from mcfn.core.policy import LENS, MATCH
from mcfn.core.stream_view import refocus_budget, stream_view
from mcfn.core.system import history_tree
from mcfn.core.tree import Tree
from mcfn.core.variants import coarsest_cut
from mcfn.inference import contexts, generation
from mcfn.inference.generation import Sampling, generate_full, generate_mc
from mcfn.inference.render import lod_string
from mcfn.inference.streaming import StreamingTree, focused_context, view_tree

T, K, L, W, H = 64, 4, 2, 32, 8
REFOCUS = 4


def decisive_system(key_smear: bool = False):
    return decisive(make_system(T, K, L, W, H, N=2, seed=3, key_smear=key_smear))


@pytest.mark.heavy(69)
def test_compiled_decoding_is_one_graph_and_decodes_what_eager_does(fresh_dynamo):
    """``--compile``: the token step, the refill and the cache's move compiled by inductor once each, for every token
    and refocus (every refocus's cache has one capacity), the refocus's choice once cold and once warm (the history
    stays within one capacity), and the token step for full decoding's own cache; the same greedy tokens as eager."""
    system = decisive_system()
    prompt = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(2))
    eager, _ = generate_mc(system, prompt, 3 * REFOCUS, REFOCUS)
    with one_graph("inductor", functions=5) as compile_fn:
        compiled, _ = generate_mc(system, prompt, REFOCUS + 1, REFOCUS, compile_fn=compile_fn)
        compile_fn.forbid_recompiles()
        compiled_more, _ = generate_mc(system, prompt, 3 * REFOCUS, REFOCUS, compile_fn=compile_fn)
    assert compiled.tolist() == eager[: REFOCUS + 1].tolist() and compiled_more.tolist() == eager.tolist()
    full_eager, _ = generate_full(system.base, prompt, 8)
    with one_graph("inductor") as compile_fn:
        full_compiled, _ = generate_full(system.base, prompt, 8, compile_fn=compile_fn)
    assert full_compiled.tolist() == full_eager.tolist()


def test_streaming_tree_gists_equal_the_batch_tree():
    """Gists built as tokens trickle in (in chunks that straddle blocks and top-level blocks) equal the ones the
    training path builds for the same text."""
    system = decisive(make_system(T, K, L, W, H, N=2, seed=3))
    with torch.no_grad():  # a GistNet that reads its features: its output projection starts at zero
        torch.nn.init.normal_(system.gistnet.out_proj.weight, std=0.5)
    tokens = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(1))
    stream = StreamingTree(system, torch.device("cpu"))
    for chunk in tokens.split(5):
        stream.append(chunk)
    tree = history_tree(system, tokens[None])
    layout = system.layout
    for k in range(1, L + 1):
        n = layout.eligible_counts[k]
        lo = layout.level_offsets[k]
        torch.testing.assert_close(stream.levels[k].rows[:n], tree.emb[0, lo : lo + n], atol=1e-5, rtol=1e-5)
    assert stream.levels[1].length == T // K and stream.levels[2].length == T // K**2


def check_stream_context(wc, n: int, budget: int) -> None:
    """At most the budget, disjoint spans in order, the newest tokens at LOD0, and everything from the first
    covered token to the newest one covered but whole left-out top-level blocks (I1-I4 over a stream of ``n``
    tokens)."""
    start, span, lod = wc.start[0], wc.span[0], wc.lod[0]
    assert bool(wc.valid.all()) and wc.batch_size[1] <= budget
    end = start + span
    assert bool((start[1:] >= end[:-1]).all())  # increasing, disjoint
    gap = start[1:] != end[:-1]
    top = K**L
    assert bool((end[:-1][gap] % top == 0).all() and (start[1:][gap] % top == 0).all())  # gaps: whole blocks
    assert int(start[0]) % top == 0
    assert int(start[-1] + span[-1]) == n  # ends at the newest token
    assert bool((start % span == 0).all())  # aligned (I1)
    newest = end > n - H  # every entry that covers one of the newest H tokens: the tail is raw text
    assert bool((lod[newest] == 0).all())
    if n <= budget:
        assert int(start[0]) == 0 and bool((lod == 0).all())


def test_the_streams_raw_tail_is_its_newest_H_to_H_plus_K_minus_1_tokens():
    """Over every history length (so every residue of ``n`` mod ``K``), the view's LOD0 tail starts on a block
    boundary and holds the newest ``H`` real tokens and at most ``K - 1`` more. Fails with the tail one block late."""
    layout, budget = decisive_system().layout, W - REFOCUS
    for n in range(H, 12 * T):
        view = stream_view(n, layout, budget)
        raw = view.layout.H - (view.layout.T - view.real)  # the tail's real tokens, phantoms aside
        assert H <= raw <= H + K - 1, n
        assert (view.origin + view.layout.T - view.layout.H) % K == 0, n


def test_a_warm_refocus_starts_from_the_previous_context_within_budget():
    """``focus_cut`` given the last refocus's context starts from it: with no allocator step it returns that context
    carried over and shrunk within budget, not the coarsest cut. Fails if a warm refocus settles from the coarsest
    cut."""
    system = spread_lens(decisive_system(), seed=4)
    budget, differs = W - REFOCUS, 0
    for n in (2 * T + 3, 3 * T + 5, 5 * T + 9):
        stream = random_stream(system, n)
        previous = focused_context(system, stream, budget, LENS, Refocus(REFOCUS, steps=4))
        stream.append(torch.randint(0, VOCAB, (REFOCUS,), generator=torch.Generator().manual_seed(n)))
        view = stream_view(len(stream), system.layout, budget)
        tree, window = view_tree(stream, view)
        nodes = NodeTable.of(view.layout, window.device)
        scores = focus_scores(
            system.lensnet.scorer(view.layout, window, system.base), tree, window, nodes, torch.tensor([view.real - 1])
        )
        start = start_cut(previous, view.origin, scores, nodes)
        warm = focus_cut(system.lensnet.scorer(view.layout, window, system.base), tree, window, view, 0, previous)
        assert torch.equal(warm, start), n
        differs += not torch.equal(warm, coarsest_cut(view.layout, window.device)[None, None])
    assert differs, "the case needs a warm start that is not the coarsest cut"


def test_a_warm_refocus_whose_carry_fails_settles_from_the_coarsest_cut(monkeypatch):
    """Where the last context cannot be carried into the new view (forced here), ``focus_cut`` starts cold: with no
    allocator step it returns the coarsest cut, and with steps it settles exactly as a cold refocus does."""
    import mcfn.core.focus as focus

    system = spread_lens(decisive_system(), seed=4)
    budget, n = W - REFOCUS, 3 * T + 5
    stream = random_stream(system, n)
    previous = focused_context(system, stream, budget, LENS, Refocus(REFOCUS, steps=4))
    stream.append(torch.randint(0, VOCAB, (REFOCUS,), generator=torch.Generator().manual_seed(n)))
    view = stream_view(len(stream), system.layout, budget)
    tree, window = view_tree(stream, view)
    scorer = system.lensnet.scorer(view.layout, window, system.base)
    warm = focus_cut(scorer, tree, window, view, 0, previous)
    assert not torch.equal(warm, coarsest_cut(view.layout, window.device)[None, None]), "the carry works here"

    def cannot_carry(previous, origin, nodes):
        return torch.zeros(1, 1, nodes.layout.n_nodes, dtype=torch.bool), torch.tensor(False)

    monkeypatch.setattr(focus, "carried_cut", cannot_carry)
    assert torch.equal(
        focus_cut(scorer, tree, window, view, 0, previous), coarsest_cut(view.layout, window.device)[None, None]
    )
    assert torch.equal(focus_cut(scorer, tree, window, view, 4, previous), focus_cut(scorer, tree, window, view, 4))


def random_stream(system, n: int) -> StreamingTree:
    stream = StreamingTree(system, torch.device("cpu"))
    stream.append(torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)))
    return stream


def test_generation_with_context_match_refocuses_with_match_as_the_evaluation_does():
    """``--context match``: the streaming refocus scored by the n-gram ``match`` (reach R), the cut the evaluation's
    ``match`` condition takes over the same view; a LensNet that disagrees cuts otherwise. Over 4 token ids the
    votes fire, so the test fails if generation's match ignored them."""
    system = decisive_system()
    stream = StreamingTree(system, torch.device("cpu"))
    stream.append(torch.randint(0, 4, (5 * W,), generator=torch.Generator().manual_seed(3)))
    budget = W - REFOCUS
    view = stream_view(len(stream), system.layout, budget)
    tree, window = view_tree(stream, view)
    scorer = match_scorer(window[:, : view.layout.T], K, REFOCUS, view.layout.T)
    expected = view_context(tree, focus_cut(scorer, tree, window, view, 4), window, view)
    got = focused_context(system, stream, budget, MATCH, Refocus(REFOCUS, steps=4))
    assert torch.equal(got.start, expected.start) and torch.equal(got.lod, expected.lod)
    lens = focused_context(system, stream, budget, LENS, Refocus(REFOCUS, steps=4))
    assert not (
        lens.start.shape == got.start.shape and torch.equal(lens.lod, got.lod) and torch.equal(lens.start, got.start)
    )


def test_generation_with_context_match_reads_ahead_R_tokens_not_its_refocus_steps():
    """Generation's ``match`` scores with reach R (the tokens a cut serves), where R (2) and the refocus steps (4)
    differ: its first refocus is the cut ``focused_context`` makes with reach 2, which differs here from reach 4's."""
    system = decisive_system()
    prompt = torch.randint(0, 4, (5 * W,), generator=torch.Generator().manual_seed(3))
    R, steps = 2, 4
    budget = refocus_budget(system.layout, R)
    stream = StreamingTree(system, torch.device("cpu"))
    stream.append(prompt)
    maps = {}
    for reach in (R, steps):
        wc = focused_context(system, stream, budget, MATCH, Refocus(reach, steps=steps))
        maps[reach] = lod_string(wc.start[0], wc.span[0], wc.lod[0], wc.valid[0], len(stream), K)
    assert maps[R] != maps[steps], "the test needs a prompt where the reach changes the cut"
    layouts = []
    generate_mc(system, prompt, 1, R, refocus_steps=steps, policy=MATCH, on_refocus=lambda _, m: layouts.append(m))
    assert layouts == [maps[R]]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40 * W))
def test_property_streaming_context_covers_the_recent_history_within_budget(n):
    system = decisive_system()
    budget = W - REFOCUS
    wc = focused_context(system, random_stream(system, n), budget, LENS, Refocus(REFOCUS, steps=2))
    check_stream_context(wc, n, budget)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40 * W), grown=st.integers(0, REFOCUS), steps=st.integers(1, 2))
def test_property_warm_refocus_keeps_the_stream_invariants(n, grown, steps):
    """A refocus that starts from the previous context, ``grown`` tokens later (the new ones at LOD0, over the
    budget until collapses make room), obeys everything a refocus from the coarsest cut does."""
    system = decisive_system()
    budget = W - REFOCUS
    stream = random_stream(system, n)
    previous = focused_context(system, stream, budget, LENS, Refocus(REFOCUS, steps=2))
    stream.append(torch.randint(0, VOCAB, (grown,), generator=torch.Generator().manual_seed(-n)))
    wc = focused_context(system, stream, budget, LENS, Refocus(REFOCUS, warm_steps=steps), previous)
    check_stream_context(wc, n + grown, budget)


def test_prompt_of_ten_budgets_generates():
    system = decisive_system()
    prompt = torch.randint(0, VOCAB, (10 * W,), generator=torch.Generator().manual_seed(2))
    layouts = []
    out, stats = generate_mc(system, prompt, 12, REFOCUS, on_refocus=lambda n, text: layouts.append((n, text)))
    assert out.shape == (12,) and bool(((out >= 0) & (out < VOCAB)).all())
    assert [n for n, _ in layouts] == [10 * W, 10 * W + 4, 10 * W + 8]
    assert all(len(text) == -(-n // K) for n, text in layouts)
    for _, text in layouts:  # newest block as tokens, and more than the tail's blocks shown (·: left out)
        assert set(text) <= set("012·") and text.endswith("0") and len(text.replace("·", "")) > H // K + 1
    assert stats.new_tokens == 12 and stats.tokens_per_s > 0


@pytest.mark.parametrize("warm_steps", [0, 1])
@pytest.mark.parametrize("prompt_len, key_smear", [(5, False), (3 * W, False), (3 * W, True)])
def test_decoding_with_kv_cache_equals_recomputation(prompt_len, key_smear, warm_steps, monkeypatch):
    """The cache a refocus keeps (the entries before the first one it changed: warm refocuses) and the cache it
    rebuilds (cold ones) give the logits of recomputing the whole context at every token, so the same tokens; with
    smeared keys too (I13: a kept prefix's newest entry is what the next chunk smears)."""
    system = decisive_system(key_smear)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    logits = {True: [], False: []}

    def decode(use_cache: bool):
        def greedy(x, sampling, generator):
            logits[use_cache].append(x)
            return x.argmax(-1, keepdim=True)

        monkeypatch.setattr(generation, "pick_token", greedy)
        return generate_mc(system, prompt, 14, REFOCUS, warm_steps=warm_steps, use_cache=use_cache)

    (cached, stats), (recomputed, _) = decode(True), decode(False)
    assert torch.equal(cached, recomputed)
    torch.testing.assert_close(torch.stack(logits[True]), torch.stack(logits[False]), atol=1e-4, rtol=1e-4)
    assert len(set(cached.tolist())) > 1  # a real sequence, not one token repeated
    assert (stats.reused_entries > 0) == bool(warm_steps)


def test_full_mode_matches_plain_forward():
    system = decisive_system()
    base = system.base
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(4))
    out, _ = generate_full(base, prompt, 6)
    ids = prompt
    for _ in range(6):  # greedy by recomputing the whole sequence each time
        ids = torch.cat([ids, base(ids[None])[0, -1].argmax()[None]])
    assert torch.equal(out, ids[30:])


def test_sampling_is_seeded():
    system = decisive_system()
    prompt = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(5))
    sampling = Sampling(temperature=1.0, top_k=5, seed=7)
    a, _ = generate_mc(system, prompt, 8, REFOCUS, sampling=sampling)
    b, _ = generate_mc(system, prompt, 8, REFOCUS, sampling=sampling)
    assert torch.equal(a, b)


def test_generate_cli_decodes_from_a_trained_run(decoding_run, capsys):
    """``train.generate`` on a run directory: every context prints a continuation and their speed, warm refocuses
    report the share of cache entries they kept, and bad arguments exit 2."""
    from train.generate import main as generate_main

    run, prompt = decoding_run
    common = ["--ckpt", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "20", "--temperature", "0"]
    common += ["--refocus-every", "4"]
    capsys.readouterr()
    assert generate_main([*common, "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "[generate] shipped (lens), refocus 4:" in err and "20 new tokens" in err and "cache entries kept:" in err
    assert "0.250 refocuses a token" in err  # 5 refocuses for 20 tokens
    # The copy rule refocuses at least as often as its clock (at the latest every 4 tokens) and says so.
    assert generate_main([*common, "--quiet", "--refocus-on", "copy"]) == 0
    err = capsys.readouterr().err
    rate = float(err.split(" refocuses a token")[0].rsplit("(", 1)[1])
    assert "refocus copy4:" in err and rate >= 0.25
    assert generate_main([*common, "--context", "full"]) == 0
    assert "[generate] full:" in capsys.readouterr().err
    # Truncation at the same cadence: every refocus shows the newest W - R = 20 tokens, as blocks of K = 4 tokens.
    assert generate_main([*common, "--context", "recency"]) == 0
    err = capsys.readouterr().err
    refocuses = err.split("[refocus]")[1:]
    maps = ["".join(line.strip() for line in r.splitlines() if line.startswith("  ")) for r in refocuses]
    assert (
        "[generate] recency, refocus 4:" in err
        and maps
        and all(m.lstrip("·") == "0" * len(m.lstrip("·")) for m in maps)
    )
    assert all(5 <= len(m.lstrip("·")) <= 6 for m in maps)  # 20 tokens span 5 blocks, or 6 when not aligned
    assert generate_main([*common, "--context", "match", "--quiet"]) == 0
    assert "[generate] match, refocus 4:" in capsys.readouterr().err
    assert generate_main([*common, "--warm-steps", "-1"]) == 2
    assert generate_main([*common, "--refocus-every", "100000"]) == 2


def test_I11_a_streaming_refocus_reads_no_phantom():
    """A streaming refocus reads the view up to the newest real token (I11): rewriting the phantoms that round
    the view up to a whole top-level block (their embeddings and ids) changes no node's score, so neither the
    cold nor the warm cut. Fails with ``seen_until`` taken out of :func:`~mcfn.core.focus.focus_scores`."""
    system = spread_lens(decisive_system(), seed=4)
    budget = W - REFOCUS
    g = torch.Generator().manual_seed(7)
    for n in (3 * T + 5, 5 * T + 9, 7 * T + 2):
        stream = random_stream(system, n)
        previous = focused_context(system, stream, budget, LENS, Refocus(REFOCUS, steps=2))
        stream.append(torch.randint(0, VOCAB, (3,), generator=g))
        view = stream_view(len(stream), system.layout, budget)
        tree, window = view_tree(stream, view)
        nodes = NodeTable.of(view.layout, window.device)
        phantom = torch.arange(view.layout.T) >= view.real
        assert phantom.any(), "the case needs phantoms"
        noisy_emb = tree.emb.clone()
        noisy_emb[0, : view.layout.T][phantom] = torch.randn(int(phantom.sum()), tree.emb.size(-1), generator=g) * 5
        noisy_window = window.clone()
        noisy_window[0, view.real :] = torch.randint(0, VOCAB, (window.size(1) - view.real,), generator=g)
        horizon = torch.tensor([view.real - 1])
        scores = [
            focus_scores(system.lensnet.scorer(nodes.layout, w, system.base), t, w, nodes, horizon)
            for t, w in ((tree, window), (Tree(emb=noisy_emb, batch_size=[1]), noisy_window))
        ]
        assert torch.equal(scores[0], scores[1]), n
        carried, can_carry = carried_cut(previous, view.origin, nodes)
        (first, within), (second, _) = (shrink_to_budget(carried, s, nodes) for s in scores)
        assert bool(can_carry & within) and torch.equal(first, second), n


def test_the_kv_cache_after_refocuses_that_change_a_level_but_keep_a_start(monkeypatch):
    """Teacher-forced over a dozen warm refocuses, the cached decode gives the logits of recomputing the context at
    every token. Among those refocuses, some expand or collapse the entry right at the end of the kept prefix without
    moving its start (an expansion's first child, a collapse's parent): a cache that decides "unchanged" by start
    alone would keep that entry's stale keys and values there. Fails with ``shared_prefix`` comparing starts only."""
    from mcfn.inference.generation import teacher_forced_mc

    system = spread_lens(decisive_system(), seed=2)
    text = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(11))
    prompt, continuation = text[:70], text[70:]
    same_start = 0
    keep = contexts.shared_prefix

    def watched(cached, entries):
        nonlocal same_start
        kept = keep(cached, entries)
        if kept < min(cached.size(0), entries.size(0)):
            same_start += int(cached[kept, 0] == entries[kept, 0])  # the first changed entry kept its start
        return kept

    monkeypatch.setattr(contexts, "shared_prefix", watched)
    refocus = Refocus(REFOCUS, steps=4, warm_steps=1)
    cached, stats = teacher_forced_mc(system, prompt, continuation, refocus, use_cache=True, reuse=contexts.PREFIX)
    recomputed, _ = teacher_forced_mc(system, prompt, continuation, refocus, use_cache=False)
    torch.testing.assert_close(cached, recomputed, atol=1e-4, rtol=1e-4)
    assert len(stats.layouts) == 50 // REFOCUS + 1 and stats.reused_entries > 0
    assert same_start >= 2, "the test needs refocuses that change a level at a kept start"
