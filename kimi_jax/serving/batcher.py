"""Continuous batching over the generation engine: a fixed number of slots, one device loop, rows that join and
leave between dispatches.

One thread owns the device. Each turn of its loop it
1. admits waiting requests into free slots: the prompt is prefilled alone (batch 1, the same cache length and
   output length as the batch) and ``join`` writes that row into the running batch state;
2. delivers every slot's new tokens to its request and retires finished slots (eos, max_tokens, a stop string
   or a disconnect seen by the HTTP side): ``retire`` marks them done, so they stop emitting;
3. runs rounds of the whole batch in one dispatch (``Programs.advance``: the chunk program ``Model.stream`` runs).
A slot freed in step 2 is reused in step 1 of the next turn; the other rows never stop.

Rounds per dispatch: as many as fill ``dispatch_ms`` (10 ms by default) at the round time measured on the
previous dispatches of the same slot bucket (4 before any is measured), or a fixed ``rounds_per_dispatch``. The
count is a run-time input of one program. Why by time: a dispatch costs the host ~0.5 ms here whatever it runs
(a lone request on this CPU spent a fifth of its time on it at 4 rounds of 0.55 ms), while a request that
arrives waits for the running dispatch to end before it can join, and tokens stream once per dispatch; a time
bound keeps both to ``dispatch_ms`` whether a round takes 0.5 ms (here) or 20 ms (a large model).

Slot buckets: the batch state holds a bucket of slots (1, 2, 4, ... up to ``max_batch``), not always
``max_batch``, because every dispatch computes all of its slots, busy or not (a lone request in 16 slots ran at
a sixth of its speed in one). A request that finds no free slot grows the state to the next bucket; when rows
leave, nothing waits and the rest fit a smaller bucket, the state shrinks and its rows are compacted
(``regroup``: one copy of the cache per change, never per dispatch).

Prefix caching (``kimi_jax.serving.prefix_cache``, on unless ``prefix_pages=0``): step 1's prefill starts after
the prompt's pages that an earlier prompt computed, copied from the store, and the prompt's new whole pages join
the store. The request's ``cached`` says how many prompt tokens that served.

What one batch shares, because it is one compiled program: the method and budget (the server's), greedy or
sampling, whether the logits processors run (``kimi_jax.decoding.processors``: any of top_k, top_p, min_p, the
penalties or logit_bias off its default, or structured output: ``response_format`` / ``regex``, each row with its
own automaton padded to the server's ``grammar_shape``; their values are each row's own), and the random key.
Each row samples at its own temperature (``engine.State.temperature`` is per row).
A request whose group differs from the running batch's waits until that batch drains (greedy requests batch
with each other, sampling requests with each other, each split by processors on or off); ``seed`` is honoured
only by a sampling request that starts a batch (the key is the batch's).
A request's ``max_tokens`` is its row's run-time limit (``engine.State.limit``): the row stops emitting there
inside the dispatch. Every program (the batch's rounds, join, retire and regroup for every slot bucket, the
prefill, whose prompt array has one width for every prompt length) comes from the model's program layer (``kimi_jax.decoding.programs``:
compiled with the platform's ``compile_options``, as ``Model.generate``'s) and is compiled by ``warm()`` before
the server listens. Under ``budget="auto"`` the drafter
stays on only where trees can pay both for a lone request and for a full batch (``_spec``), and each slot bucket
plans its rounds on its own calibrated cost table.

Faults stay with the request that caused them. Everything one request does outside the batch's dispatch (its
prefill, the new batch state it may start, its join, the delivery of its tokens) is built functionally and
stored only once it all succeeded, so a failure there ends that request alone (``Failed``, logged with its
traceback) and leaves the other rows' state as it was. A failure of the batch's dispatch ends the requests in
the batch, drops the batch state and keeps serving; ``health`` says degraded until a dispatch succeeds again.
A request taken off the queue is always finished: with its tokens, cancelled, or ``Failed``.

Across processes (``kimi_jax.serving.peers``): every device operation of the loop is one *step* of a small
vocabulary (admit, resize, retire, rounds, drop, stop), a JSON list that ``_apply`` runs. Process 0 holds the
requests and decides each step (``_do``: publish it to the other processes, then run it); the others hold no
request and only run the steps they receive, in the same order (``follow``), so every process enters the same
programs over the global mesh with the same inputs. The prefix cache's host-side index stays the same on every
process because it sees the same admits. There, a failure is not one request's: a step that fails on one process
may have succeeded on another, leaving the processes with different batches, so it ends every request (503) and
the run (``lose``), as does a process that stops beating.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax import fields
from kimi_jax.api import STRUCTURED, Model, token_logprobs
from kimi_jax.decoding import engine, processors
from kimi_jax.decoding.engine import GenerationError, State
from kimi_jax.decoding.programs import Request, prompt_width
from kimi_jax.serving.peers import Peers
from kimi_jax.serving.prefix_cache import PrefixCache, PrefixStats

log = logging.getLogger("kimi_jax.serve")


# ---- rows join and leave a running batch between dispatches -------------------------------------------------

# The prompt width of blank batch states and of the batch programs' requests: a state's shapes do not depend on
# it, and a narrow one is a prefill without the chunk loop (16 of those programs compile at warm-up)
BLANK_PROMPT = 16


def row_axes(state: State):
    """A State-shaped tree of ints: the batch axis of every field. Every field is a row's own, at axis 0 (the
    logits processors' values and history, the automata, the logprobs, what a new field will be), except the
    caches (batch at axis 1) and the batch's own fields (-1): round counter, key, width per round, the auto
    policy's memory."""
    axes = jax.tree.map(lambda _: 0, state)
    return axes.replace(cache=axes.cache.replace(kv=1), drafter=jax.tree.map(lambda _: 1, state.drafter),
                        rounds=-1, key=-1, stats=axes.stats.replace(width=-1),
                        policy=jax.tree.map(lambda _: -1, state.policy))


