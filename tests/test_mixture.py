"""The training mixture (``data.mix``): a share of training windows carries long-range facts, on its own stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import make_documents

from mcfn.data.corpus import Split
from mcfn.data.loader import WindowSampler, validation_batches
from mcfn.data.mixture import MixedSampler, write_repeat, write_shuffled_repeat
from mcfn.data.probes import make_probe
from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError
from mcfn.seeding import derive_seed

T, H = 512, 64


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(make_documents(40), vocab_size=320)


@pytest.fixture(scope="module")
def split(tok) -> Split:
    docs = [tok.encode(d) for d in make_documents(12, seed=3, sentences=120)]
    offsets = np.cumsum([0] + [len(d) for d in docs])
    return Split(tokens=np.concatenate(docs).astype(np.uint16), doc_offsets=offsets)


def mixed(split, tok, mix: float, tasks=("passkey", "kv-recall"), seed: int = 5) -> MixedSampler:
    return MixedSampler(WindowSampler(split, T + 1, seed), tok, H, mix, tasks, seed)


def test_a_share_of_rows_is_rewritten_and_the_rest_left_alone(split, tok):
    plain, sampler = WindowSampler(split, T + 1, 5), mixed(split, tok, 0.5)
    changed, asked = 0, 0
    for index in range(40):
        natural, batch = plain.batch(index, 8), sampler.batch(index, 8)
        assert torch.equal(batch, sampler.batch(index, 8)), "a pure function of (seed, index)"
        for row in range(8):
            if torch.equal(batch[row], natural[row]):
                continue
            changed += 1
            ending = tok.decode(batch[row, -H:].tolist())
            asked += "What is the pass key?" in ending or "Recall:" in ending
    assert changed == asked, "every rewritten row ends with a question"
    assert 0.35 < changed / 320 < 0.65, changed
    assert all(torch.equal(mixed(split, tok, 0.0).batch(i, 8), plain.batch(i, 8)) for i in range(5))


def test_the_mc_phase_has_its_own_share_and_its_tasked_rows_are_among_the_plain_phases(split, tok):
    """``data.mc_mix``: from the switch (``train.plain_steps``) on, a batch's tasked rows are drawn at the later share
    on the same stream, so a lower share keeps a subset of the rows the earlier one would have rewritten."""
    early = MixedSampler(WindowSampler(split, T + 1, 5), tok, H, 1.0, ("passkey",), 5)
    switched = MixedSampler(WindowSampler(split, T + 1, 5), tok, H, 1.0, ("passkey",), 5, later=0.25, switch=10)
    assert [switched.share(i) for i in (0, 9, 10, 30)] == [1.0, 1.0, 0.25, 0.25]
    for index in range(10):
        assert torch.equal(switched.batch(index, 8), early.batch(index, 8)), "the plain phase is unchanged"
    tasked = [switched.tasked(index, 8) for index in range(10, 50)]
    assert 0.1 < sum(map(sum, tasked)) / 320 < 0.4
    for index, rows in zip(range(10, 50), tasked, strict=True):
        batch, natural = switched.batch(index, 8), WindowSampler(split, T + 1, 5).batch(index, 8)
        for row, asked in enumerate(rows):
            assert torch.equal(batch[row], natural[row]) != asked


@pytest.mark.parametrize("plain_steps", [0, 10])
@pytest.mark.parametrize(("mix", "mc_mix"), [(1.0, 0.25), (0.0, 0.5), (0.5, 0.0)])
def test_a_run_s_sampler_switches_to_mc_mix_where_its_mc_phase_starts(text_dir, plain_steps, mix, mc_mix):
    """``data.mc_mix`` from the first MegaContext step on: at ``train.plain_steps``, or from the start of a run
    without a plain phase (all of it is the MC phase); a plain run (``mc.enabled`` off) keeps ``data.mix``. Either
    share may be 0: the batches are then the natural ones in that phase, and tasked ones in the other (a run with
    ``data.mix = 0`` still gets its MC phase's tasks)."""
    import dataclasses

    from builders import tiny_sections

    from mcfn.data.corpus import prepare_corpus
    from mcfn.data.loader import WindowSampler
    from mcfn.data.mixture import training_sampler
    from mcfn.profile import build_config

    sections = tiny_sections(f"text:{text_dir}", data={"mix": mix, "mc_mix": mc_mix, "mix_tasks": "repeat"})
    sections["train"]["plain_steps"] = plain_steps
    cfg = build_config(sections)
    corpus = prepare_corpus(cfg.data)
    sampler = training_sampler(cfg, corpus)
    first = mix if plain_steps else mc_mix
    assert [sampler.share(i) for i in (0, plain_steps, plain_steps + 5)] == [first, mc_mix, mc_mix]
    natural = WindowSampler(corpus.train, cfg.data.seq_len + 1, cfg.train.seed)
    for index in range(plain_steps + 12):
        share = sampler.share(index)
        changed = not torch.equal(sampler.batch(index, 8), natural.batch(index, 8))
        assert changed == any(sampler.tasked(index, 8)) and (share > 0 or not changed), (index, share)
    assert any(any(sampler.tasked(i, 8)) for i in range(plain_steps, plain_steps + 12)) == (mc_mix > 0)
    assert any(any(sampler.tasked(i, 8)) for i in range(plain_steps)) == (mix > 0 and plain_steps > 0)
    plain = training_sampler(dataclasses.replace(cfg, mc=dataclasses.replace(cfg.mc, enabled=False)), corpus)
    if mix > 0:
        assert {plain.share(i) for i in (0, 20)} == {mix}
    else:
        assert isinstance(plain, WindowSampler)


def test_the_mixture_never_touches_the_validation_windows(split, tok):
    """Validation windows come from their own sampler, whatever the mixture; the run's session builds them so."""
    before = validation_batches(split, T + 1, 3, 4)
    mixed(split, tok, 1.0).batch(0, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, validation_batches(split, T + 1, 3, 4), strict=True))


