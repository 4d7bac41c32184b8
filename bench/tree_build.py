"""Time the jitted DDTree builder (and the mask and walk) on this machine's default JAX backend.

    JAX_PLATFORMS=cpu python -m bench.tree_build [--json out.json]

Prints ms per call (median of `--iters` timed calls after one warm-up) for B=1, L=15 and several (V, N).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.decoding import ddtree

CASES = [(4096, n) for n in (16, 64, 256, 1024)] + [(163840, n) for n in (16, 64, 256)]


def time_ms(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    depth_l = args.depth
    build = jax.jit(ddtree.build_tree, static_argnums=2)
    mask = jax.jit(ddtree.ancestor_mask)
    walk = jax.jit(ddtree.walk, static_argnums=2)
    rows = []
    print(f"backend={jax.default_backend()} B=1 L={depth_l}")
    print(f"{'V':>7} {'N':>5} {'build ms':>9} {'mask ms':>8} {'walk ms':>8}")
    for vocab, n in CASES:
        key = jax.random.key(0)
        logits = 3.0 * jax.random.normal(key, (1, depth_l, vocab), jnp.float32)
        root = jnp.zeros((1,), jnp.int32)
        tree = build(root, logits, n)
        target = jax.random.randint(key, (1, 1 + n), 0, vocab, jnp.int32)
        row = dict(V=vocab, N=n, L=depth_l, build_ms=time_ms(build, root, logits, n, iters=args.iters),
                   mask_ms=time_ms(mask, tree, iters=args.iters),
                   walk_ms=time_ms(walk, tree, target, depth_l, iters=args.iters))
        rows.append(row)
        print(f"{vocab:>7} {n:>5} {row['build_ms']:>9.2f} {row['mask_ms']:>8.2f} {row['walk_ms']:>8.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
