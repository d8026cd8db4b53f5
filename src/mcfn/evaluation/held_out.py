"""The held-out windows an evaluation scores (:class:`HeldOut`), and the one way they are drawn from a split."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mcfn.data.corpus import Split
from mcfn.data.loader import evaluation_windows
from mcfn.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class HeldOut:
    """The held-out windows an evaluation scores, batch by batch, and what it needs to score them."""

    windows: list[Tensor]  # batches of windows [B, T + 1]
    token_bytes: Tensor  # [vocab] UTF-8 bytes of each token: bits per byte
    tokenizer: Tokenizer | None = None  # the probes write their questions with it (corpus alone needs none)
    docs: list[Tensor] | None = None  # each window's document, batch by batch: errors by document
    split: str | None = None  # where the windows came from

    @classmethod
    def drawn(cls, split: Split, name: str, window: int, count: int, batch_size: int, token_bytes: Tensor,
              tokenizer: Tokenizer) -> HeldOut:  # fmt: skip
        """Up to ``count`` windows of ``window`` tokens of ``split`` (called ``name``) in batches of ``batch_size``, on
        ``token_bytes``' device: the one way the final evaluation, ``train.eval`` and the ship choice draw theirs
        (:func:`mcfn.data.loader.evaluation_windows`)."""
        windows, docs = evaluation_windows(split, window, count, batch_size)
        return cls([w.to(token_bytes.device) for w in windows], token_bytes, tokenizer, docs, name)
