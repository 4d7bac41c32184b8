"""The DFlash block-diffusion drafter: its config, weights table and forward (math only).

A few Qwen3-style layers that, in one forward, predict the ``block_size - 1`` tokens after the bonus token.
The block is ``[bonus, MASK, ..., MASK]`` embedded with the target's (shared, frozen) embedding; every layer
attends, without a causal mask, to the block itself and to K/V computed from the target's hidden states of the
committed context ("KV injection"): taps of ``target_layer_ids`` concatenated, projected by ``fc`` and
normalised by ``hidden_norm`` once, then each layer's own Wk/Wv. The block positions 1.. are read out through the
target's lm_head.

The drafter keeps only those context K/V (``FeatureCache``), one row per committed token, so its length always
equals the target cache's committed length. Each round appends the rows of the accepted path's tapped states.

Weights are input-major like the target's ([in, out]); ``kimi_jax.weights.drafter`` loads them from the public
DFlash layout or from a kimi_jax drafter checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from kimi_jax.config import ModelConfig, rope_fields, yarn_mscale
from kimi_jax.model.layers import apply_rope_half, rms_norm, swiglu, yarn_frequencies

CONFIG_FILE = "drafter_config.json"


class DrafterError(ValueError):
    """A drafter that does not fit its target, or a bad drafter argument."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's fallback taps: evenly from the second layer to the third-to-last (Python round: half-to-even)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0           # 0: absent in the config (HF then scales cos/sin by get_mscale(factor))
    rope_mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise DrafterError(f"block_size must be >= 2, got {self.block_size}")

    @property
    def rope_scale(self) -> float:
        """cos/sin amplitude of HF's yarn (attention_factor); 1.0 for plain RoPE and for K2's mscale 1/1."""
        if self.rope_factor <= 1.0:
            return 1.0
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(self.rope_factor,
                                                                               self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor, 1.0)

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d):
        return cls(**{**d, "target_layer_ids": tuple(d["target_layer_ids"])})

    @classmethod
    def from_hf(cls, hf: dict[str, Any], num_target_layers: int | None = None) -> "DrafterConfig":
        """From a public DFlash config.json (Qwen3 backbone + dflash_config)."""
        dflash = hf.get("dflash_config") or {}
        layers = hf["num_hidden_layers"]
        taps = dflash.get("target_layer_ids")
        if taps is None:
            n_target = hf.get("num_target_layers", num_target_layers)
            if n_target is None:
                raise DrafterError("drafter config has neither dflash_config.target_layer_ids nor num_target_layers")
            taps = build_target_layer_ids(n_target, layers)
        rope = rope_fields(hf, mscale_default=0.0, theta_default=1e6)
        mask = dflash.get("mask_token_id", hf.get("mask_token_id"))
        if mask is None:
            raise DrafterError("drafter config has no dflash_config.mask_token_id")
        heads = hf["num_attention_heads"]
        return cls(hidden_size=hf["hidden_size"], num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=hf.get("num_key_value_heads", heads),
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                   intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                   block_size=dflash.get("block_size", hf.get("block_size", 16)), mask_token_id=mask,
                   target_layer_ids=tuple(taps), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                   **rope)

    def check_target(self, target: ModelConfig):
        if self.hidden_size != target.hidden_size:
            raise DrafterError(f"drafter hidden_size {self.hidden_size} does not match the target's "
                               f"{target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise DrafterError(f"drafter vocab_size {self.vocab_size} does not match the target's {target.vocab_size}")
        bad = [l for l in self.target_layer_ids if not 0 <= l < target.num_hidden_layers]
        if bad:
            raise DrafterError(f"drafter taps layer {bad[0]}, but the target has {target.num_hidden_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DrafterError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary")


def param_shapes(c: DrafterConfig) -> dict:
    d, hq, hk, hd, f, n = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           c.intermediate_size, c.num_hidden_layers)
    return {
        "fc": (len(c.target_layer_ids) * d, d), "hidden_norm": (d,), "norm": (d,),
        "layers": {"input_norm": (n, d), "post_norm": (n, d), "q": (n, d, hq, hd), "k": (n, d, hk, hd),
                   "v": (n, d, hk, hd), "o": (n, hq, hd, d), "q_norm": (n, hd), "k_norm": (n, hd),
                   "gate": (n, d, f), "up": (n, d, f), "down": (n, f, d)},
    }


