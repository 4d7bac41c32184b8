"""The OpenAI-compatible HTTP layer (FastAPI + pydantic; uvicorn serves it) over one ``Batcher``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Per request: ``max_tokens``,
``temperature`` (OpenAI's default 1.0; 0 is greedy), ``seed``, ``stop`` (strings), ``stream``,
``stream_options.include_usage``; the extension fields ``method`` and ``budget`` must name what the server was
started with (one compiled program serves a batch). Unsupported OpenAI features (``n`` > 1, ``top_p`` < 1,
``logprobs``, ``echo``, tools) are refused, never ignored. Every bad request is a 400 with OpenAI's error body;
a full queue is a 429.

Text is decoded incrementally (whole UTF-8 characters only); a stop string ends the request and is not
returned, and text that could still become a stop string is held back until it cannot. Token counts in
``usage`` are the prompt's and the generated tokens up to the finish (a stop token included).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from kimi_jax.decoding.engine import GenerationError
from kimi_jax.serving.batcher import Batcher, Job, QueueFull
from kimi_jax.text.tokenizer import NoChatTemplateError, StreamDecoder


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")          # OpenAI clients send fields we do not use; see _refuse
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    method: Literal["ar", "dflash", "ddtree"] | None = None
    budget: int | Literal["auto"] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None


class BadRequest(ValueError):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


class Metrics:
    def __init__(self, batcher: Batcher):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kimi_jax_requests", "requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
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


class _Generation:
    """One request's path from the batcher thread to the client: tokens in, text out, stop strings, usage."""

    def __init__(self, app_state, ids: list[int], body: _Common, max_tokens: int):
        self.tok = app_state.tokenizer
        self.metrics: Metrics = app_state.metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        self.decoder = StreamDecoder(self.tok)
        self.text, self.sent_chars, self.tokens, self.finish_reason = "", 0, 0, None
        self.prompt_tokens = len(ids)
        self.eos = set(app_state.batcher.model.config.eos_token_ids)
        hop = lambda kind: lambda x: self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, x))  # noqa: E731
        self.job = Job(ids, max_tokens, body.temperature, body.seed or 0, emit=hop("tokens"), finish=hop("finish"))
        self.t_last = None

    def _accept(self, ids: list[int]) -> None:
        now = time.perf_counter()
        if self.t_last is None:
            self.metrics.ttft.observe(now - self.job.submitted)
        elif ids:
            for _ in ids:
                self.metrics.token_latency.observe((now - self.t_last) / len(ids))
        self.t_last = now
        for t in ids:
            if self.finish_reason is not None:
                return
            self.tokens += 1
            if t in self.eos:
                self.finish_reason = "stop"
                self.job.cancel()
                return
            self.text += self.decoder.push([t])
            hit = [self.text.find(s) for s in self.stops if s in self.text]
            if hit:
                self.text = self.text[:min(hit)]
                self.finish_reason = "stop"
                self.job.cancel()

    def _ready_text(self, final: bool) -> str:
        """New text that can no longer turn into a stop string."""
        hold = 0 if final else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent_chars, len(self.text) - hold)
        delta, self.sent_chars = self.text[self.sent_chars:end], end
        return delta

    async def deltas(self):
        """(text delta, finish_reason or None) as the batcher delivers; the last one has the reason."""
        while True:
            kind, x = await self.queue.get()
            if kind == "tokens":
                self._accept(x)
                if self.finish_reason is None:
                    delta = self._ready_text(final=False)
                    if delta:
                        yield delta, None
                continue
            if self.finish_reason is None:
                self.text += self.decoder.flush()
                self.finish_reason = "length" if x == "length" else "stop" if x in ("stop", "cancelled") else x
            self.metrics.completion_tokens.inc(self.tokens)
            yield self._ready_text(final=True), self.finish_reason
            return

    def usage(self):
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}


