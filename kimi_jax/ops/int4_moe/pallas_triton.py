"""The INT4 routed experts as two grouped Pallas (Triton) kernels.

Two ``pl.pallas_call`` kernels in the Triton-lowering subset (BlockSpecs, ``pl.program_id``,
``pl.when``, ``fori_loop``, power-of-two loads; no scalar prefetch, which the Triton backend lacks, so each
program reads its block's expert id from a small int32 array and indexes the weights with it):

1. gate/up: grid ``(nb, F / bn)``. Program ``(b, n)`` reads its block's ``bm`` pairs (``row_pair``; a row's
   token is its pair // k, padding rows read the last token) and gathers those rows of ``x`` itself (no grouped copy of the activations is written: at a 17-token verify on
   K2.6 that copy was 2176 x 7168 bf16 rows, 15/16 of them padding). It loops over ``K`` in chunks of 256 inputs; per chunk it
   loads one ``[32, bn]`` word tile of gate and one of up, and for each nibble plane ``i`` (= scale group
   ``8c + i``) unpacks it with a shift and mask, does ``[bm, 32] x [32, bn]`` dots against the matching slice
   of the gathered rows (activation dtype, float32 accumulation) and adds them scaled by the group's scale row (scaling the
   ``[bm, bn]`` partial sum, not the ``[32, bn]`` weights: cheaper at decode widths, and exact since q is an
   integer). It writes ``h = silu(g) * u`` in the activation dtype.
2. down: grid ``(nb, D / bn)``, the same loop over ``F`` with one matrix, writing float32 rows.

Every program reads only its block's expert, so the bytes streamed are those of the touched experts (times the
number of row blocks an expert spans, ``ceil(n_e / bm)``, minus what L2 catches: row blocks of one expert are
adjacent on the fastest grid axis, so they run together and share the weight tile).

Tiling (for an H200 later; nothing here is tuned on hardware yet):
- ``bm`` = the next power of two of the mean rows per touched expert, clamped to [16, 64]. 16 is Triton's
  minimum dot size; at decode (``M = 8``, 8 experts) each block holds one real row and 15 padding rows, which
  costs MMA work but no extra bytes, and the kernel is bandwidth-bound there. Bigger blocks at prefill widths
  stop an expert's weights from being streamed once per 16 rows.
- ``bn`` = 64 for gate/up (two 8 KiB word tiles per chunk) and 128 for down (one 16 KiB tile): 512 B
  contiguous per word row for coalescing, and enough programs to fill 132 SMs at decode (``8 x 32`` and
  ``8 x 56`` programs for K2 shapes); ``num_stages=3`` lets Triton pipeline the chunk loop's loads.
- gate/up runs 8 warps: its gathered row loads (one ``[bm, 32]`` pointer tensor per nibble plane and stage)
  spill registers at 4 warps x 3 stages on K2.6 TP-8 slices for H200 (deviceless compile); 4 warps x 2 stages
  do not spill either. Neither is measured on a GPU yet.
- no split-K: at batch 1 the grid already has >= 256 programs of 28 (gate/up) or 8 (down) chunks each.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.int4_format import CHUNK, GROUP_SIZE, WORD_ROWS, Int4Experts
from kimi_jax.ops.numerics import F32
from kimi_jax.ops.select import lowering_tiles

PALLAS_BLOCK_M = (16, 64)     # min, max rows per block (the routing pads expert groups to these: api.py)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernels' tiles and Triton launch parameters (see the module docstring)."""
    block_n_gate_up: int = 64
    block_n_down: int = 128
    num_warps: int = 4
    num_stages: int = 3
    num_warps_gate_up: int = 8


# Per GPU (device-kind substring; "" every other): sm_120 (RTX PRO 6000 Blackwell: no wgmma, Triton's mma.sync
# path) spills registers at 4 warps x 3 stages on K2.6 TP-8 slices, deviceless compile 2026-12-05; with 8 warps it
# does not (tests/test_targets.py compiles each target with spills as errors).
TILES = {"": Tiles(), "RTX PRO 6000": Tiles(num_warps=8)}


def _block_n(n: int, target: int) -> int:
    """Largest power of two <= target that divides n (Triton loads need power-of-two tiles, dots >= 16)."""
    bn = target
    while bn > 16 and n % bn:
        bn //= 2
    if n % bn:
        raise ValueError(f"impl='pallas' needs the expert dims to be multiples of 16, got {n}; use impl='xla'")
    return bn


def _nibble_dot(x: jax.Array, words: jax.Array, i: int) -> jax.Array:
    """x [bm, 32] @ (nibble plane i of words [32, bn] as q = u - 8), float32 accumulation."""
    q = ((words >> (4 * i)) & 0xF) - 8
    return jnp.dot(x, q.astype(x.dtype), preferred_element_type=F32)


