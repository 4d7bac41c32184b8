"""Drafter checkpoints: our own form (``drafter_config.json`` + orbax ``params/``) and the public DFlash
layout (``config.json`` + safetensors, [out, in] weights), read into the input-major pytree of
``kimi_jax.decoding.drafter`` and checked against the target they will draft for."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig
from kimi_jax.decoding.drafter import CONFIG_FILE, Drafter, DrafterConfig, DrafterError, param_shapes, param_shardings
from kimi_jax.sharding import place
from kimi_jax.weights.checkpoint import PARAMS_DIR, check_manifest, restore_tree, stored_tree, write_tree
from kimi_jax.weights.hf import SafetensorsReader


def _from_hf_tensors(get, c: DrafterConfig) -> dict:
    """Public DFlash safetensors names ([out, in]) -> our input-major pytree."""
    hq, hk, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    layers = {k: [] for k in param_shapes(c)["layers"]}
    for i in range(c.num_hidden_layers):
        pre = f"layers.{i}."
        w = lambda name: np.asarray(get(pre + name), np.float32)
        layers["input_norm"].append(w("input_layernorm.weight"))
        layers["post_norm"].append(w("post_attention_layernorm.weight"))
        layers["q"].append(w("self_attn.q_proj.weight").T.reshape(-1, hq, hd))
        layers["k"].append(w("self_attn.k_proj.weight").T.reshape(-1, hk, hd))
        layers["v"].append(w("self_attn.v_proj.weight").T.reshape(-1, hk, hd))
        layers["o"].append(w("self_attn.o_proj.weight").T.reshape(hq, hd, -1))
        layers["q_norm"].append(w("self_attn.q_norm.weight"))
        layers["k_norm"].append(w("self_attn.k_norm.weight"))
        for ours in ("gate", "up", "down"):
            layers[ours].append(w(f"mlp.{ours}_proj.weight").T)
    return {"fc": np.asarray(get("fc.weight"), np.float32).T, "hidden_norm": np.asarray(get("hidden_norm.weight")),
            "norm": np.asarray(get("norm.weight")), "layers": {k: np.stack(v) for k, v in layers.items()}}


def load_drafter(path: str, target: ModelConfig, dtype=jnp.float32, verify: bool | None = None,
                 mesh: jax.sharding.Mesh | None = None, strategy=None) -> Drafter:
    """Load a drafter (kimi_jax checkpoint or public DFlash layout) and check it fits the target. ``mesh``: the
    weights go onto it split as the programs run them under ``strategy`` (``drafter.param_shardings``: heads and
    MLP width; every device reads only its shards); default this process's first device."""
    if not os.path.isdir(path):
        raise DrafterError(f"drafter directory {path!r} does not exist")
    if os.path.exists(os.path.join(path, CONFIG_FILE)):
        with open(os.path.join(path, CONFIG_FILE)) as f:
            c = DrafterConfig.from_dict(json.load(f))
        c.check_target(target)
        check_manifest(os.path.abspath(path), verify)
        where = os.path.join(path, PARAMS_DIR)
        stored = stored_tree(where)
        try:
            want = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, dtype, sharding=s), stored,
                                _placement(c, mesh, strategy))
        except ValueError as e:         # a tree that is not param_shapes' (another model's, or a damaged one)
            raise DrafterError(f"{where} does not hold a drafter's weights for its config: {e}") from None
        params = restore_tree(where, want)
        _check_shapes(params, param_shapes(c))
        return Drafter(c, params)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise DrafterError(f"{path} holds neither {CONFIG_FILE} nor a DFlash config.json")
    with open(os.path.join(path, "config.json")) as f:
        c = DrafterConfig.from_hf(json.load(f), target.num_hidden_layers)
    c.check_target(target)
    reader = SafetensorsReader(path)
    params = _from_hf_tensors(reader.get, c)
    _check_shapes(params, param_shapes(c))
    where = _placement(c, mesh, strategy)
    return Drafter(c, jax.tree.map(lambda x, s: place(np.asarray(x, dtype), s), params, where))


def _placement(c: DrafterConfig, mesh, strategy):
    """Per weight, where it goes: split on ``mesh`` (``param_shardings``), else this process's first device."""
    if mesh is not None:
        return param_shardings(c, mesh, strategy)
    first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: first, param_shapes(c), is_leaf=lambda x: isinstance(x, tuple))


def _check_shapes(params, shapes):
    for (path, a), want in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                               jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))):
        if tuple(a.shape) != tuple(want):
            raise DrafterError(f"drafter weight {jax.tree_util.keystr(path)} has shape {tuple(a.shape)}, "
                               f"the config implies {tuple(want)}")


def save_drafter(path: str, drafter: Drafter):
    write_tree(path, drafter.params, CONFIG_FILE, drafter.config.to_dict())
