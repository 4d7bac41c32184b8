"""Routed-expert SwiGLU over INT4 weights: a grouped Pallas kernel, an XLA path and an independent reference.

``int4_moe(x, topk_idx, topk_weight, experts)`` returns ``y[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) *
up_e(x_t))`` with ``e = topk_idx[t, j]``, for the experts of one MoE layer in the kernel layout of
``kimi_jax.ops.int4_format.Int4Experts`` (K-major int32 words; nibble ``i`` of word row ``32c + j`` = input
``256c + 32i + j``; bf16 scales ``[K/32, N]``).

**Grouping** (shared by both implementations, plain jnp, static shapes). The ``M = T*k`` (token, slot) pairs are
sorted by expert; each expert's run is padded to a multiple of the row block ``bm``, so every row block belongs
to exactly one expert (the layout vLLM's ``moe_align_block_size`` produces). The number of blocks is bounded
statically by ``nb = (M + min(E, M) * (bm - 1)) // bm``; blocks past the used ones carry expert ``-1`` and are
skipped. ``xs`` = the tokens' activations gathered in that order (padding rows are zeros). After the experts,
each pair's output row is gathered back and the ``k`` rows of a token are summed with their routing weights in
float32 (a gather, so padding rows and skipped blocks are never read).

**impl="pallas"**: two ``pl.pallas_call`` kernels in the Triton-lowering subset (BlockSpecs, ``pl.program_id``,
``pl.when``, ``fori_loop``, power-of-two loads; no scalar prefetch, which the Triton backend lacks, so each
program reads its block's expert id from a small int32 array and indexes the weights with it):

1. gate/up: grid ``(nb, F / bn)``. Program ``(b, n)`` loops over ``K`` in chunks of 256 inputs; per chunk it
   loads one ``[32, bn]`` word tile of gate and one of up, and for each nibble plane ``i`` (= scale group
   ``8c + i``) unpacks it with a shift and mask, does ``[bm, 32] x [32, bn]`` dots against the matching slice
   of ``xs`` (activation dtype, float32 accumulation) and adds them scaled by the group's scale row (scaling the
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
- no split-K: at batch 1 the grid already has >= 256 programs of 28 (gate/up) or 8 (down) chunks each.

**impl="xla"** (the CPU default): the same grouping, then a ``lax.scan`` over row blocks that dequantizes only
the block's expert (gathered by id) and runs the SwiGLU with plain dots; ``bm`` up to 512, since on CPU fewer,
larger blocks amortise the dequantization. Memory stays at one dequantized expert.

``int4_moe_reference``: the independent oracle for tests. It exports the experts back to the compressed-tensors
layout, dequantizes every expert with ``int4_format.dequantize_int4`` and evaluates all experts densely for every
token in float32 at HIGHEST precision; only for small shapes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.int4_format import (
    CHUNK,
    GROUP_SIZE,
    WORD_ROWS,
    Int4Experts,
    dequantize_int4,
    dequantize_kernel_layout,
)

IMPLS = ("xla", "pallas")
F32 = jnp.float32

# Pallas (Triton) tiles; see the module docstring.
PALLAS_BLOCK_M = (16, 64)     # min, max rows per block
PALLAS_BLOCK_N_GATE_UP = 64
PALLAS_BLOCK_N_DOWN = 128
PALLAS_NUM_WARPS = 4
PALLAS_NUM_STAGES = 3
XLA_BLOCK_M = (8, 512)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_block_m(num_pairs: int, num_experts: int, lo: int, hi: int) -> int:
    """Power of two near the mean number of rows per touched expert, clamped to [lo, hi]."""
    touched = max(1, min(num_experts, num_pairs))
    return min(hi, max(lo, _next_pow2(-(-num_pairs // touched))))


def _block_n(n: int, target: int) -> int:
    """Largest power of two <= target that divides n (Triton loads need power-of-two tiles, dots >= 16)."""
    bn = target
    while bn > 16 and n % bn:
        bn //= 2
    if n % bn:
        raise ValueError(f"impl='pallas' needs the expert dims to be multiples of 16, got {n}; use impl='xla'")
    return bn


# ---------------------------------------------------------------------------------------------------------------
# grouping


class Routing(NamedTuple):
    """Pairs ``p = t*k + j`` sorted by expert into row blocks of ``bm`` rows, one expert per block."""

    row_pair: jax.Array      # int32 [nb * bm]: pair in each padded row, M for padding rows
    block_expert: jax.Array  # int32 [nb]: expert of each block, -1 for unused blocks
    pair_row: jax.Array      # int32 [M]: padded row of each pair


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on sum_e ceil(n_e / bm) when sum_e n_e = M over at most min(E, M) nonempty experts."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def sort_by_expert(topk_idx: jax.Array, num_experts: int, block_m: int) -> Routing:
    flat = topk_idx.reshape(-1).astype(jnp.int32)
    m = flat.shape[0]
    nb = num_blocks(m, num_experts, block_m)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    blocks = -(-counts // block_m)
    block_end = jnp.cumsum(blocks)                   # first block after expert e's run
    row_start = (block_end - blocks) * block_m       # expert e's first padded row
    group_start = jnp.cumsum(counts) - counts        # expert e's first sorted pair
    sorted_e = flat[order]
    dest = row_start[sorted_e] + jnp.arange(m, dtype=jnp.int32) - group_start[sorted_e]
    row_pair = jnp.full(nb * block_m, m, jnp.int32).at[dest].set(order)
    pair_row = jnp.zeros(m, jnp.int32).at[order].set(dest)
    b = jnp.arange(nb, dtype=jnp.int32)
    block_expert = jnp.searchsorted(block_end, b, side="right").astype(jnp.int32)
    block_expert = jnp.where(b < block_end[-1], block_expert, -1)
    return Routing(row_pair, block_expert, pair_row)


def _gather_rows(x: jax.Array, routing: Routing, k: int, width: int) -> jax.Array:
    """xs[r] = x[token of row r] (zeros for padding rows), columns zero-padded to ``width``."""
    x = jnp.pad(x, ((0, 1), (0, width - x.shape[1])))         # row t is the zero row padding rows point at
    return x[routing.row_pair // k]


def _combine(out: jax.Array, routing: Routing, topk_weight: jax.Array) -> jax.Array:
    t, k = topk_weight.shape
    rows = out[routing.pair_row.reshape(t, k)]      # [T, k, D], float32
    return jnp.sum(rows * topk_weight.astype(F32)[..., None], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# XLA path


def _experts_xla(xs: jax.Array, block_expert: jax.Array, ex: Int4Experts) -> jax.Array:
    nb = block_expert.shape[0]
    bm = xs.shape[0] // nb
    dt = xs.dtype
    fp = ex.w2.shape[-2] * 8

    def block(xb, e):
        w13 = dequantize_kernel_layout(ex.w13[e], ex.s13[e]).astype(dt)       # [2, Dp, F]
        g = jnp.dot(xb, w13[0], preferred_element_type=F32)
        u = jnp.dot(xb, w13[1], preferred_element_type=F32)
        h = (jax.nn.silu(g) * u).astype(dt)
        h = jnp.pad(h, ((0, 0), (0, fp - h.shape[1])))
        w2 = dequantize_kernel_layout(ex.w2[e], ex.s2[e]).astype(dt)          # [Fp, D]
        return jnp.dot(h, w2, preferred_element_type=F32)

    def skip(xb, e):
        return jnp.zeros((bm, ex.d_model), F32)

    def step(carry, inp):
        xb, e = inp
        return carry, jax.lax.cond(e >= 0, block, skip, xb, e)

    _, out = jax.lax.scan(step, None, (xs.reshape(nb, bm, -1), block_expert))
    return out.reshape(nb * bm, ex.d_model)


# ---------------------------------------------------------------------------------------------------------------
# Pallas path


def _nibble_dot(x: jax.Array, words: jax.Array, i: int) -> jax.Array:
    """x [bm, 32] @ (nibble plane i of words [32, bn] as q = u - 8), float32 accumulation."""
    q = ((words >> (4 * i)) & 0xF) - 8
    return jnp.dot(x, q.astype(x.dtype), preferred_element_type=F32)


def _gate_up_kernel(block_expert_ref, x_ref, w_ref, s_ref, h_ref, *, n_chunks: int):
    e = block_expert_ref[pl.program_id(0)]

    @pl.when(e >= 0)
    def _():
        def chunk(c, acc):
            acc_g, acc_u = acc
            w_gate = w_ref[e, 0, pl.ds(c * WORD_ROWS, WORD_ROWS), :]
            w_up = w_ref[e, 1, pl.ds(c * WORD_ROWS, WORD_ROWS), :]
            for i in range(8):  # nibble plane i = scale group 8c + i = inputs 256c + 32i .. + 31
                xi = x_ref[:, pl.ds(c * CHUNK + i * GROUP_SIZE, GROUP_SIZE)]
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


def _experts_pallas(xs: jax.Array, block_expert: jax.Array, ex: Int4Experts, interpret: bool) -> jax.Array:
    nb = block_expert.shape[0]
    bm = xs.shape[0] // nb
    n_exp, _, d_rows, f = ex.w13.shape
    f_rows, d = ex.w2.shape[-2:]
    params = pltriton.CompilerParams(num_warps=PALLAS_NUM_WARPS, num_stages=PALLAS_NUM_STAGES)
    expert_spec = pl.BlockSpec((nb,), lambda b, n: (0,))

    bn = _block_n(f, PALLAS_BLOCK_N_GATE_UP)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, n_chunks=d_rows // WORD_ROWS),
        grid=(nb, f // bn),
        in_specs=[
            expert_spec,
            pl.BlockSpec((bm, xs.shape[1]), lambda b, n: (b, 0)),
            pl.BlockSpec((n_exp, 2, d_rows, bn), lambda b, n: (0, 0, 0, n)),
            pl.BlockSpec((n_exp, 2, d_rows // 4, bn), lambda b, n: (0, 0, 0, n)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda b, n: (b, n)),
        out_shape=jax.ShapeDtypeStruct((xs.shape[0], f), xs.dtype),
        compiler_params=params,
        interpret=interpret,
        name="int4_moe_gate_up",
    )(block_expert, xs, ex.w13, ex.s13)
    h = jnp.pad(h, ((0, 0), (0, f_rows * 8 - f)))   # zero inputs for the padded word rows (tiny models only)

    bn = _block_n(d, PALLAS_BLOCK_N_DOWN)
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
        out_shape=jax.ShapeDtypeStruct((xs.shape[0], d), F32),
        compiler_params=params,
        interpret=interpret,
        name="int4_moe_down",
    )(block_expert, h, ex.w2, ex.s2)


# ---------------------------------------------------------------------------------------------------------------
# API


def _check(x, topk_idx, topk_weight, ex: Int4Experts, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if ex.w13.ndim != 4 or ex.w2.ndim != 3:
        raise ValueError(f"int4_moe takes one layer's experts (w13 [E, 2, D/8, F]), got w13 {ex.w13.shape}; "
                         "slice the stacked layer axis first, e.g. jax.tree.map(lambda a: a[i], experts)")
    if x.ndim != 2 or x.shape[1] != ex.d_model:
        raise ValueError(f"x must be [T, {ex.d_model}], got {x.shape}")
    if topk_idx.shape != topk_weight.shape or topk_idx.shape[:1] != x.shape[:1] or topk_idx.ndim != 2:
        raise ValueError(f"topk_idx {topk_idx.shape} and topk_weight {topk_weight.shape} "
                         f"must both be [T={x.shape[0]}, k]")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"topk_idx must be integer, got {topk_idx.dtype}")
    rows_d, rows_f = ex.w13.shape[-2], ex.w2.shape[-2]
    if rows_d % WORD_ROWS or rows_f % WORD_ROWS or {rows_d * 8 - ex.d_model, rows_f * 8 - ex.d_ff} - set(range(CHUNK)):
        raise ValueError(f"expert word rows must come in whole 256-input chunks (w13 {ex.w13.shape}, w2 "
                         f"{ex.w2.shape}); a tensor-parallel shard of F must be a multiple of {CHUNK}")


def _check_block_m(block_m: int, impl: str) -> None:
    lo = PALLAS_BLOCK_M[0] if impl == "pallas" else 1
    if block_m < lo or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {lo} for impl={impl!r}, got {block_m}")


def int4_moe(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, experts: Int4Experts, *,
             impl: str = "xla", interpret: bool | None = None, block_m: int | None = None) -> jax.Array:
    """Routed experts of one MoE layer: ``x [T, D]``, ``topk_idx [T, k]`` int (valid expert ids),
    ``topk_weight [T, k]`` -> float32 ``[T, D]``. The dots run in ``x.dtype`` with float32 accumulation.

    ``impl="pallas"`` runs the Triton-lowered kernels; ``interpret`` defaults to "not on a GPU" (Pallas
    interpret mode on CPU). ``block_m`` overrides the row block (a power of two; >= 16 for pallas).
    """
    _check(x, topk_idx, topk_weight, experts, impl)
    experts = jax.tree.map(jnp.asarray, experts)     # numpy leaves (fresh from the loader) cannot be traced-indexed
    t, k = topk_idx.shape
    m = t * k
    lo, hi = PALLAS_BLOCK_M if impl == "pallas" else XLA_BLOCK_M
    bm = block_m or default_block_m(m, experts.num_experts, lo, hi)
    _check_block_m(bm, impl)
    routing = sort_by_expert(topk_idx, experts.num_experts, bm)
    xs = _gather_rows(x, routing, k, experts.w13.shape[-2] * 8)
    if impl == "xla":
        out = _experts_xla(xs, routing.block_expert, experts)
    else:
        if interpret is None:
            interpret = jax.default_backend() != "gpu"
        out = _experts_pallas(xs, routing.block_expert, experts, interpret)
    return _combine(out, routing, topk_weight)


def int4_moe_reference(x, topk_idx, topk_weight, experts: Int4Experts) -> jax.Array:
    """Independent oracle: every expert dequantized from the compressed-tensors layout, evaluated densely."""
    ct = experts.to_compressed_tensors()
    d, f = experts.d_model, experts.d_ff
    gate = dequantize_int4(ct["gate_packed"], ct["gate_scale"], (f, d))     # [E, F, D], HF [out, in]
    up = dequantize_int4(ct["up_packed"], ct["up_scale"], (f, d))
    down = dequantize_int4(ct["down_packed"], ct["down_scale"], (d, f))     # [E, D, F]
    hp = jax.lax.Precision.HIGHEST
    x = jnp.asarray(x, F32)
    g = jnp.einsum("td,efd->tef", x, gate, precision=hp)
    u = jnp.einsum("td,efd->tef", x, up, precision=hp)
    y = jnp.einsum("tef,edf->ted", jax.nn.silu(g) * u, down, precision=hp)   # [T, E, D]
    coef = jnp.sum(jax.nn.one_hot(topk_idx, experts.num_experts, dtype=F32)
                   * jnp.asarray(topk_weight, F32)[..., None], axis=1)       # [T, E]
    return jnp.einsum("te,ted->td", coef, y, precision=hp)
