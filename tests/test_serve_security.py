"""A server you can expose (kimi_jax.serving.access): API keys checked by the official `openai` client, the body
limit (413 before the body is read past it), the per-key limit on requests in flight (429 with retry-after), read
deadlines for slow clients (408), HTTPS with a self-signed certificate, the audit line and per-key metrics; and
none of these refusals harms a request that is running.

The real app and uvicorn run in this process on 127.0.0.1 behind a scripted batcher (no model): every job gets
REPLY's bytes as tokens, once the batcher's ``gate`` is open; a prompt that starts with "hold:" stops halfway until
``resume`` is set, so a request can be kept running while others are refused.
"""

import concurrent.futures
import hashlib
import json
import logging
import socket
import ssl
import subprocess
import threading
import time
import types

import httpx
import pytest

from kimi_jax.serving.access import AccessPolicy, body_limit
from kimi_jax.text.tokenizer import KimiTokenizer

openai = pytest.importorskip("openai")

ALPHA, BETA = "sk-alpha-0123456789", "sk-beta-9876543210"
LIMIT, IN_FLIGHT, READ_TIMEOUT, MAX_LEN, GRACE = 4096, 2, 1.0, 256, 1.0
REPLY = "0123456789abcdef" * 4                        # 64 tokens of one byte each


class ScriptedBatcher:
    """What the HTTP layer uses of a Batcher (see the module docstring)."""
    method, budget, max_batch, degraded, prefix, lost, processes = "ar", None, 4, None, None, None, 1
    max_len, queue_size = MAX_LEN, 8

    def __init__(self, tok):
        self.model = types.SimpleNamespace(tokenizer=tok, config=types.SimpleNamespace(
            eos_token_ids=tok.eos_ids, vocab_size=tok.vocab_size))
        self.stats = types.SimpleNamespace(mean_tau=0.0)
        self.active = self.queue_depth = 0
        self.draining = False
        self.gate, self.resume = threading.Event(), threading.Event()
        self.gate.set()
        self.waiting, self.lock = 0, threading.Lock()        # jobs held at the gate or halfway

    def check(self, ids, max_tokens):
        pass

    def submit(self, job):
        threading.Thread(target=self._deliver, args=(job,), daemon=True).start()

    def _hold(self, event):
        with self.lock:
            self.waiting += 1
        event.wait(30)
        with self.lock:
            self.waiting -= 1

    def _deliver(self, job):
        tok = self.model.tokenizer
        self._hold(self.gate)
        tokens = tok.encode(REPLY)[:job.max_tokens]
        half = len(tokens) // 2 if tok.decode(job.ids).startswith("hold:") else None
        for i, t in enumerate(tokens):
            if job.cancelled.is_set():
                break
            if i == half:
                self._hold(self.resume)
            job.emit([t])
        job.finish("cancelled" if job.cancelled.is_set() else "length")

    def drain(self, grace):
        self.draining = True


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def start():
    """start(policy, certfile=None, keyfile=None) -> (url, batcher, app): a server on a free loopback port;
    all of them shut down at the end of the module."""
    from kimi_jax.serving.server import create_app, serve, shutdown
    running = []

    def _start(policy, certfile=None, keyfile=None):
        batcher = ScriptedBatcher(KimiTokenizer({bytes([i]): i for i in range(256)}))
        app = create_app(batcher, "k2-scripted", policy)
        port = _free_port()
        thread = threading.Thread(target=serve, args=(app, "127.0.0.1", port, GRACE, certfile, keyfile),
                                  daemon=True)
        thread.start()
        running.append((app, thread))
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        return f"{'https' if certfile else 'http'}://127.0.0.1:{port}", batcher, app

    yield _start
    for app, thread in running:
        shutdown(app)
        thread.join(10)


@pytest.fixture(scope="module")
def keyed(start):
    url, batcher, app = start(AccessPolicy(api_keys=(ALPHA, BETA), max_body_bytes=LIMIT, max_in_flight=IN_FLIGHT,
                                           read_timeout=READ_TIMEOUT))
    return types.SimpleNamespace(url=url, batcher=batcher, app=app)


