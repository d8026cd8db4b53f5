"""How much better a cut could do, chunk by chunk: the best-of conditions of the evaluation.

Each is picked per chunk (the ``R`` predictions one refocus serves) among candidate cuts of that chunk:

* ``best_of_random``: the best of the ``M`` random cuts, picked on the tokens it is scored on (optimistic);
* ``best_of_all``: the best of every cut the evaluation scores (``recency``, ``attn``, ``match``, ``lens`` and the
  random cuts), picked the same way: optimistic, since the pick sees the tokens it is scored on;
* ``best_of_all_oos``: out of sample, cross-fitted within each chunk: the chunk's first half of predictions is
  scored by the candidate that did best on its second half, and the second by the one best on the first. No token
  is scored by a choice that saw it, and every scored token is still scored once, so it sits in the same table as
  the other conditions. The headroom the project reports is this one's.
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import Tensor

from mcfn.core.policy import RANDOM, policies
from mcfn.evaluation.one_cut import Predictions

BEST_OF = ("best_of_random", "best_of_all", "best_of_all_oos")  # the conditions this module defines


def candidate_slots(pred: Predictions) -> list[int]:
    """The context slots ``best_of_all`` picks from: the random cuts, then the cut of each policy present that
    generation could refocus with (truncation and the scored ones; not the fixed rule)."""
    random = pred.slots[RANDOM.name]
    chosen = [p.name for p in policies() if p.refocuses and p.name in pred.slots]
    return list(range(random.start, random.stop)) + [pred.slots[name].start for name in chosen]


def per_group(
    pred: Predictions, mask: Tensor, scored: Tensor, group: Tensor, groups: int, slots: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """The scored nats and wrong answers ``[B, S, G]`` of the contexts ``slots`` summed over each group of tail
    columns (``group [B, H]``, ``-1`` for none), and each group's scored bytes ``[B, G]``."""
    where = mask & (group >= 0)
    slot = group.clamp(min=0)
    nll, hit = pred.nll[:, slots], pred.hit[:, slots]
    index = repeat(slot, "b h -> b s h", s=len(slots))
    zeros = nll.new_zeros(nll.size(0), len(slots), groups)
    nats = zeros.scatter_add(-1, index, nll * where[:, None])
    wrong = zeros.scatter_add(-1, index, ((~hit) & where[:, None]).float())
    nbytes = scored.new_zeros(scored.size(0), groups).scatter_add(-1, slot, scored * where)
    return nats, wrong, nbytes


def per_chunk(pred: Predictions, mask: Tensor, scored: Tensor, slots: list[int] | None = None):
    """:func:`per_group` over chunks (``[B, S, C]``), for the random contexts unless ``slots`` says otherwise."""
    random = pred.slots[RANDOM.name]
    slots = list(range(random.start, random.stop)) if slots is None else slots
    return per_group(pred, mask, scored, pred.chunk, int(pred.chunk.max()) + 1, slots)


def halves(chunk: Tensor) -> Tensor:
    """``[B, H]``: each column's half-chunk, ``2c`` for the first half of chunk ``c``'s columns and ``2c + 1`` for
    the rest (a chunk of one column has only a first half); ``-1`` where ``chunk`` is."""
    C = int(chunk.max()) + 1
    onehot = chunk[..., None] == torch.arange(C, device=chunk.device)  # [B, H, C]
    rank = (onehot.cumsum(1) - 1).gather(-1, chunk.clamp(min=0)[..., None])[..., 0]
    length = onehot.sum(1).gather(-1, chunk.clamp(min=0))
    return torch.where(chunk >= 0, 2 * chunk + (2 * rank >= length).long() * (length > 1).long(), -1)


def best_of(nats: Tensor, wrong: Tensor) -> tuple[Tensor, Tensor]:
    """Per window, the nats of the best context of each chunk (picked on them) and whether it answered every one."""
    best = nats.argmin(1, keepdim=True)
    return nats.gather(1, best)[:, 0].sum(-1), (wrong.gather(1, best)[:, 0] == 0).all(-1)


def cross_fitted(pred: Predictions, mask: Tensor, scored: Tensor, slots: list[int]) -> tuple[Tensor, Tensor]:
    """Per window, ``best_of_all_oos``'s nats and whether it answered every scored token: each half-chunk scored by
    the context best on the other half of its chunk."""
    C = int(pred.chunk.max()) + 1
    nats, wrong, _ = per_group(pred, mask, scored, halves(pred.chunk), 2 * C, slots)  # [B, S, 2C]
    nats, wrong = nats.unflatten(-1, (C, 2)), wrong.unflatten(-1, (C, 2))  # [B, S, C, half]
    pick = nats.flip(-1).argmin(1, keepdim=True)  # [B, 1, C, half]: chosen on the other half
    return nats.gather(1, pick)[:, 0].sum((-2, -1)), (wrong.gather(1, pick)[:, 0] == 0).all(-1).all(-1)
