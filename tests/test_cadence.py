"""When a stream refocuses (mcfn.core.cadence): the copy rule's decisions, and the evaluation refocusing exactly where
generation does under it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from builders import VOCAB, decisive, make_system, spread_lens
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.cadence import CLOCK, COPY, RefocusWatch, parse_rule, rule_name
from mcfn.core.context import WorkingContext
from mcfn.core.focus import Refocus
from mcfn.core.policy import MATCH, renamed
from mcfn.evaluation.batch import EvalBatch, EvalSettings
from mcfn.evaluation.refocused import predict_chunked
from mcfn.inference.generation import teacher_forced_mc

T, K, L, W, H, R = 64, 4, 2, 32, 16, 8


def context_of(starts: list[int], lods: list[int]) -> WorkingContext:
    """A ``[1, m]`` context with these entries (spans from their LOD, ``K`` per level)."""
    start = torch.tensor([starts])
    lod = torch.tensor([lods])
    span = K**lod
    zeros = torch.zeros_like(start)
    return WorkingContext(
        emb=torch.zeros(1, len(starts), 4), position=start.float(), start=start, span=span, lod=lod,
        node=zeros, target=zeros - 1, valid=torch.ones_like(start, dtype=torch.bool), batch_size=[1, len(starts)],
    )  # fmt: skip


def test_rule_names_round_trip():
    assert parse_rule(rule_name(CLOCK, 16)) == (CLOCK, 16) and parse_rule(rule_name(COPY, 8)) == (COPY, 8)
    assert rule_name(COPY, 16) == "copy16" and rule_name(CLOCK, 4) == "4"
    with pytest.raises(ValueError):
        parse_rule("copy")


def test_copy_rule_fires_where_a_copy_starts_whose_continuation_is_hidden():
    """History 10 11 12 13 ... 30 then 10 11 12: the trigram 10 11 12 recurs, and what followed it (13) is a gist in
    the context. A refocus is due after the 12, not before (10 11 alone is no trigram match), and not where 13 is
    shown raw. Fails with the rule reading the newest bigram, or ignoring what the context shows."""
    history = list(range(10, 31))
    gist = context_of([0, 16, 20], [2, 0, 0])  # tokens 0..15 as one LOD2 gist, 16 and 20 raw
    for context, fires in ((gist, True), (context_of([3], [0]), False)):
        watch = RefocusWatch(COPY, 16, 1.0, history)
        watch.refocused(context)
        assert [watch.due(t) for t in (10, 11, 12)] == [False, False, fires]


def test_copy_rule_does_not_fire_again_for_a_copy_the_last_refocus_saw():
    """Once a refocus was made with the copy's trigram at its horizon, the copy's next tokens do not make another due
    (the same cut would be chosen), but the clock still does."""
    history = list(range(10, 31)) + [10, 11, 12]
    watch = RefocusWatch(COPY, 6, 1.0, history)
    watch.refocused(context_of([0], [2]))  # everything hidden behind one gist
    assert [watch.due(t) for t in (13, 14, 15, 16, 17)] == [False] * 5
    assert watch.due(18), "the clock: 6 tokens since the last refocus"


def test_copy_evidence_weighs_each_occurrence_as_match_does():
    """A trigram with two earlier occurrences, one continuation hidden: evidence 1/2, due at threshold 0.5 only."""
    history = [1, 2, 3, 7, 50, 51, 1, 2, 3, 8, 60, 61, 62, 63]
    for threshold, fires in ((0.5, True), (1.0, False)):
        watch = RefocusWatch(COPY, 16, threshold, history)
        watch.refocused(context_of([0, 4, 9], [1, 1, 0]))  # 7 (position 3) under a gist, 8 (position 9) raw
        assert [watch.due(t) for t in (1, 2, 3)] == [False, False, fires]


def decisions(on: str, every: int, tokens: list[int]) -> list[bool]:
    """A watch fed ``tokens`` one by one, refocused (to a context of the newest token alone) whenever it is due."""
    watch = RefocusWatch(on, every, 0.5)
    watch.refocused(context_of([0], [0]))
    out = []
    for token in tokens:
        out.append(watch.due(token))
        if out[-1]:
            watch.refocused(context_of([len(watch.tokens) - 1], [0]))
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=4, max_size=60), st.integers(1, 8), st.data())
def test_property_refocus_rules_keep_the_clock_and_read_no_future(tokens, every, data):
    """The clock rule is due exactly every R tokens whatever they are; the copy rule at the latest then; and a
    decision at a token reads nothing after it (I11: another continuation decides the same up to it)."""
    assert decisions(CLOCK, every, tokens) == [(i + 1) % every == 0 for i in range(len(tokens))]
    copy = decisions(COPY, every, tokens)
    gaps = [i for i, fired in enumerate([True, *copy]) if fired]
    assert all(b - a <= every for a, b in zip(gaps, [*gaps[1:], len(tokens)], strict=True))
    cut = data.draw(st.integers(0, len(tokens)))
    other = tokens[:cut] + data.draw(
        st.lists(st.integers(0, 5), min_size=len(tokens) - cut, max_size=len(tokens) - cut)
    )
    assert decisions(COPY, every, other)[:cut] == copy[:cut]


def copying_windows(rows: int, seed: int) -> torch.Tensor:
    """Windows whose second half copies stretches of the first: the copy rule fires inside the tail."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (rows, T + 1), generator=g)
    for row in range(rows):
        for at in (T - H + 2, T - H + 9):
            src = int(torch.randint(0, T // 2 - 8, (1,), generator=g))
            window[row, at : at + 6] = window[row, src : src + 6]
    return window


def test_evaluation_refocuses_where_generation_does_under_the_copy_rule():
    """Under the copy rule, the evaluation's ``match`` refocuses at generation's own tokens and its tail NLL equals
    generation's logits fed the same tokens. Fails with an evaluation that refocuses on the clock while generation
    refocuses on the event (the schedule below is not the clock's), or a watch fed a token late."""
    system = spread_lens(decisive(make_system(T, K, L, W, H, N=2, seed=1)), seed=2)
    window = copying_windows(2, seed=5)
    rule = Refocus(R, steps=4, warm_steps=1, on=COPY, threshold=0.5)
    policy = renamed(MATCH, "match_copy")
    with torch.no_grad():
        settings_ = EvalSettings((W,), 4, refocus=4, refocus_every=R, refocus_on=COPY, refocus_threshold=0.5,
                                 brief=True, candidates=(policy,))  # fmt: skip
        batch = EvalBatch.of(system, settings_, window, torch.full((2,), T - H))
        pred = predict_chunked(batch, W, torch.Generator().manual_seed(0))
    off_clock = False
    for row in range(2):
        prompt, continuation = window[row, : T - H + 1], window[row, T - H + 1 :]
        logits, stats = teacher_forced_mc(system, prompt, continuation, rule, MATCH)
        nll = F.cross_entropy(logits, continuation, reduction="none")
        torch.testing.assert_close(pred.nll[row, pred.slots["match_copy"].start], nll, atol=1e-4, rtol=1e-4)
        assert int(pred.refocus_counts()["match_copy"][row]) == len(stats.layouts)
        off_clock |= len(stats.layouts) != H // R
    assert off_clock, "the test needs the copy rule to refocus off the clock"
