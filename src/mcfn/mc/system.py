"""The MegaContext model (base GPT + GistNet + static tree layout) and its training step.

``process_batch`` is the whole step as a composition of pure functions, compiled as one graph::

    window [B, T+1] ─► build_tree ─► sample_variants ─► assemble ─► base forward ─► variant_losses
                       Tree           [B, V, nodes]       WC [B·V, W]  NLL [B·V, W]    loss_* + metrics
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor, nn

from mcfn.config import RunConfig
from mcfn.mc.context import WorkingContext, assemble
from mcfn.mc.gistnet import GistNet
from mcfn.mc.layout import Layout
from mcfn.mc.losses import tail_mask, variant_losses
from mcfn.mc.tree import Tree, build_tree
from mcfn.mc.variants import VariantNoise, sample_variants
from mcfn.model import GPT
from mcfn.typecheck import typechecked


class MegaContext(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.layout = Layout.from_config(cfg)
        self.base = GPT(cfg.model)
        mc = cfg.mc
        self.gistnet = GistNet(
            cfg.model.n_embd, cfg.gist_width, mc.gist_layers, mc.gist_heads, mc.block_size, mc.lod_max
        )
        for name, value in self.layout.node_table().items():
            self.register_buffer(f"node_{name}", value, persistent=False)

    @property
    def node_table(self) -> dict[str, Tensor]:
        return {"lod": self.node_lod, "start": self.node_start, "span": self.node_span, "parent": self.node_parent}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@typechecked
def build_contexts(system: MegaContext, window: Int[Tensor, "b t1"], noise: VariantNoise) -> WorkingContext:
    layout = system.layout
    tree: Tree = build_tree(system.gistnet, system.base.embed(window[:, : layout.T]), layout)
    return assemble(tree, sample_variants(noise, layout), window, layout, system.node_table)


def entry_nll(system: MegaContext, wc: WorkingContext) -> Tensor:
    """One packed base-model forward over every working context: per-entry NLL ``[B·V, W]``."""
    base = system.base
    return base.nll(base.hidden(wc.emb, wc.position, wc.span.float()), wc.target)


def process_batch(system: MegaContext, window: Tensor, noise: VariantNoise) -> dict[str, Tensor]:
    """The MegaContext training step: ``[B, T+1]`` windows and variant noise → ``loss_*`` terms + metrics."""
    wc = build_contexts(system, window, noise)
    return variant_losses(entry_nll(system, wc), wc, system.layout)


@torch.no_grad()
def tail_nll_and_bytes(
    system: MegaContext, window: Tensor, noise: VariantNoise, token_bytes: Tensor
) -> tuple[Tensor, Tensor]:
    """Validation sums per variant slot: tail NLL ``[V]`` (nats, over byte-bearing targets) and tail bytes.

    Every variant is scored on the same tail targets (I4), so the byte count is the same for all of them.
    """
    layout = system.layout
    wc = build_contexts(system, window, noise)
    nbytes = token_bytes[wc.target.clamp(min=0)] * tail_mask(wc, layout)
    nll_sum = (entry_nll(system, wc) * (nbytes > 0)).sum(-1).view(-1, layout.V).sum(0)
    return nll_sum, nbytes.sum(-1).view(-1, layout.V)[:, 0].sum()
