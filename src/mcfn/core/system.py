"""The MegaContext model (base GPT, GistNet, LensNet and the static tree) and its training step.

The step is a composition of pure stage functions, compiled as one graph::

    window [B, T+1] ─► tree_stage ─► variants_stage (+ allocator) ─► assemble_stage ─► base_stage ─► loss_stage
                       Tree │        [B, V, nodes]                    WC [B·V, W]       hidden [B·V, W, D]
                            │                                                  ├─► lens_stage ─► lens_loss_stage
                            │                                                  └─► teacher_stage (optional)
                            └─► recon_stage (optional): gists read back into their own tokens

``process_batch`` trains the base model and GistNet, and LensNet with its preference loss when the system has one
(``mc.lens.enabled``, a static choice under compile); it adds the full-window teacher's terms
(:mod:`mcfn.core.teacher`) when ``[mc.teacher]`` turns them on, static too. Each stage is
marked with :func:`mcfn.core.timing_hook.stage`: a plain call in training, and in the benchmark a recorder that
times each stage on its own, so the phase table always times the program that trains.
"""

from __future__ import annotations

import torch
from einops import repeat
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from mcfn.config import AUX_LAYERS, RunConfig
from mcfn.core.attention import AttentionTarget, attention_target_loss
from mcfn.core.context import WorkingContext, assemble, seen_until
from mcfn.core.focus import refocus, tail_horizon
from mcfn.core.gistnet import GistNet
from mcfn.core.lensnet import LensNet, horizon_query
from mcfn.core.losses import loss_shares, recency_tail_nll, tail_mask, tail_nll, variant_losses
from mcfn.core.match import match_votes
from mcfn.core.model import GPT
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.outputs import StepOutput
from mcfn.core.preferences import lens_losses
from mcfn.core.reconstruction import RECON_TOKENS, GistDecoder, reconstruction_loss
from mcfn.core.step import byte_sums
from mcfn.core.teacher import teacher_losses
from mcfn.core.timing_hook import stage
from mcfn.core.tree import Tree, build_tree, gradient_blocks, sparse_gradient_bites, with_sparse_gradient
from mcfn.core.variants import VariantNoise, coarsest_cut, sample_variants, voted_first, voted_nodes
from mcfn.core.weights import LossWeights
from mcfn.typecheck import typechecked

NODE_FIELDS = ("lod", "start", "span", "parent", "eligible")


def lensnet_of(cfg: RunConfig, layout: Layout, match_prior: str | None = None) -> LensNet:
    """A new LensNet of ``cfg``'s sizes over ``layout``, with ``cfg``'s match prior unless ``match_prior`` says
    another: the system's own, or a candidate policy's (:mod:`mcfn.stage.ship`)."""
    lens = cfg.mc.lens
    prior = lens.match_prior if match_prior is None else match_prior
    return LensNet(cfg.model.n_embd, cfg.aux_width, AUX_LAYERS, cfg.aux_heads, layout, match_reach=cfg.mc.refocus_every,
                   match_prior=prior, indexer=lens.indexer)  # fmt: skip


