"""Gist reconstruction: every gist read back into the tokens it covers (``loss_recon``).

A compressor trained only through the language-model loss barely learns (the Compressive Transformer's
LM-trained compressor did worse than mean-pooling; ICAE and Deng et al. 2024 add autoencoding). Here a
small decoder reads one gist ``g`` of LOD ``k`` and, for each offset ``j`` of its span ``[s, s + K^k)``,
predicts token ``s + j`` through the base model's own output head:

    h_j = RMSNorm(W_out · relu(W_in · RMSNorm(g) + offset_j + level_k)²)

It sees nothing but the gist and the offset, so whatever it predicts above the unigram rate is information
the gist carries about its own tokens. The gradient reaches GistNet (and the token embeddings under it).
Token ``s + j`` is the gist's *own* token, not the next one: this is autoencoding, not prediction (I5 is
about the base model's targets).
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from mcfn.core.model import GPT, rms_norm
from mcfn.core.nodes import Layout
from mcfn.core.outputs import StepOutput
from mcfn.core.tree import Tree
from mcfn.typecheck import typechecked


class GistDecoder(nn.Module):
    def __init__(self, d_model: int, width: int, block_size: int, lod_max: int):
        super().__init__()
        self.in_proj = nn.Linear(d_model, width, bias=False)
        self.offset_emb = nn.Parameter(torch.randn(block_size**lod_max, width) * 0.02)
        self.level_emb = nn.Parameter(torch.randn(lod_max, width) * 0.02)
        self.out_proj = nn.Linear(width, d_model, bias=False)

    @typechecked
    def forward(self, gists: Float[Tensor, "m d"], level: int, span: int) -> Float[Tensor, "m s d"]:
        """Per gist, one hidden state for each of the ``span`` tokens it covers (read by the base's head)."""
        x = self.in_proj(rms_norm(gists))[:, None] + self.offset_emb[:span] + self.level_emb[level - 1]
        return rms_norm(self.out_proj(torch.relu(x).square()))


@typechecked
def reconstruction_nll(
    decoder: GistDecoder, base: GPT, tree: Tree, tokens: Int[Tensor, "b t"], layout: Layout
) -> Float[Tensor, " levels"]:
    """Mean NLL (nats per token) of reading every eligible gist back into its own tokens, per level ``1..L``."""
    out = []
    for k in range(1, layout.L + 1):
        n, span = layout.eligible_counts[k], layout.K**k  # config constants: static under compile
        lo = layout.level_offsets[k]
        gists = rearrange(tree.emb[:, lo : lo + n], "b n d -> (b n) d")
        own = rearrange(tokens[:, : n * span], "b (n s) -> (b n) s", s=span)
        out.append(base.nll(decoder(gists, k, span), own).mean())
    return torch.stack(out)


def reconstruction_loss(
    decoder: GistDecoder, base: GPT, tree: Tree, tokens: Tensor, layout: Layout, weight: Tensor
) -> StepOutput:
    """``loss_recon``: the weighted mean over levels, and each level's NLL as a metric."""
    nll = reconstruction_nll(decoder, base, tree, tokens, layout)
    metrics = {f"mc/recon_lod{k}": nll[k - 1] for k in range(1, layout.L + 1)}
    return StepOutput({"loss_recon": weight * nll.mean()}, metrics, {})
