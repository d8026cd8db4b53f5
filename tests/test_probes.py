"""Long-range probes and their scoring: deterministic, answers exactly where the task says, scored right."""

from __future__ import annotations

import pytest
import torch
from builders import make_documents

from mcfn.data.probes import PAIRS, PROBES, QUERIES, make_probe, misfit
from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError
from mcfn.evaluation.one_cut import Predictions
from mcfn.evaluation.stats import record

T, H = 512, 128


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(make_documents(40), vocab_size=320)


@pytest.fixture(scope="module")
def haystack(tok) -> torch.Tensor:
    ids = tok.encode(" ".join(make_documents(20, seed=5)))
    return torch.tensor([ids[i * 300 : i * 300 + T + 1] for i in range(4)])


@pytest.mark.parametrize("name", PROBES)
def test_probes_are_deterministic_and_answer_in_the_tail(name, tok, haystack):
    a, b = make_probe(name, haystack, tok, H, seed=7), make_probe(name, haystack, tok, H, seed=7)
    assert torch.equal(a.window, b.window) and torch.equal(a.answer, b.answer) and torch.equal(a.depth, b.depth)
    assert a.window.shape == haystack.shape and a.answer.shape == (4, T)
    assert a.answer.any(-1).all() and not a.answer[:, : T - H].any(), "answers only in the scored tail (I4)"
    if name != "corpus":
        assert not torch.equal(make_probe(name, haystack, tok, H, seed=8).window, a.window)
        assert ((a.depth >= 0) & (a.depth < (T - H) / T)).all()


def answers(probe, row: int) -> torch.Tensor:
    """The answer tokens of one window: the targets at its answer positions."""
    return probe.window[row, 1:][probe.answer[row]]


def test_passkey_asks_for_the_key_stated_at_its_depth(tok, haystack):
    probe = make_probe("passkey", haystack, tok, H, seed=1)
    for row in range(4):
        key = tok.decode(answers(probe, row).tolist()).strip()
        assert key.isdigit() and len(key) == 5
        at = int(probe.depth[row] * T)
        stated = tok.decode(probe.window[row, at : at + 40].tolist())
        assert f"The pass key is {key}." in stated
        assert tok.decode(probe.window[row, -H:].tolist()).endswith(f"The pass key is {key}")


def test_the_pass_keys_fact_ends_before_the_scored_tail_in_the_shortest_window_it_fits(tok):
    """In the shortest window the pass key fits, where its fact has the least room, the whole fact lies before the
    scored tail for every draw: the room left for it counts the fact's own length. Fails when it does not (the fact
    may then run into the tail, where every context shows it at LOD0)."""
    ids = tok.encode(" ".join(make_documents(20, seed=6)))
    length = next(t for t in range(H + 8, 4 * H, 8) if misfit("passkey", tok, t, H) is None)
    windows = torch.tensor([ids[i * 50 : i * 50 + length + 1] for i in range(16)])
    for seed in range(12):
        probe = make_probe("passkey", windows, tok, H, seed=seed)
        for row in range(16):
            key = tok.decode(answers(probe, row).tolist()).strip()
            before_tail = tok.decode(probe.window[row, : length + 1 - H].tolist())
            assert f"{key} is the pass key." in before_tail, (seed, row)


def test_kv_recall_asks_for_values_stated_earlier(tok, haystack):
    probe = make_probe("kv-recall", haystack, tok, H, seed=2)
    for row in range(4):
        text = tok.decode(probe.window[row].tolist())
        question = text[text.rindex("Recall:") :]
        asked = [part.strip() for part in question.removeprefix("Recall:").split(";") if part.strip()]
        assert len(asked) == QUERIES
        facts = text[: text.rindex("Recall:")]
        assert sum(f"{k.split(' = ')[0]} = " in facts for k in asked) == QUERIES
        for pair in asked:
            assert f"\n{pair};\n" in facts, pair  # each queried value is the one stated for its key
        values = tok.decode(answers(probe, row).tolist()).split()
        assert values == [pair.split(" = ")[1] for pair in asked]
        assert facts.count(" = ") >= PAIRS


