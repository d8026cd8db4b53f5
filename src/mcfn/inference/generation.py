"""Text generation past the budget: MegaContext streaming decode, and full-context decode to compare.

``mc``: the prompt streams into a :class:`StreamingTree`. Every ``refocus_every`` tokens the working
context is rebuilt by LensNet and the allocator within ``W - refocus_every`` entries (room for the tokens
decoded until the next refocus), run through the base model to fill a KV cache, and the next tokens are
decoded one at a time against that cache; each new token also joins the tree, so its block's gists exist
by the next refocus. Per-token cost is bounded by ``W`` however long the text gets.

Every refocus scores the nodes with one LensNet pass. A refocus is cheap when little changed: the first
starts from the coarsest cut (``refocus_steps`` allocator steps), every later one from the previous context
(``warm_steps`` steps, one by default), and the cache keeps the entries before the first one the refocus
changed: a cached entry's keys and values depend only on the entries before it, so only the rest runs
through the model again.

``full``: every token at LOD0 with a KV cache over the whole text: per-token cost grows with its length.

The focus policy (:mod:`mcfn.core.policy`) chooses each refocus's context: ``lens`` (LensNet, the default), any
other scored policy (``match``, the training-free n-gram match; ``attn``, the base model's own attention), or
``recency``, the newest ``W - refocus_every`` tokens, truncation at the same cadence. :func:`teacher_forced_mc`
feeds a known continuation instead of sampling: the logits the evaluation's generation protocol scores
(:mod:`mcfn.tools.refocused`).

``use_cache=False`` recomputes the whole working context at every token instead of reading the cache;
it must pick the same tokens (the tests hold the cache to that).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.focus import REFOCUS_STEPS, WARM_STEPS, Refocus, refocus_budget
from mcfn.core.model import GPT
from mcfn.core.policy import LENS, Choice, FocusPolicy
from mcfn.core.system import MegaContext
from mcfn.errors import UserError
from mcfn.inference.decode import REFILL_CHUNK, Decoder, KVCache, extend
from mcfn.inference.render import lod_string
from mcfn.inference.streaming import StreamingTree, focused_context, recency_context
from mcfn.typecheck import typechecked

PREFILL_CHUNK = 1024  # full mode reads long prompts in chunks, so attention never builds an n × n mask


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: the whole vocabulary
    seed: int = 0


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


def pick_token(logits: Tensor, sampling: Sampling, generator: torch.Generator) -> Tensor:
    """``[vocab]`` logits → a ``[1]`` token id."""
    if sampling.temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    scaled = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = torch.where(scaled < kth, float("-inf"), scaled)
    return torch.multinomial(torch.softmax(scaled, -1), 1, generator=generator)


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
def refill(
    decoder: Decoder, cached: Int[Tensor, "n 2"], wc: WorkingContext, stats: GenerationStats
) -> tuple[Float[Tensor, "1 r d"], Int[Tensor, "m 2"]]:
    """Bring the decoder's cache, holding the entries ``cached [n, 2]`` (start, LOD), to the context ``wc [1, m]``:
    keep the entries up to the first one that differs and run the rest through the model. Returns hidden states
    whose last is the context's last entry's ``[1, r, D]`` and the context's (start, LOD) ``[m, 2]``."""
    entries = torch.stack([wc.start[0], wc.lod[0]], -1)
    # Keep at least one entry out of the prefix: its hidden state gives the next token.
    keep = min(shared_prefix(cached, entries), entries.size(0) - 1)
    decoder.cache.length = keep
    hidden = decoder.extend(wc.emb[:, keep:], wc.position[:, keep:], wc.span[:, keep:].float())
    stats.reused_entries += keep
    stats.recomputed_entries += entries.size(0) - keep
    return hidden, entries


@torch.no_grad()
def generate_mc(
    system: MegaContext,
    prompt: Tensor,
    max_new_tokens: int,
    refocus_every: int,
    refocus_steps: int = REFOCUS_STEPS,
    sampling: Sampling = Sampling(),
    warm_steps: int = WARM_STEPS,
    use_cache: bool = True,
    on_refocus: Callable[[int, str], None] | None = None,
    compile_fn: Callable[[Callable], Callable] | None = None,
    policy: FocusPolicy = LENS,
) -> tuple[Tensor, GenerationStats]:
    """Continue ``prompt [n]`` by ``max_new_tokens`` tokens; returns them ``[max_new_tokens]`` and the stats.
    ``warm_steps = 0`` starts every refocus from the coarsest cut, with a fresh cache. ``compile_fn``
    compiles the per-token step (every refocus's cache has capacity ``W``: one shape). ``policy`` chooses each
    refocus's context (a scored one, or ``recency``: truncation at the same cadence)."""
    generator = torch.Generator(device=prompt.device).manual_seed(sampling.seed)

    def choose(logits: Tensor, _: int) -> Tensor:
        return pick_token(logits, sampling, generator)

    steps = Refocus(refocus_every, refocus_steps, warm_steps)
    return decode_mc(system, prompt, max_new_tokens, steps, policy, choose, use_cache, on_refocus, compile_fn)


@torch.no_grad()
def teacher_forced_mc(
    system: MegaContext,
    prompt: Tensor,
    continuation: Tensor,
    refocus: Refocus,
    policy: FocusPolicy = LENS,
    use_cache: bool = True,
) -> tuple[Float[Tensor, "n vocab"], GenerationStats]:
    """What generation computes on a known text: the logits ``[n, vocab]`` of each token of ``continuation [n]``
    (the first from the prompt alone), decoded as :func:`generate_mc` decodes but fed the given tokens."""
    logits: list[Tensor] = []

    def choose(step_logits: Tensor, i: int) -> Tensor:
        logits.append(step_logits)
        return continuation[i : i + 1]

    _, stats = decode_mc(system, prompt, continuation.numel(), refocus, policy, choose, use_cache)
    return torch.stack(logits), stats


