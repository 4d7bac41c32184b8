"""Rounds per dispatch, fixed 4 vs by time (``--dispatch-ms`` 10), in one process without HTTP.

    python -m bench.dispatch_policy

Two batchers over the embedded default (ar, 16 slots, 64 new tokens, 256-slot caches), one with
``rounds_per_dispatch=4`` and one sizing dispatches by time, take the same 64 held-out prompts
(``kimi_jax.training.corpus.heldout_prompts``, 64-token windows) at concurrency 1, 4 and 16, alternating, twice.
Prints tokens/s per policy and concurrency and each policy's measured seconds per round per slot bucket. One
run on this machine; the ratios inside it are the point (the README's table of the two policies).
"""

from __future__ import annotations

import os
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    import kimi_jax
    from kimi_jax.serving.batcher import Batcher, Job
    from kimi_jax.training.corpus import heldout_prompts

    model = kimi_jax.load(os.path.join(ROOT, "checkpoints", "target"),
                          drafter=os.path.join(ROOT, "checkpoints", "drafter"))
    prompts = heldout_prompts(model.tokenizer, 64, 64)

    def batcher(**kw):
        b = Batcher(model, max_batch=16, max_new=64, max_len=256, method="ar", **kw)
        b.warm(log=lambda _: None)
        b.start()
        return b

    def tokens_per_s(b, concurrency):
        free, done = threading.Semaphore(concurrency), threading.Semaphore(0)

        def finish(_):
            free.release()
            done.release()

        t0 = time.perf_counter()
        for p in prompts:
            free.acquire()
            b.submit(Job(ids=p, max_tokens=64, temperature=0.0, seed=0, emit=lambda _: None, finish=finish))
        for _ in prompts:
            done.acquire()
        return round(len(prompts) * 64 / (time.perf_counter() - t0))

    policies = {"4 rounds per dispatch": batcher(rounds_per_dispatch=4), "rounds that fill 10 ms": batcher()}
    for _ in range(2):
        for name, b in policies.items():
            got = {c: tokens_per_s(b, c) for c in (1, 4, 16)}
            per_round = {slots: round(s * 1e3, 2) for slots, s in b._round_s.items()}
            print(f"{name}: tok/s by concurrency {got}; ms per round by slot bucket {per_round}", flush=True)
    for b in policies.values():
        b.stop(5)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
