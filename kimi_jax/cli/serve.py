"""`python -m kimi_jax.serve`: an OpenAI-compatible HTTP server with continuous batching over the engine.

With no arguments it serves the embedded default (checkpoints/target + checkpoints/drafter, DDTree with the
auto budget) on 127.0.0.1:8000. Every program is compiled before the port opens. SIGTERM or Ctrl-C closes the
port and lets running and queued requests finish for up to --shutdown-grace seconds; what is left then ends with
a 503 error (an error event in a stream), and the server exits: 0 after SIGTERM, 130 after Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from kimi_jax.cli.decode import DEFAULT_TARGET, OneLineParser, drafter_dir, parse_budget, persistent_compile_cache
from kimi_jax.cli.exits import exit_with, run_command


def _parse(argv):
    p = OneLineParser(prog="python -m kimi_jax.serve", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(DEFAULT_TARGET), help="target checkpoint directory")
    p.add_argument("--drafter", default=None, help="drafter directory ('none' for AR only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="slots: requests generating at once")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the largest max_tokens a request may ask for")
    p.add_argument("--max-len", type=int, default=None, help="cache slots per request (default: the context)")
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default=None)
    p.add_argument("--budget", default="auto", help="DDTree node budget: 'auto' or a number of nodes")
    p.add_argument("--rounds-per-dispatch", type=int, default=None,
                   help="rounds per dispatch (default: as many as fill --dispatch-ms)")
    p.add_argument("--dispatch-ms", type=float, default=10.0,
                   help="target length of one dispatch: how long a new request may wait to join (default 10)")
    p.add_argument("--queue-size", type=int, default=64, help="waiting requests beyond which the server says 429")
    p.add_argument("--mesh", default=None, help="device mesh, e.g. tp=8")
    p.add_argument("--prefix-cache-pages", type=int, default=None,
                   help="pages of the prefix cache (default: as many tokens as max-batch full caches; 0 = off)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per prefix-cache page")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM/Ctrl-C (default 30)")
    args = p.parse_args(argv)
    if not 0 <= args.shutdown_grace < float("inf"):
        p.error("--shutdown-grace must be a number of seconds >= 0")
    args.budget = parse_budget(p, args.budget)
    if args.prefix_cache_pages is not None and args.prefix_cache_pages < 0:
        p.error("--prefix-cache-pages must be >= 0 (0 turns the prefix cache off)")
    if args.rounds_per_dispatch is not None and args.rounds_per_dispatch < 1:
        p.error("--rounds-per-dispatch must be >= 1")
    if not 0 < args.dispatch_ms < float("inf"):
        p.error("--dispatch-ms must be a number of milliseconds > 0")
    for name in ("max_batch", "max_new_tokens", "queue_size", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run(argv=None) -> int:
    args = _parse(argv)
    persistent_compile_cache()
    import kimi_jax
    from kimi_jax.serving.batcher import Batcher
    from kimi_jax.serving.server import create_app, serve

    handler = logging.StreamHandler(sys.stderr)      # request failures: one line + the traceback, by request id
    handler.setFormatter(logging.Formatter("kimi_jax.serve: %(levelname)s: %(message)s"))
    logging.getLogger("kimi_jax.serve").addHandler(handler)
    model = kimi_jax.load(args.checkpoint, drafter=drafter_dir(args), mesh=args.mesh)
    batcher = Batcher(model, max_batch=args.max_batch, max_new=args.max_new_tokens, max_len=args.max_len,
                      method=args.method, budget=None if args.budget == "auto" else args.budget,
                      rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ms=args.dispatch_ms,
                      queue_size=args.queue_size,
                      prefix_pages=args.prefix_cache_pages, page_size=args.page_size)
    batcher.warm(log=lambda m: print(f"kimi_jax.serve: {m}", file=sys.stderr, flush=True))
    batcher.start()
    app = create_app(batcher, model.config.name)
    print(f"kimi_jax.serve: {batcher.method} with {args.max_batch} slots on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    # uvicorn drains on SIGTERM, then re-raises it to the handler it found: make that one return, so the drain
    # ends in status 0 (Ctrl-C ends in 130 through cli.exits once the drain is over).
    signal.signal(signal.SIGTERM, lambda *_: None)
    serve(app, args.host, args.port, args.shutdown_grace)
    if not batcher.stop(timeout=5.0):
        # every response went out, but the device thread is still inside a dispatch: do not wait for it
        print("kimi_jax.serve: the device was still busy at exit; not waiting for it", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    return 0


def main(argv=None) -> int:
    return run_command("kimi_jax.serve", lambda: run(argv))


if __name__ == "__main__":
    exit_with(main())
