"""A refocus's refill that keeps what the cache holds wherever it now sits (issue 101, item 1): each kept entry's
keys rotated to its new slot, and only the rest run through the model, reading them."""

from __future__ import annotations

import json

import pytest
import torch
from builders import DIM, VOCAB, as_entries, decisive, make_system, smeared_model, spread_lens
from hypothesis import given
from hypothesis import strategies as st

from mcfn.core.focus import Refocus
from mcfn.core.model import follows_its_token, in_sequence
from mcfn.core.policy import LENS
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.reuse import reuse_cost
from mcfn.inference.contexts import MOVED, PREFIX, after_its_token, kept_slots, shared_prefix
from mcfn.inference.decode import Decoder, KVCache, extend

K = 4  # a gist of level l spans K**l tokens
OLD = ([0, 16, 17, 18, 20, 21, 25, 29, 30, 31, 32, 33, 34, 35], [16, 1, 1, 1, 1, 4, 4, 1, 1, 1, 1, 1, 1, 1])
# The next refocus: the first gist and the gist at 21 left out, the gist at 25 shown as its tokens, two new tokens.
NEW = ([16, 17, 18, 20, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37], [1, 1, 1, 1] + [1] * 13)


def context(starts: list[int], spans: list[int]) -> tuple[torch.Tensor, ...]:
    """Embeddings, positions and spans ``[1, n]`` of entries, each entry's embedding fixed by its start and span,
    and its (start, LOD) rows ``[n, 2]``."""
    emb = torch.stack([torch.randn(DIM, generator=torch.Generator().manual_seed(97 * a + b)) for a, b in
                       zip(starts, spans, strict=True)])[None]  # fmt: skip
    positions, span = as_entries(starts, spans)
    lod = torch.tensor([{1: 0, 4: 1, 16: 2}[s] for s in spans])
    return emb, positions, span, torch.stack([torch.tensor(starts), lod], -1)


def moved_cache(n_layer: int) -> tuple[Decoder, torch.Tensor, tuple[torch.Tensor, ...]]:
    """A decoder whose cache held OLD, moved to NEW's slots: the decoder, the source slots and NEW's inputs."""
    model = smeared_model(4, n_layer)
    emb, positions, span, cached = context(*OLD)
    decoder = Decoder(model, KVCache(model, 20, torch.device("cpu")))
    extend(model, decoder.cache, emb, positions, span)
    new = context(*NEW)
    source = kept_slots(cached, new[3], MOVED)
    decoder.move(source)
    return decoder, source, new


