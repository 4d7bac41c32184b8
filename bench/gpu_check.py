"""One prepared check of kimi_jax on a borrowed GPU (one H100 / H200): kernels, bandwidth, a K2.6-shaped round.

    python -m bench.gpu_check [--out FILE|DIR] [--budget-s 420] [--sections kernels,copy,moe,attention,round]
    JAX_PLATFORMS=cpu python -m bench.gpu_check --tiny      # the CPU smoke run CI does (tests/test_gpu_check.py)

Written to run once, unattended, in well under 8 minutes on one GPU (compiles included), and to leave a JSON
record (default bench/results/gpu_check_<device>.json) and a short summary on stdout. Sections, in order:

1. ``kernels``: each kernel (INT4 MoE, MLA tree attention) against its oracle in ``reference.py``, on the device,
   both impls ("pallas" with ``interpret=False`` on a GPU, "xla"), at a few shapes including K2.6 TP-8 slice
   shapes, a paged cache and bf16: max abs and max relative error (``max|y - ref| / max|ref|``) against a
   tolerance per dtype, and ok = error <= tolerance. The INT4 MoE's bf16 cases also run the Mosaic GPU kernel
   ("mosaic", ``ops/int4_moe/mosaic_gpu.py``, what "auto" runs on Hopper), and so do the tree attention's bf16
   cases whose dims it takes (rope 64, latent and page size multiples of 64): impl="mosaic"
   (``ops/tree_attention/mosaic_gpu.py``, "auto" on Hopper where its rules take the call: ``kimi_jax/ops/registry.py``).
2. ``copy``: device copy bandwidth, ``a + 1`` over a 2 GiB float32 array (read + write counted), best of N.
3. ``moe``: the INT4 MoE at K2.6 TP-8 slice shapes (hidden 7168, expert width 2048/8 = 256, 384 experts, top-8,
   group-32 INT4, bf16 activations), tokens 1, 8, 16, 32, 64, both impls and on a GPU the Mosaic GPU kernel
   beside them ("mosaic": its default blocks, swapped at these widths; "mosaic_bm64": 64-row blocks): time per
   call and effective bytes/s = INT4 words + bf16 scales of the experts the call touches / time, and that as a
   fraction of the copy bandwidth.
   tokamax's ``ragged_dot`` over bf16 copies of the same experts runs as a peer if ``import tokamax`` works.
4. ``attention``: tree-verify attention time vs tree width (1, 5, 17, 33, 65) at K2.6 MLA per-device dims (16
   heads, kv_lora 512, rope 64, bf16) and cache lengths 4096 and 32768, both impls and the Mosaic GPU kernel
   ("mosaic", 16-bit caches only), with the latent-cache bytes the call must read / time.
5. ``allreduce``: one all-reduce over every device at a round's message sizes (K2.6 hidden 7168 x 1, 17 and 65
   tokens, bf16: 14-910 KB), K = 32 chained in one program, compiled with XLA's one-shot kernel on and off
   (``Runtime.one_shot_all_reduce``): us per all-reduce each way. Needs 2+ devices; on one it records why not.
6. ``round``: one DDTree round (draft, build_tree, verify, accept, commit) of a 3-layer K2.6 (the preset's real
   dims: 1 dense + 2 MoE layers, random INT4 experts) with a 1-layer drafter, per kernel choice ("auto", the
   default: Mosaic GPU experts on Hopper; "pallas": all Triton; "xla"), plain AR and
   ddtree budget 16, at a 4096-slot cache: ms per round from ``bench.steady.steady_rounds_program`` and the stage
   profile (bench/round_profile.py's instruction-to-stage map applied to a ``jax.profiler`` trace).

How times are taken (``timed``): a warm-up call (its wall time, compile included, is ``first_call_s``), then N
calls each followed by ``block_until_ready``; best and median. The kernel timings of sections 3 and 4 run K = 4
calls chained inside one program (``chain``): each call reads its own inputs (its own routing / its own cache)
and depends on the previous call through a value that is always zero but unknown to the compiler, so the calls
neither overlap, fuse nor hoist, and the host's dispatch is paid once per K; per-call time = program time / K.
Successive timed runs cycle through several such input sets (``input_sets``: 256 MB in all, > 2x the 50-60 MB
L2), so L2 does not hand one run's weights or cache to the next: bytes/s are HBM bytes/s.

Every section is guarded: a failure is recorded (``status: "error"``, the message and the traceback's tail) and
the next section runs. ``--budget-s`` is the wall-clock guard: a section (or the rest of one) that would start
with less time left than it needs is skipped with a note. ``--tiny``: small shapes, 2 repetitions, Pallas in
interpret mode, for the CPU; without it, on a machine with no GPU, the script refuses in one line.
"""

from __future__ import annotations

import os
import time

T_START = time.perf_counter()        # wall time counts from here: the JAX import included

# JAX preallocates 75% of GPU memory by default; the round section needs ~50 GB of an 80 GB H100.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import glob  # noqa: E402
import itertools  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SECTIONS = ("kernels", "copy", "moe", "attention", "allreduce", "round")
F32, BF16 = jnp.float32, jnp.bfloat16

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


# ---------------------------------------------------------------------------------------------------------------
# what runs where: the full (GPU) plan and the tiny (CPU) plan


@dataclasses.dataclass(frozen=True)
class Plan:
    reps: int                        # timed calls per measurement (best and median of these)
    chain: int                       # kernel calls chained in one program (sections 3, 4)
    flush_bytes: int                 # distinct bytes the timed programs cycle through (> 2x L2: 50-60 MB on H100/H200)
    copy_bytes: int
    # (name, experts, hidden, width, tokens, top-k, activation dtype) of the correctness cases
    moe_cases: tuple
    # (name, batch, tree width, heads, kv_lora, rope, cache slots, page size (0: contiguous), dtype)
    attn_cases: tuple
    moe_shape: tuple                 # (experts, hidden, width, top-k) of the timing section
    moe_tokens: tuple
    moe_dtype: object
    attn_dims: tuple                 # (heads, kv_lora, rope)
    attn_widths: tuple
    attn_caches: tuple
    attn_dtype: object
    round_layers: int
    round_budgets: tuple             # 0 = plain AR round
    round_impls: tuple
    round_context: int               # cache slots of the round's rows
    round_rounds: tuple              # (r1, r2): round time = (T(r2) - T(r1)) / (r2 - r1)


