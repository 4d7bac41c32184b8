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
2. down: grid ``(nb, D / bn)``, the same loop over ``F`` with one matrix, writing float32 rows: a masked store
   of the block's real rows only (at decode and verify widths 15 of 16 rows are padding, never read).

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
- at 64-row blocks (2048 tokens and up) the float32 accumulators spill registers (deviceless compiles,
  2026-12-06): the down kernel's at 4 warps on H200, the gate/up kernel's two ``[64, 64]`` on B300. There the
  down kernel runs 8 warps and gate/up 32-column tiles; below 64 rows the tiles above compile spill-free.
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
from kimi_jax.ops.int4_moe.routing import Routing, gather_rows, num_blocks, sort_by_expert
from kimi_jax.ops import registry
from kimi_jax.ops.numerics import F32, next_pow2, pow2_divisor
from kimi_jax.ops.registry import Implementation, Lowering, Op, always
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
    # at 64-row blocks (prefill widths): the down kernel's warps and the gate/up kernel's columns
    num_warps_wide: int = 8
    block_n_gate_up_wide: int = 32


# Per GPU (device-kind substring; "" every other): sm_120 (RTX PRO 6000 Blackwell: no wgmma, Triton's mma.sync
# path) spills registers at 4 warps x 3 stages on K2.6 TP-8 slices, deviceless compile 2026-12-05; with 8 warps it
# does not (tests/test_targets.py compiles each target with spills as errors).
TILES = {"": Tiles(), "RTX PRO 6000": Tiles(num_warps=8)}


def _block_n(n: int, target: int) -> int:
    """Largest power of two <= target that divides n (Triton loads need power-of-two tiles, dots >= 16)."""
    bn = pow2_divisor(n, target)
    if bn < 16:
        raise ValueError(f"impl='pallas' needs the expert dims to be multiples of 16, got {n}; use impl='xla'")
    return bn


def _nibble_dot(x: jax.Array, words: jax.Array, i: int) -> jax.Array:
    """x [bm, 32] @ (nibble plane i of words [32, bn] as q = u - 8), float32 accumulation."""
    q = ((words >> (4 * i)) & 0xF) - 8
    return jnp.dot(x, q.astype(x.dtype), preferred_element_type=F32)


def _gate_up_kernel(block_expert_ref, row_pair_ref, x_ref, *refs, n_chunks: int, k: int, scaled: bool):
    scale_ref, w_ref, s_ref, h_ref = refs if scaled else (None, *refs)
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
                cols = pl.ds(c * CHUNK + i * GROUP_SIZE, GROUP_SIZE)
                xi = x_ref[rows, cols]
                if scaled:      # the rows times the MoE norm's weight, rounded as XLA rounds scale * x
                    xi = (xi.astype(F32) * scale_ref[cols].astype(F32)[None, :]).astype(x_ref.dtype)
                g = c * 8 + i
                acc_g += _nibble_dot(xi, w_gate, i) * s_ref[e, 0, g, :].astype(F32)[None, :]
                acc_u += _nibble_dot(xi, w_up, i) * s_ref[e, 1, g, :].astype(F32)[None, :]
            return acc_g, acc_u

        zeros = jnp.zeros(h_ref.shape, F32)
        acc_g, acc_u = jax.lax.fori_loop(0, n_chunks, chunk, (zeros, zeros))
        h_ref[...] = (acc_g * jax.nn.sigmoid(acc_g) * acc_u).astype(h_ref.dtype)


