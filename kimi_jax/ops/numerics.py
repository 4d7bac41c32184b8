"""Numeric constants and helpers shared by the model, the drafter and the kernels."""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32

# The score of a masked-out key. Finite rather than -inf: a dense softmax over a row with no visible key stays free
# of NaN, and in an online (flash) softmax a fully masked block keeps the running max m finite, so
# e^(m - m_new) never computes inf - inf.
MASK_VALUE = -1e30


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (Triton loads and block sizes are powers of two)."""
    return 1 << max(0, (n - 1).bit_length())
