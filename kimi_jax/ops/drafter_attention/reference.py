"""The drafter attention's math in jnp: the XLA path on every platform, and the oracle the Pallas kernel is
tested against. It is ``drafter.block_hidden``'s attention as it was written there (the drafter's tests against
the DFlash authors' package check it), moved here unchanged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kimi_jax.ops.numerics import MASK_VALUE


def attend_reference(q, k_ctx, v_ctx, k_blk, v_blk, visible):
    """q [b, t, H, hd], context k_ctx/v_ctx [b, s, KVH, hd], block k_blk/v_blk [b, t, KVH, hd], visible
    [b, t, s + t] bool (context keys first) -> [b, t, H, hd]. Query head h reads kv head h // (H / KVH); scores
    in float32, masked keys at MASK_VALUE (a row that sees no key averages them all), probabilities rounded to
    the values' dtype."""
    b, t, heads, hd = q.shape
    kv_heads = k_blk.shape[2]
    k = jnp.concatenate([k_ctx, k_blk], axis=1)
    v = jnp.concatenate([v_ctx, v_blk], axis=1)
    q = q.reshape(b, t, kv_heads, heads // kv_heads, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, heads, hd)
