"""Long-context cost on this backend: prefill tokens/s, decode ms per step and compiled memory vs context.

    python -m bench.long_context [--contexts 1024 2048 ... 32768] [--chunk 1024]

The tiny test config (``preset("tiny")``, 3 layers, hidden 64) with a 65,536-token context and random weights;
prompts are random ids (the cost does not depend on the text). For each context C one greedy AR generation of
a (C - 100)-token prompt, so that 65 new tokens fit a cache of C slots: prefill = the one-token run, decode =
(the 65-token run - the one-token run) / 64 steps; each
program is compiled and run once before it is timed. Memory: the generation program's compiled temporaries and
arguments (``memory_analysis``). JSON to bench/results/long_context_<backend>.json, plot to
docs/long_context.png. Numbers come from one run; decode reads every cache slot each step, so its cost grows
with the cache length.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--chunk", type=int, default=1024)
    a = ap.parse_args(argv)
    import kimi_jax
    from kimi_jax.config import Runtime, preset
    from kimi_jax.model.params import init_params

    cfg = preset("tiny").replace(max_position_embeddings=65536)
    model = kimi_jax.Model(cfg, init_params(cfg, jax.random.key(0)), runtime=Runtime(prefill_chunk=a.chunk))
    rng = np.random.default_rng(0)
    rows = []
    for ctx in a.contexts:
        prompt = [rng.integers(2, cfg.vocab_size, ctx - 100).tolist()]   # + 65 new: cache of ctx slots
        times = {}
        for new in (1, 65):
            model.generate(prompt, new, method="ar")                  # compile + warm
            t0 = time.perf_counter()
            model.generate(prompt, new, method="ar")
            times[new] = time.perf_counter() - t0
        spec = model.spec("ar", None, 0.0)
        arr, lens, max_len = model._layout(prompt, 65, spec)
        mem = model._program(spec, arr, 65, max_len)[0].memory_analysis()
        row = dict(context=ctx, prompt=len(prompt[0]), cache_slots=max_len,
                   prefill_tokens_per_s=round(len(prompt[0]) / times[1], 1),
                   decode_ms_per_step=round(1e3 * (times[65] - times[1]) / 64, 3),
                   temp_mb=round(mem.temp_size_in_bytes / 2**20, 1),
                   argument_mb=round(mem.argument_size_in_bytes / 2**20, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = os.path.join(ROOT, "bench", "results", f"long_context_{jax.default_backend()}.json")
    with open(out, "w") as f:
        json.dump({"config": "tiny, 65536 context, random weights", "prefill_chunk": a.chunk, "rows": rows}, f,
                  indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        x = [r["context"] for r in rows]
        fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
        ax[0].plot(x, [r["prefill_tokens_per_s"] for r in rows], "o-")
        ax[0].set_title("prefill tokens/s")
        ax[1].plot(x, [r["decode_ms_per_step"] for r in rows], "o-")
        ax[1].set_title("decode ms per step")
        ax[2].plot(x, [r["temp_mb"] for r in rows], "o-", label="temporaries")
        ax[2].plot(x, [r["argument_mb"] for r in rows], "s-", label="arguments")
        ax[2].set_title("compiled memory (MiB)")
        ax[2].legend()
        for axis in ax:
            axis.set_xscale("log", base=2)
            axis.set_xlabel("context (tokens)")
        fig.suptitle(f"tiny K2-architecture model, {jax.default_backend()}, prefill chunk {a.chunk}")
        fig.tight_layout()
        fig.savefig(os.path.join(ROOT, "docs", "long_context.png"), dpi=110)
    except ImportError:
        pass
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
