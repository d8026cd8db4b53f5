"""Where a decoded token's context comes from: the two sources the one decode loop
(:func:`mcfn.inference.generation.decode`) reads.

* :class:`MCContexts`: MegaContext. The prompt streams into a :class:`~mcfn.inference.streaming.StreamingTree`;
  whenever its refocus rule says (:mod:`mcfn.core.cadence`: every ``R`` tokens, or when a copy starts and at the
  latest every ``R``) the focus policy's refocus (a scored policy's as one fixed-shape graph,
  :class:`~mcfn.inference.choice.FocusChoice`, which makes the evaluation's cut; truncation's by
  :func:`~mcfn.inference.streaming.focused_context`) rebuilds the working context within ``W - R`` entries, and the
  cache keeps what :func:`kept_slots` says (by default every entry the new context still holds, moved to its new slot):
  only the rest runs through the model again (:func:`refill`). Decoded tokens join the tree
  at the next refocus.
* :class:`FullContexts`: every token at LOD0 with a KV cache over the whole text, read once (the prompt, in chunks of
  :data:`PREFILL_CHUNK`): per-token cost grows with the text's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mcfn.core.cadence import RefocusWatch
from mcfn.core.context import WorkingContext
from mcfn.core.focus import Refocus
from mcfn.core.model import GPT
from mcfn.core.policy import FocusPolicy
from mcfn.core.stream_view import refocus_budget
from mcfn.core.system import MegaContext
from mcfn.inference.choice import FocusChoice
from mcfn.inference.decode import REFILL_CHUNK, Decoder, KVCache, extend
from mcfn.inference.render import lod_string
from mcfn.inference.streaming import StreamingTree, focused_context
from mcfn.typecheck import typechecked

PREFILL_CHUNK = 1024  # full context reads long prompts in chunks, so attention never builds an n × n mask
PREFIX, MOVED = "prefix", "moved"  # what a refocus keeps of the cache (kept_slots)
REUSE = (PREFIX, MOVED)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0  # reading the prompt: tree and cache (mc), or the cache (full)
    decode_s: float = 0.0  # every new token, refocuses included
    refocus_s: float = 0.0  # of decode_s: rebuilding the working context and its cache
    focus_s: float = 0.0  # of refocus_s: choosing the cut (scoring and the allocator; mc)
    compile_s: float = 0.0  # of decode_s: the compiled graphs' first calls (compilation and capture included)
    reused_entries: int = 0  # context entries whose cached keys and values a refocus kept (mc)
    recomputed_entries: int = 0  # context entries a refocus ran through the model (mc)
    layouts: list[str] = field(default_factory=list)  # the LOD layout at each refocus (mc)

    @property
    def cache_kept(self) -> float:
        """The share of context entries whose cached keys and values refocuses kept (mc; 0 when none ran)."""
        return self.reused_entries / max(1, self.reused_entries + self.recomputed_entries)

    @property
    def refocuses_per_token(self) -> float:
        """Refocuses per new token (mc; 0 when none ran): the decode cost a refocus rule buys."""
        return len(self.layouts) / max(1, self.new_tokens)

    @property
    def refocus_ms(self) -> float:
        """Milliseconds a refocus took on average, choosing the context and refilling the cache (mc)."""
        return 1e3 * self.refocus_s / max(1, len(self.layouts))

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding, compilation excluded."""
        seconds = self.decode_s - self.compile_s
        return self.new_tokens / seconds if seconds > 0 else float("nan")


