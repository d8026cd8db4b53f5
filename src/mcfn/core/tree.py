"""The summary tree of one batch: every node's embedding, built level by level with GistNet.

With ``mc.gist.source = "hidden"`` the LOD1 gists read the base model's own hidden states instead of the raw
token embeddings (:func:`block_hidden`): what the base model has made of a token in its context, the carrier
that published compressors find far stronger than input embeddings (the issue 23 reading list). The base reads
each top-level block of ``K^L`` tokens on its own, causally, so a feature depends only on its own block's text up
to itself: the same whether the tree is built for a training window or grown token by token over a stream
(:mod:`mcfn.inference.streaming`), and never on the tail.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from tensordict import TensorClass
from torch import Tensor

from mcfn.core.gistnet import GistNet
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout
from mcfn.typecheck import typechecked


class Tree(TensorClass):
    """Node embeddings ``[B, n_nodes, D]`` in the layout's node order (batch_size ``[B]``)."""

    emb: Tensor


@typechecked
def block_hidden(base: GPT, tokens: Int[Tensor, "b t"], block: int) -> Float[Tensor, "b t d"]:
    """The base model's final hidden states with every aligned ``block`` of tokens read on its own, from
    position 0 (``t`` a multiple of ``block``); detached: GistNet learns to read them, the base does not learn
    to write them."""
    with torch.no_grad():
        blocks = rearrange(tokens, "b (n s) -> (b n) s", s=block)
        return rearrange(base.token_hidden(blocks), "(b n) s d -> b (n s) d", b=tokens.size(0))


@typechecked
def build_tree(
    gistnet: GistNet,
    token_emb: Float[Tensor, "b t d"],
    layout: Layout,
    token_features: Float[Tensor, "b t d"] | None = None,
) -> Tree:
    """LOD0 = token embeddings; LODk = GistNet over aligned blocks of ``K`` LOD(k-1) nodes, one batched call
    per level; LOD1's transformer reads ``token_features`` instead of the embeddings when given. Only eligible
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
        features = None if k > 1 or token_features is None else by_block(token_features[:, : n_eligible * layout.K])
        gists = gistnet(children, level=k, features=features)
        gists = rearrange(gists, "(b n) d -> b n d", b=token_emb.size(0))
        levels.append(F.pad(gists, (0, 0, 0, layout.level_sizes[k] - n_eligible)))
    return Tree(emb=torch.cat(levels, dim=1), batch_size=[token_emb.size(0)])
