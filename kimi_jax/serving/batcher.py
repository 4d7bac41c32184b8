"""Continuous batching over the generation engine: a fixed number of slots, one device loop, rows that join and
leave between dispatches.

One thread owns the device. Each turn of its loop it
1. admits waiting requests into free slots: the prompt is prefilled alone (batch 1, the same cache length and
   output length as the batch) and ``engine.join`` writes that row into the running batch state;
2. delivers every slot's new tokens to its request and retires finished slots (eos, max_tokens, a stop string
   or a disconnect seen by the HTTP side): ``engine.retire`` marks them done, so they stop emitting;
3. runs ``rounds_per_dispatch`` rounds of the whole batch in one dispatch (``engine.chunk_program``).
A slot freed in step 2 is reused in step 1 of the next turn; the other rows never stop.

What one batch shares, because it is one compiled program: the method and budget (the server's), greedy or
sampling, the temperature and the random key. A request whose temperature differs from the running batch's
waits until that batch drains (greedy requests batch with each other, sampling requests with the same
temperature batch with each other); ``seed`` is honoured only by a sampling request that starts a batch.
Every program (the batch's rounds, the prefill of each prompt-length bucket, join, retire) is compiled by
``warm()`` before the server listens.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np

from kimi_jax import sharding
from kimi_jax.api import Model, Request, bucket
from kimi_jax.decoding import engine
from kimi_jax.decoding.engine import GenerationError


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the HTTP layer answers 429."""


@dataclasses.dataclass(eq=False)
class Job:
    """One generation, as the batcher sees it. ``emit(tokens)`` and ``finish(reason)`` are called from the
    batcher thread (the HTTP side wraps them to hop onto its event loop)."""
    ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    emit: Callable[[list[int]], None]
    finish: Callable[[str], None]
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    sent: int = 0

    def cancel(self):
        """Free the slot at the next dispatch (client gone, or a stop string was seen)."""
        self.cancelled.set()

    @property
    def group(self):
        return (self.temperature > 0, self.temperature if self.temperature > 0 else 0.0)


@dataclasses.dataclass
class Stats:
    """Counters the metrics endpoint reads (written by the batcher thread only)."""
    rounds: int = 0
    row_rounds: int = 0          # rounds x rows that were running: the denominator of mean tau
    tokens: int = 0
    dispatches: int = 0

    @property
    def mean_tau(self) -> float:
        return self.tokens / self.row_rounds if self.row_rounds else 0.0


