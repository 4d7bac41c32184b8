"""The latent projection as a split-K GEMM and one Pallas (Triton) kernel after it.

What XLA makes of ``reference.latent_reference`` at decode and verify widths on a GPU (K2.6, 17 tokens, H200,
deviceless compile): the attention norm (one kernel), the q_a|kv_a GEMM split over K (one: partial sums), and
three kernels that each sum the partials for one reader (the query latent's norm, the key latent's norm, the
cache write with the key's RoPE): five launches a layer (with the attention's norm). Here:

1. the GEMM as ``splits`` partial sums of ``(norm * x) @ [q_a | kv_a]`` (an XLA batched GEMM, the weight's
   multiply fused into its operand), without the norm's ``1 / rms(x)``: a row scale, which commutes with the GEMM;
2. one kernel, a program per token: ``1 / rms(x)`` from the token's row of ``x``, the partial sums added and
   scaled by it (rounded to x's dtype, as the reference's GEMM output), then ``cq``'s RMSNorm, ``c_kv``'s RMSNorm
   and ``k_pe``'s RoPE, written as ``cq`` and the token's cache row (into the whole cache in place, aliased,
   at the page and offset of its slot; or returned as rows).

Two launches where XLA has five. The rounding differs from the reference's in one place: the GEMM reads
``norm * x`` rounded to x's dtype where the reference reads ``norm * bf16(x / rms(x))``. Tiles: power-of-two
column chunks that divide each width (Triton tensors are powers of two), at most ``CHUNK`` wide; RoPE pairs by a
gather of the swapped column (``i ^ 1``). Nothing measured on a GPU yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.numerics import F32, next_pow2, pow2_divisor

CHUNK = 512          # widest column chunk: [splits, 512] float32 partial sums (4096 values) in 4 warps' registers
SPLITS = 8           # K splits of the GEMM at a few rows: K2.6's 7168 inputs as 8 x 896 (what XLA's split-K picks)
SPLIT_ROWS = 512     # fewer splits as the rows grow: rows x splits stays <= this (enough GEMM tiles without them)


def splits_for(d: int, rows: int) -> int:
    """K splits for ``rows`` rows of ``d`` inputs: ``SPLITS`` where each split keeps >= 128 inputs and rows x
    splits <= ``SPLIT_ROWS``, fewer (down to 1) otherwise."""
    s = SPLITS
    while s > 1 and (d % s or d // s < 128 or rows * s > SPLIT_ROWS):
        s //= 2
    return s


def _kernel(x_ref, nq_ref, nkv_ref, cos_ref, sin_ref, parts_ref, *refs, eps: float, latent_eps: float,
            to_cache: bool):
    """Program t: token t. refs: (cq, rows) out, or with ``to_cache`` (layer [1], slots [b, T], page table [b,
    pages a row] (contiguous caches: [b, 1] of row ids), the whole cache in) and (cq, cache) out, the cache
    aliased: the token's row goes to [layer, page, offset] of its slot, as ``cache.locate`` finds them, unless the
    slot is past the row's storage (dropped, as ``cache.write`` drops it)."""
    if to_cache:
        layer_ref, slots_ref, table_ref, _, cq_ref, kv_ref = refs
    else:
        cq_ref, rows_ref = refs
    t = pl.program_id(0)
    d, n_q, r = x_ref.shape[1], nq_ref.shape[0], nkv_ref.shape[0]
    p = cos_ref.shape[1] * 2
    dtype = cq_ref.dtype

    def store(cols, value):     # the token's cache row at cols
        if not to_cache:
            rows_ref[t, cols] = value.astype(rows_ref.dtype)
            return
        row, j = t // slots_ref.shape[1], t % slots_ref.shape[1]
        slot, page_size, per_row = slots_ref[row, j], kv_ref.shape[2], table_ref.shape[1]
        logical = slot // page_size

        @pl.when((slot >= 0) & (logical < per_row))
        def _():
            page = table_ref[row, jnp.minimum(logical, per_row - 1)]

            @pl.when(page < kv_ref.shape[1])
            def _():
                kv_ref[layer_ref[0], page, slot % page_size, cols] = value.astype(kv_ref.dtype)

    def row_sum_sq(width, load):
        """sum of squares of ``load(cols)`` over ``width`` columns, a power-of-two chunk at a time."""
        c = pow2_divisor(width, CHUNK)
        return jax.lax.fori_loop(0, width // c, lambda i, acc: acc + jnp.sum(
            jnp.square(load(pl.ds(i * c, c)))), jnp.float32(0))

    # the attention norm's 1 / rms of the token's row
    inv_rms = jax.lax.rsqrt(row_sum_sq(d, lambda c: x_ref[t, c].astype(F32)) / d + eps)

    def latent(base, c, size):   # the GEMM's output at columns base + [c, c + size), rounded as the reference's
        return (jnp.sum(parts_ref[:, t, pl.ds(base + c, size)], axis=0) * inv_rms).astype(dtype).astype(F32)

    def normed(base, width, weight_ref, out):   # RMSNorm of columns base + [0, width): out(cols, value)
        c = pow2_divisor(width, CHUNK)
        scale = jax.lax.rsqrt(row_sum_sq(width, lambda cols: latent(base, cols.start, c)) / width + latent_eps)

        def write(i, _):
            v = (latent(base, i * c, c) * scale).astype(dtype).astype(F32)      # rms_normalize, in x's dtype
            out(pl.ds(i * c, c), weight_ref[pl.ds(i * c, c)].astype(F32) * v)
            return 0
        jax.lax.fori_loop(0, width // c, write, 0)

    def store_cq(cols, value):
        cq_ref[t, cols] = value.astype(cq_ref.dtype)

    normed(0, n_q, nq_ref, store_cq)
    normed(n_q, r, nkv_ref, store)
    # RoPE on k_pe's adjacent pairs: column i with its partner i ^ 1 (even: e cos - o sin; odd: o cos + e sin)
    i = jnp.arange(p, dtype=jnp.int32)

    def gathered(cols):     # the GEMM's output at columns cols (an index vector), one split at a time (Triton
        #                     gathers along one axis)
        return (sum(parts_ref[s, t, cols] for s in range(parts_ref.shape[0])) * inv_rms).astype(dtype).astype(F32)

    k_pe, partner = gathered(n_q + r + i), gathered(n_q + r + (i ^ 1))
    sign = jnp.where(i % 2 == 0, -1.0, 1.0).astype(F32)
    cos, sin = cos_ref[t, i // 2], sin_ref[t, i // 2]
    store(pl.ds(r, p), k_pe * cos + sign * partner * sin)


def latent_pallas(x, norm, q_a, kv_a, q_a_norm, kv_a_norm, positions, inv_freq, cache=None, *, eps: float,
                  latent_eps: float, interpret: bool = False):
    """``reference.latent_reference`` as the split-K GEMM and the kernel (module doc): x [..., T, D] with
    positions [..., T] -> (cq [..., T, Q], rows [..., T, R + P]); with ``cache`` = (kv [layers, pages, page_size,
    R + P], page_table or None, layer, slots [..., T]; ``kimi_jax.cache``) the rows go into kv in place and (cq,
    kv) is returned. Shapes as ``api.pallas_supports`` accepts."""
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    n = flat.shape[0]
    s = splits_for(d, n)
    xs = (norm * flat).reshape(n, s, d // s)      # the norm's weight, rounded as the reference's product
    # [s, n, Q + R + P] float32: one GEMM of s batches over both weights (XLA reads the concatenation in place,
    # inside the GEMM's fusion; two GEMMs would be merged into one and their outputs sliced apart by two kernels)
    w = jnp.concatenate([q_a, kv_a], axis=-1)
    parts = jnp.einsum("tsk,skn->stn", xs, w.reshape(s, d // s, w.shape[-1]), preferred_element_type=F32)
    n_q, n_kv = q_a.shape[-1], kv_a.shape[-1]
    # the rotation's angles as apply_rope computes them: XLA shares the cos/sin kernel with the query's RoPE
    angles = positions.astype(F32)[..., None] * inv_freq
    cos, sin = (f(angles).reshape(n, -1) for f in (jnp.cos, jnp.sin))
    full = lambda a: pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)  # noqa: E731
    operands = (flat, q_a_norm, kv_a_norm, cos, sin, parts)
    out_shape = [jax.ShapeDtypeStruct((n, n_q), x.dtype)]
    if cache is None:
        out_shape.append(jax.ShapeDtypeStruct((n, n_kv), x.dtype))
    else:
        kv, page_table, layer, slots = cache
        slots = slots.reshape(-1, slots.shape[-1]).astype(jnp.int32)
        if page_table is None:          # one page a row (cache.locate's contiguous case)
            page_table = np.arange(slots.shape[0], dtype=np.int32)[:, None]
        operands += (jnp.asarray(layer, jnp.int32).reshape(1), slots, jnp.asarray(page_table, jnp.int32), kv)
        out_shape.append(jax.ShapeDtypeStruct(kv.shape, kv.dtype))
    cq, out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, latent_eps=latent_eps, to_cache=cache is not None),
        grid=(n,),
        in_specs=[full(a) for a in operands],
        out_specs=[full(o) for o in out_shape],
        out_shape=out_shape,
        input_output_aliases={} if cache is None else {len(operands) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_latent",
    )(*operands)
    return cq.reshape(*lead, n_q), (out if cache is not None else out.reshape(*lead, n_kv))


# ---- the absorbed queries: q_b as a split-K GEMM, then one kernel for RoPE and W_UK ------------------------------

QUERY_ROWS = 64      # most query rows a program takes (a [64, 128] float32 W_UK product chunk in registers)


def _queries_kernel(parts_ref, kv_b_ref, cos_ref, sin_ref, q_lat_ref, q_pe_ref, *, nope: int):
    """Program (i, h): rows block i of head h. parts [S, rows, nope + P] (float32 partial sums of q), kv_b [R,
    nope + V] (W_UK in its first nope columns, read in place), cos/sin [rows, P / 2]."""
    dtype = q_lat_ref.dtype
    r, half = kv_b_ref.shape[0], q_pe_ref.shape[-1] // 2

    def q(cols):      # the GEMM's output at cols, rounded as the reference's q (x's dtype)
        return jnp.sum(parts_ref[:, :, cols], axis=0).astype(dtype)

    q_nope = q(pl.ds(0, nope))
    c = pow2_divisor(r, 128)
    for j in range(r // c):         # q_lat = q_nope W_UK^T, a chunk of latent columns at a time
        w_uk = kv_b_ref[pl.ds(j * c, c), pl.ds(0, nope)]                  # [c, nope]
        q_lat_ref[:, pl.ds(j * c, c)] = jax.lax.dot_general(
            q_nope, w_uk, (((1,), (1,)), ((), ())), preferred_element_type=F32).astype(dtype)
    # RoPE on adjacent pairs: the even and odd columns as strided slices
    even, odd = (q(pl.ds(nope + k, half, stride=2)).astype(F32) for k in (0, 1))
    cos, sin = cos_ref[...], sin_ref[...]
    q_pe_ref[:, pl.ds(0, half, stride=2)] = (even * cos - odd * sin).astype(dtype)
    q_pe_ref[:, pl.ds(1, half, stride=2)] = (odd * cos + even * sin).astype(dtype)


def queries_pallas(cq, q_b, kv_b, positions, inv_freq, *, interpret: bool = False):
    """``reference.queries_reference`` as a split-K GEMM over q_b and the kernel above: cq [..., T, Q], q_b [Q, H,
    nope + P], kv_b [R, H, nope + V], positions [..., T] -> (q_lat [..., T, H, R], q_pe [..., T, H, P])."""
    lead, qd = cq.shape[:-1], cq.shape[-1]
    _, h, width = q_b.shape
    r, p = kv_b.shape[0], 2 * inv_freq.shape[0]
    nope = width - p
    flat = cq.reshape(-1, qd)
    n = flat.shape[0]
    s = splits_for(qd, n)
    parts = jnp.einsum("tsq,sqhk->sthk", flat.reshape(n, s, qd // s), q_b.reshape(s, qd // s, h, width),
                       preferred_element_type=F32)                              # [s, n, h, width]
    angles = positions.astype(F32)[..., None] * inv_freq                       # as apply_rope's
    cos, sin = (f(angles).reshape(n, -1) for f in (jnp.cos, jnp.sin))
    bt = min(QUERY_ROWS, max(16, next_pow2(n)))                               # Triton's dots: >= 16 rows
    q_lat, q_pe = pl.pallas_call(
        functools.partial(_queries_kernel, nope=nope),
        grid=(pl.cdiv(n, bt), h),
        in_specs=[pl.BlockSpec((s, bt, None, width), lambda i, j: (0, i, j, 0)),
                  pl.BlockSpec((r, None, kv_b.shape[-1]), lambda i, j: (0, j, 0)),
                  pl.BlockSpec((bt, p // 2), lambda i, j: (i, 0)), pl.BlockSpec((bt, p // 2), lambda i, j: (i, 0))],
        out_specs=[pl.BlockSpec((bt, None, r), lambda i, j: (i, j, 0)),
                   pl.BlockSpec((bt, None, p), lambda i, j: (i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, h, r), cq.dtype), jax.ShapeDtypeStruct((n, h, p), cq.dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_queries",
    )(parts, kv_b, cos, sin)
    return q_lat.reshape(*lead, h, r), q_pe.reshape(*lead, h, p)
