"""Generate text: ``python -m train.generate --ckpt DIR --prompt-file F [--max-new-tokens N] [--context NAME]``.

Every focus policy but ``full`` streams the prompt into the summary tree and decodes within the working context of
``W`` entries, refocused every ``--refocus-every`` tokens by the policy (its LOD layout is printed at each refocus:
one character per block of K tokens, 0 for tokens, 1 and 2 for gists, · not covered); every refocus after the
first starts from the previous context (``--warm-steps``). ``full`` decodes with the whole prompt at LOD0, for
comparison. Prints the continuation, then prompt and decode timings (tokens/s) on stderr.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

from mcfn.errors import UserError, exit_code
from train import add_reuse_flag, add_rule_flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from mcfn.core.focus import REFOCUS_STEPS, WARM_STEPS
    from mcfn.core.policy import policies

    p = argparse.ArgumentParser(prog="python -m train.generate", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="run directory (or its checkpoint.pt)")
    p.add_argument("--prompt-file", type=Path, required=True, help="UTF-8 text to continue (any length)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, help="keep only the first N tokens of the prompt")
    p.add_argument(
        "--context",
        choices=[policy.name for policy in policies() if policy.generates],
        help="the focus policy: refocus with LensNet (lens) or a training-free scorer (match: the n-gram match; attn: "
        "the base model's attention), keep the newest W - R tokens (recency: truncation, same cadence), or read the "
        "whole prompt (full); default: the policy the run ships (chosen on validation at the end of its training; "
        "report.md names it)",
    )
    add_rule_flags(p)
    add_reuse_flag(p)
    p.add_argument(
        "--refocus-steps",
        type=int,
        default=REFOCUS_STEPS,
        help="allocator steps of the first refocus, from the coarsest cut",
    )
    p.add_argument(
        "--warm-steps",
        type=int,
        default=WARM_STEPS,
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


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt file's text, once the flags are checked."""
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if args.refocus_steps < 1 or args.warm_steps < 0:
        raise UserError("--refocus-steps must be >= 1 and --warm-steps >= 0")
    try:
        return args.prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompt file {args.prompt_file}: {e}") from None


def show_layout(args: argparse.Namespace, n: int, layout: str) -> None:
    """Print a refocus's LOD layout (unless ``--quiet``)."""
    from mcfn.inference.render import fold

    if not args.quiet:
        print(f"[refocus] {n} tokens:", file=sys.stderr)
        for line in fold(layout):
            print(f"  {line}", file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    import torch

    from mcfn.core.cadence import resolved_rule, rule_name
    from mcfn.core.policy import FULL, POLICIES
    from mcfn.core.system import MegaContext
    from mcfn.inference.decode import decoding_compiler
    from mcfn.inference.generation import Sampling, generate_full, generate_mc
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.restore import load_trained

    text = prompt_text(args)
    device = resolve_device(args.device)
    trained = load_trained(args.ckpt, device)
    tok = trained.corpus.tokenizer
    ids = [tok.bos_id, *tok.encode(text)][: args.max_prompt_tokens]
    prompt = torch.tensor(ids, dtype=torch.int64, device=device)
    sampling = Sampling(args.temperature, args.top_k, args.seed)
    model = trained.model
    if args.context is not None:
        name, policy = args.context, POLICIES[args.context]
    elif trained.shipped is not None:
        shipped, policy = trained.shipped
        name = f"shipped ({shipped})"
    else:  # a plain GPT ships nothing: it reads the whole prompt
        name, policy = FULL.name, FULL
    compile_fn = decoding_compiler(trained.cfg.train.compile_mode) if args.compile else None
    if policy is not FULL:
        if not isinstance(model, MegaContext):
            raise UserError(f"{args.ckpt} holds a plain GPT (--no-mc run); use --context full")
        on, every = resolved_rule(policy.rule, trained.cfg.mc.refocus_every, args.refocus_on, args.refocus_every)
        name += f", refocus {rule_name(on, every)}"
        out, stats = generate_mc(
            model, prompt, args.max_new_tokens, every, args.refocus_steps, sampling, warm_steps=args.warm_steps,
            on_refocus=partial(show_layout, args), compile_fn=compile_fn, policy=policy, on=on, reuse=args.reuse,
        )  # fmt: skip
    else:
        base = model.base if isinstance(model, MegaContext) else model
        out, stats = generate_full(base, prompt, args.max_new_tokens, sampling, compile_fn)
    print(tok.decode(out.tolist()))
    extra = ""
    if policy is not FULL:
        extra = (f", refocus {stats.refocus_s:.2f} s of it ({stats.refocuses_per_token:.3f} refocuses a token, cache "
                 f"entries kept: {stats.cache_kept:.0%})")  # fmt: skip
    extra += f", compilation {stats.compile_s:.1f} s of it (excluded from tok/s)" if args.compile else ""
    print(
        f"[generate] {name}: prompt {stats.prompt_tokens} tokens read in {stats.prefill_s:.2f} s; "
        f"{stats.new_tokens} new tokens in {stats.decode_s:.2f} s = {stats.tokens_per_s:.1f} tok/s{extra}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
