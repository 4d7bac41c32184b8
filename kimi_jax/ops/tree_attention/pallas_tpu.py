"""Tree-verify attention as one Pallas TPU (Mosaic TPU) kernel over the MLA latent cache.

The contract is ``api.py``'s (q_lat [b,t,h,r], q_pe [b,t,h,p], a contiguous cache [b,s,r+p] or a page pool
[pages, page_size, r+p] with page_table, lengths [b], the ancestor mask new_mask [b,t,t]); this is the split-K
flash-decoding of ``pallas_triton.py`` in TPU terms.

Layout.

- Absorbed MLA is MQA: all heads share the latent rows, so the ``t*h`` (node, head) pairs of a batch row are one
  query axis (node-major), padded to whole query blocks of ``bq`` rows.
- Scores take one dot: q = ``[q_lat | q_pe]`` (concatenated outside the kernel, a few hundred KB) against the
  cache block as stored, ``[c_kv | k_pe]`` (576 = 512 + 64 columns at K2.6), whose full width is a legal block
  dim. Splitting it into a 512- and a 64-wide block would put a 64-lane block on the minor axis, which is
  neither a multiple of 128 nor the array's full width. The values are the block's first ``r`` columns
  (a lane-aligned slice at K2.6: 512 = 4 x 128).
- Grid ``(split, batch row, query block, key block)``, the key-block axis last and "arbitrary": an online softmax
  keeps ``m``, ``l`` ([bq, 1]) and ``acc`` ([bq, r]) in float32 VMEM scratch across it. Split ``j`` covers
  prefix key blocks ``[j*bps, (j+1)*bps)`` of ``bk`` rows. The split axis is outermost so that a megacore chip
  (v5p) can shard it over its two TensorCores when one row and one query block are all there is (every axis
  but the key blocks is "parallel"; which one libtpu divides between the cores is not visible in a
  deviceless compile, so this is unmeasured).
- Scalar prefetch (SMEM): the lengths, the layer and the flattened page table. The cache's index_map clamps the
  key block to the row's last valid one (``ceil(lengths / bk) - 1``), so the steps past a row's length ask
  for the block already in VMEM and the pipeline issues no copy; ``pl.when`` skips their compute. Paged:
  key block ``j`` (``bk`` divides the page size) comes from page ``table[b, j*bk // page]``.
- ``layer=``: the cache is always passed whole, ``[layers, ...]`` (``kv[None]`` without it: a free reshape), and
  the index_map picks the layer, so no layer is copied out of the cache.
- The tree's own rows (``xla.tree_rows``: ``t`` rows gathered from slots ``lengths + j``, rounded up to 32) are
  folded into split 0's online softmax at its first step under the ancestor mask, which travels bit-packed
  (``pallas_triton._pack_mask``: one int32 word per query row and 32 tree keys) and is unpacked in the kernel
  with a shift, so the mask costs ``t*h*ceil(t/32)*4`` bytes a batch row. Several splits write unnormalised
  float32 partial states that merge by log-sum-exp in jnp (``xla.merge_states``); one split (the default on
  single-core chips) normalises in the kernel and writes the output in its dtype, with no partials to merge.

Tiling per generation (``TILES``, by jax's device_kind; block_k key rows, block_q query rows, num_splits).

Figures per TensorCore from ``pltpu.get_tpu_info_for_chip``: HBM bandwidth v5e 0.82 TB/s, v5p 1.23, v6e 1.64,
TPU7x 3.7; bf16 peak 197, 230, 920, 1155 TF; VMEM 128, 64, 128, 64 MiB; SMEM 1 MiB each.

- block_q. Decode attention streams the cache (576 x 2 B a key for 2 x 1088 flops a query row), so it is
  bandwidth-bound below ~peak / bandwidth query rows and compute-bound above: v5e ~240 rows, v5p ~190, v6e
  ~560, TPU7x ~310. A query block of about that many rows makes re-reading the cache for each further query
  block free (it overlaps MXU time): 256 on v5e and v5p, 512 on v6e and TPU7x. K2.6 at TP-8 (8 heads, t <= 33:
  <= 264 rows) is one query block everywhere, so the cache is read once.
- block_k. A grid step costs ~0.35 us, so a key block's copy should take longer: 512 rows (576 KB) take 0.7 us
  on v5e, 1024 rows 0.7 us on v6e and 0.9 us on v5p, 2048 rows 0.6 us on TPU7x. All are multiples of the MXU
  width (128 on v5e / v5p, 256 on v6e / TPU7x).
- VMEM: double-buffered q [bq, 576], key block [bk, 576] (bf16) and output block [bq, r], acc [bq, r] and
  the [bq, bk] float32 scores and probabilities. libtpu's scoped-VMEM figure for the kernel at 64 heads x 33
  tokens, 4096 slots (deviceless compiles): v5e 2.4 MiB, v6e 4.9, v5p 4.7, TPU7x 6.8, all under v5e's 16 MiB
  default scoped limit (the smallest), so the kernel sets no vmem_limit_bytes.
- num_splits: one TensorCore a device on v5e, v6e and TPU7x (libtpu's compile-only TPU7x devices report one
  core each), where splitting the prefix only adds partials to merge; v5p's megacore has two, so a call with
  one row and one query block splits in two (``default_splits`` divides by the rows x query blocks that
  already fill the grid's parallel axes).

The cache's layout. XLA:TPU's default layout for a 16-bit ``[..., slots, 576]`` array is slot-minor (major_to_minor
``(..., 576, slots)``: it avoids padding 576 lanes to 640), while a Mosaic kernel takes its operands row-major, so
XLA copies the whole operand, every layer's cache with ``layer=``, into a row-major buffer before each call
(deviceless compiles: 2.7 GB of temporaries for 8 rows x 256k slots). Give the cache buffers a row-major layout
(``jax.experimental.layout.Format(Layout(major_to_minor=tuple(range(kv.ndim))), sharding)`` wherever they are
made or passed to jit: the 576 lanes then pad to 640, +11% HBM) and the kernel reads them in place
(``tests/test_tree_attention_tpu.py`` asserts no relayout of the cache in the compiled HLO).

What libtpu and Pallas TPU rejected while this was built (deviceless compiles for v5e, v5p, v6e, TPU7x), and
what the kernel does about it (``rules.tpu_rules`` states each as a rule):

- key blocks of 4 or 12 rows ("the last two dimensions of your block shape are divisible by 8 and 128
  respectively, or be equal to the respective dimensions of the overall array"): key blocks are multiples of
  8 rows or a whole page / the whole cache. 8-row blocks of a bf16 cache lower (no 16-row minimum).
- a page table of 64 rows x 4096 pages: "Ran out of memory in memory space smem" (1 MiB): at most
  ``MAX_TABLE_ENTRIES`` table entries a call.
- lowering on a CPU host without a TPU mesh: "Unsupported TPU device kind: cpu"; lower under
  ``jax.set_mesh`` of compile-only TPU devices (which also gives ``lowering_tpu`` the device kind for TILES).
- an fp8 cache with bf16 queries: ``jnp.result_type`` refuses to promote 8-bit floats, so the dots' dtype is
  picked explicitly (the wider of the two).
- Nothing at K2.6 shapes: the 576-wide single dot, the [bq, 1] m / l scratch and outputs, the bit-shift mask
  unpacking and the clamped index_maps all lower on the four generations as written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kimi_jax.ops.numerics import F32, MASK_VALUE
from kimi_jax.ops.select import lowering_tpu, pick_tiles
from kimi_jax.ops.tree_attention.pallas_triton import TREE_BLOCK, _pack_mask
from kimi_jax.ops.tree_attention.rules import TILES, AttentionCall, Tiles, key_block, tpu_rules
from kimi_jax.ops.tree_attention.xla import merge_states, tree_rows


Q_ROWS = 16     # default query blocks are whole bf16 (16, 128) tiles


def default_splits(tiles: Tiles, parallel_programs: int, n_blocks: int) -> int:
    """Prefix splits: the tile's splits shared among the (row, query block) programs that already run in
    parallel, and never more than there are key blocks."""
    return max(1, min(-(-tiles.num_splits // parallel_programs), n_blocks))


def _online_update(q, keys, valid, scale, r, m_sc, l_sc, acc_sc):
    """One key block into the running (m, l, acc): q [bq, r+p], keys [n, r+p], valid [bq, n] or [1, n]."""
    s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
    s = jnp.where(valid, s, MASK_VALUE)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    prob = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(prob, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + jnp.dot(prob.astype(keys.dtype), keys[:, :r], preferred_element_type=F32)
    m_sc[...] = m_new


def _tree_update(q, tkv_ref, w_ref, scale, r, state):
    """The tree rows [tp, r+p] under the bit-packed ancestor mask w [bq, tp / 32]: key k is bit k % 32 of word
    k // 32 (the arithmetic shift's sign fill lands on bits the mask discards)."""
    keys = tkv_ref[...].astype(q.dtype)
    col = jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], keys.shape[0]), 1)
    word = w_ref[:, 0:1]
    for j in range(1, w_ref.shape[1]):          # a handful of words (t <= 256): select each key's word
        word = jnp.where(col >= j * TREE_BLOCK, w_ref[:, j:j + 1], word)
    valid = ((word >> (col & (TREE_BLOCK - 1))) & 1) == 1
    _online_update(q, keys, valid, scale, r, *state)


