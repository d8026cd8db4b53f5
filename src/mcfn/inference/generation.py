"""Text generation past the budget: MegaContext streaming decode, and full-context decode to compare, through one
decode loop (:func:`decode`) over two sources of contexts (:mod:`mcfn.inference.contexts`).

``mc``: the prompt streams into a :class:`~mcfn.inference.streaming.StreamingTree`. Whenever the refocus rule says
(every ``refocus_every`` tokens, or when a copy starts and at the latest every ``refocus_every``:
:mod:`mcfn.core.cadence`) the working context is rebuilt by LensNet and the allocator within ``W - refocus_every``
entries (room for the tokens decoded until the next refocus), run through the base model to fill a KV cache, and the
next tokens are decoded one at a time against that cache; each new token also joins the tree, so its block's gists
exist by the next refocus. Per-token cost is bounded by ``W`` however long the text gets.

Every refocus scores the nodes with one LensNet pass. A refocus is cheap when little changed: the first
starts from the coarsest cut (``refocus_steps`` allocator steps), every later one from the previous context
(``warm_steps`` steps, one by default), and the cache keeps every entry the new context still holds, moved to
its new slot with its keys rotated there, so only the new entries run through the model (``reuse="moved"``; the
kept entries' upper layers read the context they were written in: ``train.reuse`` measures what that does to text,
and ``reuse="prefix"`` keeps only the entries before the first one that changed, exactly what the evaluation scores).

``full``: every token at LOD0 with a KV cache over the whole text: per-token cost grows with its length.

The focus policy (:mod:`mcfn.core.policy`) chooses each refocus's context: ``lens`` (LensNet, the default), any
other scored policy (``match``, the training-free n-gram match; ``attn``, the base model's own attention), or
``recency``, the newest ``W - refocus_every`` tokens, truncation at the same cadence. Each refocus is the policy's
:meth:`~mcfn.core.policy.FocusPolicy.refocus`, the very call the evaluation's generation protocol makes
(:mod:`mcfn.evaluation.refocused`); :func:`teacher_forced` feeds a known continuation to either loop instead of sampling
(:func:`teacher_forced_mc`, :func:`teacher_forced_full`), and a test holds the evaluation's NLL to its logits (the
two read the same contexts, one through the cache, one in one forward).

``use_cache=False`` recomputes the whole working context at every token instead of reading the cache;
it must pick the same tokens (the tests hold the cache to that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from mcfn.core.cadence import CLOCK, COPY_THRESHOLD
from mcfn.core.focus import REFOCUS_STEPS, WARM_STEPS, Refocus
from mcfn.core.model import GPT
from mcfn.core.policy import LENS, FocusPolicy
from mcfn.core.system import MegaContext
from mcfn.errors import UserError
from mcfn.inference.contexts import MOVED, FullContexts, GenerationStats, MCContexts, settled
from mcfn.inference.decode import REFILL_CHUNK

__all__ = [
    "GenerationStats", "Sampling", "decode", "decode_mc", "generate_full", "generate_mc", "mc_contexts",
    "teacher_forced", "teacher_forced_full", "teacher_forced_mc",
]  # fmt: skip


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: the whole vocabulary
    seed: int = 0
    top_p: float = 1.0  # nucleus: the likeliest tokens whose probabilities first reach top_p (1: all)


def pick_token(logits: Tensor, sampling: Sampling, generator: torch.Generator) -> Tensor:
    """``[vocab]`` logits → a ``[1]`` token id."""
    if sampling.temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    scaled = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = torch.where(scaled < kth, float("-inf"), scaled)
    probs = torch.softmax(scaled, -1)
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # the mass of the likelier tokens: the first always stays
        kept = torch.zeros_like(probs).scatter(0, order, (before < sampling.top_p).float())
        probs = probs * kept
    return torch.multinomial(probs, 1, generator=generator)


def decode(
    contexts: MCContexts | FullContexts,
    prompt: Tensor,
    max_new_tokens: int,
    choose: Callable[[Tensor, int], Tensor | None],
) -> tuple[Tensor, GenerationStats]:
    """The one decode loop: at most ``max_new_tokens`` tokens after ``prompt [n]``, each token ``[1]`` given by
    ``choose(logits [vocab], i)`` (None: stop before it, as a stop sequence or a gone client does), its context from
    ``contexts`` (MegaContext's, refreshed whenever its refocus rule says a refocus is due, or full context's, read
    once). Returns the new tokens ``[k]`` and the stats."""
    stats, device = contexts.stats, prompt.device
    stats.prompt_tokens = prompt.numel()
    t0 = settled(device)
    contexts.prefill(prompt)
    stats.prefill_s = settled(device) - t0
    t0 = settled(device)
    produced: list[Tensor] = []
    stopped = False
    while len(produced) < max_new_tokens and not stopped:
        logits = contexts.refresh()
        decoded: list[Tensor] = []
        while True:
            token = choose(logits, len(produced) + len(decoded))
            if token is None:
                stopped = True
                break
            decoded.append(token)
            # The last token's logits are never read, nor those of one after which the context refocuses.
            if len(produced) + len(decoded) == max_new_tokens or contexts.due(token):
                break
            logits = contexts.step(token, prompt.numel() + len(produced) + len(decoded) - 1)
        if decoded:
            contexts.absorb(torch.cat(decoded))
        produced += decoded
    stats.decode_s, stats.compile_s = settled(device) - t0, contexts.compile_s
    stats.new_tokens = len(produced)
    return torch.cat(produced) if produced else prompt.new_zeros(0), stats


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
    refill_chunk: int = REFILL_CHUNK,
    on: str = CLOCK,
    threshold: float = COPY_THRESHOLD,
    reuse: str = MOVED,
) -> tuple[Tensor, GenerationStats]:
    """Continue ``prompt [n]`` by ``max_new_tokens`` tokens; returns them ``[max_new_tokens]`` and the stats.
    ``warm_steps = 0`` starts every refocus from the coarsest cut, with a fresh cache. ``compile_fn``
    compiles the per-token step and the refill in chunks of ``refill_chunk`` entries (every refocus's cache has
    capacity ``W``: one shape each). ``policy`` chooses each refocus's context (a scored one, or ``recency``:
    truncation at the same cadence). ``on``: when to refocus, every ``refocus_every`` tokens (``clock``) or also
    when a copy starts (``copy``, with ``threshold``: :mod:`mcfn.core.cadence`). ``reuse``: what a refocus keeps of
    the cache (:func:`~mcfn.inference.contexts.kept_slots`)."""
    generator = torch.Generator(device=prompt.device).manual_seed(sampling.seed)

    def choose(logits: Tensor, _: int) -> Tensor:
        return pick_token(logits, sampling, generator)

    steps = Refocus(refocus_every, refocus_steps, warm_steps, on, threshold)
    return decode_mc(
        system, prompt, max_new_tokens, steps, policy, choose, use_cache, on_refocus, compile_fn, refill_chunk, reuse
    )


@torch.no_grad()
def teacher_forced(
    contexts: MCContexts | FullContexts, prompt: Tensor, continuation: Tensor
) -> tuple[Float[Tensor, "n vocab"], GenerationStats]:
    """What the decode loop computes on a known text: the logits ``[n, vocab]`` of each token of ``continuation [n]``
    (the first from the prompt alone), decoded from ``contexts`` as generation decodes but fed the given tokens."""
    logits: list[Tensor] = []

    def choose(step_logits: Tensor, i: int) -> Tensor:
        logits.append(step_logits)
        return continuation[i : i + 1]

    _, stats = decode(contexts, prompt, continuation.numel(), choose)
    return torch.stack(logits), stats


def teacher_forced_mc(
    system: MegaContext,
    prompt: Tensor,
    continuation: Tensor,
    refocus: Refocus,
    policy: FocusPolicy = LENS,
    use_cache: bool = True,
    reuse: str = MOVED,
) -> tuple[Float[Tensor, "n vocab"], GenerationStats]:
    """:func:`teacher_forced` through MegaContext's contexts, as :func:`generate_mc` decodes."""
    contexts = mc_contexts(system, policy, refocus, prompt.device, use_cache=use_cache, reuse=reuse)
    return teacher_forced(contexts, prompt, continuation)


