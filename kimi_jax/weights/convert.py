"""HF K2.x checkpoint -> kimi_jax checkpoint (``python -m kimi_jax.convert``), and kimi_jax params -> HF.

Import (:func:`convert_hf`) reads an HF checkpoint directory in the K2-Thinking / K2.5 / K2.6 layout:
``config.json`` (``kimi_k25`` wrapper with a ``text_config``, or a plain ``deepseek_v3`` / ``kimi_k2`` config),
the ``quantization_config`` (top level or inside ``text_config``; compressed-tensors ``pack-quantized``, 4-bit
symmetric int, group 32) and sharded safetensors with ``model.safetensors.index.json``. Tensor names carry the
``model.`` or ``language_model.model.`` prefix. Whether a module is INT4 is decided per module by the ignore
list, as compressed-tensors does it: ``re:PATTERN`` entries are regexes (``re.match`` on the module name), plain
entries are exact module names. Only routed experts may be INT4; they are read as ``weight_packed`` /
``weight_scale`` / ``weight_shape`` triplets, stacked over experts and repacked into
:class:`kimi_jax.ops.int4_format.Int4Experts` without ever being dequantised. Every tensor's shape and dtype is checked
against the config; an error names the tensor (and the shard when the file itself is bad).

Streaming and resume. Layers are converted one at a time and each is written at once as its own orbax
checkpoint ``OUT/.convert/layer_{i:03d}`` (orbax writes into a temporary directory and renames it, so a
directory under its final name is complete); embedding, final norm and lm_head go to ``OUT/.convert/globals``.
Host memory is bounded by about one layer throughout (~9.5 GB for K2.6: 384 x 3 INT4 matrices plus the bf16
attention). A rerun after a crash or kill skips every layer whose directory exists, so the final result is
identical to an uninterrupted run.

Output: the *layered* kimi_jax checkpoint form (:mod:`kimi_jax.weights.checkpoint`): when every layer is done, the
per-layer directories are moved (atomic renames, no copy, nothing read back) to ``OUT/layers/layer_{i:03d}`` and
``OUT/globals``, then ``OUT/kimi_config.json`` is written last (atomically), so a directory with
``kimi_config.json`` is complete; ``.convert`` is then removed. A kill during the moves resumes too (a layer is
done when it is in either place). :func:`kimi_jax.weights.checkpoint.restore` reads the layered form one layer at a time
(with per-device shardings) and stacks the layers on device: no step needs the whole model in host memory.

Export (:func:`export_hf`) writes params back as an HF checkpoint: ``config.json`` (deepseek_v3 fields, or the
kimi_k25 wrapper, plus ``quantization_config`` when INT4) and ``model.safetensors`` (or shards + index above
``max_shard_bytes``). Float routed experts become per-expert ``.weight``; INT4 experts become compressed-tensors
triplets (``weight_packed`` int32, ``weight_scale`` bf16, ``weight_shape`` int32). ``int4=False, prefix=""``
gives a checkpoint that transformers' ``DeepseekV3ForCausalLM`` loads.
"""

from __future__ import annotations

import gc
import json
import os
import re
import resource
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kimi_jax.config import ConfigError, ModelConfig
from kimi_jax.model.params import param_specs
from kimi_jax.ops.int4_format import GROUP_SIZE, Int4Experts, quantize_int4
from kimi_jax.weights import checkpoint as ckpt
from kimi_jax.weights.checkpoint import CheckpointError, SafetensorsReader

WORK_DIR = ".convert"
BF16 = ml_dtypes.bfloat16
FLOAT_DTYPES = (np.dtype(BF16), np.dtype(np.float16), np.dtype(np.float32))

K26_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
              "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]


# ---- quantization_config ---------------------------------------------------------------------------------

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


# ---- reading one layer -----------------------------------------------------------------------------------

class _Counter:
    """Counts bytes read, and closes the reader's shards every ``RELEASE_BYTES`` (see SafetensorsReader.close):
    keeping every shard mapped would grow RSS by the whole checkpoint."""

    RELEASE_BYTES = 256 << 20

    def __init__(self, reader: SafetensorsReader):
        self.reader, self.bytes, self._mapped = reader, 0, 0

    def get(self, name: str) -> np.ndarray:
        a = self.reader.get(name)
        self.bytes += a.nbytes
        self._mapped += a.nbytes
        if self._mapped >= self.RELEASE_BYTES:
            self.release()
        return a

    def release(self) -> None:
        self.reader.close()
        self._mapped = 0


