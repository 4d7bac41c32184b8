"""Check and time latent_attention (MLA tree verify) at K2 widths: pallas vs xla vs the dense oracle.

GPU:  python bench/tree_attention.py                       (K2: h=64, r=512, p=64; N=16 tree; s=4096)
CPU:  JAX_PLATFORMS=cpu python bench/tree_attention.py --small   (interpret mode, tiny shapes: a smoke run)
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.ops.tree_attention.api import latent_attention
from kimi_jax.ops.tree_attention.reference import dense_reference


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=17, help="t = 1 + N")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    b, t, h, s, r, p = a.batch, a.nodes, a.heads, a.slots, 512, 64
    if a.small:
        b, t, h, s, r, p, a.iters = 2, 5, 4, 100, 32, 16, 2
    rng = np.random.default_rng(0)
    n = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    q, qpe, kv = n(b, t, h, r) * 0.1, n(b, t, h, p) * 0.1, n(b, s, r + p)
    lengths = jnp.asarray(rng.integers(s // 2, s - t, size=b), jnp.int32)
    parents = rng.integers(0, np.maximum(np.arange(t), 1))
    mask = np.eye(t, dtype=bool)
    for i in range(1, t):
        mask[i] |= mask[parents[i]]
    mask = jnp.broadcast_to(jnp.asarray(mask), (b, t, t))
    scale = 1.0 / np.sqrt(192)
    ref = np.asarray(jax.jit(dense_reference, static_argnums=5)(q, qpe, kv, lengths, mask, scale))
    print(f"b={b} t={t} h={h} s={s} r={r} p={p} backend={jax.default_backend()}")
    for impl in ("xla", "pallas"):
        f = jax.jit(lambda *x, impl=impl: latent_attention(*x, scale, impl=impl, out_dtype=jnp.float32))
        out = f(q, qpe, kv, lengths, mask).block_until_ready()
        err = np.abs(np.asarray(out) - ref).max() / np.abs(ref).max()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            out = f(q, qpe, kv, lengths, mask)
        out.block_until_ready()
        us = (time.perf_counter() - t0) / a.iters * 1e6
        print(f"{impl:7s} rel err {err:.2e}  {us:9.1f} us/call")


if __name__ == "__main__":
    main()
