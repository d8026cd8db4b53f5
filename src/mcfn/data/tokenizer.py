"""Byte-level BPE tokenizer, trained with HuggingFace ``tokenizers`` on the training split.

Byte level means every string encodes (no unknown token) and every non-special token stands for a
fixed number of bytes, which is what bits-per-byte needs: :meth:`Tokenizer.token_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS = "<|bos|>"  # marks the start of every document


class Tokenizer:
    def __init__(self, hf: HFTokenizer):
        self._hf = hf
        bos = hf.token_to_id(BOS)
        if bos is None:
            raise ValueError(f"tokenizer has no {BOS} token")
        self.bos_id: int = bos

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            min_frequency=2,
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        self._hf.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=False)

    def token_bytes(self, padded_vocab: int | None = None) -> torch.Tensor:
        """``[V]`` int32: bytes each token stands for; 0 for special tokens and vocabulary padding.

        ByteLevel maps each byte to one printable character, so a token's length in characters is its
        length in bytes.
        """
        size = padded_vocab or self.vocab_size
        out = torch.zeros(size, dtype=torch.int32)
        special = {BOS}
        for token, idx in self._hf.get_vocab().items():
            out[idx] = 0 if token in special else len(token)
        return out
