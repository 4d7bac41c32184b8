"""Every weight of the K2.6 decoder, declared once: shape, logical axes, init, dtype (``param_specs``).

Initialisation, abstract shapes for AOT compilation, the weights' shardings on a mesh (``param_shardings``: the
table's logical axes through a ``kimi_jax.sharding`` strategy), checkpoint checks and the HF name table
(``kimi_jax.weights.hf``) all derive from this table. Layers of one kind are stacked on a leading axis
(``dense_layers``, ``moe_layers``) so that the forward scans them.

Linear weights are stored input-major ([in, out], y = x @ W), the transpose of HF's [out, in]; per-head
projections keep the head axis explicit (q_b [q_lora, heads, qk_head_dim], kv_b [kv_lora, heads, nope + v],
o [heads, v, hidden]) so the absorbed attention can slice W_UK and W_UV without reshapes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax import sharding
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


# ---- on a mesh ------------------------------------------------------------------------------------------------

def _spec_leaves(cfg: ModelConfig):
    specs = param_specs(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    return specs, flat, treedef


def _partition_specs(cfg: ModelConfig, mesh: Mesh, st: sharding.Strategy) -> Any:
    _, flat, treedef = _spec_leaves(cfg)
    out = []
    for path, s in flat:
        spec = sharding.logical_to_spec(s.axes, mesh, st)
        sharding.check_divides(jax.tree_util.keystr(path), s.shape, s.axes, spec, mesh)
        out.append(spec)
    _check_int4(cfg, mesh, st)
    return jax.tree.unflatten(treedef, out)


def _check_int4(cfg: ModelConfig, mesh: Mesh, st: sharding.Strategy):
    if not cfg.int4_experts:
        return
    axes = st.mesh_axes("expert_mlp", mesh)
    n = sharding.axis_size(mesh, axes)
    if n > 1:
        fp = -(-cfg.moe_intermediate_size // CHUNK) * CHUNK
        if fp % n or (fp // n) % CHUNK:
            raise sharding.ShardingError(
                f"mesh {sharding.format_mesh(mesh)}: strategy {st.name} splits the INT4 experts' intermediate size "
                f"({cfg.moe_intermediate_size}, padded to {fp}) over {'x'.join(axes)} = {n} devices, but the INT4 "
                f"kernel needs each device's slice to be a multiple of {CHUNK} (expert intermediate >= "
                f"{CHUNK * n}); split whole experts instead (ep) or use float experts")


def fitting_meshes(cfg: ModelConfig, device_counts=(2, 4, 8)) -> list[str]:
    """Each strategy's default mesh at these device counts, where it shards this model."""
    fits = []
    for n in device_counts:
        for name in sharding.STRATEGIES:
            axes = sharding.parse_mesh(sharding.default_mesh_spec(name, n))
            spec = sharding.format_mesh({k: v for k, v in axes.items() if v > 1} or axes)
            if spec in fits:
                continue
            mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))
            try:
                _partition_specs(cfg, mesh, sharding.STRATEGIES[name])
            except sharding.ShardingError:
                continue
            fits.append(spec)
    return fits


def check_global_mesh(cfg: ModelConfig, mesh: Mesh | None) -> None:
    """A run across processes computes on every process's devices: a mesh that leaves some out (or no mesh: one
    device) is a ShardingError naming the meshes over all of them that fit this model."""
    n = jax.device_count()
    if jax.process_count() == 1 or (mesh is not None and mesh.size == n):
        return
    fits = ", ".join(fitting_meshes(cfg, (n,))) or f"no mesh of {n} devices"
    have = "no mesh is given" if mesh is None else f"mesh {sharding.format_mesh(mesh)} covers {mesh.size}"
    raise sharding.ShardingError(f"a run across {jax.process_count()} processes computes on all of their {n} "
                                 f"devices, but {have}; this model fits: {fits}")


def param_partition_specs(cfg: ModelConfig, mesh: Mesh, strategy: str | sharding.Strategy) -> Any:
    """PartitionSpec of every weight (same tree as ``param_specs``), checking that the mesh divides them; when it
    does not, the error also lists the meshes of 2-8 devices that do fit."""
    try:
        return _partition_specs(cfg, mesh, sharding.get_strategy(strategy))
    except sharding.ShardingError as e:
        fits = ", ".join(fitting_meshes(cfg)) or "no mesh of 2, 4 or 8 devices"
        raise sharding.ShardingError(f"{e}. This model fits: {fits}") from None


def param_shardings(cfg: ModelConfig, mesh: Mesh, strategy: str | sharding.Strategy | None = None) -> Any:
    """NamedSharding of every weight, the same pytree as ``param_specs(cfg)`` / the params."""
    strategy = strategy or sharding.infer_strategy(mesh)
    return jax.tree.map(lambda p: NamedSharding(mesh, p), param_partition_specs(cfg, mesh, strategy),
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params, cfg: ModelConfig, mesh: Mesh, strategy: str | sharding.Strategy | None = None):
    """Place a params pytree (numpy or jax arrays, identical on every process) onto the mesh."""
    return jax.tree.map(sharding.place, params, param_shardings(cfg, mesh, strategy))


def abstract_sharded_params(cfg: ModelConfig, mesh: Mesh, strategy: str | sharding.Strategy | None = None,
                            dtype=jnp.bfloat16):
    """ShapeDtypeStructs with shardings: AOT lowering of the sharded model without allocating weights."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params(cfg, dtype), param_shardings(cfg, mesh, strategy))