def _release_memory(src: _Counter) -> None:
    """Between layers: unmap the shards, collect, and hand freed heap back to the OS (glibc), so the next layer
    starts from the baseline instead of on top of the previous one's freed-but-kept pages."""
    src.release()
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _float_tensor(src: _Counter, name: str, convert, want_shape, dtype) -> np.ndarray:
    full = src.reader.prefix + name
    a = src.get(name)
    if a.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {full!r} has dtype {a.dtype}; expected bfloat16 (or float16/float32)")
    try:
        w = convert(a) if convert else a
        ckpt._check_shape(full, w.shape, want_shape)
    except (CheckpointError, ValueError):
        raise CheckpointError(f"tensor {full!r} has shape {tuple(a.shape)} (HF layout) which does not match the "
                              f"config (our layout {tuple(want_shape)}); the checkpoint and config.json disagree"
                              ) from None
    return np.ascontiguousarray(w, dtype=dtype)  # one copy (none when already contiguous in that dtype)


def _expert_triplet(src: _Counter, cfg: ModelConfig, i: int, e: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """Expert e's (weight_packed, weight_scale), checked (with weight_shape) against the config."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    n, k = (d, f) if proj == "down" else (f, d)
    base = ckpt._expert_name(cfg, i, e, proj)
    full = src.reader.prefix + base
    p = src.get(base + ".weight_packed")
    s = src.get(base + ".weight_scale")
    shp = src.get(base + ".weight_shape")
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
        raise CheckpointError(f"tensor {full}.weight_shape is {shp.tolist()} ({shp.dtype}); expected int32/int64 "
                              f"{[n, k]}, the logical shape the config implies")
    return p, s


def _experts_int4(src: _Counter, cfg: ModelConfig, i: int, q: dict | None) -> bool:
    """Whether layer i's routed experts are INT4, decided module by module from the ignore list; all agree."""
    if q is None:
        return False
    ignore = q.get("ignore") or []
    kinds = set()
    for e in range(cfg.n_routed_experts):
        for proj in ("gate", "up", "down"):
            base = ckpt._expert_name(cfg, i, e, proj)
            kinds.add(not (is_ignored(src.reader.prefix + base, ignore) or is_ignored(base, ignore)))
    if len(kinds) > 1:
        raise CheckpointError(f"layer {i}: the quantization ignore list makes some routed experts INT4 and others "
                              "float; kimi_jax needs all routed experts in one format")
    return kinds.pop()


def _check_not_quantized(src: _Counter, cfg: ModelConfig, i: int, moe: bool, q: dict | None):
    if q is None:
        return
    ignore = q.get("ignore") or []
    for _, (name, _) in ckpt._layer_tensors(cfg, i, moe).items():
        if not name.endswith("_proj.weight"):
            continue
        module = name[: -len(".weight")]
        if not (is_ignored(src.reader.prefix + module, ignore) or is_ignored(module, ignore)):
            raise CheckpointError(f"module {src.reader.prefix + module!r} is INT4 by quantization_config (not in its "
                                  "ignore list); kimi_jax supports INT4 only for routed experts")


def read_layer(src: _Counter, cfg: ModelConfig, i: int, q: dict | None, dtype) -> dict:
    """Layer i as a nested dict in our layout (no leading layer axis); INT4 experts as {w13, s13, w2, s2}."""
    moe = i >= cfg.first_k_dense_replace
    spec = param_specs(cfg)["moe_layers" if moe else "dense_layers"]
    _check_not_quantized(src, cfg, i, moe, q)
    out: dict = {}
    for path, (name, convert) in ckpt._layer_tensors(cfg, i, moe).items():
        s = ckpt._spec_at(spec, path)
        w = _float_tensor(src, name, convert, s.shape[1:], np.dtype(s.dtype or dtype))
        node = out
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = w
    if moe:
        if cfg.int4_experts:
            # Repacked one expert at a time into preallocated stacked arrays: the unpacked nibbles of all experts
            # at once would be several times the layer's size.
            ex: dict = {}
            for e in range(cfg.n_routed_experts):
                arrays = []
                for proj in ("gate", "up", "down"):
                    arrays += _expert_triplet(src, cfg, i, e, proj)
                try:
                    one = Int4Experts.from_compressed_tensors(*arrays)
                except (ValueError, TypeError) as err:
                    raise CheckpointError(f"layer {i} routed expert {e}: {err}") from err
                for fld in ("w13", "s13", "w2", "s2"):
                    a = np.asarray(getattr(one, fld))
                    if fld not in ex:
                        ex[fld] = np.empty((cfg.n_routed_experts, *a.shape), a.dtype)
                    ex[fld][e] = a
                del arrays, one
            out["moe"]["experts"] = ex
        else:
            exp = {}
            for proj in ("gate", "up", "down"):
                ws = [_float_tensor(src, ckpt._expert_name(cfg, i, e, proj) + ".weight", lambda w: w.T,
                                    ckpt._spec_at(spec, f"moe/experts/{proj}").shape[2:], np.dtype(dtype))
                      for e in range(cfg.n_routed_experts)]
                exp[proj] = np.stack(ws)
            out["moe"]["experts"] = exp
    return out


def read_globals(src: _Counter, cfg: ModelConfig, dtype) -> dict:
    specs = param_specs(cfg)
    return {ours: _float_tensor(src, name, conv, specs[ours].shape, np.dtype(dtype))
            for ours, name, conv in (("embed", "model.embed_tokens.weight", None),
                                     ("final_norm", "model.norm.weight", None),
                                     ("lm_head", "lm_head.weight", lambda w: w.T))}


# ---- orbax per-layer directories -------------------------------------------------------------------------

def _save_tree(path: str, tree) -> None:
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
        ckptr.wait_until_finished()


def _restore_tree(path: str) -> dict:
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path).item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta)
        tree = ckptr.restore(path, target)
    return jax.tree.map(np.asarray, tree)


