"""`python -m kimi_jax.serve`: an OpenAI-compatible HTTP server with continuous batching over the engine.

With no arguments it serves the embedded default (checkpoints/target + checkpoints/drafter, DDTree with the
auto budget) on 127.0.0.1:8000. Every program is compiled before the port opens. SIGTERM or Ctrl-C closes the
port and lets running and queued requests finish for up to --shutdown-grace seconds; what is left then ends with
a 503 error (an error event in a stream), and the server exits: 0 after SIGTERM, 130 after Ctrl-C.

Across hosts (``--coordinator``/``--num-processes``/``--process-id``, or a detected cluster; ``--mesh`` is then
the global mesh): every process loads its shards and compiles the same programs; process 0 serves HTTP and sends
each step of the batch to the others (``kimi_jax.serving.peers``), which print nothing and ignore SIGTERM/Ctrl-C:
they stop when process 0 stops. A process that stops beating ends the run: process 0 answers its open requests
with 503 and exits 1, the others exit 1.

Access (docs/serving.md): API keys from --api-key, --api-key-file and $KIMI_JAX_API_KEY (without any the server is
open, and says so when it starts), the body limit, the per-key limit on requests in flight, read deadlines, TLS
and the audit line (one per request on stderr).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import ssl
import sys

from kimi_jax.cli import cluster
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
    p.add_argument("--no-processing", action="store_true",
                   help="serve without the processing programs (top_k/top_p/min_p, penalties, logit_bias, "
                        "response_format, strict tools, logprobs: a 400): half the programs, half the warm-up")
    p.add_argument("--lazy-compile", action="store_true",
                   help="compile each program when a request first needs it instead of every program before "
                        "listening: a quick start, but the first request of each kind, length and batch size waits "
                        "for its compiles (tests, development)")
    p.add_argument("--mesh", default=None, help="device mesh, e.g. tp=8")
    p.add_argument("--prefix-cache-pages", type=int, default=None,
                   help="pages of the prefix cache (default: as many tokens as max-batch full caches; 0 = off)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per prefix-cache page")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM/Ctrl-C (default 30)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="an API key clients must send as 'Authorization: Bearer KEY' on /v1 (repeatable; also "
                        "$KIMI_JAX_API_KEY, comma-separated, and --api-key-file). No key: the server is open")
    p.add_argument("--api-key-file", default=None, help="a file of API keys, one per line (# comments)")
    p.add_argument("--metrics-need-key", action="store_true", help="/metrics asks for the key too (default: open)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body (default: 32 bytes per token of --max-len, plus 1 MiB)")
    p.add_argument("--max-in-flight-per-key", type=int, default=None,
                   help="requests one key may have running or waiting (default with keys: half of --max-batch "
                        "plus --queue-size; without keys: no limit, or N per client address; 0 = no limit)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, and again its body (default 30)")
    p.add_argument("--log-request-bodies", action="store_true",
                   help="the audit line also holds the request body, prompt included (default: never)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    cluster.add_arguments(p)
    args = p.parse_args(argv)
    cluster.check_arguments(p, args)
    args.api_keys = _api_keys(p, args)
    _check_tls(p, args)
    if not 0 < args.read_timeout < float("inf"):
        p.error("--read-timeout must be a number of seconds > 0")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        p.error("--max-body-bytes must be >= 1")
    if args.max_in_flight_per_key is not None and args.max_in_flight_per_key < 0:
        p.error("--max-in-flight-per-key must be >= 0 (0: no limit)")
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


def _api_keys(p, args) -> tuple[str, ...]:
    """Every key from --api-key, $KIMI_JAX_API_KEY (comma-separated) and --api-key-file (one per line)."""
    keys = list(args.api_key) + [k.strip() for k in os.environ.get("KIMI_JAX_API_KEY", "").split(",") if k.strip()]
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--api-key-file: cannot read {args.api_key_file}: {getattr(e, 'strerror', None) or e}")
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            p.error(f"--api-key-file: {args.api_key_file} holds no key (one per line)")
        keys += from_file
    for key in keys:
        if not re.fullmatch(r"[\x21-\x7e]+", key):       # what an Authorization header can carry as one token
            p.error("an API key must be printable ASCII without spaces")
    return tuple(dict.fromkeys(keys))


def _check_tls(p, args) -> None:
    """The certificate and key load (a certificate file may hold its key); else one line that says why not."""
    if args.ssl_keyfile and not args.ssl_certfile:
        p.error("--ssl-keyfile needs --ssl-certfile")
    if not args.ssl_certfile:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except OSError as e:
        if isinstance(e, ssl.SSLError) and not args.ssl_keyfile:
            p.error(f"--ssl-certfile {args.ssl_certfile} holds no matching private key: give --ssl-keyfile ({e})")
        what = "--ssl-certfile/--ssl-keyfile" if args.ssl_keyfile else "--ssl-certfile"
        p.error(f"{what}: cannot load the certificate and key: {getattr(e, 'strerror', None) or e}")


def _access_line(args, app) -> str:
    """What the startup line says about who can use the server."""
    from kimi_jax.serving.access import key_id
    policy = app.state.policy
    limits = (f"bodies up to {policy.max_body_bytes} bytes, "
              f"{policy.max_in_flight or 'no limit on'} requests in flight per {'key' if args.api_keys else 'client'}")
    if not args.api_keys:
        return f"no API key: anyone who can reach the port can use it (--api-key); {limits}"
    return f"{len(args.api_keys)} API key(s) ({', '.join(map(key_id, args.api_keys))}); {limits}"


def _say(message: str) -> None:
    print(f"kimi_jax.serve: {message}", file=sys.stderr, flush=True)


def _follow(batcher, peers) -> int:
    """A follower's life after warm-up: process 0's steps until it stops (0), or one line and 1 when process 0
    is gone or a step failed here (the run cannot go on with its processes out of step)."""
    from kimi_jax.serving.peers import PeerLost
    try:
        batcher.follow()
    except PeerLost as e:
        _say(f"error: {e}")
        return 1
    except Exception as e:
        logging.getLogger("kimi_jax.serve").exception("process %d: a step failed", peers.index)
        _say(f"error: process {peers.index}: a step failed ({type(e).__name__}: {e}); the run ends")
        return 1
    return 0


def run(argv=None) -> int:
    args = _parse(argv)
    cluster.join(args, "kimi_jax.serve")
    persistent_compile_cache()
    import kimi_jax
    from kimi_jax.serving.access import AccessPolicy
    from kimi_jax.serving.batcher import Batcher
    from kimi_jax.serving.peers import Peers
    from kimi_jax.serving.server import create_app, serve, stop_now

    handler = logging.StreamHandler(sys.stderr)      # request failures: one line + the traceback, by request id
    handler.setFormatter(logging.Formatter("kimi_jax.serve: %(levelname)s: %(message)s"))
    logging.getLogger("kimi_jax.serve").addHandler(handler)
    logging.getLogger("kimi_jax.serve").propagate = False    # a library's basicConfig on the root would print it twice
    logging.getLogger("kimi_jax.serve.audit").setLevel(logging.INFO)     # one line per request
    peers = Peers.of_this_run(args.heartbeat_timeout)
    if peers is not None:
        peers.start_beating()
        if not peers.leader:            # process 0 decides when the run ends
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    model = kimi_jax.load(args.checkpoint, drafter=drafter_dir(args), mesh=args.mesh)
    batcher = Batcher(model, max_batch=args.max_batch, max_new=args.max_new_tokens, max_len=args.max_len,
                      method=args.method, budget=None if args.budget == "auto" else args.budget,
                      rounds_per_dispatch=args.rounds_per_dispatch, dispatch_ms=args.dispatch_ms,
                      queue_size=args.queue_size,
                      prefix_pages=args.prefix_cache_pages, page_size=args.page_size, peers=peers,
                      processing=not args.no_processing)
    if not args.lazy_compile:
        batcher.warm(log=_say if cluster.leader() else lambda m: None)
    if peers is not None and not peers.leader:
        return _follow(batcher, peers)
    batcher.start()
    policy = AccessPolicy(api_keys=args.api_keys, max_body_bytes=args.max_body_bytes,
                          max_in_flight=args.max_in_flight_per_key, read_timeout=args.read_timeout,
                          metrics_need_key=args.metrics_need_key, log_bodies=args.log_request_bodies)
    app = create_app(batcher, model.config.name, policy)
    batcher.on_lost = lambda why: stop_now(app)
    if peers is not None:
        peers.watch(batcher.lose)
    scheme = "https" if args.ssl_certfile else "http"
    across = f" over {peers.count} processes" if peers is not None else ""
    _say(f"{batcher.method} with {args.max_batch} slots{across} on {scheme}://{args.host}:{args.port}; "
         f"{_access_line(args, app)}")
    # uvicorn drains on SIGTERM, then re-raises it to the handler it found: make that one return, so the drain
    # ends in status 0 (Ctrl-C ends in 130 through cli.exits once the drain is over).
    signal.signal(signal.SIGTERM, lambda *_: None)
    serve(app, args.host, args.port, args.shutdown_grace, args.ssl_certfile, args.ssl_keyfile)
    if batcher.lost:
        # the device thread may be inside a collective with the lost process, and JAX's exit would wait for it
        _say(f"error: {batcher.lost}; the requests in flight got 503")
        sys.stdout.flush()
        os._exit(1)
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
