"""Prefix caching in the server: the page index against brute force, a prefill that starts from cached pages
against the whole prompt's prefill, and the server's tokens with and without hits against ``Model.generate``."""

import random
import threading

import httpx
import numpy as np
import pytest
from conftest import FIXTURES, serve_in_thread

import kimi_jax
from kimi_jax.serving.batcher import Batcher, Job
from kimi_jax.serving.prefix_cache import PageIndex

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
embedded = pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")


def test_hits_equal_the_longest_page_prefix_of_an_earlier_prompt():
    """A store that never fills: the hit of each prompt is the longest run of whole pages (leaving its last
    token) that some earlier prompt had as whole pages, found by comparing token lists."""
    rng, page = random.Random(0), 2
    index, seen = PageIndex(capacity=10_000, page_size=page), []
    for _ in range(400):
        base = rng.choice(seen) if seen and rng.random() < 0.7 else []
        ids = base[:rng.randrange(len(base) + 1)] + [rng.randrange(2) for _ in range(rng.randrange(1, 9))]
        hit = len(index.match(index.keys(ids, (len(ids) - 1) // page))) * page
        expected = max([k * page for q in seen for k in range(1, len(q) // page + 1)
                        if k * page <= len(ids) - 1 and ids[:k * page] == q[:k * page]], default=0)
        assert hit == expected, (ids, hit, expected)
        index.add(index.keys(ids, len(ids) // page), hit // page)
        seen.append(ids)


def test_eviction_takes_leaves_first_and_keeps_the_newest_chain():
    """A store of 8 pages under random traffic: never more than 8 pages, every stored page's chain from the
    first page is stored (nothing stranded), and the chain just added is whole while it fits."""
    rng, page = random.Random(1), 2
    index, prefix_of = PageIndex(capacity=8, page_size=page), {}
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(2, 12))] for _ in range(30)]
    for _ in range(300):
        ids = rng.choice(prompts)
        keys = index.keys(ids, len(ids) // page)
        prefix_of.update({k: tuple(ids[:(i + 1) * page]) for i, k in enumerate(keys)})
        hit = index.match(index.keys(ids, (len(ids) - 1) // page))
        index.add(keys, len(hit))
        assert len(index) <= 8
        stored = {prefix_of[k] for k in prefix_of if k in index}
        assert all(p[:-page] in stored for p in stored if len(p) > page), "a page outlived its parent"
        assert all(k in index for k in keys[:8])
    assert index.evictions > 0


@pytest.fixture(scope="module")
def model():
    return kimi_jax.load(str(TARGET), drafter=str(DRAFTER))


SYSTEM = ("You are a careful assistant. Answer in Python.\nimport os\nimport sys\n\n"
          "def main(argv):\n    parser = argparse.ArgumentParser()\n")
TAILS = ["    return", "    args = parser", "    print(", "    for arg in argv:", "    x =", "    if not"]


@embedded
@pytest.mark.parametrize("method", [pytest.param("ar", marks=pytest.mark.slow), "ddtree"])
def test_a_prefill_from_cached_pages_equals_the_whole_prompts_prefill(model, method):
    """The rows a hit's prefill holds (copied pages + computed rest): latent cache, drafter features, first
    token, equal to the plain prefill of the whole prompt; the stored pages equal that prefill's rows."""
    b = Batcher(model, max_batch=1, max_new=8, max_len=128, method=method, budget=4 if method == "ddtree" else None)
    first = model.tokenizer.encode(SYSTEM + TAILS[0])
    ids = model.tokenizer.encode(SYSTEM + TAILS[1])
    b._prefill(first, (False, False), 1.0, 0)               # stores the shared pages
    hit, cached = b._prefill(ids, (False, False), 1.0, 0)
    t = len(ids)
    assert cached >= 16 and cached % 16 == 0
    prompt = np.zeros((1, b.prompt_width), np.int32)
    prompt[0, :t] = ids
    whole, _ = b._run_prefill(prompt, np.asarray([t], np.int32), (False, False), 1.0, 0)
    np.testing.assert_allclose(np.asarray(hit.cache.kv[:, 0, :t]), np.asarray(whole.cache.kv[:, 0, :t]),
                               rtol=1e-5, atol=1e-5)
    assert int(hit.cache.lengths[0]) == int(whole.cache.lengths[0]) == t
    assert int(hit.bonus[0]) == int(whole.bonus[0])
    store = b.prefix._store
    page0 = b.prefix.index.match(b.prefix.index.keys(ids, 1))[0]
    np.testing.assert_allclose(np.asarray(store.kv[:, page0]), np.asarray(whole.cache.kv[:, 0, :16]),
                               rtol=1e-5, atol=1e-5)
    if method == "ddtree":
        for got, want in ((hit.drafter.k, whole.drafter.k), (hit.drafter.v, whole.drafter.v)):
            np.testing.assert_allclose(np.asarray(got[:, 0, :t]), np.asarray(want[:, 0, :t]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(store.k[:, page0]), np.asarray(whole.drafter.k[:, 0, :16]),
                                   rtol=1e-5, atol=1e-5)


@embedded
@pytest.mark.slow
def test_concurrent_requests_with_and_without_hits_keep_their_tokens(model):
    """Six requests sharing a system prompt, all at once, twice (the second time every prompt's pages are
    cached): each request's greedy tokens equal its prompt through ``Model.generate`` alone (DDTree, budget 4)."""
    b = Batcher(model, max_batch=4, max_new=16, max_len=128, budget=4, rounds_per_dispatch=2)
    b.start()
    try:
        for rnd in range(2):
            got, finished = [[] for _ in TAILS], threading.Semaphore(0)
            jobs = [Job(ids=model.tokenizer.encode(SYSTEM + tail), max_tokens=16, temperature=0.0, seed=0,
                        emit=got[i].extend, finish=lambda reason: finished.release()) for i, tail in enumerate(TAILS)]
            for job in jobs:
                b.submit(job)
            for _ in jobs:
                assert finished.acquire(timeout=300)
            for i, tail in enumerate(TAILS):
                alone = model.generate(SYSTEM + tail, 16, method="ddtree", budget=4).tokens[0]
                assert got[i] == alone[:len(got[i])] and len(got[i]) > 0, (rnd, i, got[i], alone)
            if rnd == 1:
                assert all(job.cached >= 16 for job in jobs), [job.cached for job in jobs]
    finally:
        b.stop(timeout=30)
    assert b.prefix.stats.hit_rate > 0.3


@embedded
@pytest.mark.slow
def test_the_server_reports_cached_tokens_and_prefix_metrics(model):
    from kimi_jax.serving.server import create_app, shutdown
    b = Batcher(model, max_batch=2, max_new=8, max_len=128, method="ar", processing=False)
    b.start()               # no warm-up: each program compiles at its first use (only what this test needs)
    app = create_app(b, "kimi-test")
    url, thread = serve_in_thread(app, grace=5)
    try:
        body = {"prompt": SYSTEM + TAILS[0], "max_tokens": 4, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        again = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        cached = again["prompt_tokens_details"]["cached_tokens"]
        assert cached == (again["prompt_tokens"] - 1) // 16 * 16 > 0
        metrics = httpx.get(url + "/metrics", timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("kimi_jax_prefix_cache")}
        assert values["kimi_jax_prefix_cache_hit_tokens"] == cached
        assert values["kimi_jax_prefix_cache_hit_rate"] == pytest.approx(cached / (2 * again["prompt_tokens"]))
        assert 0 < values["kimi_jax_prefix_cache_pages_used"] <= values["kimi_jax_prefix_cache_pages"]
    finally:
        shutdown(app)
        thread.join(30)
        b.stop(timeout=30)