def test_the_mixture_stream_is_not_the_evaluations(split, tok, monkeypatch):
    """No training window's facts are drawn from the evaluation's probe stream: the mixture draws on
    ``train_mix`` alone, the stream tags differ, so no seed is shared, and the pass keys the mixture writes are
    not the ones the evaluation asks for."""
    import mcfn.data.mixture as mixture

    streams = []
    monkeypatch.setattr(
        mixture, "derive_seed", lambda seed, stream, i: streams.append(stream) or derive_seed(seed, stream, i)
    )
    mixed(split, tok, 1.0).batch(0, 4)
    assert streams and set(streams) == {"train_mix"}
    monkeypatch.undo()
    train_seeds = {derive_seed(1337, "train_mix", i) for i in range(10_000)}
    eval_seeds = {derive_seed(task, "eval_probes", i) for task in range(4) for i in range(10_000)}
    assert not train_seeds & eval_seeds
    sampler = mixed(split, tok, 1.0, tasks=("passkey",), seed=1)
    windows = WindowSampler(split, T + 1, 1).batch(0, 8)
    evaluated = make_probe("passkey", windows, tok, H, derive_seed(1, "eval_probes", 0))
    assert not torch.equal(sampler.batch(0, 8)[:, -H:], evaluated.window[:, -H:])


def test_unknown_or_unfitting_tasks_are_refused(split, tok):
    with pytest.raises(UserError, match="unknown data.mix_tasks entry 'needle'"):
        mixed(split, tok, 0.5, tasks=("needle",))
    with pytest.raises(UserError, match="data.mix_tasks cannot use passkey"):
        MixedSampler(WindowSampler(split, T + 1, 5), tok, 8, 0.5, ("passkey",), 5)


def test_repeat_ends_the_window_with_a_copy_of_its_own_earlier_text(split, tok):
    """The last 2·H tokens are a span found earlier, ending before the copy begins; nothing else changes."""
    import random

    windows = WindowSampler(split, T + 1, 2).batch(0, 6)
    for row in range(6):
        out = write_repeat(windows[row], H, random.Random(row))
        assert torch.equal(out[: -2 * H], windows[row, : -2 * H])
        copy = out[-2 * H :]
        sources = [a for a in range(T + 1 - 4 * H + 1) if torch.equal(windows[row, a : a + 2 * H], copy)]
        assert sources, "the copy is of earlier text"
    sampler = mixed(split, tok, 1.0, tasks=("repeat",))
    batch, natural = sampler.batch(3, 4), WindowSampler(split, T + 1, 5).batch(3, 4)
    assert torch.equal(batch[:, : -2 * H], natural[:, : -2 * H]) and not torch.equal(batch, natural)


