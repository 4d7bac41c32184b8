"""`python -m kimi_jax.serve` live on 127.0.0.1, driven by the official `openai` client.

One server (the embedded default, DDTree budget 8, 4 slots) serves the whole module; the reference for every
greedy response is the same request through `Model.generate` alone in this process (AR: greedy DDTree is
lossless, so the tokens must be AR's). The last test sends SIGTERM and checks the drain.
"""

import concurrent.futures
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import FIXTURES, cpu_env, default_sigint

import kimi_jax

openai = pytest.importorskip("openai")

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
SLOTS, MAX_NEW, MAX_LEN = 4, 40, 256
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    env = cpu_env()
    # stderr to a file, not a pipe: the server writes an audit line per request, and a pipe nobody reads fills
    # (64 KiB, a few hundred requests) and then blocks the server's event loop on the write
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kimi_jax.serve", "--port", str(port), "--max-batch",
                                 str(SLOTS), "--max-new-tokens", str(MAX_NEW), "--max-len", str(MAX_LEN), "--budget",
                                 "8", "--queue-size", "32", "--lazy-compile"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("server did not come up")
    yield {"proc": proc, "url": url, "log": log,
           "client": openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def reference():
    model = kimi_jax.load(str(TARGET))
    eos = set(model.config.eos_token_ids)

    runs = {}

    def alone(ids, max_tokens):
        """(text, finish_reason, completion tokens) of greedy decoding; one run of MAX_NEW per prompt serves every
        shorter max_tokens (greedy output is a prefix of the longer one)."""
        if tuple(ids) not in runs:
            runs[tuple(ids)] = model.generate([ids], MAX_NEW, method="ar").tokens[0]
        tokens = runs[tuple(ids)][:max_tokens]
        finish = "stop" if tokens and tokens[-1] in eos else "length"
        return model.tokenizer.decode([t for t in tokens if t not in eos]), finish, len(tokens)

    return model, alone


def _prompts(model, n):
    """Held-out snippets (not the stdlib corpus) of different lengths."""
    base = ["def area(r):\n    return", "import json\n\nclass Config:\n    def __init__(self, path):\n",
            "for line in open('log.txt'):\n    if 'ERROR' in line:\n        ", "x = [i * i for i in",
            "# parse the command line\nimport argparse\nparser = argparse.ArgumentParser(", "while True:\n"]
    return [base[i % len(base)] * (1 + i // len(base)) for i in range(n)]


def test_completion_and_chat_equal_the_request_alone(server, reference):
    model, alone = reference
    client = server["client"]
    prompt = "def mean(values):\n    total ="
    want = alone(model.tokenizer.encode(prompt), 24)
    r = client.completions.create(model=model.config.name, prompt=prompt, max_tokens=24, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == want
    assert r.usage.prompt_tokens == len(model.tokenizer.encode(prompt))
    chunks = list(client.completions.create(prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            model=model.config.name))
    assert "".join(c.choices[0].text for c in chunks) == want[0] and chunks[-1].choices[0].finish_reason == want[1]

    messages = [{"role": "user", "content": "a stack class"}]
    want = alone(model.tokenizer.encode_chat(messages), 20)
    r = client.chat.completions.create(model=model.config.name, messages=messages, max_tokens=20, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens) == want
    stream = client.chat.completions.create(model=model.config.name, messages=messages, max_tokens=20,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == want[2]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[0]


def test_models_health_and_metrics(server, reference):
    model, _ = reference
    assert [m.id for m in server["client"].models.list().data] == [model.config.name]
    # started without keys: it says so, and audits every request (the audit line follows the response: wait)
    line = "key=none client=127.0.0.1 method=GET route=/v1/models status=200"
    deadline = time.monotonic() + 10
    while line not in (err := server["log"].read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "no API key: anyone who can reach the port can use it" in err
    assert line in err
    ids = re.findall(r"request id=(\S+)", err)
    assert len(ids) == len(set(ids)) > 0, err                # each request's line once (not again via the root)
    assert httpx.get(server["url"] + "/health").json()["slots"] == SLOTS
    text = httpx.get(server["url"] + "/metrics").text
    for name in ("kimi_jax_requests_total", "kimi_jax_completion_tokens_total", "kimi_jax_mean_tau",
                 "kimi_jax_queue_depth", "kimi_jax_time_to_first_token_seconds_bucket",
                 "kimi_jax_token_latency_seconds_bucket"):
        assert name in text, name


def test_sixteen_concurrent_requests_each_equal_the_request_alone(server, reference):
    """16 requests of different prompt and output lengths on 4 slots: rows join and leave the running batch;
    no response may differ from the same request run alone (no tokens mixed between slots)."""
    model, alone = reference
    prompts = _prompts(model, 16)
    lengths = [8 + (7 * i) % (MAX_NEW - 8) for i in range(16)]
    want = [alone(model.tokenizer.encode(p), n) for p, n in zip(prompts, lengths)]

    def ask(i):
        r = server["client"].completions.create(model=model.config.name, prompt=prompts[i], max_tokens=lengths[i],
                                                temperature=0, stream=i % 2 == 0)
        if i % 2 == 0:
            chunks = list(r)
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        return r.choices[0].text, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert got == [w[:2] for w in want]
    tau = [float(line.split()[-1]) for line in httpx.get(server["url"] + "/metrics").text.splitlines()
           if line.startswith("kimi_jax_mean_tau")]
    assert tau and tau[0] >= 1.0


def test_n_choices_each_run_as_a_row(server, reference):
    """n = 3 greedy through the openai client: three choices, each the text the request gets alone, indices 0-2,
    usage counting the prompt once and every choice's tokens; streamed (chat, n = 2), each index's deltas add up
    to its message; sampled (n = 4), four 200 choices of the asked length."""
    model, alone = reference
    client = server["client"]
    prompt = "for line in open('log.txt'):\n"
    want = alone(model.tokenizer.encode(prompt), 12)
    r = client.completions.create(model=model.config.name, prompt=prompt, max_tokens=12, temperature=0, n=3)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(i, *want[:2]) for i in range(3)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(model.tokenizer.encode(prompt)), 3 * want[2])

    messages = [{"role": "user", "content": "a queue class"}]
    want = alone(model.tokenizer.encode_chat(messages), 10)
    chunks = list(client.chat.completions.create(model=model.config.name, messages=messages, max_tokens=10,
                                                 temperature=0, n=2, stream=True))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == want[1]
        assert "".join(c.delta.content or "" for c in mine) == want[0]

    r = client.completions.create(model=model.config.name, prompt=prompt, max_tokens=6, temperature=1.0, seed=5,
                                  n=4)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens <= 24


def test_logits_processors_through_the_client(server, reference):
    """Greedy with penalties and a logit bias (on the DDTree batch) returns what plain AR decodes with the same
    processors alone; K2.6's recommended sampling (temperature 1, top_p 0.95) and top_k / min_p are served."""
    model, _ = reference
    client = server["client"]
    prompt = "def area(r):\n    return"
    ids = model.tokenizer.encode(prompt)
    plain = model.generate([ids], 12, method="ar").tokens[0]
    bias = {str(plain[0]): -100, str(plain[1]): 5}
    processing = dict(presence_penalty=0.8, frequency_penalty=0.5, logit_bias=bias)
    want = model.generate([ids], 12, method="ar", **processing).tokens[0]
    assert want != plain                              # the processors change what greedy decodes
    eos = set(model.config.eos_token_ids)
    r = client.completions.create(model=model.config.name, prompt=prompt, max_tokens=12, temperature=0,
                                  presence_penalty=0.8, frequency_penalty=0.5, logit_bias=bias)
    assert r.choices[0].text == model.tokenizer.decode([t for t in want if t not in eos])
    r = client.completions.create(model=model.config.name, prompt=prompt, max_tokens=12, temperature=1.0,
                                  top_p=0.95, seed=3, extra_body={"top_k": 20, "min_p": 0.05,
                                                                  "repetition_penalty": 1.1})
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1


def test_response_format_through_the_client(server, reference):
    """json_schema through the openai client, plain and streamed with n = 2: every reply validates (jsonschema);
    greedy equals Model.generate's AR decoding under the same schema; a schema feature the automaton cannot
    enforce is a 400 naming it."""
    jsonschema = pytest.importorskip("jsonschema")
    model, _ = reference
    client = server["client"]
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "kind"],
              "properties": {"name": {"type": "string", "maxLength": 8}, "kind": {"enum": ["file", "dir"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "entry", "schema": schema, "strict": True}}
    prompt = "# a directory entry\nentry = "
    eos = set(model.config.eos_token_ids)
    want = model.generate(prompt, MAX_NEW, method="ar", response_format=fmt).tokens[0]
    r = client.completions.create(model=model.config.name, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                  extra_body={"response_format": fmt})
    assert r.choices[0].text == model.tokenizer.decode([t for t in want if t not in eos])
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    messages = [{"role": "user", "content": "one entry"}]
    chunks = list(client.chat.completions.create(model=model.config.name, messages=messages, max_tokens=MAX_NEW,
                                                 temperature=1.0, seed=2, n=2, stream=True, response_format=fmt))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        jsonschema.validate(json.loads(text), schema)
    bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 1}}}
    r = httpx.post(server["url"] + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 4, "response_format": bad})
    assert r.status_code == 400 and "minimum" in r.json()["error"]["message"], r.text


def test_logprobs_through_the_client(server, reference):
    """completions logprobs=2 (greedy, on the DDTree batch): each token's logprob and top 2 are Model.generate's,
    the tokens spell the text; chat logprobs + top_logprobs=3, streamed: every content token has its 3."""
    model, _ = reference
    client = server["client"]
    prompt = "while True:\n"
    want = model.generate(prompt, 10, method="ar", logprobs=2)
    r = client.completions.create(model=model.config.name, prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    eos = set(model.config.eos_token_ids)
    kept = [entry for t, entry in zip(want.tokens[0], want.logprobs[0]) if t not in eos]
    assert lp.token_logprobs == pytest.approx([c for c, _ in kept], abs=1e-4)
    assert [len(top) for top in lp.top_logprobs] == [2] * len(kept)
    chunks = list(client.chat.completions.create(model=model.config.name, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True))
    content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert content and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    stop_at = want.tokens[0][3]                          # the 4th greedy token ends the reply, left out of it
    r = httpx.post(server["url"] + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 10, "temperature": 0, "stop_token_ids": [stop_at]})
    first = want.tokens[0][:want.tokens[0].index(stop_at)]
    assert r.json()["choices"][0] == {**r.json()["choices"][0], "text": model.tokenizer.decode(first),
                                      "finish_reason": "stop"}, r.text
    r = httpx.post(server["url"] + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs needs logprobs" in r.json()["error"]["message"]


def test_stop_string_ends_the_text_before_it(server, reference):
    model, alone = reference
    prompt = "def area(r):\n    return"
    full, _, _ = alone(model.tokenizer.encode(prompt), 30)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = server["client"].completions.create(model=model.config.name, prompt=prompt, max_tokens=30, temperature=0,
                                            stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_disconnect_mid_stream_frees_the_slot(server, reference):
    model, _ = reference
    with httpx.stream("POST", server["url"] + "/v1/completions", timeout=60,
                      json={"prompt": "while True:\n", "max_tokens": MAX_NEW, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    deadline = time.time() + 30
    while httpx.get(server["url"] + "/health").json()["active"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server["url"] + "/health").json()["active"] == 0


BAD = [({"prompt": "x", "max_tokens": 4, "seed": -1}, "seed"),
       ({"prompt": "x", "max_tokens": 4, "seed": 2**32}, "uint32"),
       ({"prompt": "x", "max_tokens": 4, "best_of": 2}, "best_of is not supported"),
       ({"prompt": "x", "max_tokens": 4, "echo": True}, "echo is not supported"),
       ({"prompt": "x", "max_tokens": 4, "colour": "red"}, "colour: unknown field"),
       ({"prompt": "x", "max_tokens": "4"}, "max_tokens"),
       ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "tool_calls: unknown field"),
       ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
       ({"prompt": "x", "max_tokens": 4, "method": "beam"}, "method"),
       ({"prompt": "x", "max_tokens": 4, "method": "dflash"}, "not served"),
       ({"prompt": "x = 1\n" * 400, "max_tokens": 4}, "at most"),
       ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
       ({"prompt": "x", "max_tokens": MAX_NEW + 1}, "limit"),
       ({"prompt": "x", "max_tokens": 4, "n": SLOTS + 1}, "exceeds this server's 4 slots"),
       ({"prompt": "x", "max_tokens": 4, "n": 0}, "n:"),
       ({"prompt": "x", "max_tokens": 4, "top_p": 1.5}, "top_p must be a finite number in (0, 1]"),
       ({"prompt": "x", "max_tokens": 4, "logit_bias": {"abc": 1}}, "logit_bias must be"),
       ({"prompt": "x", "max_tokens": 4, "logit_bias": {"99999": 1}}, "vocabulary"),
       ({"prompt": "x", "max_tokens": 4, "presence_penalty": 3}, "presence_penalty must be"),
       ({"prompt": [99999], "max_tokens": 4}, "vocabulary"),
       ({"messages": [], "max_tokens": 4}, "messages"),
       ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        "not K2's"),
       ({"prompt": "x", "max_tokens": 4, "stream": "yes"}, "stream:")]


def test_bad_requests_are_400s_and_others_complete(server, reference):
    model, alone = reference
    prompt = "import json\n\nclass Config:\n"
    want = alone(model.tokenizer.encode(prompt), MAX_NEW)

    def good():
        r = server["client"].completions.create(model=model.config.name, prompt=prompt, max_tokens=MAX_NEW,
                                                temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(good) for _ in range(3)]
        for body, word in BAD:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(server["url"] + path, json=body, timeout=60)
            assert r.status_code == 400, (body, r.text)
            assert word in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(server["url"] + "/v1/completions", content=b'{"prompt": "x", ', timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = httpx.post(server["url"] + "/v1/completions", json={"prompt": "x", "model": "gpt-4"}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        for method, path, status in (("GET", "/v1/completions", 405), ("GET", "/nowhere", 404),
                                     ("POST", "/v1/embeddings", 404)):
            r = httpx.request(method, server["url"] + path, timeout=60)
            assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert [f.result() for f in running] == [want[:2]] * 3


# ---- fuzzing the door: every bad body a 4xx, every good one exactly what it gets alone ---------------------
MISSING = object()
FUZZ_PROMPTS = ["def area(r):\n    return", "x = [i * i for i in", "while True:\n"]
FUZZ_EXAMPLES = 150


def _fuzz_body(draw, name):
    """A request body mixing valid and invalid values, and the oracle's verdict: written from the README's
    table of accepted fields, not from the server's code."""
    st = hypothesis.strategies
    ok, only_valid = True, draw(st.booleans())      # half the bodies all valid, half with any mix

    def pick(valid, invalid):
        nonlocal ok
        v = draw(st.sampled_from(valid if only_valid else valid + invalid))
        if any(v is x or (v == x and type(v) is type(x)) for x in invalid):
            ok = False
        return v

    prompt = draw(st.sampled_from(FUZZ_PROMPTS))
    body = {
        "prompt": pick([prompt, [prompt], ("ids", prompt)], ["", [], [prompt, prompt], [-1], 5, None, MISSING]),
        "max_tokens": pick([MISSING, None, 1, 7, MAX_NEW], [0, -3, MAX_NEW + 1, "4", 2.0, True]),
        "temperature": pick([MISSING, None, 0, 0.0, 0.7, 2], [-0.1, 2.5, "0", True]),
        "seed": pick([MISSING, None, 0, 123, 2**32 - 1], [-1, 2**32, 1.5, "3"]),
        "stop": pick([MISSING, None, "e", ["\n"], ["re", "x"]], [[""], ["a"] * 5, 3]),
        "n": pick([MISSING, None, 1, 2], [0, SLOTS + 1, 1.0]),
        "top_p": pick([MISSING, 1, 1.0, 0.5], [0, 1.5, "0.9"]),
        "model": pick([MISSING, None, name], ["gpt-4"]),
        "stream": pick([MISSING, False, True], ["yes"]),
        "colour": pick([MISSING], ["red"]),
    }
    return {k: v for k, v in body.items() if v is not MISSING}, ok


def test_fuzzed_bodies_get_4xx_and_good_ones_their_text(server, reference):
    """Random bodies (valid and invalid values of every field) while greedy requests run: no 5xx, every invalid
    body a 4xx at once, every valid greedy one the text it gets alone, every valid sampled one a 200."""
    hypothesis = pytest.importorskip("hypothesis")
    globals()["hypothesis"] = hypothesis
    model, alone = reference
    url = server["url"]
    background_prompt = "import json\n\nclass Config:\n"
    want_background = alone(model.tokenizer.encode(background_prompt), MAX_NEW)[0]
    stop_background = threading.Event()
    background = []

    def keep_running():
        while not stop_background.is_set():
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": background_prompt, "max_tokens": MAX_NEW, "temperature": 0})
            background.append((r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

    counts = {"valid": 0, "invalid": 0}

    @hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(hypothesis.strategies.data())
    def check(data):
        body, ok = _fuzz_body(data.draw, model.config.name)
        if isinstance(body.get("prompt"), tuple):
            body["prompt"] = model.tokenizer.encode(body["prompt"][1])
        counts["valid" if ok else "invalid"] += 1
        if body.get("stream") is True:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                status = r.status_code
                lines = [json.loads(x[5:]) for x in r.iter_lines() if x.startswith("data:") and x != "data: [DONE]"]
                text = "".join(e["choices"][0]["text"] for e in lines if e.get("choices")
                               and e["choices"][0]["index"] == 0) if status == 200 else None
        else:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            status, text = r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else None
        if not ok:
            assert 400 <= status < 500, (body, status)
            return
        assert status == 200, (body, status)
        if body.get("temperature") in (0, 0.0) and not isinstance(body.get("temperature"), bool):
            prompt = body["prompt"]
            ids = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else \
                model.tokenizer.encode(prompt[0] if isinstance(prompt, list) else prompt)
            max_tokens = body.get("max_tokens") or 16
            full = alone(ids, max_tokens)[0]
            stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
            cut = min([full.index(s) for s in stops if s in full], default=len(full))
            assert text == full[:cut], body

    runner = threading.Thread(target=keep_running)
    runner.start()
    try:
        check()
    finally:
        stop_background.set()
        runner.join()
    assert counts["valid"] >= 50 and counts["invalid"] >= 50, counts
    assert background and all(b == (200, want_background) for b in background), background[:3]
    print(f"fuzzed {sum(counts.values())} bodies: {counts}; {len(background)} background requests unharmed")


def test_sigterm_drains_running_requests_and_exits_0(server, reference):
    model, alone = reference
    prompt = "for line in open('log.txt'):\n"
    want = alone(model.tokenizer.encode(prompt), MAX_NEW)
    with httpx.stream("POST", server["url"] + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        server["proc"].send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    events = [json.loads(x[5:]) for x in [first] + rest if x != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == want[0]
    assert server["proc"].wait(timeout=60) == 0


def test_queue_bound_answers_full(reference):
    from kimi_jax.serving.batcher import Batcher, Job, QueueFull
    model = kimi_jax.load(str(TARGET), drafter=str(DRAFTER))
    b = Batcher(model, max_batch=2, max_new=8, max_len=128, budget=4, queue_size=3)   # not started: nothing runs
    noop = lambda *_: None  # noqa: E731
    for _ in range(3):
        b.submit(Job([1, 2], 4, 0.0, 0, emit=noop, finish=noop))
    with pytest.raises(QueueFull, match="3 requests are waiting"):
        b.submit(Job([1, 2], 4, 0.0, 0, emit=noop, finish=noop))
    assert b.queue_depth == 3 and np.all([r is None for r in b._slots])


def test_sigint_drains_and_exits_130_without_tracebacks(reference):
    """Ctrl-C: the request in flight completes, then status 130 and one line; no traceback per request."""
    model, alone = reference
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kimi_jax.serve", "--port", str(port), "--drafter", "none",
                             "--max-batch", "2", "--max-new-tokens", str(MAX_NEW), "--max-len", "128",
                             "--no-processing"], cwd=ROOT,
                            env=cpu_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        prompt = "while True:\n"
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data:")]
        events = [json.loads(x[5:]) for x in [first] + rest if x != "data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events) == alone(model.tokenizer.encode(prompt), MAX_NEW)[0]
        assert proc.wait(timeout=60) == 130
        err = proc.stderr.read()
        assert "Traceback" not in err and "CancelledError" not in err, err
        assert err.strip().splitlines()[-1] == "kimi_jax.serve: interrupted", err
    finally:
        if proc.poll() is None:
            proc.kill()
