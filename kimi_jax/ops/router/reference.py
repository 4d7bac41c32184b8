"""The router's math in jnp: the XLA path on CPU and TPU, and the oracle the Pallas kernel is tested against.

DeepSeek-V3 / K2 noaux_tc with one expert group (K2.6: n_group = topk_group = 1): sigmoid scores in float32,
the bias added only to choose the experts, the chosen experts weighted by their unbiased scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax.ops.numerics import F32


def scores(x, router):
    """sigmoid(x @ router) in float32: x [T, D], router [D, E] -> [T, E]."""
    return jax.nn.sigmoid(x.astype(F32) @ router.astype(F32))


def select(scores, choice, k: int, norm_topk_prob: bool, scaling: float):
    """(ids [T, k] int32, weights [T, k] float32): the k experts with the largest ``choice`` (the biased scores;
    ties: the lowest id first, as ``jax.lax.top_k``) weighted by their unbiased ``scores``."""
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


def biased(scores, bias):
    """The scores experts are chosen by. The bias only chooses experts; it is set by the balancing rule
    (kimi_jax.training), never by gradients."""
    return scores + jax.lax.stop_gradient(bias).astype(F32)


def route_reference(x, router, bias, scale=None, *, k: int, norm_topk_prob: bool, scaling: float):
    """x [T, D], router [D, E], bias [E] -> (ids [T, k] int32, weights [T, k] float32). ``scale`` [D]: x's columns
    are multiplied by it first, in x's dtype (the MoE's RMSNorm weight, as ``numerics.rms_norm`` applies it)."""
    if scale is not None:
        x = scale * x
    s = scores(x, router)
    return select(s, biased(s, bias), k, norm_topk_prob, scaling)
