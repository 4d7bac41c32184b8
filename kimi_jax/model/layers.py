"""Small building blocks of the K2 decoder: YaRN RoPE frequencies, the NeoX rotation (the drafter's), the SwiGLU
MLP with its residual (on one device or split over a mesh), and the loop over a stack of layers (stacked, or
per-layer buffers: ``kimi_jax.model.compute_layout``). RMSNorm and the DeepSeek pair rotation live in
``kimi_jax.ops.numerics``: the kernels' references read them too."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kimi_jax.config import ModelConfig
from kimi_jax.ops.swiglu.api import swiglu


def yarn_inv_freq(cfg: ModelConfig) -> jax.Array:
    """The target's per-pair inverse frequencies [qk_rope_head_dim / 2]."""
    return yarn_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_factor,
                            cfg.rope_original_max_position_embeddings, cfg.rope_beta_fast, cfg.rope_beta_slow)


def yarn_frequencies(dim: int, theta: float, factor: float, original_max: int, beta_fast: float,
                     beta_slow: float) -> jax.Array:
    """Inverse frequencies [dim/2] with the YaRN ramp between beta_fast and beta_slow (factor <= 1: plain RoPE).

    The correction range uses original_max_position_embeddings (as HF 5.x, vLLM and DeepSeek's code do);
    the cos/sin tables are not rescaled for the K2 target (mscale ratio 1); its softmax scale carries mscale^2.
    """
    extra = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    if factor <= 1.0:
        return extra
    inter = extra / factor

    def correction_dim(n_rot):
        return dim * math.log(original_max / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp
    return inter * (1.0 - extrapolate) + extra * extrapolate


def apply_rope_half(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """NeoX / Qwen3 layout: rotate (x[i], x[i + d/2]) by positions * inv_freq[i]; cos/sin multiplied by scale.

    x: [b, t, heads, d] with positions [b, t].
    """
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq         # [b, t, 1, d/2]
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    xf = x.astype(jnp.float32)
    first, second = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def residual_swiglu(x, h, gate, up, down, *, impl: str = "auto", mesh=None, mlp_axes: tuple = (),
                    rows_spec=None):
    """x + down(silu(h @ gate) * (h @ up)) (weights input-major), the SwiGLU through ``kimi_jax.ops.swiglu`` (on a
    GPU at decode widths a split-K GEMM and one kernel). Under ``mesh`` the SwiGLU runs in ``jax.shard_map``: each
    device on its slice of the hidden width (split over ``mlp_axes``; none: whole) and its rows (``rows_spec``,
    the PartitionSpec of h), then one psum over ``mlp_axes`` (a Pallas call is opaque to the partitioner, which
    would gather the weights onto every device). The residual is added after the psum, where XLA fuses the add
    into the next norm's kernel (added before it, on one device, it was a kernel of its own: the kernel's output
    cannot take it)."""
    def local(h, gate, up, down):
        y = swiglu(h, gate, up, down, impl=impl)
        return jax.lax.psum(y, mlp_axes) if mlp_axes else y

    if mesh is None or mesh.size == 1:
        return x + swiglu(h, gate, up, down, impl=impl)
    rows = rows_spec if rows_spec is not None else P()
    split = mlp_axes or None
    return x + jax.shard_map(local, mesh=mesh, out_specs=rows, check_vma=False,
                             in_specs=(rows, P(None, split), P(None, split), P(split, None)))(h, gate, up, down)


def layer_at(layers, i: int):
    """Layer ``i`` of a layer stack, whether stacked (its slice) or per-layer buffers (its own tree)."""
    return layers[i] if isinstance(layers, tuple) else jax.tree.map(lambda a: a[i], layers)


def run_layers(body, carry, layers, xs):
    """``lax.scan(body, carry, (layers, xs))`` over a stacked layer tree, or the same as a Python loop over a
    tuple of per-layer trees (``split_layers``); returns (carry, stacked per-layer outputs or None)."""
    if not isinstance(layers, tuple):
        return jax.lax.scan(body, carry, (layers, xs))
    outs = []
    for i, layer in enumerate(layers):
        carry, out = body(carry, (layer, jax.tree.map(lambda a: a[i], xs)))
        outs.append(out)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs[0] is not None else None