def _clean_tmp(work: str) -> None:
    for name in os.listdir(work):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)


# ---- convert ---------------------------------------------------------------------------------------------

def convert_hf(hf_dir: str, out_dir: str, progress: bool = True, dtype=jnp.bfloat16, on_layer_written=None) -> dict:
    """Convert an HF K2.x checkpoint directory into a layered kimi_jax checkpoint at ``out_dir``; resumable.

    ``dtype`` is the storage dtype of the non-expert float weights (bfloat16 or float32; the router bias stays
    float32). ``on_layer_written(i)`` is called after layer i's directory is complete (tests use it to simulate a
    kill). Returns stats: bytes read, seconds, MB/s, peak RSS (MiB), layers converted / skipped.
    """
    t0 = time.perf_counter()
    dtype = np.dtype(jnp.dtype(dtype))
    if dtype not in (np.dtype(BF16), np.dtype(np.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    hf = read_hf_config(hf_dir)
    q = quantization_config(hf)
    cfg = ModelConfig.from_hf(hf)
    reader = SafetensorsReader(hf_dir)
    src = _Counter(reader)
    if cfg.num_moe_layers:
        cfg = cfg.replace(int4_experts=_experts_int4(src, cfg, cfg.first_k_dense_replace, q))

    out_dir = os.path.abspath(out_dir)
    work = os.path.join(out_dir, WORK_DIR)
    if ckpt.is_kimi_checkpoint(out_dir):
        if os.path.isdir(work):  # killed after the final save but before the clean-up
            shutil.rmtree(work)
            return {"bytes": 0, "seconds": time.perf_counter() - t0, "mb_per_s": 0.0,
                    "peak_rss_mib": _peak_rss_mib(), "converted": 0, "skipped": cfg.num_hidden_layers}
        raise CheckpointError(f"{out_dir} already holds a kimi_jax checkpoint; choose another --out or remove it")
    os.makedirs(work, exist_ok=True)
    _clean_tmp(work)
    source = {"config": cfg.to_dict(), "dtype": dtype.name, "hf_dir": os.path.abspath(hf_dir)}
    src_file = os.path.join(work, "source.json")
    if os.path.exists(src_file):
        with open(src_file) as f:
            prev = json.load(f)
        if prev != source:
            raise CheckpointError(f"{work} holds a partial conversion of another checkpoint/config/dtype "
                                  f"({prev.get('hf_dir')}, {prev.get('dtype')}); remove it to start over")
    else:
        with open(src_file + ".tmp", "w") as f:
            json.dump(source, f, indent=1)
        os.replace(src_file + ".tmp", src_file)

    converted = skipped = 0
    layers = range(cfg.num_hidden_layers)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.num_hidden_layers + 1, desc="convert", unit="layer", file=sys.stderr)
    for i in layers:
        target = os.path.join(work, f"layer_{i:03d}")
        if os.path.isdir(target) or os.path.isdir(ckpt.layer_dir(out_dir, i)):  # done (maybe already moved)
            skipped += 1
        else:
            tree = read_layer(src, cfg, i, q, dtype)
            _save_tree(target, tree)
            del tree
            _release_memory(src)
            converted += 1
            if on_layer_written is not None:
                on_layer_written(i)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(MBps=f"{src.bytes / 1e6 / max(time.perf_counter() - t0, 1e-9):.1f}")
    target = os.path.join(work, ckpt.GLOBALS_DIR)
    if not os.path.isdir(target) and not os.path.isdir(os.path.join(out_dir, ckpt.GLOBALS_DIR)):
        _save_tree(target, read_globals(src, cfg, dtype))
        _release_memory(src)
    if bar is not None:
        bar.update(1)
        bar.close()

    finalize(cfg, out_dir)
    dt = time.perf_counter() - t0
    return {"bytes": src.bytes, "seconds": dt, "mb_per_s": src.bytes / 1e6 / max(dt, 1e-9),
            "peak_rss_mib": _peak_rss_mib(), "converted": converted, "skipped": skipped, "config": cfg}


def finalize(cfg: ModelConfig, out_dir: str) -> None:
    """``.convert`` -> the layered checkpoint: atomic directory renames, then ``kimi_config.json`` (atomic),
    then ``.convert`` is removed. Nothing is read back; safe to rerun after a kill at any point."""
    work = os.path.join(out_dir, WORK_DIR)
    os.makedirs(os.path.join(out_dir, ckpt.LAYERS_DIR), exist_ok=True)
    moves = [(os.path.join(work, f"layer_{i:03d}"), ckpt.layer_dir(out_dir, i)) for i in range(cfg.num_hidden_layers)]
    moves.append((os.path.join(work, ckpt.GLOBALS_DIR), os.path.join(out_dir, ckpt.GLOBALS_DIR)))
    for src, dst in moves:
        if os.path.isdir(src):
            if os.path.exists(dst):
                raise CheckpointError(f"{dst} already exists; remove it (or {out_dir}) to convert again")
            os.rename(src, dst)
        elif not os.path.isdir(dst):
            raise CheckpointError(f"{src} is missing; the conversion is incomplete")
    tmp = os.path.join(out_dir, ckpt.CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    os.replace(tmp, os.path.join(out_dir, ckpt.CONFIG_FILE))
    shutil.rmtree(work)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# ---- export ----------------------------------------------------------------------------------------------

def hf_config_dict(cfg: ModelConfig, dtype_name: str = "bfloat16") -> dict:
    """deepseek_v3 config.json fields for ``cfg`` (what transformers' DeepseekV3Config reads)."""
    rope = None
    if cfg.rope_factor != 1.0:
        rope = {"type": "yarn", "rope_type": "yarn", "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position_embeddings,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "first_k_dense_replace": cfg.first_k_dense_replace, "moe_layer_freq": 1,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_head_dim": cfg.qk_head_dim, "head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": rope,
        "rope_interleave": True, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "torch_dtype": dtype_name,
        "initializer_range": 0.02, "use_cache": True,
    }


def int4_quantization_config(ignore=None) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "kv_cache_scheme": None, "ignore": list(K26_IGNORE if ignore is None else ignore),
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                        "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                        "observer_kwargs": {}}}},
    }


class _ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_bytes`` (one tensor may exceed it alone)."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, a: np.ndarray):
        a = np.ascontiguousarray(a)
        if self.pending and self.pending_bytes + a.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = a
        self.pending_bytes += a.nbytes
        self.total += a.nbytes

    def flush(self):
        if not self.pending:
            return
        from safetensors.numpy import save_file
        save_file(self.pending, os.path.join(self.out_dir, f".shard{len(self.shards):05d}.tmp"),
                  metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self):
        self.flush()
        n = len(self.shards)
        if n == 1:
            os.replace(os.path.join(self.out_dir, ".shard00000.tmp"), os.path.join(self.out_dir, "model.safetensors"))
            return
        weight_map = {}
        for s, names in enumerate(self.shards):
            fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f".shard{s:05d}.tmp"), os.path.join(self.out_dir, fname))
            weight_map.update({k: fname for k in names})
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=1)