def _kernel(len_ref, layer_ref, table_ref, q_ref, tkv_ref, w_ref, kv_ref, *refs, scale, r, bk, bps, n_slots, ragged):
    """One (split, row, query block, key block) step. refs: the outputs, then the scratch m, l, acc: with one
    split the output o alone, normalised in out_dtype; with several the partials (o, m, l) to merge."""
    del layer_ref, table_ref                            # read by the index_maps only
    *outs, m_sc, l_sc, acc_sc = refs
    split, bi, kb = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    length = jnp.minimum(len_ref[bi], n_slots)
    start = (split * bps + kb) * bk
    q = q_ref[...]
    state = (m_sc, l_sc, acc_sc)

    @pl.when(kb == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when((kb == 0) & (split == 0))
    def _tree():
        _tree_update(q, tkv_ref, w_ref, scale, r, state)

    @pl.when(start < length)
    def _prefix():
        keys = kv_ref[...].astype(q.dtype)
        if ragged:      # the cache's last block runs past its end: rows there are unwritten VMEM (maybe NaN)
            row = start + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            keys = jnp.where(row < n_slots, keys, jnp.zeros((), keys.dtype))
        key = start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        _online_update(q, keys, key < length, scale, r, *state)

    @pl.when(kb == bps - 1)
    def _store():
        if len(outs) == 1:      # l = 0: the query saw no key (acc = 0), zeros as in api's contract
            outs[0][...] = (acc_sc[...] / jnp.where(l_sc[...] > 0, l_sc[...], 1.0)).astype(outs[0].dtype)
        else:
            for ref, sc in zip(outs, (acc_sc, m_sc, l_sc)):
                ref[...] = sc[...]


def _kv_index_map(bk, bps, n_slots, page, per_row, n_pages):
    """(split, row, query block, key block, *prefetch) -> the cache block [layer, row or page, block, 0]: the
    key block clamped to the row's last valid one, so steps past its length re-use the buffer (no copy)."""
    def index_map(split, bi, qi, kb, len_ref, layer_ref, table_ref):
        del qi
        n_valid = (jnp.minimum(len_ref[bi], n_slots) + bk - 1) // bk
        blk = jnp.minimum(split * bps + kb, jnp.maximum(n_valid - 1, 0))
        if not page:
            return layer_ref[0], bi, blk, 0
        per_page = page // bk
        pid = jnp.clip(table_ref[bi * per_row + blk // per_page], 0, n_pages - 1)   # unmapped: never computed on
        return layer_ref[0], pid, blk % per_page, 0
    return index_map


def _queries(q_lat, q_pe, dt, n_qp):
    """[b, n_qp, r+p]: [q_lat | q_pe] flattened (node, head)-major, padded to whole query blocks."""
    b, t, h, _ = q_lat.shape
    q = jnp.concatenate([q_lat.astype(dt), q_pe.astype(dt)], axis=-1).reshape(b, t * h, -1)
    return jnp.pad(q, ((0, 0), (0, n_qp - t * h), (0, 0)))


def _tree_operands(kv_layer, page_table, lengths, new_mask, h, n_qp, n_slots):
    """The tree rows [b, tp, r+p] (tp = t rounded up to 32) and the packed mask words [b, n_qp, tp / 32]."""
    b, t, _ = new_mask.shape
    tp = -(-t // TREE_BLOCK) * TREE_BLOCK
    rows, ok = tree_rows(kv_layer, page_table, lengths, t, tp, n_slots)
    mask = jnp.pad(new_mask, ((0, 0), (0, 0), (0, tp - t))) & ok[:, None, :]
    words = jnp.repeat(_pack_mask(mask), h, axis=1)                                    # [b, t*h, W]
    return rows, jnp.pad(words, ((0, 0), (0, n_qp - t * h), (0, 0)))


def latent_attention_tpu(q_lat, q_pe, kv, lengths, new_mask, scale, *, interpret=False, block_q=None,
                         block_k=None, num_splits=None, page_table=None, layer=None, out_dtype=None,
                         device_kind=None):
    """api.latent_attention's contract on a TPU (module doc). ``interpret=True`` runs Pallas' TPU interpret mode
    on a CPU: ``pltpu.InterpretParams()``, which simulates the DMAs, SMEM and VMEM (unwritten VMEM reads as NaN,
    out-of-bounds reads raise), where plain ``interpret=True`` would run the kernel as generic HLO. ``device_kind``
    picks the tiles (default: the TPU being lowered for, ``lowering_tpu``; none: TILES[""])."""
    b, t, h, r = q_lat.shape
    if layer is None:
        kv, layer = kv[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    page = 0 if page_table is None else kv.shape[2]
    n_slots = kv.shape[2] if not page else page_table.shape[1] * page
    call = AttentionCall(b, t, h, r, q_pe.shape[-1], n_slots, page, jnp.dtype(kv.dtype).name, block_q, block_k)
    device_kind = device_kind or lowering_tpu()
    tiles = pick_tiles(TILES, device_kind)
    if reason := tpu_rules(call, device_kind):
        raise ValueError(reason)
    bk = key_block(block_k or tiles.block_k, page, n_slots, bool(page))
    n_q = t * h
    bq = block_q or min(tiles.block_q, -(-n_q // Q_ROWS) * Q_ROWS)
    nq = -(-n_q // bq)
    n_blocks = -(-n_slots // bk)
    ns = min(num_splits or default_splits(tiles, b * nq, n_blocks), n_blocks)
    bps = -(-n_blocks // ns)
    # the dots' dtype: the queries', or the cache's when wider (8-bit floats have no implicit promotion)
    dt = max(jnp.result_type(q_lat, q_pe), jnp.dtype(kv.dtype), key=lambda d: d.itemsize)
    q = _queries(q_lat, q_pe, dt, nq * bq)
    lengths = lengths.astype(jnp.int32)
    kv_layer = jax.lax.dynamic_index_in_dim(kv, layer[0], 0, keepdims=False)       # fuses into the tree gather
    tree_kv, words = _tree_operands(kv_layer, page_table, lengths, new_mask.astype(bool), h, nq * bq, n_slots)
    table = jnp.zeros((1,), jnp.int32) if not page else page_table.astype(jnp.int32).reshape(-1)
    out_dtype = out_dtype or q_lat.dtype
    parts = _call(q, tree_kv, words, kv, lengths, layer, table, scale=float(scale), r=r, bq=bq, bk=bk, ns=ns,
                  bps=bps, n_slots=n_slots, page=page, per_row=0 if not page else page_table.shape[1],
                  out_dtype=out_dtype, interpret=interpret)
    if ns == 1:                 # normalised in the kernel: no partials to merge
        out = parts[0][0]
    else:
        o, m, l = parts
        out = merge_states(m[..., 0], l[..., 0], o, axis=0)
    return out[:, :n_q].astype(out_dtype).reshape(b, t, h, r)


def _call(q, tree_kv, words, kv, lengths, layer, table, *, scale, r, bq, bk, ns, bps, n_slots, page, per_row,
          out_dtype, interpret):
    """The pallas_call: with one split [o [1, b, n_qp, r] in out_dtype], else the float32 partial states
    o [ns, b, n_qp, r], m, l [ns, b, n_qp, 1]."""
    b, n_qp, c = q.shape
    tp, nw = tree_kv.shape[1], words.shape[2]
    ragged = not page and n_slots % bk != 0
    kernel = functools.partial(_kernel, scale=scale, r=r, bk=bk, bps=bps, n_slots=n_slots, ragged=ragged)
    kv_map = _kv_index_map(bk, bps, n_slots, page, per_row, kv.shape[1])
    part = lambda cols: pl.BlockSpec((None, None, bq, cols), lambda j, i, qi, k, *_: (j, i, qi, 0))  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(ns, b, n_qp // bq, bps),
        in_specs=[
            pl.BlockSpec((None, bq, c), lambda j, i, qi, k, *_: (i, qi, 0)),
            pl.BlockSpec((None, tp, c), lambda j, i, qi, k, *_: (i, 0, 0)),
            pl.BlockSpec((None, bq, nw), lambda j, i, qi, k, *_: (i, qi, 0)),
            pl.BlockSpec((None, None, bk, c), kv_map),
        ],
        out_specs=[part(r)] if ns == 1 else [part(r), part(1), part(1)],
        scratch_shapes=[pltpu.VMEM((bq, 1), F32), pltpu.VMEM((bq, 1), F32), pltpu.VMEM((bq, r), F32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=([jax.ShapeDtypeStruct((1, b, n_qp, r), out_dtype)] if ns == 1 else
                   [jax.ShapeDtypeStruct((ns, b, n_qp, r), F32)] + [jax.ShapeDtypeStruct((ns, b, n_qp, 1), F32)] * 2),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="mla_tree_attention_tpu",
    )(lengths, layer, table, q, tree_kv, words, kv)
