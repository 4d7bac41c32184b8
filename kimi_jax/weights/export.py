"""kimi_jax params -> an HF checkpoint directory (``export_hf``), through the same name table as the reader.

Writes ``config.json`` (deepseek_v3 fields, or the kimi_k25 wrapper, plus ``quantization_config`` when INT4) and
``model.safetensors`` (or shards + index above ``max_shard_bytes``). Float routed experts become per-expert
``.weight``; INT4 experts become compressed-tensors triplets (``weight_packed`` int32, ``weight_scale`` bf16,
``weight_shape`` int32). ``int4=False, prefix=""`` gives a checkpoint that transformers'
``DeepseekV3ForCausalLM`` loads.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig
from kimi_jax.model.layers import layer_at
from kimi_jax.model.params import param_specs
from kimi_jax.ops.int4_format import Int4Experts, quantize_int4
from kimi_jax.weights.hf import BF16, GLOBAL_TABLE, expert_name, layer_table

K26_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
              "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]


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
    """Write params (stacked or per-layer, ``kimi_jax.load(..., layers=)``) as an HF checkpoint (see the module
    docstring).

    ``dtype``: storage dtype of the float weights (default: as they are; the router bias stays float32).
    ``int4``: routed experts as compressed-tensors triplets (quantised with :func:`kimi_jax.ops.int4_format.quantize_int4`
    when the params hold float experts) or as float per-expert ``.weight`` (dequantised when INT4).
    ``kimi_k25_wrapper``: config.json as K2.5/K2.6 ship it (model_type kimi_k25 with a kimi_k2 text_config).
    """
    os.makedirs(out_dir, exist_ok=True)
    fdt = None if dtype is None else np.dtype(jnp.dtype(dtype))
    w = _ShardWriter(out_dir, max_shard_bytes)
    specs = param_specs(cfg)
    w.add(prefix + GLOBAL_TABLE["embed"].name, _np(params["embed"], fdt))
    for i in range(cfg.num_hidden_layers):
        moe = i >= cfg.first_k_dense_replace
        stack = "moe_layers" if moe else "dense_layers"
        j = i - cfg.first_k_dense_replace if moe else i
        layer = layer_at(params[stack], j)
        for path, t in layer_table(cfg, i).items():
            leaf, spec = layer, specs[stack]
            for k in path.split("/"):
                leaf, spec = leaf[k], spec[k]
            a = _np(leaf, None if spec.dtype else fdt)
            w.add(prefix + t.name, np.ascontiguousarray(t.to_hf(a) if t.to_hf else a))
        if not moe:
            continue
        ex = layer["moe"]["experts"]
        if isinstance(ex, Int4Experts):
            one = Int4Experts(*(np.asarray(getattr(ex, f)) for f in ("w13", "s13", "w2", "s2")))
            if int4:
                ct = one.to_compressed_tensors()
            else:
                deq = one.dequantize()
                fl = {k: np.asarray(v).astype(fdt or np.float32) for k, v in deq.items()}
        else:
            fl = {k: _np(ex[k], fdt) for k in ("gate", "up", "down")}
            if int4:
                ct = {}
                for k in ("gate", "up", "down"):
                    ct[f"{k}_packed"], ct[f"{k}_scale"] = quantize_int4(np.swapaxes(np.asarray(ex[k]), -1, -2))
        for e in range(cfg.n_routed_experts):
            for proj in ("gate", "up", "down"):
                base = prefix + expert_name(i, e, proj)
                if int4:
                    packed, scale = ct[f"{proj}_packed"][e], ct[f"{proj}_scale"][e]
                    logical = (cfg.hidden_size, cfg.moe_intermediate_size) if proj == "down" else \
                        (cfg.moe_intermediate_size, cfg.hidden_size)
                    w.add(base + ".weight_packed", packed.astype(np.int32))
                    w.add(base + ".weight_scale", scale.astype(BF16))
                    w.add(base + ".weight_shape", np.asarray(logical, np.int32))
                else:
                    w.add(base + ".weight", fl[proj][e].T)
    w.add(prefix + GLOBAL_TABLE["final_norm"].name, _np(params["final_norm"], fdt))
    w.add(prefix + GLOBAL_TABLE["lm_head"].name, GLOBAL_TABLE["lm_head"].to_hf(_np(params["lm_head"], fdt)))
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
