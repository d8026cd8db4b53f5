"""Training samples: windows of ``T + 1`` tokens, and a prefetcher that keeps loading off the hot path.

Batch ``i`` is a pure function of ``(seed, i)``: the data position of a run is one integer, so a resumed
run sees exactly the batches the uninterrupted run would have seen, and prefetching ahead is harmless.

Windows lie inside one document whenever the corpus has documents of at least ``T + 1`` tokens (each
possible in-document window is equally likely, so long documents are sampled in proportion to their
length); only a corpus with no such document falls back to windows over the concatenated stream, in
which the BOS tokens mark where documents meet.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch
from torch import Tensor

from mcfn.data.corpus import Split
from mcfn.errors import UserError
from mcfn.seeding import derive_seed

VAL_SEED = 0x5EED  # validation windows do not depend on the run's seed


class WindowSampler:
    def __init__(self, split: Split, window: int, seed: int, name: str = "train", stream: str = "train_windows"):
        n_tokens = len(split.tokens)
        if n_tokens < window:
            raise UserError(
                f"the {name} split has {n_tokens} tokens, fewer than data.seq_len + 1 = {window}; "
                f"use more data or a smaller data.seq_len"
            )
        self.split, self.window, self.seed, self.stream = split, window, seed, stream
        starts = split.doc_offsets[:-1]
        counts = np.maximum(np.diff(split.doc_offsets) - window + 1, 0)
        self.in_document = bool(counts.sum() > 0)
        if not self.in_document:  # no document is long enough: windows over the concatenated stream
            starts, counts = np.zeros(1, dtype=np.int64), np.asarray([n_tokens - window + 1])
        keep = counts > 0
        self.doc_starts = torch.from_numpy(starts[keep].astype(np.int64))
        self.cum_counts = torch.from_numpy(np.cumsum(counts[keep]).astype(np.int64))

    def batch(self, index: int, batch_size: int) -> torch.Tensor:
        """``[batch_size, T + 1]`` int64 windows for batch number ``index``."""
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.stream, index))
        u = torch.randint(int(self.cum_counts[-1]), (batch_size,), generator=g)
        doc = torch.searchsorted(self.cum_counts, u, right=True)
        before = torch.where(doc > 0, self.cum_counts[(doc - 1).clamp(min=0)], 0)
        starts = (self.doc_starts[doc] + (u - before)).numpy()
        rows = starts[:, None] + np.arange(self.window)[None, :]
        return torch.from_numpy(self.split.tokens[rows].astype(np.int64))


def validation_batches(split: Split, window: int, n_batches: int, batch_size: int) -> list[torch.Tensor]:
    """A fixed set of validation windows, the same for every run on this corpus and ``T``."""
    sampler = WindowSampler(split, window, VAL_SEED, name="validation", stream="val_windows")
    return [sampler.batch(i, batch_size) for i in range(n_batches)]


class Prefetcher:
    """Builds batches ``start, start + 1, ...`` on a background thread and hands them over on device.

    On CUDA the host tensor is pinned and copied with ``non_blocking=True``, so the step never waits on
    host work that could have happened during the previous step.
    """

    def __init__(
        self,
        sampler: WindowSampler,
        batch_size: int,
        start: int,
        device: torch.device,
        depth: int = 2,
        rows: slice = slice(None),
    ):
        # rows: this process's share of each global batch (data parallelism)
        self.sampler, self.batch_size, self.device, self.rows = sampler, batch_size, device, rows
        self.next_index = start
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(start,), daemon=True)
        self._thread.start()

    def _work(self, index: int) -> None:
        pin = self.device.type == "cuda"
        while not self._stop.is_set():
            try:
                batch = self.sampler.batch(index, self.batch_size)[self.rows]
                item = (index, batch.pin_memory() if pin else batch)
            except BaseException as e:  # handed to the consumer, raised there
                item = (index, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            index += 1

    def next(self) -> torch.Tensor:
        index, batch = self._queue.get()
        if isinstance(batch, BaseException):
            raise batch
        assert index == self.next_index
        self.next_index += 1
        return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


EVAL_SEED = 0x7E57  # the final evaluation's windows do not depend on the run's seed either
WINDOWS_PER_DOCUMENT = 2


def evaluation_windows(split: Split, window: int, n_windows: int, batch_size: int) -> tuple[list[Tensor], list[Tensor]]:
    """The final evaluation's windows, ``[≤ batch_size, T + 1]`` batches, with each window's document index: drawn
    without replacement from as many distinct documents as the split has (one window each, in a fixed random order
    of the documents), then a second from documents long enough for two that do not overlap (each window then in its
    own half), never more than :data:`WINDOWS_PER_DOCUMENT` a document. Fewer than ``n_windows`` where the split
    runs out. A split with no document of ``T + 1`` tokens gives consecutive windows over the concatenated stream,
    each counted as the document it starts in."""
    offsets = split.doc_offsets
    lengths = np.diff(offsets)
    g = torch.Generator().manual_seed(EVAL_SEED)
    order = torch.randperm(len(lengths), generator=g).numpy()
    eligible = [int(d) for d in order if lengths[d] >= window]
    picks: list[tuple[int, int]] = []  # (document, start)
    if not eligible:
        starts = np.arange(0, len(split.tokens) - window + 1, window)[:n_windows]
        picks = [(int(np.searchsorted(offsets, s, side="right") - 1), int(s)) for s in starts]
    else:
        twice = [d for d in eligible if lengths[d] >= WINDOWS_PER_DOCUMENT * window]
        second = set(twice[: max(0, n_windows - len(eligible))])
        for d in eligible[:n_windows]:
            halves = 2 if d in second else 1
            span = int(lengths[d]) // halves
            for h in range(halves):
                offset = int(torch.randint(span - window + 1, (1,), generator=g))
                picks.append((d, int(offsets[d]) + h * span + offset))
    rows = np.asarray([s for _, s in picks])[:, None] + np.arange(window)[None, :]
    tokens = torch.from_numpy(split.tokens[rows].astype(np.int64))
    docs = torch.tensor([d for d, _ in picks], dtype=torch.int64)
    return list(tokens.split(batch_size)), list(docs.split(batch_size))