FULL = Plan(
    reps=10, chain=4, flush_bytes=256 << 20, copy_bytes=2 << 30,
    moe_cases=(("tiny_f32", 8, 256, 64, 13, 3, F32),                  # padded F: 64 -> one 256 chunk
               ("k26_tp8_slice_bf16_t1", 32, 7168, 256, 1, 8, BF16),  # decode (32 of 384 experts: the oracle is
               ("k26_tp8_slice_bf16_t64", 32, 7168, 256, 64, 8, BF16)),  # dense over all experts)
    attn_cases=(("tiny_f32", 3, 6, 4, 32, 16, 70, 0, F32),
                ("k26_tree17_s4096_bf16", 1, 17, 16, 512, 64, 4096, 0, BF16),
                ("k26_tree17_paged64_bf16", 2, 17, 16, 512, 64, 4096, 64, BF16),
                ("k26_decode_s32768_bf16", 1, 1, 16, 512, 64, 32768, 0, BF16)),
    moe_shape=(384, 7168, 256, 8), moe_tokens=(1, 8, 16, 32, 64), moe_dtype=BF16,
    attn_dims=(16, 512, 64), attn_widths=(1, 5, 17, 33, 65), attn_caches=(4096, 32768), attn_dtype=BF16,
    round_layers=3, round_budgets=(16, 0), round_impls=("auto", "pallas", "xla"), round_context=4096,
    round_rounds=(3, 13),
)

TINY = Plan(
    reps=2, chain=2, flush_bytes=0, copy_bytes=16 << 20,
    moe_cases=(("tiny_f32", 8, 256, 64, 13, 3, F32),
               ("small_f32", 16, 512, 256, 8, 4, F32),
               ("tiny_bf16", 4, 256, 128, 13, 2, BF16)),         # bf16: the Mosaic GPU kernel runs too
    attn_cases=(("tiny_f32", 3, 6, 4, 32, 16, 70, 0, F32),
                ("small_tree17_f32", 1, 17, 4, 64, 16, 128, 0, F32),
                ("small_tree17_paged16_f32", 2, 17, 4, 64, 16, 128, 16, F32),
                ("small_tree5_paged64_bf16", 2, 5, 2, 128, 64, 128, 64, BF16)),   # bf16: the Mosaic kernel too
    moe_shape=(16, 512, 256, 4), moe_tokens=(1, 8), moe_dtype=F32,
    attn_dims=(4, 64, 16), attn_widths=(1, 5, 17), attn_caches=(128,), attn_dtype=F32,
    # two layers: the dense first layer and one MoE layer, every kind of layer the round has (the CPU smoke run
    # compiles each layer on its own, so a third layer only adds compile time)
    round_layers=2, round_budgets=(0, 4), round_impls=("xla", "pallas"), round_context=128,
    round_rounds=(2, 12),
)


def tolerance(dtype, on_gpu: bool) -> float:
    """Max relative error (max|y - ref| / max|ref|) a correct kernel stays under. bf16: inputs and the MoE's
    hidden h / the attention's probabilities are rounded to bf16 (the unit tests use 2e-2 / 3e-2). float32:
    exact up to summation order on a CPU; on a GPU float32 dots may run as TF32 (10-bit mantissa). A wrong
    kernel (a nibble, a scale group, a mask bit, a split) is off by O(0.1-1)."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return 3e-2
    return 1e-2 if on_gpu else 1e-4


# ---------------------------------------------------------------------------------------------------------------
# timing, budget, records


def rng_key(seed: int):
    """Keys for the random inputs and weights: XLA's RngBitGenerator ("unsafe_rbg") compiles in a fraction of
    threefry's time (a 3-layer K2.6 weight set: one program) and fills memory at bandwidth."""
    return jax.random.key(seed, impl="unsafe_rbg")


