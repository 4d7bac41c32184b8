"""The router as two Pallas (Triton) kernels: split-K scores, then bias + top-k + renormalise.

Why two and not one: every token block needs the whole router ([7168, 384] bf16, 5.5 MB on K2.6). One program
per token block would stream it through 1-4 SMs at decode and verify widths; split over K and over column
blocks, the GEMM runs on ``nt * (E / be) * splits`` programs (84 for a 17-token verify on K2.6), each reading a
``[D / splits, be]`` slice of the router. The second kernel is one program per token block and reads only the
float32 partial sums ``[splits, T, E]`` (21.5 KB per token on K2.6).

1. scores: grid ``(nt, E / be, splits)``. Program ``(i, c, s)`` loops over its ``D / splits`` inputs in chunks
   of ``bk`` and accumulates ``x[i-block, chunk] @ router[chunk, c-block]`` in float32 (bf16 inputs: exact
   products; float32 inputs: dots at HIGHEST precision, as the f32 XLA path), writing partial ``s``.
2. top-k: grid ``(nt,)``. Sums the partials, takes the sigmoid, adds the bias and picks the k experts by k
   rounds of (max, argmax, mask) over the E-wide row, held as ``E / be`` power-of-two column blocks (Triton
   tensors are powers of two; 384 is not). Ties go to the lowest id, as ``jax.lax.top_k``: ``argmax`` keeps the
   first maximum within a block and a later block wins only when strictly greater. The chosen unbiased scores
   are gathered (a masked row sum), renormalised and scaled.

Token blocks are 16 rows (Triton's smallest dot); rows past T are masked by Pallas' bounds checks on the
last block, so T needs no padding. Nothing here is measured on a GPU yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.numerics import F32, pow2_divisor
from kimi_jax.ops.select import lowering_tiles


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernels' tiles (module docstring); each is an upper bound, shrunk to a power of two that divides."""
    block_t: int = 16
    block_e: int = 128
    block_k: int = 256
    splits: int = 14          # K2.6: 7168 / 256 = 28 chunks, 2 per program
    num_warps: int = 4
    num_stages: int = 3
    # The top-k kernel's: its [block_t, E] float32 scores and choices live in registers; at 4 warps it spilled
    # where T is a whole number of full token blocks (T = 16 on H100, H200 and the RTX PRO 6000: no masked rows,
    # so all 14 split partials were loaded at once; tests/test_kernel_shapes.py)
    topk_num_warps: int = 8


# Per GPU (device-kind substring; "" every other): sm_120 (RTX PRO 6000, ~99 KiB of shared memory per block)
# cannot hold the pipelined [256, 128] router tiles (144 KiB asked, deviceless compile 2026-12-06); 128-input
# chunks halve that.
TILES = {"": Tiles(), "RTX PRO 6000": Tiles(block_k=128)}


def block(n: int, target: int) -> int | None:
    """The largest power of two in [16, target] that divides n, or None (the kernels need one)."""
    b = pow2_divisor(n, target)
    return b if b >= 16 else None


def _scores_kernel(x_ref, s_ref, w_ref, o_ref, *, n_chunks: int, block_k: int, precision):
    def chunk(j, acc):
        xs = s_ref[pl.ds(j * block_k, block_k)][None, :] * x_ref[:, pl.ds(j * block_k, block_k)]
        xs = xs.astype(w_ref.dtype)                 # rounded as the reference's scale * x, then the GEMM's dtype
        ws = w_ref[pl.ds(j * block_k, block_k), :]
        return acc + jnp.dot(xs, ws, preferred_element_type=F32, precision=precision)

    o_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros(o_ref.shape, F32))


