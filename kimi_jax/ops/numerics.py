"""Numeric constants and helpers shared by the model, the drafter and the kernels (and their references): RMSNorm
in HF's order of operations and RoPE's DeepSeek pair rotation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32

# The score of a masked-out key. Finite rather than -inf: a dense softmax over a row with no visible key stays free
# of NaN, and in an online (flash) softmax a fully masked block keeps the running max m finite, so
# e^(m - m_new) never computes inf - inf.
MASK_VALUE = -1e30


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (Triton loads and block sizes are powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= ``cap`` that divides n (1 for odd n): a Triton tile along a dimension of n."""
    c = 1
    while c * 2 <= cap and n % (c * 2) == 0:
        c *= 2
    return c


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Variance in float32, cast back to the input dtype, then scale (the HF order of operations)."""
    return weight * rms_normalize(x, eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``rms_norm`` before its weight: x / rms(x), in x's dtype."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by positions * inv_freq[i] (DeepSeek / GPT-J layout).

    x: [..., T, (heads,) rope_dim] with positions [..., T]. Angles are float32 whatever the input dtype. Named
    "rope" (the model's scope for it, whichever op's reference calls it).
    """
    with jax.named_scope("rope"):
        return _rotate_pairs(x, positions, inv_freq)


def _rotate_pairs(x, positions, inv_freq):
    angles = positions.astype(jnp.float32)[..., None] * inv_freq          # [..., T, d/2]
    if x.ndim == angles.ndim + 1:                                          # a heads axis sits before rope_dim
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
