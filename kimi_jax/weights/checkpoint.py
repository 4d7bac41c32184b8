"""Weights in and out: HF safetensors import and orbax save/restore.

Two on-disk formats:

* an **HF checkpoint directory** (``config.json`` + ``model.safetensors`` or sharded safetensors with
  ``model.safetensors.index.json``), DeepSeek-V3 tensor names with the ``model.`` prefix (K2, K2-Thinking) or
  ``language_model.model.`` (K2.5, K2.6); vision tensors and ``rotary_emb.inv_freq`` are skipped;
* a **kimi_jax checkpoint directory**: ``kimi_config.json`` (our ModelConfig) plus the weights in one of two
  forms, both read by :func:`restore`:

  - *stacked*: ``params/``, one orbax checkpoint of the whole params pytree (what :func:`save` writes; the
    shipped embedded default). Reading it without shardings needs the whole model in host memory.
  - *layered*: ``layers/layer_{i:03d}/`` (one orbax checkpoint per decoder layer: that layer's subtree without
    the leading stack axis; INT4 experts as ``{w13, s13, w2, s2}``) + ``globals/`` (embed, final_norm,
    lm_head). What ``python -m kimi_jax.convert`` writes: it never holds more than about one layer in host
    memory, and :func:`restore` reads it back one layer at a time and stacks the layers on device.

  Orbax writes into a temporary directory and renames it when complete, and ``kimi_config.json`` is written
  last through an atomic rename, so a directory with ``kimi_config.json`` in it is always complete.

Every tensor is checked against the shape the config implies; a mismatch names the tensor and both shapes.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig
from kimi_jax.model.params import ParamSpec, param_specs

CONFIG_FILE = "kimi_config.json"
PARAMS_DIR = "params"
LAYERS_DIR = "layers"
GLOBALS_DIR = "globals"
GLOBAL_KEYS = ("embed", "final_norm", "lm_head")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read; the message names the tensor."""


# ---- HF safetensors --------------------------------------------------------------------------------------

class SafetensorsReader:
    """Reads tensors by name from one or several safetensors files, lazily (one tensor in memory at a time)."""

    def __init__(self, directory: str):
        from safetensors import safe_open
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.files = json.load(f)["weight_map"]
        else:
            single = os.path.join(directory, "model.safetensors")
            if not os.path.exists(single):
                raise CheckpointError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
            with safe_open(single, "numpy") as f:
                self.files = {k: "model.safetensors" for k in f.keys()}
        self._open = {}
        self._safe_open = safe_open
        self.prefix = "language_model." if any(k.startswith("language_model.") for k in self.files) else ""

    def close(self) -> None:
        """Drop the open shards (memory maps): pages read from a mapped shard count in the process's RSS while it
        stays open. A later get() reopens the shard; arrays already returned are copies and stay valid."""
        self._open.clear()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.files

    def get(self, name: str) -> np.ndarray:
        key = self.prefix + name
        if key not in self.files:
            raise CheckpointError(f"tensor {key!r} is missing from {self.directory}")
        fname = self.files[key]
        if fname not in self._open:
            try:
                self._open[fname] = self._safe_open(os.path.join(self.directory, fname), "numpy")
            except Exception as e:  # truncated header, missing shard, ...
                raise CheckpointError(f"cannot read shard {fname} of {self.directory}: {e}") from e
        try:
            return self._open[fname].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {key!r} from {fname}: {e}") from e


def _hf_to_float32(a: np.ndarray, name: str) -> np.ndarray:
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise CheckpointError(f"tensor {name!r} has dtype {a.dtype}, expected a floating type")
    return np.asarray(a, np.float32)