class Batcher:
    def __init__(self, model: Model, *, max_batch: int = 8, max_new: int = 256, max_len: int | None = None,
                 method: str | None = None, budget=None, rounds_per_dispatch: int = 4, queue_size: int = 64):
        if model.runtime.page_size:
            # join() writes a prefilled row into its slot of one contiguous block; a page pool needs an allocator.
            raise GenerationError("the server's batch slots use the contiguous cache: load the model with "
                                  "Runtime(page_size=0)")
        self.model = model
        self.method = method or ("ddtree" if model.drafter is not None else "ar")
        self.budget = budget
        self.max_batch, self.max_new, self.rounds = max_batch, max_new, rounds_per_dispatch
        self.specs = {s: model.spec(self.method, budget, 1.0 if s else 0.0) for s in (False, True)}
        nodes = self.specs[False].nodes
        self.max_len = max_len or model.config.max_position_embeddings
        self.max_prompt = self.max_len - max_new - nodes - 1
        if self.max_prompt < 1:
            raise GenerationError(f"max_new {max_new} + tree {nodes + 1} leaves no room for a prompt in a cache of "
                                  f"{self.max_len}")
        self.buckets = sorted({min(bucket(n), self.max_prompt) for n in (1 << k for k in range(4, 31))
                               if n < 2 * self.max_prompt})
        self.queue_size = queue_size
        self.stats = Stats()
        self._waiting: collections.deque[Job] = collections.deque()
        self._slots: list[Job | None] = [None] * max_batch
        self._wake = threading.Condition()
        self._stop = False
        self._state = self._group = None
        self._costs = {}
        self._thread = threading.Thread(target=self._loop, name="kimi_jax-batcher", daemon=True)

    # ---- the HTTP side ----------------------------------------------------------------------------------------
    def check(self, ids: list[int], max_tokens: int) -> None:
        """The request fits this server (before it is queued): a GenerationError names the limit."""
        if max_tokens > self.max_new:
            raise GenerationError(f"max_tokens {max_tokens} exceeds this server's limit of {self.max_new} "
                                  "(start it with a larger --max-new-tokens)")
        if len(ids) > self.max_prompt:
            raise GenerationError(f"the prompt has {len(ids)} tokens; this server takes at most {self.max_prompt} "
                                  f"(cache of {self.max_len} minus max_new {self.max_new} and one tree)")
        self.model.encode(ids)                         # ids inside the vocabulary

    def submit(self, req: Job) -> None:
        with self._wake:
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue's bound); retry later")
            self._waiting.append(req)
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._slots)

    def start(self):
        self._thread.start()

    def stop(self):
        """Finish what is running and waiting, then end the device thread."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()

    # ---- programs ---------------------------------------------------------------------------------------------
    def warm(self, log=print) -> None:
        """Compile every program the loop can run, for greedy and for sampling batches."""
        t0 = time.perf_counter()
        for sample in (False, True):
            state = self._blank(sample)
            for t in self.buckets:
                row = self._prefill([1] * min(t, self.max_prompt), sample, 1.0, 0)
                state = engine.join(state, row, np.int32(0))
            state = engine.retire(state, np.ones(self.max_batch, bool))
            self._dispatch(state, sample)
        log(f"compiled {2 * len(self.buckets) + 2} programs for {self.max_batch} slots, prompts up to "
            f"{self.max_prompt} tokens, {self.method} in {time.perf_counter() - t0:.1f}s")

    def _cost_table(self, sample):
        spec = self.specs[sample]
        if not spec.widths:
            return None
        if sample not in self._costs:
            blank = Request(spec, np.zeros((self.max_batch, self.buckets[0]), np.int32),
                            np.ones(self.max_batch, np.int32), self.max_new, self.max_len)
            self._costs[sample] = np.asarray(self.model.cost_table(blank), np.float32)
        return self._costs[sample]

    def _prefill(self, ids, sample, temperature, seed):
        t = next(b for b in self.buckets if b >= len(ids))
        prompt = np.zeros((1, t), np.int32)
        prompt[0, :len(ids)] = ids
        args = self.model.inputs(prompt, np.asarray([len(ids)], np.int32), temperature, seed)
        costs = self._cost_table(sample)
        with sharding.mesh_context(self.model.mesh):
            state, _ = engine.prefill_program(*args, costs, spec=self.specs[sample], max_new=self.max_new,
                                              max_len=self.max_len)
        return state

    def _blank(self, sample, temperature=1.0, seed=0):
        """A batch state with every slot free (done)."""
        prompt = np.ones((self.max_batch, self.buckets[0]), np.int32)
        args = self.model.inputs(prompt, np.ones(self.max_batch, np.int32), temperature, seed)
        with sharding.mesh_context(self.model.mesh):
            state, _ = engine.prefill_program(*args, self._cost_table(sample), spec=self.specs[sample],
                                              max_new=self.max_new, max_len=self.max_len)
        return engine.retire(state, np.ones(self.max_batch, bool))

    def _dispatch(self, state, sample):
        drafter = self.model.drafter_params
        with sharding.mesh_context(self.model.mesh):
            state, _ = engine.chunk_program(self.model.compute_params, drafter, state, self._cost_table(sample),
                                            spec=self.specs[sample], rounds=self.rounds)
        return state

    # ---- the device loop ---------------------------------------------------------------------------------------
    def _loop(self):
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self.active:
                    self._wake.wait()
                if self._stop and not self._waiting and not self.active:
                    return
            try:
                self._admit()
                self._deliver()
                if self.active:
                    self._run_rounds()
            except Exception as e:          # a device failure ends every running request, loudly
                for i, r in enumerate(self._slots):
                    if r is not None:
                        r.finish(f"error: {type(e).__name__}: {e}")
                        self._slots[i] = None
                self._state = None

    def _admit(self):
        while True:
            with self._wake:
                free = [i for i, r in enumerate(self._slots) if r is None]
                if not free or not self._waiting:
                    return
                req = self._waiting[0]
                if req.cancelled.is_set():
                    self._waiting.popleft()
                    req.finish("cancelled")
                    continue
                if self.active and req.group != self._group:
                    return                 # waits until the running batch drains (see the module docstring)
                self._waiting.popleft()
            sample, temperature = req.group
            if not self.active and (self._state is None or sample or req.group != self._group):
                # a new batch: the temperature and the key are the batch's (greedy batches are reused)
                self._group = req.group
                self._state = self._blank(sample, max(temperature, 1e-6), req.seed)
            row = self._prefill(req.ids, sample, max(temperature, 1e-6), req.seed)
            self._state = engine.join(self._state, row, np.int32(free[0]))
            self._slots[free[0]] = req

    def _deliver(self):
        if self._state is None:
            return
        n_out, out, done = jax.device_get((self._state.n_out, self._state.out, self._state.done))
        leaving = np.zeros(self.max_batch, bool)
        for i, req in enumerate(self._slots):
            if req is None:
                continue
            new = out[i, req.sent:min(n_out[i], req.max_tokens)].tolist()
            if new:
                req.sent += len(new)
                req.emit(new)
            eos = bool(set(new) & set(self.model.config.eos_token_ids))
            if req.cancelled.is_set() or eos or done[i] or req.sent >= req.max_tokens:
                req.finish("cancelled" if req.cancelled.is_set() else "stop" if eos else "length")
                self._slots[i] = None
                leaving[i] = True
        if leaving.any():
            self._state = engine.retire(self._state, leaving)

    def _run_rounds(self):
        before = int(self._state.rounds)
        running = self.active
        emitted = jax.device_get(self._state.n_out)
        self._state = self._dispatch(self._state, self._group[0])
        rounds = int(self._state.rounds) - before
        self.stats.rounds += rounds
        self.stats.row_rounds += rounds * running
        self.stats.tokens += int((jax.device_get(self._state.n_out) - emitted).sum())
        self.stats.dispatches += 1
