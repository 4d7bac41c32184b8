"""HF K2.x safetensors: the one reader (float and compressed-tensors INT4) and the one name table.

An HF checkpoint directory holds ``config.json`` (a ``kimi_k25`` wrapper with a ``text_config``, or a plain
``deepseek_v3`` / ``kimi_k2`` config) and ``model.safetensors`` or shards with ``model.safetensors.index.json``.
Tensor names carry the ``model.`` prefix (K2, K2-Thinking) or ``language_model.model.`` (K2.5, K2.6); vision
tensors and ``rotary_emb.inv_freq`` are never read.

INT4: the ``quantization_config`` (top level or inside ``text_config``) must be compressed-tensors
``pack-quantized``, 4-bit symmetric int, group 32. Whether a module is INT4 is decided module by module by the
ignore list, as compressed-tensors does it (``re:PATTERN`` entries match with ``re.match``, plain entries by exact
name). Only routed experts may be INT4; they are read as ``weight_packed`` / ``weight_scale`` / ``weight_shape``
triplets and repacked into ``ops.int4_format.Int4Experts`` without ever being dequantised.

``LAYER_TABLE`` / ``GLOBAL_TABLE`` say, once, which HF tensor every one of our weights is and how the layouts map
in both directions; the reader here and the exporter (``weights.export``) both use them. Every tensor's dtype
and shape is checked against the config; an error names the tensor (and the shard when the file itself is bad).
"""

from __future__ import annotations

import gc
import json
import os
import re
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np

from kimi_jax.config import ConfigError, ModelConfig
from kimi_jax.model.params import param_specs
from kimi_jax.ops.int4_format import GROUP_SIZE, Int4Experts
from kimi_jax.weights.checkpoint import CheckpointError, stack_layers

BF16 = ml_dtypes.bfloat16
FLOAT_DTYPES = (np.dtype(BF16), np.dtype(np.float16), np.dtype(np.float32))


# ---- the name table --------------------------------------------------------------------------------------

class Tensor(NamedTuple):
    """One of our weights as an HF tensor: its name (without the model prefix) and the layout maps."""
    name: str
    to_ours: Callable | None = None      # HF [out, in] array -> ours; None: identical
    to_hf: Callable | None = None


def _t(w):
    return w.T


def layer_table(cfg: ModelConfig, i: int) -> dict[str, Tensor]:
    """Decoder layer i: our per-layer leaf path -> Tensor (routed experts excluded: see ``expert_name``)."""
    pre, h = f"model.layers.{i}.", cfg.num_attention_heads
    linear = lambda name: Tensor(pre + name, _t, _t)                      # noqa: E731
    plain = lambda name: Tensor(pre + name)                               # noqa: E731

    def per_head_out(name, width):   # HF [heads * width, in] <-> ours [in, heads, width]
        return Tensor(pre + name, lambda w: w.T.reshape(w.shape[1], h, width), lambda a: a.reshape(a.shape[0], -1).T)

    table = {
        "attn_norm": plain("input_layernorm.weight"),
        "mlp_norm": plain("post_attention_layernorm.weight"),
        "attn/q_a": linear("self_attn.q_a_proj.weight"),
        "attn/q_a_norm": plain("self_attn.q_a_layernorm.weight"),
        "attn/q_b": per_head_out("self_attn.q_b_proj.weight", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
        "attn/kv_a": linear("self_attn.kv_a_proj_with_mqa.weight"),
        "attn/kv_a_norm": plain("self_attn.kv_a_layernorm.weight"),
        "attn/kv_b": per_head_out("self_attn.kv_b_proj.weight", cfg.qk_nope_head_dim + cfg.v_head_dim),
        "attn/o": Tensor(pre + "self_attn.o_proj.weight",
                         lambda w: w.T.reshape(h, cfg.v_head_dim, -1),
                         lambda a: a.reshape(-1, a.shape[-1]).T),
    }
    if i < cfg.first_k_dense_replace:
        table.update({f"mlp/{p}": linear(f"mlp.{p}_proj.weight") for p in ("gate", "up", "down")})
        return table
    table["moe/router"] = linear("mlp.gate.weight")
    table["moe/router_bias"] = plain("mlp.gate.e_score_correction_bias")
    table.update({f"moe/shared/{p}": linear(f"mlp.shared_experts.{p}_proj.weight") for p in ("gate", "up", "down")})
    return table


GLOBAL_TABLE = {"embed": Tensor("model.embed_tokens.weight"), "final_norm": Tensor("model.norm.weight"),
                "lm_head": Tensor("lm_head.weight", _t, _t)}


def expert_name(i: int, e: int, proj: str) -> str:
    """Module name of routed expert e's gate/up/down projection in layer i."""
    return f"model.layers.{i}.mlp.experts.{e}.{proj}_proj"


# ---- config.json and quantization_config ---------------------------------------------------------------------

def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"no config.json in {hf_dir}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e


def quantization_config(hf: dict) -> dict | None:
    """The compressed-tensors config (top level or in text_config), validated; None when unquantized."""
    q = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "pack-quantized":
        raise ConfigError(f"quantization_config {q.get('quant_method')!r}/{q.get('format')!r} is not supported; "
                          "kimi_jax reads compressed-tensors pack-quantized INT4 (K2-Thinking, K2.5, K2.6)")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"quantization_config has {len(groups)} config_groups; expected exactly one")
    w = next(iter(groups.values())).get("weights") or {}
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP_SIZE}
    bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
    if bad:
        raise ConfigError(f"quantization scheme {bad} is not supported; expected {want}")
    return q


