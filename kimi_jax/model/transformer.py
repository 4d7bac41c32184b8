"""The K2.6 decoder as pure functions over a plain pytree of weights.

Weights are a nested dict of arrays. Layers of one kind are stacked on a leading axis and run with
``lax.scan``: the ``first_k_dense_replace`` dense SwiGLU layers in one stack, the MoE layers in another, so the
61-layer model compiles as two loop bodies. Every weight is declared once in ``param_specs`` (shape, logical
axes, init); initialisation, abstract shapes for AOT compilation and sharding all derive from that table.

Linear weights are stored input-major ([in, out], y = x @ W), the transpose of HF's [out, in]; per-head
projections keep the head axis explicit (q_b [q_lora, heads, qk_head_dim], kv_b [kv_lora, heads, nope + v],
o [heads, v, hidden]) so the absorbed attention can slice W_UK and W_UV without reshapes.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from kimi_jax.cache import KVCache, init_cache
from kimi_jax.config import ModelConfig
from kimi_jax.model import mla
from kimi_jax.model.layers import rms_norm, swiglu, yarn_inv_freq
from kimi_jax.model.moe import moe_block


class ParamSpec(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str, ...]      # logical axis names, mapped to mesh axes by kimi_jax.sharding
    init: str = "normal"       # "normal" (std 1/sqrt(fan_in)), "ones", "zeros"
    fan_in: int = 1
    dtype: str | None = None   # None: the model dtype


def _dense(shape, axes, fan_in):
    return ParamSpec(tuple(shape), tuple(axes), "normal", fan_in)


def _layer_specs(cfg: ModelConfig, n: int, moe: bool) -> dict:
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
    from kimi_jax.ops.int4_format import CHUNK, GROUP_SIZE, Int4Experts
    dp, fp = -(-d // CHUNK) * CHUNK, -(-f // CHUNK) * CHUNK
    axes = {k: ("layers",) + tuple("experts" if a == "expert" else "expert_mlp" if a == "mlp" else a or "pair"
                                   for a in v) for k, v in Int4Experts.LOGICAL_AXES.items()}
    return Int4Experts(w13=ParamSpec((n, e, 2, dp // 8, f), axes["w13"], "int4", dtype="int32"),
                       s13=ParamSpec((n, e, 2, dp // GROUP_SIZE, f), axes["s13"], "int4", dtype="bfloat16"),
                       w2=ParamSpec((n, e, fp // 8, d), axes["w2"], "int4", dtype="int32"),
                       s2=ParamSpec((n, e, fp // GROUP_SIZE, d), axes["s2"], "int4", dtype="bfloat16"))


def _with_experts(params, experts):
    """The params tree with its stacked routed experts replaced (everything else shared)."""
    moe = {**params["moe_layers"]["moe"], "experts": experts}
    return {**params, "moe_layers": {**params["moe_layers"], "moe": moe}}


def quantize_experts(params, cfg: ModelConfig):
    """A float params tree -> the same tree with INT4 routed experts, and the config that says so."""
    from kimi_jax.ops.int4_format import Int4Experts
    experts = params["moe_layers"]["moe"]["experts"]
    q = Int4Experts.quantize(experts["gate"], experts["up"], experts["down"])
    return _with_experts(params, jax.tree.map(jnp.asarray, q)), cfg.replace(int4_experts=True)


def dequantize_experts(params, cfg: ModelConfig):
    """The inverse of quantize_experts: float32 experts with the INT4 values (for HF export and references)."""
    if not cfg.int4_experts:
        return params, cfg
    return _with_experts(params, params["moe_layers"]["moe"]["experts"].dequantize()), cfg.replace(int4_experts=False)


# The XLA path's INT4 experts are expanded once per loaded model when the float copy stays below this.
FLOAT_EXPERTS_MAX_BYTES = 1 << 30


def compute_params(params, cfg: ModelConfig):
    """The weights the generation programs compute with (made once per loaded model by kimi_jax.api).

    On the XLA MoE path INT4 experts are unpacked inside every forward, once per touched expert: on a CPU that
    unpacking, not the matmuls, was most of a decode step. When the float copy is small (the embedded default:
    4.7 MB) it is made once, with exactly the INT4 values, so the programs only multiply; with few experts per
    choice it is laid out for the dense form (``moe.DenseExperts``). The Pallas path (GPU) keeps streaming INT4,
    and large models keep the per-expert unpacking.
    """
    from kimi_jax.model.moe import to_compute_layout
    if not cfg.int4_experts or cfg.moe_impl != "xla" or not cfg.num_moe_layers:
        return params
    experts, dtype = params["moe_layers"]["moe"]["experts"], jnp.dtype(params["embed"].dtype)
    if (experts.w13.size + experts.w2.size) * 8 * dtype.itemsize > FLOAT_EXPERTS_MAX_BYTES:
        return params
    floats = jax.jit(lambda e: to_compute_layout(jax.tree.map(lambda a: a.astype(dtype), e.dequantize()), cfg))(
        jax.tree.map(jnp.asarray, experts))
    return _with_experts(params, floats)


def param_specs(cfg: ModelConfig) -> dict:
    d, v = cfg.hidden_size, cfg.vocab_size
    return {
        "embed": ParamSpec((v, d), ("vocab", "embed"), "normal", 1),
        "dense_layers": _layer_specs(cfg, cfg.first_k_dense_replace, moe=False),
        "moe_layers": _layer_specs(cfg, cfg.num_moe_layers, moe=True),
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
        "lm_head": _dense((d, v), ("embed", "vocab"), d),
    }


def _is_spec(x):
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """ShapeDtypeStructs of every weight: eval_shape / AOT compilation without allocating anything."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype or dtype)),
                        param_specs(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 1.0) -> dict:
    """Random weights (normal with std scale/sqrt(fan_in)); used by tests and as the training start.
    INT4 experts are drawn as float weights and quantised."""
    if cfg.int4_experts:
        return quantize_experts(init_params(cfg.replace(int4_experts=False), key, dtype, scale), cfg)[0]
    specs, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=_is_spec)

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