def test_copy_repeats_early_text_and_scores_all_but_its_first_token(tok, haystack):
    probe = make_probe("copy", haystack, tok, H, seed=3)
    for row in range(4):
        at = int(round(float(probe.depth[row]) * T))
        span = probe.window[row, -24:]
        assert torch.equal(span, haystack[row, at : at + 24])
        assert torch.equal(answers(probe, row), span[1:])


def test_a_probe_that_does_not_fit_the_tail_is_refused_with_the_reason(tok):
    assert misfit("passkey", tok, T, H) is None
    assert "mc.tail is 8" in misfit("passkey", tok, T, 8)
    with pytest.raises(UserError, match="unknown task"):
        make_probe("needle", torch.zeros(1, T + 1, dtype=torch.int64), tok, H, seed=0)


def scored_predictions(hit: torch.Tensor) -> Predictions:
    """Stand-in predictions for 2 windows, slots recency / 2 random / lens, every NLL 1 nat."""
    B, S, h = hit.shape
    slots = {"recency": slice(0, 1), "random": slice(1, 3), "lens": slice(3, 4)}
    return Predictions(torch.ones(B, S, h), hit, slots, torch.zeros(B, h, dtype=torch.int64), None)


def test_the_scorer_counts_a_window_answered_only_when_every_answer_token_is_the_argmax():
    scored = torch.zeros(2, 8, dtype=torch.int64)
    scored[:, 5:7] = 2  # two answer tokens of 2 bytes each per window
    always, never = torch.ones(2, 4, 8, dtype=torch.bool), torch.zeros(2, 4, 8, dtype=torch.bool)
    answer_only = never.clone()
    answer_only[..., 5:7] = True  # wrong everywhere but on the answer
    full = (torch.ones(2, 8), torch.ones(2, 8, dtype=torch.bool))
    for hit, expected in ((always, 1.0), (never, 0.0), (answer_only, 1.0)):
        out = record(scored_predictions(hit), {"full": full}, scored, torch.zeros(2))
        for name in ("recency", "random", "lens", "best_of_random", "best_of_all", "best_of_all_oos"):
            assert float(torch.cat(out.correct[name]).mean()) == expected, name
        assert torch.equal(torch.cat(out.nats["lens"]), torch.full((2,), 2.0, dtype=torch.float64))  # 2 tokens x 1
        assert torch.equal(torch.cat(out.nbytes), torch.full((2,), 4.0, dtype=torch.float64))
    half = never.clone()
    half[0, :, 5:7] = True  # the first window answered, the second not
    out = record(scored_predictions(half), {"full": full}, scored, torch.zeros(2))
    assert torch.cat(out.correct["lens"]).tolist() == [1.0, 0.0]


def test_the_measured_gap_is_positive_when_the_first_random_context_is_better():
    """``lens_rank_corr`` pairs LensNet's preference of random context i over j with ``nats[j] - nats[i]``."""
    hit = torch.ones(1, 4, 8, dtype=torch.bool)
    nll = torch.ones(1, 4, 8)
    nll[0, 1] = 0.5  # the first random context (slot 1) predicts better than the second (slot 2)
    slots = {"recency": slice(0, 1), "random": slice(1, 3), "lens": slice(3, 4)}
    scored = torch.ones(1, 8, dtype=torch.int64)
    full = (torch.ones(1, 8), torch.ones(1, 8, dtype=torch.bool))
    one_chunk = torch.zeros(1, 8, dtype=torch.int64)
    pred = Predictions(nll, hit, slots, one_chunk, torch.tensor([[[1.0]]]))
    out = record(pred, {"full": full}, scored, torch.zeros(1))
    assert torch.cat(out.measured).tolist() == [4.0] and torch.cat(out.predicted).tolist() == [1.0]
    assert float(torch.cat(out.nats["best_of_random"])[0]) == 4.0  # the better random context
