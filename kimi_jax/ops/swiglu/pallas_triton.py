"""SwiGLU as a split-K GEMM over gate|up and one Pallas (Triton) kernel for the rest.

What XLA makes of ``down(silu(x @ gate) * (x @ up))`` at decode and verify widths on a GPU (K2.6's shared expert
at TP-8, 17 tokens, H200, deviceless compile): the gate|up GEMM split over K (partial sums), their sum with
``silu(g) * u`` (one kernel), and the down GEMM: three launches. Here two:

1. ``x @ [gate | up]`` as ``splits`` partial sums (an XLA batched GEMM: the concatenation is read in place, and a
   product feeding ``x``, e.g. the MoE norm's weight, fuses into its operand);
2. one kernel, grid (row blocks, output column blocks): each program sums the partials of its rows, rounds ``g``
   and ``u`` to x's dtype (as the reference's GEMM outputs), forms ``h = silu(g) * u`` (rounded likewise) an
   ``F``-chunk at a time and accumulates ``h @ down[:, columns]`` in float32, written in x's dtype. Every column
   program recomputes its rows' ``h`` (``splits x rows x 2F`` floats read from L2: 0.26 MB a program for the
   shared expert at TP-8) rather than a third launch.

Tiles (``Tiles``; per GPU in ``TILES``): row blocks of at most ``rows`` (Triton's dots take >= 16), ``cols`` output
columns, ``F`` in chunks of ``f_chunk``. Nothing measured on a GPU yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.latent.pallas_triton import splits_for
from kimi_jax.ops.numerics import F32, next_pow2, pow2_divisor
from kimi_jax.ops.select import lowering_tiles


@dataclasses.dataclass(frozen=True)
class Tiles:
    rows: int = 32
    cols: int = 128
    f_chunk: int = 64
    num_stages: int = 2


# Per GPU (device-kind substring; "" every other): sm_120 (RTX PRO 6000, ~99 KiB of shared memory a block) cannot
# hold two stages of a chunk's float32 partial sums ([8 splits, 32 rows, 2 x 64] floats: 148 KiB asked, deviceless
# compile 2026-12-07); one stage of 32-column chunks fits.
TILES = {"": Tiles(), "RTX PRO 6000": Tiles(f_chunk=32, num_stages=1)}


def _kernel(parts_ref, down_ref, o_ref, *, f: int, f_chunk: int):
    """parts [S, rows, 2F] (float32 partial sums of x @ [gate | up]), down [F, cols] -> o [rows, cols]."""
    dtype = o_ref.dtype
    c = pow2_divisor(f, f_chunk)

    def chunk(i, acc):
        g = jnp.sum(parts_ref[:, :, pl.ds(i * c, c)], axis=0).astype(dtype).astype(F32)
        u = jnp.sum(parts_ref[:, :, pl.ds(f + i * c, c)], axis=0).astype(dtype).astype(F32)
        sigmoid = jax.nn.sigmoid(g).astype(dtype).astype(F32)           # jax.nn.silu in x's dtype: g * sigmoid(g)
        silu = (g * sigmoid).astype(dtype).astype(F32)
        h = (silu * u).astype(dtype)
        return acc + jnp.dot(h, down_ref[pl.ds(i * c, c), :], preferred_element_type=F32)

    o_ref[...] = jax.lax.fori_loop(0, f // c, chunk, jnp.zeros(o_ref.shape, F32)).astype(dtype)


def swiglu_pallas(x, gate, up, down, *, interpret: bool = False, tiles: Tiles | None = None):
    """``reference.swiglu_reference`` for x [..., T, D], gate and up [D, F], down [F, N] -> [..., T, N]: the split-K
    GEMM and the kernel above (shapes as ``api.pallas_supports`` accepts). ``tiles``: None picks them for the GPU
    being lowered for (``select.lowering_tiles``)."""
    tiles = tiles or (Tiles() if interpret else lowering_tiles(TILES))
    lead, d = x.shape[:-1], x.shape[-1]
    f, n_out = down.shape
    flat = x.reshape(-1, d)
    t = flat.shape[0]
    s = splits_for(d, t)
    w = jnp.concatenate([gate, up], axis=-1)
    parts = jnp.einsum("tsk,skn->stn", flat.reshape(t, s, d // s), w.reshape(s, d // s, 2 * f),
                       preferred_element_type=F32)                              # [s, t, 2F]
    bt, bn = min(tiles.rows, max(16, next_pow2(t))), pow2_divisor(n_out, tiles.cols)
    out = pl.pallas_call(
        functools.partial(_kernel, f=f, f_chunk=tiles.f_chunk),
        grid=(pl.cdiv(t, bt), n_out // bn),
        in_specs=[pl.BlockSpec((s, bt, 2 * f), lambda i, j: (0, i, 0)), pl.BlockSpec((f, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bt, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((t, n_out), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=tiles.num_stages),
        interpret=interpret,
        name="swiglu",
    )(parts, down)
    return out.reshape(*lead, n_out)
