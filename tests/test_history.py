"""Text over histories longer than the training window, through generation's own loop (issue 100): full context's
teacher-forced logits are one forward's, and the three conditions agree exactly where the history fits the budget."""

from __future__ import annotations

import json

import pytest
import torch
from builders import VOCAB, decisive, make_system, spread_lens

from mcfn.core.focus import Refocus
from mcfn.core.policy import FULL, LENS, SHIPPED
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.history import TRUNCATION, history_table, history_text, local_window
from mcfn.inference.contexts import GenerationStats
from mcfn.inference.generation import teacher_forced_full


def system_and_windows(length: int, seed: int = 3):
    system = spread_lens(decisive(make_system(64, 4, 2, 32, 8, N=2, seed=seed, key_smear=True)), seed=2)
    windows = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(4))
    return system, HeldOut([windows], torch.ones(VOCAB), docs=[torch.tensor([0, 0, 1])])


def test_full_contexts_teacher_forced_logits_are_one_forwards():
    """Full context fed a known text through the decode loop (prefill, then the cache a token at a time) reads
    what one forward over the whole text reads at every fed token."""
    system, held = system_and_windows(40)
    text = held.windows[0][0]
    logits, stats = teacher_forced_full(system.base, text[:25], text[25:])
    with torch.no_grad():
        expected = system.base(text[None])[0, 24:-1]
    assert logits.shape == (15, VOCAB) and stats.new_tokens == 15
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_history_within_the_budget_scores_alike_under_every_condition():
    """Where every window fits the refocus budget (20 tokens within W − R = 28), every condition's context is the
    whole text at its own positions: the three score the same and no gain is left. A history four times the budget
    (112 tokens) separates them: truncation reads less than full context."""
    system, held = system_and_windows(20)
    result = history_text(system, LENS, Refocus(4, steps=4, warm_steps=1), 4, held, scored=8)
    assert result.windows == 3 and result.documents == 2 and result.length == 20 and result.scored == 8
    for name in (SHIPPED, FULL.name):
        assert result.bpb[name] == pytest.approx(result.bpb[TRUNCATION], abs=1e-4)
        assert abs(result.gain[name].bpb) < 1e-4
    assert result.refocuses_per_token[SHIPPED] > 0 and result.refocuses_per_token[FULL.name] == 0
    longer = history_text(system, LENS, Refocus(4, steps=4, warm_steps=1), 4, system_and_windows(112)[1], scored=16)
    assert abs(longer.gain[FULL.name].bpb) > 1e-3, longer.gain
    # truncation keeps the newest W − R = 28 tokens at every refocus: 7 or 8 blocks of K = 4 as the blocks fall
    assert 28 <= longer.local_window[TRUNCATION] <= 32 and longer.local_window[FULL.name] is None
    table = history_table(longer, "lens")
    assert "| shipped (lens) |" in table and "| truncation (recency) |" in table and "3 windows of 112 tokens" in table
    assert "local window (tokens)" in table


def test_the_local_window_is_the_newest_blocks_at_LOD0_averaged_over_refocuses():
    """A layout's trailing run of ``0`` blocks, in tokens, averaged over the refocuses; a near past left out before
    the newest tokens ends the run there; none without a refocus. Fails counting every ``0`` (the far LOD0 picks)."""
    stats = GenerationStats(layouts=["0011·00", "2222100000", "00·0"])
    assert local_window(stats, 8) == pytest.approx(8 * (2 + 5 + 1) / 3)
    assert local_window(GenerationStats(), 8) is None


def test_the_history_cli_scores_three_conditions_on_a_trained_run(decoding_run, capsys, tmp_path):
    """``train.history`` on a two-layer run at four times its training window, with ``match`` beside: the table,
    and a JSON whose gains are truncation's bits per byte less each condition's; bad lengths or contexts exit 2."""
    from train.history import main as history_main

    run, _ = decoding_run
    out = tmp_path / "history.json"
    args = ["--ckpt", str(run), "--split", "val", "--length", "96", "--scored", "16", "--windows", "3"]
    assert history_main([*args, "--context", "match", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Text over 96-token histories" in printed and "| full |" in printed and "| match |" in printed
    record = json.loads(out.read_text())
    for name in (SHIPPED, FULL.name, "match"):
        expected = record["bpb"][TRUNCATION] - record["bpb"][name]
        assert record["gain"][name]["bpb"] == pytest.approx(expected, abs=1e-5)
    assert record["length"] == 96 and record["scored"] == 16 and record["windows"] >= 1
    assert history_main(["--ckpt", str(run), "--scored", "96", "--length", "96"]) == 2
    assert history_main(["--ckpt", str(run), "--length", "10000000"]) == 2
    assert history_main([*args, "--context", "recency"]) == 2  # truncation is always scored, not a --context