# ---- forward ---------------------------------------------------------------------------------------------

def visibility(lengths, new_mask, max_len):
    """[b, t, s] key visibility: the committed prefix, plus new rows (slots lengths + j) where new_mask[t, j]."""
    t = new_mask.shape[1]
    rel = jnp.arange(max_len)[None, :] - lengths[:, None]                    # [b, s]
    in_new = (rel >= 0) & (rel < t)
    new_vis = jnp.take_along_axis(new_mask, jnp.clip(rel, 0, t - 1)[:, None, :].repeat(t, 1), axis=2)
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & new_vis)


class LayerContext(NamedTuple):
    """What every layer of one forward shares."""
    positions: jax.Array     # [b, t] RoPE positions of the new tokens
    slots: jax.Array         # [b, t] cache slots their rows are written to
    visible: jax.Array       # [b, t, s] dense key visibility (XLA attention)
    lengths: jax.Array       # [b] committed rows; with new_mask, the same visibility for the Pallas kernel
    new_mask: jax.Array      # [b, t, t]
    inv_freq: jax.Array


# Widths up to this go through the tree-attention kernel when attn_impl="pallas"; prefill keeps XLA attention.
TREE_KERNEL_MAX_WIDTH = 256


def _layer(cfg: ModelConfig, moe: bool, attn_form: str, ctx: LayerContext, x, kv, layer_params, layer_index):
    """One decoder layer; kv is the whole [L, b, s, c] cache."""
    positions, slots, inv_freq = ctx.positions, ctx.slots, ctx.inv_freq
    p = layer_params["attn"]
    h = rms_norm(x, layer_params["attn_norm"], cfg.rms_norm_eps)
    q_nope, q_pe = mla.queries(h, p, cfg, positions, inv_freq)
    rows = mla.latent_rows(h, p, cfg, positions, inv_freq)
    batch = jnp.arange(x.shape[0])[:, None]
    kv = kv.at[layer_index, batch, slots].set(rows.astype(kv.dtype), mode="drop")
    if attn_form == "absorbed" and cfg.attn_impl == "pallas" and x.shape[1] <= TREE_KERNEL_MAX_WIDTH:
        o = mla.attend_tree(q_nope, q_pe, kv[layer_index], ctx.lengths, ctx.new_mask, p, cfg)
    else:
        attend = {"absorbed": mla.attend_absorbed, "full": mla.attend_full}[attn_form]
        o = attend(q_nope, q_pe, kv[layer_index], ctx.visible, p, cfg)
    x = x + mla.output(o, p)
    h = rms_norm(x, layer_params["mlp_norm"], cfg.rms_norm_eps)
    if moe:
        x = x + moe_block(h, layer_params["moe"], cfg)
    else:
        m = layer_params["mlp"]
        x = x + swiglu(h, m["gate"], m["up"], m["down"])
    return x, kv


