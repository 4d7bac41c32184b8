"""AdamW with global-norm clipping and a warmup-cosine schedule, shared by the target and drafter trainers
(optax is not a dependency)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Hyper(NamedTuple):
    lr: float = 2e-3
    warmup: int = 100
    total: int = 1000
    min_lr_frac: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_gamma: float = 1e-3


def lr_at(step, hp: Hyper):
    """Linear warmup to hp.lr, then cosine to hp.min_lr_frac * hp.lr at hp.total."""
    step = jnp.asarray(step, jnp.float32)
    warm = hp.lr * (step + 1) / hp.warmup
    frac = jnp.clip((step - hp.warmup) / max(hp.total - hp.warmup, 1), 0.0, 1.0)
    cos = hp.lr * (hp.min_lr_frac + (1 - hp.min_lr_frac) * 0.5 * (1 + jnp.cos(math.pi * frac)))
    return jnp.where(step < hp.warmup, warm, cos)


def adamw(params, grads, mu, nu, t, lr, hp: Hyper, frozen=lambda path: False):
    """One AdamW step with global-norm clipping (t = 1-based step). Leaves where frozen(path) is true keep
    their value and moments; weight decay applies to matrices only. Returns (params, mu, nu, grad norm)."""
    gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, hp.clip / (gnorm + 1e-6))
    t = jnp.asarray(t, jnp.float32)

    def update(path, p, g, m, v):
        if frozen(path):
            return p, m, v
        g = g * scale
        m = hp.b1 * m + (1 - hp.b1) * g
        v = hp.b2 * v + (1 - hp.b2) * g * g
        upd = (m / (1 - hp.b1 ** t)) / (jnp.sqrt(v / (1 - hp.b2 ** t)) + hp.eps)
        if p.ndim >= 2:
            upd = upd + hp.weight_decay * p
        return p - lr * upd, m, v

    out = jax.tree_util.tree_map_with_path(update, params, grads, mu, nu)
    treedef = jax.tree.structure(params)
    leaves = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, tuple))
    new_p, mu, nu = (jax.tree.unflatten(treedef, [o[i] for o in leaves]) for i in range(3))
    return new_p, mu, nu, gnorm
