"""The program layer: how a request is laid out for the engine, and the compiled programs that serve it.

Everything that runs the engine gets its programs here (``kimi_jax.api.Model``'s generate, stream and prefill,
the server's batcher, the benchmarks), so every program is compiled the same way: once per shape, with
``kimi_jax.config.compile_options`` for the platform of the devices it runs on (on GPUs: the round loop as one
CUDA graph, no host read per round), and a log line when it happens. The auto policy's cost table is
calibrated here too (``Programs.cost_table``), by timing the generate program that serves the request.

Layout (``lay_out``): no program depends on a length. A request's cache has ``Runtime.context`` slots per row
(default 32768), capped at the model's context: for the embedded default, the whole context of 1024. Its output
slots are as many (the count a row emits is a run-time input, ``engine.Inputs.max_tokens``), and its prompt array
is whole chunks of ``Runtime.prefill_chunk`` as wide (the prefill runs as many chunks as the longest prompt needs,
a run-time count). What costs follows the lengths inside the one program: the prefill's chunk loop, the XLA
attention's block loop over the committed prefix (``kimi_jax.ops.tree_attention.xla``), the reads of the full-form
and drafter attention up to the longest row (``kimi_jax.cache.over_used_slots``); the GPU and TPU kernels stream
each row's own blocks already. So a notebook ``Model`` compiles once per (method and tree width, batch size,
sampling and processing switches) and never again for another prompt or output length. A request longer than
``Runtime.context`` (a model whose context is wider) gets a cache of its length rounded up to a power of two, as
before: its own program. A paged cache's pool holds one row's worth of pages, or the pages the rows can touch at
their actual lengths (``kimi_jax.cache.pool_size``) rounded up to a power of two where that is more.

Compile log: each compile logs one line at INFO on the ``kimi_jax`` logger, naming the program, its shapes and
the seconds (``compiled generate ddtree/16 batch 1 prompt 16 max_new 64 cache 128 in 14.8s``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Callable

import jax
import numpy as np

from kimi_jax import sharding
from kimi_jax.cache import pool_size
from kimi_jax.config import ModelConfig, Runtime, compile_options
from kimi_jax.decoding import costs as costs_lib
from kimi_jax.decoding import engine
from kimi_jax.model.compute_layout import program_platform

log = logging.getLogger("kimi_jax")


def bucket(n: int, minimum: int = 16) -> int:
    """Round lengths up to a power of two so a handful of programs serve every length."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass(frozen=True, eq=False)     # holds arrays: identity, not elementwise, equality
class Request:
    """A validated request laid out for the engine's programs (``lay_out``; ``kimi_jax.api.Model.prepare``)."""
    spec: engine.Spec          # the static program description: method, tree width(s), sampling, drafter block
    prompt: np.ndarray         # [b, t] int32 token ids, right-padded to a bucketed length
    lens: np.ndarray           # [b] int32 prompt lengths
    max_new: int               # output slots per row: the static bound of max_tokens (bucketed)
    max_len: int               # cache slots per row (bucketed)
    pool_pages: int = 0        # page-pool pages of a paged cache; 0 for the contiguous cache
    drafter_off: bool = False  # ``Model.resolve`` made an auto request the ar request (calibrated: trees lose)
    max_tokens: int | None = None   # new tokens per row at most (a run-time input); None: max_new

    @property
    def layout(self) -> tuple[int, int]:
        return self.max_len, self.pool_pages

    @property
    def statics(self) -> dict:
        """The static arguments of the engine's programs for this request: ``spec`` and the layout."""
        return dict(spec=self.spec, max_new=self.max_new, max_len=self.max_len, pool_pages=self.pool_pages)

    @property
    def stop(self) -> int:
        """New tokens per row at most."""
        return self.max_new if self.max_tokens is None else self.max_tokens

    @property
    def key(self) -> tuple:
        """What its programs are compiled for: the statics and the prompt's shape."""
        return (self.spec, self.prompt.shape, self.max_new, self.layout)

    def describe(self) -> str:
        spec = self.spec
        method = spec.method if spec.method == "ar" else f"{spec.method}/{'auto' if spec.widths else spec.nodes}"
        return (f"{method} batch {self.prompt.shape[0]} prompt {self.prompt.shape[1]} max_new {self.max_new} "
                f"cache {self.max_len}" + (f" pool {self.pool_pages}" if self.pool_pages else ""))