def _layer_tensors(cfg: ModelConfig, i: int, moe: bool) -> dict[str, tuple[str, callable]]:
    """Our per-layer leaf path -> (HF tensor name, converter from the HF [out, in] array)."""
    h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    pre = f"model.layers.{i}."
    t = lambda w: w.T
    table = {
        "attn_norm": (pre + "input_layernorm.weight", None),
        "mlp_norm": (pre + "post_attention_layernorm.weight", None),
        "attn/q_a": (pre + "self_attn.q_a_proj.weight", t),
        "attn/q_a_norm": (pre + "self_attn.q_a_layernorm.weight", None),
        "attn/q_b": (pre + "self_attn.q_b_proj.weight", lambda w: w.T.reshape(-1, h, dn + dr)),
        "attn/kv_a": (pre + "self_attn.kv_a_proj_with_mqa.weight", t),
        "attn/kv_a_norm": (pre + "self_attn.kv_a_layernorm.weight", None),
        "attn/kv_b": (pre + "self_attn.kv_b_proj.weight", lambda w: w.T.reshape(-1, h, dn + dv)),
        "attn/o": (pre + "self_attn.o_proj.weight", lambda w: w.T.reshape(h, dv, -1)),
    }
    if not moe:
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            table[f"mlp/{ours}"] = (pre + f"mlp.{theirs}.weight", t)
        return table
    table["moe/router"] = (pre + "mlp.gate.weight", t)
    table["moe/router_bias"] = (pre + "mlp.gate.e_score_correction_bias", None)
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        table[f"moe/shared/{ours}"] = (pre + f"mlp.shared_experts.{theirs}.weight", t)
    return table


def _expert_name(cfg, i, e, proj):
    return f"model.layers.{i}.mlp.experts.{e}.{proj}_proj"


def iter_hf_layers(reader: SafetensorsReader, cfg: ModelConfig) -> Iterator[tuple[str, int, dict]]:
    """Yields (stack name, index in stack, {leaf path: float32 array in our layout}) one layer at a time."""
    specs = param_specs(cfg)
    for i in range(cfg.num_hidden_layers):
        moe = i >= cfg.first_k_dense_replace
        stack = "moe_layers" if moe else "dense_layers"
        j = i - cfg.first_k_dense_replace if moe else i
        out = {}
        for path, (name, convert) in _layer_tensors(cfg, i, moe).items():
            w = _hf_to_float32(reader.get(name), name)
            w = convert(w) if convert else w
            _check_shape(name, w.shape, _spec_at(specs[stack], path).shape[1:])
            out[path] = w
        if moe:
            for proj in ("gate", "up", "down"):
                name = _expert_name(cfg, i, 0, proj) + ".weight"
                if not reader.has(name):
                    raise CheckpointError(
                        f"{reader.prefix}{name} not found: INT4 (compressed-tensors) experts need "
                        "`python -m kimi_jax.convert`, float experts need per-expert .weight tensors")
                ws = [_hf_to_float32(reader.get(_expert_name(cfg, i, e, proj) + ".weight"), name).T
                      for e in range(cfg.n_routed_experts)]
                w = np.stack(ws)
                _check_shape(f"model.layers.{i}.mlp.experts.*.{proj}_proj.weight (stacked, transposed)",
                             w.shape, _spec_at(specs[stack], f"moe/experts/{proj}").shape[1:])
                out[f"moe/experts/{proj}"] = w
        yield stack, j, out


def _spec_at(tree, path: str) -> ParamSpec:
    for k in path.split("/"):
        tree = tree[k]
    return tree


def _check_shape(name, got, want):
    if tuple(got) != tuple(want):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(got)} but the config implies {tuple(want)}; "
                              "the checkpoint and its config.json disagree")


def load_hf(directory: str, cfg: ModelConfig | None = None, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """Read an HF checkpoint with float weights into our params pytree (numpy arrays -> jax arrays)."""
    cfg = cfg or ModelConfig.from_hf(directory)
    reader = SafetensorsReader(directory)
    specs = param_specs(cfg)
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), specs,
                          is_leaf=lambda x: isinstance(x, ParamSpec))
    for stack, j, tensors in iter_hf_layers(reader, cfg):
        for path, w in tensors.items():
            leaf = params[stack]
            *head, last = path.split("/")
            for k in head:
                leaf = leaf[k]
            leaf[last][j] = w
    for ours, name, convert in (("embed", "model.embed_tokens.weight", None),
                                ("final_norm", "model.norm.weight", None),
                                ("lm_head", "lm_head.weight", lambda w: w.T)):
        w = _hf_to_float32(reader.get(name), name)
        w = convert(w) if convert else w
        _check_shape(name, w.shape, specs[ours].shape)
        params[ours] = w
    dtypes = jax.tree.map(lambda s: jnp.dtype(s.dtype or dtype), specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    return cfg, jax.tree.map(lambda a, dt: jnp.asarray(a, dt), params, dtypes)


# ---- orbax -----------------------------------------------------------------------------------------------

def save(directory: str, cfg: ModelConfig, params) -> None:
    """Write a kimi_jax checkpoint (config + orbax params). Refuses to overwrite an existing one."""
    write_tree(directory, params, CONFIG_FILE, cfg.to_dict())


def write_tree(directory: str, tree, config_file: str, config: dict) -> None:
    """orbax ``params/`` (written to a temporary directory and renamed by orbax), then the config JSON through a
    temporary file and an atomic rename: a directory with the config file in it is always complete."""
    import orbax.checkpoint as ocp
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, PARAMS_DIR)
    if os.path.exists(target):
        raise CheckpointError(f"{target} already exists; choose another directory or remove it first")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(target, tree)
        ckptr.wait_until_finished()
    tmp = os.path.join(directory, config_file + ".tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, os.path.join(directory, config_file))


def is_kimi_checkpoint(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, CONFIG_FILE))


