"""The key smear (I13): a raw token's keys mix in the keys of the token right before it in the text, and nothing
else does; it stays causal, and the KV cache's chunked and token-by-token forward carries it exactly."""

from __future__ import annotations

import pytest
import torch
from builders import DIM, VOCAB, as_entries, decisive, make_system, smeared_model
from compile_check import one_graph
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import ModelConfig
from mcfn.core.model import GPT, follows_its_token, in_sequence
from mcfn.inference.decode import Decoder, KVCache, extend
from mcfn.inference.generation import generate_mc


@st.composite
def entry_rows(draw) -> tuple[list[int], list[int]]:
    """Starts and spans of a working context's valid entries: raw tokens side by side, gists of 4 and 16 tokens,
    and gaps where text was left out, in increasing start order."""
    starts, spans, at = [], [], draw(st.integers(0, 3))
    for _ in range(draw(st.integers(2, 14))):
        span = draw(st.sampled_from([1, 1, 1, 4, 16]))
        starts.append(at)
        spans.append(span)
        at += span + draw(st.sampled_from([0, 0, 0, 1, 5]))  # mostly adjacent, sometimes a gap
    return starts, spans


@given(entry_rows(), st.data(), st.integers(0, 2**31 - 1))
def test_property_I13_the_key_smear_reaches_only_the_adjacent_raw_token_after(row, data, seed):
    """Changing entry j's raw keys changes the smeared keys at j, and at j + 1 exactly when both are raw tokens and
    j + 1 is the next token of the text (the rule written out by hand here); nowhere else."""
    starts, spans = row
    j = data.draw(st.integers(0, len(starts) - 1))
    attention = smeared_model(seed % 1000).blocks[0].attn
    positions, span = as_entries(starts, spans)
    preceding = in_sequence(positions, span)
    adjacent = follows_its_token(positions, span, preceding)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, len(starts), DIM // 2, generator=g)
    changed = keys.clone()
    changed[:, :, j] += 1.0 + torch.rand(DIM // 2, generator=g)
    with torch.no_grad():
        smeared_of = [attention.smear_keys(k, preceding.keys(0, k), adjacent) for k in (keys, changed)]
        moved = (smeared_of[0] - smeared_of[1]).abs().amax((0, 1, 3))
    smeared = j + 1 < len(starts) and spans[j] == 1 and spans[j + 1] == 1 and starts[j + 1] == starts[j] + 1
    want = [i == j or (i == j + 1 and smeared) for i in range(len(starts))]
    assert (moved > 1e-6).tolist() == want, (starts, spans, j)


@given(st.integers(2, 24), st.data(), st.integers(0, 2**31 - 1))
def test_property_I13_a_change_to_token_t_plus_1_leaves_every_output_up_to_t_unchanged(n, data, seed):
    t = data.draw(st.integers(0, n - 2))
    model = smeared_model(seed % 1000)
    tokens = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))
    changed = tokens.clone()
    changed[0, t + 1] = (changed[0, t + 1] + 1) % VOCAB
    with torch.no_grad():
        a, b = model.token_hidden(tokens), model.token_hidden(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1], b[:, t + 1])


