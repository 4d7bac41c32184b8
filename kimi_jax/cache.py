"""The target's latent KV cache: contiguous, or paged with a per-row page table.

Per layer and token the cache holds one latent row ``[c_kv | k_pe]``. Two layouts of the same logical rows:

* contiguous: ``kv [layers, batch, slots, latent]``; every row of a batch gets ``slots`` rows of storage.
* paged: ``kv [layers, pages, page_size, latent]`` (a pool) and ``page_table [batch, pages_per_row]``: logical
  slot ``s`` of row ``b`` lives in page ``page_table[b, s // page_size]`` at offset ``s % page_size``. Rows of
  one batch hold very different lengths at the memory of their own lengths, not every row at the longest's.
  Table entries equal to ``pages`` are unmapped: reads there give zeros, writes are dropped.

A contiguous cache is the paged one with one page per row (``page_size = slots``, ``page_table[b] = [b]``), so
every function below has one body over (page, offset) indices; only ``rows_upto`` (and ``rows_view``) of a
contiguous cache slice instead of gathering.

A forward pass writes its new tokens' rows at slots ``lengths[b] + t`` (scratch space past the committed prefix)
and never moves ``lengths``; the caller commits what it keeps. For plain decoding that is every row; for a
verified draft tree, ``commit`` moves the accepted nodes' rows into place first. Rows keep the RoPE position
they were computed at, so an accepted tree node at depth k, computed at position P + k, is exactly the row a
sequential decode would have written at slot P + k: nothing is recomputed.
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    kv: jax.Array                      # contiguous [layers, batch, slots, latent]; paged [layers, pages, page, latent]
    lengths: jax.Array                 # [batch] int32: committed rows per batch row
    page_table: jax.Array | None = None    # paged only: [batch, pages_per_row] int32

    @property
    def max_len(self) -> int:
        """Logical slots per row."""
        if self.page_table is None:
            return self.kv.shape[2]
        return self.page_table.shape[1] * self.kv.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    return KVCache(kv=jnp.zeros((cfg.num_hidden_layers, batch, max_len, cfg.latent_dim), dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


def pages_needed(capacities, page_size: int):
    """Pages per row for rows that will hold ``capacities`` slots (numpy or jnp, elementwise)."""
    return -(-capacities // page_size)


def init_paged_cache(cfg: ModelConfig, capacities, max_len: int, page_size: int, pool_pages: int,
                     dtype=jnp.float32) -> KVCache:
    """A paged cache whose row b owns ``pages_needed(capacities[b])`` consecutive pages of a pool of
    ``pool_pages`` (static; at least the sum of those), logical length ``max_len`` (a multiple of page_size).
    capacities may be traced: the table is computed on the device."""
    if max_len % page_size:
        raise ValueError(f"max_len {max_len} is not a multiple of the page size {page_size}")
    per_row = max_len // page_size
    n = pages_needed(jnp.minimum(capacities.astype(jnp.int32), max_len), page_size)
    first = jnp.cumsum(n) - n
    i = jnp.arange(per_row, dtype=jnp.int32)[None, :]
    table = jnp.where((i < n[:, None]) & (first[:, None] + i < pool_pages), first[:, None] + i, pool_pages)
    return KVCache(kv=jnp.zeros((cfg.num_hidden_layers, pool_pages, page_size, cfg.latent_dim), dtype),
                   lengths=jnp.zeros(capacities.shape, jnp.int32), page_table=table.astype(jnp.int32))


def pool_size(capacities: np.ndarray, max_len: int, page_size: int) -> int:
    """Host side: the pages init_paged_cache needs for these capacities, rounded up to a multiple of 8 so that
    requests of similar total length share one compiled program."""
    pages = int(pages_needed(np.minimum(np.asarray(capacities), max_len), page_size).sum())
    return -(-pages // 8) * 8


def locate(page_table, slots, batch: int, page_size: int, num_pages: int):
    """(page, offset) [b, n] of logical slots [b, n]; page = num_pages (out of range) where unmapped."""
    if page_table is None:              # one page per row
        page_table = jnp.arange(batch, dtype=jnp.int32)[:, None]
    per_row = page_table.shape[1]
    logical = slots // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, per_row - 1), axis=1)
    page = jnp.where((slots >= 0) & (logical < per_row), page, num_pages)
    return page, slots % page_size


def write(kv, page_table, layer, slots, rows):
    """The whole cache array kv [layers, ...] with rows [b, n, latent] stored at logical slots [b, n] of
    ``layer``; slots past a row's storage are dropped."""
    page, off = locate(page_table, slots, slots.shape[0], kv.shape[2], kv.shape[1])
    return kv.at[layer, page, off].set(rows.astype(kv.dtype), mode="drop")


