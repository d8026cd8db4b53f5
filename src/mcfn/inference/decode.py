"""Incremental decoding for the base GPT: a fixed-capacity KV cache written by index.

:func:`extend` runs new entries (tokens or gists, with their positions and spans) through the model
against everything already cached, exactly as :meth:`GPT.hidden` would over the concatenation: each new
entry attends to every cached entry and causally to the new ones. It reads prompts and refocused contexts.

:func:`decode_token` runs one new token with shapes that never change: it attends over the whole capacity
with the slots from ``length`` (a tensor) on masked out, and returns the token's keys and values, which
:class:`TokenDecoder` writes into the cache outside the graph. So the step compiles once (``fullgraph=True``)
for every token of a generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.model import GPT, Entry
from mcfn.typecheck import typechecked


class KVCache:
    """Rotated keys and values of every layer, ``[n_layer, 1, n_head, capacity, head_dim]``. With the key smear
    (I13) also each slot's raw keys (before the smear, same shape), position and span ``[1, capacity]``: the newest
    kept slot is the entry a new chunk's first entry smears (``GPT.hidden``'s ``before``)."""

    def __init__(self, model: GPT, capacity: int, device: torch.device, dtype: torch.dtype = torch.float32):
        cfg = model.cfg
        shape = (cfg.n_layer, 1, cfg.n_head, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # What the key smear reads of the newest kept entry; nothing without it.
        smeared = cfg.key_smear
        self.raw_k = torch.zeros(shape, device=device, dtype=dtype) if smeared else None
        self.position = torch.zeros(1, capacity, device=device) if smeared else None
        self.span = torch.zeros(1, capacity, device=device) if smeared else None
        self.capacity, self.length = capacity, 0

    def last(self) -> Entry | None:
        """The newest kept entry, copied (the next write may reuse its slot); None in an empty cache or without
        the key smear."""
        if self.raw_k is None or self.length == 0:
            return None
        at = slice(self.length - 1, self.length)
        return Entry(self.position[:, at].clone(), self.span[:, at].clone(), self.raw_k[:, :, :, at].clone())

    def write_entries(self, positions: Tensor, spans: Tensor) -> None:
        """Record the positions and spans ``[1, n]`` of the entries written from slot ``length`` on (with the key
        smear; without it nothing reads them)."""
        if self.position is None:
            return
        at = slice(self.length, self.length + positions.size(1))
        self.position[:, at], self.span[:, at] = positions, spans

    def end_after(self, n: int) -> int:
        """The length once ``n`` more entries are written; a cache without room for them refuses."""
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} entries; {end} requested")
        return end


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
    n, start, end = emb.size(1), cache.length, cache.end_after(emb.size(1))
    mask = torch.ones(n, end, dtype=torch.bool, device=emb.device).tril(diagonal=start)

    def append_and_attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.k[layer, :, :, start:end], cache.v[layer, :, :, start:end] = k, v
        return F.scaled_dot_product_attention(q, cache.k[layer, :, :, :end], cache.v[layer, :, :, :end], attn_mask=mask)

    def keep_raw(layer: int, raw: Tensor) -> None:
        cache.raw_k[layer, :, :, start:end] = raw

    hidden = model.hidden(emb, positions, spans, attend=append_and_attend, before=cache.last(), record_keys=keep_raw)
    cache.write_entries(positions, spans)
    cache.length = end
    return hidden


@typechecked
def decode_token(
    model: GPT,
    k_cache: Float[Tensor, "l 1 h c e"],
    v_cache: Float[Tensor, "l 1 h c e"],
    length: Int[Tensor, ""],
    emb: Float[Tensor, "1 1 d"],
    position: Float[Tensor, "1 1"],
    before: Entry | None,
) -> tuple[Float[Tensor, "1 1 d"], Float[Tensor, "l 1 h 1 e"], Float[Tensor, "l 1 h 1 e"], Tensor | None]:
    """One token entry after the ``length`` cached ones, the newest of which is ``before`` (with the key smear):
    its final hidden state, and its keys, values and raw keys (None without the smear) per layer for the caller to
    write at slot ``length``. The caches are only read (slots ``>= length`` masked),
    and the token's own key joins the softmax beside them: a graph that mutated the caches would copy them
    whole at every token, and CUDA graphs would skip it."""
    written = torch.arange(k_cache.size(3), device=emb.device) < length  # [c]
    scale = model.cfg.head_dim**-0.5
    keys, values, raw = [], [], []

    def read_masked(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q, k, v: [1, h, 1, e]
        cached = torch.where(written, (q @ k_cache[layer].transpose(-1, -2)) * scale, float("-inf"))  # [1, h, 1, c]
        weights = torch.softmax(torch.cat([cached, (q * k).sum(-1, keepdim=True) * scale], -1), -1)
        keys.append(k)
        values.append(v)
        return weights[..., :-1] @ v_cache[layer] + weights[..., -1:] * v

    hidden = model.hidden(emb, position, torch.ones_like(position), read_masked, before, lambda _, k: raw.append(k))
    return hidden, torch.stack(keys), torch.stack(values), torch.stack(raw) if raw else None


class TokenDecoder:
    """Appends decoded tokens to a :class:`KVCache` through :func:`decode_token`, compiled by ``compile_fn``
    when given (``mcfn.core.step.compile_step``): one graph for every length of every cache of one capacity."""

    def __init__(self, model: GPT, compile_fn: Callable[[Callable], Callable] | None = None):
        self.model, self.compiled = model, compile_fn is not None
        self.step = decode_token if compile_fn is None else compile_fn(decode_token)
        self.compile_s = 0.0  # the compiled step's first call, compilation included

    @torch.no_grad()
    def __call__(self, cache: KVCache, emb: Tensor, position: Tensor) -> Tensor:
        end = cache.end_after(1)
        length = torch.tensor(cache.length, device=emb.device)
        first = self.compiled and not self.compile_s
        t0 = time.perf_counter()
        hidden, k, v, raw = self.step(self.model, cache.k, cache.v, length, emb, position, cache.last())
        if first:
            self.compile_s = time.perf_counter() - t0
        cache.k[:, :, :, cache.length], cache.v[:, :, :, cache.length] = k[:, :, :, 0], v[:, :, :, 0]
        if raw is not None:
            cache.raw_k[:, :, :, cache.length] = raw[:, :, :, 0]
        cache.write_entries(position, torch.ones_like(position))
        cache.length = end
        return hidden
