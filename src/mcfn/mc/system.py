"""The MegaContext model (base GPT, GistNet, LensNet and the static tree layout) and its training step.

The step is a composition of pure functions, compiled as one graph::

    window [B, T+1] ─► build_tree ─► sample_variants (+ allocator) ─► assemble ─► base forward ─► losses
                       Tree           [B, V, nodes]                   WC [B·V, W]  NLL [B·V, W]
                                                                               └─► LensNet ─► preferences

``process_batch`` trains the base model and GistNet; ``process_batch_lens`` adds LensNet and its
preference loss. They are separate functions (not one with a flag) so that each compiles to its own
graph and a run that computes the lens loss every k-th step never recompiles.
"""

from __future__ import annotations

import dataclasses

import torch
from einops import rearrange, repeat
from jaxtyping import Bool, Int
from torch import Tensor, nn

from mcfn.config import RunConfig
from mcfn.mc.allocator import allocate, node_scores_of
from mcfn.mc.context import WorkingContext, assemble
from mcfn.mc.gistnet import GistNet
from mcfn.mc.layout import Layout
from mcfn.mc.lensnet import LensNet
from mcfn.mc.losses import tail_mask, tail_nll, variant_losses
from mcfn.mc.preferences import lens_losses
from mcfn.mc.tree import Tree, build_tree
from mcfn.mc.variants import VariantNoise, coarsest_cut, sample_variants
from mcfn.model import GPT
from mcfn.step import byte_sums
from mcfn.typecheck import typechecked

NODE_FIELDS = ("lod", "start", "span", "parent", "eligible")


