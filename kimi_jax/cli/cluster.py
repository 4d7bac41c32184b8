"""Joining a run of several processes (hosts) from the command line: ``--coordinator``, ``--num-processes``,
``--process-id``, the flags every command that runs a model takes (decode, serve, the sweep).

With the three flags the process calls ``jax.distributed.initialize`` before JAX touches a device; without them
it joins where JAX's own cluster detection finds a launcher that starts one process per host (SLURM, Open MPI,
a TPU pod: the variables those set), and otherwise runs alone. Kubernetes is left to ``--coordinator auto``
(JAX's detection, every environment): every pod runs in Kubernetes, most of them alone. ``--mesh`` then names
the global mesh, over every process's devices (``kimi_jax.load`` refuses one that leaves devices out, naming the
meshes that fit).

Failure: a process that ends on an error or Ctrl-C leaves at once (``exits.exit_with``: no distributed
shutdown, which would wait for the others), so it stops heartbeating, and JAX's coordination service ends the
others after ``--heartbeat-timeout`` seconds instead of leaving them in a collective for good. Process 0 prints;
the others print nothing but their errors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

HEARTBEAT_TIMEOUT_S = 30        # a dead process ends the run within this (JAX's default is 100 s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("across processes (hosts)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address: join a run of --num-processes processes (jax.distributed); 'auto': "
                        "JAX's cluster detection (SLURM, Open MPI, Kubernetes, TPU pods)")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the run (with --coordinator)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 .. N-1 (with --coordinator)")
    g.add_argument("--heartbeat-timeout", type=int, default=HEARTBEAT_TIMEOUT_S, metavar="S",
                   help=f"seconds after which a silent process ends the run (default {HEARTBEAT_TIMEOUT_S})")


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """All three flags or none (or --coordinator auto alone); an index inside the run."""
    if args.coordinator == "auto":
        if args.num_processes is not None or args.process_id is not None:
            parser.error("--coordinator auto takes the process count and index from the cluster, not the flags")
        given = [False]
    else:
        given = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if any(given) and not all(given):
        parser.error("--coordinator, --num-processes and --process-id go together")
    if all(given):
        if args.num_processes < 1:
            parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
        if not 0 <= args.process_id < args.num_processes:
            parser.error(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
        if ":" not in args.coordinator:
            parser.error(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if args.heartbeat_timeout < 1:
        parser.error(f"--heartbeat-timeout must be >= 1 second, got {args.heartbeat_timeout}")


def detected_cluster() -> str | None:
    """The launcher environment JAX's own detection would join (its name), Kubernetes aside (module doc), or None.
    JAX keeps that detection private; where it moved, nothing is detected and the flags are the way in."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:
        return None
    for env in ClusterEnv._cluster_types:
        if env.opt_in_only_method or "k8s" in env.__name__.lower():
            continue
        with contextlib.suppress(Exception):
            if env.is_env_present():
                return env.__name__
    return None


def join(args, prog: str) -> None:
    """Join the run the flags (or the environment) describe, and say so on stderr (one line per process, once
    every process has connected); nothing for a process on its own, or one that has joined already."""
    import jax
    if jax.distributed.is_initialized():
        return
    timeouts = dict(heartbeat_timeout_seconds=args.heartbeat_timeout, initialization_timeout=300)
    if args.coordinator == "auto" or (args.coordinator is None and detected_cluster() is not None):
        jax.distributed.initialize(**timeouts)
    elif args.coordinator is not None:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id, **timeouts)
    else:
        return
    _native_prints_to_stderr()
    print(f"{prog}: process {jax.process_index()} of {jax.process_count()} joined ({jax.local_device_count()} of "
          f"{jax.device_count()} {jax.devices()[0].platform} devices here)", file=sys.stderr, flush=True)


def _native_prints_to_stderr() -> None:
    """Keep stdout for the command's output: the CPU's cross-process collectives (gloo) print their connection
    lines to the process's stdout from C++, in the middle of the JSON or text a user pipes on. From here on file
    descriptor 1 is stderr's, and Python's stdout writes to the original stdout through a descriptor of its own."""
    sys.stdout.flush()
    own = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(own, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def leader() -> bool:
    """Whether this process speaks for the run (process 0, or a process on its own)."""
    import jax
    return jax.process_index() == 0


def quiet_unless_leader():
    """A context in which a follower's stdout goes nowhere (process 0 prints the run's output)."""
    if leader():
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(open(os.devnull, "w"))
