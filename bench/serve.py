"""Load test of `python -m kimi_jax.serve` on loopback: throughput and latency at several concurrencies, ar vs ddtree.

    python -m bench.serve [--requests 64] [--concurrency 1 4 16] [--max-tokens 64] [--slots 16] [--max-len 256]
                          [--conversations 8] [--turns 4] [--system-tokens 512]

For each method it starts one server (the embedded default, greedy), sends the same `--requests` completions
(held-out stdlib prompts of 64 tokens, never trained on, id prompts so no tokenizer round trip) at each
concurrency with streaming on, and reports aggregate tokens/s, p50/p99 time to first token and p50/p99
per-token latency (time between streamed chunks divided by the tokens in them). Beside them, the same prompts
through `Model.generate` one at a time in this process (the speed a lone request could have): the server at
concurrency 1 over that is `vs_generate`. Numbers come from one run on this machine; the ratios inside one run
are the point. JSON goes to bench/results/serve_<backend>.json.

Then a multi-turn workload, run twice on servers that differ only in the prefix cache (``--prefix-cache-pages
0`` vs the default): ``--conversations`` chats run 4 at a time, each of ``--turns`` turns. Every conversation starts
with the same ``--system-tokens`` system prompt (a held-out window), each turn adds a 32-token user message (another
held-out window) and the previous reply, re-encoded, to the prompt the client re-sends, as a chat client does. It
reports time to first token, throughput, the prefix cache's hit rate and whether the two servers returned the
same text for every turn (greedy: they must).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(method, slots, max_tokens, max_len=256, extra=()):
    port = _port()
    cmd = [sys.executable, "-m", "kimi_jax.serve", "--port", str(port), "--method", method, "--max-batch",
           str(slots), "--max-new-tokens", str(max_tokens), "--max-len", str(max_len), "--queue-size", "256", *extra]
    # stderr to a file, not a pipe: the server writes an audit line per request, and a pipe nobody reads fills
    # and then blocks the server mid-benchmark
    with tempfile.NamedTemporaryFile("w", prefix="kimi_jax_bench_serve_", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=log, text=True,
                                env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            with open(log.name) as f:
                raise SystemExit(f"server failed: {f.read()}")
        try:
            httpx.get(url + "/health", timeout=1)
            return proc, url, time.time() - t0
        except httpx.HTTPError:
            time.sleep(1)


_clients = threading.local()


def _client() -> httpx.Client:
    """One keep-alive client per worker thread, made before any clock starts, as a real client holds one:
    making an httpx client per request (its SSL context) took ~20 ms of every time to first token here."""
    if not hasattr(_clients, "client"):
        _clients.client = httpx.Client(timeout=600)
    return _clients.client


def one(url, ids, max_tokens, texts=None):
    """One streamed greedy completion -> (time to first token, per-token gaps, tokens, seconds); its text is
    appended to ``texts`` if given."""
    client = _client()
    t0 = time.perf_counter()
    stamps, parts = [], []
    with client.stream("POST", url + "/v1/completions",
                      json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        usage = None
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                usage = ev["usage"]
            elif ev["choices"] and ev["choices"][0]["text"]:
                stamps.append(time.perf_counter() - t0)
                parts.append(ev["choices"][0]["text"])
    if texts is not None:
        texts.append("".join(parts))
    tokens = usage["completion_tokens"]
    per_token = [(b - a) for a, b in zip(stamps, stamps[1:])]
    # chunks carry several tokens: spread each gap over the tokens after the first
    per_token = [g * (len(per_token) / max(tokens - 1, 1)) for g in per_token]
    return stamps[0] if stamps else float("nan"), per_token, tokens, time.perf_counter() - t0


def load_test(url, prompts, concurrency, max_tokens):
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda p: one(url, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttft = np.array([r[0] for r in res])
    lat = np.array([x for r in res for x in r[1]] or [np.nan])
    tokens = sum(r[2] for r in res)
    return dict(concurrency=concurrency, requests=len(prompts), tokens=tokens, wall_s=round(wall, 2),
                tokens_per_s=round(tokens / wall, 1), ttft_p50_ms=round(1e3 * np.median(ttft), 1),
                ttft_p99_ms=round(1e3 * np.percentile(ttft, 99), 1),
                token_p50_ms=round(1e3 * np.nanmedian(lat), 2), token_p99_ms=round(1e3 * np.nanpercentile(lat, 99), 2),
                single_tokens_per_s=round(np.mean([r[2] / r[3] for r in res]), 1))


def conversation(url, tok, system, users, max_tokens):
    """One chat's turns in order, each prompt the last one plus its reply and the next user message (ids)."""
    prompt, texts, ttft, tokens = list(system), [], [], 0
    for user in users:
        prompt += user
        first, _, n, _ = one(url, prompt, max_tokens, texts)
        ttft.append(first)
        tokens += n
        prompt += tok.encode(texts[-1])
    return texts, ttft, tokens