def is_ignored(module: str, ignore: list[str]) -> bool:
    """compressed-tensors' rule: ``re:`` entries match with re.match, plain entries by exact name."""
    for pat in ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return True
        elif pat == module:
            return True
    return False


# ---- safetensors ---------------------------------------------------------------------------------------------

class SafetensorsReader:
    """Tensors by name from one or several safetensors files, lazily, counting the bytes read.

    Pages read from a memory-mapped shard count in the process's RSS while it stays open, so the shards are
    closed every ``RELEASE_BYTES`` (and by ``release``): keeping them all mapped would grow RSS by the whole
    checkpoint. Arrays already returned are copies and stay valid."""

    RELEASE_BYTES = 256 << 20

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
        self._open, self._safe_open = {}, safe_open
        self.bytes = self._mapped = 0
        self.prefix = "language_model." if any(k.startswith("language_model.") for k in self.files) else ""

    def release(self) -> None:
        """Unmap the shards, collect, and hand freed heap back to the OS (glibc), so the next layer starts from
        the baseline instead of on top of the previous one's freed-but-kept pages."""
        self._open.clear()
        self._mapped = 0
        gc.collect()
        try:
            import ctypes
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

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
            a = self._open[fname].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {key!r} from {fname}: {e}") from e
        self.bytes += a.nbytes
        self._mapped += a.nbytes
        if self._mapped >= self.RELEASE_BYTES:
            self._open.clear()
            self._mapped = 0
        return a


# ---- one reader --------------------------------------------------------------------------------------------

def _spec_at(tree, path: str):
    for k in path.split("/"):
        tree = tree[k]
    return tree


