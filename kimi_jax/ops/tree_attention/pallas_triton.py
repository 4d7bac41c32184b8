"""Tree-verify attention as one Pallas (Triton) flash-decoding kernel over the latent cache.

One ``pl.pallas_call`` in the Triton-lowering subset (power-of-two loads, ``fori_loop``,
``pl.when``; ``interpret`` defaults to "not on a GPU").

- Absorbed MLA is MQA: all heads share the latent rows, so the ``t*h`` (node, head) pairs of a batch row are
  flattened into one query axis (node-major, padded to the query block ``bq``).
- Grid ``(nq, ns + 1, b)``: query block, key split, batch row. Query blocks are the fastest launch axis (Triton
  axis 0), so the programs streaming the same key range run together and share it through L2.
- Splits ``0 .. ns-1`` (flash-decoding): split ``j`` streams prefix key blocks ``[j*bps, (j+1)*bps)`` of ``bk``
  rows, stopping at ``ceil(lengths / bk)``, with an online softmax. Each block is two loads and two dots per
  score tile: ``[bk, r]`` c_kv and ``[bk, p]`` k_pe (576 = 512 + 64 for K2, both powers of two), then one
  ``[bq, bk] x [bk, r]`` dot for the output. The cache is read in place (never copied or padded): the last block
  of a ragged cache is loaded from ``min(start, s - bk)`` and the rows before ``start`` or at/after ``lengths``
  are masked out.
- Split ``ns`` does the tree: the ``t`` rows gathered outside the kernel (``[b, Tp, r+p]``, Tp = t rounded up to
  32: a tiny copy) under the ancestor mask, which travels bit-packed: one int32 word per query row and 32 tree
  keys, expanded in the kernel with a shift and mask (so the mask costs ``Qp * Tp / 8`` bytes, not ``Qp * Tp``).
  Tree key blocks are 32 rows.
- Paged caches (``page_table``): the kernel gets the whole page pool and the row's table; key block j of
  ``bk`` rows (``bk`` divides the page size) is loaded from page ``table[j*bk // page]`` at offset
  ``j*bk % page``, so a row streams its own pages and stops after ``ceil(lengths / bk)`` blocks, as on a
  contiguous cache. The table is padded to a power of two with unmapped entries (never read: a row's pages
  below its length are mapped).
- Feature dims that are not powers of two >= 16 (tiny test configs) are zero-padded outside the kernel, which
  copies the cache; K2's 512 + 64 never does.
- Each program writes its partial ``(acc [bq, r], m, l)`` in float32; the ``ns + 1`` partials merge by LSE in
  ``merge.py``'s Triton kernel, which also applies W_UV when the caller gives it (``merge_project``).

Tiling (for an H200; nothing here has been run on hardware yet). K2: ``h = 64`` heads (``64/TP`` per device),
``t = 1 + N`` tree nodes, head dim ``r + p = 512 + 64``, value dim 512.

- ``bq = 32`` queries (the next power of two of ``t*h`` below that, min 16 = Triton's smallest dot). One query
  block covering all ``(1+N)*64`` queries would read the cache exactly once per layer, but its float32
  accumulator alone (``1088 x 512 x 4`` B = 2.2 MB at N = 16) is far beyond one SM's registers; even 64 x 512
  is 128 KiB. With 32 queries and 8 warps the accumulator is 64 registers a thread and the q tile 32. So the
  cache is streamed once per query block (``ceil((1+N)*64/32)`` = 34 at N = 16, 4 at decode) and those reads
  hit L2 (one layer's cache at 4k context is 4.7 MB; H200 L2 50 MB) because query blocks are the fastest axis.
- ``bk = 64`` key rows per block: 64 KiB of c_kv + 8 KiB of k_pe per stage in bf16, ``num_stages = 2``.
- ``ns`` = enough splits for ~2 programs per SM (264) given ``b * nq``, but at least 4 key blocks per split and
  at most ``ceil(s / bk)``. It depends on the static cache size, not on the actual lengths, so short rows leave
  some programs idle (they exit after zero iterations).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.numerics import F32, MASK_VALUE, next_pow2
from kimi_jax.ops.select import lowering_tiles
from kimi_jax.ops.tree_attention.merge import merge_heads
from kimi_jax.ops.tree_attention.xla import tree_rows, tree_slots

TREE_BLOCK = 32         # tree keys per block = bits per mask word


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernel's tiles and Triton launch parameters (see the module docstring); block_q is the most query
    rows per block (fewer for small trees)."""
    block_q: int = 32
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2


