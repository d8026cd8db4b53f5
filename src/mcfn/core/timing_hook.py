"""Named stages of the training step, and the one hook that lets the benchmark time them.

A stage is a plain function decorated with ``@stage("tree")`` and called as itself: ``tree =
tree_stage(system, window)``. While a recorder is installed (``with recording(recorder): step()``, the
benchmark's phase table), each stage call goes to ``recorder(name, fn, *args)`` instead, which must return
what ``fn(*args)`` does. By default, and always under ``torch.compile``, the decorator is a plain call, so
the compiled step is the same graph with or without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

Recorder = Callable[..., Any]  # (name, fn, *args) -> fn(*args)
_recorder: Recorder | None = None


def stage(name: str) -> Callable[[Callable], Callable]:
    """Mark ``fn`` as the step's stage ``name`` (the benchmark reports it as ``{name}_ms``)."""

    def mark(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            if _recorder is None or torch.compiler.is_compiling():
                return fn(*args)
            return _recorder(name, fn, *args)

        return call

    return mark


@contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Route every stage call through ``recorder`` inside the block (eager code only; not re-entrant)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a stage recorder is already installed")
    _recorder = recorder
    try:
        yield
    finally:
        _recorder = None
