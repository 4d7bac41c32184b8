"""Tree-verify attention in XLA: the exact split of the softmax into the committed prefix and the tree rows.

Exact softmax splitting ([sglang-29706]; tags refer to docs/sources.md): the keys split into the committed
prefix (no mask beyond ``s < lengths``, shared by every query) and the ``t`` tree rows (the ancestor mask). Each
part gives a partial state (running max ``m``, sum ``l``, unnormalised output ``acc``) and the states merge by
log-sum-exp: ``o = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i``.

**impl="xla"**: that recipe with einsum passes (the prefix masked by ``s < lengths``, the tree over the ``t`` rows
gathered at ``lengths + j``), merged by LSE. The prefix runs in blocks of 128 slots in a loop whose trip count is
the longest row's (a run-time value): one program serves every length, at the cost of the lengths it attends
over and not of the cache's size (a notebook Model's cache spans its whole context; kimi_jax.decoding.programs).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kimi_jax.cache import gather
from kimi_jax.ops.numerics import F32, MASK_VALUE


def tree_slots(lengths, t: int, width: int, n_slots: int, offset=None):
    """Where the kernels' ``width`` tree key columns sit: column k is tree node ``k - offset`` (offset [b]; None:
    node k) at logical slot ``lengths + node``. Returns (node, slot, ok), each [b, width]; ok where the node
    exists (0 <= node < t) and its slot is one of the n_slots logical slots."""
    node = jnp.arange(width, dtype=jnp.int32)[None, :]
    if offset is not None:
        node = node - offset[:, None]
    slot = lengths[:, None] + node
    return node, slot, (node >= 0) & (node < t) & (slot < n_slots) & (slot >= 0)


def tree_rows(kv, page_table, lengths, t: int, width: int, n_slots: int):
    """The rows at logical slots lengths + j (j < width) [b, width, c] of one layer's storage kv (contiguous
    [b, s, c], or a page pool with page_table; kimi_jax.cache), zeroed where j >= t or past the n_slots logical
    slots, and that validity [b, width]."""
    _, slot, ok = tree_slots(lengths, t, width, n_slots)
    rows = gather(kv, page_table, slot)
    return jnp.where(ok[:, :, None], rows, jnp.zeros((), kv.dtype)), ok


def _partial_state(q_lat, q_pe, c_kv, k_pe, visible, scale):
    """(m, l, acc) of one key part; visible broadcasts to [b, t, h, s]. acc is unnormalised, float32."""
    scores = (jnp.einsum("bthr,bsr->bths", q_lat, c_kv, preferred_element_type=F32)
              + jnp.einsum("bthp,bsp->bths", q_pe, k_pe, preferred_element_type=F32)) * scale
    scores = jnp.where(visible, scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1)
    probs = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    acc = jnp.einsum("bths,bsr->bthr", probs.astype(c_kv.dtype), c_kv, preferred_element_type=F32)
    return m, jnp.sum(probs, axis=-1), acc


def merge_states(m, l, acc, axis: int):
    """LSE merge of partial states stacked along ``axis`` (m, l: [..., q]; acc: [..., q, r]) -> [..., q, r].
    ``(M, L)`` comes from one variadic reduction (the online softmax's own pairwise rule), so the merge is two GPU
    kernels, not three (a max, then a sum that needs it)."""
    def pair(a, b):
        (ma, la), (mb, lb) = a, b
        mm = jnp.maximum(ma, mb)
        return mm, la * jnp.exp(ma - mm) + lb * jnp.exp(mb - mm)

    lowest = jnp.finfo(F32).min     # finite: exp(lowest - lowest) stays 1, where -inf would give nan
    big_m, total = lax.reduce((m.astype(F32), l.astype(F32)), (F32(lowest), F32(0)), pair, (axis % m.ndim,))
    w = jnp.exp(m - jnp.expand_dims(big_m, axis))
    out = jnp.sum(jnp.expand_dims(w, -1) * acc, axis=axis)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def latent_attention_xla(q_lat, q_pe, kv, lengths, new_mask, scale, page_table=None, layer=None,
                         block: int = 128, blocked: bool = True):
    """The module doc's recipe over kv [b, s, r + p] (a page pool with ``page_table``; with ``layer``, that layer
    of the whole cache [layers, ...], read in place). ``blocked``: the prefix pass runs over blocks of ``block``
    slots, as many as the longest row's length needs (a run-time count, so its cost follows the rows' lengths and
    not the cache's size, with one loop body compiled); a contiguous cache whose slots are not whole blocks, or
    of one block, or ``blocked=False``: one dense pass over every slot."""
    r = q_lat.shape[-1]
    b, t = new_mask.shape[:2]
    page = kv.shape[-2]
    n_slots = page_table.shape[1] * page if page_table is not None else page

    def prefix_state(first, size):      # the partial state of the prefix's slots first + [0, size)
        slots = first + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (b, size))
        if page_table is not None:
            rows = gather(kv, page_table, slots, layer)
        elif layer is None:             # a slice, not a gather: the slots are whole blocks (no clamped start)
            rows = lax.dynamic_slice_in_dim(kv, first, size, axis=1)
        else:
            rows = lax.dynamic_slice(kv, (layer, 0, first, 0), (1, b, size, kv.shape[-1]))[0]
        visible = (slots < lengths[:, None])[:, None, None, :]                                 # [b, 1, 1, size]
        return _partial_state(q_lat, q_pe, rows[..., :r], rows[..., r:], visible, scale)

    def online(i, state):               # the flash update with block i
        m, l, acc = state
        mi, li, ai = prefix_state(i * block, block)
        new_m = jnp.maximum(m, mi)
        old, now = jnp.exp(m - new_m), jnp.exp(mi - new_m)
        return new_m, l * old + li * now, acc * old[..., None] + ai * now[..., None]

    if blocked and n_slots > block and (page_table is not None or n_slots % block == 0):
        # block 0 outside the loop: a short context runs no iteration (on CPUs each one costs a dispatch)
        m1, l1, a1 = lax.fori_loop(1, -(-jnp.max(lengths) // block), online, prefix_state(0, block))
    else:
        m1, l1, a1 = prefix_state(0, n_slots)
    _, slot, ok = tree_slots(lengths, t, t, n_slots)
    rows = jnp.where(ok[:, :, None], gather(kv, page_table, slot, layer), jnp.zeros((), kv.dtype))
    tree_vis = (new_mask & ok[:, None, :])[:, :, None, :]                                  # [b, t, 1, t]
    m2, l2, a2 = _partial_state(q_lat, q_pe, rows[..., :r], rows[..., r:], tree_vis, scale)
    return merge_states(jnp.stack([m1, m2]), jnp.stack([l1, l2]), jnp.stack([a1, a2]), axis=0)
