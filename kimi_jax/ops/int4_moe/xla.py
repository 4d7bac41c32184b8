"""The INT4 routed experts in XLA (the CPU default).

The grouping of ``routing.py``, then a ``lax.scan`` over row blocks that dequantizes only the block's expert
(gathered by id) and runs the SwiGLU with plain dots; ``bm`` up to 512, since on CPU fewer, larger blocks amortise
the dequantization. Memory stays at one dequantized expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax.ops.int4_format import Int4Experts, dequantize_kernel_layout
from kimi_jax.ops.numerics import F32

XLA_BLOCK_M = (8, 512)


def experts_xla(xs: jax.Array, block_expert: jax.Array, ex: Int4Experts) -> jax.Array:
    nb = block_expert.shape[0]
    bm = xs.shape[0] // nb
    dt = xs.dtype
    fp = ex.w2.shape[-2] * 8

    def block(xb, e):
        w13 = dequantize_kernel_layout(ex.w13[e], ex.s13[e]).astype(dt)       # [2, Dp, F]
        g = jnp.dot(xb, w13[0], preferred_element_type=F32)
        u = jnp.dot(xb, w13[1], preferred_element_type=F32)
        h = (jax.nn.silu(g) * u).astype(dt)
        h = jnp.pad(h, ((0, 0), (0, fp - h.shape[1])))
        w2 = dequantize_kernel_layout(ex.w2[e], ex.s2[e]).astype(dt)          # [Fp, D]
        return jnp.dot(h, w2, preferred_element_type=F32)

    def skip(xb, e):
        return jnp.zeros((bm, ex.d_model), F32)

    def step(carry, inp):
        xb, e = inp
        return carry, jax.lax.cond(e >= 0, block, skip, xb, e)

    _, out = jax.lax.scan(step, None, (xs.reshape(nb, bm, -1), block_expert))
    return out.reshape(nb * bm, ex.d_model)
