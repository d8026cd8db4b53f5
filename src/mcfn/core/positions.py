"""The position rule: where an entry sits for the rotary attention of every transformer here.

**An entry's rotary position is its place in the sequence it is read in**: the working context's ``i``-th entry at
``i``, whatever text it covers and however long the history behind it is; the tail and every decoded token continue
from the last entry. So no distance the base model reads is ever longer than its context (``W`` entries and the
tokens decoded since the last refocus), the distances it trained on, however far back a far pick lies in the
history. A plain window of tokens is read exactly as before (its ``t``-th token at ``t``: rotary attention depends on
differences only), and so is full attention over a whole text, the one reader that stays at absolute positions.

What an entry covers keeps its own fields: the span (``WorkingContext.span``) damps a gist's rotary phases by how
much text it stands for (``core.model.rotary_tables``), and the text position (``WorkingContext.position``, the
centre of its span in the history) says which entries are adjacent in the text (the key smear, I13) and how far
back an entry lies (LensNet's features).

Why (issue 100, LABLOG): with every entry at its absolute position, a far pick past the distances trained on (about
700 tokens at T = 512) was unreadable, full attention included (pass key 0.19 past a gap of 1,536); StreamingLLM
likewise places what its cache keeps at positions within the cache, and Activation Beacon its beacons at
consecutive positions. Numbering entries in order keeps a cache's prefix at the same positions when the entries after
it change, so a refocus that keeps a prefix keeps its keys as they were rotated.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.typecheck import typechecked


@typechecked
def laid_positions(
    first: Int[Tensor, ""] | Int[Tensor, " n"] | int, n: int, device: torch.device
) -> Float[Tensor, "1 n"]:
    """The rotary positions ``[1, n]`` of ``n`` entries read after the ``first`` entries of their sequence (a KV
    cache's slots before them; 0 for a whole working context or window): ``first, first + 1, ...``; or, given their
    places ``first [n]`` (a KV cache's slots of a refill that skips the slots it reuses), those."""
    if isinstance(first, Tensor) and first.dim() == 1:
        return first.float()[None]
    return (first + torch.arange(n, device=device)).float()[None]
