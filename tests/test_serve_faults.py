"""Faults injected into a live server (in this process, so the batcher's steps can be made to fail): a failing
request ends alone with a 500 naming its id, a failing dispatch ends its batch and the server keeps serving,
and shutdown answers every open request within the grace period even when the device thread is stuck.

The reference for every greedy response is the same request through `Model.generate` alone (AR tokens).
"""

import concurrent.futures
import threading
import time

import httpx
import pytest
from conftest import FIXTURES, serve_in_thread

import kimi_jax

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
SLOTS, MAX_NEW, MAX_LEN, GRACE = 4, 24, 128, 1.0
POISON = "def poisoned():\n"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")]


@pytest.fixture(scope="module")
def live():
    from kimi_jax.serving.batcher import Batcher
    from kimi_jax.serving.server import create_app
    model = kimi_jax.load(str(TARGET), drafter=str(DRAFTER))
    batcher = Batcher(model, max_batch=SLOTS, max_new=MAX_NEW, max_len=MAX_LEN, budget=4, processing=False)
    batcher.start()         # no warm-up: each program compiles at its first use (only what these tests need)
    app = create_app(batcher, model.config.name)
    url, thread = serve_in_thread(app, GRACE)
    runs = {}

    def alone(prompt, max_tokens):
        ids = model.tokenizer.encode(prompt)
        if prompt not in runs:
            runs[prompt] = model.generate([ids], MAX_NEW, method="ar").tokens[0]
        eos = set(model.config.eos_token_ids)
        return model.tokenizer.decode([t for t in runs[prompt][:max_tokens] if t not in eos])

    yield {"url": url, "app": app, "batcher": batcher, "thread": thread, "model": model, "alone": alone}
    batcher.stop(timeout=5)


def _complete(url, prompt, max_tokens=MAX_NEW, stream=False):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=120)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        return r.status_code, [line for line in r.iter_lines() if line.startswith("data:")]


GOOD = ["def area(r):\n    return", "import json\n\nclass Config:\n", "x = [i * i for i in"]


def _metric(url, status):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kimi_jax_requests_total{") and f'status="{status}"' in line:
            yield float(line.split()[-1])


def test_without_the_processing_programs_their_fields_are_400s(live):
    """This server runs with processing=False (--no-processing): a request that needs the processing programs is
    refused before it is queued, with the reason; a plain one is served."""
    for extra in ({"top_p": 0.9}, {"logprobs": 2}, {"response_format": {"type": "json_object"}}):
        r = httpx.post(live["url"] + "/v1/completions", json={"prompt": GOOD[0], "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400 and "--no-processing" in r.json()["error"]["message"], (extra, r.text)
    assert _complete(live["url"], GOOD[0], 4).json()["choices"][0]["text"] == live["alone"](GOOD[0], 4)


def test_a_failing_prefill_ends_that_request_alone(live, monkeypatch):
    batcher, url = live["batcher"], live["url"]
    poison_ids = live["model"].tokenizer.encode(POISON)
    prefill = batcher._prefill

    def failing(ids, *args):
        if list(ids) == poison_ids:
            raise RuntimeError("injected prefill fault")
        return prefill(ids, *args)

    monkeypatch.setattr(batcher, "_prefill", failing)
    before = sum(_metric(url, "500"))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(_complete, url, p) for p in GOOD]
        time.sleep(0.2)                                  # the poisoned one joins a running batch
        bad = _complete(url, POISON)
        results = [f.result() for f in good]
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "prefilling" in err["message"] and bad.headers["x-request-id"] in err["message"]
    assert [r.json()["choices"][0]["text"] for r in results] == [live["alone"](p, MAX_NEW) for p in GOOD]
    assert sum(_metric(url, "500")) == before + 1
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_client_that_cannot_take_tokens_leaves_alone(live):
    """The batcher's emit raising for one job (its client side broken) ends that job; the others complete."""
    from kimi_jax.serving.batcher import Job
    batcher, model = live["batcher"], live["model"]
    done = {}
    events = {i: threading.Event() for i in range(3)}

    def emit(i):
        def f(tokens):
            if i == 0:
                raise ConnectionResetError("injected: the client is gone")
            done.setdefault(i, []).extend(tokens)
        return f

    def finish(i):
        def f(reason):
            done[("reason", i)] = reason
            events[i].set()
        return f

    for i, p in enumerate(GOOD):
        batcher.submit(Job(model.tokenizer.encode(p), MAX_NEW, 0.0, 0, emit=emit(i), finish=finish(i), id=f"job{i}"))
    assert all(e.wait(120) for e in events.values())
    assert type(done[("reason", 0)]).__name__ == "Failed"
    eos = set(model.config.eos_token_ids)
    for i in (1, 2):
        assert model.tokenizer.decode([t for t in done[i] if t not in eos]) == live["alone"](GOOD[i], MAX_NEW)


def test_a_failing_dispatch_ends_its_batch_and_the_server_keeps_serving(live, monkeypatch):
    batcher, url = live["batcher"], live["url"]
    dispatch, calls = batcher._dispatch, []
    release = threading.Event()

    def failing_once(state, sample, rounds=1):
        """The first dispatch with both requests in the batch fails (earlier ones wait for the second to come)."""
        if not calls:
            deadline = time.time() + 10
            while batcher.active + batcher.queue_depth < 2 and time.time() < deadline:
                time.sleep(0.01)
            if batcher.active == 2:
                calls.append(1)
                release.wait(10)                     # hold the failure until /health has been asked
                raise RuntimeError("injected dispatch fault")
        return dispatch(state, sample, rounds)

    monkeypatch.setattr(batcher, "_dispatch", failing_once)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(_complete, url, p) for p in GOOD[:2]]
        time.sleep(0.5)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        release.set()
        results = [f.result() for f in running]
    assert [r.status_code for r in results] == [500, 500]
    assert all("batch" in r.json()["error"]["message"] for r in results)
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert "injected dispatch fault" in health.json()["error"]
    after = _complete(url, GOOD[2])                   # a new batch: served, and the server is healthy again
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == live["alone"](GOOD[2], MAX_NEW)
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_shutdown_answers_a_request_stuck_in_the_device_within_the_grace(live, monkeypatch):
    """Last in the module: the server goes away. A dispatch that never returns (a stuck device) must not keep
    the client waiting: it gets a 503 error event within the grace period, and serve() returns."""
    from kimi_jax.serving.server import shutdown
    batcher, url = live["batcher"], live["url"]
    stuck = threading.Event()
    unstick = threading.Event()
    dispatch = batcher._dispatch

    def never_returns(state, sample, rounds=1):
        stuck.set()
        unstick.wait(60)
        return dispatch(state, sample, rounds)

    monkeypatch.setattr(batcher, "_dispatch", never_returns)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(_complete, url, GOOD[0], MAX_NEW, True)
        assert stuck.wait(30)
        t0 = time.monotonic()
        shutdown(live["app"])
        status, events = streaming.result(timeout=GRACE + 10)
        answered = time.monotonic() - t0
    assert status == 200 and '"code": "shutting_down"' in events[-1], events[-2:]
    assert answered < GRACE + 2.0, answered
    live["thread"].join(GRACE + 10)
    assert not live["thread"].is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
    unstick.set()
    assert batcher.stop(timeout=30)
