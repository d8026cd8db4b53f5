"""Decode speed of MegaContext against full context, measured in one process: ``python -m train.bench --decode``.

For each prompt length, greedy generation of ``new_tokens`` tokens in four modes, run in turn ``repeats``
times so that the machine's drift falls on all of them alike; each figure is the median over the repeats:

* ``mc``: streaming MegaContext, warm refocuses (the default of ``train.generate``);
* ``mc_cold``: every refocus from the coarsest cut, with a fresh cache (``--warm-steps 0``);
* ``recency``: the newest ``W - R`` tokens at each refocus (``train.generate --context recency``), truncation;
* ``full``: the whole prompt at LOD0 with a KV cache over all of it.

With ``compile_fn`` the per-token step is compiled (once per cache shape; the first repeat pays for it, and
tokens/s never counts compilation).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any

import torch

from mcfn.core.focus import WARM_STEPS
from mcfn.core.policy import FULL, LENS, RECENCY
from mcfn.core.system import MegaContext
from mcfn.inference.generation import GenerationStats, Sampling, generate_full, generate_mc

MODES = ("mc", "mc_cold", RECENCY.name, FULL.name)  # lens warm and cold, truncation, full context


def decode_once(
    system: MegaContext, mode: str, prompt: torch.Tensor, new_tokens: int, refocus_every: int, compile_fn
) -> GenerationStats:
    greedy = Sampling(temperature=0.0)
    gc.collect()  # the previous mode's garbage is not collected on this one's time
    if mode == FULL.name:
        return generate_full(system.base, prompt, new_tokens, greedy, compile_fn)[1]
    warm_steps = 0 if mode == "mc_cold" else WARM_STEPS
    policy = RECENCY if mode == RECENCY.name else LENS
    return generate_mc(
        system,
        prompt,
        new_tokens,
        refocus_every,
        sampling=greedy,
        warm_steps=warm_steps,
        compile_fn=compile_fn,
        policy=policy,
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
) -> list[dict[str, Any]]:
    """One row per prompt length (the first ``length`` of ``ids``): per mode the median tokens/s, prompt
    read time and (MegaContext) refocus time per new token and the share of cache entries refocuses kept."""
    rows = []
    for length in lengths:
        runs: dict[str, list[GenerationStats]] = {mode: [] for mode in MODES}
        for r in range(repeats):
            for mode in MODES:
                stats = decode_once(system, mode, ids[:length], new_tokens, refocus_every, compile_fn)
                runs[mode].append(stats)
                progress(f"{length} tokens, {mode}, repeat {r + 1}/{repeats}: {stats.tokens_per_s:.1f} tok/s")
        row: dict[str, Any] = {"prompt_tokens": length}
        for mode, stats in runs.items():
            row[f"{mode}_tok_s"] = statistics.median(s.tokens_per_s for s in stats)
            row[f"{mode}_prompt_s"] = statistics.median(s.prefill_s for s in stats)
            if mode != FULL.name:
                row[f"{mode}_refocus_ms_per_token"] = 1e3 * statistics.median(s.refocus_s / s.new_tokens for s in stats)
                row[f"{mode}_cache_kept"] = statistics.median(s.cache_kept for s in stats)
        mc = runs["mc"]
        row["mc_refocuses_per_token"] = statistics.median(len(s.layouts) / s.new_tokens for s in mc)
        row["mc_recomputed_per_refocus"] = statistics.median(s.recomputed_entries / len(s.layouts) for s in mc)
        row["mc_focus_ms_per_refocus"] = 1e3 * statistics.median(s.focus_s / len(s.layouts) for s in mc)
        row["mc_over_full"] = row["mc_tok_s"] / row["full_tok_s"]
        row["mc_over_recency"] = row["mc_tok_s"] / row["recency_tok_s"]
        rows.append(row)
    return rows


def format_decode_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| prompt tokens | MC tok/s | MC cold tok/s | recency tok/s | full tok/s | MC / recency | MC / full "
        "| MC refocus ms/token (cold) | refocuses/token | entries recomputed/refocus | LensNet + allocator ms/refocus "
        "| cache kept | MC prompt read | full prompt read |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']:,} | {r['mc_tok_s']:.0f} | {r['mc_cold_tok_s']:.0f} | {r['recency_tok_s']:.0f} "
            f"| {r['full_tok_s']:.0f} | {r['mc_over_recency']:.2f} | {r['mc_over_full']:.2f} "
            f"| {r['mc_refocus_ms_per_token']:.2f} ({r['mc_cold_refocus_ms_per_token']:.2f}) "
            f"| {r['mc_refocuses_per_token']:.4f} | {r['mc_recomputed_per_refocus']:.1f} "
            f"| {r['mc_focus_ms_per_refocus']:.2f} "
            f"| {100 * r['mc_cache_kept']:.0f}% | {r['mc_prompt_s']:.2f} s | {r['full_prompt_s']:.2f} s |"
        )
    return "\n".join(lines)