@functools.partial(jax.jit, donate_argnames=("state",))
def join(state: State, row: State, slot) -> State:
    """Batch row ``slot`` of ``state`` becomes the one-row state ``row`` (a fresh prefill with the same max_len
    and max_new): every per-row field (``row_axes``); the batch's own fields stay the batch's."""
    def put(a, r, axis):
        return a if axis < 0 else jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis)

    return jax.tree.map(put, state, row, row_axes(state))


@functools.partial(jax.jit, donate_argnames=("state",))
def retire(state: State, rows) -> State:
    """Mark rows [b] (bool) done: their slots stop emitting, and a batch with every row done runs no round."""
    return state.replace(done=state.done | rows)


@jax.jit
def regroup(state: State, rows) -> State:
    """A state of ``len(rows)`` slots whose slot i is ``state``'s row ``rows[i]``, or a free (done) slot where
    ``rows[i] < 0``: the batch grown to a larger slot bucket or compacted into a smaller one."""
    take = jnp.maximum(rows, 0)
    moved = jax.tree.map(lambda a, axis: a if axis < 0 else jnp.take(a, take, axis=axis), state, row_axes(state))
    return moved.replace(done=moved.done | (rows < 0))


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the HTTP layer answers 429."""


class Draining(RuntimeError):
    """The server is shutting down and takes no new requests; the HTTP layer answers 503."""


@dataclasses.dataclass(frozen=True)
class Failed:
    """The finish reason of a request that ended in an error; ``message`` is what its client is told (the
    traceback goes to the log under the request's id)."""
    message: str
    status: int = 500             # 500: a fault of ours; 503: the server shut down before the request ended


@dataclasses.dataclass(eq=False)
class Job:
    """One generation, as the batcher sees it. ``emit(tokens)`` and ``finish(reason)`` are called from the
    batcher thread (the HTTP side wraps them to hop onto its event loop)."""
    ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    emit: Callable[[list[int]], None]
    finish: Callable[[str | Failed], None]    # "stop", "length", "cancelled" or Failed
    id: str = ""                              # the HTTP response's id, named in the log
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    sent: int = 0
    cached: int = 0                           # prompt tokens the prefix cache served
    # logits processors' values (fields.PROCESSORS) and structured output (api.STRUCTURED), as Model.generate's
    processing: dict = dataclasses.field(default_factory=dict)
    # with processing["logprobs"]: called before each emit with its tokens' (logprob, [(token, logprob)] top)
    emit_logprobs: Callable[[list], None] | None = None

    def cancel(self):
        """Free the slot at the next dispatch (client gone, or a stop string was seen)."""
        self.cancelled.set()

    @property
    def group(self):
        return _group(self.temperature, self.processing)


def _group(temperature: float, processing: dict) -> tuple[bool, bool]:
    """What requests share a batch (one compiled program, its kind): (sampling, processors or structured output
    or logprobs on)."""
    processed = processors.requested(**{k: v for k, v in processing.items() if k in fields.PROCESSORS}) or any(
        processing.get(k) is not None for k in (*STRUCTURED, "logprobs"))
    return temperature > 0, processed


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
                 method: str | None = None, budget=None, rounds_per_dispatch: int | None = None,
                 dispatch_ms: float = 10.0, queue_size: int = 64, prefix_pages: int | None = None,
                 page_size: int = 16, peers: Peers | None = None, grammar_shape: tuple[int, int] = (1024, 512),
                 processing: bool = True):
        if model.runtime.page_size:
            # join() writes a prefilled row into its slot of one contiguous block; a page pool needs an allocator.
            raise GenerationError("the server's batch slots use the contiguous cache: load the model with "
                                  "Runtime(page_size=0)")
        self.model = model
        self.method = method or ("ddtree" if model.drafter is not None else "ar")
        self.budget = budget
        self.max_batch, self.max_new = max_batch, max_new
        self.rounds, self.dispatch_s = rounds_per_dispatch, dispatch_ms / 1e3
        self._round_s = {}                  # slot bucket -> seconds per round, measured on its dispatches
        # the processing kinds also carry every row's automaton (a row without one allows everything)
        self.grammar_shape = grammar_shape
        # processing=False: only the plain kinds (half the programs and the warm-up); a request of a kind not in
        # specs is refused at submit
        self.specs = {(s, p): model.spec(self.method, budget, 1.0 if s else 0.0, process=p)._replace(
                      grammar=grammar_shape if p else None, logprobs=fields.LOGPROBS_MAX if p else None)
                      for s in (False, True) for p in ((False, True) if processing else (False,))}
        nodes = self.specs[False, False].nodes
        self.max_len = max_len or model.config.max_position_embeddings
        self.max_prompt = self.max_len - max_new - nodes - 1
        if self.max_prompt < 1:
            raise GenerationError(f"max_new {max_new} + tree {nodes + 1} leaves no room for a prompt in a cache of "
                                  f"{self.max_len}")
        # one prompt width for every prompt: the prefill runs as many chunks as a prompt needs (a run-time count)
        self.prompt_width = prompt_width(model.runtime, self.max_prompt)
        self.slot_buckets = tuple(sorted({min(1 << k, max_batch) for k in range(max_batch.bit_length() + 1)}))
        self.queue_size = queue_size
        self.stats = Stats()
        if prefix_pages is None:            # as many tokens as the largest batch's caches hold
            prefix_pages = max_batch * self.max_len // page_size
        drafts = self.specs[False, False].steps.uses_drafter
        self.prefix = PrefixCache(model, prefix_pages, page_size, self.max_prompt, drafts) if prefix_pages else None
        self._waiting: collections.deque[Job] = collections.deque()
        self._slots: list[Job | None] = [None] * self.slot_buckets[0]     # one per slot of the batch state
        self._wake = threading.Condition()
        self._stop = False
        self._state = self._group = None
        self._specs, self._programs = {}, {}
        self._deadline = None          # set by drain(): when the requests still running are ended
        self.degraded = None           # the last dispatch failure's message, until a dispatch succeeds
        self.peers = peers             # the other processes of a multi-process run (None: this one alone)
        self.lost = None               # why a multi-process run ended (a process stopped, or a step failed)
        self.on_lost: Callable[[str], None] = lambda why: None      # told once, from the thread that noticed
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

    def check_grammar(self, compiled) -> None:
        """A structured-output automaton fits the programs' padded tables (``grammar_shape``)."""
        if compiled is None:
            return
        (states, classes), (most_states, most_classes) = compiled.tables.next_state.shape, self.grammar_shape
        if states > most_states or classes >= most_classes:
            raise GenerationError(f"structured output: the automaton has {states} states x {classes} token classes; "
                                  f"this server's programs hold {most_states} x {most_classes - 1} (simplify the "
                                  "schema: fewer optional fields, shorter enums and bounds)")

    def submit(self, req: Job) -> None:
        if req.group not in self.specs:
            raise GenerationError("this server runs without the processing programs (it was started with "
                                  "--no-processing): top_k, top_p, min_p, the penalties, logit_bias, response_format, "
                                  "strict tools and logprobs are not served")
        with self._wake:
            if self._deadline is not None:
                raise Draining("the server is shutting down; retry on another server or later")
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the queue's bound); retry later")
            self._waiting.append(req)
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    @property
    def processes(self) -> int:
        """Processes in the run this server computes on."""
        return 1 if self.peers is None else self.peers.count

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._slots)

    def start(self):
        self._thread.start()

    def drain(self, grace: float) -> None:
        """Take no new requests; let the running and waiting ones finish for ``grace`` seconds, then end them
        with ``Failed(..., 503)``. Safe to call from any thread (a signal handler, the event loop)."""
        with self._wake:
            if self._deadline is None:
                self._deadline = time.monotonic() + grace
            self._wake.notify()

    def stop(self, timeout: float | None = None) -> bool:
        """End the device thread once nothing runs or waits (after ``drain``'s deadline at the latest);
        False if it is still inside a dispatch after ``timeout`` seconds."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- programs ---------------------------------------------------------------------------------------------
    def warm(self, log=print) -> None:
        """Compile every program the loop can run, for greedy and for sampling batches, each with the logits
        processors on and off (on: unless ``processing=False``): the prefill of a prompt (and the prefix cache's
        store of its pages), and for each slot bucket its rounds, join, retire,
        its growth from the bucket below and its compaction into every smaller one."""
        t0 = time.perf_counter()
        for kind in self.specs:
            if self.prefix is not None:
                self.prefix.clear()         # a miss: the whole prompt is prefilled, its pages stored
            row = self._prefill([1] * self.max_prompt, kind, 1.0, 0)[0]
            below = None
            for slots in self.slot_buckets:
                state = self._run(join, self._blank(kind, slots=slots), row, np.int32(0))
                state = self._dispatch(self._run(retire, state, np.ones(slots, bool)), kind)
                if below is not None:
                    self._run(regroup, below, _moved(below.done.shape[0], slots))
                for smaller in self.slot_buckets[:self.slot_buckets.index(slots)]:
                    self._run(regroup, state, _moved(slots, smaller))
                below = state
        if self.prefix is not None:         # warm-up's pages are not anyone's prompt
            self.prefix.clear()
            self.prefix.stats = PrefixStats()
        off = " (drafter off: the calibrated costs say trees lose at some batch size)" if self.drafter_off else ""
        log(f"compiled the programs for {self.max_batch} slots (buckets {list(self.slot_buckets)}), prompts up to "
            f"{self.max_prompt} tokens, {self.method}{off} in {time.perf_counter() - t0:.1f}s")

    def _spec(self, kind):
        """The spec every slot bucket of a kind of batch (sampling, processors) runs. Under budget="auto" the
        drafter stays on only where the calibrated costs say some tree width can pay both for a lone request and
        for a full batch (``Model.resolve`` at the smallest and the largest bucket): one batch's rows move between
        buckets, so the state keeps the drafter's features in all of them or in none. Off, every bucket runs the
        plain AR program (no drafter prefill, no taps, no per-round plan)."""
        if kind not in self._specs:
            spec = self.specs[kind]
            for slots in sorted({self.slot_buckets[0], self.slot_buckets[-1]}) if spec.widths else ():
                resolved = self.model.resolve(self._request(spec, slots))
                if resolved.drafter_off:
                    spec = resolved.spec
                    break
            self._specs[kind] = spec
        return self._specs[kind]

    def _program(self, kind, slots: int = 1) -> tuple[Request, engine.Inputs]:
        """-> (the batch program's request, its inputs) for ``slots`` blank slots: the layout every state of the
        bucket has, and the weights and auto cost table its rounds run on (each bucket plans its rounds on its
        own calibrated table: a width that pays for one row may not for sixteen)."""
        if (kind, slots) not in self._programs:
            spec = self._spec(kind)
            request = self._request(spec, slots)
            table = np.asarray(self.model.cost_table(request), np.float32) if spec.widths else None
            self._programs[kind, slots] = request, self.model.inputs(request, costs=table)
        return self._programs[kind, slots]

    def _request(self, spec, slots: int, prompt=None, lens=None, max_tokens: int | None = None) -> Request:
        """The batch's program layout (max_new, max_len) for ``slots`` rows of ``prompt`` (default: blank) that
        stop after ``max_tokens`` new tokens (default: max_new)."""
        if prompt is None:
            prompt, lens = np.ones((slots, BLANK_PROMPT), np.int32), np.ones(slots, np.int32)
        return Request(spec, prompt, lens, self.max_new, self.max_len, max_tokens=max_tokens)

    @property
    def drafter_off(self) -> bool:
        """Whether the auto policy's calibration turned this server's drafter off (greedy batches)."""
        return self.specs[False, False].widths != () and not self._spec((False, False)).widths

    @property
    def slots(self) -> int:
        """Slots of the running batch state: the slot bucket in use."""
        return len(self._slots)

    def _prefill(self, ids, kind, temperature, seed, max_tokens: int | None = None, processing=None):
        """-> (the one-row state of prompt ``ids`` that stops after ``max_tokens``, its tokens the prefix cache
        served). With a prefix cache the prefill starts after the prompt's cached pages, and the prompt's new
        whole pages join the cache."""
        prefix = None if self.prefix is None else self.prefix.lookup(ids)
        cached = 0 if prefix is None else int(prefix.length[0])
        rest = ids[cached:]
        prompt = np.zeros((1, self.prompt_width), np.int32)
        prompt[0, :len(rest)] = rest
        state, rows = self._run_prefill(prompt, np.asarray([len(rest)], np.int32), kind, temperature, seed, prefix,
                                        max_tokens, processing)
        if prefix is not None:
            self.prefix.keep(ids, prefix, state, rows)
        return state, cached

    def _blank(self, kind, temperature=1.0, seed=0, slots: int | None = None):
        """A batch state of ``slots`` (default: the smallest bucket) slots, every one free (done)."""
        slots = slots or self.slot_buckets[0]
        state, _ = self._run_prefill(np.ones((slots, BLANK_PROMPT), np.int32), np.ones(slots, np.int32), kind,
                                     temperature, seed)
        return self._run(retire, state, np.ones(slots, bool))

    def _run_prefill(self, prompt, lens, kind, temperature, seed, prefix=None, max_tokens=None, processing=None):
        """-> (the engine state after prefilling ``prompt`` with the batch's program layout (max_new, max_len),
        the drafter's context rows of the prompt or None). With ``prefix`` the prompt continues cached pages;
        ``processing``: the row's logits processors (a processing kind)."""
        batch, batch_inputs = self._program(kind, len(lens))
        request = self._request(batch.spec, len(lens), prompt, lens, max_tokens)
        inputs = self.model.inputs(request, temperature, seed, batch_inputs.costs, **(processing or {}))
        inputs = inputs.replace(prefix=prefix)
        program, _ = self.model.programs.prefill(request, inputs, rows=prefix is not None)
        if prefix is None:
            return program(inputs)[0], None
        state, _, rows = program(inputs)
        return state, rows

    def _dispatch(self, state, kind, rounds: int = 1):
        """Up to ``rounds`` rounds of the batch in one dispatch: the chunk program ``Model.stream`` runs."""
        request, inputs = self._program(kind, state.done.shape[0])
        state, _ = self.model.programs.advance(request, inputs, state, rounds)
        return state

    def _run(self, fn, *args):
        """join, retire or regroup on ``args``, compiled by the program layer once per shape."""
        return self.model.programs.small(fn, *args)

    def _rounds(self) -> int:
        """Rounds for the next dispatch: fixed, or as many as fill dispatch_ms in this slot bucket (between 1
        and 64; 4 until a dispatch of the bucket was timed)."""
        if self.rounds:
            return self.rounds
        per_round = self._round_s.get(self.slots)
        return 4 if per_round is None else int(np.clip(self.dispatch_s / per_round, 1, 64))

    # ---- the device loop (process 0, or a process on its own) ----------------------------------------------------
    def _loop(self):
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self.active and not self.lost:
                    self._wake.wait(None if self._deadline is None else 0.1)
                if self.lost or (self._stop and not self._waiting and not self.active):
                    break
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._end_everything(Failed("the server shut down before this request finished", 503))
                continue
            try:
                self._admit()
                self._deliver()
                if self.active:
                    self._run_rounds()
                    self.degraded = None
            except Exception as e:          # the batch's own work failed: end its requests, keep serving
                log.exception("dispatch failed; ending the %d requests in the batch", self.active)
                if self.peers is not None:
                    self.lose(f"a step failed on process 0 ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
                    break
                self.degraded = f"{type(e).__name__}: {e}"
                self._end_everything(Failed(f"internal error in the batch this request ran in ({type(e).__name__})"),
                                     waiting=False)
        if self.peers is not None:
            self.peers.publish(["stop"])    # the followers leave their loops (and their processes exit)

    def _end_everything(self, failure: Failed, waiting: bool = True):
        """Finish every running (and, with ``waiting``, every queued) request with ``failure``; drop the batch."""
        with self._wake:
            ended = [r for r in self._slots if r is not None] + (list(self._waiting) if waiting else [])
            if waiting:
                self._waiting.clear()
            self._slots = [None] * self.slot_buckets[0]
        if not self.lost:
            self._do(["drop"])
        for req in ended:
            _finish(req, failure)

    def lose(self, why: str) -> None:
        """The run is over (a process stopped beating, or a step failed on this one): end every request with a
        503, take no new one, and call ``on_lost`` once. Safe from any thread: the device thread may be stuck in a
        collective with a process that is gone, so nothing here waits for it."""
        with self._wake:
            if self.lost:
                return
            self.lost = why
            if self._deadline is None:
                self._deadline = time.monotonic()       # draining: new requests get 503
            self._wake.notify()
        self._end_everything(Failed(f"the server's run lost a process ({why}); retry later", 503))
        self.on_lost(why)

    def _fail(self, req: Job, step: str, e: Exception):
        log.error("request %s failed while %s", req.id or "?", step, exc_info=e)
        _finish(req, Failed(f"internal error while {step} this request ({type(e).__name__}); the server logged it "
                            f"under id {req.id or '?'}"))

    def _admit(self):
        while True:
            with self._wake:
                if not self._waiting:
                    return
                req = self._waiting[0]
                if req.cancelled.is_set():
                    self._waiting.popleft()
                    _finish(req, "cancelled")
                    continue
                if self.active and req.group != self._group:
                    return                 # waits until the running batch drains (see the module docstring)
                if self.active == self.max_batch:
                    return
                self._waiting.popleft()
            try:
                if self.active == self.slots:       # every slot busy: the next bucket, the rows where they were
                    self._resize(self.slot_buckets[self.slot_buckets.index(self.slots) + 1])
                slot = self._slots.index(None)
                # a new batch when none runs: the temperature and the key are the batch's (greedy ones are reused)
                fresh = not self.active and (self._state is None or req.group[0] or req.group != self._group)
                req.cached = self._do(["admit", slot, [int(t) for t in req.ids], req.temperature, req.seed,
                                       req.max_tokens, self.slots if fresh else 0, req.processing])
                self._slots[slot] = req
            except Exception as e:         # this request alone: the batch state was not replaced
                self._fail(req, "prefilling", e)
                if _consumed(self._state) or self.peers is not None:
                    raise                  # the batch is lost (join had taken its buffers), or the run is

    def _resize(self, slots: int):
        """Move the running rows into a state of ``slots`` slots (growing keeps every row's slot; shrinking
        compacts the busy rows to the front) and the requests with them."""
        busy = [i for i, r in enumerate(self._slots) if r is not None]
        order = _moved(self.slots, slots).tolist() if slots > self.slots else busy + [-1] * (slots - len(busy))
        self._do(["resize", order])
        self._slots = [self._slots[i] if i >= 0 else None for i in order]

    def _deliver(self):
        if self._state is None:
            return
        n_out, out, done = jax.device_get((self._state.n_out, self._state.out, self._state.done))
        asked = [i for i, r in enumerate(self._slots) if r is not None and r.emit_logprobs is not None]
        lp = jax.device_get(self._state.logprobs) if asked and self._state.logprobs is not None else None
        leaving = np.zeros(self.slots, bool)
        for i, req in enumerate(self._slots):
            if req is None:
                continue
            try:
                new = out[i, req.sent:min(n_out[i], req.max_tokens)].tolist()
                if new:
                    if lp is not None and req.emit_logprobs is not None:
                        n = req.processing.get("logprobs", 0)
                        req.emit_logprobs([(c, top[:n]) for c, top in
                                           token_logprobs(lp, [(i, req.sent, req.sent + len(new))])[0]])
                    req.sent += len(new)
                    req.emit(new)
                eos = bool(set(new) & set(self.model.config.eos_token_ids))
                if req.cancelled.is_set() or eos or done[i] or req.sent >= req.max_tokens:
                    _finish(req, "cancelled" if req.cancelled.is_set() else "stop" if eos else "length")
                    leaving[i] = True
            except Exception as e:         # its client side is broken: this row leaves, the others go on
                self._fail(req, "delivering tokens to", e)
                leaving[i] = True
            if leaving[i]:
                self._slots[i] = None
        if leaving.any():
            try:
                self._do(["retire", leaving.tolist()])
            except Exception:   # the leavers are answered; their rows run on unseen until a join overwrites them
                if _consumed(self._state) or self.peers is not None:
                    raise               # retire had taken the batch's buffers (donated), or the run is lost
                log.exception("retiring %d finished rows failed", int(leaving.sum()))
                return
            with self._wake:
                waiting = bool(self._waiting)
            smaller = next(b for b in self.slot_buckets if b >= max(self.active, 1))
            if smaller < self.slots and not waiting:      # a waiting request would only grow it back
                self._resize(smaller)

    def _run_rounds(self):
        before, emitted = jax.device_get((self._state.rounds, self._state.n_out))
        running, t0 = self.active, time.perf_counter()
        self._do(["rounds", self._rounds()])
        rounds = int(self._state.rounds) - int(before)
        if rounds:                          # a moving average: rounds slow down as the rows' contexts grow
            took, last = (time.perf_counter() - t0) / rounds, self._round_s.get(self.slots)
            self._round_s[self.slots] = took if last is None else 0.5 * (last + took)
        self.stats.rounds += rounds
        self.stats.row_rounds += rounds * running
        self.stats.tokens += int((jax.device_get(self._state.n_out) - emitted).sum())
        self.stats.dispatches += 1

    # ---- steps: what every process of the run does to its batch state, in the same order ---------------------------
    def _do(self, step: list):
        """Run one step of the batch (process 0's decision), first sending it to the other processes, if any."""
        if self.peers is not None:
            self.peers.publish(step)
        return self._apply(step)

    def _apply(self, step: list):
        """One step on this process's devices. Each builds its new state functionally and stores it only once it
        succeeded, so a failed step leaves the batch as it was. -> what an admit's prefix cache served."""
        kind, *args = step
        if kind == "admit":
            return self._admitted(*args)
        if kind == "resize":
            if self._state is not None:
                self._state = self._run(regroup, self._state, np.asarray(args[0], np.int32))
        elif kind == "retire":
            self._state = self._run(retire, self._state, np.asarray(args[0], bool))
        elif kind == "rounds":
            self._state = self._dispatch(self._state, self._group, args[0])
        elif kind == "drop":
            self._state = None
        else:
            raise ValueError(f"unknown step {kind!r}")

    def _admitted(self, slot: int, ids: list[int], temperature: float, seed: int, max_tokens: int,
                  fresh_slots: int, processing: dict) -> int:
        """Prompt ``ids`` prefilled into ``slot`` of the batch (of a new batch of ``fresh_slots`` slots if > 0,
        whose key comes from this seed) at its own temperature, with its logits processors; -> the prompt tokens
        the prefix cache served."""
        group, t = _group(temperature, processing), max(temperature, 1e-6)
        state = self._state
        if fresh_slots:
            state = self._blank(group, t, seed, fresh_slots)
        row, cached = self._prefill(ids, group, t, seed, max_tokens, processing)
        self._state, self._group = self._run(join, state, row, np.int32(slot)), group if fresh_slots else self._group
        return cached

    def follow(self) -> None:
        """A follower's loop (every process but 0, after ``warm``): run process 0's steps until it says stop.
        Raises ``peers.PeerLost`` when process 0 is gone, and whatever a step raised (the run cannot go on with
        its processes out of step)."""
        while (step := self.peers.receive())[0] != "stop":
            self._apply(step)


def _moved(old: int, new: int) -> np.ndarray:
    """``regroup``'s rows from ``old`` slots to ``new`` with slot i staying slot i (growth; and the shapes warm-up
    compiles)."""
    return np.asarray([i if i < old else -1 for i in range(new)], np.int32)


def _consumed(state) -> bool:
    """Whether a failed call had already taken ``state``'s buffers (join and retire donate them)."""
    return state is not None and any(x.is_deleted() for x in jax.tree.leaves(state))


def _finish(req: Job, reason) -> None:
    """Tell a request how it ended; a client side that cannot be told any more (its event loop closed) is only
    logged, so that one broken client cannot stop the loop from telling the others."""
    try:
        req.finish(reason)
    except Exception:
        log.exception("could not deliver the end of request %s", req.id or "?")
