"""Mixture of experts: the noaux_tc sigmoid router, routed experts and the shared expert, on one device or
sharded over a mesh.

Routing (DeepSeek-V3 / K2): sigmoid scores in float32; the correction bias is added only to *choose* experts
(group-limited when n_group > 1); the chosen experts are weighted by their unbiased scores, renormalised and
scaled by routed_scaling_factor (``ops.router``: on a GPU two Pallas kernels, with one expert group). The shared
expert sees the same input and is added unscaled.

Routed experts are computed behind one function, ``routed_experts``: float experts (a dict of stacked
[E, in, out] matrices, or the dense form ``compute_layout.DenseExperts``) take the XLA path; INT4 experts
(``ops.int4_format.Int4Experts``) go to ``ops.int4_moe`` with ``Runtime.moe_impl`` choosing the implementation
(``ops.registry``). Which form a backend gets is ``kimi_jax.model.compute_layout``'s choice.

With ``Runtime.mesh`` set, routing stays replicated (GSPMD) and the experts plus the shared expert run in one
``jax.shard_map``: every device computes its local experts (EP: ids held elsewhere get weight 0) on its slice of
the expert intermediate (TP) plus its slice of the shared expert (``ops.swiglu``: on a GPU a split-K GEMM and one
kernel), then one ``psum`` over the sharded axes, i.e. one all-reduce per MoE block under ``tp``, which also adds
the layer's residual. The strategy's logical-axis rules live in ``kimi_jax.sharding``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kimi_jax import sharding
from kimi_jax.config import ModelConfig, Runtime
from kimi_jax.model.compute_layout import DenseExperts
from kimi_jax.model.params import layer_specs
from kimi_jax.ops.int4_moe.api import int4_moe
from kimi_jax.ops.router import api as router_api
from kimi_jax.ops.router import reference as router_ref
from kimi_jax.ops.swiglu.api import swiglu


def _weighted(x, scale):
    """The rows x times the MoE norm's weight ``scale`` [d], in x's dtype (x itself where scale is None)."""
    return x if scale is None else scale * x


def route(x, router, bias, cfg: ModelConfig, impl: str = "auto", scale=None):
    """Returns (expert ids [n, k] int32, weights [n, k] float32) for tokens ``scale * x`` [n, d] (``moe_block``).
    One expert group (K2.6) is ``ops.router`` under the MoE's ``impl`` (``Runtime.moe_impl``; its rules say which
    implementation serves it); group-limited routing stays here, on XLA."""
    kw = dict(k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
    if cfg.n_group == 1:
        return router_api.route_topk(x, router, bias, scale, impl=impl, **kw)
    scores = router_ref.scores(_weighted(x, scale), router)
    n = scores.shape[0]
    groups = router_ref.biased(scores, bias).reshape(n, cfg.n_group, -1)
    group_score = jax.lax.top_k(groups, 2)[0].sum(-1)                        # sum of each group's top-2
    _, keep = jax.lax.top_k(group_score, cfg.topk_group)
    keep_mask = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], keep].set(True)
    # Experts of dropped groups can never be chosen (-inf, as transformers 5 and vLLM do).
    choice = jnp.where(keep_mask[:, :, None], groups, -jnp.inf).reshape(n, -1)
    return router_ref.select(scores, choice, **kw)


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


def _routed_f32(x, ids, weights, experts, rt: Runtime, scale=None):
    if isinstance(experts, (dict, DenseExperts)):
        return float_routed_experts(_weighted(x, scale), ids, weights, experts)
    return int4_moe(x, ids, weights, experts, impl=rt.moe_impl, scale=scale).astype(jnp.float32)


def routed_experts(x, ids, weights, experts, rt: Runtime = Runtime(), scale=None):
    """sum_k weights[:, k] * expert_{ids[:, k]}(scale * x) for x [n, d] (``scale`` [d] or None)."""
    return _routed_f32(x, ids, weights, experts, rt, scale).astype(x.dtype)


def expert_loads(ids, num_experts: int):
    """How many of the router's choices went to each expert [E] (what aux-loss-free balancing reads)."""
    return jnp.zeros((num_experts,), jnp.float32).at[ids.reshape(-1)].add(1.0)


