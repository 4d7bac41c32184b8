"""Tree-verify attention over the MLA latent cache: one entry point over two implementations.

``latent_attention(q_lat, q_pe, kv, lengths, new_mask, scale)`` is the attention core of absorbed MLA
(``mla.attend_absorbed`` between W_UK and W_UV) for ``t`` new tokens (a decode step, a chain or a DDTree tree):

* ``q_lat [b,t,h,r]`` (queries with W_UK folded in), ``q_pe [b,t,h,p]`` (rotated rope part);
* ``kv [b,s,r+p]``: latent rows ``[c_kv (r) | k_pe (p)]``, or with ``page_table [b, pages_per_row]`` a page
  pool ``kv [pages, page_size, r+p]`` holding logical slot s of row b in page ``page_table[b, s // page_size]``
  (``kimi_jax.cache``). The new tokens' rows are already written at slots ``lengths + j`` (j < t);
* key ``s`` is visible to new token ``i`` iff ``s < lengths[b]`` (committed prefix) or
  ``s = lengths[b] + j`` with ``new_mask[b, i, j]`` (``kimi_jax.cache.visibility``; slots past the cache end do not
  exist);
* ``o_lat[b,i,h] = sum_s softmax_s(scale * (q_lat·c_kv[s] + q_pe·k_pe[s])) c_kv[s]`` (K = V = latent rows);
* with ``w_uv`` (MLA's kv_b [r, h, nope + v], W_UV from column ``w_uv_from``) the output is ``o_lat`` (rounded to
  the output dtype) through each head's W_UV, [b, t, h, v]: the GPU kernels apply it in their merge
  (``merge.merge_project``: no GEMM and split-K reduction after the attention), the others in XLA.

Every query must see at least one key (true in the model: every node sees itself). A query that sees nothing
gets zeros here, where the dense form (``mla._softmax`` with a finite mask value) would average all slots.

impl="xla" (``xla.py``; a paged cache is gathered through its table block by block) or impl="pallas"
(``pallas_triton.py``: split-K over the committed prefix, each row reading only its own blocks, of a paged cache
through the table) or impl="mosaic" (``mosaic_gpu.py``: the same split-K on Hopper TMA + wgmma, 16-bit caches;
compiled where the program is lowered for a GPU, in Pallas' GPU interpret mode with interpret=True, refused
otherwise), impl="tpu" (``pallas_tpu.py``: the same split-K in Pallas TPU, the scalar-prefetched lengths and page
table choosing the blocks; a program lowered for a TPU, or TPU interpret mode), or impl="auto": the first of the
target's preference whose rules take the call
(``kimi_jax.ops.registry``; the rules: ``rules.py``); ``reference.py`` is the dense oracle they are
tested against.
"""

from __future__ import annotations

import jax.numpy as jnp

from kimi_jax.ops.tree_attention.merge import project
from kimi_jax.ops.tree_attention.pallas_tpu import latent_attention_tpu
from kimi_jax.ops.tree_attention.pallas_triton import latent_attention_pallas
from kimi_jax.ops.tree_attention.rules import TREE_ATTENTION, AttentionCall
from kimi_jax.ops.tree_attention.xla import latent_attention_xla

