"""Tokenizer, token cache and window sampling."""

import numpy as np
import pytest
import torch
from builders import make_documents
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.config import DataConfig
from mcfn.data.corpus import Split, cache_root, corpus_key, prepare_corpus
from mcfn.data.loader import Prefetcher, WindowSampler, evaluation_windows, validation_batches
from mcfn.data.sources import iter_documents, open_source, split_of
from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(make_documents(30), vocab_size=400)


def test_tokenizer_training_is_deterministic(tokenizer):
    again = Tokenizer.train(make_documents(30), vocab_size=400)
    text = make_documents(1, seed=9)[0]
    assert again.encode(text) == tokenizer.encode(text)
    assert again.vocab_size == tokenizer.vocab_size


@given(st.text(max_size=200))
def test_property_tokenizer_roundtrips_any_text_and_counts_its_bytes(text):
    tok = _SHARED_TOKENIZER
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))


_SHARED_TOKENIZER = Tokenizer.train(make_documents(10), vocab_size=300)


def test_special_tokens_have_no_bytes(tokenizer):
    tb = tokenizer.token_bytes(padded_vocab=448)
    assert tb[tokenizer.bos_id] == 0 and (tb[tokenizer.vocab_size :] == 0).all()
    assert (tb[: tokenizer.vocab_size] > 0).sum() == tokenizer.vocab_size - 1


def _cfg(source, **kw):
    kw = {"val_fraction": 0.2, "test_fraction": 0.2, **kw}
    return DataConfig(source=source, seq_len=32, vocab_size=320, min_doc_chars=100, **kw)


def test_corpus_is_tokenized_once_and_memory_mapped(text_dir, capsys):
    cfg = _cfg(f"text:{text_dir}")
    corpus = prepare_corpus(cfg)
    assert "preparing" in capsys.readouterr().err
    again = prepare_corpus(cfg)
    assert "preparing" not in capsys.readouterr().err  # served from the cache
    assert isinstance(again.train.tokens, np.memmap)
    splits = {"train": corpus.train, "val": corpus.val, "test": corpus.test}
    assert sum(split.n_docs for split in splits.values()) == 40 and all(s.n_docs > 0 for s in splits.values())
    # Every document is [BOS, its tokens...], in source order within its split, and in its split alone.
    docs = [(split_of(i, cfg.val_fraction, cfg.test_fraction), t) for i, t in iter_documents(open_source(cfg.source))]
    for name, split in splits.items():
        texts = [text for where, text in docs if where == name]
        assert len(texts) == split.n_docs
        for d in (0, split.n_docs - 1):
            start, end = split.doc_offsets[d : d + 2]
            assert split.tokens[start] == corpus.tokenizer.bos_id
            assert list(split.tokens[start + 1 : end]) == corpus.tokenizer.encode(texts[d])


def test_a_checkpoint_of_another_corpus_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """``prepare_corpus(cfg, trained_on=...)``, as a checkpoint is restored: a key that is not the one ``cfg``
    rebuilds is refused in one line naming the checkpoint, and no cache entry is built for it."""
    monkeypatch.setenv("MCFN_CACHE", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("y" * 400)
    with pytest.raises(UserError, match="checkpoint runs/x was trained on a different corpus") as refused:
        prepare_corpus(_cfg(f"text:{docs}"), trained_on=("0" * 20, "checkpoint runs/x"))
    assert "\n" not in str(refused.value) and not (tmp_path / "cache").exists()


def test_cache_key_follows_corpus_and_settings(text_dir, tmp_path):
    cfg = _cfg(f"text:{text_dir}")
    source = open_source(cfg.source)
    assert corpus_key(source, cfg) == corpus_key(source, cfg)
    assert corpus_key(source, cfg) != corpus_key(source, _cfg(cfg.source, val_fraction=0.3))
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "one.txt").write_text("x" * 200)
    assert corpus_key(open_source(str(copy)), cfg) != corpus_key(source, cfg)


def test_every_source_kind_prepares(jsonl_file, parquet_dir):
    for spec in (f"jsonl:{jsonl_file}", f"parquet:{parquet_dir}"):
        corpus = prepare_corpus(_cfg(spec))
        assert corpus.train.n_docs > 0 and corpus.val.n_docs > 0


def test_short_documents_only_is_a_user_error(tmp_path):
    (tmp_path / "a.txt").write_text("too short")
    with pytest.raises(UserError, match="no documents of at least 100 characters"):
        prepare_corpus(_cfg(str(tmp_path)))
    assert not any(cache_root().glob(".*-*"))  # no temporary build left behind


