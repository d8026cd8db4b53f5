"""The evaluation under generation's protocol scores what generation computes: the same cuts, the same logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from builders import VOCAB, decisive, make_system, rewritten_after, spread_lens

from mcfn.core.focus import Refocus
from mcfn.core.match import match_votes
from mcfn.core.policy import RECENCY
from mcfn.evaluation.batch import EvalBatch, EvalSettings
from mcfn.evaluation.refocused import predict_chunked
from mcfn.inference.generation import teacher_forced_mc
from mcfn.inference.render import lod_string

T, K, L, W, H, R = 64, 4, 2, 32, 16, 4


def moving_system():
    """A system whose LensNet scores spread widely enough that its cuts move from one chunk to the next."""
    return spread_lens(decisive(make_system(T, K, L, W, H, N=2, seed=1)), seed=2)


def chunked(system, window, horizon, warm_steps=1, random_contexts=4):
    with torch.no_grad():
        settings = EvalSettings((W,), random_contexts, refocus=4, refocus_every=R, warm_steps=warm_steps)
        batch = EvalBatch.of(system, settings, window, horizon)
        return predict_chunked(batch, W, torch.Generator().manual_seed(0))


def shown_layout(cut: torch.Tensor, system, n: int) -> str:
    nodes = system.nodes
    return lod_string(nodes.start[cut], nodes.span[cut], nodes.lod[cut], torch.ones_like(nodes.lod[cut]).bool(), n, K)


def test_evaluation_scores_what_teacher_forced_generation_computes():
    """Per chunk of R tail tokens, ``lens``'s cut is the one generation refocuses to (cold first, warm after), and
    its tail NLL equals that of generation's logits fed the same tokens. Fails with the cut taken a chunk late or
    early, a cold start where generation is warm, or the tokens after the horizon left out."""
    system = moving_system()
    window = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(3))
    pred = chunked(system, window, torch.full((2,), T - H))
    lens = pred.slots["lens"].start
    layouts = set()
    for row in range(2):
        prompt, continuation = window[row, : T - H + 1], window[row, T - H + 1 :]
        logits, stats = teacher_forced_mc(system, prompt, continuation, Refocus(R, steps=4, warm_steps=1))
        nll = F.cross_entropy(logits, continuation, reduction="none")
        torch.testing.assert_close(pred.nll[row, lens], nll, atol=1e-4, rtol=1e-4)
        cuts = pred.cuts["lens"][row]
        assert len(cuts) == len(stats.layouts) == H // R
        for c, cut in enumerate(cuts):
            assert shown_layout(cut, system, T - H + 1 + c * R) == stats.layouts[c], f"chunk {c}"
        layouts |= set(stats.layouts)
    assert len(layouts) >= 3, "the test needs cuts that move from chunk to chunk"


def test_recency_keeps_the_newest_tokens_of_the_refocus_budget():
    """``recency`` predicts each chunk from the newest ``W - R`` tokens before its horizon and the chunk's own tokens,
    what ``train.generate --context recency`` reads."""
    system = moving_system()
    window = torch.randint(0, VOCAB, (1, T + 1), generator=torch.Generator().manual_seed(4))
    pred = chunked(system, window, torch.full((1,), T - H))
    from mcfn.inference.generation import decode_mc

    forced = window[0, T - H + 1 :]
    logits: list[torch.Tensor] = []

    def choose(step_logits, i):
        logits.append(step_logits)
        return forced[i : i + 1]

    decode_mc(system, window[0, : T - H + 1], H, Refocus(R), RECENCY, choose)
    nll = F.cross_entropy(torch.stack(logits), forced, reduction="none")
    torch.testing.assert_close(pred.nll[0, pred.slots["recency"].start], nll, atol=1e-4, rtol=1e-4)


def test_best_of_random_is_never_worse_than_any_random_cut_of_its_chunk():
    system = moving_system()
    window = torch.randint(0, VOCAB, (3, T + 1), generator=torch.Generator().manual_seed(5))
    pred = chunked(system, window, torch.full((3,), T - H))
    from mcfn.evaluation.evaluate import record
    from mcfn.evaluation.headroom import per_chunk

    scored = torch.ones(3, H)
    full = (torch.zeros(3, H), torch.zeros(3, H, dtype=torch.bool))
    out = record(pred, {"full": full}, scored, torch.zeros(3))
    chunk_nats = per_chunk(pred, scored > 0, scored)[0]  # [B, M, C]
    assert chunk_nats.size(-1) == H // R
    best = out.nats["best_of_random"][0]
    for m in range(chunk_nats.size(1)):  # it beats every random cut, chunk by chunk and so in sum
        assert (best <= chunk_nats[:, m].sum(-1).double() + 1e-9).all()
    assert (best <= chunk_nats.min(1).values.sum(-1).double() + 1e-6).all()
    assert (best < chunk_nats.sum(-1).min(1).values.double() - 1e-6).any(), "per chunk, not per window"


@pytest.mark.parametrize("ids", [VOCAB, 4])
def test_I11_no_chunk_cut_reads_past_its_horizon(ids):
    """Rewriting every token after chunk c's horizon changes none of the cuts of chunks 0..c, for every focus. Over
    4 token ids trigrams repeat everywhere, so ``match`` votes at every horizon and its cuts move from chunk to chunk:
    a ``match_scorer`` that reads one token past the horizon fails here."""
    system = moving_system()
    window = torch.randint(0, ids, (2, T + 1), generator=torch.Generator().manual_seed(6))
    horizon = torch.full((2,), T - H)
    base = chunked(system, window, horizon)
    for c in range(H // R):
        rewritten = rewritten_after(window, horizon + c * R, seed=7 + c)
        other = chunked(system, rewritten, horizon)
        for name, rows in base.cuts.items():
            for row in range(2):
                for k in range(c + 1):
                    assert torch.equal(rows[row][k], other.cuts[name][row][k]), (name, row, c, k)
    if ids == 4:  # the case bites only where match acts: it votes at every chunk's horizon
        for c in range(H // R):
            assert (match_votes(window[:, :T], horizon + c * R, K, R) > 0).any(-1).all(), c


def test_lens_rank_corr_compares_each_chunks_preferences_with_its_own_gaps(monkeypatch):
    """A LensNet whose preference between two random cuts of a chunk is exactly their measured gap on that chunk
    ranks every pair right: ``lens_rank_corr`` is 1. Fails when a chunk's preferences meet another chunk's gaps."""
    from mcfn.core.preferences import pair_slots
    from mcfn.evaluation import refocused
    from mcfn.evaluation.evaluate import record
    from mcfn.evaluation.stats import spearman

    real = refocused.predict_chunk

    def exact(*args, **kwargs):
        part = real(*args, **kwargs)
        nats = part.nll[:, part.slots["random"]].sum(-1)  # [g, M]: each random cut's nats on this chunk
        i, j = pair_slots(nats.size(1), nats.size(0), nats.device)
        return dataclasses.replace(part, preference=nats.gather(1, j) - nats.gather(1, i))  # > 0: i better

    monkeypatch.setattr(refocused, "predict_chunk", exact)
    window = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(9))
    pred = chunked(moving_system(), window, torch.full((2,), T - H))
    full = (torch.zeros(2, H), torch.zeros(2, H, dtype=torch.bool))
    out = record(pred, {"full": full}, torch.ones(2, H), torch.zeros(2))
    predicted, measured = torch.cat(out.predicted), torch.cat(out.measured)
    assert predicted.numel() == 2 * (H // R) * 6  # every pair of 4 random cuts, in every chunk of both rows
    assert spearman(predicted, measured) > 0.99


def test_probe_chunks_start_at_the_probes_own_horizon():
    """A probe's chunks start at its own horizon: the columns before it are no chunk's, and chunk 0 is cold there."""
    system = moving_system()
    window = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(8))
    horizon = torch.tensor([T - H + 3, T - H + 9])
    pred = chunked(system, window, horizon)
    assert (pred.chunk[0, :3] == -1).all() and (pred.chunk[0, 3 : 3 + R] == 0).all()
    assert (pred.chunk[1, :9] == -1).all() and int(pred.chunk[1].max()) == (H - 9 - 1) // R
    prompt, continuation = window[1, : T - H + 10], window[1, T - H + 10 :]
    logits, _ = teacher_forced_mc(system, prompt, continuation, Refocus(R, steps=4, warm_steps=1))
    nll = F.cross_entropy(logits, continuation, reduction="none")
    torch.testing.assert_close(pred.nll[1, pred.slots["lens"].start, 9:], nll, atol=1e-4, rtol=1e-4)
