"""`python -m kimi_jax.serve` over two processes (one CPU device each, one ep=2 mesh, real cross-process
collectives): process 0 serves HTTP and sends every step of the batch to process 1 (``kimi_jax.serving.peers``).

It returns exactly what one process decodes for 8 concurrent greedy requests through 2 slots (plain AR in this
process as the reference), says how many processes it runs on, and stops both on SIGTERM with status 0. A
follower killed mid-run makes process 0 answer the request in flight with a 503 and exit 1, within the heartbeat
timeout.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import cpu_env

from kimi_jax.cli.decode import DEFAULT_TARGET

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEFAULT_TARGET / "kimi_config.json").exists(),
                                                   reason="embedded default not built")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NEW, HEARTBEAT_S, REQUESTS = 16, 6, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, name: str):
    """Two serve processes joined on a local coordinator -> (processes, stderr paths, base URL), once healthy."""
    coordinator, port = _free_port(), _free_port()
    procs, errs = [], []
    for i in range(2):
        errs.append(tmp_path / f"{name}{i}.err")
        env = cpu_env(1)
        with open(errs[-1], "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kimi_jax.serve", "--coordinator", f"localhost:{coordinator}",
                 "--num-processes", "2", "--process-id", str(i), "--heartbeat-timeout", str(HEARTBEAT_S),
                 "--mesh", "ep=2", "--port", str(port), "--max-batch", "2", "--max-new-tokens", str(MAX_NEW),
                 "--max-len", "64", "--budget", "8", "--queue-size", "32", "--no-processing", "--lazy-compile"],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            _kill(procs)
            pytest.fail("a server process exited:\n" + "\n".join(e.read_text()[-2000:] for e in errs))
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return procs, errs, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    _kill(procs)
    pytest.fail("the server did not come up:\n" + "\n".join(e.read_text()[-2000:] for e in errs))


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _prompts(n):
    """Held-out snippets (not the training corpus) of different lengths."""
    base = ["def area(r):\n    return", "import json\n\nclass Config:\n    def __init__(self, path):\n",
            "for line in open('log.txt'):\n    if 'ERROR' in line:\n        ", "x = [i * i for i in",
            "# parse the command line\nimport argparse\nparser = argparse.ArgumentParser(", "while True:\n"]
    return [base[i % len(base)] * (1 + i // len(base)) for i in range(n)]


def test_two_processes_serve_what_one_process_decodes(tmp_path):
    import kimi_jax
    procs, errs, url = _start(tmp_path, "serve")
    try:
        assert httpx.get(url + "/health").json()["processes"] == 2
        model = kimi_jax.load(str(DEFAULT_TARGET))
        eos = set(model.config.eos_token_ids)
        # 8 requests on 2 slots: each slot joins and retires rows several times (16 took twice as long to show
        # the same), prompts of several lengths, outputs of 4 to 16 tokens
        prompts = [model.tokenizer.encode(p)[:30] for p in _prompts(REQUESTS)]   # the server takes up to 38 tokens
        lengths = [4 + (i * 5) % (MAX_NEW - 3) for i in range(REQUESTS)]

        def ask(i):
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"], choice["finish_reason"]

        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            got = list(pool.map(ask, range(REQUESTS)))
        for i, (text, finish) in enumerate(got):
            tokens = model.generate(prompts[i], lengths[i], method="ar").tokens[0]
            want = model.tokenizer.decode([t for t in tokens if t not in eos])
            assert (text, finish) == (want, "stop" if tokens[-1] in eos else "length"), f"request {i}"
        procs[0].send_signal(signal.SIGTERM)        # the leader stops; the follower with it
        assert [p.wait(timeout=120) for p in procs] == [0, 0], [e.read_text()[-1500:] for e in errs]
        assert "over 2 processes" in errs[0].read_text()
        assert "compiled the programs" not in errs[1].read_text()           # process 0 speaks for the run
    finally:
        _kill(procs)


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_killed_follower_ends_the_server_with_503(tmp_path, in_flight):
    """SIGKILL to process 1: a request sent right after gets a 503 (the step's collective fails at once on the
    CPU), or, with nothing running, process 0 notices the missing beats; either way it exits 1 with one line
    before JAX's coordination service would abort it at the heartbeat timeout."""
    procs, errs, url = _start(tmp_path, "killed")
    request = {"prompt": "def f(x):", "max_tokens": MAX_NEW, "temperature": 0}
    try:
        if in_flight:       # the servers compile lazily: this request's programs first, so the next one's step runs
            assert httpx.post(url + "/v1/completions", timeout=300, json=request).status_code == 200
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        if in_flight:
            r = httpx.post(url + "/v1/completions", timeout=120, json=request)
            assert r.status_code == 503 and "lost a process" in r.json()["error"]["message"], r.text
        assert procs[0].wait(timeout=HEARTBEAT_S + 30) == 1
        assert time.monotonic() - t0 < HEARTBEAT_S
        err = errs[0].read_text()
        said = ("kimi_jax.serve: error: a step failed on process 0", "kimi_jax.serve: error: process 1 of 2 stopped")
        assert any(line in err for line in (said if in_flight else said[1:])), err[-2000:]
        assert "Check failure stack trace" not in err          # our exit, not JAX's abort
    finally:
        _kill(procs)


