"""Serve a run: ``python -m train.serve --ckpt DIR [--host 127.0.0.1] [--port 8000] [--compile]``.

``POST /v1/completions`` and ``GET /v1/models`` in the OpenAI protocol (any OpenAI client works against
``http://HOST:PORT/v1``), decoded with the policy and refocus rule the run ships unless a request names another
(``context``, an extension field: ``train.generate``'s ``--context`` names); the page at ``/`` streams a completion and
draws where the model looks at each refocus. One decode at a time, in arrival order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcfn.errors import UserError, exit_code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.serve", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True, help="run directory (or its checkpoint.pt)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=1024, help="the most tokens a request may ask for")
    p.add_argument("--max-prompt-tokens", type=int, default=131_072, help="longer prompts are refused (413)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--compile", action="store_true", help="compile the decoder's graphs, as train.generate --compile")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads the decoder uses (default: torch's count less one, left to HTTP and its clients)",
    )
    return p.parse_args(argv)


def served_run(args: argparse.Namespace):
    """The run loaded once, behind its decode worker: what the app serves."""
    from mcfn.inference.decode import decoding_compiler
    from mcfn.serve.app import Served
    from mcfn.serve.worker import DecodeWorker
    from mcfn.shell.devices import resolve_device
    from mcfn.shell.restore import load_shipped

    if args.max_tokens < 1 or args.max_prompt_tokens < 2:
        raise UserError("--max-tokens must be >= 1 and --max-prompt-tokens >= 2")
    device = resolve_device(args.device)
    trained, shipped, policy = load_shipped(args.ckpt, device, "train.serve serves MegaContext runs")
    compile_fn = decoding_compiler(trained.cfg.train.compile_mode) if args.compile else None
    worker = DecodeWorker(trained.model, trained.corpus.tokenizer, device, trained.cfg.mc.refocus_every, compile_fn)
    run_dir = args.ckpt if args.ckpt.is_dir() else args.ckpt.parent
    return Served(worker, run_dir.resolve().name, (shipped, policy), args.max_tokens, args.max_prompt_tokens)


def run(args: argparse.Namespace) -> None:
    import threading

    import torch
    import uvicorn

    from mcfn.serve.app import build_app

    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be >= 1")
    # Set before the model loads, so that its one OpenMP team has this size. A core is left to the HTTP side and its
    # clients: while the decode runs, its OpenMP helper spins a whole core (LABLOG, thirty-eighth session).
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))
    served = served_run(args)
    config = uvicorn.Config(build_app(served), host=args.host, port=args.port, log_level="warning")
    http = uvicorn.Server(config)

    def answer_http() -> None:
        try:
            http.run()
        finally:  # the server stopped (or never bound its port): so does the decoder
            served.worker.stop()

    print(f"[serve] {served.model_name} on http://{args.host}:{args.port} (page at /, API at /v1)", file=sys.stderr)
    listener = threading.Thread(target=answer_http, name="mcfn-http", daemon=True)
    listener.start()
    try:
        served.worker.serve()  # decoding on the thread that loaded the model (DecodeWorker says why)
    except KeyboardInterrupt:  # Ctrl-C: stop serving
        pass
    finally:
        http.should_exit = True
        listener.join(timeout=10)
    if not http.started:
        raise UserError(f"could not serve on {args.host}:{args.port} (uvicorn's message is above)")


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
