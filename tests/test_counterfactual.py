"""The counterfactual LensNet: single legal edits of a cut, their ΔNLL under generation's protocol, the ranking
objective, traces on disk and the stage that trains on them (issue 53)."""

from __future__ import annotations

import math

import pytest
import torch
from builders import VOCAB, awake, check_cut, make_system, rewritten_after
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.edits import COLLAPSE, DROP, EXPAND, edit_worth, ranking_loss, single_edits
from mcfn.core.focus import Refocus, focus_cut, view_context
from mcfn.core.system import tree_stage
from mcfn.errors import UserError
from mcfn.evaluation.chunks import chunk_view
from mcfn.evaluation.counterfactual import label_edits, lens_view_scores, trace_window
from mcfn.stage.traces import Traces, fingerprint

T, K, L, W, H, R = 64, 4, 2, 32, 16, 4


@pytest.fixture(scope="module")
def system():
    return awake(make_system(T, K, L, W, H, N=2, seed=3, refocus_every=R)).eval()


def window_of(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, T + 1), generator=torch.Generator().manual_seed(seed))


def policy_state(system, window: torch.Tensor, n: int):
    """The chunk at history ``n``: its view, LensNet's cold cut in it, and LensNet's scores there."""
    tree = tree_stage(system, window)
    cv = chunk_view(tree, window, system.nodes, n, R)
    cut = focus_cut(system.lensnet.scorer(cv.view.layout, cv.window, system.base), cv.tree, cv.window, cv.view, steps=4)
    return tree, cv, cut[0, 0], lens_view_scores(system, cv)[0]


@torch.no_grad()
def by_hand_nll(system, cv, cut: torch.Tensor, window: torch.Tensor) -> float:
    """The chunk's mean NLL read the way generation reads it: the cut's context (:func:`view_context`), then the
    chunk's tokens appended one entry each, through the base model once."""
    base, n, upto = system.base, cv.n, cv.upto
    ctx = view_context(cv.tree, cut[None, None], cv.window, cv.view)
    tokens = window[:, n:upto]
    positions = torch.arange(n, upto, dtype=torch.float32)[None]
    emb = torch.cat([ctx.emb, base.embed(tokens)], 1)
    pos = torch.cat([ctx.position, positions], 1)
    span = torch.cat([ctx.span.float(), torch.ones_like(positions)], 1)
    k = upto - n + 1
    h = base.hidden(emb, pos, span)[:, -k:]
    return float(base.nll(h, window[:, n : upto + 1]).mean())


def test_every_edit_is_a_legal_cut_within_budget_and_the_policy_is_a_candidate(system):
    """Every candidate cut is legal (I2, I3, I4: disjoint, within W, the tail at LOD0, nothing left out but whole
    droppable spans); each kind of edit occurs; the policy's own cut is scored beside the edits. Fails if an
    expansion is not paid for, or a collapse's freed budget overflows."""
    kinds = set()
    for seed in range(4):
        window = window_of(seed)
        for n in range(T - H + 1, T + 1, R):
            tree, cv, cut, scores = policy_state(system, window, n)
            edits = single_edits(cut, scores, cv.nodes)
            check_cut(edits.shown, cv.nodes.layout)
            assert not (edits.shown == cut).all(-1).any(), "every edit changes the cut"
            kinds |= set(edits.kind.tolist())
            labelled = label_edits(system, tree, window, cv, cut, scores)
            assert labelled.delta.numel() == edits.kind.numel() and "lens" in labelled.nll
    assert kinds == {EXPAND, COLLAPSE, DROP}


