"""The static shape of MegaContext: sizes, and node metadata that depends on the config only.

Nodes are numbered level by level: LOD0 tokens ``0..T-1``, then the ``T/K`` LOD1 gists, then the
``T/K²`` LOD2 gists, and so on. A LODk node ``j`` covers ``[j·K^k, (j+1)·K^k)`` (I1), and its parent is
LOD(k+1) node ``j // K``.

A node is **eligible** when its span ends before the tail ``[T-H, T)``: only eligible gists can be
shown (I4), so only they are ever computed. At each level the eligible nodes are a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcfn.config import RunConfig, coarsest_cover_size


@dataclass(frozen=True)
class Layout:
    T: int  # tokens of history per sample
    K: int  # children per gist
    L: int  # highest level of detail
    W: int  # working-context capacity
    H: int  # supervised tail, LOD0 in every variant
    N: int  # compressed variants per sample

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Layout:
        mc = cfg.mc
        return cls(T=cfg.data.seq_len, K=mc.block_size, L=mc.lod_max, W=mc.budget, H=mc.tail, N=mc.variants)

    @property
    def V(self) -> int:  # variants per sample, the recency baseline first
        return self.N + 1

    @property
    def level_sizes(self) -> tuple[int, ...]:
        return tuple(self.T // self.K**k for k in range(self.L + 1))

    @property
    def level_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for size in self.level_sizes[:-1]:
            offsets.append(offsets[-1] + size)
        return tuple(offsets)

    @property
    def n_nodes(self) -> int:
        return sum(self.level_sizes)

    @property
    def eligible_counts(self) -> tuple[int, ...]:
        """Eligible nodes per level (a prefix of each level); every token is eligible."""
        return (self.T,) + tuple((self.T - self.H) // self.K**k for k in range(1, self.L + 1))

    @property
    def coarsest_cover(self) -> int:
        return coarsest_cover_size(self.T, self.K, self.L, self.H)

    def node_table(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """``lod``, ``start``, ``span``, ``parent`` (-1 at the top; int64) and ``eligible`` (bool: a token, or a
        gist that ends before the tail) for every node, ``[n_nodes]``."""
        lod, start, span, parent = [], [], [], []
        for k, size in enumerate(self.level_sizes):
            j = torch.arange(size)
            lod.append(torch.full((size,), k))
            start.append(j * self.K**k)
            span.append(torch.full((size,), self.K**k))
            parent.append(self.level_offsets[k + 1] + j // self.K if k < self.L else torch.full((size,), -1))
        table = {"lod": lod, "start": start, "span": span, "parent": parent}
        out = {name: torch.cat(parts).to(device=device, dtype=torch.int64) for name, parts in table.items()}
        out["eligible"] = (out["lod"] == 0) | (out["start"] + out["span"] <= self.T - self.H)
        return out