def init_params(c: DrafterConfig, key, dtype=jnp.float32, scale: float = 1.0) -> dict:
    shapes, treedef = jax.tree.flatten(param_shapes(c), is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(param_shapes(c), is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(shapes))
    leaves = []
    for path, shape, k in zip(paths, shapes, keys):
        if "norm" in path:
            leaves.append(jnp.ones(shape, dtype))
        else:
            # fc [n_tap*d, d] and o [n, heads, head_dim, d] contract over more than one axis
            fan_in = shape[0] if path.endswith("['fc']") else shape[1] * (shape[2] if path.endswith("['o']") else 1)
            leaves.append((jax.random.normal(k, shape) * scale / math.sqrt(fan_in)).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


@flax.struct.dataclass
class FeatureCache:
    k: jax.Array     # [layers, b, slots, kv_heads, head_dim]: context K per draft layer (rope applied)
    v: jax.Array     # [layers, b, slots, kv_heads, head_dim]


@dataclasses.dataclass
class Drafter:
    config: DrafterConfig
    params: dict


# ---- forward ---------------------------------------------------------------------------------------------

def _inv_freq(c: DrafterConfig):
    return yarn_frequencies(c.head_dim, c.rope_theta, c.rope_factor, c.rope_original_max_position_embeddings,
                            c.rope_beta_fast, c.rope_beta_slow)


def context_features(p, c: DrafterConfig, taps):
    """taps [n_tap, b, t, d] (target layer outputs) -> the injected context [b, t, d] = hidden_norm(fc(concat))."""
    feats = jnp.concatenate(list(taps), axis=-1)
    return rms_norm(feats @ p["fc"], p["hidden_norm"], c.rms_norm_eps)


def context_kv(p, c: DrafterConfig, ctx, positions):
    """Per-layer K/V of the context rows: [layers, b, t, kv_heads, head_dim] each."""
    inv_freq = _inv_freq(c)

    def one(lp):
        k = rms_norm(jnp.einsum("btd,dhk->bthk", ctx, lp["k"]), lp["k_norm"], c.rms_norm_eps)
        return (apply_rope_half(k, positions, inv_freq, c.rope_scale), jnp.einsum("btd,dhk->bthk", ctx, lp["v"]))

    return jax.vmap(one)(p["layers"])


def block_logits(p, c: DrafterConfig, target_params, block, positions, ctx_k, ctx_v, ctx_visible, block_mask):
    """The drafter forward over blocks of tokens, returning logits for every block slot [b, t, vocab]."""
    x = block_hidden(p, c, target_params, block, positions, ctx_k, ctx_v, ctx_visible, block_mask)
    return readout(x, target_params)


def readout(x, target_params):
    """Draft logits through the target's lm_head, float32."""
    return jnp.einsum("btd,dv->btv", x, target_params["lm_head"], preferred_element_type=jnp.float32)


def block_hidden(p, c: DrafterConfig, target_params, block, positions, ctx_k, ctx_v, ctx_visible, block_mask):
    """The drafter's final-normed hidden state of every block slot [b, t, d].

    block [b, t] tokens at RoPE positions [b, t]; ctx_k/ctx_v [layers, b, s, kv_heads, head_dim];
    ctx_visible [b, t, s] which context rows each block slot sees; block_mask [b, t, t] which block slots it
    sees (all of its own block: the drafter is not causal). Serving uses one block; training packs many.
    """
    inv_freq = _inv_freq(c)
    group = c.num_attention_heads // c.num_key_value_heads
    x = target_params["embed"][block].astype(p["fc"].dtype)
    visible = jnp.concatenate([ctx_visible, block_mask], axis=-1)          # [b, t, s + t]

    def layer(x, xs):
        lp, ck, cv = xs
        h = rms_norm(x, lp["input_norm"], c.rms_norm_eps)
        q = rms_norm(jnp.einsum("btd,dhk->bthk", h, lp["q"]), lp["q_norm"], c.rms_norm_eps)
        q = apply_rope_half(q, positions, inv_freq, c.rope_scale)
        k = rms_norm(jnp.einsum("btd,dhk->bthk", h, lp["k"]), lp["k_norm"], c.rms_norm_eps)
        k = jnp.concatenate([ck, apply_rope_half(k, positions, inv_freq, c.rope_scale)], axis=1)
        v = jnp.concatenate([cv, jnp.einsum("btd,dhk->bthk", h, lp["v"])], axis=1)
        q = q.reshape(*q.shape[:2], c.num_key_value_heads, group, c.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(c.head_dim)
        scores = jnp.where(visible[:, None, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(*x.shape[:2], c.num_attention_heads, c.head_dim)
        x = x + jnp.einsum("bthk,hkd->btd", o, lp["o"])
        h = rms_norm(x, lp["post_norm"], c.rms_norm_eps)
        return x + swiglu(h, lp["gate"], lp["up"], lp["down"]), None

    x, _ = jax.lax.scan(layer, x, (p["layers"], ctx_k, ctx_v))
    return rms_norm(x, p["norm"], c.rms_norm_eps)


def draft(p, c: DrafterConfig, target_params, cache: FeatureCache, bonus, lengths, block_size: int,
          depth: int | None = None):
    """Per-position draft logits [b, depth, vocab] for the tokens after each row's bonus (depth defaults to
    block_size - 1). The block always runs whole (it is not causal); only the `depth` slots a tree of the
    caller's budget can reach go through the lm_head, the drafter's largest matmul."""
    b = bonus.shape[0]
    block = jnp.concatenate([bonus[:, None], jnp.full((b, block_size - 1), c.mask_token_id, jnp.int32)], axis=1)
    positions = lengths[:, None] + jnp.arange(block_size)[None, :]
    slots = cache.k.shape[2]
    ctx_visible = jnp.broadcast_to((jnp.arange(slots)[None, :] < lengths[:, None])[:, None, :],
                                   (b, block_size, slots))
    block_mask = jnp.ones((b, block_size, block_size), bool)
    x = block_hidden(p, c, target_params, block, positions, cache.k, cache.v, ctx_visible, block_mask)
    return readout(x[:, 1:1 + (block_size - 1 if depth is None else depth)], target_params)


def commit_features(p, c: DrafterConfig, target_params, cache: FeatureCache, taps, path, path_len, lengths):
    """Append the accepted path's context rows at slots lengths + j (j < path_len).

    taps [n_tap, b, width, d] are the target's tapped states of the verified rows; path [b, k] indexes them.
    """
    del target_params
    rows = jnp.take_along_axis(taps, jnp.maximum(path, 0)[None, :, :, None], axis=2)     # [n_tap, b, k, d]
    positions = lengths[:, None] + jnp.arange(path.shape[1])[None, :]
    k, v = context_kv(p, c, context_features(p, c, rows), positions)
    b = path.shape[0]
    dst = jnp.where(jnp.arange(path.shape[1])[None, :] < path_len[:, None], positions, cache.k.shape[2])
    batch = jnp.arange(b)[:, None]
    return FeatureCache(k=cache.k.at[:, batch, dst].set(k.astype(cache.k.dtype), mode="drop"),
                        v=cache.v.at[:, batch, dst].set(v.astype(cache.v.dtype), mode="drop"))


def prefill_features(p, c: DrafterConfig, target_params, taps, prompt_lens, max_len: int) -> FeatureCache:
    """The feature cache of the prompt: every prompt row committed at once."""
    _, b, t, _ = taps.shape
    shape = (c.num_hidden_layers, b, max_len, c.num_key_value_heads, c.head_dim)
    dtype = p["fc"].dtype
    empty = FeatureCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    path = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return commit_features(p, c, target_params, empty, taps, path, prompt_lens, jnp.zeros((b,), jnp.int32))