def timed(fn, *args, reps: int) -> dict:
    """Warm-up call (compile included: first_call_s), a second untimed call, then ``reps`` calls each ended by
    block_until_ready: best and median wall time in ms."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return dict(first_call_s=round(first, 3), best_ms=1e3 * min(times), median_ms=1e3 * float(np.median(times)),
                reps=reps)


def input_sets(plan: Plan, bytes_per_set: float) -> int:
    """How many input sets the timed calls cycle through: enough that the data one program reads was evicted
    from L2 by the others before it comes round again (at least 2, at most 16)."""
    return int(max(2, min(16, -(-plan.flush_bytes // max(int(bytes_per_set), 1)))))


def timed_cycling(fn, sets, *, reps: int) -> dict:
    """``timed`` with every call on the next of ``sets`` (argument tuples of one shape: one compile)."""
    it = itertools.cycle(sets)
    return timed(lambda: fn(*next(it)), reps=reps)


def chain(op, k: int):
    """A jitted program ``run(shared, *stacked)`` of ``k`` calls ``op(shared, *inputs_i)`` run one after another:
    inputs_i are the i-th slices of the stacked inputs; ``shared`` (the weights) is passed, never captured as a
    constant. Call i+1 adds ``z`` (always zero, unknown to XLA: ``sum(y_i) > 3e38``) to its first float input and to
    its integer inputs, so no call can be hoisted, fused with, or run alongside another."""

    def run(shared, *stacked):
        z = jnp.zeros((), bool)
        acc = jnp.zeros((), F32)
        for i in range(k):
            args, float_done = [], False
            for a in stacked:
                a = a[i]
                is_float = jnp.issubdtype(a.dtype, jnp.floating)
                if jnp.issubdtype(a.dtype, jnp.integer) or (is_float and not float_done):
                    float_done |= is_float
                    a = a + z.astype(a.dtype)
                args.append(a)
            s = jnp.sum(op(shared, *args).astype(F32))
            z = s > 3e38
            acc = acc + s
        return acc

    return jax.jit(run)


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need_s: float) -> bool:
        return self.left() >= need_s


def rel_err(y, ref) -> tuple[float, float]:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    if y.shape != ref.shape:
        raise ValueError(f"shape {y.shape} != reference {ref.shape}")
    if not np.isfinite(y).all():
        return float("inf"), float("inf")
    err = float(np.abs(y - ref).max())
    return err, err / max(float(np.abs(ref).max()), 1e-30)


def free(*trees):
    """Delete the device buffers of the given trees now (big arrays between sections)."""
    for tree in trees:
        for a in jax.tree.leaves(tree):
            if isinstance(a, jax.Array) and not a.is_deleted():
                a.delete()
    gc.collect()


# ---------------------------------------------------------------------------------------------------------------
# inputs


def random_experts(key, e: int, d: int, f: int):
    """Random INT4 words and small positive scales, made on the device (bench/int4_moe.py's; valid kernel
    layout since every 4-bit pattern is a value in [-8, 7]). ``f`` is a multiple of 256, ``d`` of 256."""
    from bench.int4_moe import random_experts as make
    return make(key, e, d, f)


def random_routing(key, t: int, e: int, k: int):
    from bench.int4_moe import random_routing as make
    return make(key, t, e, k)


def tree_mask(rng, b: int, t: int) -> jax.Array:
    """[b, t, t] ancestor masks of random trees (node i's parent drawn from 0..i-1; node 0 the root)."""
    out = np.zeros((b, t, t), bool)
    for r in range(b):
        m = np.eye(t, dtype=bool)
        for i in range(1, t):
            m[i] |= m[int(rng.integers(0, i))]
        out[r] = m
    return jnp.asarray(out)


def attention_inputs(rng, b, t, h, r, p, s, page, dtype):
    """q_lat, q_pe, kv (contiguous [b, s, r+p] or a shuffled page pool), lengths, mask, page_table (or None)."""
    n = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    q, qpe = n(b, t, h, r) * 0.3, n(b, t, h, p) * 0.3
    lengths = jnp.asarray(np.linspace(s // 4, s - t - 1, b).astype(np.int32) if b > 1 else [s - t - 1 - s // 8],
                          jnp.int32)
    mask = tree_mask(rng, b, t) if t > 1 else jnp.ones((b, 1, 1), bool)
    if not page:
        return q, qpe, n(b, s, r + p), lengths, mask, None
    per_row = s // page
    perm = rng.permutation(b * per_row + 3)[: b * per_row]           # 3 spare pages nobody maps
    return q, qpe, n(b * per_row + 3, page, r + p), lengths, mask, jnp.asarray(perm.reshape(b, per_row), jnp.int32)


# ---------------------------------------------------------------------------------------------------------------
# 1. kernels against their references


def check_kernels(plan: Plan, ctx: dict, rec: dict) -> None:
    from kimi_jax.cache import rows_view
    from kimi_jax.ops.int4_moe.api import int4_moe
    from kimi_jax.ops.int4_moe.mosaic_gpu import int4_moe_mosaic
    from kimi_jax.ops.int4_moe.reference import int4_moe_reference
    from kimi_jax.ops import registry
    from kimi_jax.ops.tree_attention.api import TREE_ATTENTION, AttentionCall, latent_attention
    from kimi_jax.ops.tree_attention.reference import dense_reference

    on_gpu, interpret = ctx["on_gpu"], not ctx["on_gpu"]
    cases = rec.setdefault("cases", [])
    moe = jax.jit(int4_moe, static_argnames=("impl", "interpret", "block_m"))
    mosaic = jax.jit(int4_moe_mosaic, static_argnames=("interpret",))
    for name, e, d, f, t, k, dtype in plan.moe_cases:
        if not ctx["budget"].allows(15):
            cases.append(dict(kernel="int4_moe", case=name, status="skipped: budget"))
            continue
        key = jax.random.fold_in(rng_key(1), len(cases))
        if d % 256 == 0 and f % 256 == 0:
            ex = random_experts(key, e, d, f)
        else:                           # dims the layout pads (tiny): quantize float weights instead
            from kimi_jax.ops.int4_format import Int4Experts
            rng = np.random.default_rng(len(cases))
            w = lambda *s, rng=rng: (rng.normal(size=s) * 0.05).astype(np.float32)  # noqa: E731
            ex = jax.tree.map(jnp.asarray, Int4Experts.quantize(w(e, d, f), w(e, d, f), w(e, f, d)))
        idx, wts = random_routing(jax.random.fold_in(key, 7), t, e, k)
        x = jax.random.normal(jax.random.fold_in(key, 8), (t, d), F32).astype(dtype)
        ref = np.asarray(int4_moe_reference(x.astype(F32), idx, wts, ex))     # eager: it exports via numpy
        outs = {}
        for impl in ("pallas", "xla") + (("mosaic",) if jnp.dtype(dtype).itemsize == 2 else ()):   # wgmma: 16-bit
            row = dict(kernel="int4_moe", case=name, impl=impl, experts=e, hidden=d, width=f, tokens=t, topk=k,
                       dtype=jnp.dtype(dtype).name, tol=tolerance(dtype, on_gpu))
            try:
                y = mosaic(x, idx, wts, ex, interpret=interpret) if impl == "mosaic" else \
                    moe(x, idx, wts, ex, impl=impl, interpret=interpret if impl == "pallas" else None)
                outs[impl] = np.asarray(y)
                row["max_abs_err"], row["max_rel_err"] = rel_err(outs[impl], ref)
                row["ok"] = row["max_rel_err"] <= row["tol"]
            except Exception as exc:     # noqa: BLE001  (one case's failure is a result)
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
            cases.append(row)
        for impl in ("pallas", "mosaic"):
            if impl in outs and "xla" in outs:
                next(c for c in cases[::-1] if c["impl"] == impl)["max_rel_diff_vs_xla"] = \
                    rel_err(outs[impl], outs["xla"])[1]
        free(ex)

    attn = jax.jit(latent_attention, static_argnames=("scale", "impl", "interpret", "block_q", "block_k",
                                                      "num_splits", "out_dtype"))
    ref_fn = jax.jit(dense_reference, static_argnames=("scale",))
    for name, b, t, h, r, p, s, page, dtype in plan.attn_cases:
        if not ctx["budget"].allows(15):
            cases.append(dict(kernel="tree_attention", case=name, status="skipped: budget"))
            continue
        rng = np.random.default_rng(len(cases))
        q, qpe, kv, lengths, mask, table = attention_inputs(rng, b, t, h, r, p, s, page, dtype)
        scale = float((r // 4 + p) ** -0.5)
        ref = np.asarray(ref_fn(q, qpe, rows_view(kv, table), lengths, mask, scale=scale))
        outs = {}
        call = AttentionCall(b, t, h, r, p, s, page, jnp.dtype(dtype).name)
        mosaic_takes = TREE_ATTENTION.refusal("mosaic", call, registry.gpu(not on_gpu)) is None
        for impl in ("pallas", "xla") + (("mosaic",) if mosaic_takes else ()):
            row = dict(kernel="tree_attention", case=name, impl=impl, batch=b, width=t, heads=h, kv_lora=r, rope=p,
                       slots=s, page_size=page, lengths=np.asarray(lengths).tolist(), dtype=jnp.dtype(dtype).name,
                       tol=tolerance(dtype, on_gpu))
            try:
                y = attn(q, qpe, kv, lengths, mask, scale=scale, impl=impl, out_dtype=F32, page_table=table,
                         interpret=interpret if impl != "xla" else None)
                outs[impl] = np.asarray(y)
                row["max_abs_err"], row["max_rel_err"] = rel_err(outs[impl], ref)
                row["ok"] = row["max_rel_err"] <= row["tol"]
            except Exception as exc:     # noqa: BLE001
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
            cases.append(row)
        for impl in ("pallas", "mosaic"):
            if impl in outs and "xla" in outs:
                next(c for c in cases[::-1] if c["impl"] == impl)["max_rel_diff_vs_xla"] = \
                    rel_err(outs[impl], outs["xla"])[1]
        free(kv)
    check_projections(ctx, cases)
    done = [c for c in cases if "ok" in c]
    rec["passed"] = sum(c["ok"] for c in done)
    rec["checked"] = len(done)


def check_projections(ctx: dict, cases: list) -> None:
    """The latent projection, the absorbed queries and SwiGLU (kimi_jax.ops.latent, ops.swiglu): each kernel
    against its jnp reference at K2.6's TP-8 widths for a 17-token verify (bf16; the tiny model's widths on a
    CPU, interpret mode)."""
    from kimi_jax.ops.latent.api import absorbed_queries, latent_projection
    from kimi_jax.ops.latent.reference import latent_reference, queries_reference
    from kimi_jax.ops.swiglu.api import swiglu
    from kimi_jax.ops.swiglu.reference import swiglu_reference

    on_gpu = ctx["on_gpu"]
    t, d, q, r, p, h, f = (17, 7168, 1536, 512, 64, 8, 256) if on_gpu else (5, 64, 48, 32, 16, 4, 32)
    rng = np.random.default_rng(5)
    arr = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, BF16)  # noqa: E731
    inv_freq = jnp.asarray(1.0 / 50000 ** (np.arange(0, p, 2) / p), F32)
    pos = jnp.asarray(rng.integers(0, 4096, (1, t)), jnp.int32)
    kw = dict(eps=1e-6, latent_eps=1e-6)
    latent_args = (arr(1, t, d), arr(d) + 1, arr(d, q, scale=d ** -0.5), arr(d, r + p, scale=d ** -0.5),
                   arr(q) + 1, arr(r) + 1, pos, inv_freq)
    query_args = (arr(1, t, q), arr(q, h, 128 + p if on_gpu else 16 + p, scale=q ** -0.5),
                  arr(r, h, 256 if on_gpu else 32, scale=0.1), pos, inv_freq)
    swiglu_args = (arr(t, d), arr(d, f, scale=d ** -0.5), arr(d, f, scale=d ** -0.5), arr(f, d, scale=f ** -0.5))
    for name, fn, ref, args in (
            ("latent_projection", functools.partial(latent_projection, **kw), functools.partial(latent_reference, **kw),
             latent_args),
            ("absorbed_queries", absorbed_queries, queries_reference, query_args),
            ("swiglu", swiglu, swiglu_reference, swiglu_args)):
        row = dict(kernel=name, case=f"t{t}_d{d}", impl="pallas", dtype="bfloat16", tol=tolerance(BF16, on_gpu))
        try:
            got = jax.tree.leaves(jax.jit(functools.partial(fn, impl="pallas", interpret=not on_gpu))(*args))
            want = jax.tree.leaves(ref(*args))
            errs = [rel_err(np.asarray(g, np.float32), np.asarray(w, np.float32)) for g, w in zip(got, want)]
            row["max_abs_err"], row["max_rel_err"] = max(e[0] for e in errs), max(e[1] for e in errs)
            row["ok"] = row["max_rel_err"] <= row["tol"]
        except Exception as exc:     # noqa: BLE001  (one case's failure is a result)
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
        cases.append(row)


# ---------------------------------------------------------------------------------------------------------------
# 2. copy bandwidth


def copy_bandwidth(plan: Plan, ctx: dict, rec: dict) -> None:
    a = jnp.ones((plan.copy_bytes // 4,), F32)
    t = timed(jax.jit(lambda a: a + 1.0), a, reps=plan.reps)
    moved = 2 * a.nbytes
    rec.update(bytes_moved=moved, array_bytes=a.nbytes, op="a + 1.0 (float32; read + write counted)", **t,
               gb_per_s=moved / (t["best_ms"] * 1e-3) / 1e9)
    ctx["copy_gb_per_s"] = rec["gb_per_s"]
    free(a)


def all_reduce_latency(plan: Plan, ctx: dict, rec: dict) -> None:
    """us per all-reduce of a round's per-layer message, with XLA's one-shot kernel and with NCCL."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from kimi_jax.config import Runtime, compile_options
    n = jax.device_count()
    if n < 2:
        rec["status_note"] = f"skipped: {n} device (an all-reduce needs 2+)"
        return
    mesh, k, hidden = Mesh(np.array(jax.devices()), ("x",)), 32, 7168

    def chained(x):          # x: [n * tokens, hidden], one row block per device; each sum feeds the next
        def body(_, a):
            return jax.lax.pcast((jax.lax.psum(a, "x") * (1.0 / n)).astype(a.dtype), "x", to="varying")
        return jax.shard_map(lambda a: jax.lax.fori_loop(0, k, body, a), mesh=mesh, in_specs=P("x"),
                             out_specs=P("x"))(x)

    rec.update(devices=n, chained=k, hidden=hidden, rows=[])
    backend = jax.default_backend()
    for tokens in (1, 17, 65):
        x = jax.device_put(jnp.ones((n * tokens, hidden), BF16), NamedSharding(mesh, P("x")))
        row = dict(tokens=tokens, message_bytes=tokens * hidden * 2)
        for one_shot in (True, False):
            compiled = jax.jit(chained).lower(x).compile(compile_options(backend, Runtime(one_shot_all_reduce=one_shot)))
            t = timed(compiled, x, reps=plan.reps)
            row["one_shot_on" if one_shot else "one_shot_off"] = dict(per_call_us=1e3 * t["best_ms"] / k, **t)
        rec["rows"].append(row)
        free(x)


# ---------------------------------------------------------------------------------------------------------------
# 3. INT4 MoE bytes/s


def _tokamax_peer():
    try:
        import tokamax
    except Exception as exc:  # noqa: BLE001
        return None, f"skipped: import tokamax failed ({type(exc).__name__}: {exc})"[:200]
    return tokamax, None


def moe_bandwidth(plan: Plan, ctx: dict, rec: dict) -> None:
    from kimi_jax.ops.int4_moe.api import int4_moe
    from kimi_jax.ops.int4_moe.mosaic_gpu import Tiles, int4_moe_mosaic
    from kimi_jax.ops.int4_moe.routing import combine, sort_by_expert

    e, d, f, k = plan.moe_shape
    interpret, n = not ctx["on_gpu"], plan.chain
    key = rng_key(3)
    ex = random_experts(key, e, d, f)
    rec.update(experts=e, hidden=d, width=f, topk=k, dtype=jnp.dtype(plan.moe_dtype).name, chain=n,
               expert_bytes=ex.expert_nbytes, layer_bytes=ex.nbytes,
               bytes_rule="INT4 words + bf16 scales of the experts each call touches (unique ids), mean over the "
                          "calls; per-call time = chained program / chain; every call routes anew and the timed "
                          "programs cycle through input_sets sets, so L2 does not serve one call's experts to the "
                          "next")
    tokamax, note = _tokamax_peer()
    rec["tokamax"] = note or f"tokamax {getattr(tokamax, '__version__', '?')}: ragged_dot over bf16 experts"
    bf16_w = None
    rows = rec.setdefault("rows", [])
    copy = ctx.get("copy_gb_per_s")
    for t in plan.moe_tokens:
        if not ctx["budget"].allows(20):
            rows.append(dict(tokens=t, status="skipped: budget"))
            continue
        kt = jax.random.fold_in(key, t)
        per_call = min(e, t * k) * ex.expert_nbytes
        sets = []
        for j in range(input_sets(plan, n * per_call)):
            routs = [random_routing(jax.random.fold_in(kt, 100 * j + i), t, e, k) for i in range(n)]
            sets.append((jax.random.normal(jax.random.fold_in(kt, 10_000 + j), (n, t, d), F32).astype(plan.moe_dtype),
                         jnp.stack([r[0] for r in routs]), jnp.stack([r[1] for r in routs])))
        unique = float(np.mean([np.unique(np.asarray(i)).size for _, idx, _ in sets for i in idx]))
        need = unique * ex.expert_nbytes
        row = dict(tokens=t, unique_experts=unique, bytes_per_call=need, input_sets=len(sets))
        ops = {impl: functools.partial(int4_moe, impl=impl, interpret=interpret if impl == "pallas" else None)
               for impl in ("pallas", "xla")}
        if ctx["on_gpu"]:             # interpret mode times nothing useful; on a GPU it is the decision's number
            ops["mosaic"] = functools.partial(int4_moe_mosaic, interpret=False)
            # the default is the swapped tiling below 64 rows a touched expert; 64-row blocks for comparison
            ops["mosaic_bm64"] = functools.partial(int4_moe_mosaic, interpret=False, tiles=Tiles(block_m=64))
            # gate/up without split K: at a token or two its grid is 32-64 CTAs of 28 chunks each, against a
            # cluster of 7 splits a tile that sums in the kernel (docs/mosaic_gpu.md): whether splitting pays
            ops["mosaic_no_split"] = functools.partial(int4_moe_mosaic, interpret=False,
                                                       tiles=Tiles(splits_gate_up=1))
        for impl, op in ops.items():
            try:
                r = timed_cycling(chain(lambda ex, x, i, wt, op=op: op(x, i, wt, ex), n),
                                  [(ex, *a) for a in sets], reps=plan.reps)
                per = r["best_ms"] / n
                row[impl] = dict(r, per_call_us=1e3 * per, gb_per_s=need / (per * 1e-3) / 1e9)
                if copy:
                    row[impl]["frac_of_copy"] = row[impl]["gb_per_s"] / copy
            except Exception as exc:  # noqa: BLE001
                row[impl] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
        if tokamax is not None:
            try:
                if bf16_w is None:
                    bf16_w = _bf16_experts(ex)
                peer = functools.partial(_ragged_moe, tokamax.ragged_dot, e, sort_by_expert, combine)
                r = timed_cycling(chain(peer, n), [(bf16_w, *a) for a in sets], reps=plan.reps)
                per = r["best_ms"] / n
                need16 = unique * sum(a.nbytes for a in bf16_w) / e
                row["tokamax_bf16"] = dict(r, per_call_us=1e3 * per, bytes_per_call=need16,
                                           gb_per_s=need16 / (per * 1e-3) / 1e9)
            except Exception as exc:  # noqa: BLE001
                row["tokamax_bf16"] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
        rows.append(row)
        free(sets)
    free(ex, bf16_w)


def _bf16_experts(ex):
    """bf16 copies of the experts for a dense-weight peer: w13 [E, D, 2F] (gate | up), w2 [E, F, D]."""
    from kimi_jax.ops.int4_format import dequantize_kernel_layout
    deq = jax.jit(lambda w, s: dequantize_kernel_layout(w, s).astype(BF16))
    gate, up = deq(ex.w13[:, 0], ex.s13[:, 0]), deq(ex.w13[:, 1], ex.s13[:, 1])
    w13 = jnp.concatenate([gate, up], axis=-1)
    free(gate, up)
    return w13, deq(ex.w2, ex.s2)


def _ragged_moe(ragged_dot, e, sort_by_expert, combine, weights, x, idx, wt):
    """Routed SwiGLU with a grouped matmul over expert-sorted rows (bm = 1: no padding rows)."""
    w13, w2 = weights
    t, k = idx.shape
    routing = sort_by_expert(idx, e, 1)
    rows = x[jnp.minimum(routing.row_pair // k, t - 1)]
    sizes = jnp.zeros((e,), jnp.int32).at[idx.reshape(-1)].add(1)
    gu = ragged_dot(rows.astype(BF16), w13, sizes).astype(F32)
    f = w2.shape[1]
    h = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(BF16)
    return combine(ragged_dot(h, w2, sizes).astype(F32), routing, wt)


# ---------------------------------------------------------------------------------------------------------------
# 4. tree attention vs width


def attention_widths(plan: Plan, ctx: dict, rec: dict) -> None:
    from kimi_jax.ops import registry
    from kimi_jax.ops.tree_attention.api import TREE_ATTENTION, AttentionCall, latent_attention

    h, r, p = plan.attn_dims
    interpret, n = not ctx["on_gpu"], plan.chain
    itemsize = jnp.dtype(plan.attn_dtype).itemsize
    rec.update(heads=h, kv_lora=r, rope=p, dtype=jnp.dtype(plan.attn_dtype).name, batch=1, chain=n,
               bytes_rule="committed latent rows (lengths x (kv_lora + rope) x itemsize) / per-call time; the "
                          "chain's calls read different caches, and the timed programs cycle through input_sets "
                          "sets of them (L2 does not serve one call's cache to the next)")
    rows = rec.setdefault("rows", [])
    scale = float((128 + p) ** -0.5)
    rng = np.random.default_rng(4)
    key = rng_key(4)
    for s in plan.attn_caches:
        n_sets = input_sets(plan, n * s * (r + p) * itemsize)
        kvs = [jax.random.normal(jax.random.fold_in(key, 1000 * s + j), (n, 1, s, r + p), F32).astype(plan.attn_dtype)
               for j in range(n_sets)]
        for t in plan.attn_widths:
            if not ctx["budget"].allows(15):
                rows.append(dict(slots=s, width=t, status="skipped: budget"))
                continue
            q = jnp.asarray(rng.normal(size=(n, 1, t, h, r)) * 0.3, plan.attn_dtype)
            qpe = jnp.asarray(rng.normal(size=(n, 1, t, h, p)) * 0.3, plan.attn_dtype)
            lengths = jnp.full((n, 1), s - t - 1, jnp.int32)
            mask = jnp.stack([tree_mask(rng, 1, t) for _ in range(n)])
            need = (s - t - 1) * (r + p) * itemsize
            row = dict(slots=s, width=t, lengths=s - t - 1, bytes_per_call=need, input_sets=n_sets)
            call = AttentionCall(1, t, h, r, p, s, 0, jnp.dtype(plan.attn_dtype).name)
            mosaic_takes = TREE_ATTENTION.refusal("mosaic", call, registry.gpu(interpret)) is None
            impls = ("pallas", "xla") + (("mosaic",) if mosaic_takes else ())
            for impl in impls:
                op = functools.partial(latent_attention, scale=scale, impl=impl,
                                       interpret=interpret if impl != "xla" else None)
                try:
                    res = timed_cycling(chain(lambda _, q, qpe, kv, ln, m, op=op: op(q, qpe, kv, ln, m), n),
                                        [((), q, qpe, kv, lengths, mask) for kv in kvs], reps=plan.reps)
                    per = res["best_ms"] / n
                    row[impl] = dict(res, per_call_us=1e3 * per, gb_per_s=need / (per * 1e-3) / 1e9)
                except Exception as exc:  # noqa: BLE001
                    row[impl] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
            rows.append(row)
        free(kvs)


# ---------------------------------------------------------------------------------------------------------------
# 5. one DDTree round of a few K2.6-shaped layers, with its stage profile


@functools.partial(jax.jit, static_argnums=(0, 2))
def random_params(cfg, key, dtype):
    """Every weight of ``cfg`` drawn on the device in one program (init_params quantizes float experts on the
    host, far too slow at K2.6 size): normal / sqrt(fan_in) for matrices, ones / zeros as the table says, random
    INT4 words and scales ~ 1 / (4 sqrt(fan_in)) for the routed experts."""
    from kimi_jax.model.params import ParamSpec, param_specs

    specs, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))

    def leaf(k, s: ParamSpec):
        dt = jnp.dtype(s.dtype or dtype)
        if s.init == "ones":
            return jnp.ones(s.shape, dt)
        if s.init == "zeros":
            return jnp.zeros(s.shape, dt)
        if s.init == "int4":
            if dt == jnp.int32:
                return jax.random.bits(k, s.shape, jnp.uint32).view(jnp.int32)
            fan_in = 32 * s.shape[-2]                      # scale rows are groups of 32 inputs
            return (jax.random.uniform(k, s.shape, F32, 0.5, 1.5) / (4 * fan_in ** 0.5)).astype(dt)
        return (jax.random.normal(k, s.shape, F32) / max(s.fan_in, 1) ** 0.5).astype(dt)

    return jax.tree.unflatten(treedef, [leaf(jax.random.fold_in(key, i), s) for i, s in enumerate(specs)])


def round_setup(plan: Plan, ctx: dict):
    """(target config, drafter config, dtype) of the round: the K2.6 preset cut to a few layers (tiny: TINY)."""
    from kimi_jax.config import preset
    from kimi_jax.decoding import drafter as dflash
    n = plan.round_layers
    if ctx["tiny"]:
        cfg = preset("tiny").replace(num_hidden_layers=n, eos_token_ids=(), name="tiny")
        dcfg = dflash.DrafterConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                    vocab_size=cfg.vocab_size, block_size=5, mask_token_id=cfg.vocab_size - 1,
                                    target_layer_ids=(0, n - 1))
        return cfg, dcfg, F32
    cfg = preset("kimi-k2.6").replace(num_hidden_layers=n, first_k_dense_replace=1, eos_token_ids=(),
                                      name=f"kimi-k2.6-{n}-layers")
    dcfg = dflash.DrafterConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=8,
                                num_key_value_heads=1, head_dim=128, intermediate_size=2048,
                                vocab_size=cfg.vocab_size, block_size=16, mask_token_id=cfg.vocab_size - 2,
                                target_layer_ids=(0, n - 1), rope_theta=cfg.rope_theta)
    return cfg, dcfg, BF16


def steady_state(model, request, lengths: int):
    """The engine state ``prefill`` would give for ``request`` (structure from ``jax.eval_shape``), filled with
    zeros and with every row's committed length set to ``lengths``: steady rounds from a full cache without
    compiling and running a prefill (the round's work does not depend on the cache's values)."""
    from kimi_jax.decoding import engine
    shapes, _ = jax.eval_shape(functools.partial(engine.prefill, **request.statics), model.inputs(request))

    @jax.jit
    def make():
        def fill(s):
            if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
                return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
            return jnp.zeros(s.shape, s.dtype)
        state = jax.tree.map(fill, shapes)
        return state.replace(cache=state.cache.replace(lengths=jnp.full(state.cache.lengths.shape, lengths,
                                                                        jnp.int32)))

    return make()


def stage_profile(compiled, run, rounds: int) -> dict:
    """Share of the round's time per stage, from one traced run: HLO instruction -> stage through the compiled
    HLO's op_name scopes (bench/round_profile.py's ``stage_of_instructions``). GPU traces: device kernel events,
    named by their ``hlo_op``; CPU traces: self time of host events (round_profile's ``self_times``)."""
    import tempfile

    from bench.round_profile import STAGES, self_times, stage_of_instructions
    stage_of = stage_of_instructions(compiled.as_text())
    lookup = dict(stage_of)
    lookup.update({k.replace(".", "_"): v for k, v in stage_of.items()})      # GPU kernels: '.' -> '_'
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(run(rounds))
        jax.profiler.stop_trace()
        path = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))[-1]
        with gzip.open(path) as fh:
            trace = json.load(fh)
        events = trace.get("traceEvents", [])
        meta = lambda kind: {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))  # noqa: E731
                             for e in events if e.get("ph") == "M" and e.get("name") == kind}
        gpu_pids = {pid for (pid, _), name in meta("process_name").items() if "GPU" in name}
        threads = {k: v for k, v in meta("thread_name").items() if k[0] in gpu_pids}
        # Device planes hold the kernels on "Stream #n" lines and derived lines ("XLA Ops", "XLA Modules")
        # that span them; count the stream lines only (kernels on a stream do not nest: durations are self times).
        streams = {k for k, v in threads.items() if v.lower().startswith("stream")}
        per_stage, unmapped = {}, {}
        if gpu_pids:
            source = "device kernel events on stream lines, named by hlo_op"
            totals = {}
            for e in events:
                if e.get("ph") == "X" and e.get("pid") in gpu_pids and (not streams or (e["pid"], e.get("tid"))
                                                                        in streams):
                    name = str(e.get("args", {}).get("hlo_op") or e["name"])
                    totals[name] = totals.get(name, 0.0) + float(e.get("dur", 0.0))
        else:
            source = "host events, self time"
            totals = self_times(d)
    for name, us in totals.items():
        if name.startswith("$"):         # the Python tracer's frames (host waiting in Python), not the program
            continue
        base = name.split(" ")[0]
        stage = lookup.get(base)
        if stage is None:
            unmapped[base] = unmapped.get(base, 0.0) + us
        else:
            per_stage[stage] = per_stage.get(stage, 0.0) + us
    mapped = sum(per_stage.values())
    total = mapped + sum(unmapped.values())
    top = sorted(unmapped.items(), key=lambda kv: -kv[1])[:8]
    return dict(source=source, traced_rounds=rounds, mapped_us=mapped, total_us=total,
                device_lines=sorted(set(threads.values()))[:12] if gpu_pids else [],
                coverage=mapped / total if total else 0.0,
                shares={s: per_stage.get(s, 0.0) / mapped if mapped else 0.0 for s in STAGES + ("other",)},
                top_unmapped_us={k: round(v, 1) for k, v in top})


def ddtree_round(plan: Plan, ctx: dict, rec: dict) -> None:
    import kimi_jax
    from kimi_jax.config import Runtime, compile_options
    from kimi_jax.decoding import drafter as dflash

    cfg, dcfg, dtype = round_setup(plan, ctx)
    rec.update(config=cfg.name, layers=cfg.num_hidden_layers, dense_layers=cfg.first_k_dense_replace,
               hidden=cfg.hidden_size, experts=cfg.n_routed_experts, moe_width=cfg.moe_intermediate_size,
               heads=cfg.num_attention_heads, vocab=cfg.vocab_size, dtype=jnp.dtype(dtype).name,
               drafter=dict(layers=dcfg.num_hidden_layers, heads=dcfg.num_attention_heads,
                            ffn=dcfg.intermediate_size, block_size=dcfg.block_size, taps=list(dcfg.target_layer_ids)),
               context_slots=plan.round_context,
               state="prefill's state shape, zeros, committed lengths = slots - nodes - 2 (no prefill run)",
               method="bench.steady.steady_rounds_program: ms/round = (T(r2) - T(r1)) / (r2 - r1), best of reps each; "
                      "stage ms = stage share of the traced run x ms/round")
    rows = rec.setdefault("rows", [])
    need = 15 if ctx["tiny"] else 60
    r1, r2 = plan.round_rounds
    dparams = jax.jit(functools.partial(dflash.init_params, dcfg, dtype=dtype))(rng_key(6))
    for impl in plan.round_impls:
        if not ctx["budget"].allows(need):
            rows.extend(dict(impl=impl, budget=b, status="skipped: budget") for b in plan.round_budgets)
            continue
        params = random_params(cfg, rng_key(5), dtype)
        rec.setdefault("weight_bytes", sum(a.nbytes for a in jax.tree.leaves(params)))
        model = kimi_jax.Model(cfg, params, drafter=dflash.Drafter(dcfg, dparams),
                               runtime=Runtime(moe_impl=impl, attn_impl=impl, context=plan.round_context))
        cp = model.compute_params
        # The programs run on compute_params (per-layer buffers): the stacked originals they do not share can
        # go, keeping only their shapes for the host-side checks (halves the round's memory at K2.6 size).
        model.params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        shared = {id(a) for a in jax.tree.leaves(cp)}
        free([a for a in jax.tree.leaves(params) if id(a) not in shared])
        del params
        try:
            # every budget with kimi_jax's GPU compile options (graph loops, XLA's split-K), then the largest
            # without graph loops and without split-K: what CUDA-graph loops and branches save per round, and
            # whether split-K's extra reductions pay at these widths (docs/gpu_overhead.md)
            default = model.runtime
            runs = [(b, default) for b in plan.round_budgets]
            backend = jax.default_backend()
            for variant in (default.replace(graph_loops=False), default.replace(split_k=False)):
                if compile_options(backend, variant) != compile_options(backend, default):
                    runs.append((max(plan.round_budgets), variant))     # off a GPU they are one program
            for budget, rt in runs:
                row = dict(impl=impl, budget=budget, method="ar" if budget == 0 else "ddtree",
                           verify_width=budget + 1, graph_loops=rt.graph_loops, split_k=rt.split_k)
                rows.append(row)
                if not ctx["budget"].allows(need):
                    row["status"] = "skipped: budget"
                    continue
                try:
                    _one_round(model, cp, plan, row, budget, r1, r2, rt)
                except Exception as exc:  # noqa: BLE001
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600],
                               traceback=traceback.format_exc()[-1500:])
        finally:
            free(cp)
            del model
            gc.collect()
    free(dparams)


