"""The INT4 routed experts as two grouped Mosaic GPU kernels (``plgpu.kernel``, Hopper wgmma), first version.

``experts_mosaic(xs, block_expert, ex, interpret)`` takes the rows gathered by ``routing.gather_rows`` (``nb``
row blocks of ``bm`` rows, one expert per block, expert -1 = unused) and returns float32 ``[nb * bm, D]``: the
contract the Triton kernel had before it read its own rows of ``x`` (``pallas_triton.experts_pallas``, which
saves that gather). Not wired into ``api.py`` yet (docs/mosaic_gpu.md).

Kernel structure (both projections): grid ``(nb, N / cta_n)`` CTAs of one warpgroup (Warpgroup lowering
semantics). CTA ``(b, n)`` reads its block's expert id from global memory, skips the block when it is -1, and
loops over ``K`` in chunks of 256 inputs. Per chunk it

1. TMA-copies the chunk's activations as 8 ``[bm, 32]`` group tiles (64-byte swizzle, the wgmma LHS layout),
   two ``[32, bn]`` int32 word tiles stacked into one ``[64, bn]`` tile (no swizzle: only read into registers)
   and their ``[8, bn]`` bf16 scale rows, all on one mbarrier, into one slot of a ``stages``-deep ring;
2. for each nibble plane ``i`` (= scale group ``8c + i``, a ``fori_loop``): loads the words into registers,
   unpacks ``q = ((w >> 4i) & 15) - 8`` to bf16 (exact: |q| <= 8), stores it to a 64-byte-swizzled ``[64, bn]``
   smem tile (the wgmma RHS layout), and issues one ``wgmma([bm, 32] x [32, bn])`` per stacked tile into a
   fresh float32 accumulator; each partial sum is scaled by its group's scale row in float32 and added to the
   running accumulator (the Triton kernel's numerics: exact int4 weights, scale applied to the partial sum).

Pipeline: the ring has ``stages`` slots (41 KiB each: x 32 KiB, words 8 KiB, scales 1 KiB), one mbarrier per
slot. Before the loop the copies of chunks ``0 .. stages-2`` are issued; chunk ``c`` first refills the slot chunk
``c - 1`` used with chunk ``c + stages - 1``, then waits for its own slot, so ``stages - 1`` chunks are in
flight while chunk ``c`` unpacks and multiplies. ``stages = 1`` is the unpipelined kernel (copy, wait,
compute). One warpgroup both copies and computes, so no consumer barriers: a slot is refilled only after the
warpgroup finished with it (wgmmas waited for, ordinary loads fenced by ``commit_smem``).

gate/up stacks the gate and up tiles of the same ``bn = 32`` columns and writes ``h = silu(g) * u`` in the
activation dtype; down stacks two adjacent 32-column tiles of ``w2`` and writes float32. ``bm`` must be 64
(wgmma's M per warpgroup); at decode most of a block's rows are padding, which costs tensor-core work and
activation/output bytes but no weight bytes. Why 32-column tiles and stacked word tiles: docs/mosaic_gpu.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kimi_jax.ops.int4_format import CHUNK, GROUP_SIZE, WORD_ROWS, Int4Experts
from kimi_jax.ops.numerics import F32

MOSAIC_BLOCK_M = 64      # rows per routing block: one wgmma M tile of one warpgroup
GROUPS = CHUNK // GROUP_SIZE   # 8 scale groups (nibble planes) per 256-input chunk


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_n_gate_up: int = 32
    block_n_down: int = 32     # x2: a CTA writes two adjacent 32-column tiles
    # Chunks in the copy ring (1 = no TMA/compute overlap), 41 KiB of smem each. 2: a CTA needs 90 KiB (gate/up)
    # or 102 KiB (down), so two CTAs share an SM's 228 KiB and overlap each other's serial unpack-and-wgmma work;
    # 3-4 (up to 184 KiB, one CTA an SM) keep more copies in flight per CTA. Not measured on a GPU yet.
    stages: int = 2


def _interpret_params(interpret):
    if not interpret:
        return None
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        return InterpretGPUParams()
    return interpret


def _swizzled(minor_elems: int, dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor_elems * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _grouped_kernel(xs, block_expert, w, s, *, pair_cols: bool, bn: int, stages: int, out_dtype, epilogue,
                    interpret):
    """One grouped projection over two ``[K, bn]`` weight tiles per CTA, stacked into one ``[64, bn]`` word tile.

    ``w`` int32 ``[E, M, K/8, N]``, ``s`` bf16 ``[E, M, K/32, N]``. ``pair_cols=False`` (gate/up, ``M = 2``):
    tile ``m`` = matrix ``m``, columns ``n*bn``; ``epilogue(acc_0, acc_1)`` -> one ``[bm, bn]`` output tile.
    ``pair_cols=True`` (down, ``M = 1``): tile ``m`` = columns ``(2n + m)*bn`` of the one matrix; each
    accumulator is written as it is. Stacking two 32-row word tiles makes the register tile 64 rows, which
    Mosaic GPU's layout inference can store into a swizzled shared-memory tile (a 32-row int32 tile cannot:
    "Failed to infer a possible set of layouts", docs/mosaic_gpu.md)."""
    nb = block_expert.shape[0]
    bm = xs.shape[0] // nb
    k_rows, n = w.shape[-2:]
    n_chunks = k_rows // WORD_ROWS
    cta_n = 2 * bn if pair_cols else bn
    if bm != MOSAIC_BLOCK_M:
        raise ValueError(f"the Mosaic GPU kernel needs row blocks of {MOSAIC_BLOCK_M}, got {bm}")
    if n % cta_n or xs.shape[1] != n_chunks * CHUNK:
        raise ValueError(f"shapes: xs {xs.shape}, w {w.shape}, bn {bn}")
    x_dtype = xs.dtype
    n_out = 2 if pair_cols else 1

    def body(be_gmem, x_gmem, w_gmem, s_gmem, o_gmem, x_smem, w_smem, s_smem, q_smem, o_smem, bars):
        b = lax.axis_index("b")
        j = lax.axis_index("n")
        e = be_gmem[b]

        def src(m):      # (matrix, first column) of weight tile m
            return (0, (2 * j + m) * bn) if pair_cols else (m, j * bn)

        def fetch(c):    # chunk c's activations, words and scales into ring slot c % stages, on that slot's barrier
            slot = lax.rem(c, stages)
            bar = bars.at[slot]
            for i in range(GROUPS):
                plgpu.copy_gmem_to_smem(
                    x_gmem.at[pl.ds(b * bm, bm), pl.ds(c * CHUNK + i * GROUP_SIZE, GROUP_SIZE)],
                    x_smem.at[slot, i], bar)
            for m in range(2):
                mat, col = src(m)
                plgpu.copy_gmem_to_smem(w_gmem.at[e, mat, pl.ds(c * WORD_ROWS, WORD_ROWS), pl.ds(col, bn)],
                                        w_smem.at[slot, pl.ds(m * WORD_ROWS, WORD_ROWS)], bar)
                plgpu.copy_gmem_to_smem(s_gmem.at[e, mat, pl.ds(c * GROUPS, GROUPS), pl.ds(col, bn)],
                                        s_smem.at[slot, m], bar)

        @pl.when(e >= 0)
        def _():
            for c in range(min(stages - 1, n_chunks)):    # the ring's first stages - 1 chunks
                fetch(c)

            def chunk(c, accs):
                slot = lax.rem(c, stages)
                # Refill the slot chunk c - 1 used with chunk c + stages - 1. Chunk c - 1's wgmmas have completed
                # (waited below), but its words and scales were read by every thread with ordinary loads: the
                # warpgroup barrier and async-proxy fence of commit_smem keep the TMA from overwriting them early.
                plgpu.commit_smem()
                pl.when(c + stages - 1 < n_chunks)(lambda: fetch(c + stages - 1))
                plgpu.barrier_wait(bars.at[slot])

                def group(i, accs):
                    words = w_smem[slot]                   # [64, bn] int32: both tiles' word rows
                    q_smem[...] = (((words >> (4 * i)) & 0xF) - 8).astype(x_dtype)
                    plgpu.commit_smem()
                    accs = list(accs)
                    for m in range(2):
                        def mma(acc_ref, m=m):
                            plgpu.wgmma(acc_ref, x_smem.at[slot, i], q_smem.at[pl.ds(m * GROUP_SIZE, GROUP_SIZE)])
                            plgpu.wgmma_wait(0)
                            return acc_ref[...]

                        part = pl.run_scoped(mma, plgpu.ACC((bm, bn), F32))
                        accs[m] = accs[m] + part * s_smem[slot, m, i].astype(F32)[None, :]
                    return tuple(accs)

                return lax.fori_loop(0, GROUPS, group, accs)

            zeros = tuple(jnp.zeros((bm, bn), F32) for _ in range(2))
            accs = lax.fori_loop(0, n_chunks, chunk, zeros)
            outs = accs if pair_cols else (epilogue(*accs),)
            for m, out in enumerate(outs):
                o_smem[m] = out.astype(out_dtype)
            plgpu.commit_smem()
            for m in range(n_out):
                plgpu.copy_smem_to_gmem(o_smem.at[m], o_gmem.at[pl.ds(b * bm, bm), pl.ds(j * cta_n + m * bn, bn)])
            plgpu.wait_smem_to_gmem(0)

    n_copies = GROUPS + 4
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((xs.shape[0], n), out_dtype),
        grid=(nb, n // cta_n),
        grid_names=("b", "n"),
        scratch_types=[
            plgpu.SMEM((stages, GROUPS, bm, GROUP_SIZE), x_dtype, transforms=_swizzled(GROUP_SIZE, x_dtype)),
            plgpu.SMEM((stages, 2 * WORD_ROWS, bn), jnp.int32),
            plgpu.SMEM((stages, 2, GROUPS, bn), s.dtype),
            plgpu.SMEM((2 * GROUP_SIZE, bn), x_dtype, transforms=_swizzled(bn, x_dtype)),
            plgpu.SMEM((n_out, bm, bn), out_dtype, transforms=_swizzled(bn, out_dtype)),
            plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret),
    )
    return kernel(block_expert, xs, w, s)


def _swiglu(g, u):
    return g * jax.nn.sigmoid(g) * u


def experts_mosaic(xs: jax.Array, block_expert: jax.Array, ex: Int4Experts, interpret=False,
                   tiles: Tiles | None = None) -> jax.Array:
    """Grouped INT4 SwiGLU experts over ``routing.py``'s row blocks; ``interpret``: True (or an
    ``InterpretGPUParams``) runs the kernels in Pallas' GPU interpret mode on the CPU."""
    tiles = tiles or Tiles()
    f_rows, d = ex.w2.shape[-2:]
    f = ex.w13.shape[-1]
    if xs.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"the Mosaic GPU kernel runs 16-bit activations (wgmma), got {xs.dtype}")
    h = _grouped_kernel(xs, block_expert, ex.w13, ex.s13, pair_cols=False, bn=tiles.block_n_gate_up,
                        stages=tiles.stages, out_dtype=xs.dtype, epilogue=_swiglu, interpret=interpret)
    h = jnp.pad(h, ((0, 0), (0, f_rows * 8 - f)))   # zero inputs for the padded word rows (tiny models only)
    return _grouped_kernel(h, block_expert, ex.w2[:, None], ex.s2[:, None], pair_cols=True, bn=tiles.block_n_down,
                           stages=tiles.stages, out_dtype=F32, epilogue=lambda a: a, interpret=interpret)


def int4_moe_mosaic(x, topk_idx, topk_weight, experts: Int4Experts, *, interpret=False,
                    tiles: Tiles | None = None) -> jax.Array:
    """``api.int4_moe``'s computation through the Mosaic GPU kernels (routing with 64-row blocks)."""
    from kimi_jax.ops.int4_moe.routing import combine, gather_rows, sort_by_expert

    t, k = topk_idx.shape
    routing = sort_by_expert(topk_idx, experts.num_experts, MOSAIC_BLOCK_M)
    xs = gather_rows(x, routing, k, experts.w13.shape[-2] * 8)
    out = experts_mosaic(xs, routing.block_expert, experts, interpret, tiles)
    return combine(out, routing, topk_weight).astype(jnp.float32)
