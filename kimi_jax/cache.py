"""The target's latent KV cache.

One array ``kv [layers, batch, slots, kv_lora_rank + qk_rope_head_dim]`` plus per-row committed lengths.
A forward pass writes its new tokens' rows at slots ``lengths[b] + t`` (scratch space past the committed
prefix) and never moves ``lengths``; the caller commits what it keeps. For plain decoding that is every row;
for a verified draft tree, ``commit`` moves the accepted nodes' rows into place first. Rows keep the RoPE
position they were computed at, so an accepted tree node at depth k, computed at position P + k, is exactly
the row a sequential decode would have written at slot P + k: nothing is recomputed.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kimi_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    kv: jax.Array        # [layers, batch, slots, latent_dim]
    lengths: jax.Array   # [batch] int32: committed rows per batch row

    @property
    def max_len(self) -> int:
        return self.kv.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    return KVCache(kv=jnp.zeros((cfg.num_hidden_layers, batch, max_len, cfg.latent_dim), dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))


def commit(cache: KVCache, path: jax.Array, path_len: jax.Array) -> KVCache:
    """Keep the rows at slots ``lengths + path[:, k]`` (k < path_len), moved to ``lengths + k``, and advance.

    path [batch, width] holds indices into the rows the last forward wrote (path[:, 0] = 0, increasing), so
    a left compaction never overwrites a row it still has to read; gather-then-scatter makes that moot anyway.
    """
    batch, width = path.shape
    rows = jnp.arange(batch)[:, None]
    src = cache.lengths[:, None] + jnp.maximum(path, 0)
    dst = cache.lengths[:, None] + jnp.arange(width)[None, :]
    keep = jnp.arange(width)[None, :] < path_len[:, None]
    dst = jnp.where(keep, dst, cache.max_len)                         # out of range: dropped by the scatter
    moved = cache.kv[:, rows, src]                                    # [layers, batch, width, latent]
    kv = cache.kv.at[:, rows, dst].set(moved, mode="drop")
    return KVCache(kv=kv, lengths=cache.lengths + path_len.astype(jnp.int32))


def visibility(lengths, new_mask, max_len):
    """[b, t, s] key visibility: the committed prefix, plus new rows (slots lengths + j) where new_mask[t, j]."""
    t = new_mask.shape[1]
    rel = jnp.arange(max_len)[None, :] - lengths[:, None]                    # [b, s]
    in_new = (rel >= 0) & (rel < t)
    new_vis = jnp.take_along_axis(new_mask, jnp.clip(rel, 0, t - 1)[:, None, :].repeat(t, 1), axis=2)
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & new_vis)
