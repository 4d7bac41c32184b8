"""Who may use the server, and how much: API keys, the request-body limit, the per-key limit on requests in
flight, read deadlines for slow clients, and one audit line per request (docs/serving.md says why each default).

One ASGI middleware (``AccessControl``) stands in front of the FastAPI app. For every request it
1. checks ``Authorization: Bearer KEY`` on the ``/v1`` routes (and ``/metrics`` if asked) when keys are set:
   a wrong or missing key is a 401 with OpenAI's error body;
2. counts the request against its key's limit on requests in flight (the client's address on a server without
   keys): one over it is a 429 with ``retry-after``;
3. reads the body itself, up to the limit and within the read deadline: a ``Content-Length`` over the limit is a
   413 before any of the body is read, a chunked body is cut off with a 413 at the limit, a body that has not
   arrived by the deadline is a 408; these refusals close the connection, so the rest of the body is never read;
4. hands the app the body it read, and writes the audit line once the response is over.
A request's headers have a deadline too, kept by uvicorn's h11 protocol with a timer (``HeaderDeadline``).
Refusals happen on the request's own task, before it reaches the batcher: they cannot touch a running request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import hmac
import json
import logging
import time
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

audit_log = logging.getLogger("kimi_jax.serve.audit")
SCOPE_KEY = "kimi_jax.exchange"          # where the app finds the request's Exchange in the ASGI scope
BYTES_PER_TOKEN = 32                     # of JSON per prompt token in the default body limit (see body_limit)
BODY_HEADROOM = 1 << 20                  # bytes of JSON beyond the prompt's: messages' structure, tools, fields


def body_limit(max_len: int) -> int:
    """The default request-body limit for a server whose requests hold ``max_len`` tokens: 32 bytes of JSON per
    token (an average English token is ~4 bytes, a CJK character escaped as \\uXXXX 6, an emoji 12, a token id
    in a list 8) plus 1 MiB for everything else in the body. 9 MiB at K2.6's 262,144-token context."""
    return BYTES_PER_TOKEN * max_len + BODY_HEADROOM