class MegaContext(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        mc = cfg.mc
        self.layout = Layout.from_config(cfg)
        self.base = GPT(cfg.model)
        width, heads = cfg.aux_width, cfg.aux_heads
        self.gistnet = GistNet(cfg.model.n_embd, width, AUX_LAYERS, heads, mc.block_size, mc.lod_max)
        self.use_recon = mc.gist.recon_weight > 0
        self.grad_blocks = mc.gist.grad_blocks if sparse_gradient_bites(self.layout, mc.gist.grad_blocks) else 0
        self.gist_decoder = GistDecoder(cfg.model.n_embd, width, mc.block_size, mc.lod_max) if self.use_recon else None
        self.lensnet = lensnet_of(cfg, self.layout) if mc.lens.enabled else None
        self.alloc_variants = mc.alloc_variants
        self.alloc_noise = mc.alloc.noise
        self.voted_share = mc.voted_share  # of the random variants, those that expand match's blocks first
        self.use_teacher = mc.teacher.enabled
        self.teacher_window = mc.teacher.window  # tokens each token of the teacher's reads; 0: all before it
        # What of the teacher's attention LensNet is fitted to (None: no attention target).
        lens_attention = mc.lens.enabled and mc.lens.attention_weight > 0
        self.attention_target = AttentionTarget.of(self.lensnet.recent, self.layout) if lens_attention else None
        self.refocus_every = mc.refocus_every
        # Buffers, so that the table follows the module's device; ``nodes`` wraps them in the typed table.
        for name, value in NodeTable.of(self.layout).tensors().items():
            self.register_buffer(f"node_{name}", value, persistent=False)
        self.register_buffer("coarsest", coarsest_cut(self.layout, torch.device("cpu")), persistent=False)

    @property
    def nodes(self) -> NodeTable:
        return NodeTable(self.layout, *(getattr(self, f"node_{name}") for name in NODE_FIELDS))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@typechecked
def allocator_cuts(
    system: MegaContext, tree: Tree, window: Int[Tensor, "b t1"], noise: VariantNoise
) -> Bool[Tensor, "b a nodes"]:
    """The allocator's working contexts, ``A = alloc_variants`` per sample, refocused from the coarsest cut
    with exploration noise, reading up to the tail (I11): LensNet thus learns on the contexts it creates."""
    A, B = system.alloc_variants, window.size(0)
    start = repeat(system.coarsest, "n -> b a n", b=B, a=A)
    horizon = tail_horizon(system.layout, B, window.device)
    explore = noise.explore[:, -A:]
    scorer = system.lensnet.scorer(system.layout, window, system.base)
    return refocus(scorer, tree, window, start, system.nodes, explore, horizon=horizon, noise=system.alloc_noise)


def prioritized(system: MegaContext, window: Int[Tensor, "b t1"], noise: VariantNoise) -> VariantNoise:
    """The random variants' noise, ``mc.voted_share`` of them expanding first the blocks ``match`` votes on: the text
    a copy in the tail would read, from the history up to the tail (I11), over the tail's ``H`` predictions
    (:func:`~mcfn.core.variants.voted_first`); the noise as drawn where the share is 0."""
    if not system.voted_share:  # a config constant: static under compile
        return noise
    layout, B = system.layout, window.size(0)
    votes = match_votes(window[:, : layout.T], tail_horizon(layout, B, window.device), layout.K, layout.H)
    return voted_first(noise, voted_nodes(votes, layout), system.voted_share)


# The stages of the step, in order. Each is a pure function of the system and tensors.


@stage("tree")
def tree_stage(system: MegaContext, window: Int[Tensor, "b t1"]) -> Tree:
    """Token embeddings and GistNet over every eligible block: the summary tree (its values only, without a
    gradient, when ``mc.gist.grad_blocks`` bounds it: :func:`tree_gradient_stage` adds that)."""
    if system.grad_blocks:  # a config constant: static under compile
        with torch.no_grad():
            return history_tree(system, window[:, : system.layout.T])
    return history_tree(system, window[:, : system.layout.T])


@stage("tree_grad")
def tree_gradient_stage(system: MegaContext, values: Tree, window: Tensor, shown: Tensor) -> Tree:
    """The tree with GistNet rerun under a gradient on ``mc.gist.grad_blocks`` blocks a level, the ones the
    working contexts ``shown [B, V, nodes]`` read first (:func:`mcfn.core.tree.with_sparse_gradient`)."""
    picks = gradient_blocks(shown.any(dim=1), system.layout, system.grad_blocks)
    tokens = system.base.embed(window[:, : system.layout.T])
    return with_sparse_gradient(system.gistnet, tokens, values, system.layout, picks)


def history_tree(system: MegaContext, tokens: Int[Tensor, "b t"]) -> Tree:
    """The summary tree over ``tokens`` (``t`` = the layout's ``T``)."""
    return build_tree(system.gistnet, system.base.embed(tokens), system.layout)


@stage("variants")
@typechecked
def variants_stage(
    system: MegaContext, tree: Tree, window: Int[Tensor, "b t1"], noise: VariantNoise
) -> Bool[Tensor, "b v nodes"]:
    """The baseline and the random compressed cuts (with priority sampling where ``mc.voted_share`` > 0), the last
    ``alloc_variants`` of them replaced by the allocator's."""
    shown = sample_variants(prioritized(system, window, noise), system.nodes)
    if not system.alloc_variants:
        return shown
    keep = system.layout.V - system.alloc_variants
    return torch.cat([shown[:, :keep], allocator_cuts(system, tree.detach(), window, noise)], dim=1)


@stage("assemble")
def assemble_stage(system: MegaContext, tree: Tree, shown: Tensor, window: Tensor) -> WorkingContext:
    return assemble(tree, shown, window, system.nodes)


@stage("base")
def base_stage(system: MegaContext, wc: WorkingContext) -> Float[Tensor, "r w d"]:
    """One packed base-model forward over every working context: final hidden states ``[B·V, W, D]``."""
    return system.base.hidden(wc.emb, wc.position, wc.span.float())


@stage("losses")
def loss_stage(system: MegaContext, hidden: Tensor, wc: WorkingContext) -> tuple[Tensor, Tensor, StepOutput]:
    """Per-entry NLL ``[B·V, W]``, tail NLL per variant ``[B, V]``, and ``loss_lm`` with the variant metrics."""
    nll = system.base.nll(hidden, wc.target)
    tails = tail_nll(nll, wc, system.layout)
    shares = StepOutput({}, loss_shares(nll, wc.valid, system.layout, system.alloc_variants), {})
    return nll, tails, variant_losses(nll, tails, wc, system.layout).merge(shares)


@stage("teacher")
def teacher_stage(
    system: MegaContext, window: Tensor, recency_nll: Tensor, weights: LossWeights
) -> tuple[StepOutput, Tensor | None]:
    """The full-window teacher's loss, and its attention target when LensNet learns from it."""
    target, reach = system.attention_target, system.teacher_window
    return teacher_losses(system.base, window, recency_nll, system.layout, weights, target, reach)


def horizon_queries(system: MegaContext, window: Tensor, horizon: Tensor, copies: int) -> Tensor | None:
    """The indexer's query of each window at its ``horizon`` (:func:`~mcfn.core.lensnet.horizon_query`), computed
    once and repeated for its ``copies`` contexts; ``None`` without the indexer."""
    if not system.lensnet.indexer:  # a config constant: static under compile
        return None
    query = horizon_query(system.base, window[:, : system.layout.T], horizon + 1)
    return repeat(query, "b d -> (b c) d", c=copies)


@stage("lens_fwd")
def lens_stage(system: MegaContext, wc: WorkingContext, horizon: Tensor, window: Tensor) -> Float[Tensor, "r w"]:
    """LensNet's scores of the working contexts, read as :func:`refocus` reads them: up to each window's horizon."""
    V, T = system.layout.V, system.layout.T
    tokens = repeat(window[:, :T], "b t -> (b v) t", v=V)
    seen = seen_until(wc, repeat(horizon, "b -> (b v)", v=V))
    return system.lensnet(seen, tokens=tokens, base=system.base, query=horizon_queries(system, window, horizon, V))


@stage("lens_loss")
def lens_loss_stage(
    system: MegaContext,
    scores: Tensor,
    shown: Tensor,
    tails: Tensor,
    wc: WorkingContext,
    weights: LossWeights,
    mass: Tensor | None,
) -> StepOutput:
    """The preference loss, and with the teacher's attention ``mass`` (``[B, nodes]``) the auxiliary attention
    target."""
    out = lens_losses(scores, shown, tails, wc, system.nodes, weights)
    if mass is None:
        return out
    near = system.attention_target.near
    return out.merge(attention_target_loss(scores, wc, mass, system.layout, weights.attention, near))


@stage("recon")
def recon_stage(system: MegaContext, tree: Tree, window: Tensor, weights: LossWeights) -> StepOutput:
    """``loss_recon`` (:mod:`mcfn.core.reconstruction`); the step calls it only when ``mc.gist.recon_weight`` > 0."""
    tokens = window[:, : system.layout.T]
    return reconstruction_loss(
        system.gist_decoder, system.base, tree, tokens, system.layout, weights.recon, RECON_TOKENS
    )


def build_contexts(system: MegaContext, window: Tensor, noise: VariantNoise) -> tuple[WorkingContext, Tensor, Tree]:
    """The working contexts of a batch, the shown-node masks ``[B, V, nodes]`` they come from, and the tree."""
    tree = tree_stage(system, window)
    shown = variants_stage(system, tree, window, noise)
    if system.grad_blocks:  # a config constant: static under compile
        tree = tree_gradient_stage(system, tree, window, shown)
    return assemble_stage(system, tree, shown, window), shown, tree


def language_model_terms(
    system: MegaContext, window: Tensor, wc: WorkingContext, weights: LossWeights
) -> tuple[Tensor, StepOutput, Tensor | None]:
    """The packed base forward's loss terms (``loss_lm`` over the whole tail), with the teacher's when it is on; the
    tail NLL ``[B, V]`` LensNet's preferences compare; and the teacher's attention target (mass per node
    ``[B, nodes]``) when LensNet learns from it."""
    hidden = base_stage(system, wc)
    nll, tails, out = loss_stage(system, hidden, wc)
    if not system.use_teacher:  # a config constant: static under compile
        return tails, out, None
    teacher, mass = teacher_stage(system, window, recency_tail_nll(nll, wc, system.layout), weights)
    return tails, out.merge(teacher), mass


def with_recon(system: MegaContext, out: StepOutput, tree: Tree, window: Tensor, weights: LossWeights) -> StepOutput:
    if not system.use_recon:  # a config constant: static under compile
        return out
    return out.merge(recon_stage(system, tree, window, weights))


def process_batch(system: MegaContext, window: Tensor, noise: VariantNoise, weights: LossWeights) -> StepOutput:
    """The MegaContext step: ``loss_lm`` (with the teacher's and reconstruction's terms where on) and, with a
    LensNet, ``loss_lens``, and all metrics, from one packed base forward."""
    wc, shown, tree = build_contexts(system, window, noise)
    tails, out, mass = language_model_terms(system, window, wc, weights)
    out = with_recon(system, out, tree, window, weights)
    if system.lensnet is None:  # a config constant: static under compile
        return out
    scores = lens_stage(system, wc, tail_horizon(system.layout, window.size(0), window.device), window)
    return out.merge(lens_loss_stage(system, scores, shown, tails, wc, weights, mass))


@torch.no_grad()
def validation_sums(
    system: MegaContext, window: Tensor, noise: VariantNoise, token_bytes: Tensor
) -> tuple[Float[Tensor, " v"], Tensor]:
    """Validation sums per variant slot: tail NLL ``[V]`` (nats, over byte-bearing targets) and tail bytes.

    Every variant is scored on the same tail targets (I4), so the byte count is the same for all of them.
    """
    layout = system.layout
    wc, _, _ = build_contexts(system, window, noise)
    nll = system.base.nll(base_stage(system, wc), wc.target)
    nats, nbytes = byte_sums(nll, wc.target, token_bytes, tail_mask(wc, layout))
    return nats.view(-1, layout.V).sum(0), nbytes.view(-1, layout.V)[:, 0].sum()
