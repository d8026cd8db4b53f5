"""The summary tree of one batch: every node's embedding, built level by level with GistNet."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from tensordict import TensorClass
from torch import Tensor

from mcfn.core.gistnet import GistNet
from mcfn.core.nodes import Layout
from mcfn.typecheck import typechecked


class Tree(TensorClass):
    """Node embeddings ``[B, n_nodes, D]`` in the layout's node order (batch_size ``[B]``)."""

    emb: Tensor


@typechecked
def build_tree(gistnet: GistNet, token_emb: Float[Tensor, "b t d"], layout: Layout) -> Tree:
    """LOD0 = token embeddings; LODk = GistNet over aligned blocks of ``K`` LOD(k-1) nodes, one batched call
    per level. Only eligible
    blocks are summarised (a gist that overlaps the tail is never shown); the rest of a level is zero padding
    that no working context reads.
    """
    levels = [token_emb]
    for k in range(1, layout.L + 1):
        n_eligible = layout.eligible_counts[k]  # a config constant: this branch is static under compile
        if n_eligible == 0:
            levels.append(token_emb.new_zeros(token_emb.size(0), layout.level_sizes[k], token_emb.size(2)))
            continue
        by_block = partial(rearrange, pattern="b (n k) d -> (b n) k d", k=layout.K)
        children = by_block(levels[-1][:, : n_eligible * layout.K])
        gists = gistnet(children, level=k)
        gists = rearrange(gists, "(b n) d -> b n d", b=token_emb.size(0))
        levels.append(F.pad(gists, (0, 0, 0, layout.level_sizes[k] - n_eligible)))
    return Tree(emb=torch.cat(levels, dim=1), batch_size=[token_emb.size(0)])
