"""Text scored through generation's own loop: each held-out window's first ``first`` tokens are the prompt and the
rest are fed to :func:`~mcfn.inference.generation.teacher_forced` under each of several decodings (a policy and rule
through MegaContext's contexts, or full context), so the score is what generation computes, refocuses, cache and all.
Bits per byte of the fed tokens, paired by window, errors by bootstrap over documents
(:class:`~mcfn.evaluation.stats.Clusters`). ``train.reuse`` (two reuses of one policy's cache) and ``train.history``
(policies over histories longer than the training window) measure through it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.result import Gain
from mcfn.evaluation.stats import Clusters, paired_gain, pooled_bpb
from mcfn.inference.contexts import GenerationStats

# One way to decode a text: (prompt [n], continuation [m]) -> the continuation's logits [m, vocab] and the stats.
Decoding = Callable[[Tensor, Tensor], tuple[Tensor, GenerationStats]]


@dataclass(frozen=True)
class Generated:
    """Each decoding's summed nats over the fed tokens of every window ``[windows]``, its stats a window, and the fed
    tokens' bytes ``[windows]``."""

    nats: dict[str, Tensor]
    stats: dict[str, list[GenerationStats]]
    nbytes: Tensor
    clusters: Clusters

    @property
    def windows(self) -> int:
        return self.nbytes.numel()

    def bpb(self, name: str) -> float:
        return float(pooled_bpb(self.nats[name], self.nbytes))

    def gain(self, worse: str, better: str) -> Gain:
        """``bpb(worse) − bpb(better)`` on the same windows, its error by document."""
        gain = paired_gain(self.nats, self.nbytes, worse, better, self.clusters)
        assert gain is not None, "both decodings ran and every window has bytes"
        return gain

    def per_window(self, name: str, figure: Callable[[GenerationStats], float]) -> float:
        """A stats figure of ``name``'s decodings, averaged over the windows."""
        return sum(figure(s) for s in self.stats[name]) / max(1, len(self.stats[name]))


@torch.no_grad()
def generated_text(
    held: HeldOut,
    first: int,
    decodings: dict[str, Decoding],
    progress: Callable[[str], None] = lambda line: None,
) -> Generated:
    """Every window of ``held`` (documents in ``held.docs``) decoded by each of ``decodings``, its tokens from
    ``first`` on fed through the loop."""
    if held.docs is None or not held.windows:
        raise ValueError("text through generation needs held-out windows with their documents")
    windows, docs = torch.cat(held.windows), torch.cat(held.docs)
    if not 0 < first < windows.size(1):
        raise ValueError(f"the prompt of {first} tokens leaves nothing of a {windows.size(1)}-token window to score")
    nats: dict[str, list[Tensor]] = {name: [] for name in decodings}
    stats: dict[str, list[GenerationStats]] = {name: [] for name in decodings}
    for i, window in enumerate(windows):
        prompt, continuation = window[:first], window[first:]
        for name, decoding in decodings.items():
            logits, run = decoding(prompt, continuation)
            nats[name].append(F.cross_entropy(logits.float(), continuation, reduction="sum"))
            stats[name].append(run)
        if (i + 1) % 16 == 0 or i + 1 == windows.size(0):
            progress(f"{i + 1}/{windows.size(0)} windows")
    return Generated(
        nats={name: torch.stack(values) for name, values in nats.items()},
        stats=stats,
        nbytes=held.token_bytes[windows[:, first:]].sum(-1).float(),
        clusters=Clusters(docs),
    )
