"""The independent oracle of the INT4 routed experts, for tests.

``int4_moe_reference`` exports the experts back to the compressed-tensors layout, dequantizes every expert with
``int4_format.dequantize_int4`` and evaluates all experts densely for every token in float32 at HIGHEST
precision; only for small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax.ops.int4_format import Int4Experts, dequantize_int4
from kimi_jax.ops.numerics import F32


def int4_moe_reference(x, topk_idx, topk_weight, experts: Int4Experts) -> jax.Array:
    """Independent oracle: every expert dequantized from the compressed-tensors layout, evaluated densely."""
    ct = experts.to_compressed_tensors()
    d, f = experts.d_model, experts.d_ff
    gate = dequantize_int4(ct["gate_packed"], ct["gate_scale"], (f, d))     # [E, F, D], HF [out, in]
    up = dequantize_int4(ct["up_packed"], ct["up_scale"], (f, d))
    down = dequantize_int4(ct["down_packed"], ct["down_scale"], (d, f))     # [E, D, F]
    hp = jax.lax.Precision.HIGHEST
    x = jnp.asarray(x, F32)
    g = jnp.einsum("td,efd->tef", x, gate, precision=hp)
    u = jnp.einsum("td,efd->tef", x, up, precision=hp)
    y = jnp.einsum("tef,edf->ted", jax.nn.silu(g) * u, down, precision=hp)   # [T, E, D]
    coef = jnp.sum(jax.nn.one_hot(topk_idx, experts.num_experts, dtype=F32)
                   * jnp.asarray(topk_weight, F32)[..., None], axis=1)       # [T, E]
    return jnp.einsum("te,ted->td", coef, y, precision=hp)