def settled(device: torch.device) -> float:
    """``perf_counter`` once the device's queued work is done: on a GPU the token graphs replay asynchronously, and
    a host clock alone times their launches, not their work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def token_entry(base: GPT, token: Tensor, position: int) -> tuple[Tensor, Tensor, Tensor]:
    """A decoded ``[1]`` token as one LOD0 entry: embedding ``[1, 1, D]``, position and span ``[1, 1]``."""
    pos = torch.full((1, 1), float(position), device=token.device)
    return base.embed(token[None]), pos, torch.ones_like(pos)


@typechecked
def shared_prefix(cached: Int[Tensor, "n 2"], entries: Int[Tensor, "m 2"]) -> int:
    """How many leading rows of two ``[n, 2]`` (start, LOD) lists agree: the cache entries a refocus keeps."""
    n = min(cached.size(0), entries.size(0))
    differ = (cached[:n] != entries[:n]).any(-1)
    return int(differ.int().argmax()) if bool(differ.any()) else n


@typechecked
def after_its_token(entries: Int[Tensor, "m 2"]) -> Bool[Tensor, " m"]:
    """Where an entry ``(start, LOD)`` is a raw token right after the raw token before it in the text: the entries
    whose keys the smear mixes (I13, :func:`mcfn.core.model.follows_its_token`)."""
    start, token = entries[:, 0], entries[:, 1] == 0
    follows = F.pad((start[1:] == start[:-1] + 1) & token[:-1], (1, 0))
    return token & follows


@typechecked
def kept_slots(cached: Int[Tensor, "n 2"], entries: Int[Tensor, "m 2"], reuse: str) -> Int[Tensor, " m"]:
    """For each entry of a new context, the cache slot whose keys and values it keeps (-1: it runs through the
    model). ``prefix``: the entries up to the first that differs, where keys and values are exact (each depends on
    the entries before it alone). ``moved``: every entry the cache holds, wherever it now sits, whose neighbour for
    the key smear is as it was; what its keys and values read at the layers above the first is then the context it
    was written in. The last entry always runs: its hidden state gives the next token."""
    m = entries.size(0)
    source = torch.full((m,), -1, dtype=torch.int64, device=entries.device)
    if cached.size(0) == 0:
        return source
    if reuse == PREFIX:
        keep = min(shared_prefix(cached, entries), m - 1)
        source[:keep] = torch.arange(keep, device=entries.device)
        return source
    same = (entries[:, None] == cached[None]).all(-1)  # [m, n]: at most one slot each, entries being distinct
    held = same.any(-1) & (after_its_token(entries) == after_its_token(cached)[same.int().argmax(-1)])
    source = torch.where(held, same.int().argmax(-1), source)
    source[-1] = -1
    return source


@typechecked
def refill(
    decoder: Decoder, cached: Int[Tensor, "n 2"], wc: WorkingContext, stats: GenerationStats, reuse: str = MOVED
) -> tuple[Float[Tensor, "1 1 d"], Int[Tensor, "m 2"]]:
    """Bring the decoder's cache, holding the entries ``cached [n, 2]`` (start, LOD), to the context ``wc [1, m]``:
    keep what ``reuse`` keeps (:func:`kept_slots`), moved to its new slots, and run the rest through the model.
    Returns the context's last entry's hidden state ``[1, 1, D]`` and the context's (start, LOD) ``[m, 2]``."""
    entries = torch.stack([wc.start[0], wc.lod[0]], -1)
    source = kept_slots(cached, entries, reuse)
    slots = torch.arange(source.size(0), device=source.device)
    if bool((source[source >= 0] != slots[source >= 0]).any()):
        decoder.move(source)
    runs = torch.nonzero(source < 0).flatten()
    hidden = decoder.refill(wc.emb, wc.position, wc.span.float(), runs)
    stats.reused_entries += entries.size(0) - runs.numel()
    stats.recomputed_entries += runs.numel()
    return hidden, entries