def _gate_up_kernel(block_expert_ref, row_pair_ref, x_ref, w_ref, s_ref, h_ref, *, n_chunks: int, k: int):
    e = block_expert_ref[pl.program_id(0)]

    @pl.when(e >= 0)
    def _():
        # [bm] token of each row; padding rows (pair T * k) read token T - 1: their outputs are never combined
        rows = jnp.minimum(row_pair_ref[...] // k, x_ref.shape[0] - 1)

        def chunk(c, acc):
            acc_g, acc_u = acc
            w_gate = w_ref[e, 0, pl.ds(c * WORD_ROWS, WORD_ROWS), :]
            w_up = w_ref[e, 1, pl.ds(c * WORD_ROWS, WORD_ROWS), :]
            for i in range(8):  # nibble plane i = scale group 8c + i = inputs 256c + 32i .. + 31
                xi = x_ref[rows, pl.ds(c * CHUNK + i * GROUP_SIZE, GROUP_SIZE)]
                g = c * 8 + i
                acc_g += _nibble_dot(xi, w_gate, i) * s_ref[e, 0, g, :].astype(F32)[None, :]
                acc_u += _nibble_dot(xi, w_up, i) * s_ref[e, 1, g, :].astype(F32)[None, :]
            return acc_g, acc_u

        zeros = jnp.zeros(h_ref.shape, F32)
        acc_g, acc_u = jax.lax.fori_loop(0, n_chunks, chunk, (zeros, zeros))
        h_ref[...] = (acc_g * jax.nn.sigmoid(acc_g) * acc_u).astype(h_ref.dtype)


def _down_kernel(block_expert_ref, h_ref, w_ref, s_ref, o_ref, *, n_chunks: int):
    e = block_expert_ref[pl.program_id(0)]

    @pl.when(e >= 0)
    def _():
        def chunk(c, acc):
            w = w_ref[e, pl.ds(c * WORD_ROWS, WORD_ROWS), :]
            for i in range(8):
                hi = h_ref[:, pl.ds(c * CHUNK + i * GROUP_SIZE, GROUP_SIZE)]
                acc += _nibble_dot(hi, w, i) * s_ref[e, c * 8 + i, :].astype(F32)[None, :]
            return acc

        o_ref[...] = jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros(o_ref.shape, F32))


def experts_pallas(x: jax.Array, row_pair: jax.Array, k: int, block_expert: jax.Array, ex: Int4Experts,
                   interpret: bool, tiles: Tiles | None = None) -> jax.Array:
    """Rows ``[nb * bm, D]`` (float32) of the experts of ``block_expert`` [nb] applied to the rows ``x[row_pair //
    k]`` (``routing.Routing``; k = pairs per token): ``x`` ``[T, Dp]`` (columns zero-padded to the word rows'
    inputs). ``tiles``: None picks them for the GPU being lowered for (``select.lowering_tiles``)."""
    tiles = tiles or (Tiles() if interpret else lowering_tiles(TILES))
    nb = block_expert.shape[0]
    bm = row_pair.shape[0] // nb
    n_exp, _, d_rows, f = ex.w13.shape
    f_rows, d = ex.w2.shape[-2:]
    params = pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    params_gate_up = pltriton.CompilerParams(num_warps=tiles.num_warps_gate_up, num_stages=tiles.num_stages)
    expert_spec = pl.BlockSpec((nb,), lambda b, n: (0,))

    bn = _block_n(f, tiles.block_n_gate_up)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, n_chunks=d_rows // WORD_ROWS, k=k),
        grid=(nb, f // bn),
        in_specs=[
            expert_spec,
            pl.BlockSpec((bm,), lambda b, n: (b,)),
            pl.BlockSpec(x.shape, lambda b, n: (0, 0)),
            pl.BlockSpec((n_exp, 2, d_rows, bn), lambda b, n: (0, 0, 0, n)),
            pl.BlockSpec((n_exp, 2, d_rows // 4, bn), lambda b, n: (0, 0, 0, n)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda b, n: (b, n)),
        out_shape=jax.ShapeDtypeStruct((row_pair.shape[0], f), x.dtype),
        compiler_params=params_gate_up,
        interpret=interpret,
        name="int4_moe_gate_up",
    )(block_expert, row_pair, x, ex.w13, ex.s13)
    h = jnp.pad(h, ((0, 0), (0, f_rows * 8 - f)))   # zero inputs for the padded word rows (tiny models only)

    bn = _block_n(d, tiles.block_n_down)
    return pl.pallas_call(
        functools.partial(_down_kernel, n_chunks=f_rows // WORD_ROWS),
        grid=(nb, d // bn),
        in_specs=[
            expert_spec,
            pl.BlockSpec((bm, h.shape[1]), lambda b, n: (b, 0)),
            pl.BlockSpec((n_exp, f_rows, bn), lambda b, n: (0, 0, n)),
            pl.BlockSpec((n_exp, f_rows // 4, bn), lambda b, n: (0, 0, n)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda b, n: (b, n)),
        out_shape=jax.ShapeDtypeStruct((row_pair.shape[0], d), F32),
        compiler_params=params,
        interpret=interpret,
        name="int4_moe_down",
    )(block_expert, h, ex.w2, ex.s2)