def read_config(directory: str) -> ModelConfig:
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        return ModelConfig.from_dict(json.load(f))


def _flat(tree, is_leaf=None) -> dict:
    """{'moe_layers/moe/experts/w13': leaf}: one path spelling for dicts and dataclasses (orbax stores both as dicts)."""
    def name(k):
        return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
    return {"/".join(map(name, path)): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def layer_dir(directory: str, i: int) -> str:
    """Decoder layer ``i``'s orbax directory in a layered checkpoint."""
    return os.path.join(directory, LAYERS_DIR, f"layer_{i:03d}")


def is_layered(directory: str) -> bool:
    return os.path.isdir(os.path.join(directory, LAYERS_DIR))


def restore(directory: str, cfg: ModelConfig | None = None, shardings=None, dtype=None):
    """Restore params; with ``shardings`` (a pytree of jax.sharding.Sharding like the params) each device reads
    only its shard. ``dtype`` casts the floating weights (not the float32 router bias) while reading.

    Both forms (module docstring) are read; the layered one (a ``layers/`` directory) one layer at a time: the
    layer is restored with the stacked shardings minus their leading (layer) axis and written into its slot of
    the stacked arrays on device, so host memory holds about one layer."""
    import orbax.checkpoint as ocp
    directory = os.path.abspath(directory)
    cfg = cfg or read_config(directory)
    if is_layered(directory):
        return cfg, _restore_layered(directory, cfg, shardings, dtype)
    target_dir = os.path.join(directory, PARAMS_DIR)
    if not os.path.isdir(target_dir):
        raise CheckpointError(f"{target_dir} is missing: the checkpoint is incomplete")
    specs = param_specs(cfg)
    want = _flat(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    flat_shardings = _flat(shardings) if shardings is not None else {}
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(target_dir).item_metadata.tree
        have = _flat(stored)
        missing = sorted(set(want) - set(have))
        if missing:
            raise CheckpointError(f"checkpoint lacks {missing[:3]} ({len(missing)} in all); was it written for "
                                  "another config?")
        for path, spec in want.items():
            if tuple(have[path].shape) != tuple(spec.shape):
                raise CheckpointError(f"param {path} has shape {tuple(have[path].shape)} in the checkpoint but the "
                                      f"config implies {tuple(spec.shape)}")

        def target(path, meta):
            key = "/".join(str(getattr(k, "key", k)) for k in path)
            spec = want[key]
            keep = dtype is None or spec.dtype is not None or not jnp.issubdtype(meta.dtype, jnp.floating)
            return jax.ShapeDtypeStruct(meta.shape, meta.dtype if keep else dtype, sharding=flat_shardings.get(key))

        restored = ckptr.restore(target_dir, jax.tree_util.tree_map_with_path(target, stored))
    # Back into the param tree's own node types (orbax hands dataclass nodes such as Int4Experts back as dicts).
    leaves = _flat(restored)
    treedef = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    return cfg, jax.tree.unflatten(treedef, [leaves[k] for k in want])


# ---- layered form ----------------------------------------------------------------------------------------

def _drop_leading_axis(sharding):
    """The sharding of one layer of a stacked array: the PartitionSpec without its first (layer) entry."""
    from jax.sharding import NamedSharding, PartitionSpec
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if spec and spec[0] is not None:
            raise CheckpointError(f"sharding {sharding.spec} splits the stacked layer axis; the layered checkpoint "
                                  "form needs the leading axis unsharded")
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]), memory_kind=sharding.memory_kind)
    if sharding.is_fully_replicated:  # SingleDeviceSharding, replicated GSPMD/Positional shardings
        return sharding
    raise CheckpointError(f"cannot derive a per-layer sharding from {type(sharding).__name__}; pass NamedShardings")


