"""Where a refocus's static layout lies over a growing history (:func:`stream_view`): the last ``H`` to ``H + K - 1``
tokens are the LOD0 tail, the length is rounded up to a multiple of ``K^L`` with *phantom* tokens after the newest
one, and the budget is ``W - R`` (:func:`refocus_budget`: room for the ``R`` tokens decoded before the next
refocus) raised by the phantoms' count so that they cost nothing. Past about ``budget·K^L`` tokens even the coarsest
cover is over that budget, and a refocus leaves out the top-level gists its scores rank lowest; past
:data:`VIEW_BLOCKS` top-level blocks the view starts later, whole blocks at a time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from mcfn.core.nodes import Layout
from mcfn.errors import UserError
from mcfn.geometry import most_refocus_every


@dataclass(frozen=True)
class StreamView:
    """Where the static layout lies over a history: tokens ``[origin, origin + layout.T)``, of which the ones from
    ``origin + real`` on are phantoms."""

    layout: Layout
    origin: int
    real: int


# The most top-level blocks a refocus reads (32,768 tokens at K^L = 64, the default profile's): a cold refocus scores
# every block of its view, so its cost grows with the view up to this.
VIEW_BLOCKS = 512


def refocus_budget(layout: Layout, refocus_every: int) -> int:
    """The budget of each refocus's cut, ``W - R``: the ``R`` tokens read before the next refocus join it as tokens.
    It must hold the tail of the view and a few gists; a ``UserError`` names the valid range of ``R`` otherwise."""
    most = most_refocus_every(layout.W, layout.H, layout.K, layout.L)
    if not 1 <= refocus_every <= most:
        raise UserError(
            f"refocus every {refocus_every} tokens: R must lie in [1, {most}], for the working context of W={layout.W} "
            f"to keep room for the tail of H={layout.H} tokens and a few gists"
        )
    return layout.W - refocus_every


def view_blocks(layout: Layout, budget: int) -> int:
    """The most top-level blocks a view holds: :data:`VIEW_BLOCKS`, or where more, those the budget's coarsest cover
    reaches (its tail and one gist a block before it: a large ``W`` reads at least what it could cover)."""
    return max(VIEW_BLOCKS, budget - layout.H + -(-layout.H // layout.top_span))


def stream_view(n: int, layout: Layout, budget: int) -> StreamView:
    """The layout over a history of ``n`` tokens, or over its newest :func:`view_blocks` top-level blocks, the
    oldest dropped ``K^L`` tokens at a time past that. Its budget holds the coarsest cover of about ``budget·K^L``
    tokens; past that a refocus leaves out the top-level gists its scores rank lowest
    (:func:`mcfn.core.allocator.coarsest_within_budget`)."""
    K, top = layout.K, layout.top_span
    tail_start = max(0, (n - layout.H) // K * K)

    # The origin keeps the newest view_blocks() top-level blocks, as long as whole blocks precede the tail.
    origin = top * min(max(0, -(-n // top) - view_blocks(layout, budget)), tail_start // top)
    real = n - origin
    T = -(-real // top) * top
    phantoms = T - real  # they cost nothing: the budget is raised by their count
    view = dataclasses.replace(layout, T=T, H=T - (tail_start - origin), W=min(budget + phantoms, T), N=0)
    return StreamView(view, origin, real)


def view_node_ids(view: StreamView, layout: Layout, device: torch.device) -> Int[Tensor, " view_nodes"]:
    """Each node of ``view`` as a node id of ``layout``, a layout over the same history from token 0 that covers the
    view (``origin + view.T <= layout.T``): how the evaluation reads a view from a training window's tree."""
    ids = [
        torch.arange(size, device=device) + offset + view.origin // layout.K**k
        for k, (size, offset) in enumerate(zip(view.layout.level_sizes, layout.level_offsets, strict=True))
    ]
    return torch.cat(ids)