def _down_kernel(block_expert_ref, row_pair_ref, h_ref, w_ref, s_ref, o_ref, *, n_chunks: int, m: int):
    e = block_expert_ref[pl.program_id(0)]

    @pl.when(e >= 0)
    def _():
        def chunk(c, acc):
            w = w_ref[e, pl.ds(c * WORD_ROWS, WORD_ROWS), :]
            for i in range(8):
                hi = h_ref[:, pl.ds(c * CHUNK + i * GROUP_SIZE, GROUP_SIZE)]
                acc += _nibble_dot(hi, w, i) * s_ref[e, c * 8 + i, :].astype(F32)[None, :]
            return acc

        out = jax.lax.fori_loop(0, n_chunks, chunk, jnp.zeros(o_ref.shape, F32))
        # only the block's real rows are stored: the combine never reads a padding row, and at decode and verify
        # widths 15 of a block's 16 rows are padding (a 17-token verify on K2.6 TP-8: 62 MB of float32 rows per
        # MoE layer per device written where 4 MB are read)
        real = jnp.broadcast_to((row_pair_ref[...] < m)[:, None], out.shape)
        pltriton.store(o_ref, out, mask=real)


def experts_pallas(x: jax.Array, row_pair: jax.Array, k: int, block_expert: jax.Array, ex: Int4Experts,
                   interpret: bool, tiles: Tiles | None = None, scale: jax.Array | None = None) -> jax.Array:
    """Rows ``[nb * bm, D]`` (float32) of the experts of ``block_expert`` [nb] applied to the rows ``scale *
    x[row_pair // k]`` (``routing.Routing``; k = pairs per token): ``x`` ``[T, Dp]`` (columns zero-padded to the
    word rows' inputs), ``scale`` [Dp] or None (ones; the gate/up kernel multiplies the rows it gathers). Only
    rows holding a pair are written; padding rows and unused blocks hold whatever the buffer held.
    ``tiles``: None picks them for the GPU being lowered for (``select.lowering_tiles``)."""
    tiles = tiles or (Tiles() if interpret else lowering_tiles(TILES))
    nb = block_expert.shape[0]
    bm = row_pair.shape[0] // nb
    n_exp, _, d_rows, f = ex.w13.shape
    f_rows, d = ex.w2.shape[-2:]
    # at 64-row blocks the float32 accumulators spill: the down kernel's at 4 warps (H200, 2048 tokens), the
    # gate/up kernel's two at 64 columns (B300)
    wide = bm >= 64
    if wide and scale is not None:
        # rows scaled in the kernel live in tensor memory on Blackwell, past B300's 512 columns at 64-row blocks
        # (deviceless compile: 576 asked); at these prefill widths XLA's product is one launch among thousands
        x, scale = (scale * x).astype(x.dtype), None
    down_warps = max(tiles.num_warps, tiles.num_warps_wide) if wide else tiles.num_warps
    params = pltriton.CompilerParams(num_warps=down_warps, num_stages=tiles.num_stages)
    params_gate_up = pltriton.CompilerParams(num_warps=tiles.num_warps_gate_up, num_stages=tiles.num_stages)
    expert_spec = pl.BlockSpec((nb,), lambda b, n: (0,))

    bn = _block_n(f, tiles.block_n_gate_up_wide if wide else tiles.block_n_gate_up)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, n_chunks=d_rows // WORD_ROWS, k=k, scaled=scale is not None),
        grid=(nb, f // bn),
        in_specs=[
            expert_spec,
            pl.BlockSpec((bm,), lambda b, n: (b,)),
            pl.BlockSpec(x.shape, lambda b, n: (0, 0)),
            *([pl.BlockSpec(x.shape[1:], lambda b, n: (0,))] if scale is not None else []),
            pl.BlockSpec((n_exp, 2, d_rows, bn), lambda b, n: (0, 0, 0, n)),
            pl.BlockSpec((n_exp, 2, d_rows // 4, bn), lambda b, n: (0, 0, 0, n)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda b, n: (b, n)),
        out_shape=jax.ShapeDtypeStruct((row_pair.shape[0], f), x.dtype),
        compiler_params=params_gate_up,
        interpret=interpret,
        name="int4_moe_gate_up",
    )(block_expert, row_pair, x, *([] if scale is None else [scale]), ex.w13, ex.s13)
    h = jnp.pad(h, ((0, 0), (0, f_rows * 8 - f)))   # zero inputs for the padded word rows (tiny models only)

    bn = _block_n(d, tiles.block_n_down)
    return pl.pallas_call(
        functools.partial(_down_kernel, n_chunks=f_rows // WORD_ROWS, m=x.shape[0] * k),
        grid=(nb, d // bn),
        in_specs=[
            expert_spec,
            pl.BlockSpec((bm,), lambda b, n: (b,)),
            pl.BlockSpec((bm, h.shape[1]), lambda b, n: (b, 0)),
            pl.BlockSpec((n_exp, f_rows, bn), lambda b, n: (0, 0, n)),
            pl.BlockSpec((n_exp, f_rows // 4, bn), lambda b, n: (0, 0, n)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda b, n: (b, n)),
        out_shape=jax.ShapeDtypeStruct((row_pair.shape[0], d), F32),
        compiler_params=params,
        interpret=interpret,
        name="int4_moe_down",
    )(block_expert, row_pair, h, ex.w2, ex.s2)


# ---- placement: routing.sort_by_expert's counting method as one kernel -------------------------------------------

# Most (token, slot) pairs placed by ``place_pallas``; above, routing.sort_by_expert's XLA paths (prefill, big
# batches). The kernel's loops cost O(pairs^2 / chunk) steps per program.
PLACE_MAX_PAIRS = 512
PLACE_BLOCK_ROWS = 128         # padded rows per program (a power of two >= bm)
PLACE_TILE = 8192              # elements of one comparison tile: [pairs, chunk] int32 in 4 warps' registers


PLACE_COLS = 128               # columns of x one program gathers (place_rows): a [128, 128] tile in registers


def _place_kernel(ids_ref, *refs, m: int, bm: int, chunk: int, k: int | None):
    """Comparisons in [pairs, chunk] tiles, so that registers hold them (all pairs at once spills). ``k`` not None:
    refs are (x, scale, row_pair, block_expert, pair_row, xs) and program ``(i, j)`` also writes columns ``j`` of
    its rows of ``xs`` (``place_rows``); programs ``(i, 0)`` write the placement."""
    if k is None:
        row_pair_ref, block_expert_ref, pair_row_ref = refs
    else:
        x_ref, scale_ref, row_pair_ref, block_expert_ref, pair_row_ref, xs_ref = refs
    mp, rows_per = ids_ref.shape[0], row_pair_ref.shape[0]
    big = jnp.iinfo(jnp.int32).max

    def ids(start, n):          # pairs start.. (+n) and their experts; past the M pairs (padding) expert `big`
        p = start + jnp.arange(n, dtype=jnp.int32)
        return p, jnp.where(p < m, ids_ref[pl.ds(start, n)], big)

    p_all, e_all = ids(0, mp)

    def earlier_same(p, e, q, f):       # [len(p), len(q)]: q before p with p's expert
        return (f[None, :] == e[:, None]) & (q[None, :] < p[:, None])

    def count_rank(c, rank):            # each pair's rank among its expert's pairs, a chunk of the others at a time
        q, f = ids(c * chunk, chunk)
        return rank + jnp.sum(earlier_same(p_all, e_all, q, f).astype(jnp.int32), axis=1)

    rank = jax.lax.fori_loop(0, mp // chunk, count_rank, jnp.zeros((mp,), jnp.int32))
    opens = (p_all < m) & (rank % bm == 0)        # the pairs that open a block of their expert
    # read here: interpret mode cannot read them inside the loop
    i = pl.program_id(0)
    first_column = i >= 0 if k is None else pl.program_id(1) == 0     # traced: pl.when takes no constant
    rows = i * rows_per + jnp.arange(rows_per, dtype=jnp.int32)
    first = i * rows_per + bm * jnp.arange(rows_per // bm, dtype=jnp.int32)

    def place(c, acc):                  # a chunk of pairs: their rows, then the rows and blocks they fill
        row_pair, block_expert = acc
        p, e = ids(c * chunk, chunk)
        rank_c = jnp.sum(earlier_same(p, e, p_all, e_all).astype(jnp.int32), axis=1)
        below = jnp.sum(((e_all[None, :] < e[:, None]) & opens[None, :]).astype(jnp.int32), axis=1)
        pair_row = jnp.where(p < m, below * bm + rank_c, -1)

        @pl.when((i == 0) & first_column)
        def _():
            pair_row_ref[pl.ds(c * chunk, chunk)] = pair_row

        hit = pair_row[None, :] == rows[:, None]
        row_pair = jnp.minimum(row_pair, jnp.min(jnp.where(hit, p[None, :], m), axis=1))
        opened = pair_row[None, :] == first[:, None]
        block_expert = jnp.maximum(block_expert, jnp.max(jnp.where(opened, e[None, :], -1), axis=1))
        return row_pair, block_expert

    row_pair, block_expert = jax.lax.fori_loop(
        0, mp // chunk, place, (jnp.full((rows_per,), m, jnp.int32), jnp.full((rows_per // bm,), -1, jnp.int32)))

    @pl.when(first_column)
    def _():
        row_pair_ref[...] = row_pair
        block_expert_ref[...] = block_expert

    if k is not None:       # xs[r] = scale * x[token of r], zeros for padding rows (routing.gather_rows)
        tokens = x_ref.shape[0]
        cols = pl.ds(pl.program_id(1) * xs_ref.shape[1], xs_ref.shape[1])
        x = x_ref[jnp.minimum(row_pair // k, tokens - 1), cols].astype(F32)
        xs = x * scale_ref[cols].astype(F32)[None, :]
        xs_ref[...] = jnp.where((row_pair < m)[:, None], xs, 0).astype(xs_ref.dtype)


def _place_call(topk_idx: jax.Array, block_m: int, nb: int, interpret: bool, x=None, scale=None, k=None):
    """``place_pallas`` (x None) or ``place_rows``'s kernel: (Routing, xs or None)."""
    flat = topk_idx.reshape(-1).astype(jnp.int32)
    m = flat.shape[0]
    if m > PLACE_MAX_PAIRS:
        raise ValueError(f"the placement kernel places at most {PLACE_MAX_PAIRS} pairs, got {m}")
    mp = next_pow2(m)
    rows_per = max(PLACE_BLOCK_ROWS, block_m)
    rows = nb * block_m
    gather = x is not None
    grid = (pl.cdiv(rows, rows_per),) + ((x.shape[1] // PLACE_COLS,) if gather else ())
    at = (lambda f: (lambda i, j: f(i))) if gather else (lambda f: f)    # index maps that ignore the column
    in_specs = [pl.BlockSpec((mp,), at(lambda i: (0,)))]
    out_specs = [pl.BlockSpec((rows_per,), at(lambda i: (i,))),
                 pl.BlockSpec((rows_per // block_m,), at(lambda i: (i,))),
                 pl.BlockSpec((mp,), at(lambda i: (0,)))]
    out_shape = [jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((nb,), jnp.int32),
                 jax.ShapeDtypeStruct((m,), jnp.int32)]
    operands = (flat,)
    if gather:
        in_specs += [pl.BlockSpec(x.shape, lambda i, j: (0, 0)), pl.BlockSpec(scale.shape, lambda i, j: (0,))]
        out_specs.append(pl.BlockSpec((rows_per, PLACE_COLS), lambda i, j: (i, j)))
        out_shape.append(jax.ShapeDtypeStruct((rows, x.shape[1]), x.dtype))
        operands += (x, scale)
    out = pl.pallas_call(
        functools.partial(_place_kernel, m=m, bm=block_m, chunk=min(mp, max(16, PLACE_TILE // mp)), k=k),
        grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="int4_moe_place",
    )(*operands)
    return Routing(*out[:3]), (out[3] if gather else None)


def place_pallas(topk_idx: jax.Array, block_m: int, nb: int, interpret: bool) -> Routing:
    """``routing.sort_by_expert(topk_idx, E, block_m)`` (``nb`` = ``routing.num_blocks``) as one kernel, for at
    most ``PLACE_MAX_PAIRS`` pairs: the same ``Routing`` exactly, by the counting method (each pair's rank in its
    expert and the blocks of lower experts, by comparing every pair with every other). Grid: one program per
    ``PLACE_BLOCK_ROWS`` padded rows; each recomputes the pairs' rows (a few hundred thousand compares) and
    writes its rows' pairs and its blocks' experts; program 0 writes every pair's row. It replaces the counting
    method's four XLA kernels."""
    return _place_call(topk_idx, block_m, nb, interpret)[0]


def place_rows_pallas(topk_idx: jax.Array, x: jax.Array, scale: jax.Array, block_m: int, nb: int,
                      interpret: bool) -> tuple[Routing, jax.Array]:
    """``place_pallas`` and ``routing.gather_rows(scale * x, ...)`` in one kernel: (Routing, xs [nb * bm, D]),
    for ``x`` [T, D] with D a multiple of ``PLACE_COLS`` and ``scale`` [D]. Grid: (row programs, D /
    ``PLACE_COLS``); every program places the pairs (it needs its rows' tokens), programs of column 0 write the
    placement. What it saves: the gather as an XLA kernel of its own (one launch per MoE layer)."""
    t, k = topk_idx.shape
    if x.ndim != 2 or x.shape[0] != t or x.shape[1] % PLACE_COLS or scale.shape != x.shape[1:]:
        raise ValueError(f"place_rows_pallas takes x [T={t}, D] with D a multiple of {PLACE_COLS} and scale [D]; "
                         f"got x {x.shape}, scale {scale.shape}")
    return _place_call(topk_idx, block_m, nb, interpret, x, scale, k)


def _place_supports(pairs: int, lowering: Lowering) -> str | None:
    if pairs > PLACE_MAX_PAIRS:
        return f"the placement kernel places at most {PLACE_MAX_PAIRS} (token, slot) pairs, got {pairs}"
    return None


# The (token, slot) pairs' placement by expert that both GPU MoE paths share; its call is the number of pairs
PLACEMENT = Op("placement", (
    Implementation("pallas", _place_supports, f"any GPU (interpret mode elsewhere); at most {PLACE_MAX_PAIRS} pairs"),
    Implementation("xla", always, "every call (routing.sort_by_expert)"),
))


def place(topk_idx: jax.Array, num_experts: int, block_m: int, interpret: bool) -> Routing:
    """The GPU paths' placement (Triton's and Mosaic GPU's kernels share it), inside their GPU (or interpret-mode)
    lowering: ``PLACEMENT``'s choice, ``place_pallas`` (one kernel) or ``routing.sort_by_expert`` on XLA. Both
    give the same ``Routing``."""
    if PLACEMENT.resolve(topk_idx.size, registry.gpu(bool(interpret))) == "pallas":
        return place_pallas(topk_idx, block_m, num_blocks(topk_idx.size, num_experts, block_m), bool(interpret))
    return sort_by_expert(topk_idx, num_experts, block_m)


def place_rows(topk_idx: jax.Array, x: jax.Array, scale: jax.Array | None, num_experts: int, block_m: int,
               width: int, interpret: bool) -> tuple[Routing, jax.Array]:
    """``place`` and the rows it orders, ``routing.gather_rows(scale * x, routing, k, width)`` (``scale`` None:
    ones): one kernel where ``PLACEMENT`` takes the pairs and ``x``'s columns come in whole ``PLACE_COLS``
    (the Mosaic GPU path: Hopper's TMA copies boxes, not rows, so its experts read gathered rows), else ``place``
    and an XLA gather."""
    scale = jnp.ones(x.shape[1:], x.dtype) if scale is None else scale
    if width % PLACE_COLS == 0 and PLACEMENT.resolve(topk_idx.size, registry.gpu(bool(interpret))) == "pallas":
        pad = ((0, 0), (0, width - x.shape[1]))         # no-op unless D is not whole chunks (tiny models)
        nb = num_blocks(topk_idx.size, num_experts, block_m)
        return place_rows_pallas(topk_idx, jnp.pad(x, pad), jnp.pad(scale, pad[1]), block_m, nb, bool(interpret))
    routing = place(topk_idx, num_experts, block_m, interpret)
    return routing, gather_rows(scale * x, routing, topk_idx.shape[1], width)
