"""The MegaContext step against the plain GPT step on the same packed entries, measured in one run.

* **MC step**: ``process_batch`` forward + backward on ``[B, T+1]`` windows with fresh variant noise.
* **Plain step**: the same base model, forward + backward over ``[B·V, W]`` token entries (the shape of
  the packed working contexts) with the next-token loss on exactly as many positions as the MC step
  supervises (its valid entries). ``ratio_mc_over_plain`` is therefore the price of MegaContext
  around the base model: the tree, the variants, the assembly and the losses.

Both are warmed up first (the first call compiles; ``compile_s`` is its time beyond a normal step),
then timed alternately, step by step, so drift on a shared machine hits both alike; medians are
reported. On CUDA each step is timed with CUDA events; on the CPU with ``perf_counter``.

**Phases** are timed one at a time, each phase compiled on its own (with the same mode) and run
forward + backward on inputs prepared by the earlier phases: ``tree_ms`` (token embedding and
GistNet over the eligible blocks), ``variants_ms`` (sampling, no gradient), ``assemble_ms`` (gather
into ``[B·V, W]``), ``base_ms`` (base model over the packed entries, per-entry NLL) and ``losses_ms``
(variant losses and metrics from the NLL). Inside the whole compiled step the phases fuse, so their sum
can differ from ``mc_step_ms``; ``glue_frac`` = (variants + assemble + losses) / MC step.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch._dynamo

from mcfn.config import RunConfig
from mcfn.mc.context import assemble
from mcfn.mc.losses import tail_nll, variant_losses
from mcfn.mc.preferences import lens_losses, lens_weight_tensors
from mcfn.mc.system import MegaContext, build_contexts, choose_variants, process_batch, process_batch_lens
from mcfn.mc.tree import Tree, build_tree
from mcfn.mc.variants import draw_variant_noise
from mcfn.model import GPT
from mcfn.step import total_loss
from mcfn.tasks import compile_step


class Timer:
    """Milliseconds of a callable, synchronised properly for the device."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[..., Any], *args: Any) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t0) * 1e3


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _compiled_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


def run_benchmark(
    cfg: RunConfig,
    vocab: int,
    device: torch.device,
    steps: int,
    warmup: int,
    compile_mode: str | None,
    phase_steps: int = 5,
) -> dict[str, Any]:
    """Measure as described in the module docstring; ``compile_mode=None`` runs eagerly."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    torch.manual_seed(cfg.train.seed)
    system = MegaContext(cfg).to(device)
    layout, B = system.layout, cfg.train.batch_size
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    compile_fn = partial(compile_step, mode=compile_mode) if compile_mode else (lambda f: f)

    def mc_inputs():
        window = torch.randint(0, vocab, (B, layout.T + 1), device=device, generator=gen)
        return window, draw_variant_noise(layout, B, gen, device, cfg.mc.alloc_iterations)

    with torch.no_grad():
        supervised = build_contexts(system, *mc_inputs())[0].valid  # [B·V, W]: the positions the MC step trains on

    def plain_inputs():
        tokens = torch.randint(0, vocab, (B * layout.V, layout.W + 1), device=device, generator=gen)
        return tokens[:, :-1], torch.where(supervised, tokens[:, 1:], -1)  # -1: no target

    plain_fn = compile_fn(plain_entries_step)
    lens_weights = lens_weight_tensors(cfg.mc, device)
    if system.lensnet is not None:
        mc_fn = partial(compile_fn(process_batch_lens), lens_weights=lens_weights)
    else:
        mc_fn = compile_fn(process_batch)

    def mc_step(inputs):
        with autocast:
            out = mc_fn(system, *inputs)
        total_loss(out).backward()
        system.zero_grad(set_to_none=True)

    def plain_step_(inputs):
        with autocast:
            out = plain_fn(system.base, *inputs)
        total_loss(out).backward()
        system.zero_grad(set_to_none=True)

    timer = Timer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    first_mc = timer(mc_step, mc_inputs())
    first_plain = timer(plain_step_, plain_inputs())
    for _ in range(warmup - 1):
        mc_step(mc_inputs())
        plain_step_(plain_inputs())
    frames_after_warmup = _compiled_frames()
    mc_ms, plain_ms = [], []
    for _ in range(steps):
        inputs, tokens = mc_inputs(), plain_inputs()
        mc_ms.append(timer(mc_step, inputs))
        plain_ms.append(timer(plain_step_, tokens))
    recompiles = _compiled_frames() - frames_after_warmup
    mc_med, plain_med = statistics.median(mc_ms), statistics.median(plain_ms)
    phases = time_phases(system, mc_inputs, compile_fn, timer, autocast, warmup, phase_steps, lens_weights)
    glue = phases["variants_ms"] + phases["assemble_ms"] + phases["losses_ms"]
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "compiled": compile_mode is not None,
        "compile_mode": compile_mode,
        "shapes": {
            "B": B,
            "T": layout.T,
            "K": layout.K,
            "LODmax": layout.L,
            "W": layout.W,
            "H": layout.H,
            "N": layout.N,
            "V": layout.V,
            "vocab": vocab,
            "n_layer": cfg.model.n_layer,
            "n_embd": cfg.model.n_embd,
            "gist_width": cfg.gist_width,
        },
        "steps_timed": steps,
        "mc_step_ms": mc_med,
        "plain_step_ms": plain_med,
        "ratio_mc_over_plain": mc_med / plain_med,
        "phases": phases,
        "glue_ms": glue,
        "glue_frac": glue / mc_med,
        "supervised_entries": int(supervised.sum()),
        # The first call of each step compiles; eager runs have nothing to report here.
        "compile_s": max(0.0, (first_mc - mc_med + first_plain - plain_med) / 1e3) if compile_mode else None,
        "graph_breaks": _graph_breaks(),
        "recompiles": recompiles,
        "peak_mem_mb": peak,
        "tokens_per_s": B * layout.T / (mc_med / 1e3),
        "entries_per_s": B * layout.V * layout.W / (mc_med / 1e3),
    }


def plain_entries_step(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The plain GPT's next-token loss, averaged over the positions with a target (``targets >= 0``)."""
    nll = model.nll(model.token_hidden(tokens), targets)
    return {"loss_lm": nll.sum() / (targets >= 0).sum()}


