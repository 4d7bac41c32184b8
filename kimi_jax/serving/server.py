"""The OpenAI-compatible HTTP layer (FastAPI + pydantic; uvicorn serves it) over one ``Batcher``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Per request: ``max_tokens``
(``max_completion_tokens``), ``temperature`` (OpenAI's default 1.0; 0 is greedy), ``seed``, ``stop`` (strings),
``stream``, ``stream_options.include_usage``, vLLM's ``stop_token_ids`` (each ends the reply as eos does, left
out of the text; the row runs on until the next dispatch retires it, its extra tokens dropped), the logits
processors (``top_p``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``; vLLM's ``top_k``, ``min_p``, ``repetition_penalty``: their order and
semantics in ``kimi_jax.decoding.processors``), ``n`` (up to the server's slots: each choice is one batch row,
``usage`` counts the prompt once and every choice's tokens, a stream interleaves the choices' events by
``index``, and one failing choice fails the request); the extension fields ``method`` and ``budget`` must name what the
server was started with (one compiled program serves a batch). Chat requests also take ``tools``, ``tool_choice``,
tool messages and ``chat_template_kwargs.thinking``; with K2's chat format the reply is parsed into ``content``,
``reasoning_content`` and ``tool_calls`` (``kimi_jax.serving.tools``).

Every field is checked before the request is queued (pydantic in strict mode, then ``kimi_jax.fields`` for the
ranges the engine accepts, then the server's limits), so nothing a request says can fail inside the batch.
OpenAI fields this server does not implement are accepted only at the value that asks for nothing
(``openai_format.NOT_IMPLEMENTED``; the request and response shapes live there), fields OpenAI does not define
are refused: never silently ignored. Errors use OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request, 404 for an unknown model or URL, 405 for a wrong method, 429 for a full queue,
503 while shutting down, 500 (with the request id the log names) when a request fails inside the server; a
stream that fails after its first event ends with one ``data: {"error": ...}`` event instead. In front of the
app, ``kimi_jax.serving.access`` answers 401 (API key), 413 (body size), 408 (a slow client) and 429 (the key's
requests in flight), and writes the audit line.

Text is decoded incrementally (whole UTF-8 characters only); a stop string ends the request and is not
returned, and text that could still become a stop string is held back until it cannot. Token counts in
``usage`` are the prompt's and the generated tokens up to the finish (a stop token included);
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens the prefix cache served (OpenAI's field).
``/metrics`` reports the prefix cache's hit rate and pages in use (``kimi_jax.serving.prefix_cache``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException

from kimi_jax import fields
from kimi_jax.decoding import processors
from kimi_jax.fields import GenerationError
from kimi_jax.serving.access import SCOPE_KEY, AccessControl, AccessPolicy, Exchange, HeaderDeadline
from kimi_jax.serving.batcher import Batcher, Draining, Failed, Job, QueueFull
from kimi_jax.serving.openai_format import (IDENTIFYING, NOT_IMPLEMENTED, UNION_BRANCH, ChatRequest, Common,
                                            CompletionRequest, chat_shape, completion_shape, failure_body,
                                            processing, sse, structured, usage)
from kimi_jax.serving.tools import InvalidToolRequest, ToolPlan, check_messages, has_reply_format
from kimi_jax.text.grammar import response_format_regex
from kimi_jax.text.tokenizer import NoChatTemplateError, StreamDecoder


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def _error(status: int, message: str, kind: str | None = None, param: str | None = None, code: str | None = None,
           headers: dict | None = None):
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


class Metrics:
    def __init__(self, batcher: Batcher):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kimi_jax_requests", "requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.requests_by_key = Counter("kimi_jax_requests_by_key", "requests by API key id ('none': no key was "
                                       "required, 'unauthenticated': refused for the key) and status",
                                       ["key", "status"], registry=r)
        self.prompt_tokens = Counter("kimi_jax_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.completion_tokens = Counter("kimi_jax_completion_tokens", "generated tokens returned", registry=r)
        self.ttft = Histogram("kimi_jax_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.token_latency = Histogram("kimi_jax_token_latency_seconds", "time per generated token after the first",
                                       buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1), registry=r)
        Gauge("kimi_jax_queue_depth", "requests waiting for a slot", registry=r).set_function(
            lambda: batcher.queue_depth)
        Gauge("kimi_jax_active_slots", "slots generating now", registry=r).set_function(lambda: batcher.active)
        Gauge("kimi_jax_mean_tau", "tokens emitted per row per round since start", registry=r).set_function(
            lambda: batcher.stats.mean_tau)
        if batcher.prefix is not None:
            prefix = batcher.prefix
            Gauge("kimi_jax_prefix_cache_hit_rate", "prompt tokens served by the prefix cache / prompt tokens "
                  "looked up, since start", registry=r).set_function(lambda: prefix.stats.hit_rate)
            Gauge("kimi_jax_prefix_cache_hit_tokens", "prompt tokens served by the prefix cache since start",
                  registry=r).set_function(lambda: prefix.stats.hit_tokens)
            Gauge("kimi_jax_prefix_cache_pages_used", "pages of the prefix cache holding a prompt page",
                  registry=r).set_function(lambda: prefix.used)
            Gauge("kimi_jax_prefix_cache_pages", "pages of the prefix cache", registry=r).set_function(
                lambda: prefix.capacity)


class RequestFailed(Exception):
    def __init__(self, failed: Failed):
        super().__init__(failed.message)
        self.failed = failed


class _Generation:
    """One request's path from the batcher thread to the client: tokens in, text out, stop strings, usage."""

    def __init__(self, app_state, rid: str, ids: list[int], body: Common, max_tokens: int,
                 reply_regex: str | None = None):
        self.tok = app_state.tokenizer
        self.metrics: Metrics = app_state.metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        self.decoder = StreamDecoder(self.tok)
        self.text, self.sent_chars, self.tokens, self.finish_reason = "", 0, 0, None
        self.prompt_tokens = len(ids)
        self.eos = set(app_state.batcher.model.config.eos_token_ids) | set(body.stop_token_ids or ())
        hop = lambda kind: lambda x: self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, x))  # noqa: E731
        self.job = Job(ids, max_tokens, body.temperature, body.seed or 0, emit=hop("tokens"), finish=hop("finish"),
                       id=rid, processing=processing(body, reply_regex))
        if "logprobs" in self.job.processing:
            self.job.emit_logprobs = hop("logprobs")
        self.pending: list = []         # logprobs of delivered tokens not yet accepted
        self.lps: list = []             # (token, text offset, logprob, top) of every token that made text
        self.lps_sent = 0
        self.t_last = None

    def fail(self, failed: Failed) -> None:
        """End this request from the HTTP side (shutdown's deadline), whatever the batcher is doing."""
        self.job.cancel()
        self.queue.put_nowait(("finish", failed))

    def _accept(self, ids: list[int]) -> None:
        now = time.perf_counter()
        if self.t_last is None:
            self.metrics.ttft.observe(now - self.job.submitted)
        elif ids:
            for _ in ids:
                self.metrics.token_latency.observe((now - self.t_last) / len(ids))
        self.t_last = now
        entries, self.pending = self.pending[:len(ids)], self.pending[len(ids):]
        for i, t in enumerate(ids):
            if self.finish_reason is not None:
                return
            self.tokens += 1
            if t in self.eos:
                self.finish_reason = "stop"
                self.job.cancel()
                return
            if i < len(entries):
                self.lps.append((t, len(self.text), *entries[i]))
            self.text += self.decoder.push([t])
            hit = [self.text.find(s) for s in self.stops if s in self.text]
            if hit:
                self.text = self.text[:min(hit)]
                self.finish_reason = "stop"
                self.job.cancel()

    def take_logprobs(self) -> list | None:
        """The logprobs of the tokens whose text was sent since the last call (None: not asked for); a token past a
        stop string is dropped with its text."""
        if self.job.emit_logprobs is None:
            return None
        upto = self.lps_sent
        while upto < len(self.lps) and self.lps[upto][1] < self.sent_chars:
            upto += 1
        out, self.lps_sent = self.lps[self.lps_sent:upto], upto
        return out

    def _ready_text(self, final: bool) -> str:
        """New text that can no longer turn into a stop string."""
        hold = 0 if final else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent_chars, len(self.text) - hold)
        delta, self.sent_chars = self.text[self.sent_chars:end], end
        return delta

    async def deltas(self):
        """(text delta, finish_reason or None) as the batcher delivers; the last one has the reason. A request
        that failed raises RequestFailed (after a stop string or eos it had already ended well)."""
        while True:
            kind, x = await self.queue.get()
            if kind == "logprobs":
                self.pending += x
                continue
            if kind == "tokens":
                self._accept(x)
                if self.finish_reason is None:
                    delta = self._ready_text(final=False)
                    if delta:
                        yield delta, None
                continue
            if isinstance(x, Failed) and self.finish_reason is None:
                raise RequestFailed(x)
            if self.finish_reason is None:
                self.text += self.decoder.flush()
                self.finish_reason = "length" if x == "length" else "stop"
            self.metrics.completion_tokens.inc(self.tokens)
            yield self._ready_text(final=True), self.finish_reason
            return



