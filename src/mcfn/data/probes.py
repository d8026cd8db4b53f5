"""Long-range probes: held-out windows rewritten so that the end of the window can only be predicted from
text far back in it (DESIGN §7).

Each probe takes a batch of held-out windows ``[B, T + 1]`` (the haystack) and writes into each one, by
index, some facts at random depths and a question about them at the very end, where the answer is scored:

* ``passkey``: "The pass key is 48213. Remember it." at one random depth; the window ends with
  "What is the pass key? The pass key is 48213", and the answer is the number's tokens.
* ``kv-recall`` (multi-query associative recall): ``PAIRS`` random ``key = value`` lines spread through the
  window; the window ends with ``QUERIES`` of them asked again in random order, and the answers are every
  queried value's tokens.
* ``copy``: the window ends with a repeat of a span of its own early text; the answer is the repeated span
  after its first token (the first one cannot be known before the repeat starts).
* ``corpus``: the natural windows unchanged; every tail token is scored.

A probe is a pure function of the windows, the tokenizer and a seed (its own random stream, never the
training or evaluation windows' streams). Answers always lie in the last ``H`` target positions, so every
working context shows them at LOD0 (I4).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError
from mcfn.seeding import derive_seed

PROBES = ("corpus", "passkey", "kv-recall", "copy")
PAIRS, QUERIES = 6, 3  # kv-recall: facts in the window, and how many of them the tail asks for
COPY_SPAN = 24  # copy: tokens repeated


@dataclass(frozen=True)
class ProbeBatch:
    window: Tensor  # [B, T + 1] int64: the haystack with the facts and the question written in
    answer: Tensor  # [B, T] bool over next-token targets: the positions scored (window[t + 1] at t)
    depth: Tensor  # [B] float: where the (first) fact lies, as a fraction of T; 1 for corpus


def _write(row: list[int], at: int, ids: list[int]) -> None:
    row[at : at + len(ids)] = ids


def _ending(tok: Tokenizer, parts: list[tuple[str, bool]], length: int, tail: int) -> tuple[list[int], list[bool]]:
    """The question as token ids with an answer flag per token, checked to fit the scored tail."""
    ids, flags = [], []
    for text, is_answer in parts:
        piece = tok.encode(text)
        ids += piece
        flags += [is_answer] * len(piece)
    if len(ids) + 1 > tail or len(ids) >= length // 2:
        raise UserError(f"the probe's question needs {len(ids) + 1} tail tokens; mc.tail is {tail}")
    return ids, flags


def _place(row: list[int], ending: list[int], flags: list[bool], answer: list[bool]) -> None:
    """Write the question at the end of ``row`` ([T + 1]) and mark its answer tokens' target positions."""
    start = len(row) - len(ending)
    _write(row, start, ending)
    for i, is_answer in enumerate(flags):
        if is_answer:
            answer[start + i - 1] = True  # token at window index j is the target of position j - 1


PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"  # the answer follows: " " and the key


def passkey_key(rng: random.Random) -> str:
    """A fresh five-digit pass key."""
    return str(rng.randint(10_000, 99_999))


def passkey_fact(key: str) -> str:
    """The sentence that states the pass key, written into the haystack."""
    return f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"


def _passkey(rng: random.Random, row: list[int], tok: Tokenizer, tail: int) -> tuple[list[bool], float]:
    key = passkey_key(rng)
    fact = tok.encode(passkey_fact(key))
    question = [(PASSKEY_QUESTION, False), (f" {key}", True)]
    ending, flags = _ending(tok, question, len(row), tail)
    room = len(row) - len(ending) - len(fact) - tail  # the fact ends before the scored tail
    if room < 0:
        raise UserError("data.seq_len is too short for the pass key's fact before the tail")
    at = rng.randint(0, room)
    _write(row, at, fact)
    answer = [False] * (len(row) - 1)
    _place(row, ending, flags, answer)
    return answer, at / (len(row) - 1)


def _kv_recall(rng: random.Random, row: list[int], tok: Tokenizer, tail: int) -> tuple[list[bool], float]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    keys = ["".join(rng.choice(letters) for _ in range(4)) for _ in range(PAIRS)]
    values = [str(rng.randint(1000, 9999)) for _ in range(PAIRS)]
    asked = rng.sample(range(PAIRS), QUERIES)
    parts = [("\nRecall:", False)]
    for i in asked:
        parts += [(f" {keys[i]} =", False), (f" {values[i]}", True), (";", False)]
    ending, flags = _ending(tok, parts, len(row), tail)
    room = len(row) - len(ending) - tail  # facts end before the scored tail
    lines = [tok.encode(f"\n{k} = {v};\n") for k, v in zip(keys, values, strict=True)]
    slot = room // PAIRS
    if slot <= max(map(len, lines)):
        raise UserError(f"data.seq_len is too short for {PAIRS} key-value facts before the tail")
    starts = [i * slot + rng.randint(0, slot - len(line)) for i, line in enumerate(lines)]
    for at, line in zip(starts, lines, strict=True):
        _write(row, at, line)
    answer = [False] * (len(row) - 1)
    _place(row, ending, flags, answer)
    return answer, starts[asked[0]] / (len(row) - 1)


def _copy(rng: random.Random, row: list[int], tok: Tokenizer, tail: int) -> tuple[list[bool], float]:
    if COPY_SPAN + 1 > tail:
        raise UserError(f"the copy probe needs {COPY_SPAN + 1} tail tokens; mc.tail is {tail}")
    at = rng.randint(0, len(row) - 2 * tail - COPY_SPAN)
    span = row[at : at + COPY_SPAN]
    answer = [False] * (len(row) - 1)
    _place(row, span, [False] + [True] * (COPY_SPAN - 1), answer)
    return answer, at / (len(row) - 1)


_WRITERS = {"passkey": _passkey, "kv-recall": _kv_recall, "copy": _copy}


def misfit(name: str, tok: Tokenizer | None, seq_len: int, tail: int) -> str | None:
    """Why probe ``name`` cannot be written into windows of ``seq_len`` tokens with ``tail`` scored, or None."""
    try:
        make_probe(name, torch.zeros(1, seq_len + 1, dtype=torch.int64), tok, tail, seed=0)
    except UserError as e:
        return str(e)
    return None


def make_probe(name: str, windows: Tensor, tok: Tokenizer | None, tail: int, seed: int) -> ProbeBatch:
    """The probe ``name`` written into held-out ``windows [B, T + 1]``; the answers in the last ``tail`` targets."""
    if name not in PROBES:
        raise UserError(f"unknown task {name!r} (known: {', '.join(PROBES)})")
    B, T = windows.size(0), windows.size(1) - 1
    if name == "corpus":
        answer = torch.zeros(B, T, dtype=torch.bool)
        answer[:, T - tail :] = True
        return ProbeBatch(windows.clone(), answer, torch.ones(B))
    rng = random.Random(seed)
    rows, answers, depths = [], [], []
    for row in windows.tolist():
        answer, depth = _WRITERS[name](rng, row, tok, tail)
        rows.append(row)
        answers.append(answer)
        depths.append(depth)
    return ProbeBatch(torch.tensor(rows), torch.tensor(answers), torch.tensor(depths))


def evaluation_probe(name: str, windows: Tensor, tok: Tokenizer | None, tail: int, index: int) -> ProbeBatch:
    """The probe ``name`` as the evaluation writes it into its ``index``-th batch of held-out ``windows``: on a
    stream of its own, so every evaluation of the same windows asks the same questions."""
    return make_probe(name, windows, tok, tail, derive_seed(PROBES.index(name), "eval_probes", index))