def _client(url, key, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, **kw)


def _kid(key):
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _complete(client, prompt="def f(x):", max_tokens=16, **kw):
    return client.completions.create(model="k2-scripted", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def _metric(url, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}}"):
            return float(line.split()[-1])
    return 0.0


def _raw(url, data: bytes, stall_after=None, timeout=5.0):
    """Send ``data`` on a fresh connection (then nothing more) and read until the server closes it: the
    response's bytes. A server that waits for more fails this with a socket timeout."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    return received


def _head(url, path, headers: dict) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {url.removeprefix('http://')}"] + [f"{k}: {v}" for k, v in
                                                                                   headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status_and_error(response: bytes):
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, head.decode().lower(), (json.loads(body)["error"] if body else None)


# ---- API keys --------------------------------------------------------------------------------------------------

def test_without_a_key_or_with_a_wrong_one_the_openai_client_gets_401(keyed):
    no_key = {"extra_headers": {"Authorization": openai.omit}}        # the client sends no Authorization header
    for key, kw in [("unsent", no_key)] + [(k, {}) for k in ("sk-wrong", ALPHA[:-1], ALPHA + "x", f"{ALPHA} {BETA}")]:
        client = _client(keyed.url, key)
        with pytest.raises(openai.AuthenticationError) as e:
            client.models.list(**kw)
        assert e.value.status_code == 401
        assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            _complete(client, **kw)
        with pytest.raises(openai.AuthenticationError):
            _complete(client, stream=True, **kw)
    bare = httpx.get(keyed.url + "/v1/models")                            # no Authorization header at all
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert set(bare.json()["error"]) == {"message", "type", "param", "code"}
    basic = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Basic {ALPHA}"})   # not Bearer
    assert basic.status_code == 401
    unknown = httpx.get(keyed.url + "/v1/no-such-route")      # no 404 either: nothing is told without a key
    assert unknown.status_code == 401
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"bearer {BETA}"}).status_code == 200


def test_with_a_right_key_the_openai_client_gets_200_streamed_too(keyed):
    for key in (ALPHA, BETA):
        client = _client(keyed.url, key)
        assert [m.id for m in client.models.list().data] == ["k2-scripted"]
        r = _complete(client, max_tokens=20)
        assert r.choices[0].text == REPLY[:20] and r.usage.completion_tokens == 20
        chunks = list(_complete(client, max_tokens=12, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == REPLY[:12]
        chat = list(client.chat.completions.create(model="k2-scripted", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=8, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == REPLY[:8]
    assert _metric(keyed.url, "kimi_jax_requests_by_key_total", key=_kid(ALPHA), status="200") >= 4
    assert _metric(keyed.url, "kimi_jax_requests_by_key_total", key=_kid(BETA), status="200") >= 4


def test_health_is_open_and_metrics_open_by_default_or_behind_the_key(keyed, start):
    assert httpx.get(keyed.url + "/health").status_code == 200
    metrics = httpx.get(keyed.url + "/metrics")
    assert metrics.status_code == 200 and ALPHA not in metrics.text and BETA not in metrics.text
    url, _, _ = start(AccessPolicy(api_keys=("sk-gamma",), metrics_need_key=True))
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-gamma"}).status_code == 200


def test_without_keys_the_server_is_open_with_limits_from_the_context(start):
    url, _, app = start(AccessPolicy())
    assert app.state.policy.max_body_bytes == body_limit(MAX_LEN) == 32 * MAX_LEN + (1 << 20)
    assert app.state.policy.max_in_flight == 0
    assert httpx.get(url + "/v1/models").status_code == 200
    r = _complete(_client(url, "anything"), max_tokens=4)        # a key the server never asked for: ignored
    assert r.choices[0].text == REPLY[:4]
    assert _metric(url, "kimi_jax_requests_by_key_total", key="none", status="200") == 2


# ---- the body limit ------------------------------------------------------------------------------------------

def test_a_content_length_over_the_limit_is_413_before_the_body_is_sent(keyed):
    """Only the headers go out: the 413 comes back and the connection closes without the server waiting for the
    body (with Expect: 100-continue, as curl sends for large bodies, no 100 is sent first)."""
    _content_length_over_the_limit_is_413(keyed)


def _content_length_over_the_limit_is_413(keyed):
    for expect in ({}, {"Expect": "100-continue"}):
        head = _head(keyed.url, "/v1/completions", {"Authorization": f"Bearer {BETA}", "Content-Type":
                                                    "application/json", "Content-Length": LIMIT + 1, **expect})
        t0 = time.monotonic()
        status, headers, error = _status_and_error(_raw(keyed.url, head))
        assert (status, error["code"]) == (413, "request_too_large") and str(LIMIT) in error["message"]
        assert "connection: close" in headers and "100 continue" not in headers
        assert time.monotonic() - t0 < READ_TIMEOUT          # answered, not timed out
    with pytest.raises(openai.APIStatusError) as e:          # the official client, sending 1 MB anyway, reads the 413
        _complete(_client(keyed.url, BETA), "x" * (1 << 20))
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"


def test_a_chunked_body_is_cut_off_at_the_limit(keyed):
    """A chunked body that goes past the limit, and never ends: 413 and the connection closed."""
    _chunked_body_over_the_limit_is_413(keyed)


def _chunked_body_over_the_limit_is_413(keyed):
    head = _head(keyed.url, "/v1/completions", {"Authorization": f"Bearer {BETA}", "Content-Type":
                                                "application/json", "Transfer-Encoding": "chunked"})
    chunks = b"".join(b"%x\r\n%s\r\n" % (1000, b" " * 1000) for _ in range(LIMIT // 1000 + 1))
    status, headers, error = _status_and_error(_raw(keyed.url, head + chunks))
    assert (status, error["code"]) == (413, "request_too_large") and "connection: close" in headers


def test_a_body_at_the_limit_is_served(keyed):
    body = json.dumps({"model": "k2-scripted", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
    body = body[:-1] + " " * (LIMIT - len(body)) + "}"
    assert len(body) == LIMIT
    r = httpx.post(keyed.url + "/v1/completions", content=body, headers={"Authorization": f"Bearer {BETA}",
                                                                          "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY[:4]


# ---- requests in flight ------------------------------------------------------------------------------------------

def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_key_over_its_in_flight_limit_gets_429_and_other_keys_do_not(keyed):
    batcher, alpha, beta = keyed.batcher, _client(keyed.url, ALPHA), _client(keyed.url, BETA)
    batcher.gate.clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            held = [pool.submit(_complete, alpha) for _ in range(IN_FLIGHT)]
            _wait_for(lambda: batcher.waiting == IN_FLIGHT)
            with pytest.raises(openai.RateLimitError) as e:
                _complete(alpha)
            assert e.value.response.headers["retry-after"] == "1"
            assert e.value.body["code"] == "too_many_requests_in_flight" and e.value.body["type"] == "rate_limit_error"
            other = pool.submit(_complete, beta)                  # another key's requests are its own
            _wait_for(lambda: batcher.waiting == IN_FLIGHT + 1)
            batcher.gate.set()
            assert [f.result().choices[0].text for f in held + [other]] == [REPLY[:16]] * (IN_FLIGHT + 1)
    finally:
        batcher.gate.set()
    assert _complete(alpha).choices[0].text == REPLY[:16]        # its requests ended: room again
    assert _metric(keyed.url, "kimi_jax_requests_by_key_total", key=_kid(ALPHA), status="429") >= 1


# ---- slow clients --------------------------------------------------------------------------------------------

def test_headers_or_a_body_slower_than_the_read_timeout_get_408(keyed):
    _late_headers_and_body_get_408(keyed)


def _late_headers_and_body_get_408(keyed):
    def late_headers():
        t0 = time.monotonic()
        return _raw(keyed.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthor"), time.monotonic() - t0

    def late_body():
        head = _head(keyed.url, "/v1/completions", {"Authorization": f"Bearer {BETA}", "Content-Length": 100})
        t0 = time.monotonic()
        return _raw(keyed.url, head + b'{"prompt": '), time.monotonic() - t0

    def silent():
        t0 = time.monotonic()
        return _raw(keyed.url, b""), time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = [pool.submit(f) for f in (late_headers, late_body, silent)]
        (response, took), (body_response, body_took), (nothing, idle_took) = (f.result() for f in results)
    def on_time(seconds):
        return READ_TIMEOUT - 0.1 <= seconds < READ_TIMEOUT + 2      # timers round a little
    assert response.startswith(b"HTTP/1.1 408 ") and on_time(took)
    status, head, error = _status_and_error(body_response)
    assert (status, error["code"]) == (408, "request_timeout") and "connection: close" in head
    assert on_time(body_took)
    assert nothing == b"" and on_time(idle_took)             # a connection that never spoke: closed, no answer


# ---- TLS ---------------------------------------------------------------------------------------------------------

def test_https_with_a_self_signed_certificate(start, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    url, _, _ = start(AccessPolicy(api_keys=(ALPHA,)), str(cert), str(key))
    trusting = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)))
    client = _client(url, ALPHA, http_client=trusting)
    assert _complete(client, max_tokens=6).choices[0].text == REPLY[:6]
    assert "".join(c.choices[0].text for c in _complete(client, max_tokens=6, stream=True)) == REPLY[:6]
    with pytest.raises(openai.AuthenticationError):
        _complete(_client(url, "sk-wrong", http_client=trusting))
    with pytest.raises(openai.APIConnectionError):               # the certificate is not one the system trusts
        _complete(_client(url, ALPHA))
    with pytest.raises(httpx.HTTPError):                         # and plain HTTP is not spoken on that port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=5)


# ---- the audit line ----------------------------------------------------------------------------------------------

def _audit(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "kimi_jax.serve.audit"]


def test_one_audit_line_per_request_with_the_key_id_never_the_key_or_the_prompt(keyed, caplog):
    prompt = "secret prompt text"
    with caplog.at_level(logging.INFO, logger="kimi_jax.serve.audit"):
        r = _complete(_client(keyed.url, ALPHA), prompt, max_tokens=10)
        chunks = list(_complete(_client(keyed.url, BETA), prompt, max_tokens=5, stream=True))
        with pytest.raises(openai.AuthenticationError):
            _complete(_client(keyed.url, "sk-wrong"), prompt)
        _wait_for(lambda: len(_audit(caplog)) == 3)
    done, streamed, refused = (dict(f.split("=", 1) for f in line.split()[1:]) for line in _audit(caplog))
    assert done["id"] == r.id and done["key"] == _kid(ALPHA) and done["route"] == "/v1/completions"
    assert (done["status"], done["prompt_tokens"], done["completion_tokens"]) == ("200", str(len(prompt)), "10")
    assert (streamed["id"], streamed["key"], streamed["status"], streamed["completion_tokens"]) == (
        chunks[0].id, _kid(BETA), "200", "5")
    assert (refused["key"], refused["status"], refused["prompt_tokens"]) == ("unauthenticated", "401", "-")
    assert all(float(line["ms"]) > 0 for line in (done, streamed, refused))
    text = "\n".join(_audit(caplog))
    assert prompt not in text and ALPHA not in text and BETA not in text and "sk-wrong" not in text


def test_the_audit_line_holds_the_body_only_when_asked(start, caplog):
    url, _, _ = start(AccessPolicy(log_bodies=True))
    with caplog.at_level(logging.INFO, logger="kimi_jax.serve.audit"):
        _complete(_client(url, "none"), 'say "hi"\n', max_tokens=3)
        _wait_for(lambda: _audit(caplog))
    (line,) = _audit(caplog)
    assert "\n" not in line                                        # one line, whatever the body holds
    assert json.loads(json.loads(line.split(" body=", 1)[1]))["prompt"] == 'say "hi"\n'


# ---- the property: refusals do not harm a running request ----------------------------------------------------

def test_no_refusal_harms_a_running_request(keyed):
    """A stream (key ALPHA) is held halfway while every kind of refusal happens beside it (401s, both 413s and
    both 408s for BETA, a 429 for its own key); it then ends with all its text."""
    batcher, alpha = keyed.batcher, _client(keyed.url, ALPHA)
    batcher.resume.clear()
    try:
        stream = iter(_complete(alpha, "hold: def f(x):", max_tokens=40, stream=True))
        first = next(stream)
        _wait_for(lambda: batcher.waiting == 1)                   # halfway, holding its slot
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = pool.submit(_late_headers_and_body_get_408, keyed)
            for _ in range(5):
                with pytest.raises(openai.AuthenticationError):
                    _complete(_client(keyed.url, "sk-wrong"))
            _content_length_over_the_limit_is_413(keyed)
            _chunked_body_over_the_limit_is_413(keyed)
            batcher.gate.clear()                                  # the stream is 1 of ALPHA's 2; a held one is 2
            held = pool.submit(_complete, alpha)
            _wait_for(lambda: batcher.waiting == 2)
            with pytest.raises(openai.RateLimitError):
                _complete(alpha)
            batcher.gate.set()
            assert held.result().choices[0].text == REPLY[:16]
            slow.result()
        batcher.resume.set()
        text = first.choices[0].text + "".join(c.choices[0].text for c in stream)
    finally:
        batcher.gate.set()
        batcher.resume.set()
    assert text == REPLY[:40]


# ---- the command line ------------------------------------------------------------------------------------------

def _parse(argv, capsys):
    """(args, None) or (None, the error line) of `python -m kimi_jax.serve` ARGV."""
    from kimi_jax.cli.serve import _parse
    try:
        return _parse(argv), None
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kimi_jax.serve: error: "), err
        return None, err.strip()


def test_keys_come_from_flags_the_environment_and_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KIMI_JAX_API_KEY", raising=False)
    assert _parse([], capsys)[0].api_keys == ()
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv("KIMI_JAX_API_KEY", "sk-env-1, sk-env-2,")
    args, _ = _parse(["--api-key", "sk-flag", "--api-key", "sk-env-1", "--api-key-file", str(keys)], capsys)
    assert args.api_keys == ("sk-flag", "sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2")


def test_bad_access_flags_are_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KIMI_JAX_API_KEY", raising=False)
    empty, cert, key = tmp_path / "empty", tmp_path / "cert.pem", tmp_path / "key.pem"
    empty.write_text("# nothing\n")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True,
                   capture_output=True)
    cases = {("--api-key-file", str(tmp_path / "missing")): "cannot read",
             ("--api-key-file", str(empty)): "holds no key",
             ("--api-key", "two words"): "printable ASCII without spaces",
             ("--ssl-certfile", str(cert)): "holds no matching private key: give --ssl-keyfile",
             ("--ssl-keyfile", str(key)): "--ssl-keyfile needs --ssl-certfile",
             ("--ssl-certfile", str(key), "--ssl-keyfile", str(key)): "cannot load the certificate and key",
             ("--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "missing")): "No such file",
             ("--read-timeout", "0"): "--read-timeout must be",
             ("--max-body-bytes", "0"): "--max-body-bytes must be",
             ("--max-in-flight-per-key", "-1"): "--max-in-flight-per-key must be"}
    for argv, message in cases.items():
        args, err = _parse(list(argv), capsys)
        assert args is None and message in err, (argv, err)
    args, err = _parse(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)], capsys)
    assert err is None and args.ssl_certfile == str(cert)


def test_the_startup_line_says_whether_the_server_is_open(capsys):
    from kimi_jax.cli.serve import _access_line
    open_app = types.SimpleNamespace(state=types.SimpleNamespace(policy=AccessPolicy(max_body_bytes=9, max_in_flight=0)))
    line = _access_line(types.SimpleNamespace(api_keys=()), open_app)
    assert line.startswith("no API key: anyone who can reach the port can use it") and "9 bytes" in line
    keyed_app = types.SimpleNamespace(state=types.SimpleNamespace(policy=AccessPolicy(max_body_bytes=9,
                                                                                      max_in_flight=3)))
    line = _access_line(types.SimpleNamespace(api_keys=(ALPHA,)), keyed_app)
    assert line.startswith(f"1 API key(s) ({_kid(ALPHA)})") and "3 requests in flight per key" in line
    assert ALPHA not in line