def _one_round(model, cp, plan, row, budget, r1, r2, rt):
    from bench.steady import steady_rounds_program
    from kimi_jax.config import compile_options
    method = "ar" if budget == 0 else "ddtree"
    prompt = [[1] * 16]
    max_new = plan.round_context - 16 - budget - 2      # prompt + max_new + tree + 1 = the slots, a power of two
    request = model.prepare(prompt, max_new, method, budget if budget else None)
    assert request.max_len == plan.round_context, (request.max_len, plan.round_context)
    lengths = request.max_len - request.spec.nodes - 2
    state = steady_state(model, request, lengths)
    dp = model.drafter_params
    force = np.int32(len(request.spec.widths) - 1 if request.spec.widths else -1)
    t0 = time.perf_counter()
    options = compile_options(jax.default_backend(), rt)
    compiled = steady_rounds_program.lower(cp, dp, state, force, np.int32(1), spec=request.spec).compile(options)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    run = lambda r: compiled(cp, dp, state, force, np.int32(r))  # noqa: E731
    t1, t2 = (timed(run, np.int32(r), reps=plan.reps) for r in (r1, r2))
    row.update(max_len=request.max_len, lengths=lengths, rounds=[r1, r2],
               round_ms=(t2["best_ms"] - t1["best_ms"]) / (r2 - r1), run_ms={str(r1): t1["best_ms"],
                                                                             str(r2): t2["best_ms"]})
    if row["round_ms"] <= 0:             # timer noise larger than the extra rounds (tiny models on a busy CPU)
        row["noisy"] = True
    try:
        prof = stage_profile(compiled, run, r2)
        prof["stages_ms"] = {s: v * row["round_ms"] for s, v in prof["shares"].items()}
        row["profile"] = prof
    except Exception as exc:  # noqa: BLE001
        row["profile"] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
    row["status"] = "ok"


