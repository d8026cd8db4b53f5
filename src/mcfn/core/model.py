"""The base model: a nanochat-style GPT that reads either token ids or entry embeddings.

Pre-norm blocks with RMSNorm without weights, rotary attention with QK-norm and a learned per-head gain
through torch's fused scaled-dot-product attention, a ReLU² MLP, untied embedding and head, a logit soft-cap,
no biases and zero-initialised output projections (each block starts as the identity).

Every entry has a text position (the centre of its span in the history) and a span, and is rotated at its place in
the sequence read (:mod:`mcfn.core.positions`: the ``i``-th entry at ``i``, so a plain window's token at ``t`` gets
exactly the standard rotary embedding, and no working context reads a distance longer than itself). A gist's rotary
phases are damped by its span: the average of ``exp(i·θ·p)`` over ``span`` consecutive positions, in the Gaussian
approximation, is ``exp(i·θ·c) · exp(-θ²σ²/2)`` with ``σ² = (span² − 1)/12`` (the variance of a uniform pick among
``span`` consecutive positions), which is exactly 1 for a token. The text positions say which entries are adjacent
in the text, where the key smear applies (I13).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from mcfn.config import ModelConfig
from mcfn.core.positions import laid_positions
from mcfn.typecheck import typechecked

SOFTCAP = 15.0  # logits are squashed to (-15, 15): tanh soft-capping, as in nanochat
ROPE_BASE = 10000.0  # the rotary base of every transformer here
KEY_MIX_INIT, INDUCTION_GAIN = 2.0, 2.0  # smeared keys' induction prior: smear sigmoid(2) = 0.88, gains 2 (Block)


@typechecked
def rms_norm(x: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
    return F.rms_norm(x, (x.size(-1),))


@typechecked
def rotary_tables(
    positions: Float[Tensor, "#b n"], spans: Float[Tensor, "#b n"], head_dim: int, base: float
) -> tuple[Float[Tensor, "#b 1 n half"], Float[Tensor, "#b 1 n half"]]:
    """Damped rotary ``cos`` and ``sin`` per entry, shaped to broadcast over heads."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angle = positions.float()[..., None] * inv_freq  # [b n half]
    variance = (spans.float().square() - 1.0).clamp(min=0.0)[..., None] / 12.0
    damping = torch.exp(-0.5 * inv_freq.square() * variance)
    cos, sin = torch.cos(angle) * damping, torch.sin(angle) * damping
    return cos[:, None], sin[:, None]


@typechecked
def apply_rotary(
    x: Float[Tensor, "b h n e"], cos: Float[Tensor, "#b 1 n half"], sin: Float[Tensor, "#b 1 n half"]
) -> Float[Tensor, "b h n e"]:
    """Rotate the pairs ``(x[..., j], x[..., j + e/2])`` by the entry's phase (and scale by its damping)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
"""How a block turns its rotated queries, keys and values ``[b, h, n, e]`` into its heads' outputs ``[b, h, n, e]``:
the one strategy every transformer here takes (the GPT causally, GistNet :func:`bidirectional`, LensNet
:func:`~mcfn.core.units.newest_read`)."""

LayerAttention = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""The GPT's :data:`Attend` given the layer's index: causal SDPA in training; a KV cache's append, a fixed-shape
masked read or a tail read-out elsewhere (``inference.decode``, ``core.attention``)."""


def causal_attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Each entry attends to itself and the entries before it (the training forward)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def bidirectional(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Every entry attends to every entry, or with ``mask`` (``[b, 1, 1, n]``, True = read) to the valid ones:
    GistNet over a block's children (LensNet's units read :func:`mcfn.core.units.newest_read`)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Preceding(NamedTuple):
    """What comes before each of a chunk's entries in the sequence read, which the key smear reads (I13): its text
    position and span ``[#b, n]`` (span 0: nothing, as before a sequence's first entry), and ``keys(layer, k)``: given
    the chunk's raw rotated keys ``[b, h, n, e]`` at a layer, the raw rotated keys of those entries ``[b, h, n, e]``
    (:func:`in_sequence` within the chunk; a KV cache records the chunk's keys and reads its slots before each)."""

    position: Tensor
    span: Tensor
    keys: Callable[[int, Tensor], Tensor]


def shifted_keys(layer: int, k: Tensor) -> Tensor:
    """Each entry's previous entry's keys within ``k [b, h, n, e]`` (zeros before the first)."""
    return torch.cat([torch.zeros_like(k[:, :, :1]), k[:, :, :-1]], 2)