def create_app(batcher: Batcher, model_name: str) -> FastAPI:
    app = FastAPI(title="kimi_jax", docs_url=None, redoc_url=None)
    app.state.batcher = batcher
    app.state.tokenizer = batcher.model.tokenizer
    app.state.metrics = metrics = Metrics(batcher)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        metrics.requests.labels(request.url.path, "400").inc()
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})")
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}", param=where)

    @app.get("/health")
    async def health():
        return {"status": "ok", "slots": batcher.max_batch, "active": batcher.active, "waiting": batcher.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "kimi_jax"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    def _refuse(body: _Common):
        if body.model not in (None, model_name):
            raise BadRequest(f"model {body.model!r} is not served here; GET /v1/models lists {model_name!r}")
        if body.n != 1:
            raise BadRequest("n > 1 is not supported")
        if body.top_p != 1.0:
            raise BadRequest("top_p < 1 is not supported (the lossless acceptance samples the full distribution)")
        if body.method not in (None, batcher.method):
            raise BadRequest(f"method {body.method!r} is not served by this server (it runs {batcher.method!r}; "
                             "start it with --method)")
        if body.budget not in (None, batcher.budget if batcher.budget is not None else "auto"):
            raise BadRequest(f"budget {body.budget!r} is not served by this server (it runs "
                             f"{batcher.budget or 'auto'!r}; start it with --budget)")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise BadRequest("stop takes up to 4 non-empty strings")

    async def _run(request: Request, body: _Common, ids: list[int], endpoint: str, shape):
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        batcher.check(ids, max_tokens)
        gen = _Generation(app.state, ids, body, max_tokens)
        batcher.submit(gen.job)
        metrics.prompt_tokens.inc(len(ids))
        rid, created = f"{shape['prefix']}-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "created": created, "model": model_name}
        if not body.stream:
            text, reason = "", None
            async for delta, reason in gen.deltas():
                text += delta
            metrics.requests.labels(endpoint, "200").inc()
            return {**head, "object": shape["object"], "choices": [shape["choice"](text, reason)],
                    "usage": gen.usage()}

        async def events():
            try:
                if "first" in shape:
                    yield _sse({**head, "object": shape["chunk"], "choices": [shape["first"]]})
                async for delta, reason in gen.deltas():
                    if delta or reason:
                        yield _sse({**head, "object": shape["chunk"], "choices": [shape["delta"](delta, reason)]})
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse({**head, "object": shape["chunk"], "choices": [], "usage": gen.usage()})
                yield "data: [DONE]\n\n"
                metrics.requests.labels(endpoint, "200").inc()
            finally:
                gen.job.cancel()        # a client that left frees its slot at the next dispatch

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _guarded(request: Request, endpoint: str, work):
        try:
            return await work()
        except (BadRequest, GenerationError, NoChatTemplateError) as e:
            metrics.requests.labels(endpoint, "400").inc()
            return _error(400, str(e))
        except QueueFull as e:
            metrics.requests.labels(endpoint, "429").inc()
            return _error(429, str(e), kind="rate_limit_error")

    completion_shape = {
        "prefix": "cmpl", "object": "text_completion", "chunk": "text_completion",
        "choice": lambda text, reason: {"index": 0, "text": text, "finish_reason": reason, "logprobs": None},
        "delta": lambda text, reason: {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}}
    chat_shape = {
        "prefix": "chatcmpl", "object": "chat.completion", "chunk": "chat.completion.chunk",
        "first": {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
        "choice": lambda text, reason: {"index": 0, "message": {"role": "assistant", "content": text},
                                        "finish_reason": reason, "logprobs": None},
        "delta": lambda text, reason: {"index": 0, "delta": {"content": text} if text else {},
                                       "finish_reason": reason}}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        async def work():
            _refuse(body)
            if body.echo or body.logprobs is not None:
                raise BadRequest("echo and logprobs are not supported")
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise BadRequest("one prompt per request (send several requests: they are batched)")
                prompt = prompt[0]
            if isinstance(prompt, str):
                if app.state.tokenizer is None:
                    raise BadRequest("this model has no tokenizer: send the prompt as token ids")
                ids = app.state.tokenizer.encode(prompt)
            else:
                ids = list(prompt)
            if not ids:
                raise BadRequest("empty prompt")
            return await _run(request, body, ids, "/v1/completions", completion_shape)
        return await _guarded(request, "/v1/completions", work)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest):
        async def work():
            _refuse(body)
            if body.logprobs or body.tools:
                raise BadRequest("logprobs and tools are not supported")
            if app.state.tokenizer is None:
                raise BadRequest("this model has no tokenizer, so no chat format")
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            ids = app.state.tokenizer.encode_chat(messages, add_generation_prompt=True)
            return await _run(request, body, ids, "/v1/chat/completions", chat_shape)
        return await _guarded(request, "/v1/chat/completions", work)

    return app


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