# ---------------------------------------------------------------------------------------------------------------
# driver


RUNNERS = {"kernels": check_kernels, "copy": copy_bandwidth, "moe": moe_bandwidth, "attention": attention_widths,
           "allreduce": all_reduce_latency, "round": ddtree_round}
# seconds a section needs at least to be worth starting (full plan; tiny: a fifth)
NEEDS = {"kernels": 30, "copy": 10, "moe": 40, "attention": 40, "allreduce": 15, "round": 90}


def device_info() -> dict:
    dev = jax.devices()[0]
    info = dict(backend=jax.default_backend(), platform=dev.platform, device_kind=dev.device_kind,
                devices=len(jax.devices()), jax=jax.__version__)
    try:
        stats = dev.memory_stats() or {}
        info["memory_bytes"] = stats.get("bytes_limit")
    except Exception:  # noqa: BLE001
        pass
    return info


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "device"


def summary_lines(result: dict) -> list[str]:
    out = [f"gpu_check on {result['device']['device_kind']} ({result['device']['backend']}, jax "
           f"{result['device']['jax']}){' [tiny]' if result['tiny'] else ''}"]
    sec = result["sections"]
    for name in SECTIONS:
        s = sec.get(name)
        if s is None:
            continue
        if s["status"] != "ok":
            out.append(f"{name}: {s['status']}" + (f" ({s.get('error', '')[:160]})" if s.get("error") else ""))
            if s["status"].startswith("skipped"):
                continue
        if name == "kernels" and "cases" in s:
            bad = [c for c in s["cases"] if "ok" in c and not c["ok"]]
            worst = max((c for c in s["cases"] if "max_rel_err" in c), key=lambda c: c["max_rel_err"], default=None)
            line = f"kernels vs reference: {s.get('passed', 0)}/{s.get('checked', 0)} within tolerance"
            if worst:
                line += (f"; worst rel err {worst['max_rel_err']:.1e} ({worst['kernel']} {worst['impl']} "
                         f"{worst['case']}, tol {worst['tol']:.0e})")
            out.append(line)
            out += [f"  FAIL {c['kernel']} {c['impl']} {c['case']}: " +
                    (f"rel err {c['max_rel_err']:.2e}" if "max_rel_err" in c else c.get("error", "")[:160])
                    for c in bad]
        elif name == "copy" and "gb_per_s" in s:
            out.append(f"copy bandwidth: {s['gb_per_s']:.0f} GB/s ({s['array_bytes'] / 2**30:.2f} GiB a + 1, best "
                       f"of {s['reps']})")
        elif name == "moe" and "rows" in s:
            out.append(f"int4 moe ({s['experts']} experts, D={s['hidden']}, F={s['width']}, top-{s['topk']}, "
                       f"{s['dtype']}): per call us / GB/s (% of copy)")
            for r in s["rows"]:
                cells = []
                for impl in ("pallas", "xla", "mosaic", "mosaic_bm64", "tokamax_bf16"):
                    v = r.get(impl)
                    if v is None:
                        continue
                    if "error" in v:
                        cells.append(f"{impl} error")
                    else:
                        frac = f" ({100 * v['frac_of_copy']:.0f}%)" if "frac_of_copy" in v else ""
                        cells.append(f"{impl} {v['per_call_us']:.1f} / {v['gb_per_s']:.0f}{frac}")
                out.append(f"  t={r['tokens']:>3}: " + (r.get("status") or "  ".join(cells)))
            if isinstance(s.get("tokamax"), str) and s["tokamax"].startswith("skipped"):
                out.append(f"  tokamax peer {s['tokamax']}")
        elif name == "attention" and "rows" in s:
            out.append(f"tree attention ({s['heads']} heads, {s['kv_lora']}+{s['rope']}, {s['dtype']}): per call us")
            for r in s["rows"]:
                cells = [f"{i} " + ("error" if "error" in r[i] else f"{r[i]['per_call_us']:.1f}")
                         for i in ("pallas", "xla", "mosaic") if i in r]
                out.append(f"  s={r['slots']:>6} w={r['width']:>3}: " + (r.get("status") or "  ".join(cells)))
        elif name == "allreduce":
            if "rows" not in s:
                out.append(f"allreduce: {s.get('status_note', 'no rows')}")
            for r in s.get("rows", ()):
                out.append(f"  all-reduce {r['message_bytes'] / 1024:.0f} KB over {s['devices']}: one-shot kernel on "
                           f"{r['one_shot_on']['per_call_us']:.1f} us, off (NCCL on a GPU) "
                           f"{r['one_shot_off']['per_call_us']:.1f} us")
        elif name == "round" and "rows" in s:
            out.append(f"ddtree round ({s['config']}, {s['context_slots']} slots): ms per round")
            for r in s["rows"]:
                label = (f"  {r['impl']:>6} {r['method']}{'' if r['budget'] == 0 else '-' + str(r['budget'])}"
                         f"{'' if r.get('graph_loops', True) else ' (no graph loops)'}"
                         f"{'' if r.get('split_k', True) else ' (no split-K)'}")
                if r.get("status") != "ok":
                    out.append(f"{label}: {r.get('status')} {r.get('error', '')[:160]}")
                    continue
                prof = r.get("profile", {})
                stages = "  ".join(f"{k} {v:.2f}" for k, v in prof.get("stages_ms", {}).items() if v > 0)
                cov = f" (profile coverage {100 * prof['coverage']:.0f}%)" if "coverage" in prof else ""
                noisy = " (noisy: more rounds ran faster)" if r.get("noisy") else ""
                out.append(f"{label}: {r['round_ms']:.2f} ms{noisy}  compile {r['compile_s']:.0f} s  {stages}{cov}")
    out.append(f"total wall time {result['wall_s']:.1f} s (budget {result['budget_s']:.0f} s)")
    return out