def multi_turn(url, tok, system, users, concurrency, max_tokens):
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda u: conversation(url, tok, system, u, max_tokens), users))
    wall = time.perf_counter() - t0
    ttft = np.array([x for r in res for x in r[1]])
    metrics = {x.split()[0]: float(x.split()[1]) for x in httpx.get(url + "/metrics").text.splitlines()
               if x.startswith("kimi_jax_prefix_cache")}
    tokens = sum(r[2] for r in res)
    return dict(conversations=len(users), turns=len(users[0]), requests=ttft.size, tokens=tokens,
                wall_s=round(wall, 2), tokens_per_s=round(tokens / wall, 1),
                ttft_p50_ms=round(1e3 * np.median(ttft), 1), ttft_p99_ms=round(1e3 * np.percentile(ttft, 99), 1),
                hit_rate=round(metrics.get("kimi_jax_prefix_cache_hit_rate", 0.0), 3)), [r[0] for r in res]


def generate_alone(model, prompts, max_tokens, method):
    """Tokens/s of the prompts through ``Model.generate`` one at a time (compiled first, not timed)."""
    model.generate([prompts[0]], max_tokens, method=method)
    t0, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += model.generate([p], max_tokens, method=method).stats["new_tokens"]
    return round(tokens / (time.perf_counter() - t0), 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256, help="the server's cache slots per row (prompt + max tokens "
                    "+ one tree must fit: 512 for --max-tokens 256)")
    ap.add_argument("--methods", nargs="+", default=["ar", "ddtree"])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    a = ap.parse_args(argv)
    import kimi_jax
    from kimi_jax.training.corpus import heldout_prompts
    model = kimi_jax.load(os.path.join(ROOT, "checkpoints", "target"),
                          drafter=os.path.join(ROOT, "checkpoints", "drafter"))
    prompts = heldout_prompts(model.tokenizer, a.requests, 64)
    rows = []
    for method in a.methods:
        alone = generate_alone(model, prompts, a.max_tokens, method)
        print(f"{method}: Model.generate alone {alone} tok/s", flush=True)
        proc, url, warm = start(method, a.slots, a.max_tokens, a.max_len)
        print(f"{method}: server up in {warm:.0f}s", flush=True)
        one(url, prompts[0], 8)                                    # first request after warm-up, not timed
        for c in a.concurrency:
            row = dict(method=method, slots=a.slots, warm_s=round(warm, 1), generate_alone_tokens_per_s=alone,
                       **load_test(url, prompts, c, a.max_tokens))
            row["vs_generate"] = round(row["tokens_per_s"] / alone, 2)
            tau = [float(x.split()[-1]) for x in httpx.get(url + "/metrics").text.splitlines()
                   if x.startswith("kimi_jax_mean_tau")]
            row["mean_tau_so_far"] = round(tau[0], 2) if tau else None
            rows.append(row)
            print(json.dumps(row), flush=True)
        proc.terminate()
        proc.wait(timeout=120)
    chats, texts = [], {}
    if a.conversations:
        system = heldout_prompts(model.tokenizer, 1, a.system_tokens, seed=1)[0]
        users = heldout_prompts(model.tokenizer, a.conversations * a.turns, 32, seed=2)
        users = [users[i * a.turns:(i + 1) * a.turns] for i in range(a.conversations)]
        for pages in ("0", None):
            proc, url, warm = start("ddtree", 8, 32, max_len=1024, extra=() if pages is None else
                                    ("--prefix-cache-pages", pages))
            one(url, users[0][0], 4)                               # first request after warm-up, not timed
            row, texts[pages] = multi_turn(url, model.tokenizer, system, users, 4, 32)
            row = dict(prefix_cache=pages is None, system_tokens=a.system_tokens, warm_s=round(warm, 1), **row)
            chats.append(row)
            print(json.dumps(row), flush=True)
            proc.terminate()
            proc.wait(timeout=120)
        same = texts["0"] == texts[None]
        for row in chats:
            row["same_text_both_servers"] = same
    import jax
    out = os.path.join(ROOT, "bench", "results", f"serve_{jax.default_backend()}.json")
    with open(out, "w") as f:
        json.dump({"text": "held-out stdlib files (kimi_jax.training.corpus.heldout_prompts, 64-token windows; "
                   "multi-turn: one 512-token window as the system prompt, 32-token windows as user turns)",
                   "max_tokens": a.max_tokens, "rows": rows, "multi_turn": chats}, f, indent=1)
    print("| method | concurrency | tokens/s | vs generate alone | TTFT p50 / p99 ms | per-token p50 / p99 ms "
          "| one request tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s']} | {r['vs_generate']}x "
              f"| {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['token_p50_ms']} / {r['token_p99_ms']} "
              f"| {r['single_tokens_per_s']} |")
    if chats:
        print("| prefix cache | conversations x turns | tokens/s | TTFT p50 / p99 ms | hit rate | same text |")
        print("|---|---|---|---|---|---|")
        for r in chats:
            print(f"| {'on' if r['prefix_cache'] else 'off'} | {r['conversations']} x {r['turns']} "
                  f"| {r['tokens_per_s']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['hit_rate']} "
                  f"| {r['same_text_both_servers']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
