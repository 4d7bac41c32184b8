"""The processes of a multi-process run as the server sees them: process 0 (the leader) owns HTTP and decides
every step of the batch; the followers run the same steps on their devices, in the same order, because every
step is a program over the global mesh that all processes must enter together.

How a step travels: the leader writes it, numbered, to JAX's coordination key-value store (the service process
0 hosts for ``jax.distributed``; a host-side gRPC call, ~0.1 ms here) *before* running it itself, and each
follower blocks on the next number. A step is a short JSON list (``kimi_jax.serving.batcher``'s vocabulary:
admit, resize, retire, rounds, drop, stop). Why the store and not a device broadcast: it needs no program of its
own, carries prompts of any length without a shape per length, and a read has a timeout, so a follower notices a
leader that is gone instead of hanging in a collective.

Liveness: every process writes a beat to the store every ``BEAT_S``; a watcher thread reads the others'. JAX's
own coordination service ends every process with an abort once one has missed heartbeats for
``--heartbeat-timeout`` seconds; the watcher acts at a third of that, so the leader can still answer its open
requests with 503 and exit on its own terms, and a follower whose leader is gone exits with one line.

The store is JAX's private client (``jax._src.distributed.global_state.client``); ``of_this_run`` returns None
when there is one process, so nothing here runs in the usual case.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable

BEAT_S = 0.5
_PREFIX = "kimi_jax/serve"


class PeerLost(RuntimeError):
    """A process of the run stopped (no beat, or the store is gone with process 0)."""


class Peers:
    """This process's view of the run: ``publish`` (leader) and ``receive`` (followers) the steps in order."""

    def __init__(self, client, index: int, count: int, stale_s: float):
        self.client, self.index, self.count, self.stale_s = client, index, count, stale_s
        self._sent = self._read = 0
        self._last: dict[int, tuple] = {}       # process -> (its last beat seen, when it changed)
        self._stop = threading.Event()

    @classmethod
    def of_this_run(cls, heartbeat_timeout_s: float) -> Peers | None:
        """The run's peers, or None for a process on its own."""
        import jax
        if jax.process_count() == 1:
            return None
        from jax._src import distributed
        return cls(distributed.global_state.client, jax.process_index(), jax.process_count(),
                   stale_s=max(heartbeat_timeout_s / 3, 3 * BEAT_S))

    @property
    def leader(self) -> bool:
        return self.index == 0

    # ---- steps -------------------------------------------------------------------------------------------------
    def publish(self, step: list) -> None:
        """The next step, for every follower (the leader's; before it runs the step itself). The step 64 back is
        deleted: followers are at most a step or two behind, since every step's program waits for all processes."""
        self.client.key_value_set(f"{_PREFIX}/step/{self._sent}", json.dumps(step))
        if self._sent >= 64:
            self.client.key_value_delete(f"{_PREFIX}/step/{self._sent - 64}")
        self._sent += 1

    def receive(self) -> list:
        """The next step (a follower's), waiting as long as the leader is alive; PeerLost once it is not."""
        key = f"{_PREFIX}/step/{self._read}"
        while True:
            try:
                step = json.loads(self.client.blocking_key_value_get(key, 1000))
                self._read += 1
                return step
            except Exception as e:                  # a timeout while the leader is idle, or the store is gone
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise PeerLost(f"process 0 is gone ({str(e).splitlines()[0][:200]})") from None
                if (gone := self.silent()) is not None:
                    raise PeerLost(gone) from None

    # ---- liveness ----------------------------------------------------------------------------------------------
    def start_beating(self) -> None:
        """Write this process's beat every BEAT_S from a daemon thread (from before the first step on)."""
        def beat():
            n = 0
            while not self._stop.wait(BEAT_S):
                n += 1
                try:
                    self.client.key_value_set(f"{_PREFIX}/beat/{self.index}", str(n), allow_overwrite=True)
                except Exception:
                    return                          # the store is gone: the watcher or receive() says so
        threading.Thread(target=beat, name="kimi_jax-beat", daemon=True).start()

    def silent(self) -> str | None:
        """Which other process has not beaten for ``stale_s`` seconds (a sentence), or None. The first call
        only records the beats it sees."""
        now = time.monotonic()
        for other in range(self.count):
            if other == self.index:
                continue
            try:
                beat = self.client.key_value_try_get(f"{_PREFIX}/beat/{other}")
            except Exception:
                beat = None                          # not written yet, or the store is gone
            seen, since = self._last.get(other, (None, now))
            if beat != seen:
                self._last[other] = (beat, now)
            elif now - since > self.stale_s:
                return f"process {other} of {self.count} stopped (no beat for {now - since:.0f} s)"
        return None

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(sentence)`` once, from a daemon thread, when another process stops beating."""
        def run():
            while not self._stop.wait(BEAT_S):
                if (gone := self.silent()) is not None:
                    on_lost(gone)
                    return
        threading.Thread(target=run, name="kimi_jax-watch", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
