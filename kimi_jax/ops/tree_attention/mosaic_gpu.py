"""Tree-verify attention as a Mosaic GPU kernel (``plgpu.kernel``, Hopper TMA + wgmma), first version.

The same contract as ``pallas_triton.latent_attention_pallas`` (api.py: impl="mosaic", and "auto" in a program
lowered for a Hopper GPU): absorbed MLA
over the latent cache (contiguous ``[b, s, r+p]`` or a page pool with ``page_table``, optionally the whole cache
``[layers, ...]`` read in place at ``layer``), the tree's ancestor mask, split-K over the committed prefix and
a log-sum-exp merge. Never run on a GPU yet: checked in GPU interpret mode and by deviceless compiles
(docs/mosaic_gpu.md).

Structure (why it differs from the Triton kernel):

- Queries: as in the Triton kernel, the ``t*h`` (node, head) pairs of a batch row share the latent rows (MLA is
  MQA after absorption), so they are one query axis, cut into blocks of ``bq = 64`` rows: wgmma's M for one
  warpgroup. (Fewer rows, e.g. 8 at decode with 8 heads, still cost a 64-row block: tensor-core work and q/out
  bytes, no cache bytes.)
- Value columns: the output accumulator ``[64, r=512]`` float32 would take 256 registers a thread on its own
  (one warpgroup = 128 threads), so each CTA owns ``dv = 256`` output columns (``block_v``) and the grid has
  ``r / dv`` CTAs per query block. Both compute the same scores (the c_kv tile is read from L2 by the second);
  the accumulator is 128 registers a thread.
- Grid ``(nq * r/dv, ns + 1, b)``: query block x value chunk (fastest, so the CTAs streaming the same keys run
  together and share them through L2), key split, batch row. Splits ``0 .. ns-1`` stream the committed prefix in
  ``bk = 64``-row key blocks, stopping at ``ceil(lengths / bk)``; split ``ns`` does the tree rows.
- Per key block: TMA copies ``c_kv [64, 512]`` (as ``r/dv`` chunks of ``[64, dv]``) and ``k_pe [64, 64]`` into a
  ``stages``-deep ring (2: block j+1 is copied while block j computes; one warpgroup, so no producer/consumer
  barriers are needed: a slot is rewritten only after the wgmmas that read it have been waited for). Scores are
  ``r/dv + 1`` wgmmas ``q [64, dv] x c^T [dv, 64]`` and ``q_pe [64, 64] x k_pe^T``; the online softmax runs in
  registers (float32); the bf16 probabilities go through a ``[64, 64]`` smem tile into one wgmma against
  ``c_kv[:, chunk]``. Registers: 210-254 a thread at K2.6 TP-8 shapes (ptxas, sm_90a), no spills.
- ``bk = 64`` because a 64-element bf16 row is 128 bytes: every smem tile then takes the 128-byte swizzle, and
  wgmma wants the swizzles of its operands to agree (docs/mosaic_gpu.md, int4 kernel).
- Queries are read unpadded ``[b, t*h, r]``: TMA fills the last block's rows past ``t*h`` with zeros.
- Tree rows: the ``t`` rows at ``lengths + j``. A contiguous cache is read in place from the slot
  ``lengths - lengths % TREE_ALIGN`` (Mosaic GPU's TMA into 8-row tiles needs a start it can prove a multiple of
  8), so tree key column k is node ``k - lengths % 8`` (the mask says so); rows past the cache end come back as
  TMA's zeros. A paged cache has them gathered outside into ``[b, tp, r+p]`` (a block may span two pages). The
  ancestor mask is an int8 ``[b, qp, tp]`` array (74 KB
  per batch row at t = 65, 8 heads) that the kernel loads tile by tile straight into the score layout. (A
  bit-packed mask, as Triton's, was tried with the tree blocks in a loop: its expansion in registers, two
  broadcast words, a select and a shift over the [64, 64] tile, spilled at t = 65; the int8 tile in a loop
  still spilled 28 B.) The tree's key blocks (one up to 64 nodes, two up to 128) run unrolled, which compiles
  without spills.
- Shared memory per CTA (bf16, dv = 256, 2 stages): q 64 KiB + q_pe 8 KiB + 2 x (c_kv 64 KiB + k_pe 8 KiB) +
  the bf16 probabilities 8 KiB = 224 KiB (226.0 KiB with barriers and alignment, as Mosaic GPU counts it) of
  Hopper's 227; the float32 output tile (64 KiB) is staged after the
  loop in a second ``run_scoped``, which reuses the loop's shared memory. The probabilities go through shared
  memory (not a register operand of wgmma, as FA3 does) because Pallas' GPU interpreter, which the tests run
  the kernel in, takes only smem operands.
- Partials ``(acc [64, dv], m, l)`` per split are float32 in HBM and merge by LSE in Triton's merge kernel
  (``merge.merge_pallas``: one launch, where XLA's merge is two; Mosaic GPU has no merge of ours), which also
  applies W_UV when the caller gives it (``merge.merge_project``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kimi_jax.ops.numerics import F32, MASK_VALUE
from kimi_jax.ops.registry import Lowering
from kimi_jax.ops.select import lowering_gpu, mosaic_interpret_params
from kimi_jax.ops.tree_attention.rules import MOSAIC_BLOCK, AttentionCall, mosaic_supports
from kimi_jax.ops.tree_attention.merge import merge_heads
from kimi_jax.ops.tree_attention.xla import tree_rows, tree_slots

BLOCK_Q = MOSAIC_BLOCK  # wgmma M of one warpgroup
BLOCK_K = MOSAIC_BLOCK  # key rows per block: 128-byte rows in bf16, so every tile takes the 128-byte swizzle
TARGET_CTAS = 132       # one per H200 SM: 226 KiB of shared memory a CTA leaves room for one CTA an SM
MIN_BLOCKS_PER_SPLIT = 4
MERGE_BLOCK = 32        # queries per program of Triton's merge kernel: [32, 512] float32 fits its registers
TREE_ALIGN = 8          # tree rows read in place start at a multiple of the smem tile's 8 rows


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_v: int = 256      # output columns per CTA (module doc: the float32 accumulator's registers)
    stages: int = 2         # key blocks in flight


def _cdiv(a, b):
    return -(-a // b)


def _tile(dtype) -> tuple:
    """The 128-byte swizzled layout of a 16-bit tile whose minor dim is a multiple of 64 (the wgmma layout)."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def default_splits(n_blocks: int, ctas_per_split: int) -> int:
    """Enough prefix splits for one CTA per SM, each at least MIN_BLOCKS_PER_SPLIT key blocks (as Triton's, which
    aims at two: its CTAs are smaller). More splits cost partial states: (ns + 1) x qp x 2 KiB, written and
    read back by the merge (docs/mosaic_gpu.md)."""
    by_occupancy = _cdiv(TARGET_CTAS, max(ctas_per_split, 1))
    return max(1, min(by_occupancy, _cdiv(n_blocks, MIN_BLOCKS_PER_SPLIT), n_blocks))


