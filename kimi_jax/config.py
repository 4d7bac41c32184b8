"""Model configuration: read from an HF ``config.json`` or taken from a named preset.

Every field that differs between K2 releases (YaRN factor and betas, rms_norm_eps, eos ids, ...) is read
from the file; nothing release-specific is hard-coded. ``ModelConfig`` is frozen and hashable, so it is
passed to jitted functions as a static argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "kimi_k25")


class ConfigError(ValueError):
    """A config.json that kimi_jax cannot serve, with the reason and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # dense SwiGLU width (layers < first_k_dense_replace)
    moe_intermediate_size: int      # routed and shared expert width
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # YaRN (factor 1.0 means plain RoPE)
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Latent norms (q_a_layernorm, kv_a_layernorm): HF transformers builds them with eps 1e-6 whatever
    # rms_norm_eps says; vLLM passes rms_norm_eps. We follow HF, the numerical reference of the tests.
    latent_norm_eps: float = 1e-6
    # Storage: routed experts as compressed-tensors INT4 (group 32), the K2-Thinking/K2.5/K2.6 format.
    int4_experts: bool = False
    name: str = "custom"

    def __post_init__(self):
        if self.hidden_size <= 0 or self.num_hidden_layers <= 0:
            raise ConfigError("hidden_size and num_hidden_layers must be positive")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace={self.first_k_dense_replace} must lie in "
                              f"[0, num_hidden_layers={self.num_hidden_layers}]")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"n_routed_experts={self.n_routed_experts}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must lie in [1, n_group={self.n_group}]")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: normalised c_kv and the rotated shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 times the YaRN mscale squared (the cos/sin tables stay unscaled)."""
        m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
        return self.qk_head_dim ** -0.5 * m * m

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        # Checkpoints written before the runtime options left the architecture carry moe_impl/attn_impl.
        d = {k: v for k, v in d.items() if k not in LEGACY_RUNTIME_FIELDS}
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    # ---- HF config.json ------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any] | str | os.PathLike, **overrides) -> "ModelConfig":
        """Build from an HF config (dict, config.json path or checkpoint directory)."""
        if not isinstance(hf, dict):
            path = os.fspath(hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise ConfigError(f"no config.json at {path}")
            with open(path) as f:
                hf = json.load(f)
        return cls(**{**_fields_from_hf(hf), **overrides})


LEGACY_RUNTIME_FIELDS = ("moe_impl", "attn_impl")


# The kernel implementations a Runtime (and each op's ``impl=``) may name; what each means, and which one "auto"
# takes for a call, is kimi_jax.ops.registry's. Here because config is the bottom layer: ops import it from here.
IMPLS = ("auto", "xla", "pallas", "mosaic", "tpu")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How a model runs, as opposed to what it is (ModelConfig): kernel choices and the device mesh.

    moe_impl / attn_impl: "auto" (GPU kernels where a program is lowered for a GPU: Mosaic GPU on Hopper for the
    calls its kernels take, Triton otherwise; XLA where it is lowered for a CPU or TPU, and for calls no kernel
    takes), "pallas" (the Triton kernels; interpret mode off the GPU), "xla", or "mosaic" (the Mosaic GPU kernels:
    programs lowered for a Hopper GPU with 16-bit activations and caches), for the INT4 expert matmul (and its
    router) and the tree-verify attention, attn_impl also for the drafter's (kimi_jax.ops.registry decides per
    call and lowering target; a forced implementation that does not take a call is an error saying why).
    mesh: a jax.sharding.Mesh to run on (None: one device); the model's MoE blocks then run in
    shard_map over it with the strategy named by the mesh's axes (kimi_jax.sharding.infer_strategy) unless
    ``strategy`` names one. prefill_chunk: prompts run in chunks of this many tokens, as many as the longest prompt
    needs (a run-time count: one program for every prompt length; attention memory O(chunk x context) instead of
    O(prompt^2)); larger chunks pay on GPUs for long prompts (fewer passes over the weights), smaller ones waste
    less on short prompts. context: the cache slots per row of a ``Model``'s programs, capped at the model's
    context (``kimi_jax.decoding.programs``: one program serves every length up to it). page_size: 0 keeps one contiguous latent cache block per row;
    N > 0 pages the cache in pages of N slots, each row owning only the pages its own length needs
    (kimi_jax.cache; one device only for now). graph_loops: on GPUs, loops and branches become CUDA-graph nodes
    (``compile_options``). split_k: False compiles every GEMM on a GPU without split-K (one kernel where XLA's
    default for decode and verify widths is a partial GEMM plus its reduction; each GEMM then runs on fewer SMs),
    opt-in until a GPU times both (``bench.gpu_check``'s round section does). one_shot_all_reduce: on GPUs, XLA's
    one-shot all-reduce kernel (every device reads its peers' buffers over NVLink and reduces locally: one
    kernel, no NCCL call) where its run-time conditions hold: all devices of the reduction on one host with peer
    access, a message under its size limit (a few hundred KB), a supported type; elsewhere XLA's collective
    thunk falls back to NCCL, so the switch is safe on any mesh (False: NCCL always; docs/roofline.md has the
    latencies each implies). Frozen and hashable, so it travels as a jit static argument.
    """
    moe_impl: str = "auto"
    attn_impl: str = "auto"
    mesh: Any = None
    strategy: str | None = None
    prefill_chunk: int = 64
    context: int = 32768
    page_size: int = 0
    graph_loops: bool = True
    split_k: bool = True
    one_shot_all_reduce: bool = True

    def __post_init__(self):
        if self.moe_impl not in IMPLS or self.attn_impl not in IMPLS:
            raise ConfigError(f"moe_impl/attn_impl must be one of {IMPLS}, got {self.moe_impl}/{self.attn_impl}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.context < 1:
            raise ConfigError(f"context must be >= 1, got {self.context}")
        if self.page_size < 0:      # what each attention implementation takes is its rule (ops.registry)
            raise ConfigError(f"page_size must be 0 (contiguous) or > 0, got {self.page_size}")
        if self.page_size and self.mesh is not None:
            raise ConfigError("a paged cache (page_size > 0) runs on one device for now; use page_size=0 with a mesh")

    def replace(self, **kw) -> "Runtime":
        return dataclasses.replace(self, **kw)


# XLA's default command-buffer (CUDA graph) contents, as jax 0.12's GPU compiler lists them, plus WHILE and
# CONDITIONAL: a loop or branch whose body can be captured becomes a graph node (CUDA >= 12.3 conditional nodes)
# instead of a host-driven thunk that copies its predicate to the host and waits, every iteration.
# docs/gpu_overhead.md has the counts this changes.
GRAPH_LOOPS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,COLLECTIVES_KERNEL,WHILE,CONDITIONAL"


def compile_options(platform: str, rt: Runtime = Runtime()) -> dict:
    """XLA compile options kimi_jax compiles its programs with on ``platform`` ("cuda", "cpu", "tpu"; a jax
    Device's ``platform``)."""
    if platform not in ("cuda", "gpu"):
        return {}
    options = {"xla_gpu_enable_command_buffer": GRAPH_LOOPS} if rt.graph_loops else {}
    if not rt.split_k:      # XLA's Triton GEMMs take split_k = 1 (docs/gpu_overhead.md: -1 kernel per GEMM it split)
        options["xla_gpu_experimental_force_split_k"] = 1
    if rt.one_shot_all_reduce:   # XLA's name for it says "unsupported": a debug option, off by default (Runtime doc)
        options["xla_gpu_unsupported_use_all_reduce_one_shot_kernel"] = True
    return options


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_fields(hf: dict[str, Any], mscale_default: float = 1.0, theta_default: float | None = None) -> dict:
    """The ``rope_*`` fields of an HF config: ``rope_theta`` plus, for YaRN ``rope_scaling`` (or
    ``rope_parameters``), the scaling. Shared by the target and the drafter configs; the defaults say what an
    absent ``mscale`` / ``rope_theta`` means (None: required)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", theta_default))
    if theta is None:
        raise ConfigError("config.json is missing 'rope_theta'")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return {"rope_theta": float(theta)}
    if rope_type != "yarn":
        raise ConfigError(f"rope type {rope_type!r} is not supported (K2 uses yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rope:
            raise ConfigError(f"yarn rope_scaling is missing {key!r}")
    mscale = rope.get("mscale", mscale_default)
    return dict(rope_theta=float(theta), rope_factor=float(rope["factor"]),
                rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                rope_beta_fast=float(rope.get("beta_fast", 32.0)),
                rope_beta_slow=float(rope.get("beta_slow", 1.0)),
                rope_mscale=float(mscale_default if mscale is None else mscale),
                rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    model_type = hf.get("model_type")
    if model_type == "kimi_k25":
        if "text_config" not in hf:
            raise ConfigError("kimi_k25 config has no text_config (the decoder config lives there)")
        hf = hf["text_config"]
        model_type = hf.get("model_type", "kimi_k2")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a Kimi K2 / DeepSeek-V3 decoder; "
                          f"kimi_jax reads model_type in {SUPPORTED_MODEL_TYPES}")

    def need(key):
        if key not in hf or hf[key] is None:
            raise ConfigError(f"config.json is missing {key!r}, which {model_type} models need")
        return hf[key]

    if hf.get("q_lora_rank") is None:
        raise ConfigError("q_lora_rank is null: models without a query LoRA (e.g. Moonlight) are not supported")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError("only the sigmoid / noaux_tc router of DeepSeek-V3 and Kimi K2 is supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (K2 uses silu)")
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (K2 has no biases)")

    rope = rope_fields(hf)

    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    heads = need("num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConfigError("MLA needs num_key_value_heads == num_attention_heads")
    return dict(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"), moe_intermediate_size=need("moe_intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"), first_k_dense_replace=need("first_k_dense_replace"),
        num_attention_heads=heads, q_lora_rank=need("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), n_routed_experts=need("n_routed_experts"),
        num_experts_per_tok=need("num_experts_per_tok"), n_shared_experts=need("n_shared_experts"),
        n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(need("routed_scaling_factor")),
        norm_topk_prob=bool(need("norm_topk_prob")), rms_norm_eps=float(need("rms_norm_eps")),
        max_position_embeddings=need("max_position_embeddings"),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, name=hf.get("_name_or_path") or model_type,
        **rope,
    )


# ---- presets ---------------------------------------------------------------------------------------------

KIMI_K26 = ModelConfig(
    name="kimi-k2.6", vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, first_k_dense_replace=1, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8,
    n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
    rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144, rope_factor=64.0,
    rope_original_max_position_embeddings=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
    bos_token_id=163584, eos_token_ids=(163585, 163586), int4_experts=True,
)

# The same topology at test size: every code path of the full model, small numbers.
TINY = ModelConfig(
    name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4,
    n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
    rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512, rope_factor=64.0,
    rope_original_max_position_embeddings=64, rope_beta_fast=32.0, rope_beta_slow=1.0,
    eos_token_ids=(1,),
)

PRESETS = {
    "kimi-k2.6": KIMI_K26,
    "tiny": TINY,
    "tiny-grouped": TINY.replace(name="tiny-grouped", n_group=4, topk_group=2),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def param_count(config: ModelConfig) -> int:
    """Logical parameters (an INT4 weight counts once per weight; scales are storage, not parameters)."""
    c = config
    h, heads = c.hidden_size, c.num_attention_heads
    attn = (h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
            + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
            + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h)
    norms = 2 * h
    dense = 3 * h * c.intermediate_size
    moe = (c.n_routed_experts * h + c.n_routed_experts
           + (c.n_routed_experts + c.n_shared_experts) * 3 * h * c.moe_intermediate_size)
    layers = c.num_hidden_layers * (attn + norms) + c.first_k_dense_replace * dense + c.num_moe_layers * moe
    return layers + 2 * c.vocab_size * h + h
