"""Long-context cost on this backend: prefill tokens/s, decode ms per step and compiled memory vs context.

    python -m bench.long_context [--contexts 1024 2048 ... 32768] [--chunk 1024]

The tiny test config (``preset("tiny")``, 3 layers, hidden 64) with a 65,536-token context and random weights;
prompts are random ids (the cost does not depend on the text). For each context C a (C - 100)-token prompt
with a cache of C slots: prefill = the engine's prefill program (chunked); decode = AR steps from that state with
``bench.steady.steady_rounds_program`` (72 minus 8 steps, / 64), so prefill noise does not leak into the step time; each
program is compiled and run once before it is timed. Memory: the prefill program's compiled temporaries and the
latent cache. JSON to bench/results/long_context_<backend>.json, plot to
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
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--chunk", type=int, default=1024)
    a = ap.parse_args(argv)
    import kimi_jax
    from kimi_jax.config import Runtime, preset
    from bench.steady import steady_rounds_program
    from kimi_jax.model.params import init_params

    cfg = preset("tiny").replace(max_position_embeddings=65536)
    model = kimi_jax.Model(cfg, init_params(cfg, jax.random.key(0)), runtime=Runtime(prefill_chunk=a.chunk))
    rng = np.random.default_rng(0)
    rows = []
    for ctx in a.contexts:
        prompt = [rng.integers(2, cfg.vocab_size, ctx - 100).tolist()]   # + 65 new: a cache of ctx slots
        request = model.prepare(prompt, 65, "ar")
        inputs = model.inputs(request)
        prefill, _ = model.programs.prefill(request, inputs)
        state, _ = prefill(inputs)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, _ = prefill(inputs)
        jax.block_until_ready(state)
        t_prefill = time.perf_counter() - t0
        steady = steady_rounds_program.lower(model.compute_params, None, state, np.int32(-1), np.int32(1),
                                                    spec=request.spec).compile()
        per = {}
        for n in (8, 72):
            steady(model.compute_params, None, state, np.int32(-1), np.int32(n)).block_until_ready()
            t0 = time.perf_counter()
            steady(model.compute_params, None, state, np.int32(-1), np.int32(n)).block_until_ready()
            per[n] = time.perf_counter() - t0
        mem = prefill.memory_analysis()
        row = dict(context=ctx, prompt=len(prompt[0]), cache_slots=request.max_len,
                   prefill_s=round(t_prefill, 3), prefill_tokens_per_s=round(len(prompt[0]) / t_prefill, 1),
                   decode_ms_per_step=round(1e3 * (per[72] - per[8]) / 64, 3),
                   prefill_temp_mb=round(mem.temp_size_in_bytes / 2**20, 1),
                   cache_mb=round(cfg.num_hidden_layers * request.max_len * cfg.latent_dim * 4 / 2**20, 2))
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
        ax[2].plot(x, [r["prefill_temp_mb"] for r in rows], "o-", label="prefill temporaries")
        ax[2].plot(x, [r["cache_mb"] for r in rows], "s-", label="latent cache")
        ax[2].set_title("memory (MiB)")
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
