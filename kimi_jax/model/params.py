"""Every weight of the K2.6 decoder, declared once: shape, logical axes, init, dtype (``param_specs``).

Initialisation, abstract shapes for AOT compilation, sharding (``kimi_jax.sharding``), checkpoint checks and
the HF name table (``kimi_jax.weights.hf``) all derive from this table. Layers of one kind are stacked on a
leading axis (``dense_layers``, ``moe_layers``) so that the forward scans them.

Linear weights are stored input-major ([in, out], y = x @ W), the transpose of HF's [out, in]; per-head
projections keep the head axis explicit (q_b [q_lora, heads, qk_head_dim], kv_b [kv_lora, heads, nope + v],
o [heads, v, hidden]) so the absorbed attention can slice W_UK and W_UV without reshapes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kimi_jax.config import ModelConfig
from kimi_jax.ops.int4_format import CHUNK, GROUP_SIZE, Int4Experts


class ParamSpec(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str, ...]      # logical axis names, mapped to mesh axes by kimi_jax.sharding
    init: str = "normal"       # "normal" (std 1/sqrt(fan_in)), "ones", "zeros"
    fan_in: int = 1
    dtype: str | None = None   # None: the model dtype


def _dense(shape, axes, fan_in):
    return ParamSpec(tuple(shape), tuple(axes), "normal", fan_in)


def layer_specs(cfg: ModelConfig, n: int, moe: bool) -> dict:
    d, h, dn, dr, dv = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim)
    rq, r = cfg.q_lora_rank, cfg.kv_lora_rank
    L = ("layers",)
    attn = {
        "q_a": _dense((n, d, rq), L + ("embed", "q_lora"), d),
        "q_a_norm": ParamSpec((n, rq), L + ("q_lora",), "ones"),
        "q_b": _dense((n, rq, h, dn + dr), L + ("q_lora", "heads", "head_dim"), rq),
        "kv_a": _dense((n, d, r + dr), L + ("embed", "latent"), d),
        "kv_a_norm": ParamSpec((n, r), L + ("kv_lora",), "ones"),
        "kv_b": _dense((n, r, h, dn + dv), L + ("kv_lora", "heads", "head_dim"), r),
        "o": _dense((n, h, dv, d), L + ("heads", "head_dim", "embed"), h * dv),
    }
    spec = {"attn_norm": ParamSpec((n, d), L + ("embed",), "ones"),
            "mlp_norm": ParamSpec((n, d), L + ("embed",), "ones"),
            "attn": attn}
    if not moe:
        f = cfg.intermediate_size
        spec["mlp"] = {"gate": _dense((n, d, f), L + ("embed", "mlp"), d),
                       "up": _dense((n, d, f), L + ("embed", "mlp"), d),
                       "down": _dense((n, f, d), L + ("mlp", "embed"), f)}
        return spec
    e, f, fs = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    spec["moe"] = {
        "router": _dense((n, d, e), L + ("embed", "experts_out"), d),
        "router_bias": ParamSpec((n, e), L + ("experts_out",), "zeros", dtype="float32"),
        "experts": _int4_expert_specs(n, e, d, f) if cfg.int4_experts else {
            "gate": _dense((n, e, d, f), L + ("experts", "embed", "expert_mlp"), d),
            "up": _dense((n, e, d, f), L + ("experts", "embed", "expert_mlp"), d),
            "down": _dense((n, e, f, d), L + ("experts", "expert_mlp", "embed"), f)},
        "shared": {"gate": _dense((n, d, fs), L + ("embed", "mlp"), d),
                   "up": _dense((n, d, fs), L + ("embed", "mlp"), d),
                   "down": _dense((n, fs, d), L + ("mlp", "embed"), fs)},
    }
    return spec


def _int4_expert_specs(n, e, d, f):
    """Int4Experts of n stacked layers in the kernel layout (kimi_jax.ops.int4_format); initialised by quantising."""
    dp, fp = -(-d // CHUNK) * CHUNK, -(-f // CHUNK) * CHUNK
    axes = {k: ("layers",) + tuple("experts" if a == "expert" else "expert_mlp" if a == "mlp" else a or "pair"
                                   for a in v) for k, v in Int4Experts.LOGICAL_AXES.items()}
    return Int4Experts(w13=ParamSpec((n, e, 2, dp // 8, f), axes["w13"], "int4", dtype="int32"),
                       s13=ParamSpec((n, e, 2, dp // GROUP_SIZE, f), axes["s13"], "int4", dtype="bfloat16"),
                       w2=ParamSpec((n, e, fp // 8, d), axes["w2"], "int4", dtype="int32"),
                       s2=ParamSpec((n, e, fp // GROUP_SIZE, d), axes["s2"], "int4", dtype="bfloat16"))


def map_experts(params, fn):
    """The params tree with its routed experts replaced by ``fn(experts)`` (everything else shared): the stacked
    experts, or each layer's where the MoE layers are per-layer buffers (a tuple: ``compute_layout.split_layers``)."""
    def one(layer):
        return {**layer, "moe": {**layer["moe"], "experts": fn(layer["moe"]["experts"])}}
    layers = params["moe_layers"]
    return {**params, "moe_layers": tuple(map(one, layers)) if isinstance(layers, tuple) else one(layers)}


