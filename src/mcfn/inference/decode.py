"""Incremental decoding for the base GPT: a fixed-capacity KV cache written by index.

:func:`extend` runs new entries (tokens or gists, with their positions and spans) through the model
against everything already cached, exactly as :meth:`GPT.hidden` would over the concatenation: each new
entry attends to every cached entry and causally to the new ones. Decoding is eager (one token at a time,
growing lengths), so nothing here is compiled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
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