def teacher_forced_full(
    base: GPT, prompt: Tensor, continuation: Tensor
) -> tuple[Float[Tensor, "n vocab"], GenerationStats]:
    """:func:`teacher_forced` through full context at absolute positions, as :func:`generate_full` decodes."""
    contexts = FullContexts(base, prompt.numel() + continuation.numel(), prompt.device)
    return teacher_forced(contexts, prompt, continuation)


def decode_mc(
    system: MegaContext,
    prompt: Tensor,
    max_new_tokens: int,
    refocus: Refocus,
    policy: FocusPolicy,
    choose: Callable[[Tensor, int], Tensor | None],
    use_cache: bool = True,
    on_refocus: Callable[[int, str], None] | None = None,
    compile_fn: Callable[[Callable], Callable] | None = None,
    refill_chunk: int = REFILL_CHUNK,
    reuse: str = MOVED,
) -> tuple[Tensor, GenerationStats]:
    """MC decoding of ``max_new_tokens`` tokens after ``prompt [n]`` with ``policy``'s contexts (:func:`decode`
    with :class:`~mcfn.inference.contexts.MCContexts`); ``choose(logits [vocab], i)`` gives the ``i``-th new token
    ``[1]``."""
    contexts = mc_contexts(
        system, policy, refocus, prompt.device, compile_fn, use_cache, on_refocus, refill_chunk, reuse
    )
    return decode(contexts, prompt, max_new_tokens, choose)


def mc_contexts(
    system: MegaContext,
    policy: FocusPolicy,
    refocus: Refocus,
    device: torch.device,
    compile_fn: Callable[[Callable], Callable] | None = None,
    use_cache: bool = True,
    on_refocus: Callable[[int, str], None] | None = None,
    refill_chunk: int = REFILL_CHUNK,
    reuse: str = MOVED,
) -> MCContexts:
    """MegaContext's contexts for one decode with ``policy``, refused with a user's error where it cannot refocus."""
    if not policy.refocuses:
        raise UserError(f"MegaContext decoding cannot refocus with the {policy.name} policy")
    if not policy.available(system):
        raise UserError(f"the {policy.name} policy needs the run's LensNet, and this run has none (mc.lens.enabled)")
    return MCContexts(system, policy, refocus, device, compile_fn, use_cache, on_refocus, refill_chunk, reuse)


@torch.no_grad()
def generate_full(
    base: GPT,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    compile_fn: Callable[[Callable], Callable] | None = None,
) -> tuple[Tensor, GenerationStats]:
    """Decode with every token at LOD0 and a KV cache over the whole text (the comparison for ``mc``)."""
    generator = torch.Generator(device=prompt.device).manual_seed(sampling.seed)
    contexts = FullContexts(base, prompt.numel() + max_new_tokens, prompt.device, compile_fn)
    return decode(contexts, prompt, max_new_tokens, lambda logits, _: pick_token(logits, sampling, generator))