def with_experts(params, experts):
    """The params tree with its stacked routed experts replaced (everything else shared)."""
    return map_experts(params, lambda _: experts)


def quantize_experts(params, cfg: ModelConfig):
    """A float params tree -> the same tree with INT4 routed experts, and the config that says so."""
    experts = params["moe_layers"]["moe"]["experts"]
    q = Int4Experts.quantize(experts["gate"], experts["up"], experts["down"])
    return with_experts(params, jax.tree.map(jnp.asarray, q)), cfg.replace(int4_experts=True)


def dequantize_experts(params, cfg: ModelConfig):
    """The inverse of quantize_experts: float32 experts with the INT4 values (for HF export and references)."""
    if not cfg.int4_experts:
        return params, cfg
    return map_experts(params, lambda e: e.dequantize()), cfg.replace(int4_experts=False)


def param_specs(cfg: ModelConfig) -> dict:
    d, v = cfg.hidden_size, cfg.vocab_size
    return {
        "embed": ParamSpec((v, d), ("vocab", "embed"), "normal", 1),
        "dense_layers": layer_specs(cfg, cfg.first_k_dense_replace, moe=False),
        "moe_layers": layer_specs(cfg, cfg.num_moe_layers, moe=True),
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
        "lm_head": _dense((d, v), ("embed", "vocab"), d),
    }


def is_spec(x) -> bool:
    """is_leaf for trees of ParamSpecs (a NamedTuple, which jax.tree would otherwise descend into)."""
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """ShapeDtypeStructs of every weight: eval_shape / AOT compilation without allocating anything."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype or dtype)),
                        param_specs(cfg), is_leaf=is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 1.0) -> dict:
    """Random weights (normal with std scale/sqrt(fan_in)); used by tests and as the training start.
    INT4 experts are drawn as float weights and quantised."""
    if cfg.int4_experts:
        return quantize_experts(init_params(cfg.replace(int4_experts=False), key, dtype, scale), cfg)[0]
    specs, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)

    def one(s: ParamSpec, k):
        dt = jnp.dtype(s.dtype or dtype)
        if s.init == "ones":
            return jnp.ones(s.shape, dt)
        if s.init == "zeros":
            return jnp.zeros(s.shape, dt)
        return (jax.random.normal(k, s.shape, jnp.float32) * (scale / math.sqrt(s.fan_in))).astype(dt)

    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(specs))
        return jax.tree.unflatten(treedef, [one(s, k) for s, k in zip(specs, keys)])

    return init(key)
