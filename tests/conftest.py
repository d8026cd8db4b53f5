"""Shared fixtures: a private token cache, small generated corpora of every kind, a tiny profile and run. What they
build from lives in ``builders.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from builders import make_documents, tiny_sections, write_profile
from hypothesis import settings

# ci: what every test run uses (pytest -k property stays under 3 minutes); nightly: a deeper search, for a
# run that has the time (MCFN_HYPOTHESIS=nightly pytest -k property).
settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.register_profile("nightly", deadline=None, max_examples=400)
settings.load_profile(os.environ.get("MCFN_HYPOTHESIS", "ci"))


# Under pytest-xdist each worker is one process of the suite's: one thread each (its subprocesses too), and
# inductor's C++ compiled in the worker itself rather than in a pool of its own, so two workers on two cores do not
# fight over them.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# Inductor's own cache is keyed by the graph, not by the ATen kernels in force: a kernel that a suite run under
# ATEN_CPU_CAPABILITY=avx2 compiled and cached corrupted the heap when the next run at the machine's own AVX-512
# loaded it (LABLOG, twentieth session). Each capability compiles into a cache of its own.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    import torch

    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{tempfile.gettempdir()}/torchinductor_{getpass.getuser()}_{capability}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heavy tests first, the longest first (``@pytest.mark.heavy(seconds)``: its time on 2 cores with an empty
    inductor cache), the rest in file order: the workers then take the long ones early and finish together."""

    def seconds(item: pytest.Item) -> float:
        mark = item.get_closest_marker("heavy")
        return mark.args[0] if mark else 0.0

    items.sort(key=lambda item: -seconds(item))


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo cache before and after a compile test, and the default stance restored."""
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Every test session builds its own token caches, as CI does on a fresh machine."""
    os.environ["MCFN_CACHE"] = str(tmp_path_factory.mktemp("mcfn-cache"))


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text-corpus")
    for i, doc in enumerate(make_documents(40)):
        sub = root / ("a" if i % 2 else "b")
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_text(doc)
    (root / "notes.bin").write_bytes(b"\x00\x01 not text")  # ignored: not a text suffix
    return root


@pytest.fixture(scope="session")
def jsonl_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("jsonl-corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(make_documents(30, 1))))
    return path


@pytest.fixture(scope="session")
def parquet_dir(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("parquet-corpus")
    docs = make_documents(30, 2)
    for shard in range(3):
        pq.write_table(pa.table({"text": docs[shard::3]}), root / f"shard_{shard:05d}.parquet", row_group_size=4)
    return root


@pytest.fixture
def profile(tmp_path, text_dir) -> Path:
    return write_profile(tmp_path / "tiny.toml", tiny_sections(f"text:{text_dir}"))


@pytest.fixture(scope="session")
def decoding_run(tmp_path_factory, text_dir) -> tuple[Path, Path]:
    """A tiny MegaContext run (2 steps, W = 24, room to refocus every 4 tokens) and a prompt file to continue.
    Its own vocabulary size gives it its own token cache: tests that expect to tokenize the corpus first still do."""
    from train.run import main as run_main

    root = tmp_path_factory.mktemp("decoding")
    sections = tiny_sections(
        f"text:{text_dir}", data={"vocab_size": 300}, train={"final_eval_batches": 0}, mc={"budget": 24}
    )
    profile = write_profile(root / "p.toml", sections)
    assert run_main(["--profile", str(profile), "--out", str(root / "run"), "--steps", "2"]) == 0
    prompt = root / "prompt.txt"
    prompt.write_text("a long story about the sea and the old town " * 30)
    return root / "run", prompt
