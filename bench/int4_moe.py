"""Time the routed-expert INT4 MoE (one K2.6 MoE layer) and compare it with the bytes it must stream.

    python -m bench.int4_moe [--quick] [--tokens 1 8 64] [--experts N] [--impls xla pallas]

K2.6 shapes: hidden D=7168, expert width F=2048, top-8 routing (uniform random, distinct experts per token).
For each token count and each implementation available on the backend (CPU: xla; GPU: xla and pallas) it prints
the median time, the weight bytes the step must read (unique experts touched x one expert's INT4 words and bf16
scales) and the achieved bytes/s. On GPU it also measures device-copy bandwidth (a 2 GiB copy: read + write) and
prints the fraction of it each implementation reaches, and checks pallas against xla on the same inputs.

The full layer has 384 experts (9.5 GB of INT4): too big for a small CPU box, so on CPU the default is 16 experts
with the same D and F (the output says so); ``--experts 384`` restores the full layer. Results go to
bench/results/int4_moe_<backend>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.ops.int4_format import Int4Experts
from kimi_jax.ops.int4_moe.api import int4_moe

D, F, TOPK, FULL_EXPERTS = 7168, 2048, 8, 384
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def random_experts(key, e: int, d: int, f: int) -> Int4Experts:
    """Random INT4 words and small positive scales, made on the device (quantizing 9.5 GB on the host is slow)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    words = lambda k, s: jax.random.bits(k, s, jnp.uint32).view(jnp.int32)  # noqa: E731
    scales = lambda k, s: jax.random.uniform(k, s, jnp.float32, 0.002, 0.01).astype(jnp.bfloat16)  # noqa: E731
    return Int4Experts(w13=words(k1, (e, 2, d // 8, f)), s13=scales(k2, (e, 2, d // 32, f)),
                       w2=words(k3, (e, f // 8, d)), s2=scales(k4, (e, f // 32, d)))


def random_routing(key, t: int, e: int, k: int):
    k1, k2 = jax.random.split(key)
    idx = jax.lax.top_k(jax.random.uniform(k1, (t, e)), k)[1].astype(jnp.int32)   # k distinct experts per token
    w = jax.random.uniform(k2, (t, k), jnp.float32, 0.05, 0.5)
    return idx, w


def time_ms(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def copy_bandwidth(reps: int, gib: float = 2.0) -> float:
    """Bytes/s of a device copy of ``gib`` GiB (read + write both counted)."""
    a = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    ms = time_ms(jax.jit(lambda a: a + 1.0), a, reps=reps)
    return 2 * a.nbytes / (ms * 1e-3)


def main() -> None:
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer token counts and repetitions")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--experts", type=int, default=FULL_EXPERTS if on_gpu else 16)
    ap.add_argument("--impls", nargs="+", default=["xla", "pallas"] if on_gpu else ["xla"])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16" if on_gpu else "float32", help="activation dtype")
    ap.add_argument("--json", default=str(RESULTS / f"int4_moe_{backend}.json"))
    args = ap.parse_args()
    tokens = args.tokens or ([1, 8, 64] if args.quick else [1, 8, 64, 256, 1024])
    reps = args.reps or {(False, True): 3, (False, False): 5, (True, True): 10, (True, False): 20}[on_gpu, args.quick]
    dtype = jnp.dtype(args.dtype)

    key = jax.random.key(0)
    experts = random_experts(key, args.experts, D, F)
    expert_bytes = experts.expert_nbytes
    note = "" if args.experts == FULL_EXPERTS else f"  (REDUCED from {FULL_EXPERTS} experts to fit this machine)"
    print(f"backend={backend} device={jax.devices()[0].device_kind} experts={args.experts}{note}")
    print(f"D={D} F={F} top-{TOPK} x={dtype.name}; one expert = {expert_bytes / 1e6:.2f} MB INT4+scales; "
          f"layer = {experts.nbytes / 1e9:.2f} GB; median of {reps}")
    copy_bw = copy_bandwidth(reps) if on_gpu else None
    if copy_bw:
        print(f"device copy bandwidth (2 GiB, read+write): {copy_bw / 1e9:.0f} GB/s")

    fns = {impl: jax.jit(functools.partial(int4_moe, impl=impl)) for impl in args.impls}
    rows = []
    hdr = f"{'tokens':>6} {'experts':>7} {'MB read':>9} " + " ".join(
        f"{impl + ' ms':>10} {impl + ' GB/s':>11}" + (f" {'%copy':>6}" if copy_bw else "") for impl in args.impls)
    print(hdr)
    for t in tokens:
        kx, kr = jax.random.split(jax.random.fold_in(key, t))
        x = jax.random.normal(kx, (t, D), jnp.float32).astype(dtype)
        idx, w = random_routing(kr, t, args.experts, TOPK)
        unique = int(np.unique(np.asarray(idx)).size)
        need = unique * expert_bytes
        row = dict(tokens=t, unique_experts=unique, bytes_read=need)
        line = f"{t:>6} {unique:>7} {need / 1e6:>9.1f} "
        outs = {}
        for impl, fn in fns.items():
            ms = time_ms(fn, x, idx, w, experts, reps=reps)
            bw = need / (ms * 1e-3)
            row[impl] = dict(ms=ms, bytes_per_s=bw) | ({"frac_copy_bw": bw / copy_bw} if copy_bw else {})
            line += f"{ms:>10.3f} {bw / 1e9:>11.1f}" + (f" {bw / copy_bw:>6.1%}" if copy_bw else "") + " "
            if on_gpu:
                outs[impl] = np.asarray(fn(x, idx, w, experts))
        if len(outs) > 1:  # agreement check on the real hardware
            ref = outs["xla"]
            for impl, y in outs.items():
                if impl != "xla":
                    row[impl]["max_rel_err_vs_xla"] = float(np.abs(y - ref).max() / np.abs(ref).max())
            line += " relerr " + " ".join(f"{row[i]['max_rel_err_vs_xla']:.1e}" for i in outs if i != "xla")
        rows.append(row)
        print(line, flush=True)

    RESULTS.mkdir(exist_ok=True)
    out = dict(backend=backend, device=jax.devices()[0].device_kind, experts=args.experts,
               full_layer_experts=FULL_EXPERTS, D=D, F=F, topk=TOPK, dtype=dtype.name, reps=reps,
               expert_bytes=expert_bytes, copy_bytes_per_s=copy_bw, jax=jax.__version__, rows=rows)
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
