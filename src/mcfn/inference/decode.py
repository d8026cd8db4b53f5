"""Incremental decoding for the base GPT: a fixed-capacity KV cache written by index.

:func:`extend` runs new entries (tokens or gists, with their positions and spans) through the model
against everything already cached, exactly as :meth:`GPT.hidden` would over the concatenation: each new
entry attends to every cached entry and causally to the new ones. It reads prompts and refocused contexts.

:func:`decode_token` appends one token with shapes that never change: it writes its keys and values at slot
``length`` (a tensor) and attends over the whole capacity with the unwritten slots masked out, so
:class:`TokenDecoder` can compile it once (``fullgraph=True``) for every token of a generation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.model import GPT, rms_norm, rotary_tables
from mcfn.typecheck import typechecked


class KVCache:
    """Rotated keys and values of every layer, ``[n_layer, 1, n_head, capacity, head_dim]``."""

    def __init__(self, model: GPT, capacity: int, device: torch.device, dtype: torch.dtype = torch.float32):
        cfg = model.cfg
        shape = (cfg.n_layer, 1, cfg.n_head, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity, self.length = capacity, 0


@typechecked
@torch.no_grad()
def extend(
    model: GPT,
    cache: KVCache,
    emb: Float[Tensor, "1 n d"],
    positions: Float[Tensor, "1 n"],
    spans: Float[Tensor, "1 n"],
) -> Float[Tensor, "1 n d"]:
    """Append ``n`` entries to the cache; returns their final hidden states (normed, as ``GPT.hidden``)."""
    n, start = emb.size(1), cache.length
    end = start + n
    if end > cache.capacity:
        raise ValueError(f"KV cache holds {cache.capacity} entries; {end} requested")
    cos, sin = rotary_tables(positions, spans, model.cfg.head_dim, model.cfg.rope_base)
    mask = torch.ones(n, end, dtype=torch.bool, device=emb.device).tril(diagonal=start)
    x = rms_norm(emb)
    for i, block in enumerate(model.blocks):
        q, k, v = block.attn.qkv(rms_norm(x), cos, sin)
        cache.k[i, :, :, start:end], cache.v[i, :, :, start:end] = k, v
        y = F.scaled_dot_product_attention(q, cache.k[i, :, :, :end], cache.v[i, :, :, :end], attn_mask=mask)
        x = x + block.attn.project(y)
        x = x + block.mlp(rms_norm(x))
    cache.length = end
    return rms_norm(x)


@typechecked
def decode_token(
    model: GPT,
    k_cache: Float[Tensor, "l 1 h c e"],
    v_cache: Float[Tensor, "l 1 h c e"],
    length: Int[Tensor, ""],
    emb: Float[Tensor, "1 1 d"],
    position: Float[Tensor, "1 1"],
) -> Float[Tensor, "1 1 d"]:
    """One token entry written at slot ``length`` of the caches (in place), attending to slots ``0..length``;
    returns its final hidden state. What :func:`extend` does for ``n = 1``, at a fixed shape."""
    cos, sin = rotary_tables(position, torch.ones_like(position), model.cfg.head_dim, model.cfg.rope_base)
    mask = (torch.arange(k_cache.size(3), device=emb.device) <= length)[None, :]  # [1, c]: written slots and this
    slot = length.view(1)
    x = rms_norm(emb)
    for i, block in enumerate(model.blocks):
        q, k, v = block.attn.qkv(rms_norm(x), cos, sin)
        k_cache[i].index_copy_(2, slot, k)
        v_cache[i].index_copy_(2, slot, v)
        y = F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=mask)
        x = x + block.attn.project(y)
        x = x + block.mlp(rms_norm(x))
    return rms_norm(x)


class TokenDecoder:
    """Appends decoded tokens to a :class:`KVCache` through :func:`decode_token`, compiled by ``compile_fn``
    when given (``mcfn.core.step.compile_step``): one graph for every length of every cache of one capacity."""

    def __init__(self, model: GPT, compile_fn: Callable[[Callable], Callable] | None = None):
        self.model = model
        self.step = decode_token if compile_fn is None else compile_fn(decode_token)

    @torch.no_grad()
    def __call__(self, cache: KVCache, emb: Tensor, position: Tensor) -> Tensor:
        if cache.length >= cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} entries; {cache.length + 1} requested")
        length = torch.tensor(cache.length, device=emb.device)
        hidden = self.step(self.model, cache.k, cache.v, length, emb, position)
        cache.length += 1
        return hidden
