"""Incremental decoding for the base GPT: a fixed-capacity KV cache written by index, inside the graph.

:func:`write_and_attend` runs ``n`` entries (tokens or gists, with their positions and spans) through the model at
given slots of the cache, each rotated at its slot, exactly as :meth:`GPT.hidden` would over the cache's entries
with these in their slots: it writes their keys and values there and each entry attends over the whole capacity with
every slot after its own masked out, so whatever a cache holds past it is never read. The slots are a tensor and
the capacity is fixed, so one compiled graph serves every length of a cache; the writes are in place (inductor does
not copy the cache). :func:`moved` carries cached entries to new slots, their keys rotated by how far they moved:
a refocus keeps what the new context still holds and runs only the rest.

:class:`Decoder` drives one cache. Eagerly it runs exactly the entries given. Compiled, it has three graphs of fixed
shape: the token step (embedding, the model, the logits), the refill of a refocus in chunks of ``refill_chunk``
entries (the last chunk padded with its last entry again, so the cache needs no room beyond the context), and the
move. On a GPU each graph is captured once per cache as a CUDA graph and replayed: one token is then one launch, not
hundreds (BENCHMARKS.md: a token was launch-bound at about 7 ms on 12 layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from torch.utils._pytree import tree_map_only

from mcfn.core.model import GPT, ROPE_BASE, Preceding, apply_rotary, rotary_tables
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
    also each slot's raw keys (before the smear, same shape), position and span ``[1, capacity]``: an entry written
    at a slot smears the one in the slot before it (:func:`preceding_in_cache`); None without it."""

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
        smeared = cfg.key_smear  # what the key smear reads of the slot before an entry's; nothing without it
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


def write_slots(into: Tensor, layer: int, slots: Tensor, x: Tensor) -> None:
    """``x [1, h, n, e]`` written into one layer of a cache tensor ``[n_layer, 1, h, capacity, e]`` at ``slots [n]``."""
    # Indexed on the whole cache tensor: inductor writes a layer's view (cache[layer].index_copy_) by copying the
    # whole cache at every call (measured: 190 ms against 9 ms a token at 32k slots on the CPU).
    layer_at = torch.full((), layer, device=x.device)
    heads = torch.arange(into.size(2), device=x.device)[:, None]  # [h, 1]
    into.index_put_((layer_at, torch.zeros_like(layer_at), heads, slots[None]), x[0].to(into.dtype))


def preceding_in_cache(cache: CacheTensors, slots: Tensor) -> Preceding | None:
    """What precedes the entries written at ``slots [n]`` (with the key smear): the cache's entry at each slot less
    one, read after the chunk's own are written, so a chunk's entry reads its neighbour in the chunk or in the cache
    alike; before slot 0, nothing (span 0). None without the key smear."""
    raw_k, position, span = cache.raw_k, cache.position, cache.span
    if raw_k is None or position is None or span is None:
        return None
    before = (slots - 1).clamp(min=0)

    def keys(layer: int, k: Tensor) -> Tensor:
        write_slots(raw_k, layer, slots, k)
        return raw_k[layer].index_select(2, before).to(k.dtype)

    spans = torch.where(slots > 0, span.index_select(1, before), 0.0)
    return Preceding(position.index_select(1, before), spans, keys)


