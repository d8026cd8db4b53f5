"""Decode speed of MegaContext against full context, measured in one process: ``python -m train.bench --decode``.

For each prompt length, greedy generation of ``new_tokens`` tokens in up to four modes (``modes``; all by default),
run in turn ``repeats`` times so that the machine's drift falls on all of them alike (after one untimed run of each);
each figure is the median over the repeats:

* ``mc``: streaming MegaContext, warm refocuses (the default of ``train.generate``), each keeping every cached entry
  the new context still holds (``--reuse moved``);
* ``mc_prefix``: ``mc`` keeping only the cache's entries up to the first that changed (``--reuse prefix``), what the
  evaluation scores;
* ``mc_cold``: every refocus from the coarsest cut, with a fresh cache (``--warm-steps 0``);
* ``mc_one_chunk``: ``mc`` with its compiled refill in one chunk of the whole refocus budget ``W - R`` instead of
  :data:`~mcfn.inference.decode.REFILL_CHUNK` entries: one replay where warm refocuses keep little of the cache
  (0-4 % on the H100, 2026-11-28), at the cost of recomputing up to ``W - R`` entries where they keep more;
* ``recency``: the newest ``W - R`` tokens at each refocus (``train.generate --context recency``), truncation;
* ``full``: the whole prompt at LOD0 with a KV cache over all of it.

With ``compile_fn`` the token step and the refill are compiled (once per cache shape) and, on a GPU, replayed as
CUDA graphs, and a refocus's choice is one compiled graph per capacity (:mod:`mcfn.inference.choice`); tokens/s and
refocus times never count the compilation. A refocus's cost is reported whole (choosing
the context and refilling the cache, per refocus) and split: choosing it (LensNet and the allocator).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any

import torch

from mcfn.bench.operators import warm_refocus_operators
from mcfn.core.cadence import CLOCK
from mcfn.core.focus import WARM_STEPS
from mcfn.core.policy import FULL, LENS, RECENCY, FocusPolicy
from mcfn.core.stream_view import refocus_budget
from mcfn.core.system import MegaContext
from mcfn.inference.contexts import MOVED, PREFIX
from mcfn.inference.decode import REFILL_CHUNK
from mcfn.inference.generation import GenerationStats, Sampling, generate_full, generate_mc

COUNTED_REFOCUSES = 10  # warm refocuses whose operators are counted per prompt length
MODES = ("mc", "mc_prefix", "mc_cold", "mc_one_chunk", RECENCY.name, FULL.name)  # lens warm, keeping its prefix,
# cold, its refill in one chunk; truncation; full context


def decode_once(
    system: MegaContext,
    mode: str,
    prompt: torch.Tensor,
    new_tokens: int,
    refocus_every: int,
    compile_fn,
    policy: FocusPolicy = LENS,
    on: str = CLOCK,
    refill_chunk: int = REFILL_CHUNK,
) -> GenerationStats:
    greedy = Sampling(temperature=0.0)
    gc.collect()  # the previous mode's garbage is not collected on this one's time
    if mode == FULL.name:
        return generate_full(system.base, prompt, new_tokens, greedy, compile_fn)[1]
    warm_steps = 0 if mode == "mc_cold" else WARM_STEPS
    policy = RECENCY if mode == RECENCY.name else policy
    refill_chunk = refocus_budget(system.layout, refocus_every) if mode == "mc_one_chunk" else refill_chunk
    reuse = PREFIX if mode == "mc_prefix" else MOVED
    return generate_mc(
        system,
        prompt,
        new_tokens,
        refocus_every,
        sampling=greedy,
        warm_steps=warm_steps,
        compile_fn=compile_fn,
        policy=policy,
        refill_chunk=refill_chunk,
        on=on,
        reuse=reuse,
    )[1]


def run_decode_benchmark(
    system: MegaContext,
    ids: torch.Tensor,
    lengths: list[int],
    new_tokens: int,
    repeats: int,
    refocus_every: int,
    compile_fn: Callable[[Callable], Callable] | None = None,
    progress: Callable[[str], None] = lambda line: None,
    modes: tuple[str, ...] = MODES,
    policy: FocusPolicy = LENS,
    on: str = CLOCK,
    refill_chunk: int = REFILL_CHUNK,
) -> list[dict[str, Any]]:
    """One row per prompt length (the first ``length`` of ``ids``): per mode the median tokens/s and prompt read
    time, and for MegaContext's modes the refocus time per new token and per refocus and the share of cache entries
    refocuses kept; the ratios of ``mc`` to full context and to truncation where both ran. Compiled, call it within
    :func:`~mcfn.bench.operators.counted_kernels`, so that the operator count sees the graphs' kernels. MegaContext's
    modes decode with ``policy`` (truncation's with its own) under the rule ``on`` (:mod:`mcfn.core.cadence`),
    refocusing at the latest every ``refocus_every`` tokens, their compiled refills in chunks of ``refill_chunk``."""
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"decode modes are {', '.join(MODES)}; got {', '.join(modes) or 'none'}")
    # One untimed run per mode first, past a warm refocus: on the H100 (2026-11-28) the first mode timed in a process
    # ran at a quarter of its later rate (kernels loaded and tuned on first use, outside the compiled graphs).
    for mode in modes:
        decode_once(system, mode, ids[: lengths[0]], refocus_every + 1, refocus_every, compile_fn, policy, on,
                    refill_chunk)  # fmt: skip
    rows = []
    for length in lengths:
        runs: dict[str, list[GenerationStats]] = {mode: [] for mode in modes}
        for r in range(repeats):
            for mode in modes:
                stats = decode_once(system, mode, ids[:length], new_tokens, refocus_every, compile_fn, policy, on,
                                    refill_chunk)  # fmt: skip
                runs[mode].append(stats)
                progress(f"{length} tokens, {mode}, repeat {r + 1}/{repeats}: {stats.tokens_per_s:.1f} tok/s")
        row: dict[str, Any] = {"prompt_tokens": length}
        for mode, stats in runs.items():
            row[f"{mode}_tok_s"] = statistics.median(s.tokens_per_s for s in stats)
            row[f"{mode}_prompt_s"] = statistics.median(s.prefill_s for s in stats)
            if mode != FULL.name:
                row[f"{mode}_refocus_ms_per_token"] = 1e3 * statistics.median(s.refocus_s / s.new_tokens for s in stats)
                row[f"{mode}_refocus_ms_per_refocus"] = statistics.median(s.refocus_ms for s in stats)
                row[f"{mode}_cache_kept"] = statistics.median(s.cache_kept for s in stats)
                row[f"{mode}_focus_ms_per_refocus"] = 1e3 * statistics.median(s.focus_s / len(s.layouts) for s in stats)
        if mc := runs.get("mc"):
            row["mc_refocuses_per_token"] = statistics.median(s.refocuses_per_token for s in mc)
            row["mc_recomputed_per_refocus"] = statistics.median(s.recomputed_entries / len(s.layouts) for s in mc)
            counts = warm_refocus_operators(system, ids, length, refocus_every, COUNTED_REFOCUSES, compile_fn)
            row["mc_refocus_ops"] = statistics.median(counts)
            for other in (FULL.name, RECENCY.name):
                if other in runs:
                    row[f"mc_over_{other}"] = row["mc_tok_s"] / row[f"{other}_tok_s"]
        rows.append(row)
    return rows


COLUMNS = (  # (key, heading, format): the table shows the columns whose keys the rows have
    ("mc_tok_s", "MC tok/s", "{:.0f}"),
    ("mc_cold_tok_s", "MC cold tok/s", "{:.0f}"),
    ("recency_tok_s", "recency tok/s", "{:.0f}"),
    ("full_tok_s", "full tok/s", "{:.0f}"),
    ("mc_over_recency", "MC / recency", "{:.2f}"),
    ("mc_over_full", "MC / full", "{:.2f}"),
    ("mc_refocus_ms_per_refocus", "MC ms/refocus", "{:.2f}"),
    ("mc_focus_ms_per_refocus", "of which LensNet + allocator", "{:.2f}"),
    ("mc_refocus_ops", "operators a warm refocus's choice", "{:,.0f}"),
    ("mc_prefix_refocus_ms_per_refocus", "MC prefix-kept ms/refocus", "{:.2f}"),
    ("mc_prefix_focus_ms_per_refocus", "of which LensNet + allocator", "{:.2f}"),
    ("mc_prefix_tok_s", "MC prefix-kept tok/s", "{:.0f}"),
    ("mc_cold_refocus_ms_per_refocus", "MC cold ms/refocus", "{:.2f}"),
    ("mc_one_chunk_tok_s", "MC one-chunk refill tok/s", "{:.0f}"),
    ("mc_one_chunk_refocus_ms_per_refocus", "MC one-chunk ms/refocus", "{:.2f}"),
    ("mc_refocuses_per_token", "refocuses/token", "{:.4f}"),
    ("mc_recomputed_per_refocus", "entries recomputed/refocus", "{:.1f}"),
    ("mc_cache_kept", "cache kept", "{:.0%}"),
    ("mc_prompt_s", "MC prompt read s", "{:.2f}"),
    ("full_prompt_s", "full prompt read s", "{:.2f}"),
)


def format_decode_table(rows: list[dict[str, Any]]) -> str:
    columns = [c for c in COLUMNS if c[0] in rows[0]]
    lines = [
        "| prompt tokens | " + " | ".join(heading for _, heading, _ in columns) + " |",
        "| ---: |" + " ---: |" * len(columns),
    ]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']:,} | " + " | ".join(fmt.format(r[k]) for k, _, fmt in columns) + " |")
    return "\n".join(lines)
