"""Mixture of experts: the noaux_tc sigmoid router, routed experts and the shared expert.

Routing (DeepSeek-V3 / K2): sigmoid scores in float32; the correction bias is added only to *choose* experts
(group-limited when n_group > 1); the chosen experts are weighted by their unbiased scores, renormalised and
scaled by routed_scaling_factor. The shared expert sees the same input and is added unscaled.

Routed experts are computed behind one function, ``routed_experts``: float experts (a dict of stacked
[E, in, out] matrices) take the XLA gather path; INT4 experts (``kimi_jax.ops.int4_format.Int4Experts``) go to
``kimi_jax.ops.int4_moe`` with ``cfg.moe_impl`` choosing the XLA or the Pallas kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kimi_jax.config import ModelConfig
from kimi_jax.model.layers import swiglu


def route(x, router, bias, cfg: ModelConfig):
    """Returns (expert ids [n, k] int32, weights [n, k] float32) for tokens x [n, d]."""
    scores = jax.nn.sigmoid(x.astype(jnp.float32) @ router.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        n = choice.shape[0]
        groups = choice.reshape(n, cfg.n_group, -1)
        group_score = jax.lax.top_k(groups, 2)[0].sum(-1)                        # sum of each group's top-2
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        keep_mask = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], keep].set(True)
        # Experts of dropped groups can never be chosen (-inf, as transformers 5 and vLLM do).
        choice = jnp.where(keep_mask[:, :, None], groups, -jnp.inf).reshape(n, -1)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


# With few experts per choice (E <= DENSE_EXPERTS_PER_CHOICE * k) float experts are evaluated densely: every
# token through every expert, weighted by its routing coefficient (zero for unchosen experts). That is E/k
# times the multiply-adds but no per-token weight gather, the faster side on a CPU up to about 8 (16 experts
# top-2 at 32 tokens: dense 0.36 ms, gather 0.49 ms per layer). K2.6 (384/8 = 48) gathers.
DENSE_EXPERTS_PER_CHOICE = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseExperts:
    """Float experts laid out for the dense form: gate/up input-major over all experts, so each is one
    [d, E*f] matmul operand with no transpose (leading stacked-layer axes allowed)."""
    gate: jax.Array   # [..., d, E, f]
    up: jax.Array     # [..., d, E, f]
    down: jax.Array   # [..., E, f, d]


def to_compute_layout(experts: dict, cfg: ModelConfig):
    """Float experts {gate, up: [.., E, d, f], down: [.., E, f, d]} -> the layout routed_experts runs fastest."""
    if cfg.n_routed_experts > DENSE_EXPERTS_PER_CHOICE * cfg.num_experts_per_tok:
        return experts
    return DenseExperts(gate=jnp.swapaxes(experts["gate"], -3, -2), up=jnp.swapaxes(experts["up"], -3, -2),
                        down=experts["down"])


def float_routed_experts(x, ids, weights, experts):
    """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [n, d]; experts a float dict or DenseExperts."""
    if isinstance(experts, DenseExperts):
        num_experts = experts.down.shape[-3]
        coef = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
        h = jax.nn.silu(jnp.einsum("nd,def->nef", x, experts.gate)) * jnp.einsum("nd,def->nef", x, experts.up)
        h = h * coef[..., None].astype(h.dtype)
        return jnp.einsum("nef,efd->nd", h, experts.down, preferred_element_type=jnp.float32)
    # Gather only the selected experts' matrices: at decode and verify widths this reads exactly the
    # experts that are used, which is what bounds a bandwidth-limited step.
    gate, up, down = experts["gate"][ids], experts["up"][ids], experts["down"][ids]   # [n, k, ...]
    h = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", x, gate)) * jnp.einsum("nd,nkdf->nkf", x, up)
    y = jnp.einsum("nkf,nkfd->nkd", h, down)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), weights)


def routed_experts(x, ids, weights, experts, cfg: ModelConfig):
    """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [n, d]."""
    if isinstance(experts, (dict, DenseExperts)):
        return float_routed_experts(x, ids, weights, experts).astype(x.dtype)
    from kimi_jax.ops.int4_moe import int4_moe
    return int4_moe(x, ids, weights, experts, impl=cfg.moe_impl).astype(x.dtype)


def moe_block(x, p, cfg: ModelConfig):
    """x [..., d] -> [..., d]: routed experts plus the shared expert.

    Under ``kimi_jax.sharding.use(mesh)`` the block runs in shard_map with the strategy's collectives."""
    from kimi_jax import sharding
    sharded = sharding.moe_hook(x, p, cfg)
    if sharded is not None:
        return sharded
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    ids, weights = route(flat, p["router"], p["router_bias"], cfg)
    y = routed_experts(flat, ids, weights, p["experts"], cfg)
    s = p["shared"]
    y = y + swiglu(flat, s["gate"], s["up"], s["down"])
    return y.reshape(shape)