class HFCheckpoint:
    """An opened HF checkpoint: its ModelConfig (``int4_experts`` decided from the files) and a reader of one
    decoder layer (or the globals) at a time, in our layout, checked against the config."""

    def __init__(self, directory: str):
        hf = read_hf_config(directory)
        self.quant = quantization_config(hf)
        self.reader = SafetensorsReader(directory)
        cfg = ModelConfig.from_hf(hf)
        if cfg.num_moe_layers:
            cfg = cfg.replace(int4_experts=self._experts_int4(cfg, cfg.first_k_dense_replace))
        self.config = cfg
        self._specs = param_specs(cfg)

    def _quantized(self, module: str) -> bool:
        if self.quant is None:
            return False
        ignore = self.quant.get("ignore") or []
        return not (is_ignored(self.reader.prefix + module, ignore) or is_ignored(module, ignore))

    def _experts_int4(self, cfg: ModelConfig, i: int) -> bool:
        """Whether layer i's routed experts are INT4, module by module from the ignore list; all must agree."""
        kinds = {self._quantized(expert_name(i, e, p)) for e in range(cfg.n_routed_experts)
                 for p in ("gate", "up", "down")}
        if len(kinds) > 1:
            raise CheckpointError(f"layer {i}: the quantization ignore list makes some routed experts INT4 and "
                                  "others float; kimi_jax needs all routed experts in one format")
        return kinds.pop()

    def _float(self, t: Tensor, want_shape, dtype) -> np.ndarray:
        full = self.reader.prefix + t.name
        a = self.reader.get(t.name)
        if a.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {full!r} has dtype {a.dtype}; expected bfloat16 (or float16/float32)")
        try:
            w = t.to_ours(a) if t.to_ours else a
            ok = tuple(w.shape) == tuple(want_shape)
        except ValueError:
            ok = False
        if not ok:
            raise CheckpointError(f"tensor {full!r} has shape {tuple(a.shape)} (HF layout) which does not match "
                                  f"the config (our layout {tuple(want_shape)}); the checkpoint and config.json "
                                  "disagree")
        return np.ascontiguousarray(w, dtype=dtype)  # one copy (none when already contiguous in that dtype)

    def _triplet(self, i: int, e: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's (weight_packed, weight_scale), checked (with weight_shape) against the config."""
        cfg = self.config
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        n, k = (d, f) if proj == "down" else (f, d)
        base = expert_name(i, e, proj)
        full = self.reader.prefix + base
        p, s, shp = (self.reader.get(base + x) for x in (".weight_packed", ".weight_scale", ".weight_shape"))
        if p.dtype != np.int32:
            raise CheckpointError(f"tensor {full}.weight_packed has dtype {p.dtype}; expected int32")
        if p.shape != (n, -(-k // 8)):
            raise CheckpointError(f"tensor {full}.weight_packed has shape {p.shape}; the config implies "
                                  f"{(n, -(-k // 8))}")
        if s.dtype != BF16:
            raise CheckpointError(f"tensor {full}.weight_scale has dtype {s.dtype}; expected bfloat16")
        if s.shape != (n, k // GROUP_SIZE):
            raise CheckpointError(f"tensor {full}.weight_scale has shape {s.shape}; the config implies "
                                  f"{(n, k // GROUP_SIZE)}")
        if shp.dtype not in (np.int32, np.int64) or tuple(int(x) for x in shp.reshape(-1)) != (n, k):
            raise CheckpointError(f"tensor {full}.weight_shape is {shp.tolist()} ({shp.dtype}); expected "
                                  f"int32/int64 {[n, k]}, the logical shape the config implies")
        return p, s

    def _int4_experts(self, i: int) -> dict:
        # Repacked one expert at a time into preallocated stacked arrays: the unpacked nibbles of all experts at
        # once would be several times the layer's size.
        ex: dict = {}
        n = self.config.n_routed_experts
        for e in range(n):
            arrays = [a for p in ("gate", "up", "down") for a in self._triplet(i, e, p)]
            try:
                one = Int4Experts.from_compressed_tensors(*arrays)
            except (ValueError, TypeError) as err:
                raise CheckpointError(f"layer {i} routed expert {e}: {err}") from err
            for fld in ("w13", "s13", "w2", "s2"):
                a = np.asarray(getattr(one, fld))
                if fld not in ex:
                    ex[fld] = np.empty((n, *a.shape), a.dtype)
                ex[fld][e] = a
        return ex

    def read_layer(self, i: int, dtype) -> dict:
        """Decoder layer i as {per-layer leaf path: array} (no leading layer axis); INT4 experts as
        ``experts/{w13, s13, w2, s2}``. ``dtype``: the float weights' dtype (the router bias keeps its own)."""
        cfg = self.config
        moe = i >= cfg.first_k_dense_replace
        spec = self._specs["moe_layers" if moe else "dense_layers"]
        out = {}
        for path, t in layer_table(cfg, i).items():
            if t.name.endswith("_proj.weight") and self._quantized(t.name[:-len(".weight")]):
                raise CheckpointError(f"module {self.reader.prefix + t.name[:-len('.weight')]!r} is INT4 by "
                                      "quantization_config (not in its ignore list); kimi_jax supports INT4 only "
                                      "for routed experts")
            s = _spec_at(spec, path)
            out[path] = self._float(t, s.shape[1:], np.dtype(s.dtype or dtype))
        if moe and cfg.int4_experts:
            out.update({f"moe/experts/{k}": v for k, v in self._int4_experts(i).items()})
        elif moe:
            for p in ("gate", "up", "down"):
                want = _spec_at(spec, f"moe/experts/{p}").shape[2:]
                out[f"moe/experts/{p}"] = np.stack([
                    self._float(Tensor(expert_name(i, e, p) + ".weight", _t), want, np.dtype(dtype))
                    for e in range(cfg.n_routed_experts)])
        return out

    def read_globals(self, dtype) -> dict:
        return {k: self._float(t, self._specs[k].shape, np.dtype(dtype)) for k, t in GLOBAL_TABLE.items()}


def is_hf_checkpoint(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "config.json"))


def stack_from(source: HFCheckpoint, shardings=None, dtype=np.float32, split: bool = False):
    """The params of an opened HF checkpoint, read one layer at a time onto ``shardings``; ``split``: per-layer
    buffers instead of stacks (``weights.checkpoint.stack_layers``)."""
    def layer(i, _):   # host arrays; stack_layers places them
        tree = source.read_layer(i, dtype)
        source.reader.release()
        return tree

    return stack_layers(source.config, layer, source.read_globals(dtype), shardings, split)


def load(directory: str, shardings=None, dtype=np.float32):
    """(config, params) of an HF checkpoint directory, float or INT4."""
    source = HFCheckpoint(directory)
    return source.config, stack_from(source, shardings, dtype)