def in_sequence(positions: Tensor, spans: Tensor) -> Preceding:
    """What precedes each entry of a sequence read whole: the entry before it, nothing before the first."""
    position = torch.cat([positions[:, :1], positions[:, :-1]], 1)
    span = torch.cat([torch.zeros_like(spans[:, :1]), spans[:, :-1]], 1)
    return Preceding(position, span, shifted_keys)


@typechecked
def follows_its_token(
    positions: Float[Tensor, "#b n"], spans: Float[Tensor, "#b n"], preceding: Preceding
) -> Bool[Tensor, "#b n"]:
    """True where an entry and the entry before it are both raw tokens (span 1) adjacent in the text: the only
    entries whose keys the smear mixes (I13). A gist, a token after a gist and a token after left-out text get
    nothing, nor does a sequence's first entry (``preceding``'s span 0)."""
    return (spans == 1) & (preceding.span == 1) & (positions - preceding.position == 1)


class KeySmear(NamedTuple):
    """What one block's key smear reads: where it applies ``[#b, n]``, and the raw keys of the entries before the
    block's own ``[b, h, n, e]`` given them (:attr:`Preceding.keys` at the block's layer)."""

    adjacent: Tensor
    previous: Callable[[Tensor], Tensor]


class SelfAttention(nn.Module):
    """Multi-head attention's projections with QK-norm and (damped) rotary; how the heads attend is the caller's
    :data:`Attend`.

    ``gain`` ``[h]`` scales each head's queries. QK-norm alone caps a logit at ``sqrt(head_dim)`` (8 at head
    width 64), so no head could put more than e^8 / (e^8 + 511) of its weight on one key among 512 even when
    the two align exactly: too flat to copy a token from far back. Learning the gain lifts the cap: with it
    stdlib's pass key goes from 0.91 to 1.00 under full attention (LABLOG)."""

    def __init__(self, dim: int, n_head: int, key_smear: bool = False):
        super().__init__()
        self.n_head = n_head
        self.gain = nn.Parameter(torch.ones(n_head))
        # Smeared keys: each head's key mixes in the previous token's, weighted sigmoid(key_mix) (see reset_parameters).
        self.key_mix = nn.Parameter(torch.zeros(n_head)) if key_smear else None
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_k = nn.Linear(dim, dim, bias=False)
        self.c_v = nn.Linear(dim, dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[b, h, n, e]``, rotated (keys are what a KV cache stores)."""
        q, k, v = (rearrange(lin(x), "b n (h e) -> b h n e", h=self.n_head) for lin in (self.c_q, self.c_k, self.c_v))
        # QK-norm before the rotary, so a gist's span damping is not normalised away.
        # Indexing, not einops: einops on a Parameter registers a new backend type, a recompile guard.
        q = apply_rotary(rms_norm(q), cos, sin) * self.gain[:, None, None].to(q.dtype)
        return q, apply_rotary(rms_norm(k), cos, sin), v

    def smear_keys(self, k: Tensor, previous: Tensor, adjacent: Tensor) -> Tensor:
        """Rotated keys ``[b, h, n, e]`` with each head's previous-token key (``previous``, same shape) mixed in where
        ``adjacent`` ``[#b, n]`` (I13). The previous token's key is rotated at its own position, so the mix is causal
        and exact under a cache. This is the induction-heads study's smeared key: a head can then match "the token
        before this key" against its query in one layer, which an induction head otherwise needs a previous-token
        head below it for."""
        assert self.key_mix is not None, "a block without the key smear was given one"
        # Indexing, not einops (a Parameter through einops is a recompile guard, as for the gain).
        w = torch.sigmoid(self.key_mix)[:, None, None].to(k.dtype)
        return torch.where(adjacent[:, None, :, None], (1 - w) * k + w * previous.to(k.dtype), k)

    def project(self, y: Tensor) -> Tensor:
        return self.c_proj(rearrange(y, "b h n e -> b n (h e)"))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int, key_smear: bool = False):
        super().__init__()
        self.attn = SelfAttention(dim, n_head, key_smear)
        self.mlp = MLP(dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, smear: KeySmear | None = None) -> Tensor:
        """``attend`` maps the block's rotated ``q, k, v`` to its heads' outputs; ``smear`` (GPT blocks with
        ``model.key_smear``) mixes the previous token's key into each key first."""
        q, k, v = self.attn.qkv(rms_norm(x), cos, sin)
        if smear is not None:
            k = self.attn.smear_keys(k, smear.previous(k), smear.adjacent)
        x = x + self.attn.project(attend(q, k, v))
        return x + self.mlp(rms_norm(x))

    @torch.no_grad()
    def reset_parameters(self, induction_prior: bool = False) -> None:
        """Uniform inputs with std 1/sqrt(dim); zero output projections (each block starts as the identity); unit
        gains. ``induction_prior`` (smeared keys): heads start out favouring induction (LABLOG, twenty-first session).
        W_k = W_q (mimetic), so a query favours a key that mixes in its own token; the smear starts at 0.88, so that
        token is mostly the *previous* one (the query favours the position after its token's earlier occurrence);
        gains start at 2, since only the rotary's slow dimensions keep the match at a distance."""
        bound = math.sqrt(3.0) * self.attn.c_q.in_features**-0.5
        nn.init.ones_(self.attn.gain)
        for lin in (self.attn.c_q, self.attn.c_k, self.attn.c_v, self.mlp.c_fc):
            nn.init.uniform_(lin.weight, -bound, bound)
        nn.init.zeros_(self.attn.c_proj.weight)
        nn.init.zeros_(self.mlp.c_proj.weight)
        if self.attn.key_mix is not None:
            nn.init.constant_(self.attn.key_mix, KEY_MIX_INIT if induction_prior else 0.0)
        if induction_prior:
            self.attn.c_k.weight.copy_(self.attn.c_q.weight)
            nn.init.constant_(self.attn.gain, INDUCTION_GAIN)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set from the tokenizer")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg.n_embd, cfg.n_head, cfg.key_smear) for _ in range(cfg.n_layer))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            block.reset_parameters(induction_prior=self.cfg.key_smear)

    @typechecked
    def embed(self, tokens: Int[Tensor, "b n"]) -> Float[Tensor, "b n d"]:
        return self.wte(tokens)

    @typechecked
    def hidden(
        self,
        emb: Float[Tensor, "b n d"],
        positions: Float[Tensor, "#b n"],
        spans: Float[Tensor, "#b n"],
        attend: LayerAttention = causal_attention,
        preceding: Preceding | None = None,
        at: Int[Tensor, ""] | Int[Tensor, " n"] | int = 0,
    ) -> Float[Tensor, "b n d"]:
        """Final hidden states (normed) over entries with the given text positions and spans, each rotated at its
        place in the sequence read (:func:`~mcfn.core.positions.laid_positions`): after ``at`` entries (a KV cache's
        slots before them; 0: the sequence starts here), or at the places ``at [n]``. The one block loop: training,
        prefill, the token step, a refill and the attention read-out differ only in ``attend``. With the key smear,
        ``preceding`` says what comes before each entry (default: the entry before it, :func:`in_sequence`), so that
        a cache computes what one forward over everything computes."""
        places = laid_positions(at, emb.size(1), emb.device)
        cos, sin = rotary_tables(places, spans, self.cfg.head_dim, ROPE_BASE)
        adjacent = None
        if self.cfg.key_smear:
            preceding = in_sequence(positions, spans) if preceding is None else preceding
            adjacent = follows_its_token(positions, spans, preceding)
        x = rms_norm(emb)
        for layer, block in enumerate(self.blocks):
            smear = None if adjacent is None else KeySmear(adjacent, partial(preceding.keys, layer))
            x = block(x, cos, sin, attend=partial(attend, layer), smear=smear)
        return rms_norm(x)

    @typechecked
    def logits(self, h: Float[Tensor, "b n d"]) -> Float[Tensor, "b n v"]:
        return SOFTCAP * torch.tanh(self.lm_head(h).float() / SOFTCAP)

    @typechecked
    def token_hidden(self, tokens: Int[Tensor, "b n"]) -> Float[Tensor, "b n d"]:
        """Hidden states for plain token input: positions ``0..n-1``, span 1."""
        positions = torch.arange(tokens.size(1), device=tokens.device, dtype=torch.float32)[None]
        return self.hidden(self.embed(tokens), positions, torch.ones_like(positions))

    def forward(self, tokens: Tensor) -> Tensor:
        """``[b, n]`` token ids → ``[b, n, vocab]`` logits (fp32, soft-capped)."""
        return self.logits(self.token_hidden(tokens))

    @typechecked
    def nll(self, h: Float[Tensor, "b n d"], targets: Int[Tensor, "b n"]) -> Float[Tensor, "b n"]:
        """Per-entry next-token NLL in nats; 0 where ``targets < 0`` (no target)."""
        logits = self.logits(h)
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten().clamp(min=0), reduction="none")
        return torch.where(targets >= 0, nll.view_as(targets).float(), 0.0)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
