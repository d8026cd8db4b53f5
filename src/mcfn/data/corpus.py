"""The pre-tokenized corpus: built once per (corpus, settings), cached on disk, memory-mapped after.

Layout of a cache entry ``<cache>/<key>/``::

    tokenizer.json            the trained BPE
    train.bin, val.bin, test.bin   every kept document as [BOS, tokens...], concatenated (uint16 or uint32)
    train_docs.npy, ...       document start offsets into each .bin file, plus the end (int64)
    meta.json                 written last: an entry without it is incomplete and rebuilt

The entry is built in a temporary directory and renamed into place, so a crash never leaves a
half-written cache behind and concurrent builders cannot corrupt each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mcfn.config import DataConfig
from mcfn.data.sources import SPLITS, Source, iter_documents, open_source, split_of
from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError

FORMAT_VERSION = 1
ENCODE_CHUNK_DOCS = 256


@dataclass(frozen=True)
class Split:
    tokens: np.ndarray  # [N] memory-mapped token ids
    doc_offsets: np.ndarray  # [n_docs + 1] start of each document, then N

    @property
    def n_docs(self) -> int:
        return len(self.doc_offsets) - 1


EMPTY = Split(tokens=np.zeros(0, dtype=np.uint16), doc_offsets=np.zeros(1, dtype=np.int64))


@dataclass(frozen=True)
class Corpus:
    key: str
    tokenizer: Tokenizer
    train: Split
    val: Split  # in-training evaluation and every design choice
    test: Split  # the final evaluation alone (empty for a run configured before test splits existed)


# Characters of the training split the BPE is trained on: a sample that settles a 32k vocabulary's merges, read in
# seconds (the embedded corpus is shorter than this, so it trains on all of it).
TOKENIZER_TRAIN_CHARS = 20_000_000


def cache_root() -> Path:
    """Where tokenizers and token caches live: ``$MCFN_CACHE``, or ``~/.cache/mcfn``."""
    return Path(os.environ.get("MCFN_CACHE") or Path.home() / ".cache" / "mcfn").expanduser()


def corpus_key(source: Source, cfg: DataConfig) -> str:
    settings = {
        "format": FORMAT_VERSION,
        "corpus": source.fingerprint(),
        "vocab_size": cfg.vocab_size,
        "min_doc_chars": cfg.min_doc_chars,
        "val_fraction": cfg.val_fraction,
        # only where there is a test split, so that a cache built before test splits existed is still found
        **({"test_fraction": cfg.test_fraction} if cfg.test_fraction else {}),
        "tokenizer_train_chars": TOKENIZER_TRAIN_CHARS,  # in the key since it was a knob: older caches still match
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]


def held_out(corpus: Corpus, wanted: str) -> tuple[str, Split]:
    """The split an evaluation reads: ``wanted`` (``test`` or ``val``), or validation where the test split has no
    document (a corpus too small for one, or a run configured before test splits existed), said on stderr."""
    if wanted not in ("test", "val"):
        raise UserError(f"--split must be test or val, got {wanted!r}")
    if wanted == "test" and corpus.test.n_docs == 0:
        _log("the test split has no document (data.test_fraction, or a small corpus): evaluating on validation")
        return "val", corpus.val
    return wanted, corpus.test if wanted == "test" else corpus.val


def _log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def _kept_documents(source: Source, cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """``(split, text)`` for every document long enough to keep."""
    for doc_id, text in iter_documents(source):
        if len(text) >= cfg.min_doc_chars:
            yield split_of(doc_id, cfg.val_fraction, cfg.test_fraction), text


def _training_text(source: Source, cfg: DataConfig) -> Iterator[str]:
    budget = TOKENIZER_TRAIN_CHARS
    for split, text in _kept_documents(source, cfg):
        if split != "train":
            continue
        yield text[:budget]
        budget -= len(text)
        if budget <= 0:
            return


def _encode_splits(source: Source, cfg: DataConfig, tok: Tokenizer, out: Path) -> dict[str, int]:
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    files = {split: (out / f"{split}.bin").open("wb") for split in SPLITS}
    offsets: dict[str, list[int]] = {split: [0] for split in SPLITS}
    chars = dict.fromkeys(SPLITS, 0)

    def flush(chunk: list[tuple[str, str]]) -> None:
        for (split, text), ids in zip(chunk, tok.encode_batch([t for _, t in chunk]), strict=True):
            files[split].write(np.asarray([tok.bos_id, *ids], dtype=dtype).tobytes())
            offsets[split].append(offsets[split][-1] + 1 + len(ids))
            chars[split] += len(text)

    chunk: list[tuple[str, str]] = []
    for item in _kept_documents(source, cfg):
        chunk.append(item)
        if len(chunk) == ENCODE_CHUNK_DOCS:
            flush(chunk)
            chunk = []
    flush(chunk)
    for split, f in files.items():
        f.close()
        np.save(out / f"{split}_docs.npy", np.asarray(offsets[split], dtype=np.int64))
    return {
        "dtype": np.dtype(dtype).name,
        **{f"{s}_docs": len(offsets[s]) - 1 for s in offsets},
        **{f"{s}_tokens": offsets[s][-1] for s in offsets},
        **{f"{s}_chars": chars[s] for s in chars},
    }


def _count_documents(source: Source, cfg: DataConfig) -> dict[str, int]:
    counts = dict.fromkeys(SPLITS, 0)
    for split, _ in _kept_documents(source, cfg):
        counts[split] += 1
    return counts


def _build(source: Source, cfg: DataConfig, spec: str, final: Path) -> None:
    counts = _count_documents(source, cfg)
    n_train, n_val, n_test = (counts[split] for split in SPLITS)
    if n_train + n_val + n_test == 0:
        raise UserError(
            f"data source {spec!r}: no documents of at least {cfg.min_doc_chars} characters "
            f"(data.min_doc_chars) in {len(source.files)} file(s)"
        )
    if n_train == 0 or n_val == 0:
        raise UserError(
            f"data source {spec!r}: {n_train} training and {n_val} validation documents; both "
            f"splits need at least one (adjust data.val_fraction or add documents)"
        )
    t0 = time.perf_counter()
    _log(
        f"preparing {spec}: {n_train} train / {n_val} val / {n_test} test documents (one-time, cached in "
        f"{final.parent})"
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        tok = Tokenizer.train(_training_text(source, cfg), cfg.vocab_size)
        tok.save(tmp / "tokenizer.json")
        _log(f"trained BPE tokenizer: {tok.vocab_size} tokens in {time.perf_counter() - t0:.1f}s")
        stats = _encode_splits(source, cfg, tok, tmp)
        meta = {"format": FORMAT_VERSION, "source": spec, "vocab_size": tok.vocab_size, **stats}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same entry first; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
        _log(
            f"tokenized {stats['train_tokens']:,} train / {stats['val_tokens']:,} val / {stats['test_tokens']:,} "
            f"test tokens "
            f"in {time.perf_counter() - t0:.1f}s"
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_split(entry: Path, name: str, dtype: str) -> Split:
    if name == "test" and not (entry / "test_docs.npy").is_file():  # built before test splits, with none
        return EMPTY
    offsets = np.load(entry / f"{name}_docs.npy")
    if offsets[-1] == 0:  # a split without documents: an empty file, which cannot be memory-mapped
        return EMPTY
    tokens = np.memmap(entry / f"{name}.bin", dtype=dtype, mode="r", shape=(int(offsets[-1]),))
    return Split(tokens=tokens, doc_offsets=offsets)


def prepare_corpus(cfg: DataConfig, trained_on: tuple[str, str] | None = None) -> Corpus:
    """Open the cached corpus for ``cfg``, building it first if needed. ``trained_on``: the corpus key a checkpoint
    was trained on and how to name it, refused in one line (before anything is built) where ``cfg`` rebuilds
    another corpus or tokenizer on this machine."""
    source = open_source(cfg.source)
    key = corpus_key(source, cfg)
    if trained_on is not None and trained_on[0] != key:
        raise UserError(
            f"{trained_on[1]} was trained on a different corpus or tokenizer than the one its config rebuilds"
        )
    entry = cache_root() / key
    if not (entry / "meta.json").is_file():
        _build(source, cfg, cfg.source, entry)
    try:
        meta = json.loads((entry / "meta.json").read_text())
        return Corpus(
            key=key,
            tokenizer=Tokenizer.load(entry / "tokenizer.json"),
            train=_load_split(entry, "train", meta["dtype"]),
            val=_load_split(entry, "val", meta["dtype"]),
            test=_load_split(entry, "test", meta["dtype"]),
        )
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"token cache {entry} is damaged ({e}); delete it to rebuild") from None


def encode_source(spec: str, tokenizer: Tokenizer, min_doc_chars: int) -> Split:
    """Every document of a data source, tokenized in memory with an existing tokenizer (for evaluation)."""
    source = open_source(spec)
    offsets, parts = [0], []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_batch(batch):
            parts.append(np.asarray([tokenizer.bos_id, *ids], dtype=np.int64))
            offsets.append(offsets[-1] + len(parts[-1]))
        batch.clear()

    for _, text in iter_documents(source):
        if len(text) >= min_doc_chars:
            batch.append(text)
        if len(batch) == ENCODE_CHUNK_DOCS:
            flush()
    flush()
    if not parts:
        raise UserError(f"data source {spec!r}: no documents of at least {min_doc_chars} characters")
    return Split(tokens=np.concatenate(parts), doc_offsets=np.asarray(offsets, dtype=np.int64))
