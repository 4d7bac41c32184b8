"""The K2.6 decoder as pure functions over a plain pytree of weights.

Weights are the nested dict declared in ``kimi_jax.model.params``. Layers of one kind are stacked on a leading
axis and run with ``lax.scan``: the ``first_k_dense_replace`` dense SwiGLU layers in one stack, the MoE layers in
another, so the 61-layer model compiles as two loop bodies. GPUs and small unsharded models decode from per-layer
buffers instead: each stack a tuple of per-layer trees (``kimi_jax.model.compute_layout`` says where and why;
``kimi_jax.model.layers.run_layers`` runs either form). One ``forward`` serves prefill, decode, tree verify
and training (which reads the expert loads it returns).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax import sharding
from kimi_jax.cache import KVCache, init_cache, visibility
from kimi_jax.config import ModelConfig, Runtime
from kimi_jax.model import mla
from kimi_jax.model.layers import residual_swiglu, run_layers, yarn_inv_freq
from kimi_jax.model.moe import moe_block
from kimi_jax.ops.numerics import rms_norm, rms_normalize


class LayerContext(NamedTuple):
    """What every layer of one forward shares."""
    positions: jax.Array     # [b, t] RoPE positions of the new tokens
    slots: jax.Array         # [b, t] cache slots their rows are written to
    visible: jax.Array       # [b, t, s] dense key visibility (XLA attention)
    lengths: jax.Array       # [b] committed rows; with new_mask, the same visibility for the Pallas kernel
    new_mask: jax.Array      # [b, t, t]
    inv_freq: jax.Array
    page_table: jax.Array | None   # paged caches: [b, pages_per_row] (kimi_jax.cache)


def _layer(cfg: ModelConfig, rt: Runtime, moe: bool, attn_form: str, ctx: LayerContext, x, kv, layer_params,
           layer_index):
    """One decoder layer; kv is the whole cache array (kimi_jax.cache). Returns (x, kv, expert loads [E] or None)."""
    positions, slots, inv_freq = ctx.positions, ctx.slots, ctx.inv_freq
    p = layer_params["attn"]
    with jax.named_scope("attention"):
        with jax.named_scope("qkv_proj"):   # the attention's norm and the cache write ride in the projection (mla)
            cq, kv = mla.latent_projection(x, layer_params["attn_norm"], p, cfg, positions, inv_freq, rt, kv,
                                           ctx.page_table, layer_index, slots)
        with jax.named_scope("attend"):
            o = mla.attend(cq, kv, ctx.page_table, ctx.visible, ctx.lengths, ctx.new_mask, positions, inv_freq, p,
                           cfg, form=attn_form, impl=rt.attn_impl, rt=rt, layer=layer_index)
        with jax.named_scope("o_proj"):
            y = mla.output(o, p)
    x = x + y
    if moe:     # the norm's weight goes in with the rows: the router kernel applies it (moe_block)
        with jax.named_scope("norm"):
            h = rms_normalize(x, cfg.rms_norm_eps)
        x, loads = moe_block(h, layer_params["moe"], cfg, rt, scale=layer_params["mlp_norm"], residual=x)
        return x, kv, loads
    with jax.named_scope("norm"):
        h = rms_norm(x, layer_params["mlp_norm"], cfg.rms_norm_eps)
    m = layer_params["mlp"]
    with jax.named_scope("dense_mlp"):
        # its width split as the strategy splits "mlp" (sharding.mlp_split)
        return residual_swiglu(x, h, m["gate"], m["up"], m["down"], impl=rt.moe_impl,
                               **sharding.mlp_split(rt.mesh, rt.strategy)), kv, None


class ForwardOut(NamedTuple):
    logits: jax.Array        # [b, t, vocab] float32
    cache: KVCache           # new rows written at slots lengths + t; lengths unchanged
    taps: jax.Array          # [n_taps, b, t, hidden]: outputs of the requested layers
    loads: jax.Array         # [num_moe_layers, n_routed_experts]: the router's choices per expert (training)


def forward(params, cfg: ModelConfig, tokens, cache: KVCache, *, positions=None, new_mask=None,
            taps: Sequence[int] = (), attn_form: str = "absorbed", rt: Runtime = Runtime()) -> ForwardOut:
    """Run new tokens [b, t] against the cache.

    positions: RoPE positions [b, t] (default lengths + t; a draft tree passes lengths + depth).
    new_mask: [b, t, t] which new tokens each new token sees (default causal; a tree passes its ancestor mask).
    taps: layer ids whose outputs to return: HF's hidden_states[l + 1], i.e. the output of decoder layer l, and
      for the last layer its output after the final norm (HF reports that one normed, and DFlash drafters read it).
    attn_form: "absorbed" (decode, verify, prefill) or "full" (training and the reference path; kimi_jax.model.mla).
    rt: kernels and mesh (kimi_jax.config.Runtime). Serving and training run this same forward.
    """
    b, t = tokens.shape
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    slots = cache.lengths[:, None] + steps
    if positions is None:
        positions = slots
    if new_mask is None:
        new_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    ctx = LayerContext(positions, slots, visibility(cache.lengths, new_mask, cache.max_len), cache.lengths, new_mask,
                       yarn_inv_freq(cfg), cache.page_table)
    taps = tuple(taps)
    for l in taps:
        if not 0 <= l < cfg.num_hidden_layers:
            raise ValueError(f"tap layer {l} is outside [0, {cfg.num_hidden_layers})")
    # Tap slot per layer; non-tapped layers write to a spare slot n_taps that is dropped at the end.
    tap_slot = jnp.full((cfg.num_hidden_layers,), len(taps), jnp.int32)
    for i, l in enumerate(taps):
        tap_slot = tap_slot.at[l].set(i)

    with jax.named_scope("embed"):
        x = params["embed"][tokens]
    tapped = jnp.zeros((len(taps) + 1, b, t, cfg.hidden_size), x.dtype)
    kv = cache.kv
    loads = jnp.zeros((0, cfg.n_routed_experts), jnp.float32)
    for stack, is_moe, offset in (("dense_layers", False, 0), ("moe_layers", True, cfg.first_k_dense_replace)):
        n = cfg.first_k_dense_replace if not is_moe else cfg.num_moe_layers
        if n == 0:
            continue

        def body(carry, xs, is_moe=is_moe):
            x, kv, tapped = carry
            layer_params, index = xs
            x, kv, layer_loads = _layer(cfg, rt, is_moe, attn_form, ctx, x, kv, layer_params, index)
            tapped = jax.lax.dynamic_update_index_in_dim(tapped, x, tap_slot[index], 0)
            return (x, kv, tapped), layer_loads

        # numpy, not jnp: on per-layer weights each layer's index is then a Python constant, where an iota's
        # element is a slice kernel per layer on a GPU (the attention kernel and the cache write take it)
        indices = np.arange(offset, offset + n, dtype=np.int32)
        (x, kv, tapped), layer_loads = run_layers(body, (x, kv, tapped), params[stack], indices)
        if is_moe:
            loads = layer_loads

    with jax.named_scope("head"):
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        if cfg.num_hidden_layers - 1 in taps:
            tapped = tapped.at[taps.index(cfg.num_hidden_layers - 1)].set(x)
        logits = jnp.einsum("btd,dv->btv", x, params["lm_head"], preferred_element_type=jnp.float32)
    return ForwardOut(logits, cache.replace(kv=kv), tapped[:len(taps)], loads)


def chunked_forward(params, cfg: ModelConfig, tokens, cache: KVCache, chunk: int, *, last=None,
                    taps: Sequence[int] = (), attn_form: str = "absorbed", rt: Runtime = Runtime()) -> ForwardOut:
    """``forward`` of tokens [b, t] (t a multiple of ``chunk``) in a loop over chunks of ``chunk`` tokens, each
    attending to the cache so far plus itself: activations O(chunk x cache slots) instead of O(t x t).

    last [b]: keep only the logits at position last[b] (returned as [b, 1, vocab]), and run only the chunks up to
    the longest row's last position (a run-time count: one program serves every prompt length up to t; taps past
    it are zeros). None runs every chunk and keeps all logits [b, t, vocab] (what ``Model.logits`` returns).
    Taps are kept for every position.
    """
    b, t = tokens.shape
    if t % chunk:
        raise ValueError(f"{t} tokens are not a whole number of chunks of {chunk}")
    n = t // chunk

    def run(i, kv):
        toks = jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1)
        return forward(params, cfg, toks, cache.replace(kv=kv, lengths=cache.lengths + i * chunk), taps=taps,
                       attn_form=attn_form, rt=rt)

    if last is None:
        def step(kv, i):
            out = run(i, kv)
            return out.cache.kv, (out.logits, out.taps, out.loads)

        kv, (logits, tapped, loads) = jax.lax.scan(step, cache.kv, jnp.arange(n, dtype=jnp.int32))
        logits = logits.transpose(1, 0, 2, 3).reshape(b, t, -1)
        tapped = tapped.transpose(1, 2, 0, 3, 4).reshape(tapped.shape[1], b, t, tapped.shape[-1])
        return ForwardOut(logits, cache.replace(kv=kv), tapped, loads.sum(0))

    def body(i, carry):
        kv, logits, tapped, loads = carry
        out = run(i, kv)
        j = last - i * chunk                # the row's last position, if it falls in this chunk
        hit = (j >= 0) & (j < chunk)
        logits = logits + jnp.where(hit[:, None, None], jnp.take_along_axis(
            out.logits, jnp.clip(j, 0, chunk - 1)[:, None, None], axis=1), 0.0)
        tapped = jax.lax.dynamic_update_slice_in_dim(tapped, out.taps, i * chunk, axis=2)
        return out.cache.kv, logits, tapped, loads + out.loads

    start = (cache.kv, jnp.zeros((b, 1, cfg.vocab_size), jnp.float32),
             jnp.zeros((len(tuple(taps)), b, t, cfg.hidden_size), params["embed"].dtype),
             jnp.zeros((cfg.num_moe_layers, cfg.n_routed_experts), jnp.float32))
    used = jnp.minimum(jnp.max(last) // chunk + 1, n)
    kv, logits, tapped, loads = jax.lax.fori_loop(0, used, body, start)
    return ForwardOut(logits, cache.replace(kv=kv), tapped, loads)


def causal_forward(params, cfg: ModelConfig, tokens, attn_form: str = "full",
                   rt: Runtime = Runtime()) -> ForwardOut:
    """A plain causal forward over tokens [b, t] with a fresh cache of t slots (not kept): the reference path
    and the training forward."""
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
    return forward(params, cfg, tokens, cache, attn_form=attn_form, rt=rt)


def full_logits(params, cfg: ModelConfig, tokens, attn_form: str = "full", rt: Runtime = Runtime()):
    """Logits [b, t, vocab] of a plain causal forward."""
    return causal_forward(params, cfg, tokens, attn_form, rt).logits
