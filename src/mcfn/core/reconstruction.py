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

Reading every gist back costs the base's output head on every token of every level, ``L·T`` predictions a
sequence: at T = 16384 that was 16.9 s of a 19.1 s step on the CPU. So each level reads back at most
``max_tokens`` tokens a sequence (:data:`RECON_TOKENS` in training): a uniform sample of (gist, offset) pairs, drawn
afresh each step, whose mean NLL is an unbiased estimate of the level's mean. Sampling tokens rather than whole
gists keeps the bound at every level: a LOD4 gist spans 4096 tokens, more than the bound on its own. Where the
level holds no more than that, every gist is read whole, in order, as before.
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat
from jaxtyping import Float, Int
from torch import Tensor, nn

from mcfn.core.model import GPT, rms_norm
from mcfn.core.nodes import Layout
from mcfn.core.outputs import StepOutput
from mcfn.core.tree import Tree
from mcfn.typecheck import typechecked

RECON_TOKENS = 512  # tokens read back a level and sequence in training: at T = 512 every gist is read whole


class GistDecoder(nn.Module):
    def __init__(self, d_model: int, width: int, block_size: int, lod_max: int):
        super().__init__()
        self.in_proj = nn.Linear(d_model, width, bias=False)
        self.offset_emb = nn.Parameter(torch.randn(block_size**lod_max, width) * 0.02)
        self.level_emb = nn.Parameter(torch.randn(lod_max, width) * 0.02)
        self.out_proj = nn.Linear(width, d_model, bias=False)

    @typechecked
    def forward(self, gists: Float[Tensor, "m d"], level: int, offsets: Int[Tensor, "m s"]) -> Float[Tensor, "m s d"]:
        """Per gist, one hidden state for each of its tokens at ``offsets`` into its span (read by the base's head)."""
        x = self.in_proj(rms_norm(gists))[:, None] + self.offset_emb[offsets] + self.level_emb[level - 1]
        return rms_norm(self.out_proj(torch.relu(x).square()))


def tokens_read(n: int, span: int, max_tokens: int) -> int:
    """How many of a level's ``n·span`` tokens are read back a sequence: all of them unless ``max_tokens``
    (0: no bound) is fewer."""
    return n * span if max_tokens <= 0 else min(n * span, max_tokens)


def sample_tokens(b: int, total: int, m: int, device: torch.device) -> Int[Tensor, "b m"]:
    """``m`` distinct token indices of ``0..total-1`` per row, uniformly at random (fixed shape: no recompile)."""
    return torch.rand(b, total, device=device).topk(m, dim=1).indices


@typechecked
def reconstruction_nll(
    decoder: GistDecoder, base: GPT, tree: Tree, tokens: Int[Tensor, "b t"], layout: Layout, max_tokens: int = 0
) -> Float[Tensor, " levels"]:
    """Mean NLL (nats per token) of reading eligible gists back into their own tokens, per level ``1..L``: every
    token of every one, or a uniform sample of ``max_tokens`` of them a sequence (:func:`tokens_read`)."""
    out = []
    for k in range(1, layout.L + 1):
        n, span = layout.eligible_counts[k], layout.K**k  # config constants: static under compile
        lo = layout.level_offsets[k]
        gists, own = tree.emb[:, lo : lo + n], tokens[:, : n * span]
        m = tokens_read(n, span, max_tokens)
        if m < n * span:  # config constants: static under compile
            pick = sample_tokens(tokens.size(0), n * span, m, tokens.device)  # token j·span + o: gist j, offset o
            gists = gists.gather(1, (pick // span)[..., None].expand(-1, -1, gists.size(-1)))
            offsets, own = rearrange(pick % span, "b m -> (b m) 1"), own.gather(1, pick)
        else:
            offsets = repeat(torch.arange(span, device=tokens.device), "s -> (b n) s", b=tokens.size(0), n=n)
        hidden = decoder(rearrange(gists, "b m d -> (b m) d"), k, offsets)
        out.append(base.nll(hidden, rearrange(own, "b (m s) -> (b m) s", s=offsets.size(1))).mean())
    return torch.stack(out)


def reconstruction_loss(
    decoder: GistDecoder, base: GPT, tree: Tree, tokens: Tensor, layout: Layout, weight: Tensor, max_tokens: int
) -> StepOutput:
    """``loss_recon``: the weighted mean over levels, and each level's NLL as a metric."""
    nll = reconstruction_nll(decoder, base, tree, tokens, layout, max_tokens)
    metrics = {f"mc/recon_lod{k}": nll[k - 1] for k in range(1, layout.L + 1)}
    return StepOutput({"loss_recon": weight * nll.mean()}, metrics, {})
