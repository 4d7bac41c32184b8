"""What serving from two processes costs on one machine: `python -m kimi_jax.serve` on one ep=2 mesh, once as one
process holding both CPU devices and once as two processes of one device each (jax.distributed, gloo
collectives between them, every batch step sent from process 0 to process 1 through the coordination store).

    python -m bench.serve_across [--requests 16] [--concurrency 1 4] [--max-tokens 32] [--budget 8]

Both servers get the same held-out prompts (64-token windows of text the embedded default never trained on,
``kimi_jax.training.corpus.heldout_prompts``), greedy, streamed; it reports p50/p99 time to first token, per-token
latency and tokens/s at each concurrency, and the two-process figures over the one-process ones. The same
programs run in both (same mesh), so the ratio is what crossing processes costs: the collectives over loopback
TCP instead of in-process, and the steps' trip through the store. One run on this machine; only the ratios within
it mean anything. JSON goes to bench/results/serve_across_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from bench.serve import ROOT, _port, load_test, one


def start(processes: int, max_tokens: int, budget: str):
    """A server on an ep=2 mesh of CPU devices, from ``processes`` processes -> (processes, URL, seconds to up)."""
    port, coordinator = _port(), _port()
    devices = 2 // processes
    procs = []
    for i in range(processes):
        flags = ["--coordinator", f"localhost:{coordinator}", "--num-processes", str(processes), "--process-id",
                 str(i)] if processes > 1 else []
        log = tempfile.NamedTemporaryFile("w", prefix=f"kimi_jax_bench_across{i}_", suffix=".log", delete=False)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kimi_jax.serve", "--port", str(port), "--mesh", "ep=2", "--max-batch", "4",
             "--max-new-tokens", str(max_tokens), "--max-len", "256", "--budget", budget, *flags],
            cwd=ROOT, stderr=log, stdout=subprocess.DEVNULL,
            env={**os.environ, "JAX_PLATFORMS": "cpu",
                 "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}))
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while True:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a server process failed; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return procs, url, time.time() - t0
        except httpx.HTTPError:
            time.sleep(1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", default="8")
    a = ap.parse_args(argv)

    import kimi_jax
    from kimi_jax.training.corpus import heldout_prompts
    tok = kimi_jax.load(os.path.join(ROOT, "checkpoints", "target")).tokenizer
    prompts = heldout_prompts(tok, a.requests, 64)
    rows, texts = [], {}
    for processes in (1, 2):
        procs, url, up = start(processes, a.max_tokens, a.budget)
        print(f"{processes} process(es): server up in {up:.0f}s", flush=True)
        one(url, prompts[0], 8)                                    # the first request after warm-up, not timed
        texts[processes] = []
        for p in prompts:                                          # the tokens, to show both serve the same
            one(url, p, a.max_tokens, texts[processes])
        for c in a.concurrency:
            row = dict(processes=processes, **load_test(url, prompts, c, a.max_tokens))
            rows.append(row)
            print(json.dumps(row), flush=True)
        procs[0].terminate()
        for p in procs:
            p.wait(timeout=120)
    ratios = {}
    for c in a.concurrency:
        one_p, two_p = (next(r for r in rows if r["processes"] == n and r["concurrency"] == c) for n in (1, 2))
        ratios[c] = {k: round(two_p[k] / one_p[k], 2) for k in ("ttft_p50_ms", "token_p50_ms", "tokens_per_s")}
    out = dict(rows=rows, two_over_one=ratios, same_text=texts[1] == texts[2], prompts="heldout_prompts(64 tokens)",
               budget=a.budget, max_tokens=a.max_tokens)
    print(json.dumps({"two_over_one": ratios, "same_text": out["same_text"]}))
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "serve_across_cpu.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