def mixed_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embeddings, positions and spans of 14 entries: a gist, tokens after it, a gap, two gists, a token run."""
    starts = [0, 16, 17, 18, 20, 21, 25, 29, 30, 31, 32, 33, 34, 35]
    spans = [16, 1, 1, 1, 1, 4, 4, 1, 1, 1, 1, 1, 1, 1]
    positions, span = as_entries(starts, spans)
    return torch.randn(1, 14, DIM, generator=torch.Generator().manual_seed(5)), positions, span


@pytest.mark.parametrize("cuts", [(1, 2, 3, 9, 14), (5, 8, 14), (14,)])
def test_the_kv_cache_carries_the_key_smear_across_chunks_exactly(cuts):
    """Extending a cache chunk by chunk gives one forward's hidden states, with chunk boundaries between two
    adjacent tokens (the second smears the first's keys, which only the cache still holds), after a gist and at a
    gap."""
    model = smeared_model(1)
    emb, positions, span = mixed_row()
    with torch.no_grad():
        want = model.hidden(emb, positions, span)
    cache, got, lo = KVCache(model, 14, torch.device("cpu")), [], 0
    for hi in cuts:
        got.append(extend(model, cache, emb[:, lo:hi], positions[:, lo:hi], span[:, lo:hi]))
        lo = hi
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-5, rtol=1e-5)


def test_the_token_step_carries_the_key_smear_and_a_refill_smears_the_kept_entry():
    """Tokens decoded one at a time after a prefill give one forward's logits; cutting the cache back (what a warm
    refocus does) and extending from there smears the newest kept entry, not the last one written."""
    model = smeared_model(2)
    emb, positions, span = mixed_row()
    tokens = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(6))
    emb[:, 9:] = model.embed(tokens[None]).detach()  # entries 9-13: tokens 32-36, one after the other
    with torch.no_grad():
        want = model.hidden(emb, positions, span)
        want_logits = model.logits(want)[0]
    decoder = Decoder(model, KVCache(model, 14, torch.device("cpu")))
    extend(model, decoder.cache, emb[:, :9], positions[:, :9], span[:, :9])
    got = [decoder.token(tokens[i - 9 : i - 8], int(positions[0, i])) for i in range(9, 14)]
    torch.testing.assert_close(torch.stack(got), want_logits[9:], atol=1e-4, rtol=1e-4)
    # Keep entries 0-9: entry 10 (the token after token 9) must smear entry 9's keys again.
    refilled = decoder.refill(emb, positions, span, torch.arange(10, 14))
    torch.testing.assert_close(refilled, want[:, -1:], atol=1e-5, rtol=1e-5)


@pytest.mark.heavy(42)
def test_the_compiled_token_step_with_the_key_smear_is_one_graph_and_decodes_what_eager_does(fresh_dynamo):
    """The token step, the refill and the move read the raw keys of the slot before each entry from the cache: one
    graph each for every token and refocus (and the refocus's choice one cold, one warm), and the same greedy tokens
    as eager, whose refocuses keep moved entries."""
    system = decisive(make_system(64, 4, 2, 32, 8, N=2, seed=3, key_smear=True))
    prompt = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(2))
    eager, _ = generate_mc(system, prompt, 12, 4)
    with one_graph("inductor", functions=5) as compile_fn:
        first, _ = generate_mc(system, prompt, 5, 4, compile_fn=compile_fn)
        compile_fn.forbid_recompiles()
        compiled, _ = generate_mc(system, prompt, 12, 4, compile_fn=compile_fn)
    assert first.tolist() == eager[:5].tolist() and compiled.tolist() == eager.tolist()


def induction_mass(model: GPT, seed: int) -> float:
    """The first block's mean attention, over heads and the second half of a repeated random sequence, on the
    induction target: the position after the query token's earlier occurrence (uniform ≈ 1/96 here; 3/96 for
    smeared keys with W_k ≠ W_q, 0 with the smear on the token itself)."""
    torch.manual_seed(seed)
    half = torch.randperm(VOCAB)[:64]  # distinct tokens: each query token has exactly one earlier occurrence
    tokens = torch.cat([half, half])[None]
    weights = {}

    def attend(layer, q, k, v):
        scores = (q @ k.transpose(-1, -2)) * q.size(-1) ** -0.5
        scores = scores.masked_fill(torch.ones(128, 128, dtype=torch.bool).triu(1), float("-inf"))
        weights[layer] = scores.softmax(-1)
        return weights[layer] @ v

    positions = torch.arange(128.0)[None]
    with torch.no_grad():
        model.hidden(model.embed(tokens), positions, torch.ones_like(positions), attend=attend)
    query = torch.arange(65, 128)  # the repeat's tokens after its first: each one's target is query - 63
    return float(weights[0][0][:, query, query - 63].mean())


def test_smeared_keys_start_with_an_induction_prior_that_plain_keys_lack():
    """With ``model.key_smear`` the base model's heads start out attending from a repeated token to the token after
    its earlier occurrence (mimetic keys, the smear mostly on the previous token, gains at 2: the prior that made
    retrieval form early, LABLOG twenty-first session); plain heads start near uniform. Fails if the prior is
    dropped, or put on the token itself rather than the one after it."""
    cfg = dict(n_layer=2, n_head=2, n_embd=128, vocab_size=VOCAB)
    for seed in range(3):
        torch.manual_seed(seed)
        prior = induction_mass(GPT(ModelConfig(**cfg, key_smear=True)), seed)
        torch.manual_seed(seed)
        plain = induction_mass(GPT(ModelConfig(**cfg)), seed)
        assert prior > 20 / 96 and plain < 2 / 96, (seed, prior, plain)  # measured: 41-47 / 96 and 1 / 96
