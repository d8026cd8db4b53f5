"""The best-of conditions: how much a better choice of cut could gain, picked in sample and out of sample."""

from __future__ import annotations

import torch
from builders import VOCAB, decisive, make_system, spread_lens

from mcfn.evaluation.batch import EvalBatch, EvalSettings
from mcfn.evaluation.evaluate import evaluate, record
from mcfn.evaluation.headroom import candidate_slots, halves, per_chunk
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.long_range import far_context_tokens
from mcfn.evaluation.one_cut import Predictions
from mcfn.evaluation.refocused import predict_chunked

T, K, L, W, H, R = 64, 4, 2, 32, 16, 4


def hand_built(rows: list[list[float]], chunk: list[int]) -> Predictions:
    """One window whose contexts are recency then random cuts, with these NLLs per tail column."""
    nll = torch.tensor([rows])
    slots = {"recency": slice(0, 1), "random": slice(1, len(rows))}
    return Predictions(nll, torch.ones_like(nll, dtype=torch.bool), slots, torch.tensor([chunk]), None)


def test_the_out_of_sample_pick_never_scores_a_token_with_a_choice_that_saw_it():
    """Cut A is perfect on the first half of the chunk and bad on the second; B is middling throughout. Picked in
    sample the best of all scores each chunk by its better context (B, 4 nats); cross-fitted, the first half is
    scored by the choice made on the second (B: 2) and the second by the choice made on the first (A: 10)."""
    pred = hand_built([[9.0] * 4, [0.0, 0.0, 5.0, 5.0], [1.0] * 4], [0, 0, 0, 0])
    full = (torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool))
    out = record(pred, {"full": full}, torch.ones(1, 4), torch.zeros(1))
    assert float(out.nats["best_of_all"][0]) == 4.0 and float(out.nats["best_of_random"][0]) == 4.0
    assert float(out.nats["best_of_all_oos"][0]) == 12.0


def test_halves_split_each_chunk_and_leave_unscored_columns_out():
    chunk = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 1, 1, 2]])
    assert halves(chunk).tolist() == [[-1, -1, 0, 0, 1, 2, 2, 3, 3, 4]]


def test_best_of_all_is_at_most_every_condition_it_picks_from_chunk_by_chunk():
    """Under generation's protocol, per chunk and in sum, the in-sample best of all is no worse than recency, attn,
    match, lens or any random cut; the out-of-sample pick is no better than it."""
    system = spread_lens(decisive(make_system(T, K, L, W, H, N=2, seed=1)), seed=2)
    window = torch.randint(0, 4, (3, T + 1), generator=torch.Generator().manual_seed(5))  # 4 ids: match acts
    with torch.no_grad():
        settings = EvalSettings((W,), 4, refocus=4, refocus_every=R)
        pred = predict_chunked(EvalBatch.of(system, settings, window, torch.full((3,), T - H)), W, torch.Generator())
    scored = torch.ones(3, H)
    out = record(pred, {"full": (torch.zeros(3, H), torch.ones(3, H, dtype=torch.bool))}, scored, torch.zeros(3))
    slots = candidate_slots(pred)
    assert len(slots) == 4 + 5  # the random cuts, recency, attn, match, lens, branches
    chunk_nats = per_chunk(pred, scored > 0, scored, slots)[0]  # [B, S, C]
    best = out.nats["best_of_all"][0]
    assert torch.allclose(best, chunk_nats.min(1).values.sum(-1).double())
    for name in ("recency", "attn", "match", "lens", "best_of_random"):
        assert (best <= out.nats[name][0] + 1e-6).all(), name
    assert (out.nats["best_of_all_oos"][0] >= best - 1e-6).all()


def test_long_range_tokens_are_those_whose_context_only_the_far_past_holds():
    """The tail's positions 60..63 end the trigrams (1,2,3), (2,3,4), (3,4,5), (4,5,6): the first was seen only 40
    tokens back (far), the second 46 and 8 back (near too), the third never, the fourth only 31 back, on the edge."""
    window = torch.arange(1000, 1065)[None].clone()  # distinct ids: no trigram repeats
    window[0, 58:64] = torch.tensor([1, 2, 3, 4, 5, 6])
    window[0, 15:21] = torch.tensor([2, 3, 4, 1, 2, 3])  # (2,3,4) ends at 17, (1,2,3) at 20
    window[0, 51:54] = torch.tensor([2, 3, 4])  # ends at 53: 8 before 61
    window[0, 30:33] = torch.tensor([4, 5, 6])  # ends at 32: 31 before 63
    assert far_context_tokens(window, tail=4, near=31)[0].tolist() == [True, False, False, True]
    assert far_context_tokens(window, tail=4, near=32)[0].tolist() == [True, False, False, False]


def test_the_long_range_tokens_depend_on_the_tokens_not_on_any_model():
    """Two models of different weights, scored on the same windows, report the same long-range tokens."""
    windows = [torch.randint(0, 4, (2, T + 1), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    settings = EvalSettings(budgets=(W,), random_contexts=2, refocus=1, tasks=("corpus",), refocus_every=R)
    counts = []
    for seed in (1, 2):
        system = decisive(make_system(T, K, L, W, H, N=2, seed=seed))
        report = evaluate(system, HeldOut(windows, torch.ones(VOCAB, dtype=torch.int64)), settings)
        counts.append(report.head.longrange.tokens)
    assert counts[0] == counts[1] > 0
