"""A streaming refocus's choice as one fixed-shape graph (:mod:`mcfn.inference.choice`): the view laid in a stepped
capacity makes the evaluation's own cut, compiles once per capacity, and its pieces hold without host syncs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from builders import (
    VOCAB,
    adversarial,
    adversarial_scores,
    cases,
    check_cut,
    decisive,
    layouts,
    make_system,
    spread_lens,
    token_coverage,
)
from compile_check import one_graph
from hypothesis import given
from hypothesis import strategies as st

from mcfn.core.allocator import allocate, shrink
from mcfn.core.focus import Refocus, focus_scores, shrink_to_budget
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.policy import BRANCHES, LENS, MATCH
from mcfn.core.stream_view import stream_view, view_blocks
from mcfn.core.variants import draw_variant_noise, sample_variants
from mcfn.geometry import most_refocus_every
from mcfn.inference.choice import (
    FocusChoice,
    block_view_width,
    capacities,
    capacity_layout,
    capacity_of,
    choice_graphs,
    longest_view,
    view_where,
)
from mcfn.inference.streaming import LaidView, StreamingTree, focused_context, view_tree

T, K, L, W, H = 64, 4, 2, 32, 8
R = 4
BUDGET = W - R


def system_for(policy):
    system = decisive(make_system(T, K, L, W, H, N=2, seed=3))
    return spread_lens(system, seed=4) if policy.needs_lensnet else system


def same_context(a, b) -> bool:
    return a.batch_size == b.batch_size and all(
        torch.equal(a.get(k), b.get(k)) for k in ("start", "span", "lod", "valid")
    )


def history(n: int, refocuses: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n + refocuses * R,), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("policy", [MATCH, LENS, BRANCHES], ids=lambda p: p.name)
@pytest.mark.parametrize("warm_steps", [1, 0])
def test_the_choice_in_a_stepped_capacity_makes_the_evaluations_cut(policy, warm_steps):
    """Over prompts of several lengths (a few tokens; mid-growth; past the point where the origin moves) and 40
    refocuses each, cold and then warm (or cold every time), the choice laid in its stepped capacity and the one laid
    in the view's own length give exactly the context of ``focused_context`` (``focus_cut``, the evaluation's path).
    Fails if a node the capacity adds could be chosen, or the phantoms it adds entered the scores, or the block
    view's fixed width fell short of a view's real entries (by one block: watched failing)."""
    system, protocol = system_for(policy), Refocus(R, warm_steps=warm_steps)
    for n in (5, 130, 700):
        ids = history(n, 40)
        stream = StreamingTree(system, torch.device("cpu"))
        stream.append(ids[:n])
        stepped = FocusChoice(system, policy, protocol, BUDGET, compile_fn=lambda fn: fn)  # stepped, run eagerly
        own = FocusChoice(system, policy, protocol, BUDGET)
        previous = None
        for i in range(40):
            previous = focused_context(system, stream, BUDGET, policy, protocol, previous)
            assert same_context(stepped(stream), previous) and same_context(own(stream), previous), (n, i)
            stream.append(ids[n + i * R : n + (i + 1) * R])
        assert any(T != len(stream) for T, _, _ in stepped.shapes), "the case needs capacities past the view"


def laid_from_scratch(stream, view, layout):
    """The view's tree and window laid whole, level by level: the reference :class:`LaidView` must equal."""
    parts = []
    for k, (level, size) in enumerate(zip(stream.levels, layout.level_sizes, strict=True)):
        rows = level.rows[view.origin // layout.K**k :][:size]
        parts.append(F.pad(rows, (0, 0, 0, size - rows.size(0))))
    window = stream.tokens.rows[view.origin :]
    return torch.cat(parts)[None], F.pad(window, (0, layout.T + 1 - window.numel()))[None]


@given(st.sampled_from([0, 64]), st.lists(st.integers(1, 40), min_size=1, max_size=40), st.booleans())
def test_property_a_laid_view_written_as_rows_arrive_is_the_view_laid_whole(short_of_longest, chunks, stepped):
    """A stream grown by any chunks, from empty or from ``short_of_longest`` tokens before its longest view (where
    the origin starts to move), its view laid in the view's own layout or in its stepped capacity after each: the
    buffers written row by row as they arrive equal the tree and window laid whole, phantoms and incomplete gists
    zero. Fails if a level's rows were written once and never again (a gist completed later stays zero), or a new
    origin kept the old rows (both watched failing)."""
    system = make_system(T, K, L, W, H, N=2, seed=3)
    stream = StreamingTree(system, torch.device("cpu"))
    laid = LaidView(stream)
    prefix = longest_view(system.layout, BUDGET) - short_of_longest if short_of_longest else 0
    ids = torch.randint(0, VOCAB, (prefix + sum(chunks),), generator=torch.Generator().manual_seed(len(chunks)))
    stream.append(ids[:prefix])
    at = prefix
    for size in chunks:
        stream.append(ids[at : at + size])
        at += size
        view = stream_view(len(stream), system.layout, BUDGET)
        layout = capacity_layout(capacity_of(view, system.layout, BUDGET), system.layout, BUDGET) if stepped else None
        tree, window = laid(view, layout)
        emb, want_window = laid_from_scratch(stream, view, layout or view.layout)
        assert torch.equal(tree.emb, emb) and torch.equal(window, want_window)


@pytest.mark.parametrize("policy", [MATCH, LENS], ids=lambda p: p.name)
def test_the_scores_in_a_capacity_are_the_views_own(policy):
    """Every node of a view scores in its capacity as in the view's own layout (the capacity's added nodes aside):
    the block view's fixed width holds every real entry, and the recency prior is measured over the view's length,
    not the capacity's. Fails with the scorer given no ``scale``."""
    system = system_for(policy)
    for n in (130, 700):
        stream = StreamingTree(system, torch.device("cpu"))
        stream.append(history(n, 0))
        view = stream_view(n, system.layout, BUDGET)
        capacity = capacity_layout(capacity_of(view, system.layout, BUDGET), system.layout, BUDGET)
        assert capacity.T > view.layout.T, "the case needs a capacity past the view"
        horizon = torch.tensor([view.real - 1])
        real, origin, tail_start, length = torch.tensor(view_where(view)).unbind()
        tree, window = view_tree(stream, view)
        own_nodes = NodeTable.of(view.layout)
        own = focus_scores(policy.scorer(system, window, view.layout, R), tree, window, own_nodes, horizon)
        tree, window = view_tree(stream, view, capacity)
        nodes = NodeTable.of(capacity).fixed(tail_start, torch.tensor(0))
        scorer = policy.scorer(system, window, capacity, R, length)
        laid = focus_scores(scorer, tree, window, nodes, horizon, block_view_width(capacity))
        for k, size in enumerate(view.layout.level_sizes):
            torch.testing.assert_close(nodes.level(laid, k)[:, :size], own_nodes.level(own, k), rtol=1e-5, atol=1e-6)


def contexts_over(system, choice: FocusChoice, ids: torch.Tensor, prompt: int, refocuses: int) -> list:
    """``choice``'s contexts over a stream of the first ``prompt`` of ``ids``, growing by ``R`` after each refocus."""
    stream = StreamingTree(system, torch.device("cpu"))
    stream.append(ids[:prompt])
    out = []
    for i in range(refocuses):
        out.append(choice(stream))
        stream.append(ids[prompt + i * R : prompt + (i + 1) * R])
    return out


@pytest.mark.heavy(35)
def test_the_choice_is_one_graph_per_capacity_over_200_refocuses_of_a_growing_history(fresh_dynamo):
    """From a 5-token prompt over 200 warm refocuses (800 tokens: through every capacity, past the origin's first
    move) the compiled choice is one graph per capacity and one for the cold start, at most 8 (dynamo's limit per
    function), with no graph break (``fullgraph``), each the eager choice's context; a second stream over the same
    history compiles nothing."""
    system, protocol = system_for(LENS), Refocus(R)
    ids = history(5, 200)
    eager = FocusChoice(system, LENS, protocol, BUDGET, compile_fn=lambda fn: fn)
    expected = contexts_over(system, eager, ids, 5, 200)
    assert 6 <= len(eager.shapes) <= 8 and {s for _, s, _ in eager.shapes} == {1, 4}
    with one_graph("aot_eager", functions=len(eager.shapes)) as compile_fn:
        compiled = FocusChoice(system, LENS, protocol, BUDGET, compile_fn)
        got = contexts_over(system, compiled, ids, 5, 200)
        assert all(same_context(a, b) for a, b in zip(got, expected, strict=True))
        compile_fn.forbid_recompiles()
        contexts_over(system, FocusChoice(system, LENS, protocol, BUDGET, compile_fn), ids, 5, 200)
    assert compiled.shapes == eager.shapes


@pytest.mark.heavy(21)
@pytest.mark.parametrize("policy", [MATCH, BRANCHES], ids=lambda p: p.name)
def test_the_compiled_choice_of_a_composed_scorer_is_its_eager_one(fresh_dynamo, policy):
    """``match`` builds its scorer (a type-checked closure) inside the graph, and ``branches`` composes it with
    LensNet's and a top-k: compiled with ``fullgraph``, past the origin's first move, cold then warm, each makes the
    eager choice's contexts, one graph per shape."""
    system, protocol = system_for(policy), Refocus(R)
    ids = history(700, 6)
    eager = FocusChoice(system, policy, protocol, BUDGET, compile_fn=lambda fn: fn)
    expected = contexts_over(system, eager, ids, 700, 6)
    with one_graph("aot_eager", functions=len(eager.shapes)) as compile_fn:
        got = contexts_over(system, FocusChoice(system, policy, protocol, BUDGET, compile_fn), ids, 700, 6)
    assert all(same_context(a, b) for a, b in zip(got, expected, strict=True))


def test_the_capacities_step_up_to_the_longest_view():
    """Every view's length fits its capacity, less than twice over, the capacities are powers of two of whole
    top-level blocks but the longest view, which is reached (at a history past the origin's first move)."""
    layout = system_for(MATCH).layout
    longest = longest_view(layout, BUDGET)
    seen = set()
    for n in range(1, longest + 4 * layout.top_span):
        view = stream_view(n, layout, BUDGET)
        capacity = capacity_of(view, layout, BUDGET)
        assert view.layout.T <= capacity < 2 * view.layout.T and capacity <= longest, n
        seen.add(capacity)
    top = layout.top_span
    assert seen == {top * 2**j for j in range(longest.bit_length()) if top * 2**j < longest} | {longest}
    assert sorted(seen) == capacities(layout, BUDGET)


@pytest.mark.heavy(10)
def test_a_compiled_choice_holds_dynamos_recompile_limit_at_its_graphs(fresh_dynamo):
    """With dynamo's recompile limit at 2, a compiled choice from a 5-token prompt through its first capacity's
    cold and warm refocuses into the next capacity (three graphs) runs: its calls hold the limit at the graphs its
    stream can need (:func:`choice_graphs`). Without that the third graph raises, as dynamo's default 8 stopped a
    stream grown to 32k tokens at the default layout (20 graphs)."""
    system, protocol = system_for(MATCH), Refocus(R)
    assert choice_graphs(system.layout, BUDGET) > 2
    with torch._dynamo.config.patch(recompile_limit=2), one_graph("eager", functions=3) as compile_fn:
        compiled = FocusChoice(system, MATCH, protocol, BUDGET, compile_fn)
        contexts_over(system, compiled, history(5, 4), 5, 4)
    assert len({T for T, _, _ in compiled.shapes}) == 2


@st.composite
def streams(draw) -> tuple[Layout, int, int]:
    """A layout, a refocus budget ``W - R`` its geometry allows, and a history length up to 40 top-level blocks."""
    layout = Layout(**draw(layouts()))
    most = most_refocus_every(layout.W, layout.H, layout.K, layout.L)
    if most < 1:
        layout = dataclasses.replace(layout, W=layout.T)
        most = most_refocus_every(layout.W, layout.H, layout.K, layout.L)
    refocus = draw(st.integers(1, max(1, most)))
    return layout, layout.W - refocus, draw(st.integers(1, 40 * layout.top_span))


@given(streams())
def test_property_the_views_origin_is_the_one_a_block_by_block_scan_finds(case):
    """:func:`stream_view` jumps to its origin: the origin and the layout are the ones that dropping top-level blocks
    one at a time finds while the view holds more than :func:`view_blocks` of them (and whole blocks precede the
    tail), and past the coarsest cover's reach the budget is the view's still."""
    layout, budget, n = case
    most = view_blocks(layout, budget)
    n += max(0, most - 20) * layout.top_span  # histories from 20 blocks before the origin's first move to 20 after
    top, tail_start = layout.top_span, max(0, (n - layout.H) // layout.K * layout.K)

    def fitted(origin: int):
        real = n - origin
        T = -(-real // top) * top
        return dataclasses.replace(layout, T=T, H=T - (tail_start - origin), W=min(budget + T - real, T), N=0)

    origin = 0
    while -(-(n - origin) // top) > most and origin + top <= tail_start:
        origin += top
    got = stream_view(n, layout, budget)
    assert (got.origin, got.layout, got.real) == (origin, fitted(origin), n - origin)


@given(streams())
def test_property_the_longest_view_is_the_longest_a_scan_over_every_history_finds(case):
    """:func:`longest_view`'s closed form against the views of the histories around the origin's first move (before
    it the views grow with the history, after it they repeat every ``K^L`` tokens, shifted)."""
    layout, budget, _ = case
    most, top = view_blocks(layout, budget), layout.top_span
    scan = range(max(1, (most - 2) * top), (most + 4) * top + 2 * layout.H)
    assert longest_view(layout, budget) == max(stream_view(n, layout, budget).layout.T for n in scan)


@given(cases)
def test_property_the_coarsest_cut_covers_every_token_once_in_the_coarsest_covers_count(case):
    """:attr:`NodeTable.coarsest` (every eligible node under no eligible parent, one mask, no host sync) is a cut
    (I2, the tail at LOD0) that leaves nothing out, in as many entries as the greedy count from the top level."""
    layout = Layout(**case[0])
    coarsest = NodeTable.of(layout).coarsest[None]
    check_cut(coarsest, layout)
    assert bool((token_coverage(coarsest, layout) == 1).all()) and int(coarsest.sum()) == layout.coarsest_cover


@given(cases, adversarial)
def test_property_a_table_given_its_tail_and_budget_as_tensors_is_the_layouts_own(case, kind):
    """:meth:`NodeTable.fixed` over a layout of other ``H`` and ``W``: the same eligibility, and the allocator (one
    step, from the coarsest cut and from a variant) and the shrink make the same cuts as the layout's own table."""
    shape, batch, seed = case
    layout = Layout(**shape)
    own = NodeTable.of(layout)
    other = NodeTable.of(dataclasses.replace(layout, H=layout.T - layout.K, W=layout.T))
    fixed = other.fixed(torch.tensor(layout.T - layout.H), torch.tensor(layout.W))
    assert torch.equal(fixed.eligible, own.eligible)
    noise = draw_variant_noise(layout, batch, torch.Generator().manual_seed(seed), torch.device("cpu"))
    start = torch.cat([own.coarsest[None], sample_variants(noise, own)[:, 1:].flatten(0, 1)])
    scores = own.spread_block_scores(adversarial_scores(kind, start.shape, seed))
    assert torch.equal(allocate(start, scores, fixed), allocate(start, scores, own))
    assert torch.equal(shrink(start, scores, fixed), shrink(start, scores, own))


@given(cases, adversarial, st.integers(0, 2**16))
def test_property_a_fixed_count_of_shrinks_gets_within_budget_where_shrinking_until_done_does(case, kind, draw):
    """:func:`shrink_to_budget` calls the shrink ``L + 1`` times, whatever the cut: it reaches the cut and the verdict
    that calling it until the cut is within budget, or until a call frees nothing, reaches. Cuts over budget are the
    layout's variants held to a smaller budget."""
    shape, batch, seed = case
    layout = Layout(**shape)
    tight = dataclasses.replace(layout, W=layout.coarsest_cover + draw % (layout.W - layout.coarsest_cover + 1))
    nodes = NodeTable.of(tight)
    noise = draw_variant_noise(layout, batch, torch.Generator().manual_seed(seed), torch.device("cpu"))
    scores = nodes.spread_block_scores(adversarial_scores(kind, (1, layout.n_nodes), seed))
    for cut in sample_variants(noise, NodeTable.of(layout)).flatten(0, 1):
        shown, size, expected = cut[None], int(cut.sum()), None
        while size > tight.W:
            shown = shrink(shown, scores, nodes)
            size, before = int(shown.sum()), size
            if size == before:
                break
        else:
            expected = shown
        got, within = shrink_to_budget(cut[None, None], scores, nodes)
        assert bool(within) == (expected is not None)
        assert expected is None or torch.equal(got[0], expected)
