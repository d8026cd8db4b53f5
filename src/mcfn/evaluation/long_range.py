"""The long-range tokens of a window, defined by its tokens alone: what only the far past can predict.

A tail prediction at position ``t`` (its target the token after ``t``) is **long-range** when the trigram ending at
``t`` occurred earlier in the window, but only further back than the last ``W - R`` tokens: the span truncation keeps
at a refocus. A copy of what followed there would predict it, and nothing recent can. The set depends on the tokens
only, never on any condition's loss, so every condition is scored on the same tokens and none is favoured by the
choice (the earlier definition, tokens where truncation lost more than a nat to full context, picked the tokens
where truncation did worst).
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from mcfn.core.match import NGRAM, ngram_keys
from mcfn.typecheck import typechecked


@typechecked
def far_context_tokens(window: Int[Tensor, "b t1"], tail: int, near: int) -> Bool[Tensor, "b h"]:
    """``[B, tail]``: for each of the last ``tail`` predictions, whether its trigram context occurred earlier in the
    window and every earlier occurrence ends ``near`` or more tokens back."""
    tokens = window[:, :-1]
    T = tokens.size(1)
    keys = ngram_keys(tokens, NGRAM)
    t = torch.arange(T - tail, T, device=window.device)  # the tail's positions
    p = torch.arange(T, device=window.device)
    same = keys[:, None, :] == keys[:, T - tail :, None]  # [B, tail, T]: position p ends the same trigram as t
    earlier = (p[None, :] < t[:, None]) & (t[:, None] >= NGRAM - 1)  # a full trigram at t, and p before it
    back = t[:, None] - p[None, :]
    seen = same & earlier
    return (seen & (back >= near)).any(-1) & ~(seen & (back < near)).any(-1)
