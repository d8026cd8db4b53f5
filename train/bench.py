"""Benchmark the MegaContext step against the plain GPT step: ``python -m train.bench --profile NAME``.

Random tokens at the profile's shapes (compute does not depend on the text, so no corpus is needed);
compiled by default (``--eager`` to compare). Prints a table and writes ``--json FILE``. What is
measured and how is in :mod:`mcfn.bench.benchmark`.

``python -m train.bench --decode RUN_DIR --prompt-file F`` instead times generation with a trained model:
MegaContext (warm and cold refocuses) against full context at several prompt lengths
(:mod:`mcfn.bench.decode_speed`).

``python -m train.bench --profile NAME --sweep-T 512,1024,...`` instead measures how the training step's cost grows
with the history: the plain step against the MC step with the teacher off, on and bounded, at each ``T``
(:mod:`mcfn.bench.sweep`); ``bench_sweep.json`` and ``bench_sweep.png`` go into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcfn.errors import UserError, exit_code
from mcfn.profile import parse_override, resolve
from train import add_rule_flags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="bench-ref")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each kind (medians are reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    p.add_argument("--phase-steps", type=int, default=5, help="timed steps of each phase alone (0: no phases)")
    p.add_argument("--eager", action="store_true", help="do not compile")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: CUDA where there is one)")
    p.add_argument(
        "--typecheck-cost",
        action="store_true",
        help="instead: time an eager step and evaluation with the runtime shape checks on and off",
    )
    p.add_argument(
        "--lens-entries",
        type=int,
        default=0,
        metavar="N",
        help="also time LensNet's forward over one working context of N entries (mcfn.bench.lens)",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    decode = p.add_argument_group("decode speed (instead of the step)")
    decode.add_argument("--decode", type=Path, metavar="RUN_DIR", help="time generation with this trained MC run")
    decode.add_argument("--prompt-file", type=Path, help="UTF-8 text; its first tokens are the prompts")
    decode.add_argument("--lengths", default="1024,4096,16384,32768", help="prompt lengths in tokens")
    decode.add_argument("--new-tokens", type=int, default=256)
    decode.add_argument("--repeats", type=int, default=3, help="runs of each mode per length (medians reported)")
    add_rule_flags(decode)
    decode.add_argument(
        "--refill-chunk", type=int, help="entries a compiled refill runs at once (MC modes; default: generation's)"
    )
    decode.add_argument("--modes", default="mc,mc_prefix,mc_cold,recency,full", help="which decoding modes to time")
    sweep = p.add_argument_group("cost against the history's length (instead of the step)")
    sweep.add_argument("--sweep-T", help="comma-separated history lengths T, at the profile's W")
    sweep.add_argument("--window", type=int, default=128, help="tokens each position of the bounded teacher reads")
    sweep.add_argument(
        "--grad-blocks", type=int, default=256, help="blocks a level GistNet's gradient reaches in mc_sparse"
    )
    sweep.add_argument("--conditions", default="plain,mc,mc_teacher,mc_bounded", help="which conditions to measure")
    sweep.add_argument("--point-cap", type=float, default=600.0, help="seconds one point may take before it is skipped")
    sweep.add_argument(
        "--warm-first", action="store_true", help="compile every point at once first (fills the caches; many cores)"
    )
    sweep.add_argument("--out", type=Path, default=Path("."), help="where bench_sweep.json and bench_sweep.png go")
    sweep.add_argument("--sweep-point", help=argparse.SUPPRESS)  # one point, in the process the sweep starts
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.decode is not None:
        return exit_code(lambda: decode_benchmark(args))
    if args.sweep_point is not None:
        return exit_code(lambda: sweep_point(json.loads(args.sweep_point)))
    if args.sweep_T is not None:
        return exit_code(lambda: sweep_benchmark(args))
    try:
        cfg = resolve(args.profile, [parse_override(o) for o in args.overrides] + [("mc", "enabled", True)])
        if args.steps < 1 or args.warmup < 1:
            raise UserError("--steps and --warmup must be >= 1")
        if args.lens_entries and args.lens_entries < cfg.mc.tail:
            raise UserError(f"--lens-entries must be 0 or at least mc.tail = {cfg.mc.tail}")
        from mcfn.bench.benchmark import format_table, run_benchmark, typecheck_cost
        from mcfn.shell.devices import padded_vocab, resolve_device

        vocab, device = padded_vocab(cfg.data.vocab_size), resolve_device(args.device)
        if args.typecheck_cost:
            result = typecheck_cost(cfg, vocab, device, args.steps, evaluate_batch)
        else:
            mode = None if args.eager else cfg.train.compile_mode
            result = run_benchmark(
                cfg,
                vocab,
                device,
                args.steps,
                args.warmup,
                mode,
                args.phase_steps,
                progress=bench_progress,
                lens_entries=args.lens_entries,
            )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["profile"] = args.profile
    text = "\n".join(f"{k}: {v}" for k, v in result.items()) if args.typecheck_cost else format_table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def evaluate_batch(system, window) -> None:
    """The held-out evaluation of one batch ``window [B, T + 1]`` at the default budgets, on the corpus: what
    ``--typecheck-cost`` times beside the step."""
    import torch

    from mcfn.evaluation.batch import EvalSettings, evaluation_budgets
    from mcfn.evaluation.evaluate import score_tasks
    from mcfn.evaluation.held_out import HeldOut

    token_bytes = torch.ones(system.base.wte.weight.size(0), dtype=torch.int64, device=window.device)
    budgets = evaluation_budgets(system.layout, None, system.refocus_every)
    score_tasks(
        system,
        HeldOut([window], token_bytes),
        EvalSettings(budgets, tasks=("corpus",), refocus_every=system.refocus_every),
    )


def bench_progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)


def sweep_benchmark(args: argparse.Namespace) -> None:
    from mcfn.bench.sweep import CONDITIONS, format_sweep_table, plot_sweep, run_sweep, sweep_lod_max

    try:
        lengths = [int(n) for n in args.sweep_T.split(",")]
    except ValueError:
        raise UserError(f"--sweep-T must be comma-separated integers, got {args.sweep_T!r}") from None
    if args.steps < 1 or args.warmup < 1 or args.point_cap <= 0:
        raise UserError("--steps and --warmup must be >= 1, --point-cap > 0")
    cfg = resolve(args.profile, [parse_override(o) for o in args.overrides] + [("mc", "enabled", True)])
    for T in lengths:  # refuse a length no tree fits before anything runs
        sweep_lod_max(T, cfg)
    conditions = tuple(c.strip() for c in args.conditions.split(","))
    if not set(conditions) <= set(CONDITIONS):
        raise UserError(f"--conditions must name some of {', '.join(CONDITIONS)}")
    rows = run_sweep(
        args.profile,
        args.overrides,
        lengths,
        args.window,
        args.steps,
        args.warmup,
        args.eager,
        args.point_cap,
        progress=lambda line: print(f"[sweep] {line}", file=sys.stderr, flush=True),
        conditions=conditions,
        warm_first=args.warm_first,
        grad_blocks=args.grad_blocks,
        device=args.device,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_sweep.json").write_text(json.dumps(rows, indent=2))
    plot_sweep(rows, args.out / "bench_sweep.png")
    print(f"profile {args.profile}, W={cfg.mc.budget}, B={cfg.train.batch_size}, teacher window {args.window}, "
          f"compiled {not args.eager}, median of {args.steps} steps")  # fmt: skip
    print(format_sweep_table(rows))


def sweep_point(spec: dict) -> None:
    """One point of the sweep, in a process of its own: its row as the last line of stdout."""
    from mcfn.bench.sweep import measure_point, point_config
    from mcfn.config import RunConfig
    from mcfn.shell.devices import padded_vocab, resolve_device

    cfg: RunConfig = resolve(
        spec["profile"], [parse_override(o) for o in spec["overrides"]] + [("mc", "enabled", True)]
    )
    point = point_config(cfg, spec["T"], spec["condition"], spec["window"], spec["grad_blocks"])
    device = resolve_device(spec["device"])
    mode = None if spec["eager"] else point.train.compile_mode
    row = measure_point(
        point, spec["condition"], padded_vocab(point.data.vocab_size), device, spec["steps"], spec["warmup"], mode
    )
    print(json.dumps(row))


def decode_benchmark(args: argparse.Namespace) -> None:
    import torch

    from mcfn.bench.decode_speed import MODES, format_decode_table, run_decode_benchmark
    from mcfn.bench.operators import counted_kernels
    from mcfn.core.cadence import resolved_rule, rule_name
    from mcfn.inference.decode import REFILL_CHUNK, decoding_compiler
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.restore import load_shipped

    try:
        lengths = [int(n) for n in args.lengths.split(",")]
        text = args.prompt_file.read_text(encoding="utf-8") if args.prompt_file else None
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise UserError(f"--lengths must be integers and --prompt-file readable UTF-8 text: {e}") from None
    modes = tuple(args.modes.split(","))
    if not set(modes) <= set(MODES):
        raise UserError(f"--modes takes {', '.join(MODES)}; got {args.modes}")
    chunk_ok = args.refill_chunk is None or args.refill_chunk >= 1
    if text is None or min(lengths) < 1 or args.new_tokens < 1 or args.repeats < 1 or not chunk_ok:
        raise UserError("--decode needs --prompt-file, and --lengths, --new-tokens, --repeats, --refill-chunk >= 1")
    lacks = "no working context to decode beside full context"
    trained, shipped, policy = load_shipped(args.decode, resolve_device(args.device), lacks)
    tok = trained.corpus.tokenizer
    ids = torch.tensor([tok.bos_id, *tok.encode(text)], device=trained.token_bytes.device)
    if ids.numel() < max(lengths):
        raise UserError(f"{args.prompt_file} gives {ids.numel()} tokens; --lengths asks for {max(lengths)}")
    compile_fn = None if args.eager else decoding_compiler(trained.cfg.train.compile_mode)
    # MC decodes with the shipped policy, under its rule unless the flags say
    on, refocus_every = resolved_rule(policy.rule, trained.cfg.mc.refocus_every, args.refocus_on, args.refocus_every)
    with counted_kernels():  # the graphs compiled record their kernels, which the operator count reads
        say = lambda line: print(f"[decode] {line}", file=sys.stderr)  # noqa: E731
        rows = run_decode_benchmark(trained.model, ids, lengths, args.new_tokens, args.repeats, refocus_every,
                                    compile_fn, progress=say, modes=modes, policy=policy, on=on,
                                    refill_chunk=args.refill_chunk or REFILL_CHUNK)  # fmt: skip
    print(
        f"compiled {not args.eager}, {args.new_tokens} new tokens, greedy, MC with the shipped {shipped} refocusing "
        f"{rule_name(on, refocus_every)}, median of {args.repeats}"
    )
    print(format_decode_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())
