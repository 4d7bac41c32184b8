"""Multi-head latent attention (MLA) over a latent cache.

Per token and layer the cache holds ``kv_lora_rank + qk_rope_head_dim`` values: the normalised latent c_kv and
the rotated key rope part k_pe shared by all heads. Two ways to attend over it, equal up to rounding:

* full form (prefill-friendly, the test oracle): expand per-head k_nope and v from c_kv with kv_b, then
  ordinary attention with 192-wide keys and 128-wide values;
* absorbed form (decode / verify): fold W_UK into the query and W_UV into the output, so attention is one
  MQA over the 576-wide latent rows and no per-head K/V is ever materialised.

Einsum letters: b batch, t query, s key (cache slot), h head, r latent (kv_lora) rank, q q_lora rank,
n nope dim, p rope dim, v value dim, d model dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kimi_jax import cache as cache_lib
from kimi_jax import sharding
from kimi_jax.cache import over_used_slots, rows_upto
from kimi_jax.config import ModelConfig, Runtime
from kimi_jax.ops.latent import api as latent_op
from kimi_jax.ops.numerics import MASK_VALUE, apply_rope
from kimi_jax.ops.tree_attention.api import latent_attention


def latent_projection(x, norm, p, cfg: ModelConfig, positions, inv_freq, rt: Runtime, kv, page_table, layer, slots):
    """(cq [b,t,q], the whole cache kv with the new tokens' rows written at ``slots`` [b,t] of ``layer``) from a
    layer's input rows x [b,t,d] before the attention's RMSNorm (weight ``norm``): the op ``kimi_jax.ops.latent``
    (on a GPU at decode and verify widths one split-K GEMM and one kernel for the norms, the latent norms, the
    key's RoPE and the cache write). Under ``rt.mesh`` each device projects its own rows into its own cache
    rows (the weights are replicated in every strategy; a Pallas call is opaque to the partitioner); a cache split
    by position (dcp) is written by XLA's partitioned scatter."""
    def local(x, norm, q_a, kv_a, q_a_norm, kv_a_norm, positions, inv_freq, cache):
        return latent_op.latent_projection(x, norm, q_a, kv_a, q_a_norm, kv_a_norm, positions, inv_freq, cache,
                                           eps=cfg.rms_norm_eps, latent_eps=cfg.latent_norm_eps, impl=rt.attn_impl)

    weights = (norm, p["q_a"], p["kv_a"], p["q_a_norm"], p["kv_a_norm"])
    if rt.mesh is None or rt.mesh.size == 1:
        return local(x, *weights, positions, inv_freq, (kv, page_table, layer, slots))
    st = sharding.get_strategy(rt.strategy or sharding.infer_strategy(rt.mesh))
    spec = lambda *axes: sharding.logical_to_spec(axes, rt.mesh, st)  # noqa: E731
    rows, pos = spec("batch", None, None), spec("batch", None)
    if st.mesh_axes("slots", rt.mesh):
        cq, new_rows = jax.shard_map(lambda *a: local(*a, None), mesh=rt.mesh, out_specs=(rows, rows),
                                     in_specs=(rows, *[P()] * 5, pos, P()), check_vma=False)(
                                         x, *weights, positions, inv_freq)
        with jax.named_scope("cache_write"):
            return cq, cache_lib.write(kv, page_table, layer, slots, new_rows)
    kv_spec = spec("layers", "batch", "slots", "latent")      # meshes keep contiguous caches: no page table
    return jax.shard_map(lambda *a: local(*a[:8], (a[8], None, a[9], a[10])), mesh=rt.mesh,
                         out_specs=(rows, kv_spec), check_vma=False,
                         in_specs=(rows, *[P()] * 5, pos, P(), kv_spec, P(), pos))(
                             x, *weights, positions, inv_freq, kv, jnp.asarray(layer, jnp.int32), slots)


def queries(cq, p, cfg: ModelConfig, positions, inv_freq):
    """q_nope [b,t,h,n] and rotated q_pe [b,t,h,p] from the query latent cq [b,t,q] (``latent_projection``)."""
    with jax.named_scope("qkv_proj"):
        q = jnp.einsum("btq,qhk->bthk", cq, p["q_b"])
    q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    return q_nope, apply_rope(q_pe, positions, inv_freq)


def _softmax(scores, visible):
    scores = jnp.where(visible[:, None], scores, MASK_VALUE)      # visible [b,t,s] -> [b,1,t,s]
    return jax.nn.softmax(scores, axis=-1)


def attend_absorbed(q_nope, q_pe, kv, visible, p, cfg: ModelConfig):
    """Absorbed MLA: MQA of all heads over latent rows kv [b,s,r+p]; returns per-head outputs [b,t,h,v]."""
    r = cfg.kv_lora_rank
    w_uk, w_uv = p["kv_b"][..., :cfg.qk_nope_head_dim], p["kv_b"][..., cfg.qk_nope_head_dim:]
    c_kv, k_pe = kv[..., :r], kv[..., r:]
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk)               # W_UK folded into the query
    scores = (jnp.einsum("bthr,bsr->bhts", q_lat, c_kv, preferred_element_type=jnp.float32)
              + jnp.einsum("bthp,bsp->bhts", q_pe, k_pe, preferred_element_type=jnp.float32))
    probs = _softmax(scores * cfg.softmax_scale, visible)
    o_lat = jnp.einsum("bhts,bsr->bthr", probs.astype(kv.dtype), c_kv)
    return jnp.einsum("bthr,rhv->bthv", o_lat, w_uv)                 # W_UV applied after attention


def attend_tree(cq, positions, inv_freq, kv, page_table, lengths, new_mask, p, cfg: ModelConfig, impl: str,
                layer=None, partitioned: bool = False):
    """attend_absorbed from the query latent cq with visibility given as (committed lengths, new-token mask): the
    absorbed queries (``kimi_jax.ops.latent``: q_b, RoPE and W_UK, on a GPU one split-K GEMM and one kernel) and
    the tree-attention op (kimi_jax.ops.tree_attention.api), whose kernels stream the prefix (of a paged cache: the
    row's own pages) without a dense [b, t, s] mask. ``partitioned``: left to XLA's partitioner (the op's rules
    then refuse what it cannot partition)."""
    with jax.named_scope("qkv_proj"):
        q_lat, q_pe = latent_op.absorbed_queries(cq, p["q_b"], p["kv_b"], positions, inv_freq, impl=impl)
    # W_UV (kv_b's columns after the nope ones) is applied by the op: in its merge kernel on GPUs
    return latent_attention(q_lat, q_pe, kv, lengths, new_mask, cfg.softmax_scale, impl=impl, out_dtype=kv.dtype,
                            page_table=page_table, layer=layer, partitioned=partitioned, w_uv=p["kv_b"],
                            w_uv_from=cfg.qk_nope_head_dim)


def attend(cq, kv, page_table, visible, lengths, new_mask, positions, inv_freq, p, cfg: ModelConfig, *, form: str,
           impl: str, rt: Runtime | None = None, layer=None):
    """The model's one attention call, from the query latent cq [b, t, q] (``latent_projection``), over one layer's
    cache storage kv (page_table: kimi_jax.cache), or with ``layer`` over layer ``layer`` of the whole cache kv
    [layers, ...] (the kernels read it there in place).
    form="full": per-head queries, expanded per-head K/V over the dense ``visible`` mask (training, the reference);
    form="absorbed": absorbed queries and MQA over the latent rows through the tree-attention op, whose ``impl``
    resolves per call and lowering platform (kimi_jax.ops.registry: the kernels at tree widths on a GPU, XLA for
    prefills and elsewhere). Under ``rt.mesh`` each device attends with its own heads (``_tree_on_local_heads``)."""
    if form not in ("absorbed", "full"):
        raise ValueError(f"attention form {form!r} is not 'absorbed' or 'full'")
    if form == "full":
        q_nope, q_pe = queries(cq, p, cfg, positions, inv_freq)
        def read(slots):        # visible keys lie below the longest row's length + t (cache.over_used_slots)
            rows = rows_upto(kv, page_table, slots, layer)
            return attend_full(q_nope, q_pe, rows, visible[..., :rows.shape[1]], p, cfg)
        n_slots, t = visible.shape[-1], cq.shape[1]
        if partitioned_slots(rt):
            return read(n_slots)
        return over_used_slots(jnp.max(lengths) + t, n_slots, read, t)
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
    if rt is not None and rt.mesh is not None:
        return _tree_on_local_heads(cq, positions, inv_freq, kv, lengths, new_mask, p, cfg, rt, impl, layer)
    return attend_tree(cq, positions, inv_freq, kv, page_table, lengths, new_mask, p, cfg, impl, layer)


def partitioned_slots(rt: Runtime | None) -> bool:
    """Whether ``rt``'s strategy splits the cache's slots over the mesh (dcp)."""
    if rt is None or rt.mesh is None:
        return False
    return bool(sharding.get_strategy(rt.strategy or sharding.infer_strategy(rt.mesh)).mesh_axes("slots", rt.mesh))


def _tree_on_local_heads(cq, positions, inv_freq, kv, lengths, new_mask, p, cfg: ModelConfig, rt: Runtime,
                         impl: str, layer=None):
    """attend_tree in ``jax.shard_map`` over ``rt.mesh``, each device on its own heads (and batch rows): a
    Pallas call is opaque to the SPMD partitioner, which otherwise gathers every head onto every device and runs
    the whole kernel on each (compiled for 8 H200s at TP-8: an all-gather per layer and 8x the attention work).
    A strategy that splits the cache by position (dcp) keeps the partitioner's form: its per-device partial
    softmaxes would need merging across devices."""
    def local(cq, positions, inv_freq, kv, lengths, new_mask, q_b, kv_b, layer, partitioned=False):
        return attend_tree(cq, positions, inv_freq, kv, None, lengths, new_mask, {"q_b": q_b, "kv_b": kv_b}, cfg,
                           impl, layer, partitioned)

    args = (cq, positions, inv_freq, kv, lengths, new_mask, p["q_b"], p["kv_b"], layer)
    st = sharding.get_strategy(rt.strategy or sharding.infer_strategy(rt.mesh))
    if st.mesh_axes("slots", rt.mesh):
        return local(*args, partitioned=True)
    spec = lambda *axes: sharding.logical_to_spec(axes, rt.mesh, st)  # noqa: E731
    kv_axes = ("batch", "slots", "latent") if layer is None else ("layers", "batch", "slots", "latent")
    return jax.shard_map(local, mesh=rt.mesh, out_specs=spec("batch", None, "heads", None), check_vma=False,
                         in_specs=(spec("batch", None, None), spec("batch", None), P(), spec(*kv_axes), spec("batch"),
                                   spec("batch", None, None), spec("q_lora", "heads", "head_dim"),
                                   spec("kv_lora", "heads", "head_dim"), None if layer is None else spec()))(*args)


def attend_full(q_nope, q_pe, kv, visible, p, cfg: ModelConfig):
    """Full-form MLA: expand per-head keys and values from the latent rows (the oracle for the absorbed form)."""
    r = cfg.kv_lora_rank
    kv_heads = jnp.einsum("bsr,rhk->bshk", kv[..., :r], p["kv_b"])
    k_nope, v = kv_heads[..., :cfg.qk_nope_head_dim], kv_heads[..., cfg.qk_nope_head_dim:]
    k_pe = kv[..., r:]
    scores = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
              + jnp.einsum("bthp,bsp->bhts", q_pe, k_pe, preferred_element_type=jnp.float32))
    probs = _softmax(scores * cfg.softmax_scale, visible)
    return jnp.einsum("bhts,bshv->bthv", probs.astype(v.dtype), v)


def output(o_heads, p):
    return jnp.einsum("bthv,hvd->btd", o_heads, p["o"])
