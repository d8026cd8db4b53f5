"""ASCII pictures of working contexts: one character per block of ``K`` tokens."""

from __future__ import annotations

from torch import Tensor

UNCOVERED = "·"


def lod_string(start: Tensor, span: Tensor, lod: Tensor, valid: Tensor, n_tokens: int, block: int) -> str:
    """For the blocks of ``[0, n_tokens)``: ``0`` where shown as tokens, ``k`` where inside a LODk gist, and
    ``·`` where the context does not cover it. Inputs are one context's ``[W]`` entry fields."""
    finest = [None] * (-(-n_tokens // block))
    for s, w, k, ok in zip(start.tolist(), span.tolist(), lod.tolist(), valid.tolist(), strict=True):
        if not ok:
            continue
        for b in range(s // block, min(len(finest), -(-(s + w) // block))):
            finest[b] = k if finest[b] is None else min(finest[b], k)
    return "".join(UNCOVERED if k is None else str(k) for k in finest)


def fold(text: str, width: int = 96) -> list[str]:
    return [text[i : i + width] for i in range(0, len(text), width)] or [""]
