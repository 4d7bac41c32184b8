"""The small public API used by the CLI, notebooks and benchmarks.

    model = kimi_jax.load("checkpoints/target", drafter="checkpoints/drafter")
    model.logits(ids)                                        # float32 [.., t, vocab]
    out = model.generate("def fib(n):", max_new_tokens=64, method="ddtree", budget=32)
    out.text, out.tokens, out.stats

``generate`` compiles one program per (method, budget, batch, bucketed lengths: prompt and max_new_tokens,
``kimi_jax.decoding.programs``) ahead of time and runs the whole generation in a single dispatch; ``stream`` runs
a fixed number of rounds per dispatch and yields the tokens each chunk accepted. This class validates what a
user gives and formats what comes back; the layout and the compiled programs are ``kimi_jax.decoding.programs``'
(``Model.programs``). Under both, the program API, for code that drives the engine itself (benchmarks, the
notebook, the server):

    request = model.prepare(prompt, 64, "ddtree", 16)    # validated and laid out: a Request
    request = model.resolve(request)                     # auto: the AR request where calibrated trees lose
    lowered = model.lower(request)                       # .compile(), .as_text(), cost and memory analysis
    program, compile_s = model.program(request)          # compiled once per shape (compile_s: 0.0 after that)
    state, nan = program(model.inputs(request, temperature=0.0, seed=0))   # one pytree of inputs
    engine.generate_program.lower(inputs, **request.statics)   # the same program for any inputs (another mesh,
                                                                # abstract weights)

``prefill`` runs a request's first dispatch (``stream`` continues it with ``model.programs.advance``);
``cost_table`` is the auto policy's calibrated costs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax import fields, sharding
from kimi_jax.cache import init_cache
from kimi_jax.config import ModelConfig, Runtime
from kimi_jax.decoding import auto, constrained, engine, processors
from kimi_jax.decoding import drafter as dflash
from kimi_jax.decoding.engine import GenerationError
from kimi_jax.decoding.programs import Programs, Request, blank_costs, lay_out, relaid
from kimi_jax.model.compute_layout import compute_params, own_buffers, program_platform
from kimi_jax.model.params import check_global_mesh, param_shardings
from kimi_jax.model.transformer import chunked_forward, full_logits
from kimi_jax.text.grammar import GrammarCache
from kimi_jax.text.tokenizer import load_tokenizer
from kimi_jax.weights import checkpoint, hf
from kimi_jax.weights.drafter import load_drafter


# structured output's fields (``Model.grammar``), taken with the logits processors' by prepare and inputs
# (``reply_regex``: a whole chat reply with K2's markers, what the server makes of strict tools)
STRUCTURED = ("response_format", "regex", "reply_regex")


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]            # new tokens per batch row (stop token kept)
    text: list[str] | None             # decoded tokens when a tokenizer is loaded
    stats: dict                        # see Model.generate
    # with logprobs=n: per row, per token (logprob, [(token, logprob)] of the n most likely), raw distribution
    logprobs: list[list[tuple[float, list[tuple[int, float]]]]] | None = None


class Model:
    def __init__(self, config: ModelConfig, params, tokenizer=None, drafter=None, mesh=None,
                 runtime: Runtime | None = None):
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.drafter = drafter            # kimi_jax.decoding.drafter.Drafter or None
        self.runtime = (runtime or Runtime()).replace(mesh=mesh)   # kernels + mesh, passed to every program
        self.programs = Programs(self.runtime)   # the compiled programs: kimi_jax.decoding.programs
        self._compute_params = None
        self._drafter_params = None
        self.grammars = GrammarCache()     # structured output's compiled automata (kimi_jax.text.grammar)

    @property
    def mesh(self):
        return self.runtime.mesh

    @property
    def compute_params(self):
        """The weights the generation programs run on (``kimi_jax.model.compute_layout.compute_params``), made once."""
        if self._compute_params is None:
            self._compute_params = compute_params(self.params, self.config, self.runtime)
        return self._compute_params

    @property
    def drafter_params(self):
        """The drafter's weights as the programs run on them (``kimi_jax.decoding.drafter.compute_params``),
        made once per drafter weights; None without a drafter."""
        if self.drafter is None:
            return None
        if self._drafter_params is None or self._drafter_params[0] is not self.drafter.params:
            self._drafter_params = (self.drafter.params, dflash.compute_params(self.drafter.params, self.mesh,
                                                                               strategy=self.runtime.strategy))
        return self._drafter_params[1]

    # ---- inputs ------------------------------------------------------------------------------------------
    def encode(self, prompt) -> list[list[int]]:
        """A string, a list of ids, or a batch of either -> list of id lists (validated)."""
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], str)):
            if self.tokenizer is None:
                raise GenerationError("this model has no tokenizer: pass token ids instead of text")
            rows = [prompt] if isinstance(prompt, str) else list(prompt)
            ids = [self.tokenizer.encode(r) for r in rows]
        else:
            arr = prompt if isinstance(prompt, (list, tuple)) else np.asarray(prompt).tolist()
            ids = [list(map(int, r)) for r in arr] if arr and isinstance(arr[0], (list, tuple)) else [list(map(int, arr))]
        for r in ids:
            if not r:
                raise GenerationError("empty prompt: give at least one token")
            bad = [t for t in r if not 0 <= t < self.config.vocab_size]
            if bad:
                raise GenerationError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    # ---- forward -----------------------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """Float32 logits of a full causal forward over token ids [t] or [b, t]."""
        ids = np.asarray(token_ids)
        single = ids.ndim == 1
        rows = self.encode(ids[None] if single else ids)
        if len(rows[0]) > self.config.max_position_embeddings:
            raise GenerationError(f"{len(rows[0])} tokens exceed the context of {self.config.max_position_embeddings}")
        ids = np.asarray(rows, np.int32)
        t, chunk = ids.shape[1], self.runtime.prefill_chunk
        with sharding.mesh_context(self.mesh):
            if t <= chunk:
                out = _full_logits(self.params, self.config, jnp.asarray(ids), rt=self.runtime)
            else:                           # in chunks against a cache: memory O(chunk x t), not O(t^2)
                padded = np.pad(ids, ((0, 0), (0, -t % chunk)))
                out = _chunked_logits(self.params, self.config, jnp.asarray(padded), rt=self.runtime)[:, :t]
        out = np.asarray(out)
        return out[0] if single else out

    # ---- generation --------------------------------------------------------------------------------------
    def spec(self, method, budget, temperature, block_size=None, process: bool = False) -> engine.Spec:
        """The static description of the programs that serve a request (engine.Spec); ``process``: the logits
        processors on (``kimi_jax.decoding.processors``: one program serves every value of them)."""
        if budget == "auto":
            budget = None
        if method == "ar":
            return engine.Spec(self.config, "ar", 0, temperature > 0, rt=self.runtime, process=process)
        if self.drafter is None:
            raise GenerationError(f"method {method!r} needs a drafter: kimi_jax.load(path, drafter=...)")
        block = block_size or self.drafter.config.block_size
        if not 2 <= block <= self.drafter.config.block_size:
            raise GenerationError(f"block_size {block} exceeds the drafter's {self.drafter.config.block_size} "
                                  "(or is below 2)")
        if method == "dflash":
            budget = block - 1
        elif budget is None:          # ddtree's default: the cost-model policy over auto.AUTO_WIDTHS
            widths = auto.AUTO_WIDTHS
            return engine.Spec(self.config, method, max(widths), temperature > 0, self.drafter.config, block, widths,
                               rt=self.runtime, process=process)
        return engine.Spec(self.config, method, int(budget), temperature > 0, self.drafter.config, block,
                           rt=self.runtime, process=process)

    def prepare(self, prompt, max_new_tokens: int = 64, method: str | None = None, budget: int | str | None = None,
                temperature: float | list = 0.0, block_size: int | None = None, **processing) -> Request:
        """Validate a request and lay it out for the engine's programs (what ``generate`` runs on; also the way
        in for code that drives the engine itself: ``prefill``, ``program``). ``processing``: the logits
        processors (``fields.PROCESSORS``, as ``generate`` takes them); any value off its default turns them on
        in the spec (``Spec.process``), and ``inputs`` then needs the same values; so does structured output
        (``response_format``, ``regex``: ``Spec.grammar``)."""
        method = method or ("ddtree" if self.drafter is not None else "ar")
        fields.check(max_new_tokens=max_new_tokens, method=method, budget=budget, block_size=block_size)
        rows = self.encode(prompt)
        temperature = float(_temperatures(temperature, len(rows)).max())      # the spec samples if any row does
        compiled = self.grammar(**{k: processing.pop(k, None) for k in STRUCTURED})
        logprobs = processing.pop("logprobs", None)
        fields.check(logprobs=logprobs)
        processors.sampling(len(rows), self.config.vocab_size, **processing)      # checked before any compile
        spec = self.spec(method, budget, temperature, block_size, processors.requested(**processing))
        if compiled is not None:        # the automaton's padded shape is the program's (a few buckets serve all)
            spec = spec._replace(grammar=constrained.bucket(constrained.shape_of(compiled.tables)))
        spec = spec._replace(logprobs=logprobs)
        longest = max(map(len, rows))
        context = self.config.max_position_embeddings
        if longest + spec.nodes + 2 > context:
            if not spec.nodes:          # ar: no tree to make smaller
                raise GenerationError(f"a prompt of {longest} tokens leaves no room for a new token in the context "
                                      f"of {context}; shorten it")
            smaller = "block_size" if spec.method == "dflash" else "the budget"
            raise GenerationError(f"a prompt of {longest} tokens leaves no room for one round of {spec.nodes + 1} "
                                  f"tree tokens in the context of {context}; shorten it or lower {smaller}")
        need = longest + max_new_tokens + spec.nodes + 1
        if need > context:
            raise GenerationError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + tree ({spec.nodes + 1}) = {need} "
                f"exceeds the context of {context}; shorten the prompt or lower max_new_tokens")
        request = lay_out(self.config, self.runtime, spec, rows, max_new_tokens)
        self._check_cache_fits(len(rows), request.max_len, request.pool_pages)
        return request

    def resolve(self, request: Request) -> Request:
        """The request as it should run. An auto ddtree request (``spec.widths``) whose calibrated cost table
        (``cost_table``: this request's batch size and cache slots) says no tree width can pay
        (``kimi_jax.decoding.auto.drafter_off``) becomes the request ``prepare`` makes for ``method="ar"``: the
        AR program, with no drafter prefill, no feature taps and no per-round plan, and ``drafter_off`` set. Any
        other request comes back as it is. The first call of a table's key calibrates it (``cost_table``)."""
        spec = request.spec
        if not spec.widths or not auto.drafter_off(self.cost_table(request)):
            return request
        ar = self.spec("ar", None, 1.0 if spec.sample else 0.0, process=spec.process)   # the same sampling, no drafter
        ar = ar._replace(grammar=spec.grammar, logprobs=spec.logprobs)
        return relaid(self.config, self.runtime, request, ar, drafter_off=True)

    def _check_cache_fits(self, rows: int, max_len: int, pool_pages: int = 0) -> None:
        """A GenerationError naming the bytes if the latent cache (+ drafter features) cannot fit the device."""
        cfg = self.config
        slots = pool_pages * self.runtime.page_size if pool_pages else rows * max_len
        need = cfg.num_hidden_layers * slots * cfg.latent_dim * jnp.dtype(self.params["embed"].dtype).itemsize
        if self.drafter is not None:
            d = self.drafter.config
            need += 2 * d.num_hidden_layers * rows * dflash.feature_slots(d, max_len) * d.num_key_value_heads * \
                d.head_dim * jnp.dtype(self.drafter.params["fc"].dtype).itemsize
        free = device_memory_bytes()
        if self.mesh is None and free is not None and need > free:
            raise GenerationError(f"a cache of {max_len} positions for {rows} rows needs {need / 2**30:.2f} GiB but "
                                  f"the device has {free / 2**30:.2f} GiB free; shorten the request or use a mesh")

    def inputs(self, request: Request, temperature: float | list = 0.0, seed: int = 0, costs="calibrated",
               force: int = -1, max_rounds: int | None = None, **processing) -> engine.Inputs:
        """The run-time inputs of the request's programs as one pytree (``engine.Inputs``): compute params,
        drafter params, prompt, lengths, temperature, seed; for auto requests the cost table ("calibrated":
        ``cost_table``, measured on first use; or a [2, len(widths)] array), a forced width index (-1: the policy
        chooses) and a round limit (None: until done); the logits processors' values (``processing``, each a
        scalar or one value per row; a request prepared without them takes none)."""
        fields.check(seed=seed)
        temperature = _temperatures(temperature, request.prompt.shape[0])
        grammar = self._grammar_tables(request, self.grammar(**{k: processing.pop(k, None) for k in STRUCTURED}))
        # static (the program's): a count up to what the request was prepared with (its top alternatives are cut
        # on the host, as the server's batches, prepared with the most, do)
        if (logprobs := processing.pop("logprobs", None)) is not None and logprobs > (request.spec.logprobs or -1):
            raise GenerationError(f"logprobs={logprobs} needs a request prepared with at least that many (it was "
                                  f"prepared with {request.spec.logprobs})")
        sampling = self._sampling(request, processing)
        if isinstance(costs, str):
            costs = self._costs_arg(request)
        # numpy inputs: transferred with the launch, no extra device programs (see test_one_dispatch_per_generate)
        return engine.Inputs(
            params=self.compute_params, drafter_params=self.drafter_params,
            prompt=np.asarray(request.prompt, np.int32), lens=np.asarray(request.lens, np.int32),
            temperature=np.maximum(temperature, 1e-6).astype(np.float32), seed=np.uint32(seed),
            costs=None if costs is None else np.asarray(costs, np.float32), force=np.int32(force),
            max_rounds=np.int32(2 ** 30 if max_rounds is None else max_rounds), max_tokens=np.int32(request.stop),
            sampling=sampling, grammar=grammar)

    def grammar(self, response_format: dict | None = None, regex: str | None = None, reply_regex: str | None = None):
        """The compiled automaton of a structured-output request (``kimi_jax.text.grammar``: a JSON schema,
        ``json_object``, a regex, or a chat reply's regex with K2's markers: ``serving.tools``), or None; compiled
        once per format and tokenizer (``self.grammars``). GenerationError for a schema feature it cannot
        enforce (named) or an automaton past its size limits."""
        if response_format is None and regex is None and reply_regex is None:
            return None
        if self.tokenizer is None:
            raise GenerationError("structured output needs the model's tokenizer (its tokens' bytes)")
        return self.grammars.get(self.tokenizer, response_format, regex, reply_regex)

    def _grammar_tables(self, request: Request, compiled):
        """Every row's automaton padded to the request's ``Spec.grammar`` (None without it)."""
        shape = request.spec.grammar
        if shape is None:
            if compiled is not None:
                raise GenerationError("this request was prepared without structured output: pass the same "
                                      "response_format / regex to prepare")
            return None
        row = constrained.row_tables(None if compiled is None else compiled.tables, self.config.vocab_size, shape)
        return constrained.stack([row] * len(request.lens))

    def _sampling(self, request: Request, processing: dict):
        """The per-row processor values of a processing request (None for one without processors)."""
        rows = len(request.lens)
        sampling = processors.sampling(rows, self.config.vocab_size, **processing)
        if request.spec.process:
            return sampling
        asked = sorted(name for name, value in processing.items() if processors.requested(**{name: value}))
        if asked:
            raise GenerationError(f"this request was prepared without logits processors: pass the same "
                                  f"{', '.join(asked)} to prepare")
        return None

    def lower(self, request: Request) -> jax.stages.Lowered:
        """The whole-generation program lowered for the request's shapes (and this model's mesh):
        ``.compile()``, ``.as_text()``, ``.compile().memory_analysis()`` / ``cost_analysis()``."""
        return self.programs.lower_generate(request, self._compile_inputs(request))

    def _compile_inputs(self, request: Request) -> engine.Inputs:
        """Inputs to lower the request's programs with (an auto request's cost table blank: calibrating it needs
        the program)."""
        return self.inputs(request, costs=blank_costs(request.spec))

    def program(self, request: Request):
        """-> (the compiled whole-generation program for the request's shapes, the seconds this call spent
        compiling it: 0.0 when it was compiled before); compiled once per (spec, prompt shape, output slots,
        cache layout), with ``kimi_jax.decoding.programs``. Call it on ``inputs(request, ...)``."""
        return self.programs.generate(request, self._compile_inputs(request))

    def prefill(self, request: Request, temperature: float = 0.0, seed: int = 0, **processing):
        """-> (engine state after the prompt, NaN flag): the first dispatch of ``stream``; continue it with
        ``self.programs.advance``. ``processing``: the logits processors, as ``inputs``."""
        program, _ = self.programs.prefill(request, self._compile_inputs(request))
        return program(self.inputs(request, temperature, seed, **processing))

    def cost_table(self, request: Request) -> np.ndarray:
        """[2, len(spec.widths)]: seconds per round and prior expected tokens per row at each width on this
        backend (kimi_jax.decoding.costs): from memory, the disk cache, or measured now with the generation program
        (``Programs.cost_table``)."""
        return self.programs.cost_table(request, lambda **kw: self.inputs(request, **kw))

    def _costs_arg(self, request: Request):
        if not request.spec.widths:
            return None
        return np.asarray(self.cost_table(request), np.float32)

    def generate(self, prompt, max_new_tokens: int = 64, method: str | None = None, budget: int | str | None = None,
                 temperature: float | list = 0.0, seed: int = 0, block_size: int | None = None, *, top_k=None,
                 top_p=None, min_p=None, presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                 logit_bias=None, response_format: dict | None = None, regex: str | None = None,
                 logprobs: int | None = None) -> Generation:
        """Generate up to max_new_tokens per row; greedy when temperature == 0. One dispatch per call.
        ``temperature``: one for every row, or a list with one per row (a row at 0 in a batch that samples takes
        the argmax).

        The logits processors (``kimi_jax.decoding.processors``, in its order: logit_bias, repetition_penalty,
        frequency_penalty and presence_penalty, temperature, min_p, top_k, top_p), each a scalar for every row or
        a list with one value per row (``logit_bias``: a {token id: bias} map, or a list of them); None or the
        default leaves the distribution as it is. Greedy decoding takes the argmax of the biased, penalised
        logits. Ranges: ``kimi_jax.fields.FIELDS``.

        Structured output: ``response_format`` as OpenAI's (``{"type": "json_object"}`` or ``{"type":
        "json_schema", "json_schema": {"schema": ...}}``) or a ``regex``: every row's reply is generated under the
        token automaton of it (``kimi_jax.decoding.constrained``; the DDTree keeps only prefixes it allows), and
        ends with a complete match unless max_new_tokens cuts it first.

        ``logprobs=n`` (0-20): ``Generation.logprobs`` holds every new token's log-probability and the n most
        likely tokens at its position, under the target's raw distribution (before the processors and the
        grammar's mask, as vLLM reports by default).

        budget: ddtree's node budget, or "auto"/None (the default): each round picks a plain AR step or a tree
        width by expected tokens per second under costs calibrated on this backend (``cost_table``); where those
        costs say no tree can pay, the call runs the plain AR program instead (``resolve``).

        stats: new_tokens, rounds, tau_per_round and width_per_round (per row / per round), mean_tau, seconds and
        tokens_per_s (the dispatches only), compile_s (the seconds this call spent compiling, not in seconds: 0.0
        when its programs were compiled before, e.g. for another length of the same bucket),
        dispatches, and drafter: "on" (a drafter ran), "off (calibrated)" (an auto request ran as AR, see
        ``resolve``) or "none" (method ar)."""
        processing = dict(top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                          logit_bias=logit_bias, response_format=response_format, regex=regex, logprobs=logprobs)
        compiled_before = self.programs.compile_s       # resolve may compile (calibrating the cost table)
        request = self.resolve(self.prepare(prompt, max_new_tokens, method, budget, temperature, block_size,
                                            **processing))
        program, _ = self.program(request)
        compile_s = self.programs.compile_s - compiled_before
        inputs = self.inputs(request, temperature, seed, **processing)
        t0 = time.perf_counter()
        state, nan = program(inputs)
        n_out, out, accepted, width, rounds, lp = jax.device_get((state.n_out, state.out, state.stats.accepted,
                                                                  state.stats.width, state.rounds, state.logprobs))
        elapsed = time.perf_counter() - t0
        _check_finite(nan)
        return self._result(request, out, n_out, accepted, width, int(rounds), elapsed, compile_s, dispatches=1,
                            logprobs=lp)

    def _result(self, request, out, n_out, accepted, width, rounds, elapsed, compile_s, dispatches,
                logprobs=None) -> Generation:
        tokens = [out[i, :n_out[i]].tolist() for i in range(out.shape[0])]
        taus = [a[a > 0].tolist() for a in accepted]
        all_taus = [t for row in taus for t in row]
        new = int(sum(map(len, tokens)))
        drafter = "off (calibrated)" if request.drafter_off else "none" if request.spec.method == "ar" else "on"
        stats = dict(new_tokens=new, rounds=rounds, tau_per_round=taus, width_per_round=width[width >= 0].tolist(),
                     mean_tau=float(np.mean(all_taus)) if all_taus else 0.0, seconds=elapsed,
                     tokens_per_s=new / elapsed if elapsed > 0 else float("inf"), compile_s=compile_s,
                     dispatches=dispatches, drafter=drafter)
        text = [self.tokenizer.decode(t) for t in tokens] if self.tokenizer is not None else None
        return Generation(tokens, text, stats, None if logprobs is None else
                          token_logprobs(logprobs, [(i, 0, int(n)) for i, n in enumerate(n_out)]))

    def stream(self, prompt, max_new_tokens: int = 64, method: str | None = None, budget: int | str | None = None,
               temperature: float | list = 0.0, seed: int = 0, block_size: int | None = None,
               rounds_per_dispatch: int = 4, *, top_k=None, top_p=None, min_p=None, presence_penalty=None,
               frequency_penalty=None, repetition_penalty=None, logit_bias=None,
               response_format: dict | None = None, regex: str | None = None,
               logprobs: int | None = None) -> Iterator[list[list[int]] | Generation]:
        """Yield, per dispatch, the new tokens of every row; the last item is the full Generation (its stats as
        ``generate``'s: seconds count this generator's dispatches and transfers, not compiling, calibrating, or
        the caller's time between items). The logits processors as ``generate``'s."""
        processing = dict(top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                          logit_bias=logit_bias, response_format=response_format, regex=regex, logprobs=logprobs)
        compiled_before = self.programs.compile_s
        request = self.resolve(self.prepare(prompt, max_new_tokens, method, budget, temperature, block_size,
                                            **processing))
        inputs = self.inputs(request, temperature, seed, **processing)
        prefill, _ = self.programs.prefill(request, self._compile_inputs(request))
        self.programs.chunk(request, self._compile_inputs(request))
        compile_s = self.programs.compile_s - compiled_before
        rows = len(request.lens)
        busy, t0 = 0.0, time.perf_counter()
        state, nan = prefill(inputs)
        dispatches, seen = 1, np.zeros(rows, np.int64)
        while True:
            n_out, out, done = jax.device_get((state.n_out, state.out, state.done))
            chunk = [out[i, seen[i]:n_out[i]].tolist() for i in range(rows)]
            seen = n_out.copy()
            if any(chunk):
                busy += time.perf_counter() - t0
                yield chunk
                t0 = time.perf_counter()
            if done.all() or bool(nan):
                break
            state, bad = self.programs.advance(request, inputs, state, rounds_per_dispatch)
            nan = nan | bad
            dispatches += 1
        _check_finite(nan)
        accepted, width, rounds, lp = jax.device_get((state.stats.accepted, state.stats.width, state.rounds,
                                                      state.logprobs))
        busy += time.perf_counter() - t0
        yield self._result(request, out, n_out, accepted, width, int(rounds), busy, compile_s, dispatches, lp)


def _temperatures(temperature, rows: int) -> np.ndarray:
    """A request's temperature, checked: one for every row, or a list with one per row (a greedy row, 0, in a
    batch that samples samples at 1e-6: its argmax)."""
    values = np.asarray(temperature if isinstance(temperature, (list, tuple)) else [temperature] * rows, object)
    if values.ndim != 1 or len(values) != rows:
        raise GenerationError(f"temperature: one number, or a list of {rows} (one per row), got {temperature!r}")
    for t in values:
        fields.check(temperature=t)
    return values.astype(np.float64)


def token_logprobs(lp: engine.Logprobs, spans) -> list:
    """Host-side per-token log-probabilities from a fetched ``engine.Logprobs``: for each (row, start, end) of
    ``spans``, per output slot in [start, end), (logprob, [(token, logprob)] of the top ones)."""
    return [[(float(lp.chosen[i, k]), [(int(t), float(v)) for t, v in zip(lp.top_ids[i, k], lp.top[i, k])])
             for k in range(start, end)] for i, start, end in spans]


def device_memory_bytes() -> int | None:
    """Free bytes on this process's first device, where the backend reports them (GPUs do; the CPU does not:
    None). A local device: in a multi-process run the global first device belongs to process 0 only."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def _check_finite(nan_flag):
    if bool(nan_flag):
        raise GenerationError("the model produced NaN logits; check the weights and dtype")


_full_logits = jax.jit(full_logits, static_argnums=(1,), static_argnames=("attn_form", "rt"))


@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("rt",))
def _chunked_logits(params, cfg, tokens, rt):
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
    return chunked_forward(params, cfg, tokens, cache, rt.prefill_chunk, attn_form="full", rt=rt).logits


LAYOUTS = ("per-layer", "stacked")


def load(path: str, drafter: str | None = None, mesh=None, dtype=None, tokenizer: str | None = None,
         runtime: Runtime | None = None, verify: bool | None = None, layers: str | None = None) -> Model:
    """Load a kimi_jax checkpoint (orbax, stacked or layered) or an HF checkpoint directory (float or
    compressed-tensors INT4: K2.6 as published), optionally with a DFlash drafter.

    ``mesh`` (a Mesh or "tp=8"-style string): the weights' shardings are chosen first and every layer is read
    straight onto them (the host holds about one layer at a time). ``dtype`` casts the floating weights (INT4
    experts stay INT4); the default keeps the stored dtype, except on the CPU, where XLA's float32 matmuls are
    faster and exact enough to compare against references. ``runtime``: kernel choices (kimi_jax.Runtime).
    ``verify``: checksum every weight file of a kimi_jax checkpoint against its manifest (sizes are always
    checked; None checksums only small checkpoints such as the embedded default).
    ``layers``: "per-layer" reads every decoder layer into its own buffers (``Model.params`` holds each layer
    stack as a tuple of per-layer trees) and never allocates a stacked copy on the device; "stacked" keeps the
    layer stacks; None (default) decides by ``kimi_jax.model.compute_layout.own_buffers`` for the platform of the devices
    the weights go to (GPUs: per-layer, so the programs read each layer in place without holding two copies).
    """
    if layers not in (None, *LAYOUTS):
        raise ValueError(f"layers must be one of {LAYOUTS} or None, not {layers!r}")
    if dtype is None and jax.default_backend() == "cpu":
        dtype = jnp.float32
    if not os.path.isdir(path):
        raise checkpoint.CheckpointError(f"checkpoint directory {path!r} does not exist")
    mesh = None if mesh is None else sharding.make_mesh(mesh)
    kimi = checkpoint.is_kimi_checkpoint(path)
    if kimi:
        cfg = checkpoint.read_config(path)
    elif hf.is_hf_checkpoint(path):
        source = hf.HFCheckpoint(path)
        cfg = source.config
    else:
        raise checkpoint.CheckpointError(f"{path} holds neither {checkpoint.CONFIG_FILE} nor config.json")
    check_global_mesh(cfg, mesh)
    split = layers == "per-layer" if layers is not None else \
        own_buffers(cfg.num_hidden_layers, program_platform(Runtime(mesh=mesh)), mesh is not None)
    shardings = None if mesh is None else param_shardings(cfg, mesh)
    if kimi:
        cfg, params = checkpoint.restore(path, cfg, shardings=shardings, dtype=dtype, verify=verify, split=split)
    else:
        params = hf.stack_from(source, shardings, dtype or jnp.float32, split)
    tok = None
    try:
        tok = load_tokenizer(tokenizer or path)
    except (FileNotFoundError, ImportError, ValueError):
        if tokenizer is not None:
            raise
    model = Model(cfg, params, tokenizer=tok, mesh=mesh, runtime=runtime)
    if drafter is not None:
        # in the target's dtype (it reads the target's embedding and lm_head; a float32 copy of K2.6's would be
        # 13 GiB), split over the mesh as the programs run it (drafter.param_shardings, then compute_params packs
        # it): replicated, K2.6's would take 6.5 GiB on every device beside the split copy the programs read
        model.drafter = load_drafter(drafter, cfg, dtype=params["embed"].dtype, verify=verify, mesh=mesh,
                                     strategy=model.runtime.strategy)
    return model
