"""GistNet: one vector for an aligned block of ``K`` children, shared by every level of the tree.

A small bidirectional transformer (the GPT's own block without the causal mask) at its own width,
usually half the model's, since it runs over every eligible token and must stay cheap. It reads the
``K`` children (token embeddings for LOD1, LOD1 gists for LOD2), adds a learned embedding of the level it is
building, mean-pools the result and adds a projection of that to the mean of the children. The projection starts at
zero, so a new GistNet's gist is the plain average of its children, already in the embedding space the base model
reads. What the learned part adds is measured by ``gist_worth`` (every gist zeroed, ``lens_nogist``).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from mcfn.core.model import ROPE_BASE, Block, bidirectional, rms_norm, rotary_tables
from mcfn.typecheck import typechecked


class GistNet(nn.Module):
    def __init__(self, d_model: int, width: int, n_layer: int, n_head: int, block_size: int, lod_max: int):
        super().__init__()
        self.block_size, self.width = block_size, width
        self.in_proj = nn.Linear(d_model, width, bias=False)
        self.level_emb = nn.Parameter(torch.zeros(lod_max, width))
        self.blocks = nn.ModuleList(Block(width, n_head) for _ in range(n_layer))
        self.out_proj = nn.Linear(width, d_model, bias=False)
        self.head_dim = width // n_head
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.uniform_(
            self.in_proj.weight, -((3 / self.in_proj.in_features) ** 0.5), (3 / self.in_proj.in_features) ** 0.5
        )
        nn.init.normal_(self.level_emb, std=0.02)
        for block in self.blocks:
            block.reset_parameters()
        nn.init.zeros_(self.out_proj.weight)

    @typechecked
    def forward(self, children: Float[Tensor, "m k d"], level: int) -> Float[Tensor, "m d"]:
        """Gists of ``m`` blocks of ``k`` children each, building LOD ``level`` (1-based): the children's mean
        plus what the transformer reads from them."""
        positions = torch.arange(children.size(1), device=children.device, dtype=torch.float32)[None]
        cos, sin = rotary_tables(positions, torch.ones_like(positions), self.head_dim, ROPE_BASE)
        x = self.in_proj(rms_norm(children)) + self.level_emb[level - 1]
        for block in self.blocks:
            x = block(x, cos, sin, bidirectional)
        return children.mean(dim=1) + self.out_proj(rms_norm(x).mean(dim=1))
