"""The summary tree of one batch: every node's embedding, built level by level with GistNet.

With ``mc.gist.source = "hidden"`` the LOD1 gists read the base model's own hidden states instead of the raw
token embeddings (:func:`block_hidden`): what the base model has made of a token in its context, the carrier
that published compressors find far stronger than input embeddings (the issue 23 reading list). The base reads
each top-level block of ``K^L`` tokens on its own, causally, so a feature depends only on its own block's text up
to itself: the same whether the tree is built for a training window or grown token by token over a stream
(:mod:`mcfn.inference.streaming`), and never on the tail.

With ``mc.gist.carrier = "kv"`` the tree also holds, for every node and every layer of the base model, the
mean of its tokens' keys and values from that same per-block forward (:func:`block_kv`, :func:`pool_kv`): the
per-layer key/value gist that published comparisons find far stronger than one input embedding. The keys are
averaged after their rotary, which is what the span-damped rotary of a gist's own position approximates
(:mod:`mcfn.core.model`), so a pooled key sits where the gist does.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from jaxtyping import Float, Int
from tensordict import TensorClass
from torch import Tensor

from mcfn.core.gistnet import GistNet
from mcfn.core.model import GPT, causal_attention
from mcfn.core.nodes import Layout
from mcfn.typecheck import typechecked


class Tree(TensorClass):
    """Every node of a batch in the layout's node order (batch_size ``[B]``)."""

    emb: Tensor  # [B, n_nodes, D] node embeddings
    kv: Tensor | None = None  # [B, n_nodes, layers, 2, heads, head_dim] pooled keys and values (carrier "kv")


@typechecked
def block_hidden(base: GPT, tokens: Int[Tensor, "b t"], block: int) -> Float[Tensor, "b t d"]:
    """The base model's final hidden states with every aligned ``block`` of tokens read on its own, from
    position 0 (``t`` a multiple of ``block``); detached: GistNet learns to read them, the base does not learn
    to write them."""
    with torch.no_grad():
        blocks = rearrange(tokens, "b (n s) -> (b n) s", s=block)
        return rearrange(base.token_hidden(blocks), "(b n) s d -> b (n s) d", b=tokens.size(0))


@typechecked
def block_kv(base: GPT, tokens: Int[Tensor, "b t"], block: int) -> Float[Tensor, "b t layers 2 h e"]:
    """Every token's rotated key and value in every layer of the base model, with every aligned ``block`` of
    tokens read on its own at its true positions (as :func:`block_hidden` reads them); detached."""
    keys_values: list[Tensor] = []

    def keep(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys_values.append(torch.stack((k, v), dim=2))  # [(b n), h, 2, s, e]
        return causal_attention(layer, q, k, v)

    with torch.no_grad():
        blocks = rearrange(tokens, "b (n s) -> (b n) s", s=block)
        first = torch.arange(0, tokens.size(1), block, device=tokens.device).repeat(tokens.size(0))
        positions = (first[:, None] + torch.arange(block, device=tokens.device)).float()
        base.hidden(base.embed(blocks), positions, torch.ones_like(positions), attend=keep)
    per_layer = torch.stack(keys_values, dim=1)  # [(b n), layers, h, 2, s, e]
    return rearrange(per_layer, "(b n) l h two s e -> b (n s) l two h e", b=tokens.size(0))


@typechecked
def pool_kv(token_kv: Float[Tensor, "b t layers 2 h e"], layout: Layout) -> Float[Tensor, "b nodes layers 2 h e"]:
    """Every node's keys and values: a token's own at LOD0, the mean of its ``K`` children's at LODk (so the
    mean of its tokens'); zero for the ineligible nodes, which no working context shows."""
    levels = [token_kv]
    for k in range(1, layout.L + 1):
        means = reduce(levels[-1], "b (n k) l two h e -> b n l two h e", "mean", k=layout.K)
        eligible = torch.arange(means.size(1), device=means.device) < layout.eligible_counts[k]
        levels.append(means * rearrange(eligible, "n -> 1 n 1 1 1 1"))
    return torch.cat(levels, dim=1)


@typechecked
def build_tree(
    gistnet: GistNet,
    token_emb: Float[Tensor, "b t d"],
    layout: Layout,
    token_features: Float[Tensor, "b t d"] | None = None,
    token_kv: Float[Tensor, "b t layers 2 h e"] | None = None,
) -> Tree:
    """LOD0 = token embeddings; LODk = GistNet over aligned blocks of ``K`` LOD(k-1) nodes, one batched call
    per level; LOD1's transformer reads ``token_features`` instead of the embeddings when given. Only eligible
    blocks are summarised (a gist that overlaps the tail is never shown); the rest of a level is zero padding
    that no working context reads. With ``token_kv`` the tree also holds every node's pooled keys and values.
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
    kv = None if token_kv is None else pool_kv(token_kv, layout)
    return Tree(emb=torch.cat(levels, dim=1), kv=kv, batch_size=[token_emb.size(0)])