def test_shuffled_repeat_is_the_windows_own_tokens_reordered_then_a_copy_of_an_earlier_span(split, tok):
    """Before the copy, the window's own tokens in another order (the same multiset as its first T + 1 - 2·H
    tokens' shuffle: counted against the whole window's); the last 2·H tokens repeat a span of that shuffled text;
    the same random stream gives the same window."""
    import random

    windows = WindowSampler(split, T + 1, 2).batch(0, 4)
    for row in range(4):
        out = write_shuffled_repeat(windows[row], H, random.Random(row))
        head, copy = out[: -2 * H], out[-2 * H :]
        assert not torch.equal(head, windows[row, : -2 * H]), "reordered"
        ids = int(windows.max()) + 1
        have, whole = torch.bincount(head, minlength=ids), torch.bincount(windows[row], minlength=ids)
        assert (have <= whole).all() and int(have.sum()) == T + 1 - 2 * H, "only the window's own tokens"
        assert any(torch.equal(out[a : a + 2 * H], copy) for a in range(T + 1 - 4 * H + 1)), "a copy of earlier text"
        assert torch.equal(out, write_shuffled_repeat(windows[row], H, random.Random(row)))
    sampler = mixed(split, tok, 1.0, tasks=("shuffled-repeat",))
    assert sampler.batch(3, 4).shape == (4, T + 1)


def test_each_batch_index_draws_its_own_facts_and_rows_whatever_came_before(split, tok):
    """Batch ``i`` is a function of ``(seed, i)`` alone: different indices rewrite different rows with different
    pass keys, and a batch is the same whether or not other batches were drawn before it. Fails with every batch
    seeded alike (the same rows and facts each time) or with one random stream carried from batch to batch."""
    import re

    def facts(batch: torch.Tensor) -> tuple[tuple[int, ...], tuple[str, ...]]:
        texts = [tok.decode(row.tolist()) for row in batch]
        rows = tuple(r for r, text in enumerate(texts) if "What is the pass key?" in text)
        keys = tuple(re.search(r"The pass key is (\d+)\.", texts[r]).group(1) for r in rows)
        return rows, keys

    fresh = mixed(split, tok, 0.5, tasks=("passkey",))
    drawn = [facts(fresh.batch(i, 8)) for i in range(12)]
    keys = [k for _, ks in drawn for k in ks]
    assert len({rows for rows, _ in drawn}) >= 6, "the mixed rows change with the batch index"
    assert len(keys) >= 24 and len(set(keys)) >= 0.9 * len(keys), "each batch writes its own facts"
    late = mixed(split, tok, 0.5, tasks=("passkey",))
    assert torch.equal(late.batch(9, 8), mixed(split, tok, 0.5, tasks=("passkey",)).batch(9, 8))
    for i in (3, 9, 4):  # out of order, after other batches: the same windows as drawn first
        assert facts(late.batch(i, 8)) == drawn[i]


def test_each_listed_task_gets_its_share_of_the_rewritten_rows(split, tok):
    """With ``passkey,kv-recall`` and ``mix`` 1, each task writes about half the rows, told apart by the question the
    row itself ends with (not by the sampler's own draw): a sampler that trained on one task alone fails here."""
    sampler = mixed(split, tok, 1.0)
    counts = {"What is the pass key?": 0, "Recall:": 0}
    rows = 0
    for index in range(30):
        for window in sampler.batch(index, 8):
            ending = tok.decode(window[-H:].tolist())
            rows += 1
            for question in counts:
                counts[question] += question in ending
    assert sum(counts.values()) == rows, "every row carries exactly one of the two questions"
    assert all(0.38 < n / rows < 0.62 for n in counts.values()), counts  # 240 rows: ±0.12 is beyond 3.7 SE
