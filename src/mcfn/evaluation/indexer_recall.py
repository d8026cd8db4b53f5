"""A focus policy measured as an indexer: how much of what full attention reads in the far past it shows in detail.

Per chunk of ``R`` predictions (generation's protocol: one cut each), the full window's attention of those
predictions' queries, summed over layers and heads, is pooled per ``K``-aligned block of tokens. Among the
**far** blocks (wholly older than the last ``W - R`` tokens before the chunk's horizon: what truncation cannot show,
so its recall is 0 by definition) the :data:`TOP` that full attention reads most are the blocks the chunk needs from
far back; a policy's recall is the share of them its cut shows at LOD0. The first block is left out: the base
model parks attention on its first tokens (an attention sink) whatever they hold. Nothing here chooses a cut: the
figure reads the cuts the evaluation already scored, beside their bits per byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange, reduce
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.attention import text_attention
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout
from mcfn.typecheck import typechecked

TOP = 4  # the far blocks per chunk that full attention reads most: the ones recall counts
DEFINITION = (
    f"per chunk of R predictions, the share of the {TOP} far blocks (older than the last W - R tokens, the first "
    "block left out) that full attention reads most which the policy's cut shows at LOD0"
)


@torch.no_grad()
@typechecked
def tail_attention(base: GPT, window: Int[Tensor, "b t1"], layout: Layout, before: int = 0) -> Float[Tensor, "b q t"]:
    """The full window's causal attention of each of the last ``q = H + before`` predictions' queries over the
    ``T`` tokens, summed over layers and heads: the tail's, after the ``before`` queries just ahead of it."""
    return text_attention(base, window[:, : layout.T], layout.H + before)


@typechecked
def chunk_recall(
    attention: Float[Tensor, "h t"], chunk: Int[Tensor, " h"], cuts: list[Tensor], layout: Layout, near: int, R: int
) -> list[float]:
    """One window's recall at each of its chunks that has far blocks (``cuts[c]``: chunk ``c``'s cut ``[nodes]``;
    ``chunk``: each tail column's chunk, -1 where unscored)."""
    T, H, K = layout.T, layout.H, layout.K
    blocks = torch.arange(T // K, device=attention.device)
    out = []
    for c, cut in enumerate(cuts):
        columns = chunk == c
        if not bool(columns.any()):
            continue
        horizon = T - H + int(columns.nonzero()[0, 0])  # the chunk's first prediction's position
        far = ((blocks + 1) * K <= horizon + 1 - near) & (blocks > 0)
        count = min(TOP, int(far.sum()))
        if count == 0:
            continue
        mass = reduce(attention[columns].sum(0), "(n k) -> n", "sum", k=K)
        top = torch.where(far, mass, -math.inf).topk(count).indices
        shown = rearrange(cut[:T], "(n k) -> n k", k=K).any(-1)
        out.append(float(shown[top].float().mean()))
    return out


@dataclass(frozen=True)
class IndexerRecall:
    """Each policy's recall (mean over windows of their chunks' mean) with its standard error over windows."""

    by_policy: dict[str, tuple[float, float]]
    windows: int

    def to_json(self) -> dict[str, Any]:
        return {
            "definition": DEFINITION,
            "windows": self.windows,
            **{name: {"recall": mean, "se": se} for name, (mean, se) in self.by_policy.items()},
        }

    @classmethod
    def of(cls, per_window: dict[str, list[float]]) -> IndexerRecall | None:
        """From each policy's per-window recalls (windows without far blocks left out); None when none has any."""
        if not per_window or not next(iter(per_window.values())):
            return None
        out = {}
        for name, values in per_window.items():
            x = torch.tensor(values, dtype=torch.float64)
            se = float(x.std() / math.sqrt(x.numel())) if x.numel() > 1 else math.nan
            out[name] = (float(x.mean()), se)
        return cls(out, len(next(iter(per_window.values()))))
