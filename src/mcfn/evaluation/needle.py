"""The needle grid: can a run answer a pass key stated anywhere in a long history? (issue 100)

A **prompt** of ``L`` tokens is held-out text (one contiguous stretch of a split's token stream, documents in a row)
with the pass-key fact of the training probe (:func:`mcfn.data.probes.passkey_fact`) written at a depth (0: the
start, 1: just before the question) and the probe's question at its end. It is decoded greedily through the one
decode loop :mod:`train.generate` uses (:func:`mcfn.inference.generation.generate_mc` with the run's shipped policy and
rule; :func:`~mcfn.inference.generation.generate_full` for full attention, every token at its absolute position, as a
plain GPT reads), as many tokens as the key has, and a cell's accuracy is the share of its prompts whose decoded
tokens are exactly the key's. The same haystacks serve every depth of a length, and every policy, so cells of one
length differ only in where the fact lies.

The grid is the long-context field's standard picture (a heatmap of length by depth); here its point is lengths far
past the training window ``T``: MegaContext reads them through a working context of ``W`` entries.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

from mcfn.data.corpus import Split
from mcfn.data.probes import PASSKEY_QUESTION, passkey_fact, passkey_key
from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError
from mcfn.seeding import derive_seed

LENGTHS = (1024, 4096, 8192, 32768)  # prompt tokens: from twice T to 64 times it
DEPTHS = (0.1, 0.5, 0.9)  # where the fact starts, as a share of the haystack
PROMPTS = 10  # a cell: one prompt wrong leaves 0.9

Decode = Callable[[Tensor, int], Tensor]
"""A policy's greedy decode: a prompt ``[n]`` and how many tokens → the decoded tokens ``[k]``."""


@dataclass(frozen=True)
class NeedlePrompt:
    ids: Tensor  # [L] int64: BOS, the haystack with the fact written in, the question
    answer: Tensor  # [k] int64: the key's tokens, what a greedy decode must give
    length: int
    depth: float


@dataclass(frozen=True)
class NeedleCell:
    policy: str
    length: int
    depth: float
    correct: int
    prompts: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.prompts


def needle_prompts(
    split: Split, tok: Tokenizer, length: int, depths: Sequence[float], count: int, seed: int, device: torch.device
) -> list[NeedlePrompt]:
    """``count`` haystacks of ``length`` tokens, each with a fresh key written at every depth of ``depths`` (one prompt
    per haystack and depth, the haystack and key shared by its depths). A pure function of its arguments."""
    rng = random.Random(derive_seed(seed, "needle", length))
    question = tok.encode(PASSKEY_QUESTION)
    stream = split.tokens
    prompts = []
    for _ in range(count):
        key = passkey_key(rng)
        fact, answer = tok.encode(passkey_fact(key)), tok.encode(f" {key}")
        room = length - 1 - len(question) - len(fact)  # the haystack's tokens around the fact (BOS first)
        if room < 1:
            raise UserError(f"a needle prompt of {length} tokens cannot hold the fact and the question")
        if len(stream) < room:
            raise UserError(f"the split holds {len(stream)} tokens; a needle prompt of {length} needs {room}")
        start = rng.randint(0, len(stream) - room)
        haystack = np.asarray(stream[start : start + room], dtype=np.int64).tolist()
        for depth in depths:
            at = round(depth * room)
            ids = [tok.bos_id, *haystack[:at], *fact, *haystack[at:], *question]
            prompts.append(
                NeedlePrompt(
                    torch.tensor(ids, dtype=torch.int64, device=device),
                    torch.tensor(answer, dtype=torch.int64, device=device),
                    length,
                    depth,
                )
            )
    return prompts


def answered(decoded: Tensor, answer: Tensor) -> bool:
    """Whether a decode gave exactly the key's tokens."""
    return decoded.shape == answer.shape and bool((decoded == answer).all())


def needle_grid(
    policies: dict[str, Decode],
    split: Split,
    tok: Tokenizer,
    lengths: Sequence[int] = LENGTHS,
    depths: Sequence[float] = DEPTHS,
    count: int = PROMPTS,
    seed: int = 0,
    device: torch.device | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> list[NeedleCell]:
    """Every policy's accuracy at every (length, depth), scored from what its decode gives."""
    cells = []
    for length in lengths:
        prompts = needle_prompts(split, tok, length, depths, count, seed, device or torch.device("cpu"))
        for name, decode in policies.items():
            for depth in depths:
                mine = [p for p in prompts if p.depth == depth]
                correct = sum(answered(decode(p.ids, p.answer.numel()), p.answer) for p in mine)
                cells.append(NeedleCell(name, length, depth, correct, len(mine)))
                progress(f"{name} at {length} tokens, depth {depth:.0%}: {correct}/{len(mine)}")
    return cells


def needle_table(cells: Sequence[NeedleCell]) -> str:
    """A markdown table a policy: rows the lengths, columns the depths, each cell ``accuracy (correct/prompts)``."""
    depths = sorted({c.depth for c in cells})
    lines = []
    for policy in dict.fromkeys(c.policy for c in cells):
        mine = [c for c in cells if c.policy == policy]
        lines += [f"**{policy}**", "", "| tokens | " + " | ".join(f"depth {d:.0%}" for d in depths) + " |"]
        lines.append("|---:|" + "---:|" * len(depths))
        for length in sorted({c.length for c in mine}):
            row = {c.depth: c for c in mine if c.length == length}
            lines.append(
                f"| {length:,} | "
                + " | ".join(f"{row[d].accuracy:.2f} ({row[d].correct}/{row[d].prompts})" for d in depths)
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def cells_json(cells: Sequence[NeedleCell]) -> list[dict]:
    return [{**asdict(c), "accuracy": c.accuracy} for c in cells]