def key_id(key: str) -> str:
    """How logs and metrics name a key: the first 8 hex digits of its SHA-256, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    """What ``create_app`` enforces. ``None`` limits are derived from the batcher (``resolve``)."""
    api_keys: tuple[str, ...] = ()       # none: the server is open, as vLLM is without --api-key
    max_body_bytes: int | None = None    # None: body_limit(the batcher's max_len)
    max_in_flight: int | None = None     # per key; None: half the slots + queue with keys, no limit without; 0: none
    read_timeout: float = 30.0           # seconds for a request's headers, and again for its body
    metrics_need_key: bool = False       # /metrics behind the key too (it holds counts and key ids, no text)
    log_bodies: bool = False             # the audit line also holds the request body (the prompt): off

    def resolve(self, batcher) -> AccessPolicy:
        body = self.max_body_bytes if self.max_body_bytes is not None else body_limit(batcher.max_len)
        in_flight = self.max_in_flight
        if in_flight is None:
            in_flight = max(1, (batcher.max_batch + batcher.queue_size) // 2) if self.api_keys else 0
        return dataclasses.replace(self, max_body_bytes=body, max_in_flight=in_flight)


@dataclasses.dataclass
class Exchange:
    """One request as the audit line and the per-key metrics see it; the app fills in what only it knows."""
    id: str                              # the app replaces it with its response id (cmpl-..., chatcmpl-...)
    route: str                           # a route of the app, or "other": never the client's text
    key: str = "none"                    # key id; "none": no key was required; "unauthenticated": 401
    status: int | None = None            # the response's, or how a stream ended (499: the client left)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class Keys:
    def __init__(self, keys: tuple[str, ...]):
        self._digests = [(hashlib.sha256(k.encode()).digest(), key_id(k)) for k in keys]

    def __bool__(self):
        return bool(self._digests)

    def identify(self, authorization: bytes | None) -> str | None:
        """The key id of a ``Bearer`` key that is one of ours, else None. Digests are compared, every one of
        them, with hmac.compare_digest: the time taken says neither which key matched nor how much of one."""
        scheme, _, presented = (authorization or b"").strip().partition(b" ")
        digest = hashlib.sha256(presented.strip()).digest()
        found = None
        for known, kid in self._digests:
            if hmac.compare_digest(known, digest):
                found = kid
        return found if scheme.lower() == b"bearer" else None


class Refusal(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: tuple = ()):
        super().__init__(message)
        self.status, self.kind, self.code, self.headers = status, kind, code, headers


class AccessControl:
    """The ASGI middleware described in the module docstring."""

    def __init__(self, app, policy: AccessPolicy, metrics, routes: set[str]):
        self.app, self.policy, self.metrics, self.routes = app, policy, metrics, routes
        self.keys = Keys(policy.api_keys)
        self.in_flight: collections.Counter[str] = collections.Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        exchange = scope[SCOPE_KEY] = Exchange(f"req-{uuid.uuid4().hex[:24]}", path if path in self.routes
                                               else "other")
        t0, body = time.perf_counter(), None
        try:
            body = await self._admit_and_serve(scope, receive, send, exchange)
        finally:
            self._account(scope, exchange, time.perf_counter() - t0, body)

    async def _admit_and_serve(self, scope, receive, send, exchange: Exchange) -> bytes | None:
        path, headers = scope["path"], dict(scope["headers"])
        guarded = path.startswith("/v1/") or path == "/v1" or (path == "/metrics" and self.policy.metrics_need_key)
        expects_body = b"content-length" in headers or b"transfer-encoding" in headers
        try:
            if guarded and self.keys:
                exchange.key = self.keys.identify(headers.get(b"authorization")) or "unauthenticated"
                if exchange.key == "unauthenticated":
                    raise Refusal(401, "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                                  code="invalid_api_key", headers=((b"www-authenticate", b"Bearer"),))
            client = exchange.key if self.keys else (scope.get("client") or ("?",))[0]
            limit = self.policy.max_in_flight if path.startswith("/v1/") else 0
            if limit and self.in_flight[client] >= limit:
                raise Refusal(429, f"this {'key' if self.keys else 'client'} has {limit} requests in flight, its "
                              "limit; retry when one has finished", kind="rate_limit_error",
                              code="too_many_requests_in_flight", headers=((b"retry-after", b"1"),))
            self.in_flight[client] += 1
            try:
                body = await self._read_body(receive, headers)
                if body is None:                # the client left while sending
                    exchange.status = 499
                    return None
                await self.app(scope, _replay(body, receive), self._watch(send, exchange))
                return body
            finally:
                self.in_flight[client] -= 1
                if not self.in_flight[client]:
                    del self.in_flight[client]
        except Refusal as r:
            exchange.status = r.status
            self.metrics.requests.labels(exchange.route, str(r.status)).inc()      # the app never saw it
            close = ((b"connection", b"close"),) if expects_body else ()
            await _send_error(send, r, (*r.headers, *close, (b"x-request-id", exchange.id.encode())))
            return None

    async def _read_body(self, receive, headers) -> bytes | None:
        """The whole body (None if the client left first); a Refusal if it is over the limit or late."""
        limit = self.policy.max_body_bytes
        too_large = Refusal(413, f"the request body is over this server's limit of {limit} bytes",
                            code="request_too_large")
        if int(headers.get(b"content-length", 0)) > limit:     # h11 has checked that it is a number
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.policy.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise Refusal(408, f"the request body did not arrive within {self.policy.read_timeout:g} s",
                          code="request_timeout") from None

    def _watch(self, send, exchange: Exchange):
        """The app's send, which notes the status and names the request id on every response."""
        async def watched(message):
            if message["type"] == "http.response.start":
                exchange.status = exchange.status or message["status"]
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", exchange.id.encode()))
                message = {**message, "headers": headers}
            await send(message)
        return watched

    def _account(self, scope, exchange: Exchange, seconds: float, body: bytes | None) -> None:
        status = str(exchange.status or 500)
        self.metrics.requests_by_key.labels(exchange.key, status).inc()
        fields = [f"id={exchange.id}", f"key={exchange.key}", f"client={(scope.get('client') or ('-',))[0]}",
                  f"method={scope['method']}", f"route={exchange.route}", f"status={status}",
                  f"prompt_tokens={_or_dash(exchange.prompt_tokens)}",
                  f"completion_tokens={_or_dash(exchange.completion_tokens)}", f"ms={seconds * 1e3:.1f}"]
        if self.policy.log_bodies and body:
            fields.append("body=" + json.dumps(body.decode("utf-8", "replace")))    # one line, whatever it holds
        audit_log.info("request " + " ".join(fields))


def _or_dash(n):
    return "-" if n is None else n


def _replay(body: bytes, receive):
    """A receive that gives the app the body already read, then what the client does next (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


async def _send_error(send, r: Refusal, headers: tuple) -> None:
    body = json.dumps({"error": {"message": str(r), "type": r.kind, "param": None, "code": r.code}}).encode()
    await send({"type": "http.response.start", "status": r.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers: ``seconds`` after the connection opens,
    or after the previous response on a kept-alive connection, a request whose headers are not all in gets a
    408 and the connection closes; a connection that sent nothing just closes (uvicorn itself waits for the
    first request's headers forever, and a trickle of bytes keeps its keep-alive timer off)."""
    seconds = 30.0

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self):
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc):
        self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self):
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.seconds, self._late)

    def _late(self):
        # IDLE: no complete request line and headers yet (h11 leaves IDLE once they are all in)
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:       # part of a request came: say why it ends (an idle one just closes)
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.close()

    @classmethod
    def after(cls, seconds: float) -> type[HeaderDeadline]:
        return type(cls.__name__, (cls,), {"seconds": seconds})