def _split(lengths, bos=0):
    from mcfn.data.corpus import Split

    tokens, offsets = [], [0]
    for i, n in enumerate(lengths):
        tokens += [bos] + [100 * (i + 1) + j for j in range(n - 1)]
        offsets.append(len(tokens))
    return Split(tokens=np.asarray(tokens, dtype=np.uint16), doc_offsets=np.asarray(offsets, dtype=np.int64))


@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(2, 12), st.integers(0, 50))
def test_property_windows_stay_inside_one_document_when_one_is_long_enough(lengths, window, index):
    split = _split(lengths)
    if len(split.tokens) < window:
        with pytest.raises(UserError, match="fewer than data.seq_len"):
            WindowSampler(split, window, seed=1)
        return
    sampler = WindowSampler(split, window, seed=1)
    batch = sampler.batch(index, 3)
    assert batch.shape == (3, window)
    assert torch.equal(batch, sampler.batch(index, 3))  # a pure function of (seed, index)
    if any(n >= window for n in lengths):
        assert sampler.in_document
        for row in batch.tolist():
            # No document boundary inside the window (a window may begin on its own document's BOS).
            assert 0 not in row[1:]
            docs = {t // 100 for t in row if t != 0}
            assert len(docs) == 1
    else:
        assert not sampler.in_document


def test_different_seeds_and_indices_give_different_batches():
    split = _split([200, 300])
    a = WindowSampler(split, 16, seed=1)
    assert not torch.equal(a.batch(0, 4), a.batch(1, 4))
    assert not torch.equal(a.batch(0, 4), WindowSampler(split, 16, seed=2).batch(0, 4))


def test_validation_windows_ignore_the_run_seed():
    split = _split([200, 300])
    torch.manual_seed(1)
    first = validation_batches(split, 16, 3, 2)
    torch.manual_seed(2)
    second = validation_batches(split, 16, 3, 2)
    assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))
    assert not torch.equal(first[0], first[1])


def test_prefetcher_hands_out_consecutive_batches():
    sampler = WindowSampler(_split([200, 300]), 16, seed=3)
    pf = Prefetcher(sampler, 4, start=5, device=torch.device("cpu"))
    try:
        for i in range(5, 9):
            assert torch.equal(pf.next(), sampler.batch(i, 4))
    finally:
        pf.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=30), st.integers(1, 80), st.integers(1, 5))
def test_property_evaluation_windows_spread_over_documents_without_overlap(lengths, wanted, batch):
    """The final evaluation's windows: each inside one document, at most two a document and never overlapping, as
    many distinct documents as the split allows, a second window only once every long enough document has one."""
    window = 16
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    split = Split(tokens=np.arange(offsets[-1], dtype=np.int64), doc_offsets=offsets)
    if offsets[-1] < window:
        return
    batches, docs = evaluation_windows(split, window, wanted, batch)
    rows, doc = torch.cat(batches), torch.cat(docs)
    assert all(b.size(0) <= batch for b in batches) and rows.size(0) == doc.size(0) <= wanted
    long = [d for d, n in enumerate(lengths) if n >= window]
    if not long:  # the concatenated stream: consecutive windows, none overlapping
        assert bool((rows[1:, 0] >= rows[:-1, 0] + window).all())
        return
    starts = rows[:, 0]
    assert bool((rows == starts[:, None] + torch.arange(window)).all())
    first, end = torch.from_numpy(offsets[doc.numpy()]), torch.from_numpy(offsets[doc.numpy() + 1])
    assert bool((starts >= first).all() and (starts + window <= end).all())
    counts = torch.bincount(doc, minlength=len(lengths))
    assert int(counts.max()) <= 2 and int((counts > 0).sum()) == min(wanted, len(long))
    for d in torch.nonzero(counts == 2).flatten().tolist():
        a, b = sorted(starts[doc == d].tolist())
        assert b >= a + window


def test_a_corpus_without_test_documents_loads_and_is_evaluated_on_validation(text_dir, capsys):
    """A test split too small to hold a document (or a run from before test splits) still prepares and loads; an
    evaluation asked for the test split reads validation instead and says so."""
    from mcfn.data.corpus import held_out

    corpus = prepare_corpus(_cfg(f"text:{text_dir}", test_fraction=1e-9))
    assert corpus.test.n_docs == 0 and prepare_corpus(_cfg(f"text:{text_dir}", test_fraction=1e-9)).test.n_docs == 0
    capsys.readouterr()
    name, split = held_out(corpus, "test")
    assert name == "val" and split is corpus.val and "evaluating on validation" in capsys.readouterr().err
    with pytest.raises(UserError, match="--split must be test or val"):
        held_out(corpus, "train")
