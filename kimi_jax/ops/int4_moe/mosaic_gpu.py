"""The INT4 routed experts as two grouped Mosaic GPU kernels (``plgpu.kernel``, Hopper wgmma), first version.

Same contract as ``pallas_triton.experts_pallas``: ``experts_mosaic(xs, block_expert, ex, interpret)`` takes the
rows gathered by ``routing.py`` (``nb`` row blocks of ``bm`` rows, one expert per block, expert -1 = unused)
and returns float32 ``[nb * bm, D]``. Not wired into ``api.py`` yet (docs/mosaic_gpu.md).

Kernel structure (both projections): grid ``(nb, N / bn)`` CTAs of one warpgroup (Warpgroup lowering
semantics). CTA ``(b, n)`` reads its block's expert id from global memory, skips the block when it is -1, and
loops over ``K`` in chunks of 256 inputs. Per chunk it

1. TMA-copies the chunk's activations as 8 ``[bm, 32]`` group tiles (64-byte swizzle, the wgmma LHS layout),
   the ``[32, bn]`` int32 word tile(s) of the expert (no swizzle: they are only read into registers) and the
   ``[8, bn]`` bf16 scale rows, all on one mbarrier;
2. for each nibble plane ``i`` (= scale group ``8c + i``): loads the word tile into registers, unpacks
   ``q = ((w >> 4i) & 15) - 8`` and converts it to bf16 (exact: |q| <= 8), stores it to a swizzled ``[32, bn]``
   shared-memory tile (the wgmma RHS layout), and issues ``wgmma([bm, 32] x [32, bn])`` into a fresh float32
   accumulator; the partial sum is scaled by the group's scale row in float32 and added to the running
   accumulator (the Triton kernel's numerics: exact int4 weights, scale applied to the partial sum).

gate/up does this for both matrices of ``w13`` and writes ``h = silu(g) * u`` in the activation dtype; down
does it for ``w2`` and writes float32. ``bm`` must be 64 (wgmma's M per warpgroup); at decode most of a block's
rows are padding, which costs tensor-core work but no weight bytes. Depth-1 pipeline: the copies of chunk
``c + 1`` are issued only after chunk ``c``'s wgmmas have completed (see docs/mosaic_gpu.md for what is left).
"""

from __future__ import annotations

import dataclasses
import functools

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
    block_n_gate_up: int = 64
    block_n_down: int = 128


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


def _grouped_kernel(xs, block_expert, w, s, *, n_mats: int, bn: int, out_dtype, epilogue, interpret):
    """One grouped projection. ``w`` int32 ``[E, n_mats, K/8, N]``, ``s`` bf16 ``[E, n_mats, K/32, N]``;
    returns ``epilogue(acc_0, ..., acc_{n_mats-1})`` per row block, ``[nb * bm, N]`` of ``out_dtype``."""
    nb = block_expert.shape[0]
    bm = xs.shape[0] // nb
    k_rows, n = w.shape[-2:]
    n_chunks = k_rows // WORD_ROWS
    if bm != MOSAIC_BLOCK_M:
        raise ValueError(f"the Mosaic GPU kernel needs row blocks of {MOSAIC_BLOCK_M}, got {bm}")
    if n % bn or xs.shape[1] != n_chunks * CHUNK:
        raise ValueError(f"shapes: xs {xs.shape}, w {w.shape}, bn {bn}")
    x_dtype = xs.dtype

    def body(be_gmem, x_gmem, w_gmem, s_gmem, o_gmem, x_smem, w_smem, s_smem, q_smem, o_smem, bar):
        b = lax.axis_index("b")
        j = lax.axis_index("n")
        e = be_gmem[b]
        cols = pl.ds(j * bn, bn)

        @pl.when(e >= 0)
        def _():
            def chunk(c, accs):
                for i in range(GROUPS):
                    plgpu.copy_gmem_to_smem(
                        x_gmem.at[pl.ds(b * bm, bm), pl.ds(c * CHUNK + i * GROUP_SIZE, GROUP_SIZE)],
                        x_smem.at[i], bar)
                for m in range(n_mats):
                    plgpu.copy_gmem_to_smem(w_gmem.at[e, m, pl.ds(c * WORD_ROWS, WORD_ROWS), cols],
                                            w_smem.at[m], bar)
                    plgpu.copy_gmem_to_smem(s_gmem.at[e, m, pl.ds(c * GROUPS, GROUPS), cols], s_smem.at[m], bar)
                plgpu.barrier_wait(bar)
                accs = list(accs)
                for m in range(n_mats):
                    words = w_smem[m]
                    scales = s_smem[m].astype(F32)
                    for i in range(GROUPS):
                        q = ((words >> (4 * i)) & 0xF) - 8
                        q_smem[m] = q.astype(x_dtype)
                        plgpu.commit_smem()

                        def mma(acc_ref, m=m, i=i):
                            plgpu.wgmma(acc_ref, x_smem.at[i], q_smem.at[m])
                            plgpu.wgmma_wait(0)
                            return acc_ref[...]

                        part = pl.run_scoped(mma, plgpu.ACC((bm, bn), F32))
                        accs[m] = accs[m] + part * scales[i][None, :]
                return tuple(accs)

            zeros = tuple(jnp.zeros((bm, bn), F32) for _ in range(n_mats))
            accs = lax.fori_loop(0, n_chunks, chunk, zeros)
            o_smem[...] = epilogue(*accs).astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(b * bm, bm), cols])
            plgpu.wait_smem_to_gmem(0)

    n_copies = GROUPS + 2 * n_mats
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((xs.shape[0], n), out_dtype),
        grid=(nb, n // bn),
        grid_names=("b", "n"),
        scratch_types=[
            plgpu.SMEM((GROUPS, bm, GROUP_SIZE), x_dtype, transforms=_swizzled(GROUP_SIZE, x_dtype)),
            plgpu.SMEM((n_mats, WORD_ROWS, bn), jnp.int32),
            plgpu.SMEM((n_mats, GROUPS, bn), s.dtype),
            plgpu.SMEM((n_mats, GROUP_SIZE, bn), x_dtype, transforms=_swizzled(bn, x_dtype)),
            plgpu.SMEM((bm, bn), out_dtype),
            plgpu.Barrier(num_arrivals=n_copies),
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
    h = _grouped_kernel(xs, block_expert, ex.w13, ex.s13, n_mats=2, bn=tiles.block_n_gate_up,
                        out_dtype=xs.dtype, epilogue=_swiglu, interpret=interpret)
    h = jnp.pad(h, ((0, 0), (0, f_rows * 8 - f)))   # zero inputs for the padded word rows (tiny models only)
    return _grouped_kernel(h, block_expert, ex.w2[:, None], ex.s2[:, None], n_mats=1, bn=tiles.block_n_down,
                           out_dtype=F32, epilogue=lambda a: a, interpret=interpret)


def int4_moe_mosaic(x, topk_idx, topk_weight, experts: Int4Experts, *, interpret=False) -> jax.Array:
    """``api.int4_moe``'s computation through the Mosaic GPU kernels (routing with 64-row blocks)."""
    from kimi_jax.ops.int4_moe.routing import combine, gather_rows, sort_by_expert

    t, k = topk_idx.shape
    routing = sort_by_expert(topk_idx, experts.num_experts, MOSAIC_BLOCK_M)
    xs = gather_rows(x, routing, k, experts.w13.shape[-2] * 8)
    out = experts_mosaic(xs, routing.block_expert, experts, interpret)
    return combine(out, routing, topk_weight).astype(jnp.float32)