def latent_attention(q_lat, q_pe, kv, lengths, new_mask, scale: float, *, impl: str = "auto",
                     interpret: bool = False, block_q: int | None = None, block_k: int | None = None,
                     num_splits: int | None = None, out_dtype=None, page_table=None, layer=None,
                     partitioned: bool = False, w_uv=None, w_uv_from: int = 0):
    """Absorbed-MLA attention of t new tokens over the committed prefix and their own rows (see module doc).

    q_lat [b,t,h,r], q_pe [b,t,h,p], kv [b,s,r+p] (new rows already at slots lengths + j), lengths [b] int,
    new_mask [b,t,t] bool (new token i sees new token j) -> o_lat [b,t,h,r] in ``out_dtype`` (default q_lat's
    dtype), or with ``w_uv`` [r, h, c] o_lat through ``w_uv[:, head, w_uv_from:]``: [b,t,h,c - w_uv_from] (module
    doc). Dots run in the input dtype with float32 accumulation; the softmax is float32.
    ``impl``: "auto", "xla", "pallas", "mosaic" or "tpu", resolved for the platform the program is lowered for
    (``kimi_jax.ops.registry``; a forced one that does not take the call is an error saying why);
    ``interpret=True`` forces Pallas interpret mode. Pallas tiling:
    block_q / block_k (powers of two >= 16) and num_splits (block_k <= page_size on a paged cache); "mosaic" has
    block_q = block_k = 64 (None or 64) and needs a page size that is a multiple of 64.
    page_table [b, pages_per_row] int: kv is a page pool [pages, page_size, r+p] (module doc).
    layer (int or int32 scalar): kv is the whole cache [layers, ...] and this is the layer attended over; the
    Pallas kernel reads it in place (no copy of one layer's rows out of the cache).
    partitioned: the call is left to XLA's SPMD partitioner (not inside shard_map); the rules then refuse the
    kernels it cannot partition (Mosaic TPU's).
    """
    whole = kv
    if layer is not None:
        if kv.ndim != 4:
            raise ValueError(f"with layer=, kv is the whole cache [layers, ...], got {kv.shape}")
        kv = kv[0]              # for the shape checks only
        layer = jnp.asarray(layer, jnp.int32)
    b, t, h, r = q_lat.shape
    rows_ok = kv.shape[0] == b if page_table is None else page_table.shape[0] == b and page_table.ndim == 2
    if q_pe.shape[:3] != (b, t, h) or kv.ndim != 3 or not rows_ok or kv.shape[2] != r + q_pe.shape[-1]:
        raise ValueError(f"shapes disagree: q_lat {q_lat.shape}, q_pe {q_pe.shape}, kv {kv.shape}, page_table "
                         f"{None if page_table is None else page_table.shape} (want kv [b, s, r + p], or a pool "
                         "[pages, page_size, r + p] with page_table [b, pages_per_row])")
    if new_mask.shape != (b, t, t) or lengths.shape != (b,):
        raise ValueError(f"want new_mask [{b},{t},{t}] and lengths [{b}], got {new_mask.shape}, {lengths.shape}")
    if w_uv is not None and (w_uv.ndim != 3 or w_uv.shape[:2] != (r, h) or not 0 <= w_uv_from < w_uv.shape[2]):
        raise ValueError(f"want w_uv [{r}, {h}, > w_uv_from={w_uv_from}], got {w_uv.shape}")
    lengths = lengths.astype(jnp.int32)
    new_mask = new_mask.astype(bool)
    dtype = out_dtype or q_lat.dtype

    def projected(o_lat, w_uv):         # the implementations without the projecting merge
        return o_lat if w_uv is None else project(o_lat, w_uv, w_uv_from)

    def xla(q_lat, q_pe, kv, lengths, new_mask, page_table, layer, w_uv):
        # the prefix in blocks up to the longest row (xla.py), except where the partitioner splits the slots
        # (dcp): a block's gather would then move rows between devices
        o_lat = latent_attention_xla(q_lat, q_pe, kv, lengths, new_mask, scale, page_table, layer,
                                     blocked=not partitioned)
        return projected(o_lat.astype(dtype), w_uv)

    def pallas(q_lat, q_pe, kv, lengths, new_mask, page_table, layer, w_uv, *, interpret):
        return latent_attention_pallas(q_lat, q_pe, kv, lengths, new_mask, scale, interpret=interpret,
                                       block_q=block_q, block_k=block_k, num_splits=num_splits,
                                       page_table=page_table, layer=layer, out_dtype=dtype, w_uv=w_uv,
                                       w_uv_from=w_uv_from)

    def mosaic(q_lat, q_pe, kv, lengths, new_mask, page_table, layer, w_uv, *, interpret):
        # imported here: Mosaic GPU's Python side loads only for programs that ask for it
        from kimi_jax.ops.tree_attention.mosaic_gpu import latent_attention_mosaic

        return latent_attention_mosaic(q_lat, q_pe, kv, lengths, new_mask, scale, interpret=interpret,
                                       block_q=block_q, block_k=block_k, num_splits=num_splits,
                                       page_table=page_table, layer=layer, out_dtype=dtype, w_uv=w_uv,
                                       w_uv_from=w_uv_from)

    def tpu(q_lat, q_pe, kv, lengths, new_mask, page_table, layer, w_uv, *, interpret):
        return projected(latent_attention_tpu(q_lat, q_pe, kv, lengths, new_mask, scale, interpret=interpret,
                                              block_q=block_q, block_k=block_k, num_splits=num_splits,
                                              page_table=page_table, layer=layer, out_dtype=dtype), w_uv)

    operands = (q_lat, q_pe, whole, lengths, new_mask, page_table, layer, w_uv)
    call = AttentionCall(b, t, h, r, q_pe.shape[-1], kv.shape[1] if page_table is None else
                         page_table.shape[1] * kv.shape[1], 0 if page_table is None else kv.shape[1],
                         jnp.dtype(kv.dtype).name, block_q, block_k, partitioned=partitioned)
    return TREE_ATTENTION.dispatch(call, operands, impl=impl, interpret=interpret,
                                   run={"xla": xla, "pallas": pallas, "mosaic": mosaic, "tpu": tpu})