def moe_block(x, p, cfg: ModelConfig, rt: Runtime = Runtime(), scale=None, residual=None):
    """x [..., d] -> (routed experts + shared expert [..., d], expert loads [E]) of ``scale * x``, plus
    ``residual`` [..., d] where given (the layer's residual stream: on a mesh it joins the experts' all-reduce,
    ``_sharded_experts``, so the sum is not a kernel of its own).

    ``scale`` [d]: the MoE's RMSNorm weight, with x the normalised rows before it (``numerics.rms_normalize``). The
    router kernel multiplies the rows it reads, XLA fuses the product into the shared expert's GEMM, and the
    routed experts take it with the rows (``int4_moe``'s ``scale``: the Mosaic GPU path's placement kernel, which
    gathers their rows, multiplies them), so on a GPU the weighted rows are not a kernel of their own
    (docs/gpu_overhead.md)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    with jax.named_scope("router"):
        ids, weights = route(flat, p["router"], p["router_bias"], cfg, rt.moe_impl, scale)
        loads = expert_loads(ids, cfg.n_routed_experts)
    res = None if residual is None else residual.reshape(flat.shape)
    if rt.mesh is not None and rt.mesh.size > 1:
        y = _sharded_experts(flat, scale, ids, weights, p, cfg, rt, res)
    else:
        s = p["shared"]
        with jax.named_scope("experts"):
            routed = routed_experts(flat, ids, weights, p["experts"], rt, scale)
        with jax.named_scope("shared_expert"):
            shared = swiglu(_weighted(flat, scale), s["gate"], s["up"], s["down"], impl=rt.moe_impl)
        y = routed + shared if res is None else res + (routed + shared)
    return y.reshape(shape), loads


# ---- on a mesh ------------------------------------------------------------------------------------------------

def _num_experts(experts) -> int:
    if isinstance(experts, dict):
        return experts["gate"].shape[-3]
    if isinstance(experts, DenseExperts):
        return experts.down.shape[-3]
    return experts.num_experts


def _per_layer_specs(cfg: ModelConfig, mesh, st: sharding.Strategy):
    """PartitionSpecs of one layer's routed experts and shared expert (no leading 'layers' axis)."""
    moe = layer_specs(cfg, 1, moe=True)["moe"]
    spec = lambda t: jax.tree.map(lambda s: sharding.logical_to_spec(s.axes[1:], mesh, st), t,  # noqa: E731
                                  is_leaf=lambda s: hasattr(s, "axes"))
    return spec(moe["experts"]), spec(moe["shared"])


def _sharded_experts(x, scale, ids, weights, p, cfg: ModelConfig, rt: Runtime, residual=None):
    """Routed + shared experts of scale * x [n, d] (replicated; scale [d] or None) under rt.mesh -> [n, d]
    replicated, plus ``residual`` (replicated, or None). The residual goes into the psum from the first device of
    the summed axes: the all-reduce then returns the layer's output, where adding it after the all-reduce is one
    more GPU kernel per MoE layer (its own loop fusion: nothing before the next layer's norm can take it). The
    sum's rounding differs from ``residual + psum(y)`` by where bfloat16 rounds, not more."""
    mesh = rt.mesh
    st = sharding.get_strategy(rt.strategy or sharding.infer_strategy(mesh))
    ex_specs, sh_specs = _per_layer_specs(cfg, mesh, st)
    ep_axes = st.mesh_axes("experts", mesh)
    sum_axes = tuple(a for a in mesh.axis_names if a in ep_axes + st.mesh_axes("expert_mlp", mesh))
    # The shared expert joins the same psum when it is split over exactly the same axes, else it runs outside.
    with_shared = set(st.mesh_axes("mlp", mesh)) == set(sum_axes)
    shared = p["shared"]

    def body(x, scale, ids, weights, experts, shared, residual):
        with jax.named_scope("experts"):
            if ep_axes:
                n_local = _num_experts(experts)
                lo = sharding.shard_index(ep_axes, mesh) * n_local
                local = (ids >= lo) & (ids < lo + n_local)
                ids, weights = jnp.where(local, ids - lo, 0), jnp.where(local, weights, 0.0)
            y = _routed_f32(x, ids, weights, experts, rt, scale)
        if shared is not None:
            with jax.named_scope("shared_expert"):
                y = y + swiglu(_weighted(x, scale), shared["gate"], shared["up"], shared["down"],
                               impl=rt.moe_impl).astype(jnp.float32)
        if residual is not None:
            y = y + jnp.where(sharding.shard_index(sum_axes, mesh) == 0, residual, 0).astype(jnp.float32)
        y = y.astype(x.dtype)
        return jax.lax.psum(y, sum_axes) if sum_axes else y

    inner = residual if sum_axes else None
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), None if scale is None else P(), P(), P(), ex_specs,
                                                  sh_specs if with_shared else None, None if inner is None else P()),
                       out_specs=P(), check_vma=False)
    y = fn(x, scale, ids, weights, p["experts"], shared if with_shared else None, inner)
    if not with_shared:
        with jax.named_scope("shared_expert"):
            y_shared = swiglu(_weighted(x, scale), shared["gate"], shared["up"], shared["down"], impl=rt.moe_impl)
        y = y + y_shared
    return y if residual is None or inner is not None else residual + y
