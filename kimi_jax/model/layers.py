"""Small building blocks of the K2 decoder: RMSNorm, YaRN RoPE (DeepSeek pair rotation), SwiGLU, and the
loop over a stack of layers (stacked, or per-layer buffers: ``kimi_jax.model.compute_layout``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kimi_jax.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Variance in float32, cast back to the input dtype, then scale (the HF order of operations)."""
    return weight * rms_normalize(x, eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``rms_norm`` before its weight: x / rms(x), in x's dtype."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by positions * inv_freq[i] (DeepSeek / GPT-J layout).

    x: [..., T, (heads,) rope_dim] with positions [..., T]. Angles are float32 whatever the input dtype.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq          # [..., T, d/2]
    if x.ndim == angles.ndim + 1:                                          # a heads axis sits before rope_dim
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def apply_rope_half(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """NeoX / Qwen3 layout: rotate (x[i], x[i + d/2]) by positions * inv_freq[i]; cos/sin multiplied by scale.

    x: [b, t, heads, d] with positions [b, t].
    """
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq         # [b, t, 1, d/2]
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    xf = x.astype(jnp.float32)
    first, second = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)); weights are input-major ([in, out])."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


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
