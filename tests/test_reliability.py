"""The split-half reliability of LensNet's labels (mcfn.stage.reliability): 1 for identical estimates, about 0 for
noise, between the two as the noise grows, with an error that counts windows, not states."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.stage.reliability import pair_agreement, pooled, split_halves, whole_cut_rewards


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    num, den = pair_agreement(a, b)
    return num / den


def test_identical_estimates_agree_fully_and_reversed_ones_not_at_all():
    a = torch.tensor([0.0, 0.3, -0.1, 0.02, 0.5])
    assert agreement(a, a) == 1.0
    assert agreement(a, -a) == -1.0


def test_pairs_that_matter_more_weigh_more():
    """One far pair ordered alike outweighs a near pair ordered oppositely (an unweighted count would be 0)."""
    a = torch.tensor([0.0, 1.0, 1.01])
    b = torch.tensor([0.0, 1.01, 1.0])
    assert agreement(a, b) > 0.9


def test_noise_scores_near_zero_and_signal_near_one():
    generator = torch.Generator().manual_seed(0)
    truth = torch.randn(500, 8, 1, generator=generator)  # states, edits, one value each
    for noise_std, low, high in ((100.0, -0.05, 0.05), (0.01, 0.95, 1.0)):
        tokens = truth + noise_std * torch.randn(500, 8, 16, generator=generator)
        parts = [(i, *pair_agreement(*split_halves(tokens[i], generator))) for i in range(500)]
        assert low < pooled(parts).half < high, (noise_std, pooled(parts))


def test_split_halves_are_disjoint_halves_with_the_anchor_first():
    delta = torch.arange(8.0).repeat(3, 1)  # three edits, 8 predictions valued 0..7
    a, b = split_halves(delta, torch.Generator().manual_seed(1))
    assert a[0] == 0 and b[0] == 0 and a.numel() == 4
    assert torch.allclose((a[1:] + b[1:]) / 2, torch.full((3,), 3.5))  # together, every prediction once
    assert not torch.equal(a[1:], b[1:])


def test_the_error_counts_windows_and_spearman_brown_lifts_the_half():
    # Two windows that disagree with each other: a large error, however many states each has.
    parts = [(0, 0.8, 1.0)] * 20 + [(1, -0.2, 1.0)] * 20
    r = pooled(parts)
    assert math.isclose(r.half, 0.3) and r.windows == 2 and r.states == 40
    assert r.se > 0.3
    assert math.isclose(r.full, 2 * 0.3 / 1.3) and math.isclose(r.ceiling, math.sqrt(r.full))
    same = pooled([(w, 0.3, 1.0) for w in range(40)])
    assert same.se < 1e-9


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.integers(0, 2**16))
def test_property_agreement_is_symmetric_and_bounded(values, seed):
    a = torch.tensor(values)
    b = a + torch.randn(a.numel(), generator=torch.Generator().manual_seed(seed))
    num, den = pair_agreement(a, b)
    assert abs(num) <= den + 1e-6
    assert math.isclose(num, pair_agreement(b, a)[0], rel_tol=1e-6, abs_tol=1e-6)


def test_a_runs_labels_are_measured_on_both_sets_and_the_checkpoint_is_untouched(decoding_run, tmp_path):
    """``train.lens --reliability 2`` on a tiny run: both window sets measured, each state's chunk ΔNLL the mean
    of the per-prediction ΔNLLs the halves split, and nothing written into the checkpoint."""
    import json
    import shutil

    from mcfn.checkpoint import Checkpoint
    from train.lens import main as lens_main

    run = tmp_path / "run"
    shutil.copytree(decoding_run[0], run)
    before = (run / "checkpoint.pt").read_bytes()
    assert lens_main(["--run", str(run), "--reliability", "2", "--held-out", "2"]) == 0
    figures = json.loads((run / "lens_labels.json").read_text())
    layout = Checkpoint.read(run).cfg.mc
    chunks = layout.tail // layout.refocus_every
    for name in ("training windows (the stage's: half with a task)", "validation windows (corpus text)"):
        edits, attention = figures[name]["single-edit ΔNLL"], figures[name]["attention"]
        assert -1.0 <= edits["half"] <= 1.0 and edits["states"] == 2 * chunks, edits
        whole, two = figures[name]["whole cuts"], figures[name]["two-chunk ΔNLL"]
        assert -1.0 <= whole["half"] <= 1.0 and whole["states"] == 2 * chunks, whole
        assert -1.0 <= two["half"] <= 1.0 and two["states"] == 2 * (chunks - 1), two  # the last chunk has no next
        assert -1.0 <= attention["half"] <= 1.0 and attention["states"] == 2, attention
        for figures_of in (edits, attention):  # each label's worth against the measured ΔNLL, NaN below 3 edits
            corr = figures_of["utility_corr"]
            assert corr != corr or -1.0 <= corr <= 1.0
    assert (run / "checkpoint.pt").read_bytes() == before


def test_the_labels_halves_split_are_the_labels_own_predictions(decoding_run):
    from mcfn.checkpoint import Checkpoint
    from mcfn.core.focus import Refocus
    from mcfn.data.corpus import prepare_corpus
    from mcfn.data.mixture import training_sampler
    from mcfn.stage.candidates import run_system
    from mcfn.stage.traces import trace

    class Bar:
        def update(self, _):
            pass

    ckpt = Checkpoint.read(decoding_run[0])
    system, cfg = run_system(ckpt, torch.device("cpu"))
    batch = training_sampler(cfg, prepare_corpus(cfg.data)).batch(0, 1)
    states = trace(system, [batch], Refocus(cfg.mc.refocus_every), 1, 0, Bar())[2]
    for s in states:
        by_token = s.labelled.delta_by_token
        assert by_token.shape == (s.labelled.delta.numel(), cfg.mc.refocus_every)
        torch.testing.assert_close(by_token.mean(-1), s.labelled.delta)
        # The whole cuts: LensNet's first, then match's, recency and the one random cut, each the chunk NLL traced.
        whole = s.labelled.cuts_by_token
        assert whole.shape == (4, cfg.mc.refocus_every)
        torch.testing.assert_close(whole[0].mean(), s.labelled.nll["lens"][0])
        torch.testing.assert_close(whole[1].mean(), s.labelled.nll["match"][0])


def test_the_attention_labels_halves_together_are_the_whole_tails_attention(decoding_run):
    from mcfn.checkpoint import Checkpoint
    from mcfn.core.attention import hidden_and_tail_attention, node_mass
    from mcfn.data.corpus import prepare_corpus
    from mcfn.data.mixture import training_sampler
    from mcfn.evaluation.indexer_recall import tail_attention
    from mcfn.stage.candidates import run_system
    from mcfn.stage.reliability import attention_halves

    system, cfg = run_system(Checkpoint.read(decoding_run[0]), torch.device("cpu"))
    window = training_sampler(cfg, prepare_corpus(cfg.data)).batch(0, 1)
    nodes, layout = system.nodes, system.layout
    a, b = attention_halves(tail_attention(system.base, window, layout)[0], nodes, torch.Generator().manual_seed(0))
    gists = (nodes.lod > 0) & nodes.eligible
    assert a.shape == b.shape == (int(gists.sum()),) and not torch.equal(a, b)
    positions = torch.arange(layout.T, dtype=torch.float32)[None]
    emb, first = system.base.embed(window[:, : layout.T]), torch.tensor([layout.T - layout.H])
    whole = hidden_and_tail_attention(system.base, emb, positions, torch.ones_like(positions), first, layout.H)[1]
    torch.testing.assert_close((a + b) / 2, node_mass(whole[0].mean(0)[None], layout)[0, gists])


def test_a_small_validation_split_gives_windows_of_its_text_with_their_documents():
    import numpy as np

    from mcfn.data.corpus import Split
    from mcfn.stage.labels import reliability_windows

    split = Split(tokens=np.arange(300, dtype=np.uint16), doc_offsets=np.array([0, 100, 250, 300]))
    rows, docs = reliability_windows(split, 40, 12, 4, seed=0)
    assert rows.shape == (12, 40) and docs.shape == (12,)
    for row, doc in zip(rows.tolist(), docs.tolist(), strict=True):
        assert row == list(range(row[0], row[0] + 40))  # a window of the text itself
        assert split.doc_offsets[doc] <= row[0] < split.doc_offsets[doc + 1]  # the document it starts in


def test_whole_cut_rewards_are_group_relative_and_follow_the_lower_nll():
    """A whole cut's reward is minus its NLL on the half's predictions, less the group's mean: they sum to 0, and
    the cut with the lower NLL there has the higher reward."""
    nll = torch.tensor([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 0.0, 5.0]])
    half = torch.tensor([0, 2])
    reward = whole_cut_rewards(nll, half)
    torch.testing.assert_close(reward.sum(), torch.tensor(0.0))
    assert reward[2] > reward[0] == reward[1]  # NLL on the half's predictions: 2, 2 and 0
    torch.testing.assert_close(reward, torch.tensor([-2.0, -2.0, 0.0]) - torch.tensor([-2.0, -2.0, 0.0]).mean())


def test_an_edits_two_chunk_label_is_its_chunk_label_then_the_next_chunk_with_its_context_carried():
    """:func:`~mcfn.stage.carried.carried_delta_by_token`: the first ``k`` columns are the traced chunk's own ΔNLL;
    the next are the next chunk's, read with the edit's context carried into LensNet's warm refocus there, against
    the policy's own carried cut: for the edit whose effect carries furthest, a separate warm refocus and forward give
    the same, and the edits' next-chunk labels differ from one another (a cold refocus would give them all one)."""
    from builders import VOCAB, awake, make_system, spread_lens

    from mcfn.core.focus import Refocus, focus_cut, view_context
    from mcfn.core.policy import LENS
    from mcfn.core.system import tree_stage
    from mcfn.evaluation.chunks import chunk_predictions, chunk_view
    from mcfn.evaluation.counterfactual import trace_window
    from mcfn.stage.carried import carried_delta_by_token

    system = spread_lens(awake(make_system(64, 4, 2, 32, 16, N=2, seed=3, refocus_every=4)), seed=2).eval()
    protocol = Refocus(4)
    for seed in range(8):  # the first window with an edit whose effect outlasts its chunk
        window = torch.randint(0, VOCAB, (1, 65), generator=torch.Generator().manual_seed(seed))
        tree = tree_stage(system, window)
        states = trace_window(system, tree, window, protocol, 1, torch.Generator().manual_seed(0))
        pairs = [(s, f, carried_delta_by_token(system, tree, window, protocol, s, f))
                 for s, f in zip(states, states[1:], strict=False)]  # fmt: skip
        k = states[0].labelled.delta_by_token.size(1)
        carrying = [(s, f, labels) for s, f, labels in pairs if labels[:, k:].std(0).max() > 1e-6]
        if carrying:
            break
    assert carrying, "the case needs an edit whose effect reaches the next chunk"
    state, following, labels = carrying[0]
    torch.testing.assert_close(labels[:, :k], state.labelled.delta_by_token)
    here, there = (chunk_view(tree, window, system.nodes, s.n, protocol.every) for s in (state, following))
    edit = int(labels[:, k:].abs().sum(-1).argmax())
    carried = view_context(here.tree, state.labelled.edits.shown[edit][None, None], here.window, here.view)
    scorer = LENS.scorer(system, there.window, there.view.layout, protocol.every)
    cut = focus_cut(scorer, there.tree, there.window, there.view, protocol.warm_steps, carried)
    nll = chunk_predictions(system, tree, there.window_cut(cut[:, 0])[None], window, there)[0][0, 0]
    torch.testing.assert_close(labels[edit, k:], following.labelled.cuts_by_token[0] - nll, atol=1e-5, rtol=1e-5)