@typechecked
def write_and_attend(
    model: GPT,
    cache: CacheTensors,
    slots: Int[Tensor, " n"],
    emb: Float[Tensor, "1 n d"],
    positions: Float[Tensor, "1 n"],
    spans: Float[Tensor, "1 n"],
    reach: int | None = None,
) -> Float[Tensor, "1 n d"]:
    """Write ``n`` entries at ``slots`` (increasing; a slot given twice must be given the same entry) and return
    their final hidden states (normed, as ``GPT.hidden`` over the cache's entries with these in their slots): each
    entry is rotated at its slot and attends to every slot up to its own, so whatever a cache holds past it is never
    read. The caller keeps the slots within the capacity. Attention reads the first ``reach`` slots (default: all;
    eager callers pass the cache's length)."""
    reach = reach or cache.k.size(3)
    visible = torch.arange(reach, device=emb.device)[None] <= slots[:, None]  # [n, reach]

    def write_and_read(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        write_slots(cache.k, layer, slots, k)
        write_slots(cache.v, layer, slots, v)
        keys, values = cache.k[layer][:, :, :reach].to(q.dtype), cache.v[layer][:, :, :reach].to(q.dtype)
        if q.size(2) > 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        # One query: the scores written out compile to tighter CPU code than SDPA's masked path (measured).
        scores = torch.where(visible, (q @ keys.transpose(-1, -2)) * q.size(-1) ** -0.5, float("-inf"))
        return torch.softmax(scores, -1) @ values

    if cache.position is not None and cache.span is not None:
        cache.position.index_copy_(1, slots, positions)
        cache.span.index_copy_(1, slots, spans)
    return model.hidden(emb, positions, spans, write_and_read, preceding_in_cache(cache, slots), slots)


@typechecked
def token_logits(
    model: GPT,
    cache: CacheTensors,
    slot: Int[Tensor, " 1"],
    token: Int[Tensor, " 1"],
    position: Float[Tensor, "1 1"],
    reach: int | None = None,
) -> Float[Tensor, " vocab"]:
    """One token written at ``slot``: the logits of the token after it (attending over ``reach`` slots)."""
    ones = torch.ones_like(position)
    hidden = write_and_attend(model, cache, slot, model.embed(token[None]), position, ones, reach)
    return model.logits(hidden)[0, 0]


@typechecked
def moved(cache: CacheTensors, source: Int[Tensor, " capacity"], head_dim: int) -> CacheTensors:
    """The cache's entries at new slots: slot ``j`` holds what slot ``source[j]`` held (``-1``: nothing kept, the slot
    keeps what it has, to be written), its keys rotated on by ``j - source[j]`` places (a rotation by the difference
    composes with the one they were written with, span damping included) and its values as they were. What a kept
    entry's keys and values read at the layers above the first stays the context it was written in."""
    capacity = source.size(0)
    kept, at = source >= 0, source.clamp(min=0)
    shift = (torch.arange(capacity, device=source.device) - at).float()[None]
    cos, sin = rotary_tables(shift, torch.ones_like(shift), head_dim, ROPE_BASE)

    def rotated(keys: Tensor | None) -> Tensor | None:
        if keys is None:
            return None
        taken = keys.index_select(3, at)  # [n_layer, 1, h, capacity, e]
        return torch.where(kept[:, None], apply_rotary(taken.flatten(0, 1), cos, sin).view_as(taken), keys)

    def taken(row: Tensor | None) -> Tensor | None:
        return None if row is None else torch.where(kept, row.index_select(1, at), row)

    values = torch.where(kept[:, None], cache.v.index_select(3, at), cache.v)
    return CacheTensors(rotated(cache.k), values, rotated(cache.raw_k), taken(cache.position), taken(cache.span))


class Replay:
    """``fn()`` over input tensors that the caller fills in place before each call. On a GPU the first call captures
    it as a CUDA graph (after two warm-up calls on a side stream, which compile it) and every call replays that
    graph; elsewhere each call runs it. Each call returns a copy of the output (its tensors): the graph's own is
    overwritten by the next replay. ``fn`` must be idempotent in its inputs: the warm-up and the capture run it on
    the first call's. ``first_s``: the first call's seconds (compilation and capture included)."""

    def __init__(self, fn: Callable[[], Any], device: torch.device):
        self.fn, self.graphed = fn, device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Any = None
        self.first_s: float | None = None

    def __call__(self) -> Any:
        if self.first_s is None:
            t0 = time.perf_counter()
            out = self.run()
            self.first_s = time.perf_counter() - t0
            return out
        return self.run()

    def run(self) -> Any:
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
        return tree_map_only(Tensor, torch.clone, self.output)


class Decoder:
    """Decoding against one :class:`KVCache`: :meth:`move` (a refocus's kept entries to their new slots),
    :meth:`refill` (the entries it runs) and :meth:`token` (one decoded token). ``compile_fn``
    (``mcfn.core.step.compile_step``) compiles the three into fixed shapes, one graph each for every length of every
    cache of one capacity, replayed as CUDA graphs on a GPU (:class:`Replay`), the refill in chunks of
    ``refill_chunk`` entries (at most the cache's capacity; by default :data:`REFILL_CHUNK` or the capacity where
    smaller); without it they run eagerly, the refill over exactly the entries given."""

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
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)
        self.token_in = torch.zeros(1, dtype=torch.int64, device=device)
        self.position_in = torch.zeros(1, 1, device=device)
        self.chunk = (torch.zeros(c, dtype=torch.int64, device=device), torch.zeros(1, c, d, device=device),
                      torch.zeros(1, c, device=device), torch.ones(1, c, device=device))  # fmt: skip
        self.source = torch.full((cache.capacity,), -1, dtype=torch.int64, device=device)
        self.token_graph: Replay | None = None
        self.refill_graph: Replay | None = None
        self.move_graph: Replay | None = None
        if compile_fn is not None:
            step, refill, move = compile_fn(token_logits), compile_fn(write_and_attend), compile_fn(moved)
            tensors = cache.tensors
            self.token_graph = Replay(partial(step, model, tensors, self.slot, self.token_in, self.position_in), device)
            self.refill_graph = Replay(partial(refill, model, tensors, *self.chunk), device)
            self.move_graph = Replay(partial(move, tensors, self.source, model.cfg.head_dim), device)

    @property
    def compile_s(self) -> float:
        """The compiled graphs' first calls, compilation and capture included (0 eagerly)."""
        graphs = (self.token_graph, self.refill_graph, self.move_graph)
        return sum(g.first_s or 0.0 for g in graphs if g is not None)

    @torch.no_grad()
    def move(self, source: Int[Tensor, " m"]) -> None:
        """Keep cached entries at new slots: slot ``j < m`` takes the entry at slot ``source[j]`` (``-1``: none, a slot
        the refill writes), its keys rotated to its new place (:func:`moved`)."""
        self.source.fill_(-1)
        self.source[: source.size(0)] = source
        tensors = self.cache.tensors
        new = moved(tensors, self.source, self.model.cfg.head_dim) if self.move_graph is None else self.move_graph()
        for into, taken in zip(tensors, new, strict=True):
            if into is not None:
                into.copy_(taken)

    @torch.no_grad()
    def refill(
        self,
        emb: Float[Tensor, "1 m d"],
        positions: Float[Tensor, "1 m"],
        spans: Float[Tensor, "1 m"],
        slots: Int[Tensor, " r"],
    ) -> Float[Tensor, "1 1 d"]:
        """Bring the cache, whose slots hold the context ``[1, m]`` given (its inputs: embeddings, positions, spans)
        but at ``slots`` (increasing, ending at the last entry ``m - 1``), to the whole context: the entries at
        ``slots`` run through the model, reading what the other slots hold. The last entry's hidden state: the one
        the next token reads."""
        cache, m = self.cache, emb.size(1)
        if slots.numel() == 0 or int(slots[-1]) != m - 1:
            raise ValueError(f"a refill runs the context's last entry {m - 1} at least; it was given {slots.tolist()}")
        if m > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} entries; {m} requested")
        cache.length = m
        if self.refill_graph is None:
            return write_and_attend(self.model, cache.tensors, slots, emb[:, slots], positions[:, slots],
                                    spans[:, slots], m)[:, -1:]  # fmt: skip
        slots_in, emb_in, positions_in, spans_in = self.chunk
        c = slots_in.size(0)
        for lo in range(0, slots.numel(), c):
            # The last chunk is padded with its last entry again: it writes what it writes, and reads nothing new.
            at = slots[lo : lo + c]
            at = torch.cat([at, at[-1:].expand(c - at.numel())])
            slots_in.copy_(at)
            emb_in.copy_(emb[:, at])
            positions_in.copy_(positions[:, at])
            spans_in.copy_(spans[:, at])
            hidden = self.refill_graph()
        return hidden[:, -1:]

    @torch.no_grad()
    def token(self, token: Int[Tensor, " 1"], position: int) -> Float[Tensor, " vocab"]:
        """Write one decoded token at slot ``length`` (its position in the text: ``position``); the logits of the
        token after it."""
        cache = self.cache
        end = cache.end_after(1)
        self.slot.fill_(cache.length)
        self.token_in.copy_(token)
        self.position_in.fill_(float(position))
        if self.token_graph is None:
            logits = token_logits(self.model, cache.tensors, self.slot, self.token_in, self.position_in, end)
        else:
            logits = self.token_graph()
        cache.length = end
        return logits


@torch.no_grad()
def extend(model: GPT, cache: KVCache, emb: Tensor, positions: Tensor, spans: Tensor) -> Tensor:
    """Eagerly append ``n`` entries ``[1, n, D]`` to ``cache``, attending over the slots up to the new length alone;
    their hidden states ``[1, n, D]`` (a prompt's prefill, an eager refill)."""
    end = cache.end_after(emb.size(1))
    slots = torch.arange(cache.length, end, device=emb.device)
    hidden = write_and_attend(model, cache.tensors, slots, emb, positions, spans, end)
    cache.length = end
    return hidden