class MCContexts:
    """MegaContext's contexts for one text: a refocus whenever ``refocus`` says (:mod:`mcfn.core.cadence`) with
    ``policy``'s context and the cache refilled where it changed (``use_cache=False``: the whole context recomputed at
    every token instead, to hold the cache to the same tokens). ``on_refocus(n, layout)`` hears each refocus's LOD
    layout. ``refill_chunk``: the entries a compiled refill runs at once (:class:`~mcfn.inference.decode.Decoder`; at
    most ``W``). ``reuse``: what a refocus keeps of the cache (:func:`kept_slots`)."""

    def __init__(self, system: MegaContext, policy: FocusPolicy, refocus: Refocus, device: torch.device,
                 compile_fn=None, use_cache: bool = True, on_refocus=None,
                 refill_chunk: int = REFILL_CHUNK, reuse: str = MOVED):  # fmt: skip
        if reuse not in REUSE:
            raise ValueError(f"a refocus keeps the cache's {' or '.join(REUSE)}; {reuse!r} asked")
        self.reuse = reuse
        self.system, self.policy, self.refocus, self.stats = system, policy, refocus, GenerationStats()
        self.use_cache, self.on_refocus, self.device = use_cache, on_refocus, device
        self.budget = refocus_budget(system.layout, refocus.every)
        self.stream = StreamingTree(system, device)
        # A scored policy's choice runs as one fixed-shape graph, compiled with the decoder's graphs.
        self.choice = FocusChoice(system, policy, refocus, self.budget, compile_fn) if policy.scored else None
        # The cache holds the context (within W - R) and the R tokens decoded after it; a context shorter than a
        # refill chunk is padded to one.
        capacity = max(system.layout.W, refill_chunk)
        self.decoder = Decoder(system.base, KVCache(system.base, capacity, device), compile_fn, refill_chunk)
        self.context: WorkingContext | None = None
        self.cached = torch.zeros(0, 2, dtype=torch.int64, device=device)  # (start, LOD) of each cache entry
        self.entries: tuple[Tensor, Tensor, Tensor] | None = None  # use_cache=False: the context's inputs so far
        self.watch: RefocusWatch | None = None  # when the next refocus is due (mcfn.core.cadence): from the prompt on

    def prefill(self, prompt: Tensor) -> None:
        self.stream.append(prompt)
        self.watch = self.refocus.watch(prompt.tolist())

    def due(self, token: Tensor) -> bool:
        """Whether the context refocuses after the decoded ``token [1]`` (its rule's decision)."""
        return self.watch.due(int(token))

    def refresh(self) -> Tensor:
        """A refocus: the policy's context over the history so far, the cache brought to it; the next logits."""
        stats, decoder, base = self.stats, self.decoder, self.system.base
        t_refocus = settled(self.device)
        warm = self.refocus.carried(self.context) is not None
        compiling = self.compile_s
        if self.choice is not None:
            wc = self.context = self.choice(self.stream)
        else:
            wc = self.context = focused_context(self.system, self.stream, self.budget, self.policy, self.refocus,
                                                self.context)  # fmt: skip
        stats.focus_s += settled(self.device) - t_refocus - (self.compile_s - compiling)
        self.watch.refocused(wc)
        layout_text = lod_string(
            wc.start[0], wc.span[0], wc.lod[0], wc.valid[0], len(self.stream), self.system.layout.K
        )
        stats.layouts.append(layout_text)
        if self.on_refocus is not None:
            self.on_refocus(len(self.stream), layout_text)
        if self.use_cache:
            hidden, self.cached = refill(decoder, self.cached if warm else self.cached[:0], wc, stats, self.reuse)
        else:
            self.entries = (wc.emb, wc.position, wc.span.float())
            hidden = base.hidden(*self.entries)
        logits = base.logits(hidden[:, -1:])[0, 0]
        # Like tokens/s, the refocus time leaves out the compilation of the choice's and the refill's graphs.
        stats.refocus_s += settled(self.device) - t_refocus - (self.compile_s - compiling)
        return logits

    @property
    def compile_s(self) -> float:
        """The compiled graphs' first calls: the decoder's, and each shape's of the choice."""
        return self.decoder.compile_s + (0.0 if self.choice is None else self.choice.compile_s)

    def step(self, token: Tensor, position: int) -> Tensor:
        """One decoded token ``[1]`` at ``position`` read into the context: the next logits."""
        if self.use_cache:
            return self.decoder.token(token, position)
        base = self.system.base
        new = token_entry(base, token, position)
        self.entries = tuple(torch.cat(pair, 1) for pair in zip(self.entries, new, strict=True))
        return base.logits(base.hidden(*self.entries)[:, -1:])[0, 0]

    def absorb(self, decoded: Tensor) -> None:
        """The tokens ``[r]`` decoded since the last refocus join the tree (one GistNet call per level) and the
        cache's bookkeeping."""
        new = torch.arange(len(self.stream), len(self.stream) + decoded.numel(), device=self.device)
        self.cached = torch.cat([self.cached, torch.stack([new, torch.zeros_like(new)], -1)])
        self.stream.append(decoded)


class FullContexts:
    """Full context for one text: the prompt read once into a cache of its length and the new tokens'."""

    def __init__(self, base: GPT, capacity: int, device: torch.device, compile_fn=None):
        self.base, self.stats = base, GenerationStats()
        self.decoder = Decoder(base, KVCache(base, capacity, device), compile_fn)  # no refill: no padding
        self.logits: Tensor | None = None

    def prefill(self, prompt: Tensor) -> None:
        for lo in range(0, prompt.numel(), PREFILL_CHUNK):
            ids = prompt[lo : lo + PREFILL_CHUNK][None]
            pos = torch.arange(lo, lo + ids.size(1), device=ids.device, dtype=torch.float32)[None]
            hidden = extend(self.base, self.decoder.cache, self.base.embed(ids), pos, torch.ones_like(pos))
        self.logits = self.base.logits(hidden[:, -1:])[0, 0]

    def refresh(self) -> Tensor:
        return self.logits

    def due(self, token: Tensor) -> bool:
        return False  # read once: never refocused

    @property
    def compile_s(self) -> float:
        return self.decoder.compile_s

    def step(self, token: Tensor, position: int) -> Tensor:
        return self.decoder.token(token, position)

    def absorb(self, decoded: Tensor) -> None:
        pass  # the cache holds them already