def write(path: pathlib.Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o)) + "\n")
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes, 2 reps, interpret-mode Pallas (CPU smoke run)")
    ap.add_argument("--out", default=None, help="JSON file, or a directory for gpu_check_<device>.json "
                                                "(default bench/results/)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock guard: sections that would start with less time left are skipped "
                         "(default 420 on a GPU, 300 with --tiny)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 10; tiny 2)")
    ap.add_argument("--compile-cache", default=None, help="a directory for JAX's persistent compilation cache "
                                                         "(a rerun on the same machine skips the compiles)")
    a = ap.parse_args(argv)
    t_start = T_START
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"gpu_check: unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    if not on_gpu and not a.tiny:
        print(f"gpu_check: no GPU here (JAX backend {backend!r}); run it on a GPU machine, or pass --tiny for the "
              "CPU smoke run", file=sys.stderr)
        return 2
    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    plan = TINY if a.tiny else FULL
    if a.reps:
        plan = dataclasses.replace(plan, reps=a.reps)
    budget_s = a.budget_s if a.budget_s is not None else (300.0 if a.tiny else 420.0)
    budget = Budget(budget_s)
    budget.t0 = t_start
    ctx = dict(on_gpu=on_gpu, tiny=a.tiny, budget=budget)
    info = device_info()
    name = f"gpu_check_{'cpu' if not on_gpu else slug(info['device_kind'])}{'_tiny' if a.tiny else ''}.json"
    out = pathlib.Path(a.out) if a.out else RESULTS / name
    if out.is_dir() or (a.out and a.out.endswith("/")):
        out = out / name
    result = dict(command="python -m bench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), device=info, tiny=a.tiny, budget_s=budget_s,
                  interpret=not on_gpu, sections={})
    scale = 0.2 if a.tiny else 1.0
    for sec in SECTIONS:
        if sec not in sections:
            continue
        rec = result["sections"][sec] = dict(status="running")
        if not budget.allows(NEEDS[sec] * scale):
            rec["status"] = f"skipped: budget ({budget.left():.0f} s left, needs ~{NEEDS[sec] * scale:.0f} s)"
            continue
        t0 = time.perf_counter()
        try:
            RUNNERS[sec](plan, ctx, rec)
            rec["status"] = "ok"
        except Exception as exc:  # noqa: BLE001  (a section's failure is recorded; the next one runs)
            rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:800],
                       traceback=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[{budget.elapsed():6.1f} s] {sec}: {rec['status']} in {rec['seconds']:.1f} s", flush=True)
        result["wall_s"] = round(time.perf_counter() - t_start, 2)
        write(out, result)                # after every section: a run killed later keeps what it measured
        gc.collect()
    result["wall_s"] = round(time.perf_counter() - t_start, 2)
    result["summary"] = summary_lines(result)
    write(out, result)
    print("\n".join(result["summary"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