# Per GPU (device-kind substring; "" every other): the RTX PRO 6000 Blackwell (sm_120) allows 99 KiB of shared
# memory a block, and 32 query rows x 64 keys x 2 stages take 112 KiB at K2.6 shapes; 16 query rows fit, at every
# width and paging tested (deviceless compile, 2026-12-05; tests/test_targets.py).
TILES = {"": Tiles(), "RTX PRO 6000": Tiles(block_q=16)}
TARGET_PROGRAMS = 264   # ~2 per H200 SM
MIN_BLOCKS_PER_SPLIT = 4
MIN_DOT = 16
# Query rows a program of the merge kernel: [16, 512] float32 partials. At 32 rows it spilled registers wherever
# the kernel had 2 partial states (one prefix split: caches up to 4 key blocks, or num_splits=1) and a ragged last
# query block (t*h > 32 and not a multiple of 32: 17 tree tokens x 4 heads), on every GPU target (deviceless
# compiles, tests/test_kernel_shapes.py); 16 rows compile spill-free there.
MERGE_BLOCK = 16


def _prev_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _cdiv(a, b):
    return -(-a // b)


def dot_nt(a, b):
    """a [m, k] @ b[n, k]^T in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def online_update(carry, s, valid, v):
    """One key block of an online (flash) softmax: the running (max m [bq], sum l [bq], acc [bq, dv]) of float32
    scores ``s`` [bq, nk] where ``valid``, values ``v`` [nk, dv]. A row with no valid key so far keeps
    m = MASK_VALUE, l = 0 and acc = 0 (``merge.merge_pallas`` gives it zeros). Shared with the drafter's attention."""
    m, l, acc = carry
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    prob = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(prob, axis=1)
    acc = alpha[:, None] * acc + jnp.dot(prob.astype(v.dtype), v, preferred_element_type=F32)
    return m_new, l, acc


def _online_update(carry, q, qpe, c, kpe, valid, scale):
    return online_update(carry, (dot_nt(q, c) + dot_nt(qpe, kpe)) * scale, valid, c)      # MLA: K = V = c


def _kernel(len_ref, layer_ref, q_ref, qpe_ref, kv_ref, pt_ref, tkv_ref, w_ref, o_ref, m_ref, l_ref, *,
            scale, r, p, bk, bps, n_splits, n_slots, n_rows, n_words, page, n_new, inplace):
    split, bi = pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    length = jnp.minimum(len_ref[bi], n_slots)
    q = q_ref[...]                  # q, q_pe arrive in the promoted dtype; cache tiles are cast to it (no-op
    qpe = qpe_ref[...]              # when the cache has the same dtype, as in the model)
    bq = q.shape[0]
    dt = q.dtype
    init = (jnp.full((bq,), MASK_VALUE, F32), jnp.zeros((bq,), F32), jnp.zeros((bq, r), F32))

    def store(state):
        m, l, acc = state
        m_ref[...] = m
        l_ref[...] = l
        o_ref[...] = acc

    @pl.when(split < n_splits)
    def _prefix():
        first = split * bps
        last = jnp.minimum(first + bps, (length + bk - 1) // bk)

        def body(j, carry):
            start = j * bk
            if page:                                        # paged: block j lies inside one page
                at = (layer, jnp.minimum(pt_ref[start // page], kv_ref.shape[1] - 1), pl.ds(start % page, bk))
                row0 = start
            else:
                row0 = jnp.minimum(start, n_rows - bk)      # stay in bounds on a ragged cache; mask the overlap
                at = (layer, bi, pl.ds(row0, bk))
            c = kv_ref[(*at, pl.ds(0, r))].astype(dt)
            kpe = kv_ref[(*at, pl.ds(r, p))].astype(dt)
            key = row0 + jnp.arange(bk, dtype=jnp.int32)
            valid = ((key >= start) & (key < length))[None, :]
            return _online_update(carry, q, qpe, c, kpe, valid, scale)

        store(jax.lax.fori_loop(first, jnp.maximum(last, first), body, init))

    @pl.when(split == n_splits)
    def _tree():
        bit = jnp.arange(TREE_BLOCK, dtype=jnp.int32)[None, :]

        def body(j, carry):
            words = w_ref[:, pl.ds(j, 1)]                                # [bq, 1]
            if inplace:     # contiguous cache: tree key 32j + k is row lengths + 32j + k of the cache itself
                base = len_ref[bi] + j * TREE_BLOCK
                row0 = jnp.clip(base, 0, n_rows - TREE_BLOCK)            # in bounds; keys before base masked
                at = (layer, bi, pl.ds(row0, TREE_BLOCK))
                c = kv_ref[(*at, pl.ds(0, r))].astype(dt)
                kpe = kv_ref[(*at, pl.ds(r, p))].astype(dt)
                rel = (row0 - base) + bit                                # tree key index - 32j
                valid = ((rel >= 0) & (rel < TREE_BLOCK) & (rel + j * TREE_BLOCK < n_new)
                         & (row0 + bit < n_slots) & (((words >> jnp.clip(rel, 0, TREE_BLOCK - 1)) & 1) == 1))
            else:
                c = tkv_ref[pl.ds(j * TREE_BLOCK, TREE_BLOCK), pl.ds(0, r)].astype(dt)
                kpe = tkv_ref[pl.ds(j * TREE_BLOCK, TREE_BLOCK), pl.ds(r, p)].astype(dt)
                valid = ((words >> bit) & 1) == 1                        # [bq, 32] (bit 31: the arithmetic
                #                                                          shift's sign fill is masked off)
            return _online_update(carry, q, qpe, c, kpe, valid, scale)

        store(jax.lax.fori_loop(0, n_words, body, init))


def _pack_mask(mask):
    """bool [..., 32*W] -> int32 [..., W], bit k of word w = mask[..., 32w + k]."""
    *lead, n = mask.shape
    bits = mask.reshape(*lead, n // TREE_BLOCK, TREE_BLOCK).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(TREE_BLOCK, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def default_splits(n_blocks: int, programs_per_split: int) -> int:
    by_occupancy = _cdiv(TARGET_PROGRAMS, max(programs_per_split, 1))
    by_work = _cdiv(n_blocks, MIN_BLOCKS_PER_SPLIT)
    return max(1, min(by_occupancy, by_work, n_blocks))


def latent_attention_pallas(q_lat, q_pe, kv, lengths, new_mask, scale, *, interpret, block_q, block_k,
                             num_splits, page_table=None, layer=None, out_dtype=None, w_uv=None, w_uv_from=0):
    b, t, h, r_in = q_lat.shape
    # The kernel reads the whole cache kv [layers, ...] at ``layer`` in place: slicing one layer out in XLA
    # (kv[layer]) would copy it into its own buffer for the custom call (4.7 MB per layer at 4096 slots).
    if layer is None:
        kv, layer = kv[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kv_layer = jax.lax.dynamic_index_in_dim(kv, layer[0], 0, keepdims=False)       # fuses into the tree gather
    p_in = q_pe.shape[-1]
    page = 0 if page_table is None else kv.shape[2]
    if page and (page < MIN_DOT or page & (page - 1)):
        raise ValueError(f"the Pallas kernel needs a page size that is a power of two >= {MIN_DOT}, got {page}")
    n_slots = kv.shape[2] if not page else page_table.shape[1] * page          # logical slots per row
    # Tree rows are gathered before any padding: from logical slots, through the table when paged. A contiguous
    # cache of at least TREE_BLOCK slots needs no gather: the kernel reads them at lengths + j in place.
    tp = _cdiv(t, TREE_BLOCK) * TREE_BLOCK
    inplace = not page and n_slots >= TREE_BLOCK
    if inplace:
        _, _, ok = tree_slots(lengths, t, tp, n_slots)
        tree_kv = None
    else:
        tree_kv, ok = tree_rows(kv_layer, page_table, lengths, t, tp, n_slots)
    r, p = max(MIN_DOT, next_pow2(r_in)), max(MIN_DOT, next_pow2(p_in))
    if (r, p) != (r_in, p_in):   # small test models only (K2: 512 + 64): zero-pad the feature dims (copies kv)
        q_lat = jnp.pad(q_lat, ((0, 0),) * 3 + ((0, r - r_in),))
        q_pe = jnp.pad(q_pe, ((0, 0),) * 3 + ((0, p - p_in),))
        pad = lambda x: jnp.concatenate(  # noqa: E731
            [jnp.pad(x[..., :r_in], ((0, 0),) * (x.ndim - 1) + ((0, r - r_in),)),
             jnp.pad(x[..., r_in:], ((0, 0),) * (x.ndim - 1) + ((0, p - p_in),))], axis=-1)
        kv, tree_kv = pad(kv), tree_kv if tree_kv is None else pad(tree_kv)
    if not page and n_slots < MIN_DOT:   # tiny caches only: pad so that one key block fits (rows past lengths
        kv = jnp.pad(kv, ((0, 0), (0, 0), (0, MIN_DOT - n_slots), (0, 0)))    # are masked)
    n_rows = kv.shape[2]
    if page:
        table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, next_pow2(page_table.shape[1]) -
                                                                 page_table.shape[1])), constant_values=kv.shape[1])
    else:
        table = jnp.zeros((b, 1), jnp.int32)                                     # unused

    n_q = t * h
    tiles = lowering_tiles(TILES) if not interpret else Tiles()
    bq = block_q or min(tiles.block_q, max(MIN_DOT, next_pow2(n_q)))
    for name, v in (("block_q", bq), ("block_k", block_k or tiles.block_k)):
        if v < MIN_DOT or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_DOT}, got {v}")
    bk = min(block_k or tiles.block_k, _prev_pow2(n_rows))         # paged: n_rows = page, so bk divides it
    nq = _cdiv(n_q, bq)
    n_blocks = _cdiv(n_slots, bk)
    ns = num_splits or default_splits(n_blocks, nq * b)
    ns = max(1, min(ns, n_blocks))
    bps = _cdiv(n_blocks, ns)

    # Queries, mask words and outputs keep their n_q rows, unpadded: the last query block is ragged and Pallas'
    # Triton lowering masks its loads and stores past n_q (padding them to qp copied q_lat and q_pe per layer).
    flat = lambda x: x.reshape(b, n_q, -1)  # noqa: E731
    dt = jnp.result_type(q_lat, q_pe, kv)
    q2, qpe2 = flat(q_lat.astype(dt)), flat(q_pe.astype(dt))

    n_words = tp // TREE_BLOCK
    mask = jnp.pad(new_mask.astype(bool), ((0, 0), (0, 0), (0, tp - t))) & ok[:, None, :]    # [b, t, tp]
    words = jnp.broadcast_to(_pack_mask(mask)[:, :, None, :], (b, t, h, n_words))
    words = flat(words)                                                                    # [b, n_q, W]

    kernel = functools.partial(_kernel, scale=float(scale), r=r, p=p, bk=bk, bps=bps, n_splits=ns,
                               n_slots=n_slots, n_rows=n_rows, n_words=n_words, page=page, n_new=t, inplace=inplace)
    kv_spec = pl.BlockSpec(kv.shape, lambda i, j, k: (0, 0, 0, 0))   # whole cache; the kernel picks layer and row
    if inplace:             # the tree operand is unused: pass the cache again (no buffer of its own)
        tree_kv, tree_spec = kv, kv_spec
    else:
        tree_spec = pl.BlockSpec((None, tp, r + p), lambda i, j, k: (k, 0, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(nq, ns + 1, b),
        in_specs=[
            pl.BlockSpec((b,), lambda i, j, k: (0,)),
            pl.BlockSpec((1,), lambda i, j, k: (0,)),
            pl.BlockSpec((None, bq, r), lambda i, j, k: (k, i, 0)),
            pl.BlockSpec((None, bq, p), lambda i, j, k: (k, i, 0)),
            kv_spec,
            pl.BlockSpec((None, table.shape[1]), lambda i, j, k: (k, 0)),
            tree_spec,
            pl.BlockSpec((None, bq, n_words), lambda i, j, k: (k, i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, r), lambda i, j, k: (k, j, i, 0)),
            pl.BlockSpec((None, None, bq), lambda i, j, k: (k, j, i)),
            pl.BlockSpec((None, None, bq), lambda i, j, k: (k, j, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, ns + 1, n_q, r), F32),
            jax.ShapeDtypeStruct((b, ns + 1, n_q), F32),
            jax.ShapeDtypeStruct((b, ns + 1, n_q), F32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="mla_tree_attention",
    )(lengths.astype(jnp.int32), layer, q2, qpe2, kv, table, tree_kv, words)
    return merge_heads(o, m, l, t, h, MERGE_BLOCK, out_dtype or F32, interpret, w_uv, w_uv_from, latent=r_in)
