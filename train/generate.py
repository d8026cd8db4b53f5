"""Generate text: ``python -m train.generate --ckpt DIR --prompt-file F [--max-new-tokens N] [--mode mc|full]``.

``mc`` streams the prompt into the summary tree and decodes within the working context of ``W`` entries,
refocused every ``--refocus-every`` tokens (its LOD layout is printed at each refocus: one character per
block of K tokens, 0 for tokens, 1 and 2 for gists, · not covered); every refocus after the first starts
from the previous context (``--warm-steps``). ``full`` decodes with the whole prompt at LOD0, for
comparison. Prints the continuation, then prompt and decode timings (tokens/s) on stderr.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

from mcfn.errors import UserError, exit_code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.generate", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="run directory (or its checkpoint.pt)")
    p.add_argument("--prompt-file", type=Path, required=True, help="UTF-8 text to continue (any length)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, help="keep only the first N tokens of the prompt")
    p.add_argument("--mode", choices=["mc", "full"], default="mc")
    p.add_argument(
        "--context",
        choices=["focus", "match", "recency"],
        default="focus",
        help="mc: refocus with LensNet (focus) or the training-free n-gram match (match), or keep the newest W - R "
        "tokens (recency: truncation, same cadence); the run's report says which its evaluation found best",
    )
    p.add_argument(
        "--refocus-every", type=int, help="tokens decoded between refocuses (mc; default: the run's mc.refocus_every)"
    )
    p.add_argument(
        "--refocus-steps", type=int, default=4, help="allocator steps of the first refocus, from the coarsest cut (mc)"
    )
    p.add_argument(
        "--warm-steps",
        type=int,
        default=1,
        help="allocator steps of each later refocus, from the previous context; 0: every refocus from the coarsest cut",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 for all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="do not print the LOD layout at each refocus")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--compile", action="store_true", help="compile the per-token decode step (one graph, fixed-capacity cache)"
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    import torch

    from mcfn.core.step import compile_step
    from mcfn.core.system import MegaContext
    from mcfn.inference.generation import Sampling, generate_full, generate_mc
    from mcfn.inference.render import fold
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.restore import load_trained

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if args.refocus_steps < 1 or args.warm_steps < 0:
        raise UserError("--refocus-steps must be >= 1 and --warm-steps >= 0")
    try:
        text = args.prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompt file {args.prompt_file}: {e}") from None
    device = resolve_device(args.device)
    trained = load_trained(args.ckpt, device)
    tok = trained.corpus.tokenizer
    ids = [tok.bos_id, *tok.encode(text)][: args.max_prompt_tokens]
    prompt = torch.tensor(ids, dtype=torch.int64, device=device)
    sampling = Sampling(args.temperature, args.top_k, args.seed)

    def show_layout(n: int, layout: str) -> None:
        if not args.quiet:
            print(f"[refocus] {n} tokens:", file=sys.stderr)
            for line in fold(layout):
                print(f"  {line}", file=sys.stderr)

    model = trained.model
    compile_fn = partial(compile_step, mode=trained.cfg.train.compile_mode) if args.compile else None
    if args.mode == "mc":
        if not isinstance(model, MegaContext):
            raise UserError(f"{args.ckpt} holds a plain GPT (--no-mc run); use --mode full")
        out, stats = generate_mc(
            model,
            prompt,
            args.max_new_tokens,
            trained.cfg.mc.refocus_every if args.refocus_every is None else args.refocus_every,
            args.refocus_steps,
            sampling,
            warm_steps=args.warm_steps,
            on_refocus=show_layout,
            compile_fn=compile_fn,
            context=args.context,
        )
    else:
        out, stats = generate_full(
            model.base if isinstance(model, MegaContext) else model, prompt, args.max_new_tokens, sampling, compile_fn
        )
    print(tok.decode(out.tolist()))
    extra = ""
    if args.mode == "mc":
        extra = f", refocus {stats.refocus_s:.2f} s of it (cache entries kept: {stats.cache_kept:.0%})"
    extra += f", compilation {stats.compile_s:.1f} s of it (excluded from tok/s)" if args.compile else ""
    print(
        f"[generate] {args.mode}: prompt {stats.prompt_tokens} tokens read in {stats.prefill_s:.2f} s; "
        f"{stats.new_tokens} new tokens in {stats.decode_s:.2f} s = {stats.tokens_per_s:.1f} tok/s{extra}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
