"""A notebook's session, twice: programs per length (a cache bucket per request, the rule before lengths became
run-time inputs) against one program per (method, batch) (the default: a cache as wide as the context).

    python -m bench.programs [--method auto|ar|ddtree] [--calls 6] [--repeats 3]

Held-out prompts (``kimi_jax.training.corpus.heldout_prompts``: stdlib files the embedded default never trained
on) of other lengths, each call with another ``max_new_tokens``. Prints, per layout, the programs compiled and the
seconds spent compiling, and per call the best of ``--repeats`` timed runs after it compiled; the ratio of the two
layouts' decode seconds is measured in this one run. Both layouts emit the same tokens (checked).
"""

from __future__ import annotations

import argparse
import time

from kimi_jax import api
from kimi_jax.config import Runtime
from kimi_jax.training.corpus import heldout_prompts

ROOT = "checkpoints"
# (prompt tokens, max_new_tokens): both sides of the old power-of-two buckets
CALLS = [(60, 64), (30, 100), (150, 20), (90, 300), (10, 7), (200, 256), (45, 33), (120, 128)]


def session(layouts: dict, calls, method, budget, repeats):
    """-> {layout: (tokens per call, best decode seconds per call)}. Each call runs on every layout in turn (its
    first run compiles where it must), then ``repeats`` timed runs alternate between them, so load on the machine
    falls on both."""
    out = {name: ([], []) for name in layouts}
    for prompt, n in calls:
        best = dict.fromkeys(layouts, float("inf"))
        for name, model in layouts.items():
            out[name][0].append(model.generate([prompt], n, method=method, budget=budget).tokens[0])
        for _ in range(repeats):
            for name, model in layouts.items():
                t0 = time.perf_counter()
                model.generate([prompt], n, method=method, budget=budget)
                best[name] = min(best[name], time.perf_counter() - t0)
        for name in layouts:
            out[name][1].append(best[name])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="auto", choices=["auto", "ar", "ddtree"])
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    method, budget = {"auto": ("ddtree", "auto"), "ar": ("ar", None), "ddtree": ("ddtree", 16)}[a.method]
    load = lambda rt: api.load(f"{ROOT}/target", drafter=f"{ROOT}/drafter", runtime=rt)    # noqa: E731
    layouts = {"per length": load(Runtime(context=1)), "one program": load(Runtime())}
    heldout = heldout_prompts(layouts["one program"].tokenizer, a.calls, max(n for n, _ in CALLS), seed=5)
    calls = [(h[:n], m) for h, (n, m) in zip(heldout, CALLS[:a.calls])]
    results = session(layouts, calls, method, budget, a.repeats)
    (tok_a, sec_a), (tok_b, sec_b) = results.values()
    assert tok_a == tok_b, "the two layouts emitted different tokens"
    print(f"method {a.method}, {a.calls} calls on held-out prompts (the stdlib's held-out files), embedded default")
    for name, model in layouts.items():
        print(f"  {name:12s}: {len(model.programs._compiled)} programs, {model.programs.compile_s:.1f} s compiling")
    print(f"  {'prompt':>6s} {'new':>4s} {'per length s':>13s} {'one program s':>14s} {'ratio':>6s}")
    for (prompt, n), x, y in zip(calls, sec_a, sec_b):
        print(f"  {len(prompt):6d} {n:4d} {x:13.3f} {y:14.3f} {x / y:6.2f}")
    print(f"  total decode: per length {sum(sec_a):.3f} s, one program {sum(sec_b):.3f} s, "
          f"ratio {sum(sec_a) / sum(sec_b):.2f} (above 1: one program is faster)")


if __name__ == "__main__":
    main()