def test_an_edits_delta_nll_equals_a_separate_forward_over_that_context(system):
    """ΔNLL of an edit = the chunk NLL under the policy's cut minus under the edit, each recomputed by hand the way
    generation reads a context. Fails if the packed forward scored other predictions or another cut."""
    window = window_of(7)
    n = T - H + 1 + R
    tree, cv, cut, scores = policy_state(system, window, n)
    labelled = label_edits(system, tree, window, cv, cut, scores)
    policy = by_hand_nll(system, cv, cut, window)
    assert labelled.nll["lens"][0] == pytest.approx(policy, abs=1e-5)
    for j in (0, labelled.delta.numel() // 2, labelled.delta.numel() - 1):
        edited = by_hand_nll(system, cv, labelled.edits.shown[j], window)
        assert float(labelled.delta[j]) == pytest.approx(policy - edited, abs=1e-5)
    assert labelled.delta.abs().max() > 1e-4, "the edits change what the base model predicts"


def test_candidates_read_nothing_after_the_horizon_but_the_labels_do(system):
    """No leak (I11): rewriting every token after a chunk's horizon leaves its candidates (the edits' cuts and
    nodes, the policy's scores) unchanged and changes its labels."""
    window = window_of(11)
    n = T - H + 1
    rewritten = rewritten_after(window, torch.tensor([n - 1]), seed=5)
    states = [policy_state(system, w, n) for w in (window, rewritten)]
    labels = [label_edits(system, tree, w, cv, cut, scores)
              for (tree, cv, cut, scores), w in zip(states, (window, rewritten), strict=True)]  # fmt: skip
    (_, _, cut_a, scores_a), (_, _, cut_b, scores_b) = states
    assert torch.equal(cut_a, cut_b) and torch.equal(scores_a, scores_b)
    a, b = labels[0].edits, labels[1].edits
    assert torch.equal(a.shown, b.shown) and torch.equal(a.gain, b.gain) and torch.equal(a.loss, b.loss)
    assert not torch.allclose(labels[0].delta, labels[1].delta)


@pytest.mark.parametrize("prior", ["gated", "sum"])
def test_warm_candidates_of_a_later_chunk_under_the_match_prior_read_nothing_after_its_horizon(prior):
    """No leak (I11) where the stage's candidates come from: LensNet under the match prior (whose votes read the
    window's tokens), on the second chunk, its cut warm from the first. Rewriting every token after that chunk's
    horizon leaves both chunks' candidates (the edits' cuts and nodes) unchanged, and changes the second's labels."""
    from builders import spread_lens

    system = spread_lens(
        awake(make_system(T, K, L, W, H, N=2, seed=3, refocus_every=R, lens={"match_prior": prior})), 4
    )
    window = torch.randint(0, 3, (1, T + 1), generator=torch.Generator().manual_seed(8))  # 3 ids: the votes fire
    second = T - H + 1 + R  # the second chunk's history
    rewritten = rewritten_after(window, torch.tensor([second - 1]), seed=6)
    walks = [trace_window(system.eval(), tree_stage(system, w), w, Refocus(R, 4, 1), 1, torch.Generator(), 0)
             for w in (window, rewritten)]  # fmt: skip
    for a, b in zip(*(walk[:2] for walk in walks), strict=True):
        assert torch.equal(a.labelled.edits.shown, b.labelled.edits.shown)
        assert torch.equal(a.labelled.edits.gain, b.labelled.edits.gain)
    assert walks[0][1].n == second and not torch.allclose(walks[0][1].labelled.delta, walks[1][1].labelled.delta)


def test_a_trace_walks_the_tail_on_policy_chunk_by_chunk(system):
    """One state per chunk of R, each carrying the policy's, match's, recency's and the random cuts' chunk NLLs."""
    window = window_of(2)
    states = trace_window(system, tree_stage(system, window), window, Refocus(R, 4, 1), 2, torch.Generator(), 9)
    assert [s.n for s in states] == list(range(T - H + 1, T + 1, R))
    assert all(s.window == 9 and set(s.labelled.nll) == {"lens", "match", "recency", "random"} for s in states)
    assert all(s.labelled.nll["random"].numel() == 2 for s in states)


deltas = st.lists(st.integers(-100, 100).map(lambda x: x / 100), min_size=3, max_size=12, unique=True)


@settings(max_examples=40, deadline=None)
@given(deltas, st.integers(0, 3))
def test_property_one_ranking_step_orders_the_edits_as_their_measured_worth(delta, padding):
    """From equal scores, one gradient step of the ranking loss gives each edit a score that rises with its ΔNLL:
    the order of the scores is exactly the order of the labels (padding ignored). With the labels' sign flipped the
    order is reversed, so this fails for a loss that ranked the wrong way."""
    for sign in (1.0, -1.0):
        labels = torch.tensor(delta + [0.0] * padding) * sign
        valid = torch.arange(labels.numel()) < len(delta)
        predicted = torch.zeros(1, labels.numel(), requires_grad=True)
        ranking_loss(predicted, labels[None], valid[None]).backward()
        stepped = (-predicted.grad[0])[valid]
        order = torch.argsort(stepped)
        assert torch.equal(order, torch.argsort(labels[valid])), (sign, stepped, labels)
        assert (predicted.grad[0][~valid] == 0).all()


@given(deltas, st.data())
def test_property_the_ranking_loss_is_the_pair_loss_written_out(delta, data):
    """From any scores, the ranking loss is the sum over ordered pairs with Δ_i > Δ_j of |Δ_i − Δ_j| times the
    logistic loss of scoring j above i, over the sum of those weights, the unedited cut (score 0, Δ 0) among the
    items: a double loop by hand. A signed pair weight (Δ_i − Δ_j over every pair), an unweighted one or a list
    without the unedited cut gives another number."""
    scores = data.draw(st.lists(st.floats(-3, 3), min_size=len(delta), max_size=len(delta)))
    got = ranking_loss(torch.tensor([scores]), torch.tensor([delta]), torch.ones(1, len(delta), dtype=torch.bool))
    delta, scores = [0.0, *delta], [0.0, *scores]
    total, weights = 0.0, 0.0
    for i, di in enumerate(delta):
        for j, dj in enumerate(delta):
            if di > dj:
                weight = abs(di - dj)
                total += weight * math.log1p(math.exp(-(scores[i] - scores[j])))
                weights += weight
    assert float(got) == pytest.approx(total / weights, rel=1e-5, abs=1e-6)


def test_the_ranking_loss_asks_that_an_edit_helps_exactly_when_predicted_to():
    """Scores that order the edits as their ΔNLL lose more once shifted so that a harmful edit looks helpful (or a
    helpful one harmful): the unedited cut anchors them. Without it the loss would not see a shift."""
    delta = torch.tensor([[0.3, 0.1, -0.2, -0.4]])
    valid = torch.ones_like(delta, dtype=torch.bool)
    right = ranking_loss(10 * delta, delta, valid)
    for shift in (-3.0, 3.0):
        assert ranking_loss(10 * delta + shift, delta, valid) > right + 0.01


def test_an_edits_predicted_worth_is_what_it_gains_minus_what_it_gives_up():
    scores = torch.tensor([[0.5, -1.0, 2.0, 0.25]])
    gain, loss = torch.tensor([[2, -1, 0]]), torch.tensor([[1, 3, -1]])
    assert edit_worth(scores, gain, loss).tolist() == [[3.0, -0.25, 0.5]]


def test_traces_are_written_read_back_and_refused_for_another_checkpoint_or_config(system, tmp_path):
    window = window_of(4)
    tree = tree_stage(system, window)
    states = trace_window(system, tree, window, Refocus(R, 4, 1), 2, torch.Generator(), 0)
    config = {
        "data": {"mix": 0.8},
        "mc": {"budget": W, "block_size": K, "refocus_every": R, "lens": {"match_prior": False}},
    }
    made_by = fingerprint(system, 10, config)
    traces = Traces.of(window, tree.emb, states, made_by, round=1)
    traces.save(tmp_path / "t.pt")
    back = Traces.load(tmp_path / "t.pt", made_by)
    assert back.round == 1 and torch.equal(back.windows, traces.windows) and torch.equal(back.trees, traces.trees)
    assert all(torch.equal(back.states[k], traces.states[k]) for k in traces.states.keys())
    assert int(back.states["valid"].sum()) == sum(s.labelled.delta.numel() for s in states)
    policy = {**config, "mc": {**config["mc"], "lens": {"match_prior": True}}}
    assert fingerprint(system, 10, policy) == made_by, "the policy may change"
    other_configs = [{**config, "data": {**config["data"], "mix": 0.5}}]
    # [mc] outside [mc.lens] decides the states traced: the budget, the block size, the refocus cadence.
    other_configs += [{**config, "mc": {**config["mc"], key: value}} for key, value in
                      (("budget", W // 2), ("block_size", 2 * K), ("refocus_every", 2 * R))]  # fmt: skip
    other_weights = awake(make_system(T, K, L, W, H, N=2, seed=4, refocus_every=R))
    others = [fingerprint(system, 11, config), fingerprint(other_weights, 10, config)]
    for other in others + [fingerprint(system, 10, c) for c in other_configs]:
        with pytest.raises(UserError, match="another checkpoint or config") as refused:
            Traces.load(tmp_path / "t.pt", other)
        assert "\n" not in str(refused.value)