def _np(a, dtype=None) -> np.ndarray:
    a = np.asarray(a)
    return a if dtype is None else a.astype(dtype)


def export_hf(params, cfg: ModelConfig, out_dir: str, int4: bool = True, prefix: str = "language_model.",
              dtype=None, max_shard_bytes: int = 5 * 2**30, kimi_k25_wrapper: bool = False,
              ignore: list[str] | None = None) -> None:
    """Write params as an HF checkpoint (see the module docstring).

    ``dtype``: storage dtype of the float weights (default: as they are; the router bias stays float32).
    ``int4``: routed experts as compressed-tensors triplets (quantised with :func:`kimi_jax.ops.int4_format.quantize_int4`
    when the params hold float experts) or as float per-expert ``.weight`` (dequantised when INT4).
    ``kimi_k25_wrapper``: config.json as K2.5/K2.6 ship it (model_type kimi_k25 with a kimi_k2 text_config).
    """
    os.makedirs(out_dir, exist_ok=True)
    fdt = None if dtype is None else np.dtype(jnp.dtype(dtype))
    w = _ShardWriter(out_dir, max_shard_bytes)
    specs = param_specs(cfg)
    h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def to_hf(path, a):  # our layout (one layer) -> HF [out, in]
        if path in ("attn/q_b", "attn/kv_b"):
            return a.reshape(a.shape[0], -1).T
        if path == "attn/o":
            return a.reshape(-1, a.shape[-1]).T
        return a.T if a.ndim == 2 else a

    w.add(prefix + "model.embed_tokens.weight", _np(params["embed"], fdt))
    for i in range(cfg.num_hidden_layers):
        moe = i >= cfg.first_k_dense_replace
        stack = "moe_layers" if moe else "dense_layers"
        j = i - cfg.first_k_dense_replace if moe else i
        for path, (name, _) in ckpt._layer_tensors(cfg, i, moe).items():
            leaf = params[stack]
            for k in path.split("/"):
                leaf = leaf[k]
            spec = ckpt._spec_at(specs[stack], path)
            a = _np(leaf[j], None if spec.dtype else fdt)
            w.add(prefix + name, np.ascontiguousarray(to_hf(path, a)))
        if not moe:
            continue
        ex = params[stack]["moe"]["experts"]
        if isinstance(ex, Int4Experts):
            one = Int4Experts(*(np.asarray(getattr(ex, f)[j]) for f in ("w13", "s13", "w2", "s2")))
            if int4:
                ct = one.to_compressed_tensors()
            else:
                deq = one.dequantize()
                fl = {k: np.asarray(v).astype(fdt or np.float32) for k, v in deq.items()}
        else:
            fl = {k: _np(ex[k][j], fdt) for k in ("gate", "up", "down")}
            if int4:
                ct = {}
                for k in ("gate", "up", "down"):
                    ct[f"{k}_packed"], ct[f"{k}_scale"] = quantize_int4(np.swapaxes(np.asarray(ex[k][j]), -1, -2))
        for e in range(cfg.n_routed_experts):
            for proj in ("gate", "up", "down"):
                base = prefix + ckpt._expert_name(cfg, i, e, proj)
                if int4:
                    packed, scale = ct[f"{proj}_packed"][e], ct[f"{proj}_scale"][e]
                    logical = (cfg.hidden_size, cfg.moe_intermediate_size) if proj == "down" else \
                        (cfg.moe_intermediate_size, cfg.hidden_size)
                    w.add(base + ".weight_packed", packed.astype(np.int32))
                    w.add(base + ".weight_scale", scale.astype(BF16))
                    w.add(base + ".weight_shape", np.asarray(logical, np.int32))
                else:
                    w.add(base + ".weight", fl[proj][e].T)
    w.add(prefix + "model.norm.weight", _np(params["final_norm"], fdt))
    w.add(prefix + "lm_head.weight", _np(params["lm_head"], fdt).T)
    w.close()

    dtype_name = (fdt or np.asarray(params["embed"]).dtype).name
    text = hf_config_dict(cfg, dtype_name)
    if kimi_k25_wrapper:
        text = {**text, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
        conf = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": text, "torch_dtype": dtype_name}
    else:
        conf = text
    if int4:
        conf["quantization_config"] = int4_quantization_config(ignore)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
