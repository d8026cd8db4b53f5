import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcfn.data.sources import iter_documents, open_source, split_of
from mcfn.errors import UserError


def test_text_directory_in_sorted_order(text_dir):
    source = open_source(f"text:{text_dir}")
    assert source.kind == "text"
    ids = [doc_id for doc_id, _ in iter_documents(source)]
    assert ids == sorted(ids) and len(ids) == 40
    assert all(i.endswith(".txt") for i in ids)  # notes.bin is skipped


def test_kinds_are_guessed_from_bare_paths(text_dir, jsonl_file, parquet_dir):
    assert open_source(str(text_dir)).kind == "text"
    assert open_source(str(jsonl_file)).kind == "jsonl"
    assert open_source(str(parquet_dir)).kind == "parquet"


def test_jsonl_documents_carry_line_ids(jsonl_file):
    docs = list(iter_documents(open_source(f"jsonl:{jsonl_file}")))
    assert len(docs) == 30
    assert docs[0][0] == "docs.jsonl:1" and docs[0][1] == json.loads(jsonl_file.read_text().splitlines()[0])["text"]


def test_parquet_shards_stream_every_row(parquet_dir):
    docs = list(iter_documents(open_source(f"parquet:{parquet_dir}")))
    assert len(docs) == 30
    assert docs[0][0] == "shard_00000.parquet:0" and docs[-1][0] == "shard_00002.parquet:9"


def test_stdlib_is_the_embedded_default():
    source = open_source("stdlib")
    assert len(source.files) > 500
    assert all(f.suffix == ".py" for f in source.files)
    assert not any("site-packages" in f.parts for f in source.files)


def test_bad_sources_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        open_source(f"text:{tmp_path / 'missing'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .* files"):
        open_source(f"text:{tmp_path / 'empty'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(UserError, match="bad.jsonl:2: not valid JSON"):
        list(iter_documents(open_source(str(bad))))
    notext = tmp_path / "notext.jsonl"
    notext.write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match="string 'text' field"):
        list(iter_documents(open_source(str(notext))))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet")
    with pytest.raises(UserError, match="cannot read"):
        list(iter_documents(open_source(str(garbage))))


def test_parquet_without_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "x.parquet")
    with pytest.raises(UserError, match="no 'text' column"):
        list(iter_documents(open_source(str(tmp_path / "x.parquet"))))


@given(st.text(min_size=1, max_size=40), st.floats(0.01, 0.5), st.floats(0.0, 0.45))
def test_property_split_depends_only_on_document_id(doc_id, val, test):
    """One split per document, from its id alone; a test split is carved from what trained, so the validation
    documents are the ones they were before test splits existed."""
    split = split_of(doc_id, val, test)
    assert split in ("train", "val", "test") and split == split_of(doc_id, val, test)
    assert (split == "val") == (split_of(doc_id, val, 0.0) == "val")
    assert split_of(doc_id, val, 0.0) != "test"


def test_split_fractions_are_roughly_honoured():
    splits = [split_of(f"doc{i}", 0.1, 0.05) for i in range(5000)]
    assert 0.08 < splits.count("val") / 5000 < 0.12 and 0.035 < splits.count("test") / 5000 < 0.065


def test_text_dirs_take_suffix_less_text_and_skip_binary_files(tmp_path, capsys):
    """The two input holes: random bytes became a training document, and extension-less license texts were
    refused. Now text is taken by what it is, and what is not text is skipped and counted."""
    root = tmp_path / "licenses"
    root.mkdir()
    (root / "LICENSE").write_text("Permission is hereby granted, free of charge. " * 20)
    (root / "COPYING").write_text("This program is free software; you can redistribute it. " * 20)
    (root / "notes.txt").write_text("Plain notes. " * 50)
    (root / "random.txt").write_bytes(bytes(range(256)) * 40)  # a text suffix, but not text
    (root / "blob").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(200))  # no suffix, not text
    (root / ".hidden").write_text("editor state")
    source = open_source(f"text:{root}")
    assert [f.name for f in source.files] == ["COPYING", "LICENSE", "notes.txt"]
    assert "2 file(s) under" in capsys.readouterr().err
    assert all("\ufffd" not in text for _, text in iter_documents(source))
    (tmp_path / "binary-only").mkdir()
    (tmp_path / "binary-only" / "x.txt").write_bytes(b"\xff\xfe\x00\x01" * 10)
    with pytest.raises(UserError, match="no UTF-8 text files"):
        open_source(f"text:{tmp_path / 'binary-only'}")
