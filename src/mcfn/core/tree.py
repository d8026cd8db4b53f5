"""The summary tree of one batch: every node's embedding, built level by level with GistNet.

Every gist of the tree is read by some working context (together they cover the whole history), so the exact
backward runs GistNet over all ``T`` tokens a second time and keeps every level's activations for it: the step's
cost and memory grow with ``T``. With ``mc.gist.grad_blocks = m`` the tree's values are computed without a
gradient, and GistNet is run again with one on at most ``m`` blocks per level and sequence
(:func:`with_sparse_gradient`): the gists the working contexts read first, then the children of those already
chosen a level up, then any. Values are unchanged; the gradient is exact wherever a read gist's whole subtree
was chosen and stops at the first block that was not.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from jaxtyping import Bool, Float, Int
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


def sparse_gradient_bites(layout: Layout, grad_blocks: int) -> bool:
    """Whether ``mc.gist.grad_blocks`` leaves any level's eligible block without its gradient (a config constant)."""
    return grad_blocks > 0 and max(layout.eligible_counts[1:], default=0) > grad_blocks


@typechecked
def gradient_blocks(read: Bool[Tensor, "b nodes"], layout: Layout, grad_blocks: int) -> list[Int[Tensor, "b _"]]:
    """Per level ``1..L``, the ``min(n_k, grad_blocks)`` eligible blocks ``[B, m_k]`` GistNet reruns with a gradient,
    chosen top-down: blocks some working context reads (``read``) first, then children of the blocks chosen a
    level up (so a read gist's subtree stays differentiable as deep as the bound allows), then at random."""
    b, K = read.size(0), layout.K
    picks: list[Tensor] = []
    above: Tensor | None = None  # the level above's choice as a mask over its eligible blocks
    for k in range(layout.L, 0, -1):
        n, lo = layout.eligible_counts[k], layout.level_offsets[k]
        key = 2.0 * read[:, lo : lo + n].float() + torch.rand(b, n, device=read.device)
        if above is not None:
            under = repeat(above, "b p -> b (p k)", k=K)  # block j of level k sits under parent j // K
            key = key + F.pad(under, (0, n - under.size(1)))
        pick = key.topk(min(n, grad_blocks), dim=1).indices
        above = torch.zeros(b, n, device=read.device).scatter(1, pick, 1.0)
        picks.append(pick)
    return picks[::-1]


@typechecked
def with_sparse_gradient(
    gistnet: GistNet, token_emb: Float[Tensor, "b t d"], values: Tree, layout: Layout, picks: list[Tensor]
) -> Tree:
    """``values`` (a tree computed without a gradient) with the gists of ``picks`` recomputed from their children
    with one, bottom-up, so a chosen gist's gradient reaches its chosen children and, at LOD1, the tokens."""
    levels, d = [token_emb], token_emb.size(2)
    for k in range(1, layout.L + 1):
        lo, size = layout.level_offsets[k], layout.level_sizes[k]
        level, pick = values.emb[:, lo : lo + size], picks[k - 1]
        if pick.size(1):  # a config constant: a level with no eligible block keeps its zero padding
            child = rearrange(
                pick[..., None] * layout.K + torch.arange(layout.K, device=pick.device), "b m k -> b (m k)"
            )
            children = levels[-1].gather(1, repeat(child, "b c -> b c d", d=d))
            gists = gistnet(rearrange(children, "b (m k) d -> (b m) k d", k=layout.K), level=k)
            level = level.scatter(
                1, repeat(pick, "b m -> b m d", d=d), rearrange(gists, "(b m) d -> b m d", b=pick.size(0))
            )
        levels.append(level)
    return Tree(emb=torch.cat(levels, dim=1), batch_size=[token_emb.size(0)])