def gather(kv, page_table, slots, layer=None):
    """Rows [b, n, latent] at logical slots [b, n] of one layer's storage kv [pages_or_batch, ...], or with
    ``layer`` of that layer of the whole cache [layers, ...] (read in place); zeros where a slot has no storage."""
    where = locate(page_table, slots, slots.shape[0], kv.shape[-2], kv.shape[-3])
    return (kv.at[where] if layer is None else kv.at[(layer, *where)]).get(mode="fill", fill_value=0)


def rows_view(kv_layer, page_table):
    """One layer's logical rows [b, max_len, latent]: the array itself when contiguous, the pages gathered
    through the table when paged (unmapped pages read as zeros): ``rows_upto`` of every slot."""
    page = kv_layer.shape[1]
    return rows_upto(kv_layer, page_table, page if page_table is None else page_table.shape[1] * page)


def slot_buckets(n_slots: int, smallest: int = 64) -> tuple[int, ...]:
    """The slot counts an attention may read: ``smallest`` times powers of four below n_slots, then n_slots. Four
    apart, not two: each is a branch compiled into the program, and reading up to 4x the slots used costs less
    than compiling twice the branches (``over_used_slots``)."""
    buckets = []
    while smallest < n_slots:
        buckets.append(smallest)
        smallest *= 4
    return (*buckets, n_slots)


def over_used_slots(used, n_slots: int, read: Callable[[int], jax.Array], smallest: int = 64):
    """``read(s)`` for the smallest of ``slot_buckets(n_slots, smallest)`` that holds ``used`` (run-time: no row
    sees a slot at or past it), picked by ``lax.switch``. ``read(s)`` attends over each row's first s slots only,
    which is exact when no key past ``used`` is visible: one program whose attention costs what the rows' lengths
    need, where the plain form reads every slot of a cache sized for the longest request. ``smallest``: the
    fewest slots any call can need (its own new rows; buckets below it would never be picked)."""
    buckets = slot_buckets(n_slots, max(smallest, 1))
    if len(buckets) == 1:
        return read(n_slots)
    index = jnp.sum(jnp.asarray(buckets[:-1], jnp.int32) < used)
    return jax.lax.switch(index, [functools.partial(read, s) for s in buckets])


def rows_upto(kv, page_table, slots: int, layer=None):
    """Each row's first ``slots`` logical rows [b, slots, latent] (of a paged cache: the whole pages holding them,
    so possibly a few more; unmapped pages read as zeros) of one layer's storage ``kv``, or with ``layer`` of that
    layer of the whole cache [layers, ...]; only those rows are read (no copy of the layer's other slots)."""
    if page_table is None:
        return kv[:, :slots] if layer is None else kv[layer, :, :slots]
    pages = page_table[:, :-(-slots // kv.shape[-2])]
    got = (kv.at[pages] if layer is None else kv.at[layer, pages]).get(mode="fill", fill_value=0)
    return got.reshape(pages.shape[0], -1, kv.shape[-1])


def commit(cache: KVCache, path: jax.Array, path_len: jax.Array) -> KVCache:
    """Keep the rows at slots ``lengths + path[:, k]`` (k < path_len), moved to ``lengths + k``, and advance.

    path [batch, width] holds indices into the rows the last forward wrote (path[:, 0] = 0, increasing), so
    a left compaction never overwrites a row it still has to read; gather-then-scatter makes that moot anyway.
    """
    batch, width = path.shape
    page_size, num_pages = cache.kv.shape[2], cache.kv.shape[1]
    k = jnp.arange(width)[None, :]
    src = locate(cache.page_table, cache.lengths[:, None] + jnp.maximum(path, 0), batch, page_size, num_pages)
    dst_page, dst_off = locate(cache.page_table, cache.lengths[:, None] + k, batch, page_size, num_pages)
    dst_page = jnp.where(k < path_len[:, None], dst_page, num_pages)              # out of range: dropped
    moved = cache.kv.at[:, src[0], src[1]].get(mode="fill", fill_value=0)        # [layers, batch, width, latent]
    kv = cache.kv.at[:, dst_page, dst_off].set(moved, mode="drop")
    return cache.replace(kv=kv, lengths=cache.lengths + path_len.astype(jnp.int32))


def visibility(lengths, new_mask, max_len):
    """[b, t, s] key visibility: the committed prefix, plus new rows (slots lengths + j) where new_mask[t, j]."""
    t = new_mask.shape[1]
    rel = jnp.arange(max_len)[None, :] - lengths[:, None]                    # [b, s]
    in_new = (rel >= 0) & (rel < t)
    new_vis = jnp.take_along_axis(new_mask, jnp.clip(rel, 0, t - 1)[:, None, :].repeat(t, 1), axis=2)
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & new_vis)
