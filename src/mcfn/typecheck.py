"""One decorator for runtime shape and type checks that never fights torch.compile.

Functions are annotated with jaxtyping shapes (``Float[Tensor, "b t d"]``). In eager code and tests the
annotations are enforced by beartype through jaxtyping; while dynamo traces (``is_compiling()``), the
wrapper calls the plain function, so checks cost nothing in compiled graphs and never break them.
Set ``MCFN_TYPECHECK=0`` to switch the eager checks off.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from beartype import beartype
from jaxtyping import jaxtyped

F = TypeVar("F", bound=Callable)

_ENABLED = os.environ.get("MCFN_TYPECHECK", "1") != "0"


@contextlib.contextmanager
def checks(enabled: bool) -> Iterator[None]:
    """Eager shape checks on or off inside the block (the benchmark measures what they cost)."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, enabled
    try:
        yield
    finally:
        _ENABLED = previous


def typechecked(fn: F) -> F:
    if torch.compiler.is_compiling():  # a closure decorated as a compiled region builds it: dynamo cannot trace it
        return fn
    checked = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling() or not _ENABLED:
            return fn(*args, **kwargs)
        return checked(*args, **kwargs)

    wrapper.unchecked = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def unchecked(fn: F) -> F:
    """The function under :func:`typechecked`'s wrapper (any other function as it is). What ``torch.compile`` should
    get: dynamo keeps its compiled graphs on the code object it is given, and every checked function shares the
    wrapper's, so they would share one recompile limit (8): the decode benchmark alone compiled six graphs on it
    (2026-11-27, H100), where the limit is meant per function."""
    return getattr(fn, "unchecked", fn)
