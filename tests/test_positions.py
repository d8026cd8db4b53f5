"""The position rule (:mod:`mcfn.core.positions`): every entry the base model reads is rotated at its place in its
sequence, so no working context reads a distance longer than itself however long the history behind it, and
training, the evaluation and generation rotate the same context alike."""

from __future__ import annotations

from unittest import mock

import torch
from builders import VOCAB, decisive, make_system
from hypothesis import given, settings
from hypothesis import strategies as st

import mcfn.core.model as model_module
from mcfn.core.policy import MATCH
from mcfn.core.positions import laid_positions
from mcfn.inference.decode import KVCache, extend
from mcfn.inference.generation import generate_mc

T, K, L, W, H = 64, 4, 2, 32, 8
REFOCUS = 4


def smeared_system():
    return decisive(make_system(T, K, L, W, H, N=2, seed=3, key_smear=True))


def test_laid_positions_number_the_entries_from_the_first():
    assert laid_positions(0, 4, torch.device("cpu")).tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert laid_positions(torch.tensor(7), 2, torch.device("cpu")).tolist() == [[7.0, 8.0]]


def rotated_positions(run) -> list[float]:
    """The largest rotary position of every base-model read during ``run()`` (the GPT's ``rotary_tables`` spied on)."""
    seen: list[float] = []
    real = model_module.rotary_tables

    def spy(positions, spans, head_dim, base):
        seen.append(float(positions.max()))
        return real(positions, spans, head_dim, base)

    with mock.patch.object(model_module, "rotary_tables", spy):
        run()
    return seen


@settings(max_examples=12, deadline=None)
@given(history=st.integers(min_value=1, max_value=40 * T), seed=st.integers(0, 2**16))
def test_property_generation_reads_every_entry_within_its_working_context(history, seed):
    """I14: whatever the history's length (up to 40 training windows), every entry the base model reads while
    generating lies at a position below ``W``: the context (within ``W - R``) and the tokens decoded after it."""
    system = smeared_system()
    prompt = torch.randint(0, VOCAB, (history,), generator=torch.Generator().manual_seed(seed))
    seen = rotated_positions(lambda: generate_mc(system, prompt, 2 * REFOCUS + 1, REFOCUS, policy=MATCH))
    assert seen and max(seen) < W


@settings(max_examples=20, deadline=None)
@given(gap=st.integers(min_value=1, max_value=100_000), cut=st.integers(min_value=2, max_value=20))
def test_property_a_gap_in_the_history_changes_no_reading(gap, cut):
    """I14: a working context whose entries before ``cut`` lie ``gap`` tokens farther back (a longer history between
    them and the rest) reads exactly as before: positions come from the entries' order, not their distance. The gap
    falls after a gist, where the key smear (I13) already reads no text adjacency."""
    base = smeared_system().base
    n = 24
    emb = base.embed(torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(gap)))
    span = torch.ones(1, n)
    span[0, cut - 1] = 16.0  # a gist just before the gap
    position = torch.cumsum(span, 1) - (span + 1) / 2  # centres of consecutive spans
    farther = torch.where(torch.arange(n) < cut, position - gap, position)
    with torch.no_grad():
        torch.testing.assert_close(base.hidden(emb, farther, span), base.hidden(emb, position, span))


def test_a_cache_read_in_chunks_rotates_as_one_forward():
    """Training and the evaluation read a context in one forward from its first entry; generation's KV cache reads
    it in chunks after cached slots. The same hidden states, because the chunks continue the numbering (a chunk
    rotated from 0 again would not)."""
    base = smeared_system().base
    n = 30
    emb = base.embed(torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(1)))
    span = torch.tensor([[16.0] * 4 + [4.0] * 6 + [1.0] * 20])
    position = torch.cumsum(span, 1) - (span + 1) / 2 + 5000.0  # far into a long history
    with torch.no_grad():
        want = base.hidden(emb, position, span)
        cache = KVCache(base, n, torch.device("cpu"))
        got = torch.cat(
            [extend(base, cache, emb[:, a:b], position[:, a:b], span[:, a:b]) for a, b in ((0, 11), (11, n))], 1
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