def test_the_single_edit_labels_error_is_over_documents_computed_by_hand():
    """Four windows from two documents, one state each, two predictions a chunk (so the two halves are the two
    predictions, whichever order the draw takes): the pooled agreement and its jackknife error over the two
    documents, computed here by hand, are what ``single_edit_reliability`` reports with the windows' documents."""
    from types import SimpleNamespace

    from mcfn.stage.reliability import single_edit_reliability

    by_state = [  # [edits, 2 predictions] ΔNLL per window
        torch.tensor([[0.5, 0.4], [-0.2, 0.1], [0.3, -0.6]]),
        torch.tensor([[1.0, 0.8], [0.1, 0.2], [-0.4, -0.5]]),
        torch.tensor([[0.2, -0.3], [-0.1, 0.6], [0.7, 0.1]]),
        torch.tensor([[-0.5, -0.2], [0.9, -0.1], [0.0, 0.4]]),
    ]
    documents = [0, 0, 1, 1]

    def by_hand(labels: torch.Tensor) -> tuple[float, float]:
        a, b = [0.0, *labels[:, 0].tolist()], [0.0, *labels[:, 1].tolist()]  # the unedited cut's 0 first
        n = d = 0.0
        for i in range(len(a)):
            for j in range(len(a)):
                da, db = a[i] - a[j], b[i] - b[j]
                sign = (da > 0) - (da < 0), (db > 0) - (db < 0)
                n += (abs(da) + abs(db)) * sign[0] * sign[1]
                d += abs(da) + abs(db)
        return n, d

    sums = {doc: [0.0, 0.0] for doc in (0, 1)}
    for labels, doc in zip(by_state, documents, strict=True):
        n, d = by_hand(labels)
        sums[doc][0] += n
        sums[doc][1] += d
    N, D = sum(s[0] for s in sums.values()), sum(s[1] for s in sums.values())
    leave_out = [(N - sums[doc][0]) / (D - sums[doc][1]) for doc in (0, 1)]
    mean = sum(leave_out) / 2
    se = math.sqrt(0.5 * sum((x - mean) ** 2 for x in leave_out))
    states = [SimpleNamespace(window=w, labelled=SimpleNamespace(delta_by_token=x)) for w, x in enumerate(by_state)]
    got = single_edit_reliability(states, seed=0, clusters=documents)
    assert got.windows == 2 and got.states == 4
    assert math.isclose(got.half, N / D, rel_tol=1e-5) and math.isclose(got.se, se, rel_tol=1e-5)
