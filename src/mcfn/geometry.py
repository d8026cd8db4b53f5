"""The layout rules of the tree, a base module below the config and the core: how many entries the coarsest cover
of a window takes, and how often a working context can be refocused within its budget. Config validation
(:mod:`mcfn.config`) and the core (:mod:`mcfn.core.nodes`, :mod:`mcfn.core.focus`) both ask here, so that the core
learns its own shapes without importing the config."""

from __future__ import annotations


def coarsest_cover_size(seq_len: int, block: int, lod_max: int, tail: int) -> int:
    """Entries in the coarsest working context that covers ``[0, T)`` with the last ``H`` tokens at LOD0.

    Greedy from the top level: the largest aligned nodes that fit before the tail, then the next level
    for what is left (``T - H`` is a multiple of ``K``, so LOD1 always finishes the job).
    """
    left, entries = seq_len - tail, tail
    for level in range(lod_max, 0, -1):
        entries += left // block**level
        left %= block**level
    return entries


def most_refocus_every(budget: int, tail: int, block: int, lod_max: int) -> int:
    """The largest ``R`` whose refocus budget ``W - R`` still holds any history's coarsest cover: the view's tail
    (at most ``H + K - 1`` tokens) and, once the oldest top-level blocks are dropped, at most ``K - 1`` gists per
    level below the top (:func:`mcfn.core.stream_view.stream_view`)."""
    return budget - tail - (block - 1) * lod_max
