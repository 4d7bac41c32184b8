"""The INT4 routed experts as two grouped Mosaic GPU kernels (``plgpu.kernel``: Hopper wgmma, Blackwell tcgen05).

``experts_mosaic(xs, block_expert, ex, interpret)`` takes the rows in ``routing.gather_rows``' order (``nb``
row blocks of ``bm`` rows, one expert per block, expert -1 = unused) and returns float32 ``[nb * bm, D]``: the
contract the Triton kernel had before it read its own rows of ``x`` (``pallas_triton.experts_pallas``). Hopper's
TMA copies boxes, it does not gather rows, so the rows are gathered first: by the placement kernel itself
(``pallas_triton.place_rows``), times the MoE norm's weight, not by an XLA kernel of their own.
``int4_moe_mosaic`` is the whole layer (``api.int4_moe``'s impl="mosaic", and "auto" on Hopper:
``kimi_jax.ops.registry``).

Kernel structure (both projections): grid ``(nb, N / cta_n)`` CTAs of one warpgroup (Warpgroup lowering
semantics). CTA ``(b, n)`` reads its block's expert id from global memory, skips the block when it is -1, and
loops over ``K`` in chunks of 256 inputs. Per chunk it

1. TMA-copies the chunk's activations as 8 ``[bm, 32]`` group tiles (64-byte swizzle, a wgmma operand),
   two ``[32, bn]`` int32 word tiles stacked into one ``[64, bn]`` tile (no swizzle: only read into registers)
   and their ``[8, bn]`` bf16 scale rows, all on one mbarrier, into one slot of a ``stages``-deep ring;
2. for each nibble plane ``i`` (= scale group ``8c + i``, a ``fori_loop``): loads the words into registers,
   unpacks ``q = ((w >> 4i) & 15) - 8`` to bf16 (exact: |q| <= 8) without an int->float conversion
   (``_unpack``), stores it to a 64-byte-swizzled ``[64, bn]``
   smem tile (a wgmma operand), and issues one wgmma per stacked tile (the two tilings below) into a fresh
   float32 accumulator; each partial sum is scaled by its group's scale row in float32 and added to the
   running accumulator (the Triton kernel's numerics: exact int4 weights, scale applied to the partial sum).

Pipeline: the ring has ``stages`` slots, one mbarrier each (a slot is 41 KiB at 64-row blocks: x 32, words 8,
scales 1; 22 KiB at 8-row swapped blocks: x 4, words 16, scales 2). Before the loop the copies of chunks
``0 .. stages-2`` are issued; chunk ``c`` first refills the slot chunk ``c - 1`` used with chunk
``c + stages - 1``, then waits for its own slot, so ``stages - 1`` chunks are in flight while chunk ``c``
unpacks and multiplies. ``stages = 1`` is the unpipelined kernel (copy, wait,
compute). One warpgroup both copies and computes, so no consumer barriers: a slot is refilled only after the
warpgroup finished with it (wgmmas waited for, ordinary loads fenced by ``commit_smem``).

gate/up stacks the gate and up tiles of the same ``bn`` columns and writes ``h = silu(g) * u`` in the
activation dtype; down stacks two adjacent ``bn``-column tiles of ``w2`` and writes float32. Where gate/up's grid
is small (one token: 8 blocks x 4 column tiles), it splits K over a cluster of CTAs (``gate_up_splits``, at
most 8); the cluster's first CTA sums the others' float32 partial sums, read back from global memory after a
cluster barrier, and writes ``h`` (``_reduce_splits``): one launch, as without splits. Why stacked word
tiles and 64-byte swizzles: docs/mosaic_gpu.md.

Two tilings, chosen by the routing block ``bm`` (``Tiles.block_m``; by default the next power of two of the
mean rows per touched expert, in [8, 64]):

- ``bm = 64`` rows (wgmma's M per warpgroup), ``bn = 32`` weight columns a tile: ``acc [64, 32] += x [64, 32]
  q [32, 32]``. At decode most rows are padding: tensor-core work, and activation/output bytes (64 gathered rows
  of ``D`` bf16 and 64 float32 output rows a block).
- ``bm`` = 8, 16 or 32 rows, **swapped**: the weight columns fill wgmma's M (``bn = 64``) and the block's rows are
  its N (a multiple of 8): ``acc [64, bm] += q^T [64, 32] x^T [32, bm]``, both operands transposed views of the
  same smem tiles (16-bit wgmma reads either major order). gate/up stores ``h`` through a transposed view of a
  ``[rows, N]`` smem tile, so it leaves the kernel as down reads it; down's output leaves ``[N, rows]``, and its
  transpose fuses into ``combine``'s gather. At K2.6 decode this cuts
  the gathered and written rows 8-fold (bm 8 instead of 64) and the x tiles in smem from 32 to 4 KiB a stage.

Blackwell (B200/B300, sm_100a/sm_103a, ``Tiles.mma = "tcgen05"``, by default where the kernel is lowered for
one): wgmma does not exist there. The same kernel issues each group's two MMAs with ``tcgen05_mma`` into a TMEM
accumulator ``[128, 2 bm]``, commits them to one tensor-core barrier, waits, and reads the partial sums from TMEM
into registers for the scale multiply. Always swapped with ``TC_M = 128`` weight columns a tile (tcgen05's M for
one CTA: M = 64 takes a CTA pair on Mosaic GPU) and row blocks of 16 or more (TMEM columns come in 16s).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from kimi_jax.ops.int4_format import CHUNK, GROUP_SIZE, WORD_ROWS, Int4Experts
from kimi_jax.ops.int4_moe.rules import TC_MIN_ROWS, WGMMA_M
from kimi_jax.ops.numerics import F32
from kimi_jax.ops.select import blackwell, lowering_gpu, mosaic_interpret_params

TC_M = 128               # tcgen05's M for one CTA (Blackwell): the weight columns a tile, always swapped (M = 64
#                          takes a CTA pair on Mosaic GPU); its N, the block's rows, a multiple of 16 (TMEM columns)
GROUPS = CHUNK // GROUP_SIZE   # 8 scale groups (nibble planes) per 256-input chunk
TARGET_CTAS = 132        # H200's SMs: gate/up splits K until its grid has at least this many CTAs
MIN_CHUNKS_PER_SPLIT = 4
MAX_CLUSTER = 8          # the portable cluster size: gate/up's K splits are one cluster's CTAs


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_n_gate_up: int = 32
    block_n_down: int = 32     # x2: a CTA writes two adjacent 32-column tiles
    # Chunks in the copy ring (1 = no TMA/compute overlap). 2: a CTA needs at most 90 KiB (gate/up) and 102 KiB
    # (down) of smem at 64-row blocks, 53 and 56 KiB at 8-row ones, so two or more CTAs share an SM's 228 KiB and
    # overlap each other's serial unpack-and-wgmma work; 3-4 (up to 184 KiB) keep more copies in flight per
    # CTA. Not measured on a GPU yet.
    stages: int = 2
    # Rows per routing block: 64, or 8, 16, 32 (swapped kernels); None: int4_moe_mosaic picks
    block_m: int | None = None
    # K splits of the gate/up kernel (a divisor of D / 256); None: gate_up_splits picks
    splits_gate_up: int | None = None
    # "wgmma" (Hopper) or "tcgen05" (Blackwell: TMEM accumulators); None: the GPU the kernel is lowered for
    # picks (select.blackwell), wgmma where there is none (interpret mode)
    mma: str | None = None

    def tcgen05(self) -> bool:
        if self.mma not in (None, "wgmma", "tcgen05"):
            raise ValueError(f'Tiles.mma must be "wgmma", "tcgen05" or None, got {self.mma!r}')
        return self.mma == "tcgen05" if self.mma else blackwell(lowering_gpu())


def _swizzled(minor_elems: int, dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor_elems * bits)
    if swizzle < 32:    # rows of 16 bytes (a swapped [64, 8] bf16 output tile): no swizzle exists, plain rows
        return ()
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _unpack(words, i, dtype):
    """Nibble plane ``i`` of ``words`` as ``q = u - 8`` in ``dtype`` without an int->float conversion: ``u``
    becomes the low mantissa bits of the float ``2^m`` whose unit in the last place is 1 (bf16 128, f16 1024),
    read as ``2^m + u`` and shifted by ``2^m + 8`` (both exact). The PTX then has a shift, an and/or, half a
    ``prmt`` and half an ``add.bf16x2`` per weight instead of a ``cvt.rn.bf16.s32``, a conversion the SM runs at a
    fraction of its integer rate (docs/mosaic_gpu.md)."""
    base = {jnp.dtype(jnp.bfloat16): 128.0, jnp.dtype(jnp.float16): 1024.0}[jnp.dtype(dtype)]
    bits = int(np.asarray(base, dtype).view(np.uint16))
    u = ((words >> (4 * i)) & 0xF) | bits
    return lax.bitcast_convert_type(u.astype(jnp.int16), dtype) - jnp.asarray(base + 8, dtype)


def _grouped_kernel(xs, block_expert, w, s, *, pair_cols: bool, bn: int, stages: int, out_dtype, epilogue,
                    interpret, splits: int = 1, tc: bool = False):
    """One grouped projection over two ``[K, bn]`` weight tiles per CTA, stacked into one ``[64, bn]`` word tile.

    ``w`` int32 ``[E, M, K/8, N]``, ``s`` bf16 ``[E, M, K/32, N]``. ``pair_cols=False`` (gate/up, ``M = 2``):
    tile ``m`` = matrix ``m``, columns ``n*bn``. ``pair_cols=True`` (down, ``M = 1``): tile ``m`` = columns
    ``(2n + m)*bn`` of the one matrix. ``epilogue(acc_0, acc_1)`` makes one output tile at the CTA's columns;
    with ``epilogue=None`` each accumulator is written at its own tile's place in the ``[M * N]`` columns.
    ``splits`` > 1 splits K over a cluster of ``splits`` CTAs (cluster axis "k", ``K/256 / splits`` chunks each):
    CTA ``k > 0`` publishes its two float32 accumulators to a workspace in global memory; after one cluster
    barrier CTA 0 reads them back, adds them to its own and runs the epilogue (``_reduce_splits``). The output
    has a leading axis of size 1.

    Stacking two 32-row word tiles makes the register tile 64 rows, which Mosaic GPU's layout inference can store
    into a swizzled shared-memory tile (a 32-row int32 tile cannot: "Failed to infer a possible set of layouts",
    docs/mosaic_gpu.md)."""
    nb = block_expert.shape[0]
    bm = xs.shape[0] // nb
    k_rows, n = w.shape[-2:]
    n_mats = w.shape[1]
    n_chunks = k_rows // WORD_ROWS // splits     # per split
    cta_n = 2 * bn if pair_cols else bn
    swap = bm < WGMMA_M or tc      # the tokens as the MMA's N, the weight columns as its M (module doc)
    if tc and (bm % TC_MIN_ROWS or bn != TC_M):
        raise ValueError(f"the tcgen05 kernel takes row blocks of a multiple of {TC_MIN_ROWS} rows and {TC_M}-column "
                         f"weight tiles; got {bm}, {bn}")
    if not tc and ((bm if swap else bn) % 8 or (bn if swap else bm) != WGMMA_M):
        raise ValueError(f"the Mosaic GPU kernel takes row blocks of {WGMMA_M} rows and {GROUP_SIZE}-column "
                         f"weight tiles, or fewer rows (a multiple of 8) and {WGMMA_M}-column tiles; got {bm}, {bn}")
    if n % cta_n or xs.shape[1] != splits * n_chunks * CHUNK or (splits > 1 and epilogue is None):
        raise ValueError(f"shapes: xs {xs.shape}, w {w.shape}, bn {bn}, splits {splits} (with an epilogue only)")
    if splits > MAX_CLUSTER:
        raise ValueError(f"at most {MAX_CLUSTER} K splits (a cluster of CTAs), got {splits}")
    x_dtype = xs.dtype
    n_out = 2 if epilogue is None else 1
    width = n_mats * n if epilogue is None else n
    acc_shape = (bn, bm) if swap else (bm, bn)
    # Swapped, the accumulators are [N, rows]. With an epilogue (gate/up's h, read next by down as its rows) the
    # tile is stored through a transposed view of a [rows, N] smem tile, so h leaves the kernel [rows, N] and
    # needs no transpose kernel; down's output stays [N, rows] (its transpose fuses into combine's gather).
    out_t = swap and epilogue is not None
    o_shape = acc_shape[::-1] if out_t else acc_shape

    def body(be_gmem, x_gmem, w_gmem, s_gmem, o_gmem, *refs):
        if splits > 1:      # the ring's refs and the exchange tiles, aliased (a RefUnion's leaves)
            ws_gmem, ring, q_smem, o_smem, bars, split_bar, cluster_bar, *tmem = refs
            (x_smem, w_smem, s_smem), exchange = ring
        else:
            ws_gmem, exchange, split_bar, cluster_bar = None, None, None, None
            (x_smem, w_smem, s_smem), q_smem, o_smem, bars, *tmem = refs
        b = lax.axis_index("b")
        j = lax.axis_index("n")
        c0 = lax.axis_index("k") * n_chunks if splits > 1 else 0    # this split's first chunk
        e = be_gmem[b]

        def src(m):      # (matrix, first column) of weight tile m
            return (0, (2 * j + m) * bn) if pair_cols else (m, j * bn)

        def fetch(c):    # the split's chunk c (activations, words, scales) into ring slot c % stages, on its barrier
            slot = lax.rem(c, stages)
            bar = bars.at[slot]
            c = c0 + c
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
                    q_smem[...] = _unpack(words, i, x_dtype)
                    plgpu.commit_smem()
                    accs = list(accs)
                    if tc:      # both tiles' MMAs into TMEM, one commit for the pair, then the scaled sums
                        acc_tmem, mma_bar = tmem
                        for m in range(2):
                            q = q_smem.at[pl.ds(m * GROUP_SIZE, GROUP_SIZE)]
                            plgpu.tcgen05_mma(acc_tmem.at[:, pl.ds(m * bm, bm)], q.transpose((1, 0)),
                                              x_smem.at[slot, i].transpose((1, 0)), mma_bar if m else None,
                                              accumulate=False)
                        plgpu.barrier_wait(mma_bar)
                        for m in range(2):
                            part = plgpu.async_load_tmem(acc_tmem.at[:, pl.ds(m * bm, bm)])
                            scale = s_smem[slot, m, i].astype(F32)
                            accs[m] = accs[m] + part * lax.broadcast_in_dim(scale, acc_shape, [0])
                        plgpu.wait_load_tmem()      # the next group's MMAs overwrite what was read
                        return tuple(accs)
                    for m in range(2):
                        def mma(acc_ref, m=m):
                            x, q = x_smem.at[slot, i], q_smem.at[pl.ds(m * GROUP_SIZE, GROUP_SIZE)]
                            if swap:    # [bn, bm] += q^T [bn, 32] x^T [32, bm]
                                plgpu.wgmma(acc_ref, q.transpose((1, 0)), x.transpose((1, 0)))
                            else:       # [bm, bn] += x [bm, 32] q [32, bn]
                                plgpu.wgmma(acc_ref, x, q)
                            plgpu.wgmma_wait(0)
                            return acc_ref[...]

                        part = pl.run_scoped(mma, plgpu.ACC(acc_shape, F32))
                        scale = s_smem[slot, m, i].astype(F32)          # [bn]: one per weight column
                        accs[m] = accs[m] + part * lax.broadcast_in_dim(scale, acc_shape, [0 if swap else 1])
                    return tuple(accs)

                return lax.fori_loop(0, GROUPS, group, accs)

            def store(accs):    # the CTA's output tiles (the epilogue's one, or both accumulators)
                outs = accs if epilogue is None else (epilogue(*accs),)
                for m, out in enumerate(outs):
                    if out_t:
                        o_smem.at[m].transpose((1, 0))[...] = out.astype(out_dtype)
                    else:
                        o_smem[m] = out.astype(out_dtype)
                plgpu.commit_smem()
                for m in range(n_out):
                    mat, col = src(m)
                    rows, cols = pl.ds(b * bm, bm), pl.ds(mat * n + col if epilogue is None else col, bn)
                    plgpu.copy_smem_to_gmem(o_smem.at[m],
                                            o_gmem.at[0].at[(cols, rows) if swap and not out_t else (rows, cols)])
                plgpu.wait_smem_to_gmem(0)

            zeros = tuple(jnp.zeros(acc_shape, F32) for _ in range(2))
            accs = lax.fori_loop(0, n_chunks, chunk, zeros)
            if splits == 1:
                store(accs)
            else:
                _reduce_splits(accs, splits, ws_gmem.at[:, b, j], exchange, split_bar, cluster_bar, store,
                               interpret)

    n_copies = GROUPS + 4
    out = jax.ShapeDtypeStruct((1, width, xs.shape[0]) if swap and not out_t else (1, xs.shape[0], width), out_dtype)
    ring = (plgpu.SMEM((stages, GROUPS, bm, GROUP_SIZE), x_dtype, transforms=_swizzled(GROUP_SIZE, x_dtype)),
            plgpu.SMEM((stages, 2 * WORD_ROWS, bn), jnp.int32),
            plgpu.SMEM((stages, 2, GROUPS, bn), s.dtype))
    if splits > 1:
        # the workspace: [splits - 1, blocks, column tiles, 2, *acc_shape] float32 (one box per CTA k > 0); the
        # exchange tiles CTA 0 reads it into share the ring's memory (the ring is idle once K is done)
        ws_tile = (2, *acc_shape)
        out = (out, jax.ShapeDtypeStruct((splits - 1, nb, n // cta_n, *ws_tile), F32))
        ring = plgpu.RefUnion(ring, plgpu.SMEM((splits - 1, *ws_tile), F32, transforms=_swizzled(acc_shape[1], F32)))
    kernel = plgpu.kernel(
        body,
        out_type=out,
        grid=(nb, n // cta_n),
        grid_names=("b", "n"),
        **(dict(cluster=(splits,), cluster_names=("k",)) if splits > 1 else {}),
        scratch_types=[
            ring,
            # 64-byte swizzle for both wgmma operands (their swizzles must agree; 32 K elements = 64 B)
            plgpu.SMEM((2 * GROUP_SIZE, bn), x_dtype, transforms=_swizzled(GROUP_SIZE, x_dtype)),
            plgpu.SMEM((n_out, *o_shape), out_dtype, transforms=_swizzled(o_shape[1], out_dtype)),
            plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        ] + ([plgpu.Barrier(num_arrivals=splits - 1), plgpu.ClusterBarrier(collective_axes=("k",))]
             if splits > 1 else []) + (
            [plgpu.TMEM((bn, max(2 * bm, 32)), F32),       # TMEM is allocated 32 columns at the least
             plgpu.Barrier(num_arrivals=1, orders_tensor_core=True)] if tc else []),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_interpret_params(interpret),
    )
    out = kernel(block_expert, xs, w, s)
    return out[0] if splits > 1 else out


def _reduce_splits(accs, splits, ws, exchange, split_bar, cluster_bar, store, interpret):
    """The cluster's split-K sum: CTA ``k > 0`` of the cluster writes its accumulators to ``ws[k - 1]`` (its own
    box in global memory), every CTA arrives at the cluster barrier, and CTA 0, once all have, reads the
    ``splits - 1`` boxes into ``exchange`` (one TMA each), adds them to its own accumulators and ``store``s.

    Why global memory and not the peers' shared memory (``cluster_ref``): GPU interpret mode runs the former and
    not the latter, and the boxes are a few KiB (``2 x 64 x 8`` floats at one token), read from L2. Why a cluster:
    its CTAs are co-scheduled, so CTA 0 can wait for the others without a grid-wide semaphore, which would need a
    zeroed buffer, one memset more a layer. The exchange tiles alias the copy ring, idle after the K loop."""
    k = lax.axis_index("k")
    # every thread past its last ordinary loads of the ring (the last group's scales) before the exchange tiles,
    # which alias it, are written: by this warpgroup's stores, or by CTA 0's TMA (hence the async-proxy fence)
    plgpu.commit_smem()

    @pl.when(k > 0)
    def _():
        for m in range(2):
            exchange[0, m] = accs[m]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(exchange.at[0], ws.at[k - 1])
        plgpu.wait_smem_to_gmem(0)      # the writes done, not only the reads of shared memory
        _fence_cluster(interpret)

    plgpu.barrier_arrive(cluster_bar)
    plgpu.barrier_wait(cluster_bar)

    @pl.when(k == 0)
    def _():
        _fence_cluster(interpret)
        for i in range(splits - 1):
            plgpu.copy_gmem_to_smem(ws.at[i], exchange.at[i], split_bar)
        plgpu.barrier_wait(split_bar)
        total = list(accs)
        for i in range(splits - 1):
            for m in range(2):
                total[m] = total[m] + exchange[i, m]
        store(tuple(total))


def _fence_cluster(interpret):
    """Orders one CTA's global memory accesses with another's in the cluster around the cluster barrier (whose
    mbarrier arrive and wait order at CTA scope only), the TMA's async proxy included: ``fence.acq_rel.cluster``
    and ``fence.proxy.async.global``, then a warpgroup barrier so that the one thread that issued the TMA store
    has fenced before any thread arrives. Nothing in GPU interpret mode, which has no memory model to fence."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def fence(ctx):
        mgpu_utils.inline_ptx("fence.proxy.async.global;\n\tfence.acq_rel.cluster;", has_side_effects=True)
        mgpu_utils.warpgroup_barrier()

    fence()


