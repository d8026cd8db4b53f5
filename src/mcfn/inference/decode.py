"""Incremental decoding for the base GPT: a fixed-capacity KV cache written by index, inside the graph.

:func:`write_and_attend` runs ``n`` new entries (tokens or gists, with their positions and spans) through the model
after the ``start`` cached ones, exactly as :meth:`GPT.hidden` would over the concatenation: it writes their keys
and values at slots ``start..start+n`` and each new entry attends over the whole capacity with every slot after
its own masked out, so stale slots past ``start`` are never read. The start is a tensor and the capacity is fixed,
so one compiled graph serves every length of a cache; the writes are in place (inductor does not copy the cache).

:class:`Decoder` drives one cache. Eagerly it extends by exactly the entries given. Compiled, it has two graphs of
fixed shape: the token step (embedding, the model, the logits) and the refill of a refocus in chunks of
``refill_chunk`` entries. The last chunk ends at the context's last entry, recomputing a few entries before the
ones that changed instead of padding past the end, so the cache needs no room beyond the context (a context shorter
than one chunk is padded, within a capacity of at least one chunk). On a GPU each graph is captured once per cache
as a CUDA graph and replayed: one token is then one launch, not hundreds (BENCHMARKS.md: a token was launch-bound at
about 7 ms on 12 layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.model import GPT, Entry
from mcfn.core.step import compile_step
from mcfn.typecheck import typechecked

REFILL_CHUNK = 64  # entries a compiled refill runs at once by default: what changed is recomputed in n / 64 calls
# Decoding's graphs compile without inductor's own CUDA graphs: Replay captures them, and captures do not nest.
WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def decoding_compiler(mode: str) -> Callable[[Callable], Callable]:
    """``compile_step`` in the run's compile ``mode``, less its CUDA graphs (:data:`WITHOUT_CUDA_GRAPHS`)."""
    return partial(compile_step, mode=WITHOUT_CUDA_GRAPHS.get(mode, mode))


class CacheTensors(NamedTuple):
    """Rotated keys and values of every layer ``[n_layer, 1, n_head, capacity, head_dim]``. With the key smear (I13)
    also each slot's raw keys (before the smear, same shape), position and span ``[1, capacity]``: the newest kept
    slot is the entry a new chunk's first entry smears (``GPT.hidden``'s ``before``); None without it."""

    k: Tensor
    v: Tensor
    raw_k: Tensor | None
    position: Tensor | None
    span: Tensor | None


class KVCache:
    """A cache's tensors and how many of its slots hold the current context (``length``, on the host)."""

    def __init__(self, model: GPT, capacity: int, device: torch.device, dtype: torch.dtype = torch.float32):
        cfg = model.cfg
        shape = (cfg.n_layer, 1, cfg.n_head, capacity, cfg.head_dim)
        smeared = cfg.key_smear  # what the key smear reads of the newest kept entry; nothing without it
        self.tensors = CacheTensors(
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype) if smeared else None,
            torch.zeros(1, capacity, device=device) if smeared else None,
            torch.zeros(1, capacity, device=device) if smeared else None,
        )
        self.capacity, self.length = capacity, 0

    def end_after(self, n: int) -> int:
        """The length once ``n`` more entries are written; a cache without room for them refuses."""
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} entries; {end} requested")
        return end


def newest_kept(cache: CacheTensors, start: Tensor) -> Entry | None:
    """The entry at slot ``start - 1``, which a chunk written from ``start`` follows (with the key smear). At
    ``start = 0`` its span reads 0: nothing precedes the chunk, so its first entry smears nothing."""
    if cache.raw_k is None or cache.position is None or cache.span is None:
        return None
    at = (start - 1).clamp(min=0).reshape(1)
    span = torch.where(start > 0, cache.span.index_select(1, at), 0.0)
    return Entry(cache.position.index_select(1, at), span, cache.raw_k.index_select(3, at))


