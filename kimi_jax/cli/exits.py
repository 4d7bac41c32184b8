"""How every command ends: its own status, one line on stderr and status 1 for input it cannot use, or one line
and status 130 on Ctrl-C (SIGINT). Neither reaches the user as a traceback.

Interrupted work leaves nothing half-written: checkpoints appear by atomic renames only, conversion resumes from
its last complete layer and target training from its last saved state (rerun the same command).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (a path, a file, a flag, a config): each message already names the fix."""
    from kimi_jax.config import ConfigError
    from kimi_jax.decoding.drafter import DrafterError
    from kimi_jax.decoding.engine import GenerationError
    from kimi_jax.sharding import ShardingError
    from kimi_jax.weights.checkpoint import CheckpointError
    return CheckpointError, ConfigError, DrafterError, GenerationError, ShardingError, OSError


def run_command(prog: str, body: Callable[[], int | None], extra_errors: tuple = ()) -> int:
    """body() -> its status (None = 0), with bad input and Ctrl-C turned into one line each."""
    # orbax logs its own warnings about the files it could not read through absl; our one line says it all.
    logging.getLogger("absl").setLevel(logging.ERROR)
    # Ctrl-C ends the process at once, between two Python bytecodes: no exception unwinds through a half-done
    # import or a C extension, and every write is a rename of a finished file, so nothing is left half-written.
    previous = signal.getsignal(signal.SIGINT)
    own = previous is not signal.SIG_IGN and threading.current_thread() is threading.main_thread()
    if own:
        signal.signal(signal.SIGINT, lambda *_: _interrupted(prog))
    try:
        return body() or 0
    except KeyboardInterrupt:
        _interrupted(prog)
    except user_errors() + tuple(extra_errors) as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    finally:
        if own:
            signal.signal(signal.SIGINT, previous)


def _interrupted(prog: str):
    sys.stdout.flush()
    sys.stderr.write(f"{prog}: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def exit_with(status: int):
    """End the process with ``status``. After a failure, skip the interpreter's teardown: the reads a failed
    orbax restore left running in tensorstore's threads need not finish (weights.checkpoint drops their reports)."""
    if status == 0:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