def _restore_orbax(path: str, want: dict, shardings: dict, dtype, what: str) -> dict:
    """One orbax directory -> {flat path: array}, checked against ``want`` ({flat path: (shape, spec dtype)})."""
    import orbax.checkpoint as ocp
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(path).item_metadata.tree
        have = _flat(stored)
        if set(want) != set(have):
            raise CheckpointError(f"{what} ({path}) has params {sorted(set(have) ^ set(want))[:3]} that the config "
                                  "does not imply (or lacks them); was it written for another config?")
        for k, (shape, _) in want.items():
            if tuple(have[k].shape) != tuple(shape):
                raise CheckpointError(f"{what}: param {k} has shape {tuple(have[k].shape)} in the checkpoint but "
                                      f"the config implies {tuple(shape)}")

        def target(path, meta):
            key = "/".join(str(getattr(k, "key", k)) for k in path)
            fixed = want[key][1] is not None
            keep = dtype is None or fixed or not jnp.issubdtype(meta.dtype, jnp.floating)
            return jax.ShapeDtypeStruct(meta.shape, meta.dtype if keep else dtype, sharding=shardings.get(key))

        return _flat(ckptr.restore(path, jax.tree_util.tree_map_with_path(target, stored)))


def _restore_layered(directory: str, cfg: ModelConfig, shardings, dtype) -> dict:
    specs = param_specs(cfg)
    is_spec = lambda x: isinstance(x, ParamSpec)  # noqa: E731
    want = _flat(specs, is_leaf=is_spec)
    flat_sh = _flat(shardings) if shardings is not None else {}
    if shardings is not None and set(flat_sh) != set(want):
        raise CheckpointError(f"shardings do not match the params tree: {sorted(set(flat_sh) ^ set(want))[:3]}")
    out = _restore_orbax(os.path.join(directory, GLOBALS_DIR), {k: (want[k].shape, want[k].dtype) for k in GLOBAL_KEYS},
                         {k: flat_sh[k] for k in GLOBAL_KEYS if k in flat_sh}, dtype, "globals")
    float_dtype = jnp.dtype(dtype) if dtype is not None else out["embed"].dtype

    def leaf_dtype(k, stored=None):
        s = want[k]
        return jnp.dtype(s.dtype) if s.dtype is not None else (stored if dtype is None and stored is not None
                                                               else float_dtype)

    for stack, first, n in (("dense_layers", 0, cfg.first_k_dense_replace),
                            ("moe_layers", cfg.first_k_dense_replace, cfg.num_moe_layers)):
        keys = [k for k in want if k.startswith(stack + "/")]
        sub = {k[len(stack) + 1:]: k for k in keys}  # per-layer path -> stacked path
        layer_want = {s: (want[k].shape[1:], want[k].dtype) for s, k in sub.items()}
        layer_sh = {s: _drop_leading_axis(flat_sh[k]) for s, k in sub.items() if k in flat_sh}
        out_sh = {s: flat_sh[k] for s, k in sub.items()} if flat_sh else None
        buf = None
        for j in range(n):
            layer = _restore_orbax(layer_dir(directory, first + j), layer_want, layer_sh, dtype,
                                   f"layer {first + j}")
            if buf is None:  # the stacked arrays, allocated on device with the stacked shardings
                shapes = {s: jax.ShapeDtypeStruct(want[k].shape, layer[s].dtype) for s, k in sub.items()}
                buf = jax.jit(lambda: {s: jnp.zeros(v.shape, v.dtype) for s, v in shapes.items()},
                              out_shardings=out_sh)()
                put = jax.jit(_put_layer, donate_argnums=0, out_shardings=out_sh)
            buf = put(buf, layer, j)
            del layer
        if buf is None:  # zero layers of this kind: empty stacks
            buf = {s: jnp.zeros(want[k].shape, leaf_dtype(k)) for s, k in sub.items()}
        out.update({k: buf[s] for s, k in sub.items()})
    treedef = jax.tree.structure(specs, is_leaf=is_spec)
    return jax.tree.unflatten(treedef, [out[k] for k in want])


def _put_layer(buf: dict, layer: dict, j):
    return {k: jax.lax.dynamic_update_index_in_dim(buf[k], layer[k].astype(buf[k].dtype), j, 0) for k in buf}
