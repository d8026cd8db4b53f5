"""The training mixture: a share of training windows carry long-range facts and questions (``data.mix``).

Natural text gives a tiny model little reason to read far back. A mixed window is a natural training window
rewritten by one of the long-range generators of :mod:`mcfn.data.probes` (``passkey``, ``kv-recall``,
``copy``): facts written into the real text at random depths and a question at the very end, whose answer
lies in the scored tail, so the step's tail loss rewards whoever kept the fact. One generator is for training
only, ``repeat``: the window ends with a copy of ``2·H`` tokens of its own earlier text. Every token of the copy
after its first is predictable from far back (the tail entirely so), a dense signal for the induction
(find the earlier occurrence, copy what followed) that every probe's answer needs. A second, ``shuffled-repeat``,
first shuffles the window's own tokens, so that only the copy predicts the copied span: with smeared keys
(``model.key_smear``) it made retrieval form by plain step 800 on stdlib seed 1337, where neither did alone by 1200
(LABLOG, twentieth session).

Which rows are mixed, with which generator, and what they write is a pure function of ``(seed, batch
index)`` on the ``train_mix`` stream: a resumed run sees the same batches, and no training window's facts
come from the evaluation's ``eval_probes`` stream. Validation windows never pass through here.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from mcfn.config import RunConfig
from mcfn.data.corpus import Corpus
from mcfn.data.loader import WindowSampler
from mcfn.data.probes import PROBES, make_probe, misfit
from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError
from mcfn.seeding import derive_seed

REPEAT = "repeat"
SHUFFLED_REPEAT = "shuffled-repeat"
MIX_TASKS = (REPEAT, SHUFFLED_REPEAT, *PROBES[1:])


def write_repeat(window: Tensor, tail: int, rng: random.Random) -> Tensor:
    """``window [T + 1]`` ending with a copy of ``2·tail`` tokens (at most a quarter of it) from earlier in it."""
    span = min(2 * tail, window.numel() // 4)
    source = rng.randint(0, window.numel() - 2 * span)
    out = window.clone()
    out[-span:] = window[source : source + span]
    return out


def write_shuffled_repeat(window: Tensor, tail: int, rng: random.Random) -> Tensor:
    """``window [T + 1]``'s own tokens in a random order, then :func:`write_repeat`: nothing but the copy predicts the
    repeated span, so its loss teaches induction alone, on tokens whose embeddings the text trains."""
    order = torch.randperm(window.numel(), generator=torch.Generator().manual_seed(rng.getrandbits(63)))
    return write_repeat(window[order], tail, rng)


REPEATS = {REPEAT: write_repeat, SHUFFLED_REPEAT: write_shuffled_repeat}  # the training-only generators


class MixedSampler:
    """A :class:`WindowSampler` whose batches have a share ``mix`` of rows rewritten by ``tasks``; from batch
    ``switch`` on (a MegaContext run's MC phase), a share ``later``."""

    def __init__(
        self,
        sampler: WindowSampler,
        tok: Tokenizer,
        tail: int,
        mix: float,
        tasks: tuple[str, ...],
        seed: int,
        later: float | None = None,
        switch: int = 0,
    ):
        for name in tasks:
            if name not in MIX_TASKS:
                raise UserError(f"unknown data.mix_tasks entry {name!r} (known: {', '.join(MIX_TASKS)})")
            why = None if name in REPEATS else misfit(name, tok, sampler.window - 1, tail)
            if why is not None:
                raise UserError(f"data.mix_tasks cannot use {name}: {why}")
        self.sampler, self.tok, self.tail, self.mix, self.tasks, self.seed = sampler, tok, tail, mix, tasks, seed
        self.later, self.switch = mix if later is None else later, switch
        self.window = sampler.window

    def share(self, index: int) -> float:
        """The share of batch ``index``'s rows that carry a task."""
        return self.later if index >= self.switch else self.mix

    def draw(self, index: int, batch_size: int) -> tuple[random.Random, list[tuple[int, str]]]:
        """Batch ``index``'s rows that carry a task, with its name, and the generator that then writes them."""
        rng = random.Random(derive_seed(self.seed, "train_mix", index))
        return rng, [(row, rng.choice(self.tasks)) for row in range(batch_size) if rng.random() < self.share(index)]

    def tasked(self, index: int, batch_size: int) -> list[bool]:
        """Which rows of batch ``index`` carry a long-range task (without building the batch)."""
        rows = {row for row, _ in self.draw(index, batch_size)[1]}
        return [row in rows for row in range(batch_size)]

    def batch(self, index: int, batch_size: int) -> Tensor:
        """``[batch_size, T + 1]`` windows for batch ``index``: the sampler's, a share of them rewritten."""
        windows = self.sampler.batch(index, batch_size)
        rng, chosen = self.draw(index, batch_size)
        for row, name in chosen:
            if name in REPEATS:
                windows[row] = REPEATS[name](windows[row], self.tail, rng)
                continue
            probe = make_probe(name, windows[row : row + 1], self.tok, self.tail, seed=rng.getrandbits(63))
            windows[row] = probe.window[0]
        return windows


def training_sampler(cfg: RunConfig, corpus: Corpus) -> WindowSampler | MixedSampler:
    """Training batch ``i`` as a pure function of the seed and ``i``: corpus windows, with ``data.mix`` of them
    carrying a long-range task (``data.mc_mix`` in a MegaContext run's MC phase, where it is set)."""
    sampler = WindowSampler(corpus.train, cfg.data.seq_len + 1, cfg.train.seed)
    d = cfg.data
    later = d.mc_mix if d.mc_mix >= 0 and cfg.mc.enabled else d.mix  # the MC phase: from train.plain_steps on
    if d.mix <= 0 and later <= 0:
        return sampler
    return MixedSampler(sampler, corpus.tokenizer, cfg.mc.tail, d.mix, d.mix_task_names, cfg.train.seed, later,
                        cfg.train.plain_steps)  # fmt: skip