def decode_mc(
    system: MegaContext,
    prompt: Tensor,
    max_new_tokens: int,
    refocus: Refocus,
    policy: FocusPolicy,
    choose: Callable[[Tensor, int], Tensor],
    use_cache: bool = True,
    on_refocus: Callable[[int, str], None] | None = None,
    compile_fn: Callable[[Callable], Callable] | None = None,
) -> tuple[Tensor, GenerationStats]:
    """MC decoding of ``max_new_tokens`` tokens after ``prompt [n]`` with ``policy``'s contexts; ``choose(logits
    [vocab], i)`` gives the ``i``-th new token ``[1]``."""
    if not policy.refocuses:
        raise UserError(f"MegaContext decoding cannot refocus with the {policy.name} policy")
    if not policy.available(system):
        raise UserError(f"the {policy.name} policy needs the run's LensNet, and this run has none (mc.lens.enabled)")
    base, layout = system.base, system.layout
    budget = refocus_budget(layout, refocus.every)
    device = prompt.device
    stats = GenerationStats(prompt_tokens=prompt.numel())
    t0 = settled(device)
    stream = StreamingTree(system, device)
    stream.append(prompt)
    stats.prefill_s = settled(device) - t0

    t0 = settled(device)
    produced: list[Tensor] = []
    # The cache holds the context, the R tokens decoded after it and a refill's padding.
    decoder = Decoder(base, KVCache(base, layout.W + REFILL_CHUNK, device), compile_fn)
    wc = None
    cached = torch.zeros(0, 2, dtype=torch.int64, device=device)  # (start, LOD) of each cache entry
    while len(produced) < max_new_tokens:
        t_refocus = settled(device)
        warm = refocus.warm_steps > 0 and wc is not None
        if policy.choice is Choice.TRUNCATION:
            wc = recency_context(stream, budget)
        else:
            steps = refocus.warm_steps if warm else refocus.steps
            wc = focused_context(system, stream, budget, policy, steps, refocus.every, wc if warm else None)
        stats.focus_s += settled(device) - t_refocus
        layout_text = lod_string(wc.start[0], wc.span[0], wc.lod[0], wc.valid[0], len(stream), layout.K)
        stats.layouts.append(layout_text)
        if on_refocus is not None:
            on_refocus(len(stream), layout_text)
        emb, positions, spans = wc.emb, wc.position, wc.span.float()
        compiling = decoder.compile_s
        if use_cache:
            hidden, cached = refill(decoder, cached if warm else cached[:0], wc, stats)
        else:
            hidden = base.hidden(emb, positions, spans)
        logits = base.logits(hidden[:, -1:])[0, 0]
        # Like tokens/s, the refocus time leaves out the refill graph's compilation (its first call).
        stats.refocus_s += settled(device) - t_refocus - (decoder.compile_s - compiling)
        # Decoded tokens join the tree at the next refocus, the only reader: one GistNet call per level.
        decoded: list[Tensor] = []
        for _ in range(min(refocus.every, max_new_tokens - len(produced))):
            token = choose(logits, len(produced) + len(decoded))
            decoded.append(token)
            position = len(stream) + len(decoded) - 1
            if use_cache:
                logits = decoder.token(token, position)
            else:
                new_emb, new_pos, one = token_entry(base, token, position)
                emb = torch.cat([emb, new_emb], 1)
                positions, spans = torch.cat([positions, new_pos], 1), torch.cat([spans, one], 1)
                logits = base.logits(base.hidden(emb, positions, spans)[:, -1:])[0, 0]
        new = torch.arange(len(stream), len(stream) + len(decoded), device=device)
        cached = torch.cat([cached, torch.stack([new, torch.zeros_like(new)], -1)])
        stream.append(torch.cat(decoded))
        produced += decoded
    stats.decode_s, stats.compile_s = settled(device) - t0, decoder.compile_s
    stats.new_tokens = len(produced)
    return torch.cat(produced) if produced else prompt.new_zeros(0), stats


@torch.no_grad()
def generate_full(
    base: GPT,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    compile_fn: Callable[[Callable], Callable] | None = None,
) -> tuple[Tensor, GenerationStats]:
    """Decode with every token at LOD0 and a KV cache over the whole text (the comparison for ``mc``)."""
    device, n = prompt.device, prompt.numel()
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    stats = GenerationStats(prompt_tokens=n)
    decoder = Decoder(base, KVCache(base, n + max_new_tokens, device), compile_fn)  # no refill: no padding
    t0 = settled(device)
    for lo in range(0, n, PREFILL_CHUNK):
        ids = prompt[lo : lo + PREFILL_CHUNK][None]
        pos = torch.arange(lo, lo + ids.size(1), device=device, dtype=torch.float32)[None]
        hidden = extend(base, decoder.cache, base.embed(ids), pos, torch.ones_like(pos))
    logits = base.logits(hidden[:, -1:])[0, 0]
    stats.prefill_s = settled(device) - t0
    t0 = settled(device)
    produced: list[Tensor] = []
    for i in range(max_new_tokens):
        token = pick_token(logits, sampling, generator)
        produced.append(token)
        if i + 1 < max_new_tokens:
            logits = decoder.token(token, n + i)
    stats.decode_s, stats.compile_s = settled(device) - t0, decoder.compile_s
    stats.new_tokens = len(produced)
    return torch.cat(produced) if produced else prompt.new_zeros(0), stats
