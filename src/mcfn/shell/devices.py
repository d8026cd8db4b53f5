"""The device a run uses, its mixed-precision context, and sizes rounded for the hardware."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch

from mcfn.errors import UserError


def resolve_device(name: str) -> torch.device:
    """``auto`` is the GPU when torch sees one, else the CPU; a named CUDA device must exist."""
    if name not in ("auto", "cpu") and not name.startswith("cuda"):
        raise UserError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}, but torch sees no CUDA device")
    return torch.device(name)


def autocast_for(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast on CUDA; nothing elsewhere (the CPU has no fast bf16 units here)."""
    if device.type == "cuda":
        return partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def padded_vocab(n: int, multiple: int = 64) -> int:
    """The embedding's row count: the tokenizer's vocabulary rounded up to a multiple of 64 for fast matmuls."""
    return -(-n // multiple) * multiple