def create_app(batcher: Batcher, model_name: str, policy: AccessPolicy | None = None) -> FastAPI:
    """The app, behind ``access.AccessControl`` with ``policy`` (default: open, limits derived from the batcher)."""
    app = FastAPI(title="kimi_jax", docs_url=None, redoc_url=None)
    app.state.batcher = batcher
    app.state.policy = policy = (policy or AccessPolicy()).resolve(batcher)
    app.state.tokenizer = batcher.model.tokenizer
    app.state.metrics = metrics = Metrics(batcher)
    app.state.open = open_requests = set()         # _Generations not yet answered in full (shutdown ends them)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        metrics.requests.labels(request.url.path, "400").inc()
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})")
        loc = [str(x) for x in first.get("loc", ())[1:]]
        unknown = first.get("type") == "extra_forbidden"        # then the last part is the unknown field's name
        loc = [x for i, x in enumerate(loc) if not UNION_BRANCH.fullmatch(x) or unknown and i == len(loc) - 1]
        where = ".".join(loc) or None
        if unknown:
            return _error(400, f"{where}: unknown field", param=where)
        return _error(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        metrics.requests.labels("other", str(exc.status_code)).inc()
        if exc.status_code == 404:
            return _error(404, f"unknown URL: {request.method} {request.url.path}", code="unknown_url")
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed",
                          headers=exc.headers)
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        state = {"slots": batcher.max_batch, "active": batcher.active, "waiting": batcher.queue_depth,
                 "processes": batcher.processes}
        if batcher.lost:
            return JSONResponse({"status": "lost", "error": batcher.lost, **state}, 503)
        if batcher.draining:
            return JSONResponse({"status": "draining", **state}, 503)
        if batcher.degraded:
            return JSONResponse({"status": "degraded", "error": batcher.degraded, **state}, 503)
        return {"status": "ok", **state}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "kimi_jax"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    def _check(body: Common):
        if body.model not in (None, model_name):
            raise BadRequest(f"model {body.model!r} does not exist here; GET /v1/models lists {model_name!r}",
                             404, "model_not_found", "model")
        for name, value in (body.model_extra or {}).items():
            if name in IDENTIFYING:
                continue
            if name not in NOT_IMPLEMENTED:
                raise BadRequest(f"{name}: unknown field", param=name)
            if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                             for v in NOT_IMPLEMENTED[name]):
                neutral = " or ".join(json.dumps(v) for v in NOT_IMPLEMENTED[name]) or "null"
                raise BadRequest(f"{name} is not supported by this server (only {neutral})", param=name)
        if body.temperature is None:
            body.temperature = 1.0
        try:
            fields.check(temperature=body.temperature, seed=body.seed)
            processors.sampling(1, batcher.model.config.vocab_size,
                                **{k: v for k, v in processing(body).items() if k in fields.PROCESSORS})
        except GenerationError as e:
            raise BadRequest(str(e), param=str(e).split()[0]) from None
        if body.method not in (None, batcher.method):
            raise BadRequest(f"method {body.method!r} is not served by this server (it runs {batcher.method!r}; "
                             "start it with --method)", param="method")
        if body.budget not in (None, batcher.budget if batcher.budget is not None else "auto"):
            raise BadRequest(f"budget {body.budget!r} is not served by this server (it runs "
                             f"{batcher.budget or 'auto'!r}; start it with --budget)", param="budget")
        if getattr(body, "top_logprobs", None) is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if (body.n or 1) > batcher.max_batch:
            raise BadRequest(f"n {body.n} exceeds this server's {batcher.max_batch} slots (the choices run side by "
                             "side; start it with a larger --max-batch)", param="n")
        vocab = batcher.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()) or len(body.stop_token_ids or ()) > 64:
            raise BadRequest(f"stop_token_ids takes up to 64 token ids in [0, {vocab})", param="stop_token_ids")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise BadRequest("stop takes up to 4 non-empty strings", param="stop")

    async def _run(body: Common, ids: list[int], endpoint: str, shape, exchange: Exchange,
                   reply_regex: str | None = None):
        """Generate ``body.n`` choices of ``ids`` (one batch row each) and answer: one body, or a stream whose
        events interleave the choices by index. ``shape(i)`` builds choice i's response pieces; ``reply_regex``:
        the whole reply's grammar (strict tools), in place of the response format."""
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        batcher.check(ids, max_tokens)
        if asked := structured(body, reply_regex):
            # compiled here, off the event loop (a json_object automaton takes seconds once), and cached for
            # the batcher; a schema it cannot enforce is a 400 naming the feature
            batcher.check_grammar(await asyncio.to_thread(batcher.model.grammar, **asked))
        shapes = [shape(i) for i in range(body.n or 1)]
        rid = f"{shapes[0]['prefix']}-{uuid.uuid4().hex[:24]}"
        gens = [_Generation(app.state, rid, ids, body, max_tokens, reply_regex) for _ in shapes]
        try:
            for gen in gens:
                batcher.submit(gen.job)
        except (QueueFull, Draining):
            for gen in gens:
                gen.job.cancel()        # the choices already queued leave at once (cancelled before admission)
            raise
        open_requests.update(gens)
        metrics.prompt_tokens.inc(len(ids))
        exchange.id, exchange.prompt_tokens = rid, len(ids)        # the audit line names the id the client sees
        head = {"id": rid, "created": int(time.time()), "model": model_name, "object": shapes[0]["chunk"]}

        def done():
            open_requests.difference_update(gens)
            for gen in gens:
                gen.job.cancel()         # a client that left (or a failure) frees its slots at the next dispatch
            exchange.completion_tokens = sum(g.tokens for g in gens)

        if not body.stream:
            try:
                choices = await asyncio.gather(*(_whole(g, s) for g, s in zip(gens, shapes)))
            except RequestFailed as e:
                return _failure(e.failed, rid, endpoint)
            finally:
                done()
            metrics.requests.labels(endpoint, "200").inc()
            return {**head, "object": shapes[0]["object"], "choices": choices, "usage": usage(gens)}

        async def events():
            status = "499"                      # unless it ends below: the client went away
            try:
                for s in shapes:
                    if "first" in s:
                        yield sse({**head, "choices": [s["first"]]})
                async for choice in _interleaved(gens, shapes):
                    yield sse({**head, "choices": [choice]})
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(gens)})
                yield "data: [DONE]\n\n"
                status = "200"
            except RequestFailed as e:
                status = str(e.failed.status)
                yield sse(failure_body(e.failed, rid))
            finally:
                done()
                metrics.requests.labels(endpoint, status).inc()
                exchange.status = int(status)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-request-id": rid})

    def _failure(failed: Failed, rid: str, endpoint: str):
        metrics.requests.labels(endpoint, str(failed.status)).inc()
        return JSONResponse(failure_body(failed, rid), failed.status, headers={"x-request-id": rid})

    async def _guarded(endpoint: str, work):
        try:
            return await work()
        except BadRequest as e:
            metrics.requests.labels(endpoint, str(e.status)).inc()
            return _error(e.status, str(e), param=e.param, code=e.code)
        except (GenerationError, NoChatTemplateError) as e:
            metrics.requests.labels(endpoint, "400").inc()
            return _error(400, str(e))
        except InvalidToolRequest as e:
            metrics.requests.labels(endpoint, "400").inc()
            return _error(400, str(e), param=e.param)
        except QueueFull as e:
            metrics.requests.labels(endpoint, "429").inc()
            return _error(429, str(e), kind="rate_limit_error")
        except Draining as e:
            metrics.requests.labels(endpoint, "503").inc()
            return _error(503, str(e), code="shutting_down")


    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        async def work():
            _check(body)
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise BadRequest("one prompt per request (send several requests: they are batched)",
                                     param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                if app.state.tokenizer is None:
                    raise BadRequest("this model has no tokenizer: send the prompt as token ids", param="prompt")
                ids = app.state.tokenizer.encode(prompt)
            else:
                ids = list(prompt)
            if not ids:
                raise BadRequest("empty prompt", param="prompt")
            shape = functools.partial(completion_shape, app.state.tokenizer)
            return await _run(body, ids, "/v1/completions", shape, request.scope[SCOPE_KEY])
        return await _guarded("/v1/completions", work)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        async def work():
            _check(body)
            tok = app.state.tokenizer
            if tok is None:
                raise BadRequest("this model has no tokenizer, so no chat format")
            check_messages(body.messages)
            thinking = body.chat_template_kwargs.thinking if body.chat_template_kwargs else None
            plan = ToolPlan(body.tools, body.tool_choice, thinking, has_reply_format(tok))
            prompt = plan.prompt(tok, [m.model_dump(exclude_none=True) for m in body.messages])
            # strict tools: the whole reply is one grammar (the response format its content part)
            reply_regex = plan.reply_regex(response_format_regex(body.response_format, body.guided_regex)) \
                if plan.strict else None
            return await _run(body, tok.encode(prompt), "/v1/chat/completions",
                              chat_shape(tok, lambda: plan.reply(prompt)), request.scope[SCOPE_KEY], reply_regex)
        return await _guarded("/v1/chat/completions", work)

    def end_open_requests():
        for gen in list(open_requests):
            gen.fail(Failed("the server shut down before this request finished", 503))
    app.state.end_open_requests = end_open_requests
    app.add_middleware(AccessControl, policy=policy, metrics=metrics, routes={r.path for r in app.routes})
    return app


async def _whole(gen: _Generation, shape) -> dict:
    """Choice ``gen`` as one piece, once it ended."""
    text, reason = "", None
    async for delta, reason in gen.deltas():
        text += delta
    return shape["choice"](text, reason, gen.take_logprobs())


async def _interleaved(gens: list[_Generation], shapes):
    """The stream's choice deltas of every generation, as each arrives. The first failure raises RequestFailed."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(gen, shape):
        try:
            async for delta, reason in gen.deltas():
                for choice in shape["deltas"](delta, reason, gen.take_logprobs()):
                    await merged.put(choice)
        except RequestFailed as e:
            await merged.put(e)
        finally:
            await merged.put(None)

    tasks = [asyncio.ensure_future(pump(g, s)) for g, s in zip(gens, shapes)]
    try:
        left = len(tasks)
        while left:
            item = await merged.get()
            if item is None:
                left -= 1
            elif isinstance(item, RequestFailed):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


class _Server(uvicorn.Server):
    """uvicorn, whose exit (SIGTERM, SIGINT, or ``shutdown``) also starts the bounded drain: the batcher's
    deadline, and the HTTP side's own a moment later, which answers every open request even if the device
    thread is stuck inside a dispatch."""

    def __init__(self, app: FastAPI, host: str, port: int, grace: float, ssl_certfile=None, ssl_keyfile=None):
        # uvicorn's deadline only backs ours up: it cancels responses still open a few seconds after ours.
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        timeout_graceful_shutdown=grace + 5,
                                        http=HeaderDeadline.after(app.state.policy.read_timeout),
                                        ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile))
        self.app, self.grace, self.loop = app, grace, None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        batcher: Batcher = self.app.state.batcher
        if not batcher.draining:
            batcher.drain(self.grace)
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.loop.call_later, self.grace + 0.5,
                                               self.app.state.end_open_requests)
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str, port: int, grace: float, ssl_certfile: str | None = None,
          ssl_keyfile: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``shutdown(app)``); then the listening socket closes, running and queued
    requests get ``grace`` seconds to finish, and whatever is left ends with a 503 error (an error event in a
    stream). Returns once every response is sent. With ``ssl_certfile`` (and ``ssl_keyfile`` unless the
    certificate file holds the key) it serves HTTPS."""
    app.state.server = _Server(app, host, port, grace, ssl_certfile, ssl_keyfile)
    app.state.server.run()


def shutdown(app: FastAPI) -> None:
    """What SIGTERM does, for a server run in a thread (tests, embedding): start the bounded drain."""
    app.state.server.handle_exit(signal.SIGTERM, None)


def stop_now(app: FastAPI) -> None:
    """End the server at once, from any thread (the run lost a process, ``Batcher.lose``): the open requests end
    with a 503 now, not after a grace period, and the port closes."""
    server = getattr(app.state, "server", None)
    if server is None or server.loop is None:
        return
    server.loop.call_soon_threadsafe(app.state.end_open_requests)
    server.should_exit = True