def test_one_layer_refilled_from_moved_entries_reads_what_one_forward_reads():
    """With one layer an entry's keys and values depend on itself, its place and its smear neighbour alone, so
    keeping the entries the new context still holds at their new slots and running the rest gives one forward's
    last hidden state over the new context. Fails with the kept keys left unrotated, rotated the wrong way, or
    the values left where they were."""
    decoder, source, (emb, positions, span, _) = moved_cache(1)
    slots = torch.arange(source.numel())
    assert ((source >= 0) & (source != slots)).sum() >= 8  # most kept entries moved
    with torch.no_grad():
        got = decoder.refill(emb, positions, span, torch.nonzero(source < 0).flatten())
        want = decoder.model.hidden(emb, positions, span)[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_moved_entries_hold_at_the_first_layer_what_their_new_slots_would_write():
    """Deeper, a kept entry's first layer is still exact at its new slot (keys, raw keys and values; the layers
    above read the context it was written in)."""
    decoder, source, (emb, positions, span, _) = moved_cache(2)
    fresh = KVCache(decoder.model, 20, torch.device("cpu"))
    extend(decoder.model, fresh, emb, positions, span)
    kept = torch.nonzero(source >= 0).flatten()
    for got, want in zip(decoder.cache.tensors[:3], fresh.tensors[:3], strict=True):
        torch.testing.assert_close(got[0][:, :, kept], want[0][:, :, kept], atol=1e-5, rtol=1e-5)


@st.composite
def two_contexts(draw) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, LOD) rows of a cached context and a new one, drawn from one pool of entries in text order."""
    pool, at = [], 0
    for _ in range(24):
        lod = draw(st.sampled_from([0, 0, 0, 1, 2]))
        pool.append((at, lod))
        at += K**lod + draw(st.sampled_from([0, 0, 1]))
    cached = sorted(draw(st.lists(st.sampled_from(pool), max_size=16, unique=True)))
    new = sorted(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=16, unique=True)))
    return torch.tensor(cached, dtype=torch.int64).view(-1, 2), torch.tensor(new, dtype=torch.int64).view(-1, 2)


@given(two_contexts())
def test_property_a_refill_keeps_only_entries_the_cache_holds_and_never_the_last(rows):
    """``moved`` keeps an entry exactly where the cache holds the same (start, LOD) with the same key-smear
    neighbourship (read from positions and spans, as the model reads it), never the last entry (its hidden state
    gives the next token); ``prefix`` keeps the shared prefix in place, short of the last entry."""
    cached, new = rows
    moved, prefix = kept_slots(cached, new, MOVED), kept_slots(cached, new, PREFIX)
    for rows_ in (cached, new):
        if rows_.size(0):
            span = (K ** rows_[:, 1]).float()[None]
            position = rows_[:, 0].float()[None] + (span - 1) / 2
            assert (
                after_its_token(rows_).tolist()
                == follows_its_token(position, span, in_sequence(position, span))[0].tolist()
            )
    adjacent_new, adjacent_old = after_its_token(new), after_its_token(cached) if cached.size(0) else None
    m = new.size(0)
    for j in range(m):
        held = [i for i in range(cached.size(0)) if cached[i].tolist() == new[j].tolist()]
        keepable = j < m - 1 and bool(held) and bool(adjacent_old[held[0]] == adjacent_new[j])
        assert int(moved[j]) == (held[0] if keepable else -1), (cached.tolist(), new.tolist(), j)
    keep = min(shared_prefix(cached, new), m - 1)
    assert prefix.tolist() == list(range(keep)) + [-1] * (m - keep)


def test_the_reuse_cost_is_nil_where_one_layer_makes_the_moved_entries_exact():
    """``mcfn.evaluation.reuse`` feeds both reuses the same windows through generation's loop: with one layer (the
    moved entries exact) their bits per byte agree, while ``moved`` keeps far more of the cache than ``prefix``."""
    system = spread_lens(decisive(make_system(64, 4, 2, 32, 8, N=2, seed=3, key_smear=True)), seed=2)
    windows = torch.randint(0, VOCAB, (3, 65), generator=torch.Generator().manual_seed(4))
    held = HeldOut([windows], torch.ones(VOCAB), docs=[torch.tensor([0, 0, 1])])
    cost = reuse_cost(system, LENS, Refocus(4, steps=4, warm_steps=1), held)
    assert cost.windows == 3 and cost.documents == 2
    assert abs(cost.cost) < 1e-5 and cost.bpb[MOVED] == pytest.approx(cost.bpb[PREFIX], abs=1e-5)
    assert cost.kept[MOVED] > cost.kept[PREFIX] + 0.1, cost.kept  # measured: 0.37 against 0.19
    assert cost.recomputed_per_refocus[MOVED] < cost.recomputed_per_refocus[PREFIX]


def test_the_reuse_cli_scores_both_reuses_on_a_trained_run(decoding_run, capsys, tmp_path):
    """``train.reuse`` on a two-layer run: the table, and a JSON whose cost is the two bits per byte's difference;
    a bad ``--windows`` exits 2."""
    from train.reuse import main as reuse_main

    run, _ = decoding_run
    out = tmp_path / "reuse.json"
    assert reuse_main(["--ckpt", str(run), "--windows", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| prefix |" in printed and "| moved |" in printed and "moved − prefix:" in printed
    record = json.loads(out.read_text())
    assert record["cost"] == pytest.approx(record["bpb"][MOVED] - record["bpb"][PREFIX], abs=1e-5)
    assert record["kept"][MOVED] >= record["kept"][PREFIX] and record["windows"] >= 1
    assert reuse_main(["--ckpt", str(run), "--windows", "0"]) == 2
