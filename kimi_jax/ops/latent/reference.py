"""The latent projection in jnp: the XLA path, and the oracle the Pallas kernel is tested against.

From a layer's input rows ``x`` (before the attention's RMSNorm) to what MLA's attention needs of them: the
query's normalised latent ``cq = q_a_norm(norm(x) @ q_a)`` and the cache rows ``[kv_a_norm(c_kv) ‖ rope(k_pe)]``
with ``[c_kv ‖ k_pe] = norm(x) @ kv_a`` (HF's DeepseekV3Attention; every norm HF's order of operations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax import cache as cache_lib
from kimi_jax.ops.numerics import apply_rope, rms_norm


def latent_reference(x, norm, q_a, kv_a, q_a_norm, kv_a_norm, positions, inv_freq, cache=None, *, eps: float,
                     latent_eps: float):
    """x [b, T, D] with positions [b, T] -> (cq [b, T, Q], rows [b, T, R + P]) in x's dtype; with ``cache`` =
    (kv, page_table or None, layer, slots [b, T]) the rows written into the whole cache kv at ``layer``
    (``kimi_jax.cache.write``) and (cq, kv) returned."""
    h = rms_norm(x, norm, eps)
    cq = rms_norm(h @ q_a, q_a_norm, latent_eps)
    a = h @ kv_a
    r = kv_a_norm.shape[0]
    c_kv = rms_norm(a[..., :r], kv_a_norm, latent_eps)
    rows = jnp.concatenate([c_kv, apply_rope(a[..., r:], positions, inv_freq)], axis=-1)
    if cache is None:
        return cq, rows
    kv, page_table, layer, slots = cache
    with jax.named_scope("cache_write"):
        return cq, cache_lib.write(kv, page_table, layer, slots, rows)


def queries_reference(cq, q_b, kv_b, positions, inv_freq):
    """Absorbed MLA's queries from the query latent cq [..., T, Q] (``latent_reference``): q = cq @ q_b split into
    q_nope and q_pe, W_UK (kv_b's first nope columns) folded into q_nope, q_pe rotated -> (q_lat [..., T, H, R],
    q_pe [..., T, H, P]); q_b [Q, H, nope + P], kv_b [R, H, nope + V]."""
    nope = q_b.shape[-1] - 2 * inv_freq.shape[0]
    q = jnp.einsum("...tq,qhk->...thk", cq, q_b)
    q_lat = jnp.einsum("...thn,rhn->...thr", q[..., :nope], kv_b[..., :nope])
    return q_lat, apply_rope(q[..., nope:], positions, inv_freq)