class ForwardOut(NamedTuple):
    logits: jax.Array        # [b, t, vocab] float32
    cache: KVCache           # new rows written at slots lengths + t; lengths unchanged
    taps: jax.Array          # [n_taps, b, t, hidden]: outputs of the requested layers


def forward(params, cfg: ModelConfig, tokens, cache: KVCache, *, positions=None, new_mask=None,
            taps: Sequence[int] = (), attn_form: str = "absorbed") -> ForwardOut:
    """Run new tokens [b, t] against the cache.

    positions: RoPE positions [b, t] (default lengths + t; a draft tree passes lengths + depth).
    new_mask: [b, t, t] which new tokens each new token sees (default causal; a tree passes its ancestor mask).
    taps: layer ids whose outputs to return (layer l = output of decoder layer l = HF hidden_states[l + 1]).
    """
    b, t = tokens.shape
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    slots = cache.lengths[:, None] + steps
    if positions is None:
        positions = slots
    if new_mask is None:
        new_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    ctx = LayerContext(positions, slots, visibility(cache.lengths, new_mask, cache.max_len), cache.lengths, new_mask,
                       yarn_inv_freq(cfg))
    taps = tuple(taps)
    for l in taps:
        if not 0 <= l < cfg.num_hidden_layers:
            raise ValueError(f"tap layer {l} is outside [0, {cfg.num_hidden_layers})")
    # Tap slot per layer; non-tapped layers write to a spare slot n_taps that is dropped at the end.
    tap_slot = jnp.full((cfg.num_hidden_layers,), len(taps), jnp.int32)
    for i, l in enumerate(taps):
        tap_slot = tap_slot.at[l].set(i)

    x = params["embed"][tokens]
    tapped = jnp.zeros((len(taps) + 1, b, t, cfg.hidden_size), x.dtype)
    kv = cache.kv
    for stack, moe, offset in (("dense_layers", False, 0), ("moe_layers", True, cfg.first_k_dense_replace)):
        n = cfg.first_k_dense_replace if not moe else cfg.num_moe_layers
        if n == 0:
            continue

        def body(carry, xs, moe=moe):
            x, kv, tapped = carry
            layer_params, index = xs
            x, kv = _layer(cfg, moe, attn_form, ctx, x, kv, layer_params, index)
            tapped = jax.lax.dynamic_update_index_in_dim(tapped, x, tap_slot[index], 0)
            return (x, kv, tapped), None

        indices = jnp.arange(offset, offset + n, dtype=jnp.int32)
        (x, kv, tapped), _ = jax.lax.scan(body, (x, kv, tapped), (params[stack], indices))

    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"], preferred_element_type=jnp.float32)
    return ForwardOut(logits, KVCache(kv=kv, lengths=cache.lengths), tapped[:len(taps)])


def full_logits(params, cfg: ModelConfig, tokens, attn_form: str = "full") -> jax.Array:
    """Logits [b, t, vocab] of a plain causal forward (no cache kept): the reference path."""
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
    return forward(params, cfg, tokens, cache, attn_form=attn_form).logits
