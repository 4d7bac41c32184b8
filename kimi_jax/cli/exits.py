"""How every command starts and ends. It starts on the CPU alone when no accelerator is attached and the user
chose no JAX platform (kimi_jax.cli.platform: no plugin tracebacks before our output). It ends with its own status,
one line on stderr and status 1 for input it cannot use, one line naming the extra to install and status 2 where an
optional dependency is missing (``EXTRAS``), or one line and status 130 on Ctrl-C (SIGINT), within
milliseconds even inside an XLA compile. Neither reaches the user as a traceback.

Interrupted work leaves nothing half-written: checkpoints appear by atomic renames only, conversion resumes from
its last complete layer and target training from its last saved state (rerun the same command).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from kimi_jax.cli.platform import choose_platforms

# (module, class) of the exceptions that mean bad input (a path, a file, a flag, a config): each message already
# names the fix.
_USER_ERRORS = (("kimi_jax.config", "ConfigError"), ("kimi_jax.decoding.drafter", "DrafterError"),
                ("kimi_jax.fields", "GenerationError"), ("kimi_jax.sharding", "ShardingError"),
                ("kimi_jax.weights.checkpoint", "CheckpointError"))

# The optional dependencies' modules and the extra of pyproject.toml that installs each: a command that needs one
# names the extra (status 2), never a traceback. jax's CUDA plugin comes with both cuda12 and compile; a command
# that runs on a GPU needs cuda12.
EXTRAS = {"fastapi": "serve", "starlette": "serve", "uvicorn": "serve", "h11": "serve", "prometheus_client": "serve",
          "jax_triton": "cuda12", "jax_cuda12_plugin": "cuda12", "libtpu": "compile"}

_commands: list[str] = []          # the run_command calls in progress, innermost last: Ctrl-C names the innermost
_exiting = threading.Lock()        # held for good by the first thread that prints "interrupted"


def user_errors() -> tuple[type[BaseException], ...]:
    """The bad-input exception classes, from the modules already imported only: an exception whose module was
    never imported cannot have been raised, and importing them here would load JAX just to report a bad flag."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in _USER_ERRORS)
    return tuple(cls for cls in found if cls is not None) + (OSError,)


def run_command(prog: str, body: Callable[[], int | None], extra_errors: tuple = ()) -> int:
    """body() -> its status (None = 0), with bad input and Ctrl-C turned into one line each."""
    choose_platforms()
    # orbax logs its own warnings about the files it could not read through absl; our one line says it all.
    logging.getLogger("absl").setLevel(logging.ERROR)
    _commands.append(prog)
    # Only the outermost call owns Ctrl-C: `python -m kimi_jax.decode` runs cli.decode.main, a run_command too.
    undo = _own_ctrl_c() if len(_commands) == 1 else None
    try:
        return body() or 0
    except KeyboardInterrupt:
        _interrupted(prog)
    except ModuleNotFoundError as e:
        module = (e.name or "").split(".")[0]
        if module not in EXTRAS:
            raise
        extra = EXTRAS[module]
        print(f"{prog}: error: it needs {module}, from the {extra} extra: pip install 'kimi-jax[{extra}]' (in a "
              f"checkout: .venv/bin/pip install -e '.[{extra}]')", file=sys.stderr)
        return 2
    except user_errors() + tuple(extra_errors) as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    finally:
        if undo is not None:
            undo()
        _commands.pop()


def _own_ctrl_c() -> Callable[[], None] | None:
    """Make Ctrl-C end the process at once: no exception unwinds through a half-done import or a C extension, and
    every write is a rename of a finished file, so nothing is left half-written. -> what undoes it, or None where
    Ctrl-C is not ours: off the main thread, or ignored (nohup, a shell's background job) and kept so.

    A Python handler runs only between two bytecodes of the main thread, seconds late inside an XLA compile. So
    the handler also gets a wakeup fd: the C-level handler writes the signal's number to it as the signal
    arrives, and a thread blocked on the other end ends the process. That thread runs during a compile because
    XLA releases the GIL while it compiles (measured: a 5 ms ticker thread never waited over 10 ms during a
    2.7 s compile)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        return None
    signal.signal(signal.SIGINT, _on_sigint)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)                   # set_wakeup_fd's requirement: a signal never blocks
    previous_fd = signal.set_wakeup_fd(write_end)
    if previous_fd != -1:
        # an event loop's: its own signals must keep reaching it, so Ctrl-C is the Python handler's alone here
        signal.set_wakeup_fd(previous_fd)
        os.close(write_end)
        os.close(read_end)
    else:
        threading.Thread(target=_watch, args=(read_end,), name="kimi_jax ctrl-c", daemon=True).start()

    def undo():
        if previous_fd == -1:
            signal.set_wakeup_fd(-1)
            os.close(write_end)                         # the watching thread reads end-of-file and stops
        signal.signal(signal.SIGINT, previous)
    return undo


def _on_sigint(*_):
    _interrupted(_commands[-1])


def _watch(read_end: int):
    with open(read_end, "rb", buffering=0) as pipe:
        while signals := pipe.read(64):
            # Only while ours is the Python handler: a server installs its own to drain its open requests first
            # (uvicorn does, under `python -m kimi_jax.serve`), and then that one decides.
            if signal.SIGINT in signals and signal.getsignal(signal.SIGINT) is _on_sigint:
                _interrupted(_commands[-1])


def _interrupted(prog: str):
    _exiting.acquire()                 # the handler and the watching thread may both get here: one line only
    with contextlib.suppress(OSError, ValueError):      # stdout may be a closed pipe; Ctrl-C must still exit
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