def _swiglu(g, u):
    return g * jax.nn.sigmoid(g) * u


def gate_up_splits(ctas: int, n_chunks: int) -> int:
    """K splits for gate/up: the fewest that give ``TARGET_CTAS`` CTAs (at one token K2.6's gate/up has 8 blocks x
    4 column tiles = 32 CTAs, a quarter of the SMs, each unpacking a 7168 x 128 slice), keeping at least
    ``MIN_CHUNKS_PER_SPLIT`` chunks a split for the copy ring and at most ``MAX_CLUSTER`` (a cluster's CTAs)."""
    fits = [s for s in range(1, min(n_chunks, MAX_CLUSTER) + 1)
            if n_chunks % s == 0 and n_chunks // s >= MIN_CHUNKS_PER_SPLIT] or [1]
    return next((s for s in fits if ctas * s >= TARGET_CTAS), fits[-1])


def experts_mosaic(xs: jax.Array, block_expert: jax.Array, ex: Int4Experts, interpret=False,
                   tiles: Tiles | None = None) -> jax.Array:
    """Grouped INT4 SwiGLU experts over ``routing.py``'s row blocks (64 rows, or fewer: swapped; tcgen05: a
    multiple of 16 rows, always swapped); ``interpret``: True (or an ``InterpretGPUParams``) runs the kernels in
    Pallas' GPU interpret mode on the CPU."""
    tiles = tiles or Tiles()
    tc = tiles.tcgen05()
    f_rows, d = ex.w2.shape[-2:]
    f = ex.w13.shape[-1]
    if xs.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"the Mosaic GPU kernel runs 16-bit activations (wgmma, tcgen05), got {xs.dtype}")
    nb = block_expert.shape[0]
    swap = xs.shape[0] // nb < WGMMA_M or tc
    # swapped, down's output comes [N, rows]: transposed here (the transpose fuses into combine's gather);
    # gate/up's h comes [rows, F] (``_grouped_kernel``)
    transposed = (lambda a: a.T) if swap else (lambda a: a)
    bn_gate_up, bn_down = (TC_M, TC_M) if tc else (WGMMA_M, WGMMA_M) if swap else \
        (tiles.block_n_gate_up, tiles.block_n_down)
    n_chunks = ex.w13.shape[-2] // WORD_ROWS
    splits = tiles.splits_gate_up or gate_up_splits(nb * (f // bn_gate_up), n_chunks)
    h = _grouped_kernel(xs, block_expert, ex.w13, ex.s13, pair_cols=False, bn=bn_gate_up, stages=tiles.stages,
                        out_dtype=xs.dtype, epilogue=_swiglu, interpret=interpret, splits=splits, tc=tc)[0]
    h = jnp.pad(h, ((0, 0), (0, f_rows * 8 - f)))   # zero inputs for the padded word rows (tiny models only)
    return transposed(_grouped_kernel(h, block_expert, ex.w2[:, None], ex.s2[:, None], pair_cols=True,
                                      bn=bn_down, stages=tiles.stages, out_dtype=F32, epilogue=None,
                                      interpret=interpret, tc=tc)[0])


def int4_moe_mosaic(x, topk_idx, topk_weight, experts: Int4Experts, *, interpret=False,
                    tiles: Tiles | None = None, scale=None) -> jax.Array:
    """``api.int4_moe``'s computation through the Mosaic GPU kernels: routing blocks of ``tiles.block_m`` rows,
    by default the next power of two of the mean rows per touched expert in [8, 64] ([16, 64] for tcgen05;
    ``routing.default_block_m``; under 64, and always with tcgen05, the kernels run swapped). The pairs are
    placed as the Triton path places them (``pallas_triton.place``: its placement kernel up to 512 pairs, XLA
    above): Mosaic GPU has no such kernel of ours, and four XLA kernels in its place cost launches at every MoE
    layer. The same kernel gathers the rows the experts read, ``scale * x`` (``pallas_triton.place_rows``)."""
    from kimi_jax.ops.int4_moe.pallas_triton import place_rows
    from kimi_jax.ops.int4_moe.routing import combine, default_block_m

    tiles = tiles or Tiles()
    t, k = topk_idx.shape
    lo = TC_MIN_ROWS if tiles.tcgen05() else 8
    bm = tiles.block_m or default_block_m(t * k, experts.num_experts, lo, WGMMA_M)
    routing, xs = place_rows(topk_idx, x, scale, experts.num_experts, bm, experts.w13.shape[-2] * 8, interpret)
    out = experts_mosaic(xs, routing.block_expert, experts, interpret, tiles)
    return combine(out, routing, topk_weight).astype(jnp.float32)
