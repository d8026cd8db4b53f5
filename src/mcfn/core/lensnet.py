"""LensNet: one signed score per working-context entry.

``> 0``: expanding this entry into its ``K`` children would lower the loss on what comes next.
``< 0``: this entry and its siblings can be collapsed into their parent at little cost.

A small **bidirectional** transformer (the GPT's block without the causal mask), so that old entries
see the recent text they are judged against. Padding is masked out of attention. Entries carry
their (damped) rotary position, and three features added to the input: a learned embedding of the
LOD, and the log-span and distance back from the newest entry (both scaled to about [0, 1]). The inputs are the
entries' embeddings, detached: the policy learns to read the tree, not to reshape it.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor, nn

from mcfn.core.context import WorkingContext
from mcfn.core.model import Block, rms_norm, rotary_tables
from mcfn.core.nodes import Layout
from mcfn.typecheck import typechecked


class LensNet(nn.Module):
    def __init__(self, d_model: int, width: int, n_layer: int, n_head: int, layout: Layout):
        super().__init__()
        self.layout, self.head_dim = layout, width // n_head
        self.in_proj = nn.Linear(d_model, width, bias=False)
        self.lod_emb = nn.Parameter(torch.zeros(layout.L + 1, width))
        self.feature_proj = nn.Linear(2, width, bias=False)
        self.blocks = nn.ModuleList(Block(width, n_head, causal=False) for _ in range(n_layer))
        self.head = nn.Linear(width, 1, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = math.sqrt(3.0 / self.in_proj.in_features)
        nn.init.uniform_(self.in_proj.weight, -bound, bound)
        nn.init.normal_(self.lod_emb, std=0.02)
        nn.init.normal_(self.feature_proj.weight, std=0.02)
        for block in self.blocks:
            block.reset_parameters()
        nn.init.normal_(self.head.weight, std=0.01)

    @typechecked
    def forward(self, wc: WorkingContext) -> Float[Tensor, "r w"]:
        T, L = self.layout.T, self.layout.L
        end = wc.start + wc.span
        # Distance back from the context's last entry (the newest token), in units of the training T:
        # during training the context ends at T; while streaming it ends wherever the text has got to.
        now = torch.where(wc.valid, end, 0).amax(-1, keepdim=True)
        features = torch.stack(
            (torch.log2(wc.span.float()) / max(1.0, math.log2(self.layout.K) * L), (now - end).float() / T), dim=-1
        )
        x = self.in_proj(rms_norm(wc.emb.detach())) + self.lod_emb[wc.lod] + self.feature_proj(features)
        cos, sin = rotary_tables(wc.position, wc.span.float(), self.head_dim, 10000.0)
        mask = rearrange(wc.valid, "r w -> r 1 1 w")  # every query attends to valid keys only
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.head(rms_norm(x)).squeeze(-1) * wc.valid
