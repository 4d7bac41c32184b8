"""The dense oracle of tree-verify attention: one softmax over the [b, t, s] visibility mask, as
``mla.attend_absorbed`` computes it, in float32 at the highest precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax.cache import visibility
from kimi_jax.ops.numerics import F32, MASK_VALUE


def dense_reference(q_lat, q_pe, kv, lengths, new_mask, scale: float):
    """The oracle: one softmax over the dense [b, t, s] visibility mask, as ``mla.attend_absorbed`` computes it."""
    # Inputs upcast (exact) so that XLA:CPU never needs a bf16 x bf16 -> f32 dot, which its DotThunk lacks for
    # some shapes; the probabilities are still rounded to the cache dtype as attend_absorbed does.
    r = q_lat.shape[-1]
    hp = jax.lax.Precision.HIGHEST
    q_lat, q_pe, c_kv, k_pe = (x.astype(F32) for x in (q_lat, q_pe, kv[..., :r], kv[..., r:]))
    visible = visibility(lengths, new_mask, kv.shape[1])                         # [b, t, s]
    scores = (jnp.einsum("bthr,bsr->bhts", q_lat, c_kv, precision=hp)
              + jnp.einsum("bthp,bsp->bhts", q_pe, k_pe, precision=hp))
    scores = jnp.where(visible[:, None], scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(kv.dtype).astype(F32)
    return jnp.einsum("bhts,bsr->bthr", probs, c_kv, precision=hp)
