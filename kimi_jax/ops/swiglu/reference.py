"""SwiGLU in jnp: the XLA path and the oracle of the Triton kernel."""

from __future__ import annotations

import jax


def swiglu_reference(x, gate, up, down):
    """down(silu(x @ gate) * (x @ up)); weights input-major ([in, out]), every product in x's dtype."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down