def layout(cfg: ModelConfig, rt: Runtime, spec: engine.Spec, lens: np.ndarray,
           max_tokens: int) -> tuple[int, int, int]:
    """(output slots, cache slots per row, page-pool pages or 0) for rows of prompt lengths ``lens`` that emit up
    to ``max_tokens`` new tokens under ``spec``: the rule of the module doc."""
    context = cfg.max_position_embeddings
    need = int(lens.max()) + max_tokens + spec.nodes + 1
    max_len = min(max(rt.context, bucket(need, 64)), context)
    page = rt.page_size
    if not page:
        return max_len, max_len, 0
    # Logical rows in whole pages; the pool holds one row's worth, or the pages these rows can touch at their
    # actual lengths rounded up to a power of two where that is more.
    max_len = -(-max_len // page) * page
    touched = pool_size(engine.row_capacity(lens, max_tokens, spec), max_len, page)
    return max_len, max_len, max(max_len // page, bucket(touched, 8))


def prompt_width(rt: Runtime, max_len: int) -> int:
    """The prompt array's width for a cache of ``max_len`` slots: whole chunks of ``rt.prefill_chunk`` (the
    prefill runs as many as the longest prompt needs), or the cache's width when one chunk holds it."""
    chunk = rt.prefill_chunk
    return max_len if max_len <= chunk else -(-max_len // chunk) * chunk


def lay_out(cfg: ModelConfig, rt: Runtime, spec: engine.Spec, rows: list[list[int]], max_tokens: int) -> Request:
    """The Request of prompt rows (token ids, validated) that emit up to ``max_tokens`` new tokens each."""
    lens = np.asarray([len(r) for r in rows], np.int32)
    max_new, max_len, pool = layout(cfg, rt, spec, lens, max_tokens)
    padded = np.zeros((len(rows), prompt_width(rt, max_len)), np.int32)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    return Request(spec, padded, lens, max_new, max_len, pool, max_tokens=max_tokens)


def relaid(cfg: ModelConfig, rt: Runtime, request: Request, spec: engine.Spec, **changes) -> Request:
    """``request`` under another spec (its layout follows the spec's tree)."""
    max_new, max_len, pool = layout(cfg, rt, spec, request.lens, request.stop)
    return dataclasses.replace(request, spec=spec, max_new=max_new, max_len=max_len, pool_pages=pool, **changes)


def blank_costs(spec: engine.Spec):
    """A cost table of the right shape for compiling (its values are runtime inputs); None without widths."""
    return np.ones((2, len(spec.widths)), np.float32) if spec.widths else None


class Programs:
    """The compiled programs of one model: compiled once per key with ``options`` (default: ``compile_options``
    for the platform of ``runtime.mesh``) and kept. Every getter returns (the compiled program, the seconds this
    call spent compiling it: 0.0 when it was compiled before)."""

    def __init__(self, runtime: Runtime, options: dict | None = None):
        self.runtime = runtime
        self.options = compile_options(program_platform(runtime), runtime) if options is None else options
        self._compiled = {}
        self._costs = {}
        self.compile_s = 0.0          # seconds spent compiling so far: a call's share is the difference

    def compiled(self, key: tuple, lower: Callable[[], jax.stages.Lowered], what: Callable[[], str]):
        """-> (the program ``lower()`` lowers, compiled for ``key`` once; seconds compiled now). ``what()``
        names it in the compile log line (made only then: the chunk program is looked up every dispatch)."""
        if key in self._compiled:
            return self._compiled[key], 0.0
        t0 = time.perf_counter()
        with sharding.mesh_context(self.runtime.mesh):
            compiled = lower().compile(self.options)
        seconds = time.perf_counter() - t0
        self.compile_s += seconds
        log.info("compiled %s in %.1fs", what(), seconds)
        self._compiled[key] = compiled
        _in_step()
        return compiled, seconds

    def cost_table(self, request: Request, inputs: Callable[..., engine.Inputs]) -> np.ndarray:
        """The auto policy's cost table for the request's batch and cache (``kimi_jax.decoding.costs``): from
        memory, the disk cache, or measured now by running the request's generate program, the very program
        that serves it. ``inputs(costs=, force=, max_rounds=)``: the request's Inputs."""
        spec = request.spec
        key = costs_lib.table_key(spec, request.prompt.shape[0], request.max_len)
        if key not in self._costs:
            table = costs_lib.load(key)
            if table is not None and table.shape[1] != len(spec.widths):
                table = None

            def measure():
                ones = blank_costs(spec)
                program, _ = self.generate(request, inputs(costs=ones))

                def run(force, limit):
                    state, _ = program(inputs(costs=ones, force=force, max_rounds=limit))
                    rounds, outlook = jax.device_get((state.rounds, state.policy.outlook))
                    return int(rounds), outlook / request.prompt.shape[0]

                return costs_lib.measure(run, len(spec.widths))

            self._costs[key] = _one_table_for_all(key, spec.widths, table, measure)
        return self._costs[key]

    # ---- lowering: the same programs for any inputs (another mesh, abstract weights) ----------------------
    def lower_generate(self, request: Request, inputs: engine.Inputs) -> jax.stages.Lowered:
        """Prefill and every round, lowered for the request's shapes."""
        with sharding.mesh_context(self.runtime.mesh):
            return engine.generate_program.lower(inputs, **request.statics)

    def lower_prefill(self, request: Request, inputs: engine.Inputs, rows: bool = False) -> jax.stages.Lowered:
        """The prompt's dispatch (``rows``: also the drafter's context rows, for a prefix cache)."""
        program = engine.prefill_rows_program if rows else engine.prefill_program
        with sharding.mesh_context(self.runtime.mesh):
            return program.lower(inputs, **request.statics)

    def lower_chunk(self, request: Request, inputs: engine.Inputs, state) -> jax.stages.Lowered:
        """Rounds (a run-time count) from ``state`` (arrays or their shapes), for the state's batch."""
        with sharding.mesh_context(self.runtime.mesh):
            return engine.chunk_program.lower(inputs.params, inputs.drafter_params, state, inputs.costs, np.int32(0),
                                              spec=request.spec)

    # ---- compiled ---------------------------------------------------------------------------------------
    def generate(self, request: Request, inputs: engine.Inputs):
        """The whole generation in one dispatch: call it on ``inputs`` -> (state, NaN flag)."""
        return self.compiled(("generate",) + request.key, lambda: self.lower_generate(request, inputs),
                             lambda: f"generate {request.describe()}")

    def prefill(self, request: Request, inputs: engine.Inputs, rows: bool = False):
        """The prompt's dispatch -> (state, NaN flag[, drafter context rows with ``rows``]). ``inputs.prefix``
        (a prefix cache's pages) is part of its key."""
        name = "prefill_rows" if rows else "prefill"
        prefix = jax.tree.map(lambda a: (a.shape, str(a.dtype)), inputs.prefix)
        return self.compiled((name, prefix) + request.key, lambda: self.lower_prefill(request, inputs, rows),
                             lambda: f"{name} {request.describe()}" + (" with a cached prefix" if prefix else ""))

    def chunk(self, request: Request, inputs: engine.Inputs):
        """Up to a run-time number of rounds from the state the request's prefill makes (donated): call it as
        ``chunk(params, drafter_params, state, costs, rounds)`` -> (state, NaN flag)."""
        def lower():
            state, _ = self.prefill(request, inputs)[0].out_info      # shapes and shardings of the state
            return self.lower_chunk(request, inputs, state)
        return self.compiled(("chunk", request.spec, request.prompt.shape[0], request.max_new, request.layout), lower,
                             lambda: f"chunk {request.describe()}")

    def advance(self, request: Request, inputs: engine.Inputs, state, rounds: int):
        """Run up to ``rounds`` more rounds of ``state`` (donated) in one dispatch -> (state, NaN flag): the one
        round loop's step, for ``Model.stream`` and the server's batch."""
        chunk, _ = self.chunk(request, inputs)
        return chunk(inputs.params, inputs.drafter_params, state, inputs.costs, np.int32(rounds))

    def small(self, fn, *args):
        """Run a small jitted program ``fn`` (the batcher's join, retire, regroup) on ``args``, compiled once per
        shape of them."""
        leaves, tree = jax.tree.flatten(args)
        key = (fn.__name__, tree, tuple((np.shape(a), str(a.dtype)) for a in leaves))
        program, _ = self.compiled(key, lambda: fn.lower(*args), lambda: f"{fn.__name__} of {np.shape(leaves[0])}")
        return program(*args)


_COMPILES = itertools.count(1)       # programs compiled by this process: every process counts the same ones


def _in_step(timeout_s: int = 1800) -> None:
    """In a run across processes, wait until every process has compiled its latest program. They compile the
    same programs in the same order, but one may read a program from the compilation cache while another
    compiles it for minutes; the program's first collective would then wait on the late one, and on CPUs gloo
    gives up connecting after a fixed 30 s ("Context initialization failed ... Connect timeout"). The barrier is
    the coordination service's (jax.distributed's client: no device collective), one id per compile of the
    process; one process skips it."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed           # the client's barrier has no public name in JAX
    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"kimi_jax_compiled_{next(_COMPILES)}", timeout_in_ms=timeout_s * 1000)


def _one_table_for_all(key: str, widths, stored, measure: Callable[[], np.ndarray]) -> np.ndarray:
    """The cost table every process of the run uses: the stored one, else measured now (and stored). Across
    processes the programs take one set of inputs, so the table is process 0's: its disk decides whether all of
    them measure (in step: the calibration runs programs, which every process must run alike), and its numbers
    reach the others (a broadcast), where their own disks or clocks might have said otherwise."""
    if jax.process_count() == 1:
        if stored is None:
            stored = measure()
            costs_lib.save(key, stored, widths)
        return stored
    from jax.experimental import multihost_utils
    have = bool(multihost_utils.broadcast_one_to_all(np.int32(stored is not None)))
    table = (stored if stored is not None else np.zeros((2, len(widths)))) if have else measure()
    table = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(table, np.float32)), np.float64)
    if not have and jax.process_index() == 0:
        costs_lib.save(key, table, widths)
    return table

