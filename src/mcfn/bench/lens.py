"""LensNet's forward on one long working context, timed alone: the "LensNet at 8k entries" figure.

The step's own ``lens_fwd_ms`` phase scores ``[B·V, W]`` packed contexts at the profile's ``W``. This measures
what a deployment at a larger budget pays per refocus: one working context of ``entries`` entries (the profile's
model, ``mc.budget = entries``, ``T`` the smallest multiple of ``K**LODmax`` at least ``2·entries``), built by
the step's own stages from random tokens, then LensNet's forward over its recency row, compiled alone and timed
as a median after warm-up. Forward only: a refocus scores without a gradient.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch

from mcfn.config import RunConfig
from mcfn.core.system import MegaContext, build_contexts
from mcfn.core.variants import draw_variant_noise


def long_context_config(cfg: RunConfig, entries: int, vocab: int) -> RunConfig:
    """``cfg``'s model at working-context budget ``entries``, over a history twice as long, one sample a batch."""
    top = cfg.mc.block_size**cfg.mc.lod_max
    seq_len = -(-2 * entries // top) * top
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=vocab),
        data=dataclasses.replace(cfg.data, seq_len=seq_len),
        train=dataclasses.replace(cfg.train, batch_size=1),
        mc=dataclasses.replace(cfg.mc, budget=entries),
    )


def lens_forward_ms(
    cfg: RunConfig,
    vocab: int,
    device: torch.device,
    entries: int,
    timer: Callable[..., float],
    compile_fn: Callable[[Callable], Callable],
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """Median milliseconds of LensNet's forward over one working context of ``entries`` entries."""
    cfg = long_context_config(cfg, entries, vocab)
    torch.manual_seed(cfg.train.seed)
    system = MegaContext(cfg).to(device).eval()
    if system.lensnet is None:
        return {"lens_entries": entries, "lens_fwd_long_ms": None}
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    layout = system.layout
    window = torch.randint(0, vocab, (1, layout.T + 1), device=device, generator=gen)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    with torch.no_grad(), autocast:
        wc = build_contexts(system, window, draw_variant_noise(layout, 1, gen, device, cfg.mc.alloc.iterations))[0]
    row = wc[:1]  # the recency variant: every entry of the budget filled
    tokens = window[:, : layout.T]
    forward = compile_fn(system.lensnet)

    def score() -> None:
        with torch.no_grad(), autocast:
            forward(row, None, tokens, system.base)

    for _ in range(warmup):
        score()
    return {
        "lens_entries": int(row.valid.sum()),
        "lens_fwd_long_ms": statistics.median(timer(score) for _ in range(steps)),
    }
