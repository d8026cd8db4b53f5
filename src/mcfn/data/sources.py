"""Document sources: where the text comes from, streamed in a deterministic order.

A source spec is one of

* ``stdlib`` — the Python standard library's ``.py`` files of the running interpreter (the embedded
  default: ~30 MB of long, structured documents, no download);
* ``text:DIR`` — text files under a directory, recursively: files with a text suffix (``.txt``, ``.md``,
  ``.py``, ``.rst``, ...) and files with no suffix at all (``LICENSE``, ``README``); a file that does not
  decode as UTF-8 is skipped, and the skips are counted on stderr;
* ``jsonl:PATH`` — a ``.jsonl`` file, or a directory of them, one JSON object with a ``text`` field per line;
* ``parquet:PATH`` — a ``.parquet`` file, or a directory of shards, with a ``text`` column (the layout of
  nanochat's FineWeb-Edu shards), read a record batch at a time;
* a bare path — the kind is guessed from the suffix or the directory's files.

Every document has a stable id (a path relative to the source root, plus a line or row number) that
decides its split: a hash of the id, not its position, so adding files does not reshuffle the split.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mcfn.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".tex", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".html")
KINDS = ("stdlib", "text", "jsonl", "parquet")
SNIFF_BYTES = 1 << 16  # how much of a text candidate must decode as UTF-8


@dataclass(frozen=True)
class Source:
    kind: str  # one of KINDS
    root: Path
    files: tuple[Path, ...]  # sorted: the document order

    def fingerprint(self) -> str:
        """Identifies the corpus for caching: kind, and each file's relative path, size and mtime."""
        h = hashlib.sha256(self.kind.encode())
        for f in self.files:
            st = f.stat()
            h.update(f"{f.relative_to(self.root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:16]


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def _files_with(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes))


def is_text(path: Path) -> bool:
    """Whether the file's first ``SNIFF_BYTES`` decode as UTF-8 without a NUL byte (a sequence cut at the end
    of the sample is fine)."""
    try:
        with path.open("rb") as f:
            sample = f.read(SNIFF_BYTES)
        codecs.getincrementaldecoder("utf-8")().decode(sample, final=False)
    except (OSError, UnicodeDecodeError):
        return False
    return b"\x00" not in sample


def _text_files(root: Path) -> tuple[list[Path], int]:
    """Text documents under ``root``: text suffixes and suffix-less names (hidden files aside), kept when they
    decode as text; returns them and how many candidates were skipped for not being text."""
    if root.is_file():
        candidates = [root]
    else:
        candidates = sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and (p.name.endswith(TEXT_SUFFIXES) or (not p.suffix and not p.name.startswith(".")))
        )
    files = [p for p in candidates if is_text(p)]
    return files, len(candidates) - len(files)


def _guess_kind(path: Path) -> str:
    if path.is_file():
        if path.name.endswith(".jsonl"):
            return "jsonl"
        if path.name.endswith(".parquet"):
            return "parquet"
        return "text"
    names = [p.name for p in path.rglob("*") if p.is_file()]
    if names and all(n.endswith(".parquet") for n in names):
        return "parquet"
    if names and all(n.endswith(".jsonl") for n in names):
        return "jsonl"
    return "text"


def open_source(spec: str) -> Source:
    """Resolve a source spec to its sorted file list; raises UserError when there is nothing to read."""
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return Source("stdlib", root, tuple(_stdlib_files(root)))
    kind, _, rest = spec.partition(":")
    if kind in KINDS and rest:
        path = Path(rest).expanduser()
    else:
        kind, path = "", Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"data source {spec!r}: {path} does not exist")
    kind = kind or _guess_kind(path)
    if kind == "text":
        files, skipped = _text_files(path)
        if skipped:
            print(f"[data] {skipped} file(s) under {path} skipped: not UTF-8 text", file=sys.stderr, flush=True)
        if not files:
            raise UserError(
                f"data source {spec!r}: no UTF-8 text files (suffix-less or {'/'.join(TEXT_SUFFIXES)}) under {path}"
            )
    else:
        suffixes = {"jsonl": (".jsonl",), "parquet": (".parquet",)}[kind]
        files = _files_with(path, suffixes)
        if not files:
            raise UserError(f"data source {spec!r}: no {'/'.join(suffixes)} files under {path}")
    root = path if path.is_dir() else path.parent
    return Source(kind, root, tuple(files))


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _jsonl_docs(path: Path, rel: str) -> Iterator[tuple[str, str]]:
    try:
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise UserError(f"{path}:{lineno}: expected an object with a string 'text' field")
                yield f"{rel}:{lineno}", obj["text"]
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None


def _parquet_docs(path: Path, rel: str) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise UserError(f"{path}: parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=["text"]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield f"{rel}:{row}", text
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def iter_documents(source: Source) -> Iterator[tuple[str, str]]:
    """Stream ``(doc_id, text)`` pairs in the source's deterministic order."""
    for path in source.files:
        rel = str(path.relative_to(source.root)) if path != source.root else path.name
        if source.kind in ("stdlib", "text"):
            yield rel, _read_text(path)
        elif source.kind == "jsonl":
            yield from _jsonl_docs(path, rel)
        else:
            yield from _parquet_docs(path, rel)


SPLITS = ("train", "val", "test")


def split_of(doc_id: str, val_fraction: float, test_fraction: float) -> str:
    """The split a document belongs to, by a hash of its id alone, so every document lies in exactly one: a hash
    below ``val_fraction`` is validation (the documents it always was), the next ``test_fraction`` is the test
    split, the rest trains."""
    digest = hashlib.sha256(doc_id.encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "val" if u < val_fraction else "test" if u < val_fraction + test_fraction else "train"