def _attention_call(q, qpe, kv, tree_kv, tree_mask, lengths, layer, table, *, scale, dv, stages, ns, bps, n_slots,
                    n_tree, page, interpret):
    """The kernel: partial states o [b, ns+1, qp, r], m, l [b, ns+1, qp] (float32) for queries q [b, n_q, r],
    qpe [b, n_q, p], unpadded: TMA fills the rows of the last query block past n_q with zeros. Tree rows come
    from ``tree_kv`` [b, tp, r+p] when paged, else from the cache at lengths + j (``tree_kv`` is None)."""
    b, _, r = q.shape
    qp = tree_mask.shape[1]
    p = qpe.shape[-1]
    n_v, nq = r // dv, qp // BLOCK_Q
    dt = q.dtype
    n_rows = kv.shape[2]                    # rows per batch row (contiguous) or per page (paged)

    def body(len_gmem, layer_gmem, pt_gmem, q_gmem, qpe_gmem, kv_gmem, tkv_gmem, mask_gmem, o_gmem, m_gmem, l_gmem):
        iq, split, bi = lax.axis_index("q"), lax.axis_index("split"), lax.axis_index("b")
        q0, vh = (iq // n_v) * BLOCK_Q, iq % n_v
        layer = layer_gmem[0]
        length = jnp.minimum(len_gmem[bi], n_slots)

        def prefix_fetch(j, c_dst, kpe_dst, bar):
            start = j * BLOCK_K
            if page:        # block j lies inside one page (BLOCK_K divides the page size)
                pid = jnp.clip(pt_gmem[bi, start // page], 0, kv_gmem.shape[1] - 1)      # mapped below lengths
                at = (layer, pid, pl.ds(start % page, BLOCK_K))
            else:           # stay in bounds on a ragged cache; the rows before start are masked
                at = (layer, bi, pl.ds(jnp.minimum(start, n_rows - BLOCK_K), BLOCK_K))
            for v in range(n_v):
                plgpu.copy_gmem_to_smem(kv_gmem.at[(*at, pl.ds(v * dv, dv))], c_dst.at[v], bar)
            plgpu.copy_gmem_to_smem(kv_gmem.at[(*at, pl.ds(r, p))], kpe_dst, bar)

        def keys():     # built per block: a [64, 64] int32 tile kept across the loop would hold 32 registers
            return plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, BLOCK_K), 1, layout=plgpu.Layout.WGMMA)

        def prefix_mask(j):
            start, col = j * BLOCK_K, keys()
            key = (start if page else jnp.minimum(start, n_rows - BLOCK_K)) + col
            return (key >= start) & (key < length)

        def tree_fetch(j, c_dst, kpe_dst, bar):
            # contiguous: in place at lengths + j (TMA fills rows past the cache end with zeros; rows past t are
            # masked); paged: the rows gathered outside (one 64-row block may span two pages)
            rows = (bi, pl.ds(j * BLOCK_K, BLOCK_K)) if page else (layer, bi, pl.ds(
                (len_gmem[bi] // TREE_ALIGN) * TREE_ALIGN + j * BLOCK_K, BLOCK_K))
            src = tkv_gmem if page else kv_gmem
            for v in range(n_v):
                plgpu.copy_gmem_to_smem(src.at[(*rows, pl.ds(v * dv, dv))], c_dst.at[v], bar)
            plgpu.copy_gmem_to_smem(src.at[(*rows, pl.ds(r, p))], kpe_dst, bar)

        def tree_mask(j):
            # the [64 queries, 64 tree keys] tile of the ancestor mask, straight from HBM into the score layout
            # (gathered rows that do not exist, past t or the cache end, are False: packed outside)
            return plgpu.load(mask_gmem.at[bi, pl.ds(q0, BLOCK_Q), pl.ds(j * BLOCK_K, BLOCK_K)],
                              layout=plgpu.Layout.WGMMA, optimized=False) != 0

        def attend(first, last, fetch, mask_of, q_smem, qpe_smem, c_smem, kpe_smem, p_smem, bars, q_bar):
            for v in range(n_v):
                plgpu.copy_gmem_to_smem(q_gmem.at[bi, pl.ds(q0, BLOCK_Q), pl.ds(v * dv, dv)], q_smem.at[v], q_bar)
            plgpu.copy_gmem_to_smem(qpe_gmem.at[bi, pl.ds(q0, BLOCK_Q)], qpe_smem, q_bar)

            def fetch_into(j):
                slot = lax.rem(j - first, stages)
                fetch(j, c_smem.at[slot], kpe_smem.at[slot], bars.at[slot])

            pl.when(first < last)(lambda: fetch_into(first))
            plgpu.barrier_wait(q_bar)

            def step(j, carry):
                acc, m, l = carry
                slot = lax.rem(j - first, stages)
                # the slot of block j+1 was last read by block j+1-stages, whose wgmmas have completed
                pl.when(j + 1 < last)(lambda: fetch_into(j + 1))
                plgpu.barrier_wait(bars.at[slot])

                def scores(acc_ref):
                    for v in range(n_v):
                        plgpu.wgmma(acc_ref, q_smem.at[v], c_smem.at[slot, v].transpose((1, 0)))
                    plgpu.wgmma(acc_ref, qpe_smem, kpe_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, BLOCK_K), F32)) * scale
                valid = mask_of(j)
                s = jnp.where(valid, s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp(m - m_new)
                # No second where: a masked key has exp(MASK_VALUE - m_new) = 0 once its row has seen a key; until
                # then the row's (m, l, acc) hold MASK_VALUE-weighted junk that alpha = 0 wipes at its first key,
                # or that the merge weighs by exp(MASK_VALUE - M) = 0 (every query sees itself in the tree split).
                prob = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + prob.sum(axis=1)

                p_smem[...] = prob.astype(dt)
                plgpu.commit_smem()         # the smem store must be visible to the tensor core (async proxy)

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, c_smem.at[slot, vh])

                if interpret:   # the interpreter has no run_state (jaxpr_interpret.py's TODO): a fresh
                    #             accumulator and one add; compiled, that would hold two [64, dv] float32 tiles
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pl.run_scoped(
                        lambda acc_ref: (values(acc_ref), acc_ref[...])[1], plgpu.ACC((BLOCK_Q, dv), F32))
                else:           # the rescaled accumulator is the wgmma's own
                    acc = pl.run_state(values)(plgpu.ACC.init(acc * lax.broadcast_in_dim(alpha, acc.shape, [0])))
                return acc, m_new, l

            init = (plgpu.layout_cast(jnp.zeros((BLOCK_Q, dv), F32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((BLOCK_Q,), MASK_VALUE, F32), plgpu.Layout.WGMMA.reduce(1)),
                    plgpu.layout_cast(jnp.zeros((BLOCK_Q,), F32), plgpu.Layout.WGMMA.reduce(1)))
            if isinstance(last, int):   # the tree's few blocks: unrolled (as a loop, it spilled at t = 65)
                state = init
                for j in range(first, last):
                    state = step(j, state)
                return state
            return lax.fori_loop(first, jnp.maximum(first, last), step, init)

        def store(state):
            acc, m, l = state

            def write(o_smem, ml_smem):
                o_smem[...] = acc
                ml_smem[0] = m
                ml_smem[1] = l
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[bi, split, pl.ds(q0, BLOCK_Q), pl.ds(vh * dv, dv)])

                @pl.when(vh == 0)       # every value chunk has the same m and l
                def _():
                    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_gmem.at[bi, split, pl.ds(q0, BLOCK_Q)])
                    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_gmem.at[bi, split, pl.ds(q0, BLOCK_Q)])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(write, plgpu.SMEM((BLOCK_Q, dv), F32), plgpu.SMEM((2, BLOCK_Q), F32))

        def run(first, last, fetch, mask_of):
            state = pl.run_scoped(
                functools.partial(attend, first, last, fetch, mask_of),
                plgpu.SMEM((n_v, BLOCK_Q, dv), dt, transforms=_tile(dt)),
                plgpu.SMEM((BLOCK_Q, p), dt, transforms=_tile(dt)),
                plgpu.SMEM((stages, n_v, BLOCK_K, dv), dt, transforms=_tile(dt)),
                plgpu.SMEM((stages, BLOCK_K, p), dt, transforms=_tile(dt)),
                plgpu.SMEM((BLOCK_Q, BLOCK_K), dt, transforms=_tile(dt)),
                plgpu.Barrier(num_arrivals=n_v + 1, num_barriers=stages),
                plgpu.Barrier(num_arrivals=n_v + 1))
            store(state)

        @pl.when(split < ns)
        def _prefix():
            first = split * bps
            run(first, jnp.minimum(first + bps, (length + BLOCK_K - 1) // BLOCK_K), prefix_fetch, prefix_mask)

        @pl.when(split == ns)
        def _tree():
            run(0, n_tree, tree_fetch, tree_mask)

    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((b, ns + 1, qp, r), F32),
                  jax.ShapeDtypeStruct((b, ns + 1, qp), F32),
                  jax.ShapeDtypeStruct((b, ns + 1, qp), F32)),
        grid=(nq * n_v, ns + 1, b),
        grid_names=("q", "split", "b"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic_interpret_params(interpret),
    )
    # contiguous: the cache stands in for tree_kv (a second reference to the same buffer, never read as such)
    return kernel(lengths, layer, table, q, qpe, kv, kv if tree_kv is None else tree_kv, tree_mask)


def latent_attention_mosaic(q_lat, q_pe, kv, lengths, new_mask, scale, *, interpret, block_q=None, block_k=None,
                            num_splits=None, page_table=None, layer=None, out_dtype=None, w_uv=None, w_uv_from=0,
                            tiles: Tiles | None = None):
    """``api.latent_attention``'s computation through the Mosaic GPU kernel (module doc), for the calls
    ``rules.mosaic_supports`` takes (block_q and block_k fixed at 64: None or 64); ``interpret``: True (or an
    ``InterpretGPUParams``) runs the kernel in Pallas' GPU interpret mode on the CPU. Inputs are cast to the
    cache's dtype, which must be 16-bit (wgmma)."""
    tiles = tiles or Tiles()
    b, t, h, r = q_lat.shape
    p = q_pe.shape[-1]
    if layer is None:
        kv, layer = kv[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    dt = kv.dtype
    page = 0 if page_table is None else kv.shape[2]
    dv = min(tiles.block_v, r)
    n_slots = kv.shape[2] if not page else page_table.shape[1] * page
    call = AttentionCall(b, t, h, r, p, n_slots, page, jnp.dtype(dt).name, block_q, block_k, tiles.block_v)
    if (reason := mosaic_supports(call, Lowering("cuda", lowering_gpu(), bool(interpret)))) is not None:
        raise ValueError(reason)

    # Tree rows (module doc): gathered from logical slots through the table when paged (tree key column k is
    # node k); read in place from a contiguous cache, from the slot lengths - off below them that is a multiple
    # of TREE_ALIGN (Mosaic GPU's TMA into 8-row tiles needs that start), so column k is node k - off.
    lengths = lengths.astype(jnp.int32)
    tp = _cdiv(t + (0 if page else TREE_ALIGN - 1), BLOCK_K) * BLOCK_K
    node, _, ok = tree_slots(lengths, t, tp, n_slots, None if page else lengths % TREE_ALIGN)      # [b, tp]
    tree_kv = None
    if page:
        kv_layer = lax.dynamic_index_in_dim(kv, layer[0], 0, keepdims=False)
        tree_kv, _ = tree_rows(kv_layer, page_table, lengths, t, tp, n_slots)
    if not page and n_slots < BLOCK_K:   # tiny caches only: pad so that one key block fits (masked past lengths)
        kv = jnp.pad(kv, ((0, 0), (0, 0), (0, BLOCK_K - n_slots), (0, 0)))
    table = (jnp.zeros((b, 1), jnp.int32) if not page else page_table.astype(jnp.int32))

    # Queries node-major, unpadded (the kernel's TMA zero-fills the last block's rows past n_q); the mask is
    # padded to whole 64-row blocks (the kernel reads it with plain loads). It depends on no layer: one per round.
    n_q = t * h
    nq = _cdiv(n_q, BLOCK_Q)
    qp = nq * BLOCK_Q
    flat = lambda x: x.astype(dt).reshape(b, n_q, -1)  # noqa: E731
    columns = jnp.broadcast_to(jnp.clip(node, 0, t - 1)[:, None, :], (b, t, tp))
    mask = jnp.take_along_axis(new_mask.astype(bool), columns, axis=2) & ok[:, None, :]              # [b, t, tp]
    mask = jnp.broadcast_to(mask[:, :, None, :], (b, t, h, tp)).reshape(b, n_q, tp)
    mask = jnp.pad(mask, ((0, 0), (0, qp - n_q), (0, 0))).astype(jnp.int8)                            # [b, qp, tp]

    n_blocks = _cdiv(n_slots, BLOCK_K)
    ns = num_splits or default_splits(n_blocks, nq * (r // dv) * b)
    ns = max(1, min(ns, n_blocks))
    bps = _cdiv(n_blocks, ns)
    o, m, l = _attention_call(flat(q_lat), flat(q_pe), kv, tree_kv, mask, lengths, layer,
                              table, scale=float(scale), dv=dv, stages=tiles.stages, ns=ns, bps=bps,
                              n_slots=n_slots, n_tree=tp // BLOCK_K, page=page, interpret=interpret)
    # Triton's merge kernel (one launch; XLA's merge_states is two): a query that saw no key (m still MASK_VALUE
    # everywhere) holds junk here (no second where in the kernel), which it zeroes, as api.py's contract says
    return merge_heads(o, m, l, t, h, MERGE_BLOCK, out_dtype or F32, bool(interpret), w_uv, w_uv_from)