@typechecked
def write_and_attend(
    model: GPT,
    cache: CacheTensors,
    start: Int[Tensor, ""],
    emb: Float[Tensor, "1 n d"],
    positions: Float[Tensor, "1 n"],
    spans: Float[Tensor, "1 n"],
    reach: int | None = None,
) -> Float[Tensor, "1 n d"]:
    """Write ``n`` entries at slots ``start..start+n`` and return their final hidden states (normed, as
    ``GPT.hidden`` over the cached entries and these). The caller keeps ``start + n`` within the capacity.
    Attention reads the first ``reach`` slots (default: all; eager callers pass ``start + n``)."""
    reach = reach or cache.k.size(3)
    slots = start + torch.arange(emb.size(1), device=emb.device)  # [n]
    visible = torch.arange(reach, device=emb.device)[None] <= slots[:, None]  # [n, reach]

    heads = torch.arange(cache.k.size(2), device=emb.device)[:, None]  # [h, 1]

    def write(into: Tensor, layer: int, x: Tensor) -> None:  # x: [1, h, n, e] at slots [n] of one layer
        # Indexed on the whole cache tensor: inductor writes a layer's view (cache[layer].index_copy_) by copying
        # the whole cache at every call (measured: 190 ms against 9 ms a token at 32k slots on the CPU).
        layer_at = torch.full((), layer, device=x.device)
        into.index_put_((layer_at, torch.zeros_like(layer_at), heads, slots[None]), x[0].to(into.dtype))

    def write_and_read(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        write(cache.k, layer, k)
        write(cache.v, layer, v)
        keys, values = cache.k[layer][:, :, :reach].to(q.dtype), cache.v[layer][:, :, :reach].to(q.dtype)
        if q.size(2) > 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        # One query: the scores written out compile to tighter CPU code than SDPA's masked path (measured).
        scores = torch.where(visible, (q @ keys.transpose(-1, -2)) * q.size(-1) ** -0.5, float("-inf"))
        return torch.softmax(scores, -1) @ values

    def keep_raw(layer: int, raw: Tensor) -> None:
        assert cache.raw_k is not None
        write(cache.raw_k, layer, raw)

    before = newest_kept(cache, start)
    hidden = model.hidden(
        emb, positions, spans, write_and_read, before, keep_raw if before is not None else None, start
    )
    if cache.position is not None and cache.span is not None:
        cache.position.index_copy_(1, slots, positions)
        cache.span.index_copy_(1, slots, spans)
    return hidden


@typechecked
def token_logits(
    model: GPT,
    cache: CacheTensors,
    start: Int[Tensor, ""],
    token: Int[Tensor, " 1"],
    position: Float[Tensor, "1 1"],
    reach: int | None = None,
) -> Float[Tensor, " vocab"]:
    """One token written at slot ``start``: the logits of the token after it (attending over ``reach`` slots)."""
    ones = torch.ones_like(position)
    hidden = write_and_attend(model, cache, start, model.embed(token[None]), position, ones, reach)
    return model.logits(hidden)[0, 0]


class Replay:
    """``fn()`` over input tensors that the caller fills in place before each call. On a GPU the first call captures
    it as a CUDA graph (after two warm-up calls on a side stream, which compile it) and every call replays that
    graph; elsewhere each call runs it. Each call returns a copy of the output: the graph's own is overwritten by the
    next replay. ``fn`` must be idempotent in its inputs: the warm-up and the capture run it on the first call's.
    ``first_s``: the first call's seconds (compilation and capture included)."""

    def __init__(self, fn: Callable[[], Tensor], device: torch.device):
        self.fn, self.graphed = fn, device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None
        self.first_s: float | None = None

    def __call__(self) -> Tensor:
        if self.first_s is None:
            t0 = time.perf_counter()
            out = self.run()
            self.first_s = time.perf_counter() - t0
            return out
        return self.run()

    def run(self) -> Tensor:
        if not self.graphed:
            return self.fn()
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.output = self.fn()
        self.graph.replay()
        assert self.output is not None
        return self.output.clone()


class Decoder:
    """Decoding against one :class:`KVCache`: :meth:`refill` (a refocus's changed entries) and :meth:`token` (one
    decoded token). ``compile_fn`` (``mcfn.core.step.compile_step``) compiles both into fixed shapes, one graph
    each for every length of every cache of one capacity, replayed as CUDA graphs on a GPU (:class:`Replay`), the
    refill in chunks of ``refill_chunk`` entries (at most the cache's capacity; by default :data:`REFILL_CHUNK` or
    the capacity where smaller); without it they run eagerly, the refill over exactly the entries that changed."""

    def __init__(
        self,
        model: GPT,
        cache: KVCache,
        compile_fn: Callable[[Callable], Callable] | None = None,
        refill_chunk: int | None = None,
    ):
        refill_chunk = min(REFILL_CHUNK, cache.capacity) if refill_chunk is None else refill_chunk
        if not 1 <= refill_chunk <= cache.capacity:
            raise ValueError(f"a refill chunk of {refill_chunk} entries does not fit a cache of {cache.capacity}")
        self.model, self.cache = model, cache
        device, d, c = cache.tensors.k.device, model.cfg.n_embd, refill_chunk
        # The compiled graphs' inputs, filled in place before each call.
        self.start = torch.zeros((), dtype=torch.int64, device=device)
        self.token_in = torch.zeros(1, dtype=torch.int64, device=device)
        self.position_in = torch.zeros(1, 1, device=device)
        self.chunk = (torch.zeros(1, c, d, device=device), torch.zeros(1, c, device=device),
                      torch.ones(1, c, device=device))  # fmt: skip
        self.token_graph: Replay | None = None
        self.refill_graph: Replay | None = None
        if compile_fn is not None:
            step, refill = compile_fn(token_logits), compile_fn(write_and_attend)
            inputs = (model, cache.tensors, self.start)
            self.token_graph = Replay(partial(step, *inputs, self.token_in, self.position_in), device)
            self.refill_graph = Replay(partial(refill, *inputs, *self.chunk), device)

    @property
    def compile_s(self) -> float:
        """The compiled graphs' first calls, compilation and capture included (0 eagerly)."""
        return sum(g.first_s or 0.0 for g in (self.token_graph, self.refill_graph) if g is not None)

    @torch.no_grad()
    def refill(
        self, emb: Float[Tensor, "1 m d"], positions: Float[Tensor, "1 m"], spans: Float[Tensor, "1 m"], keep: int
    ) -> Float[Tensor, "1 r d"]:
        """Bring the cache, whose first ``keep`` slots hold the first entries of the context ``[1, m]`` given (its
        inputs: embeddings, positions, spans), to the whole context: entries ``keep..m`` run through the model.
        Hidden states whose last is the context's last entry's (``r = m - keep`` eagerly, 1 compiled: the one the
        next token reads)."""
        cache, m = self.cache, emb.size(1)
        if not 0 <= keep < m:
            raise ValueError(f"a refill keeps fewer than the context's {m} entries; {keep} asked")
        cache.length = keep
        if self.refill_graph is None:
            return extend(self.model, cache, emb[:, keep:], positions[:, keep:], spans[:, keep:])
        cache.end_after(m - keep)
        emb_in, positions_in, spans_in = self.chunk
        c = emb_in.size(1)
        for lo in range(keep, m, c):
            # The last chunk ends at entry m - 1: its first entries were written already (or kept), and writing them
            # again writes what is there, where padding would need room past the context.
            first = max(0, min(lo, m - c))
            n = min(c, m - first)
            self.start.fill_(first)
            at = slice(first, first + n)
            emb_in[:, :n], positions_in[:, :n], spans_in[:, :n] = emb[:, at], positions[:, at], spans[:, at]
            hidden = self.refill_graph()
        cache.length = m
        return hidden[:, n - 1 : n]

    @torch.no_grad()
    def token(self, token: Int[Tensor, " 1"], position: int) -> Float[Tensor, " vocab"]:
        """Write one decoded token at slot ``length`` (its position in the text: ``position``); the logits of the
        token after it."""
        cache = self.cache
        end = cache.end_after(1)
        self.start.fill_(cache.length)
        self.token_in.copy_(token)
        self.position_in.fill_(float(position))
        if self.token_graph is None:
            logits = token_logits(self.model, cache.tensors, self.start, self.token_in, self.position_in, end)
        else:
            logits = self.token_graph()
        cache.length = end
        return logits


@torch.no_grad()
def extend(model: GPT, cache: KVCache, emb: Tensor, positions: Tensor, spans: Tensor) -> Tensor:
    """Eagerly append ``n`` entries ``[1, n, D]`` to ``cache``, attending over the slots up to the new length alone;
    their hidden states ``[1, n, D]`` (a prompt's prefill, an eager refill)."""
    end = cache.end_after(emb.size(1))
    start = torch.tensor(cache.length, device=emb.device)
    hidden = write_and_attend(model, cache.tensors, start, emb, positions, spans, end)
    cache.length = end
    return hidden