class _Recorder:
    """Process 0's side of ``kimi_jax.serving.peers.Peers``, keeping the steps instead of sending them."""
    index, count, leader = 0, 2, True

    def __init__(self):
        self.steps = []

    def publish(self, step):
        self.steps.append(json.loads(json.dumps(step)))         # what travels: JSON


class _Replayer:
    """A follower's side, reading the recorded steps."""
    index, count, leader = 1, 2, False

    def __init__(self, steps):
        self.steps = list(steps)

    def receive(self):
        return self.steps.pop(0)


def test_a_follower_that_runs_only_the_steps_ends_with_process_0s_batch():
    """In one process: a batcher that is told only the steps (JSON) of another's run, 10 greedy requests of
    different lengths through 2 slots (growth, compaction, retirements, the prefix cache; the last two with
    logits processors, whose logit_bias token ids travel as JSON's string keys), ends with the same batch state,
    token for token, and the same prefix cache."""
    import jax
    import numpy as np

    import kimi_jax
    from kimi_jax.serving.batcher import Batcher, Job

    model = kimi_jax.load(str(DEFAULT_TARGET), drafter=str(DEFAULT_TARGET.parent / "drafter"))
    kw = dict(max_batch=2, max_new=12, max_len=96, budget=4, rounds_per_dispatch=2)
    leader = Batcher(model, peers=_Recorder(), **kw)
    done = []
    leader.start()
    for i, prompt in enumerate(_prompts(10)):
        ids = model.tokenizer.encode(prompt)[:40]
        processing = {"logit_bias": {ids[-1]: 5.0}, "repetition_penalty": 1.3} if i >= 8 else {}
        leader.submit(Job(ids, 3 + i, 0.0, 0, emit=lambda t: None, finish=done.append, processing=processing))
    deadline = time.monotonic() + 300
    while len(done) < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leader.stop(timeout=60) and sorted(set(done)) <= ["length", "stop"] and len(done) == 10, done
    steps = leader.peers.steps
    assert steps[-1] == ["stop"] and {s[0] for s in steps} >= {"admit", "resize", "retire", "rounds"}
    follower = Batcher(model, peers=_Replayer(steps), **kw)
    follower.follow()
    ours, theirs = jax.device_get((leader._state.out, leader._state.n_out)), jax.device_get(
        (follower._state.out, follower._state.n_out))
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1], theirs[1])
    assert leader.prefix.stats == follower.prefix.stats and leader.prefix.stats.hits > 0