class MegaContext(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        mc = cfg.mc
        self.layout = Layout.from_config(cfg)
        self.base = GPT(cfg.model)
        self.gistnet = GistNet(
            cfg.model.n_embd, cfg.gist_width, mc.gist_layers, mc.gist_heads, mc.block_size, mc.lod_max
        )
        self.lensnet = (
            LensNet(cfg.model.n_embd, cfg.lens_width, mc.lens_layers, mc.lens_heads, self.layout) if (mc.lens) else None
        )
        self.alloc_variants = mc.alloc_variants if mc.lens else 0
        self.alloc_noise = mc.alloc_noise
        self.use_rank = mc.lens_rank
        self.spend_min = mc.variant_spend_min
        for name, value in self.layout.node_table().items():
            self.register_buffer(f"node_{name}", value, persistent=False)
        self.register_buffer("coarsest", coarsest_cut(self.layout, torch.device("cpu")), persistent=False)

    @property
    def node_table(self) -> dict[str, Tensor]:
        return {name: getattr(self, f"node_{name}") for name in NODE_FIELDS}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@typechecked
def refocus(
    system: MegaContext,
    tree: Tree,
    window: Int[Tensor, "b t1"],
    cut: Bool[Tensor, "b a nodes"],
    layout: Layout,
    explore: Tensor | None = None,
    iterations: int = 1,
    node_table: dict[str, Tensor] | None = None,
) -> Bool[Tensor, "b a nodes"]:
    """Refocus ``A`` working contexts per sample within ``layout.W``: each iteration scores the current
    context with LensNet, adds ``alloc_noise`` times the exploration noise ``explore [B, A, I, nodes]``
    if given (then ``I`` iterations), and reallocates. ``node_table`` is ``layout``'s, when ``layout`` is
    not the system's own (a streaming view)."""
    B, A = cut.shape[:2]
    table = system.node_table if node_table is None else node_table
    per_row = dataclasses.replace(layout, N=A - 1)  # assemble A contexts per sample: V = A
    iterations = explore.size(2) if explore is not None else iterations
    cut = rearrange(cut, "b a n -> (b a) n")
    with torch.no_grad():
        for it in range(iterations):
            wc = assemble(tree, rearrange(cut, "(b a) n -> b a n", b=B), window, per_row, table)
            scores = node_scores_of(system.lensnet(wc), wc.node, wc.valid, layout.n_nodes)
            if explore is not None:
                scores = scores + system.alloc_noise * rearrange(explore[:, :, it], "b a n -> (b a) n")
            cut = allocate(cut, scores, per_row, table)
    return rearrange(cut, "(b a) n -> b a n", b=B)


@typechecked
def allocator_cuts(
    system: MegaContext, tree: Tree, window: Int[Tensor, "b t1"], noise: VariantNoise
) -> Bool[Tensor, "b a nodes"]:
    """The allocator's working contexts, ``A = alloc_variants`` per sample, refocused from the coarsest cut
    with exploration noise: LensNet thus learns on the contexts it creates."""
    A, B = system.alloc_variants, window.size(0)
    start = repeat(system.coarsest, "n -> b a n", b=B, a=A)
    return refocus(system, tree, window, start, system.layout, explore=noise.explore[:, -A:])


@typechecked
def choose_variants(
    system: MegaContext, tree: Tree, window: Int[Tensor, "b t1"], noise: VariantNoise
) -> Bool[Tensor, "b v nodes"]:
    """The baseline and the random compressed cuts, the last ``alloc_variants`` of them replaced by the allocator's."""
    shown = sample_variants(noise, system.layout, system.spend_min)
    if not system.alloc_variants:
        return shown
    keep = system.layout.V - system.alloc_variants
    return torch.cat([shown[:, :keep], allocator_cuts(system, tree.detach(), window, noise)], dim=1)


@typechecked
def build_contexts(
    system: MegaContext, window: Int[Tensor, "b t1"], noise: VariantNoise
) -> tuple[WorkingContext, Bool[Tensor, "b v nodes"]]:
    layout = system.layout
    tree = build_tree(system.gistnet, system.base.embed(window[:, : layout.T]), layout)
    shown = choose_variants(system, tree, window, noise)
    return assemble(tree, shown, window, layout, system.node_table), shown


def entry_nll(system: MegaContext, wc: WorkingContext) -> Tensor:
    """One packed base-model forward over every working context: per-entry NLL ``[B·V, W]``."""
    base = system.base
    return base.nll(base.hidden(wc.emb, wc.position, wc.span.float()), wc.target)


def process_batch(system: MegaContext, window: Tensor, noise: VariantNoise) -> dict[str, Tensor]:
    """The MegaContext step without the LensNet loss: ``loss_lm`` and the variant metrics."""
    wc, _ = build_contexts(system, window, noise)
    nll = entry_nll(system, wc)
    return variant_losses(nll, tail_nll(nll, wc, system.layout), wc, system.layout)


def process_batch_lens(
    system: MegaContext, window: Tensor, noise: VariantNoise, lens_weights: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The full MegaContext step: ``loss_lm``, ``loss_lens`` and all metrics, from one base-model forward."""
    wc, shown = build_contexts(system, window, noise)
    nll = entry_nll(system, wc)
    tails = tail_nll(nll, wc, system.layout)
    out = variant_losses(nll, tails, wc, system.layout)
    scores = system.lensnet(wc)
    out.update(lens_losses(scores, shown, tails, wc, system.layout, system.node_table, lens_weights, system.use_rank))
    return out


@torch.no_grad()
def tail_nll_and_bytes(
    system: MegaContext, window: Tensor, noise: VariantNoise, token_bytes: Tensor
) -> tuple[Tensor, Tensor]:
    """Validation sums per variant slot: tail NLL ``[V]`` (nats, over byte-bearing targets) and tail bytes.

    Every variant is scored on the same tail targets (I4), so the byte count is the same for all of them.
    """
    layout = system.layout
    wc, _ = build_contexts(system, window, noise)
    nats, nbytes = byte_sums(entry_nll(system, wc), wc.target, token_bytes, tail_mask(wc, layout))
    return nats.view(-1, layout.V).sum(0), nbytes.view(-1, layout.V)[:, 0].sum()
