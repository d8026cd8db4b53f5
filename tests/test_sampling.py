"""Sampling a token (temperature, top-k, top-p) and the decode loop's early stop, which the server's stop sequences
and gone clients use."""

from __future__ import annotations

import torch
from builders import VOCAB, make_system

from mcfn.inference.contexts import FullContexts
from mcfn.inference.generation import Sampling, decode, pick_token


def test_top_p_samples_only_the_likeliest_tokens_whose_mass_first_reaches_p():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    generator = torch.Generator().manual_seed(0)

    def drawn(p: float) -> set[int]:
        return {int(pick_token(logits, Sampling(1.0, 0, 0, p), generator)) for _ in range(300)}

    assert drawn(0.4) == {1}
    assert drawn(0.7) == {1, 2}
    assert drawn(0.9) == {1, 2, 3}
    assert drawn(1.0) == {0, 1, 2, 3}


def test_the_decode_loop_stops_before_a_token_its_chooser_refuses():
    base = make_system(64, 4, 2, 32, 8, N=2, seed=3).base
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    asked = []

    def choose(logits, i):
        asked.append(i)
        return None if i == 3 else logits.argmax(-1, keepdim=True)

    out, stats = decode(FullContexts(base, 40, torch.device("cpu")), prompt, 10, choose)
    assert out.numel() == 3 and stats.new_tokens == 3 and asked == [0, 1, 2, 3]