def _topk_kernel(p_ref, b_ref, ids_ref, w_ref, *, n_cols: int, block_e: int, k: int, norm: bool,
                 scaling: float):
    n_splits, bt = p_ref.shape[0], p_ref.shape[1]
    col = jnp.arange(block_e, dtype=jnp.int32)[None, :]
    scores, choice = [], []
    for c in range(n_cols):
        cols = pl.ds(c * block_e, block_e)
        logits = sum(p_ref[s, :, cols] for s in range(n_splits))
        scores.append(jax.nn.sigmoid(logits))
        choice.append(scores[c] + b_ref[cols].astype(F32)[None, :])
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]
    ids, weights = jnp.zeros((bt, k), jnp.int32), jnp.zeros((bt, k), F32)
    for r in range(k):
        best, best_id = None, None
        for c in range(n_cols):
            v = jnp.max(choice[c], axis=1)
            i = jnp.argmax(choice[c], axis=1).astype(jnp.int32) + c * block_e
            if best is None:
                best, best_id = v, i
            else:   # strictly greater: on a tie the earlier block (the lower id) stays
                best_id = jnp.where(v > best, i, best_id)
                best = jnp.maximum(v, best)
        hit = [col + c * block_e == best_id[:, None] for c in range(n_cols)]
        score = sum(jnp.sum(jnp.where(hit[c], scores[c], 0.0), axis=1) for c in range(n_cols))
        choice = [jnp.where(hit[c], -jnp.inf, choice[c]) for c in range(n_cols)]
        ids = jnp.where(slot == r, best_id[:, None], ids)
        weights = jnp.where(slot == r, score[:, None], weights)
    if norm:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20)
    ids_ref[...] = ids
    w_ref[...] = weights * scaling


def route_pallas(x, router, bias, scale, *, k: int, norm_topk_prob: bool, scaling: float, interpret: bool,
                 tiles: Tiles | None = None):
    """x [T, D], router [D, E], bias [E], scale [D] (x's columns multiplied by it in x's dtype first) -> (ids
    [T, k] int32, weights [T, k] float32); shapes as ``api.pallas_supports`` accepts. ``tiles``: None picks them
    for the GPU being lowered for (``select.lowering_tiles``)."""
    tiles = tiles or (Tiles() if interpret else lowering_tiles(TILES))
    t, d = x.shape
    e = router.shape[1]
    bt, be, bk = tiles.block_t, block(e, tiles.block_e), block(d, tiles.block_k)
    splits = math.gcd(d // bk, tiles.splits)
    nt, nc = pl.cdiv(t, bt), e // be
    dtype = jnp.promote_types(jnp.result_type(x, scale), router.dtype)
    # 16-bit inputs: bf16 x bf16 products are exact in the float32 accumulator; float32 inputs keep full precision.
    precision = None if jnp.dtype(dtype).itemsize == 2 else jax.lax.Precision.HIGHEST
    params = pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    part = d // splits
    partial = pl.pallas_call(
        functools.partial(_scores_kernel, n_chunks=part // bk, block_k=bk, precision=precision),
        grid=(nt, nc, splits),
        in_specs=[pl.BlockSpec((bt, part), lambda i, c, s: (i, s)),
                  pl.BlockSpec((part,), lambda i, c, s: (s,)),
                  pl.BlockSpec((part, be), lambda i, c, s: (s, c))],
        out_specs=pl.BlockSpec((None, bt, be), lambda i, c, s: (s, i, c)),
        out_shape=jax.ShapeDtypeStruct((splits, t, e), F32),
        compiler_params=params,
        interpret=interpret,
        name="router_scores",
    )(x, scale, router.astype(dtype))
    return pl.pallas_call(
        functools.partial(_topk_kernel, n_cols=nc, block_e=be, k=k, norm=norm_topk_prob, scaling=scaling),
        grid=(nt,),
        in_specs=[pl.BlockSpec((splits, bt, e), lambda i: (0, i, 0)),
                  pl.BlockSpec((e,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((bt, k), lambda i: (i, 0)), pl.BlockSpec((bt, k), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), F32)],
        compiler_params=pltriton.CompilerParams(num_warps=tiles.topk_num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="router_topk",
    )(partial, bias)