def time_phases(
    system: MegaContext,
    mc_inputs,
    compile_fn,
    timer: Timer,
    autocast,
    warmup: int,
    steps: int,
    lens_weights: dict[str, torch.Tensor],
) -> dict[str, float]:
    layout, base = system.layout, system.base
    table = system.node_table

    def tree_fn(window):
        return build_tree(system.gistnet, base.embed(window[:, : layout.T]), layout).emb

    def as_tree(tree_emb):
        return Tree(emb=tree_emb, batch_size=[tree_emb.size(0)])

    def variants_fn(tree_emb, window, noise):
        return choose_variants(system, as_tree(tree_emb), window, noise)

    def assemble_fn(tree_emb, shown, window):
        return assemble(as_tree(tree_emb), shown, window, layout, table)

    def base_fn(emb, position, span, target):
        return base.nll(base.hidden(emb, position, span), target)

    def losses_fn(nll, wc):
        return total_loss(variant_losses(nll, tail_nll(nll, wc, layout), wc, layout))

    def lens_loss_fn(scores, shown, tails, wc):
        return lens_losses(scores, shown, tails, wc, layout, table, lens_weights, system.use_rank)["loss_lens"]

    tree_c, variants_c, assemble_c = compile_fn(tree_fn), compile_fn(variants_fn), compile_fn(assemble_fn)
    base_c, losses_c = compile_fn(base_fn), compile_fn(losses_fn)
    window, noise = mc_inputs()
    with torch.no_grad(), autocast:
        tree_emb = tree_fn(window).float()
        shown = variants_fn(tree_emb, window, noise)
        wc = assemble_fn(tree_emb, shown, window)
        nll = base_fn(wc.emb, wc.position, wc.span.float(), wc.target).float()
        tails = tail_nll(nll, wc, layout)

    def run_tree():
        with autocast:
            emb = tree_c(window)
        emb.float().square().mean().backward()

    def run_variants():
        with torch.no_grad(), autocast:
            variants_c(tree_emb, window, noise)

    leaf_tree = tree_emb.detach().requires_grad_()

    def run_assemble():
        with autocast:
            out = assemble_c(leaf_tree, shown, window)
        out.emb.float().square().mean().backward()

    leaf_emb = wc.emb.detach().requires_grad_()

    def run_base():
        with autocast:
            out = base_c(leaf_emb, wc.position, wc.span.float(), wc.target)
        out.mean().backward()

    leaf_nll = nll.detach().requires_grad_()

    def run_losses():
        losses_c(leaf_nll, wc).backward()

    runs = [
        ("tree_ms", run_tree),
        ("variants_ms", run_variants),
        ("assemble_ms", run_assemble),
        ("base_ms", run_base),
        ("losses_ms", run_losses),
    ]
    if system.lensnet is not None:
        lens_c, lens_loss_c = compile_fn(system.lensnet), compile_fn(lens_loss_fn)
        with torch.no_grad(), autocast:
            leaf_scores = system.lensnet(wc).float().requires_grad_()

        def run_lens_fwd():
            with autocast:
                scores = lens_c(wc)
            scores.float().square().mean().backward()

        def run_lens_loss():
            lens_loss_c(leaf_scores, shown, tails, wc).backward()

        runs += [("lens_fwd_ms", run_lens_fwd), ("lens_loss_ms", run_lens_loss)]
    phases = {}
    for name, fn in runs:
        for _ in range(warmup):
            fn()
        phases[name] = statistics.median(timer(fn) for _ in range(steps))
        system.zero_grad(set_to_none=True)
    return phases


def _seconds(value: float | None) -> str:
    return "n/a (eager)" if value is None else f"{value:.1f} s"


def format_table(result: dict[str, Any]) -> str:
    s = result["shapes"]
    lines = [
        f"device {result['device']}  compiled {result['compiled']} ({result['compile_mode']})  "
        f"B={s['B']} T={s['T']} K={s['K']} LODmax={s['LODmax']} W={s['W']} H={s['H']} N={s['N']} "
        f"D={s['n_embd']} layers={s['n_layer']} vocab={s['vocab']}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| MC step (fwd+bwd) | {result['mc_step_ms']:.1f} ms |",
        f"| plain step, same [B·V, W] entries | {result['plain_step_ms']:.1f} ms |",
        f"| **ratio MC / plain** | **{result['ratio_mc_over_plain']:.3f}** |",
    ]
    lines += [f"| phase {k.removesuffix('_ms')} | {v:.1f} ms |" for k, v in result["phases"].items()]
    lines += [
        f"| glue (variants + assemble + losses) | {result['glue_ms']:.1f} ms "
        f"= {100 * result['glue_frac']:.1f}% of MC step |",
        f"| compile | {_seconds(result['compile_s'])} |",
        f"| graph breaks / recompiles | {result['graph_breaks']} / {result['recompiles']} |",
        f"| peak memory | {result['peak_mem_mb']:.0f} MB |",
        f"| tokens/s (history) | {result['tokens_per_s']:,.0f} |",
    ]
    return "\n".join(lines)
