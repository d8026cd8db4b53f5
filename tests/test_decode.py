"""The KV cache of decoding: extending it, the token step and a refocus's compiled refill against one forward over
the whole text."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, decisive, make_system
from compile_check import one_graph

from mcfn.inference.decode import REFILL_CHUNK, Decoder, KVCache, extend

T, K, L, W, H = 64, 4, 2, 32, 8


def decisive_system():
    return decisive(make_system(T, K, L, W, H, N=2, seed=3))


def test_kv_cache_extend_matches_full_forward():
    system = decisive_system()
    base = system.base
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    emb = base.embed(tokens)
    pos = torch.arange(40, dtype=torch.float32)[None] * 3.0  # any positions, gists' spans too
    span = torch.randint(1, 5, (1, 40)).float()
    want = base.hidden(emb, pos, span)
    cache = KVCache(base, 40, torch.device("cpu"))
    got = torch.cat(
        [extend(base, cache, emb[:, a:b], pos[:, a:b], span[:, a:b]) for a, b in ((0, 25), (25, 26), (26, 40))], 1
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_token_step_matches_the_full_forward():
    """Tokens decoded one by one into a cache larger than the text (unwritten slots never read) give the logits of
    one forward over the whole text; a full cache refuses another token."""
    system = decisive_system()
    base = system.base
    tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    emb, pos = base.embed(tokens), torch.arange(20, dtype=torch.float32)[None]
    with torch.no_grad():
        want = base.logits(base.hidden(emb, pos, torch.ones_like(pos)))
    decoder = Decoder(base, KVCache(base, 20, torch.device("cpu")))
    extend(base, decoder.cache, emb[:, :7], pos[:, :7], torch.ones_like(pos[:, :7]))
    got = torch.stack([decoder.token(tokens[0, i : i + 1], i) for i in range(7, 20)])
    torch.testing.assert_close(got, want[0, 7:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="holds 20"):
        decoder.token(tokens[0, :1], 20)


@pytest.mark.parametrize(("kept", "n"), [(0, REFILL_CHUNK + 7), (5, REFILL_CHUNK + 12), (70, 2 * REFILL_CHUNK + 7),
                                         (3, 30)])  # fmt: skip
@pytest.mark.heavy(12)
def test_the_compiled_refill_in_chunks_writes_what_eager_extending_writes(fresh_dynamo, kept, n):
    """A refocus's refill compiled in fixed chunks of REFILL_CHUNK entries, after ``kept`` cached entries, in a
    cache of exactly the context's length or of one chunk where the context is shorter (the last chunk padded with
    its last entry again, so nothing is written past the context): the same last hidden state and the same cache
    slots as extending eagerly, and stale slots past the kept prefix (a longer earlier context) never read."""
    base = decisive_system().base
    emb = torch.randn(1, n, base.cfg.n_embd, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n, dtype=torch.float32)[None] * 2.0
    span = torch.randint(1, 3, (1, n)).float()
    capacity = max(n, REFILL_CHUNK)
    eager = KVCache(base, capacity, torch.device("cpu"))
    want = extend(base, eager, emb, pos, span)
    with one_graph("inductor") as compile_fn:
        decoder = Decoder(base, KVCache(base, capacity, torch.device("cpu")), compile_fn)
        decoder.cache.tensors.k.normal_()  # stale slots: a refill must never read past what it wrote
        decoder.cache.tensors.v.normal_()
        extend(base, decoder.cache, emb[:, :kept], pos[:, :kept], span[:, :kept])
        got = decoder.refill(emb, pos, span, torch.arange(kept, n))
    torch.testing.assert_close(got, want[:, -1:], atol=1e-4, rtol=1e-4)
    for got_slots, want_slots in zip(decoder.cache.tensors[:2], eager.tensors[:2], strict=True):  # keys, values
        torch.testing.assert_close(got_slots[:, :, :, :n], want_slots[:, :, :, :n])
    assert decoder.cache.length == n


def test_a_refill_chunk_must_fit_its_cache_and_a_refill_runs_the_last_entry():
    base = decisive_system().base
    with pytest.raises(ValueError, match="does not fit a cache of 8"):
        Decoder(base, KVCache(base, 8, torch.device("cpu")), refill_chunk=9)
    decoder = Decoder(base, KVCache(base, 8, torch.device("cpu")), refill_chunk=8)
    emb, ones = torch.zeros(1, 4, base.cfg.n_embd), torch.ones(1, 4)
    for slots in ([], [0, 2]):  # nothing to run; not the last entry
        with pytest.raises(ValueError, match="runs the context's last entry 3 at least"):
            decoder.refill(emb, ones, ones, torch.tensor(slots, dtype=torch.int64))
