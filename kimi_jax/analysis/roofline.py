"""Analytical roofline: bytes, FLOPs and step time of one decode / DDTree round, per device.

Pure Python (no jax). Bracketed tags such as ``[hw-h200]`` refer to entries of docs/sources.md, which name the
public source (or the derivation) of each number.

Model of one round (a verify forward over ``T = width x batch`` tokens, plus an optional DFlash drafter pass)::

    t_component = max(bytes / (eta_bw * BW),  flops / (eta_flop * FLOPS))      per component, per device
    t_step      = sum(t_component) + n_AR * (t_AR + 2 (d-1)/d * msg / link_BW) + overhead
    tokens/s    = tau / t_step                                                   (per sequence)

``t_AR`` is the small-message latency of the all-reduce implementation the program runs (``ALLREDUCE_IMPLS``):
XLA's one-shot kernel, kimi_jax's default compile (``Runtime.one_shot_all_reduce``), or NCCL.

Per-device bytes (bf16 = 2 B, INT4 experts = 0.5 + 2/32 B/param: packed nibbles plus one bf16 scale per 32)::

    attention  = L * (A * r + B / d) * wb        A = q_a + kv_a (+ norms), B = q_b + kv_b + o; r = 1 (replicated,
                                                 the default TP layout, [k26-tp8]) or 1/d (fully sharded)
    kv_cache   = seqs * ctx * L * (kv_lora + rope) * kvb        latent KV, replicated under TP ([k26-bytes]);
                                                 / d under dcp (the cache split by position)
    dense      = L_dense * 3 h I_dense * wb / d
    shared     = L_moe * n_shared * 3 h I_moe * wb / d
    router     = L_moe * (E h + E) * wb * r
    routed     = L_moe * U(T) * 3 h I_moe * eb / d,    U(T) = E (1 - (1 - k/E)^T)   (uniform, [k26-verify-bytes])
    lm_head    = (V h + h) * wb / d
    embedding  = T * h * wb                                      (rows gathered; negligible)

``U(T)`` assumes every token routes independently and uniformly. Draft-tree tokens of one sequence share a
prefix and route alike, so for verify widths ``U(T)`` is an UPPER BOUND on the unique experts ([k26-verify-bytes]).

FLOPs per device: ``2 * params_local * tokens`` for every matmul (routed: ``2 * T * k * 3 h I / d``, not the
unique experts) plus absorbed-MLA attention ``2 * T * heads_local * ctx * (2 kv_lora + rope)`` per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from types import MappingProxyType
from typing import Any, Mapping

from kimi_jax.config import KIMI_K26, ModelConfig
from kimi_jax.decoding.drafter import KIMI_K26_DFLASH

GB = 1e9
MS = 1e-3
US = 1e-6
INT4_BYTES_PER_PARAM = 0.5 + 2 / 32      # packed INT4 + bf16 scale per group of 32 [int4-format]
STRATEGIES = ("tp", "ep", "tp_ep", "dp_attn", "dcp")

# Small-message all-reduce latency across one 8-GPU NVLink node, per implementation. A round's messages are
# T x 7168 x 2 B (14 KB at one token, 244 KB at 17), so the latency, not the link bandwidth, sets their cost.
ALLREDUCE_IMPLS = ("one_shot", "nccl")
NVLINK_ALLREDUCE_S = MappingProxyType({
    "one_shot": 9 * US,     # [allreduce-one-shot]: one-shot class 5.9-16.7 us (512 B-256 KB); kimi_jax's default
    "nccl": 22 * US,        # [allreduce-nccl]: NCCL 20-25 us on 8x H100 (Runtime(one_shot_all_reduce=False))
})


def same_for_every_impl(seconds: float) -> Mapping[str, float]:
    """One latency for every implementation: where no measurement tells them apart (PCIe, TPU ICI)."""
    return MappingProxyType(dict.fromkeys(ALLREDUCE_IMPLS, seconds))


# ---- hardware -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator (per chip). Bandwidths in bytes/s, FLOP/s, seconds, bytes.

    ``efficiency`` is the default fraction of ``mem_bw`` that weight streaming reaches; ``flop_efficiency``
    the fraction of ``bf16_flops`` that compute-bound kernels reach. For the calibrated ``cpu`` profile
    ``mem_bw`` and ``bf16_flops`` hold measured numbers (copy bandwidth, float32 matmul) and both
    efficiencies are 1. ``allreduce_s`` maps each of ``ALLREDUCE_IMPLS`` to its small-message latency.
    """
    name: str
    mem_bw: float                  # spec bandwidth
    measured_bw: float | None      # measured STREAM-copy bandwidth, None where not published
    bf16_flops: float              # dense (no 2:4 sparsity)
    link_bw: float                 # interconnect, per direction per device
    allreduce_s: Mapping[str, float]  # small-message all-reduce latency across the node, per implementation
    mem_capacity: float
    efficiency: float = 0.85       # [bw-efficiency]: weight streaming 85-90% of spec on HBM (use 85%)
    flop_efficiency: float = 0.67  # [flop-efficiency]: FlashMLA compute-bound 660 of 989 TF on H800

    def bw(self, efficiency: float | None = None) -> float:
        return (self.efficiency if efficiency is None else efficiency) * self.mem_bw

    def allreduce(self, impl: str = "one_shot") -> float:
        if impl not in self.allreduce_s:
            raise ValueError(f"unknown all-reduce implementation {impl!r}; choose from {ALLREDUCE_IMPLS}")
        return self.allreduce_s[impl]


PROFILES: dict[str, Hardware] = {
    "rtx_pro_6000": Hardware(
        name="rtx_pro_6000",
        mem_bw=1.792e12,             # [hw-rtx-pro-6000]: 512-bit GDDR7 @ 28 Gbps = 1.792 TB/s
        measured_bw=None,            # [hw-rtx-pro-6000]: no STREAM number found
        bf16_flops=504e12,           # [hw-rtx-pro-6000]: ~504 TF dense BF16 (aggregator); torch GEMM 368-417 TF
        link_bw=64e9,                # [hw-rtx-pro-6000]: PCIe Gen5 x16 only, no NVLink (~64 GB/s per direction)
        allreduce_s=same_for_every_impl(30 * US),  # [allreduce]: none published for PCIe; budget 20-40 us
        mem_capacity=96e9,           # [hw-rtx-pro-6000]: 96 GB GDDR7
        efficiency=0.70,             # [design-measured]: INT4 Marlin MoE measured at 67-73% of peak
    ),
    "h100": Hardware(
        name="h100",
        mem_bw=3.35e12,              # [hw-h100]
        measured_bw=2.90e12,         # [hw-h100]: STREAM copy 2.90 TB/s (87%)
        bf16_flops=989e12,           # [hw-h100]
        link_bw=450e9,               # [hw-h100]: NVLink4 900 GB/s bidirectional
        allreduce_s=NVLINK_ALLREDUCE_S,
        mem_capacity=80e9,           # [hw-h100]
    ),
    "h200": Hardware(
        name="h200",
        mem_bw=4.8e12,               # [hw-h200]
        measured_bw=4.01e12,         # [hw-h200]: STREAM copy 4.01 TB/s (84%)
        bf16_flops=989e12,           # [hw-h200]
        link_bw=450e9,               # [hw-h200]: NVLink4 900 GB/s bidirectional
        allreduce_s=NVLINK_ALLREDUCE_S,  # [k26-roofline]: 123 AR x 9 us = 1.1 ms one-shot
        mem_capacity=141e9,          # [hw-h200]
    ),
    "b200": Hardware(
        name="b200",
        mem_bw=7.67e12,              # [hw-b200]: driver-reported bus 7680 bit x 3996 MHz (not the 8 TB/s mkt figure)
        measured_bw=None,
        bf16_flops=2.25e15,          # [hw-b200]
        link_bw=900e9,               # [hw-b200]: NVLink5 1.8 TB/s bidirectional
        allreduce_s=NVLINK_ALLREDUCE_S,  # assumed as H100/H200 (no B200 number)
        mem_capacity=180e9,          # [hw-b200]: 180 GB usable
    ),
    "b300": Hardware(
        name="b300",
        mem_bw=8.0e12,               # [hw-b300]: 8 TB/s, no correction found
        measured_bw=None,
        bf16_flops=2.25e15,          # [hw-b300] (Tom's HW 5 PF is a sparse figure)
        link_bw=900e9,               # [hw-b300]: NVLink5 1.8 TB/s bidirectional
        allreduce_s=NVLINK_ALLREDUCE_S,  # assumed as H100/H200 (no B300 number)
        mem_capacity=288e9,          # [hw-b300]
    ),
    # TPUs, per chip. No measured copy bandwidth or ICI all-reduce latency was found for any of them: the
    # all-reduce takes the GPUs' one-shot figure as a placeholder until one is measured, for both implementation
    # names (a TPU runs neither NCCL nor XLA's GPU one-shot kernel; its all-reduce goes over ICI).
    "v5e": Hardware(
        name="v5e",
        mem_bw=819e9,                # [hw-tpu]: 819 GB/s HBM2e
        measured_bw=None,
        bf16_flops=197e12,           # [hw-tpu]
        link_bw=200e9,               # [hw-tpu]: ICI 400 GB/s bidirectional per chip
        allreduce_s=same_for_every_impl(9 * US),  # placeholder: no ICI figure found
        mem_capacity=16e9,           # [hw-tpu]
    ),
    "v6e": Hardware(
        name="v6e",
        mem_bw=1638e9,               # [hw-tpu]
        measured_bw=None,
        bf16_flops=918e12,           # [hw-tpu]
        link_bw=400e9,               # [hw-tpu]: ICI 800 GB/s bidirectional per chip
        allreduce_s=same_for_every_impl(9 * US),  # placeholder
        mem_capacity=32e9,           # [hw-tpu]
    ),
    "v5p": Hardware(
        name="v5p",
        mem_bw=2765e9,               # [hw-tpu]: 2 TensorCores a chip, one jax device (megacore)
        measured_bw=None,
        bf16_flops=459e12,           # [hw-tpu]
        link_bw=600e9,               # [hw-tpu]: ICI 1200 GB/s bidirectional per chip
        allreduce_s=same_for_every_impl(9 * US),  # placeholder
        mem_capacity=95e9,           # [hw-tpu]
    ),
    "tpu7x": Hardware(
        name="tpu7x",
        mem_bw=7380e9,               # [hw-tpu]: per chip = 2 jax devices (TensorCores) of half each
        measured_bw=None,
        bf16_flops=2307e12,          # [hw-tpu]
        link_bw=600e9,               # [hw-tpu]: ICI 1200 GB/s bidirectional per chip
        allreduce_s=same_for_every_impl(9 * US),  # placeholder
        mem_capacity=192e9,          # [hw-tpu]
    ),
}
ALIASES = {"rtx": "rtx_pro_6000", "rtx6000": "rtx_pro_6000", "rtx_pro": "rtx_pro_6000", "ironwood": "tpu7x"}


def calibrate_cpu(copy_mb: int = 256, matmul_n: int = 1024, repeats: int = 5) -> Hardware:
    """Measure this machine: numpy copy bandwidth (read + write bytes, as STREAM counts them) and float32
    matmul FLOP/s (``2 n^3`` per product), best of ``repeats``. Returns the ``cpu`` profile (one device)."""
    import numpy as np

    n = copy_mb * 2**20 // 4
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)                                      # touch the pages first
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    bw = 2 * src.nbytes / best

    a = np.random.default_rng(0).standard_normal((matmul_n, matmul_n), dtype=np.float32)
    a @ a
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    flops = 2 * matmul_n**3 / best
    try:
        import os
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        capacity = 0.0
    return Hardware(name="cpu", mem_bw=bw, measured_bw=bw, bf16_flops=flops, link_bw=bw,
                    allreduce_s=same_for_every_impl(0.0), mem_capacity=float(capacity), efficiency=1.0,
                    flop_efficiency=1.0)


def get_profile(name: str) -> Hardware:
    name = ALIASES.get(name.lower(), name.lower())
    if name == "cpu":
        return calibrate_cpu()
    if name not in PROFILES:
        raise ValueError(f"unknown hardware {name!r}; choose from {sorted(PROFILES) + ['cpu']}")
    return PROFILES[name]


# ---- drafter ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """Size of a DFlash drafter (Qwen3-style GQA layers + fc over tapped target features).

    params = layers * (h*H*hd + 2*h*Hkv*hd + H*hd*h + 3*h*I + 2h + 2hd) + n_taps*h_target*h + 2h
    It shares the target's embedding and lm_head; with ``shares_lm_head`` the round reads the lm_head a
    second time for the drafter's ``block_size - 1`` logits.
    """
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    n_taps: int
    target_hidden: int
    block_size: int
    shares_lm_head: bool = True

    @property
    def params(self) -> int:
        h, hd = self.hidden, self.head_dim
        layer = (h * self.heads * hd + 2 * h * self.kv_heads * hd + self.heads * hd * h
                 + 3 * h * self.intermediate + 2 * h + 2 * hd)
        return self.layers * layer + self.n_taps * self.target_hidden * h + 2 * h

    @classmethod
    def from_config(cls, cfg: Any, target_hidden: int | None = None) -> "DrafterSpec":
        """From any object with HF-style drafter fields (hidden_size, num_hidden_layers, ...)."""
        g = lambda *names, default=None: next((getattr(cfg, n) for n in names if hasattr(cfg, n)), default)
        h = g("hidden_size")
        heads = g("num_attention_heads")
        taps = g("target_layer_ids", default=None)
        return cls(layers=g("num_hidden_layers", "num_layers"), hidden=h, heads=heads,
                   kv_heads=g("num_key_value_heads", default=heads), head_dim=g("head_dim", default=h // heads),
                   intermediate=g("intermediate_size"),
                   n_taps=len(taps) if taps is not None else g("n_taps", default=1),
                   target_hidden=target_hidden or g("target_hidden_size", default=h),
                   block_size=g("block_size", default=8))


# The public Kimi DFlash drafter [kimi-dflash], the preset the engine runs (kimi_jax.decoding.drafter).
KIMI_DFLASH = DrafterSpec.from_config(KIMI_K26_DFLASH)


# ---- counting -----------------------------------------------------------------------------------------------

def unique_experts(n_experts: int, k: int, tokens: float) -> float:
    """Expected distinct experts touched by ``tokens`` tokens routed uniformly: ``E (1 - (1 - k/E)^T)``.
    An upper bound for draft-tree tokens of one sequence, which route alike ([k26-verify-bytes])."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens) if tokens > 0 else 0.0


def expected_max_group_experts(n_experts: int, k: int, tokens: float, groups: int) -> float:
    """E[max over ``groups`` expert-parallel groups of the distinct experts touched in that group].

    Each group holds ``n = E/groups`` experts; each expert is touched with ``p = 1 - (1 - k/E)^T``; the
    per-group counts are treated as independent Binomial(n, p):  E[max] = sum_j (1 - F(j-1)^groups).
    (Monte Carlo for E=384, k=8, T=1, 8 groups gives 2.57 ([k26-tp8]); this gives 2.56.)"""
    if groups <= 1:
        return unique_experts(n_experts, k, tokens)
    n = n_experts // groups
    p = 1.0 - (1.0 - k / n_experts) ** tokens
    pmf = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    cdf, total = 0.0, 0.0
    for j in range(1, n + 1):
        cdf += pmf[j - 1]
        total += 1.0 - min(cdf, 1.0) ** groups
    return total


def attention_layer_params(c: ModelConfig) -> tuple[int, int]:
    """(A, B) parameters of one MLA layer: A = q_a + kv_a + the layer's norms (replicated under the default
    TP layout), B = q_b + kv_b + o (split by heads). Kimi: A = 15.15M, B = 85.98M ([k26-bytes]: 101.1M total)."""
    h, H = c.hidden_size, c.num_attention_heads
    a = h * c.q_lora_rank + h * (c.kv_lora_rank + c.qk_rope_head_dim)
    norms = 2 * h + c.q_lora_rank + c.kv_lora_rank
    b = (c.q_lora_rank * H * c.qk_head_dim + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
         + H * c.v_head_dim * h)
    return a + norms, b


def expert_params(c: ModelConfig) -> int:
    """One SwiGLU expert: gate, up, down = 3 h I (Kimi: 44.04M, [k26-bytes])."""
    return 3 * c.hidden_size * c.moe_intermediate_size


def moe_layer_bytes(c: ModelConfig, expert_bytes_per_param: float = INT4_BYTES_PER_PARAM) -> float:
    """All routed experts of one MoE layer (Kimi INT4: 384 x 44.04M x 0.5625 B = 9.51 GB, [design-measured])."""
    return c.n_routed_experts * expert_params(c) * expert_bytes_per_param


def kv_bytes_per_token(c: ModelConfig, kv_dtype_bytes: float = 2) -> float:
    """Latent KV over all layers: L (kv_lora + rope) bytes (Kimi bf16: 70,272 B = 70.3 KB, [k26-bytes])."""
    return c.num_hidden_layers * c.latent_dim * kv_dtype_bytes


def checkpoint_bytes(c: ModelConfig, weight_dtype_bytes: float = 2,
                     expert_bytes_per_param: float = INT4_BYTES_PER_PARAM) -> float:
    """Stored weights: everything at ``weight_dtype_bytes`` except routed experts (Kimi: ~594 GB, [k26-bytes])."""
    from kimi_jax.config import param_count
    routed = c.num_moe_layers * c.n_routed_experts * expert_params(c)
    return (param_count(c) - routed) * weight_dtype_bytes + routed * expert_bytes_per_param


# ---- one round ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    bytes: float      # per device
    flops: float      # per device


def round_components(config: ModelConfig, tokens_per_step: float, context: int = 0, *, batch: int = 1,
                     strategy: str = "tp", devices: int = 1, tp: int | None = None,
                     weight_dtype_bytes: float = 2, expert_bytes_per_param: float = INT4_BYTES_PER_PARAM,
                     kv_dtype_bytes: float | None = None, replicate_small: bool = True,
                     drafter: DrafterSpec | None = None,
                     independent_tokens: float | None = None) -> list[Component]:
    """Per-device bytes and FLOPs of one round, by component (formulas in the module docstring).

    tokens_per_step: tokens in the verify forward, all sequences together (verify width x batch).
    batch: sequences (each reads its own ``context`` of latent KV).
    strategy: ``tp`` (heads and expert intermediate split over ``devices``), ``ep`` (attention TP, experts
      placed E/d per device; the busiest device sets the time), ``tp_ep`` (experts TP over ``tp`` x EP over
      ``devices/tp``; default tp = devices/2), ``dp_attn`` (attention weights replicated, sequences split over
      devices; experts TP).
    replicate_small: the default TP layout (q_a/kv_a and router replicated on every rank, [k26-tp8]); False
      shards them too (the "fully sharded ideal").
    independent_tokens: tokens that route independently, for the unique-expert count (default: all
      ``tokens_per_step``, the uniform upper bound; ``batch`` is the lower bound where every tree token of a
      sequence picks its root's experts).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
    c, d, T = config, devices, float(tokens_per_step)
    wb, eb = weight_dtype_bytes, expert_bytes_per_param
    kvb = wb if kv_dtype_bytes is None else kv_dtype_bytes
    h, L, E, k = c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok
    Lm, Ld = c.num_moe_layers, c.first_k_dense_replace
    r = 1.0 if replicate_small else 1.0 / d

    # attention: weights, latent KV, absorbed-MLA FLOPs (scores over kv_lora+rope, values over kv_lora)
    A, B = attention_layer_params(c)
    if strategy == "dp_attn":
        seqs = math.ceil(batch / d)
        a_frac, b_frac, heads, t_attn = 1.0, 1.0, c.num_attention_heads, T * seqs / batch
    else:
        seqs, a_frac, b_frac, heads, t_attn = batch, r, 1.0 / d, c.num_attention_heads / d, T
    attn_flops = L * (2 * (A * a_frac + B * b_frac) * t_attn
                      + 2 * t_attn * heads * context * (2 * c.kv_lora_rank + c.qk_rope_head_dim))
    # dcp: every device scores all heads over its 1/d of the positions (the same FLOPs as tp's heads / d over
    # all positions) and reads 1/d of the cache
    kv_split = d if strategy == "dcp" else 1
    comps = [Component("attention", L * (A * a_frac + B * b_frac) * wb, attn_flops),
             Component("kv_cache", seqs * context * kv_bytes_per_token(c, kvb) / kv_split, 0.0)]

    dense = 3 * h * c.intermediate_size
    comps.append(Component("dense_mlp", Ld * dense * wb / d, 2 * Ld * dense * T / d))
    shared = c.n_shared_experts * expert_params(c)
    comps.append(Component("shared_experts", Lm * shared * wb / d, 2 * Lm * shared * T / d))
    router = E * h + E
    comps.append(Component("router", Lm * router * wb * r, 2 * Lm * E * h * T * r))

    # routed experts: distinct experts read on the busiest device; FLOPs by T*k (tokens x chosen experts)
    P = expert_params(c)
    Tr = T if independent_tokens is None else float(independent_tokens)
    if strategy == "ep":
        n_local, split = expected_max_group_experts(E, k, Tr, d), 1
        imbalance = n_local / max(unique_experts(E, k, Tr) / d, 1e-30)
    elif strategy == "tp_ep":
        t = tp or max(d // 2, 1)
        if d % t:
            raise ValueError(f"tp={t} does not divide devices={d}")
        n_local, split = expected_max_group_experts(E, k, Tr, d // t), t
        imbalance = n_local / max(unique_experts(E, k, Tr) / (d // t), 1e-30)
    else:
        n_local, split, imbalance = unique_experts(E, k, Tr), d, 1.0
    comps.append(Component("routed_experts", Lm * n_local * P * eb / split,
                           2 * Lm * T * k * P / d * imbalance))

    lm_head = c.vocab_size * h + h                           # + final norm
    comps.append(Component("lm_head", lm_head * wb / d, 2 * c.vocab_size * h * T / d))
    comps.append(Component("embedding", T * h * wb, 0.0))

    if drafter is not None:
        dd = 1 if strategy == "dp_attn" else d
        blk = drafter.block_size * (seqs if strategy == "dp_attn" else batch)
        dbytes = drafter.params * wb / dd
        dflops = 2 * drafter.params * blk / dd
        # drafter feature cache: per context token and layer, K and V of kv_heads x head_dim
        dkv = seqs * context * drafter.layers * 2 * drafter.kv_heads * drafter.head_dim * kvb / dd
        if drafter.shares_lm_head:
            dbytes += c.vocab_size * h * wb / dd
            dflops += 2 * c.vocab_size * h * (drafter.block_size - 1) * batch / dd
        comps.append(Component("drafter", dbytes + dkv, dflops))
    return comps


def n_allreduce(config: ModelConfig, devices: int, drafter: DrafterSpec | None = None) -> int:
    """Small-message all-reduces per round: 2 per layer (after attention, after MLP/MoE) + 1 for the logits
    (Kimi TP8: 2 x 61 + 1 = 123, [allreduce]); the drafter adds 2 per layer + 1. Zero on one device. The same count is
    used for every strategy (EP psum / DP-attention gather+scatter also sync twice per layer)."""
    if devices <= 1:
        return 0
    n = 2 * config.num_hidden_layers + 1
    return n + (2 * drafter.layers + 1 if drafter is not None else 0)


TIME_SPLIT = ("weights", "kv_cache", "flops_over_bytes", "collectives", "overhead")


@dataclasses.dataclass(frozen=True)
class RoundEstimate:
    """A predicted round; ``components`` rows are (name, bytes, flops, t_bytes, t_flops, t = max of both)."""
    profile: str
    components: tuple[tuple[str, float, float, float, float, float], ...]
    n_collectives: int
    t_collectives: float
    overhead_s: float
    total_s: float
    batch: int

    @property
    def bytes(self) -> float:
        return sum(row[1] for row in self.components)

    @property
    def flops(self) -> float:
        return sum(row[2] for row in self.components)

    @property
    def t_compute(self) -> float:
        """Sum of the per-component max(byte time, FLOP time)."""
        return sum(row[5] for row in self.components)

    def component(self, name: str) -> tuple[str, float, float, float, float, float]:
        return next(row for row in self.components if row[0] == name)

    def tokens_per_s(self, tau: float) -> float:
        """Per-sequence decode speed: tau accepted tokens per round (the acceptance length, bonus included)."""
        return tau / self.total_s

    def fixed_share(self) -> float:
        """Share of the round spent neither streaming bytes nor computing: (collectives + overhead) / t."""
        return (self.overhead_s + self.t_collectives) / self.total_s

    def flop_bound(self) -> list[str]:
        """Components whose FLOP time exceeds their byte time."""
        return [r[0] for r in self.components if r[4] > r[3]]

    def time_split(self) -> dict[str, float]:
        """The round's seconds by what sets them (``TIME_SPLIT`` order), summing to ``total_s``: weight bytes
        (every component's byte time but the latent KV's; the drafter's small feature cache rides with its
        weights), latent-KV bytes, FLOP time beyond the bytes of FLOP-bound components (attention scores over
        the context at wide trees), collectives, and the fixed overhead (op tails and host submissions)."""
        return dict(weights=sum(r[3] for r in self.components if r[0] != "kv_cache"),
                    kv_cache=self.component("kv_cache")[3],
                    flops_over_bytes=sum(r[5] - r[3] for r in self.components),
                    collectives=self.t_collectives, overhead=self.overhead_s)

    def to_dict(self) -> dict[str, Any]:
        keys = ("bytes", "flops", "t_bytes_s", "t_flops_s", "t_s")
        return dict(profile=self.profile, components={r[0]: dict(zip(keys, r[1:])) for r in self.components},
                    bytes=self.bytes, n_collectives=self.n_collectives, t_collectives_s=self.t_collectives,
                    overhead_s=self.overhead_s, total_s=self.total_s)


def predict_round_time(config: ModelConfig, profile: Hardware, tokens_per_step: float, context: int = 0, *,
                       batch: int = 1, strategy: str = "tp", devices: int = 1, tp: int | None = None,
                       weight_dtype_bytes: float = 2, expert_bytes_per_param: float = INT4_BYTES_PER_PARAM,
                       kv_dtype_bytes: float | None = None, act_dtype_bytes: float | None = None,
                       replicate_small: bool = True, drafter: DrafterSpec | None = None,
                       efficiency: float | None = None, flop_efficiency: float | None = None,
                       overhead_s: float = 0.0, include_flops: bool = True,
                       independent_tokens: float | None = None, allreduce: str = "one_shot") -> RoundEstimate:
    """Round time on ``devices`` chips of ``profile`` (arguments as in :func:`round_components`).

        t = sum_c max(bytes_c / (eta * BW), flops_c / (eta_f * FLOPS))
            + n_AR * (t_AR + 2 (d-1)/d * T h act_bytes / link_BW) + overhead_s

    ``allreduce`` names the implementation whose latency is ``t_AR`` (one of ``ALLREDUCE_IMPLS``).

    Works for any config, e.g. the tiny float32 model on the calibrated ``cpu`` profile:
    ``predict_round_time(TINY, calibrate_cpu(), 8, 100, weight_dtype_bytes=4, expert_bytes_per_param=4)``.
    """
    comps = round_components(config, tokens_per_step, context, batch=batch, strategy=strategy, devices=devices,
                             tp=tp, weight_dtype_bytes=weight_dtype_bytes,
                             expert_bytes_per_param=expert_bytes_per_param, kv_dtype_bytes=kv_dtype_bytes,
                             replicate_small=replicate_small, drafter=drafter,
                             independent_tokens=independent_tokens)
    bw = profile.bw(efficiency)
    fl = profile.bf16_flops * (profile.flop_efficiency if flop_efficiency is None else flop_efficiency)
    rows = []
    for comp in comps:
        tb = comp.bytes / bw
        tf = comp.flops / fl if include_flops else 0.0
        rows.append((comp.name, comp.bytes, comp.flops, tb, tf, max(tb, tf)))
    n_ar = n_allreduce(config, devices, drafter)
    latency = profile.allreduce(allreduce)
    t_ar = 0.0
    if n_ar:
        ab = weight_dtype_bytes if act_dtype_bytes is None else act_dtype_bytes
        ring = 2 * (devices - 1) / devices / profile.link_bw
        n_target = 2 * config.num_hidden_layers + 1
        t_ar = n_target * (latency + ring * tokens_per_step * config.hidden_size * ab)
        if drafter is not None:
            t_ar += (n_ar - n_target) * (latency + ring * drafter.block_size * batch * drafter.hidden * ab)
    total = sum(r[5] for r in rows) + t_ar + overhead_s
    return RoundEstimate(profile.name, tuple(rows), n_ar, t_ar, overhead_s, total, batch)


# ---- "this design": one dispatch per generate call ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DesignOverhead:
    """Fixed cost per round when the whole round is one compiled program inside a device-side while_loop:
    no host dispatch, no CPU tree build; what is left is each GPU op's launch-free tail (ramp-up, drain, the
    dependency gap between back-to-back kernels) times the number of ops, the host submissions of whatever the
    program leaves outside CUDA graphs, plus collectives (counted by :func:`predict_round_time`).

        overhead = (L * ops_per_layer + L_draft * ops_per_drafter_layer + round_ops) * op_tail_s
                   + host_launches * host_launch_s

    The counts are measured, not assumed: the thunk sequence of the K2.6 TP-8 DDTree round (budget 16, its
    6-layer DFlash drafter) compiled for 8 H200s as kimi_jax compiles it (per-layer weights, graph loops, the
    Mosaic GPU experts and tree attention Hopper gets by default, the latent, queries and SwiGLU Triton kernels),
    bench/results/gpu_overhead_h200.json (2026-12-07, issue 41 part four): 1253 GPU ops = 61 x 18.2 target-layer
    ops (the mean over 1 dense and 60 MoE layers, the round's 9 unscoped ops included; 18 a MoE layer) + 6 x 13
    drafter-layer ops (scopes ``draft/drafter`` and ``commit/drafter``, 80 in all) + 62 round ops (``build_tree``
    38, ``accept`` 9, ``commit`` 15), in one CUDA graph, one host submission. Earlier the same day: 1730 = 61 x
    25.8 + 6 x 15 + 62 (part three), 1871 = 61 x 27.8 + 6 x 18 + 64 (part two). Before issue 41's cuts
    (2026-12-06): 2065 ops = 61 x 29.7 + 6 x 20 + 134, 5 submissions; all-Triton 2005 (28.7 a layer); before the
    router and placement kernels 2508 (36.9), before the attention cuts 2798 (41.4), before the routing cuts 5443
    (85). ``Runtime(split_k=False)`` compiles the same round to 1254 ops (the kernels' GEMMs split K themselves).
    The AR step of one row (1130 ops: 18 a MoE layer as the round's verify, 18.08 a layer over 61 with the
    once-a-step ops; 1250 before the Mosaic gate/up kernel summed its K splits in a cluster, 2026-12-07) is not
    counted separately: width 1 takes the DDTree round's per-layer count. B300 runs the Triton kernels but takes
    the H200 round's counts here: no full-size B300 round has been counted. The per-op tail (2 us under CUDA
    graphs) and the per-submission host cost (5 us) are assumptions: [kernel-overhead] infers 2.5-4 us per launch
    under graphs; no GPU has run them here.
    """
    ops_per_layer: float = 18.2
    ops_per_drafter_layer: int = 13
    round_ops: int = 62
    host_launches: int = 1
    op_tail_s: float = 2 * US
    host_launch_s: float = 5 * US

    def seconds(self, config: ModelConfig, drafter: DrafterSpec | None = None) -> float:
        n = config.num_hidden_layers * self.ops_per_layer
        if drafter is not None:
            n += drafter.layers * self.ops_per_drafter_layer + self.round_ops
        return n * self.op_tail_s + self.host_launches * self.host_launch_s


DESIGN_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DESIGN_TAUS = tuple(range(1, 9))
DESIGN_HARDWARE = ("h200", "b300", "rtx_pro_6000")


def design_projection(hardware=DESIGN_HARDWARE, widths=DESIGN_WIDTHS, *, config: ModelConfig = KIMI_K26,
                      context: int = 4096, devices: int = 8, strategy: str = "tp", batch: int = 1,
                      drafter: DrafterSpec | None = KIMI_DFLASH, correlated_routing: bool = False,
                      overhead: DesignOverhead = DesignOverhead(),
                      allreduce: str = "one_shot") -> dict[str, list[RoundEstimate]]:
    """Round estimates of this design for each hardware and verify width (width 1 = plain AR, no drafter).
    ``correlated_routing`` takes the lower bound on unique experts (a tree's tokens share its root's experts)
    instead of the uniform upper bound; ``allreduce`` names the all-reduce implementation (``ALLREDUCE_IMPLS``)."""
    out = {}
    for hw in hardware:
        prof = hw if isinstance(hw, Hardware) else get_profile(hw)
        rows = []
        for w in widths:
            dr = drafter if w > 1 else None
            rows.append(predict_round_time(config, prof, w * batch, context, batch=batch, strategy=strategy,
                                           devices=devices, drafter=dr, overhead_s=overhead.seconds(config, dr),
                                           independent_tokens=batch if correlated_routing else None,
                                           allreduce=allreduce))
        out[prof.name] = rows
    return out


def projected_costs(hardware: str, widths, context: int = 4096):
    """What the auto policy's cost table (``kimi_jax.decoding.costs``) would hold for full K2.6 + its 6-layer
    DFlash drafter on 8 chips of ``hardware`` (TP-8), from this roofline: seconds per round at each tree width
    (width w verifies w + 1 tokens; width 0 is plain AR), monotone in the width as measured tables are."""
    from kimi_jax.decoding.costs import monotone
    rows = design_projection((hardware,), widths=tuple(w + 1 for w in widths), context=context)
    return monotone([r.total_s for r in next(iter(rows.values()))])


def format_design_table(proj: dict[str, list[RoundEstimate]], widths=DESIGN_WIDTHS, taus=DESIGN_TAUS) -> str:
    """Per hardware: rows = verify width; columns = GB/device, ms of bytes/FLOP work, collectives, kernel
    tails, round time, FLOP-bound components (first one + how many more), tok/s at each tau (blank where
    tau > width: a round accepts at most ``width`` tokens)."""
    short = {"attention": "attn", "routed_experts": "moe", "shared_experts": "shared", "lm_head": "lm",
             "dense_mlp": "dense", "drafter": "draft", "router": "router"}
    lines = []
    for name, rows in proj.items():
        lines.append(f"\n[{name}]")
        head = (f"{'width':>5} {'GB/dev':>7} {'work ms':>8} {'AR ms':>6} {'tail ms':>7} {'round ms':>8} "
                f"{'FLOP-bound':<11}|")
        lines.append(head + "".join(f" {'tau=' + str(t):>7}" for t in taus))
        for w, est in zip(widths, rows):
            fb = [short.get(n, n) for n in est.flop_bound()]
            bound = "-" if not fb else fb[0] + (f"+{len(fb) - 1}" if len(fb) > 1 else "")
            cells = "".join(f" {est.tokens_per_s(t):7.0f}" if t <= w else f" {'':>7}" for t in taus)
            lines.append(f"{w:>5} {est.bytes / GB:7.2f} {est.t_compute / MS:8.2f} {est.t_collectives / MS:6.2f}"
                         f" {est.overhead_s / MS:7.2f} {est.total_s / MS:8.2f} {bound:<11}|{cells}")
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------------------------

def format_round_table(ests: list[RoundEstimate], tau: float) -> str:
    names = [e.profile for e in ests]
    comp_names = [r[0] for r in ests[0].components]
    lines = [f"{'component':<16} {'GB/dev':>8} |" + "".join(f" {n + ' ms':>16}" for n in names)]
    for i, cn in enumerate(comp_names):
        row = ests[0].components[i]
        cells = ""
        for e in ests:
            r = e.components[i]
            cells += f" {r[5] / MS:13.3f} {'F' if r[4] > r[3] else ' '}  "
        lines.append(f"{cn:<16} {row[1] / GB:8.3f} |{cells}")
    lines.append(f"{'sum':<16} {ests[0].bytes / GB:8.3f} |" + "".join(f" {e.t_compute / MS:13.3f}   " for e in ests))
    lines.append(f"{'collectives':<16} {ests[0].n_collectives:>6} x |"
                 + "".join(f" {e.t_collectives / MS:13.3f}   " for e in ests))
    lines.append(f"{'overhead':<16} {'':>8} |" + "".join(f" {e.overhead_s / MS:13.3f}   " for e in ests))
    lines.append(f"{'round':<16} {'':>8} |" + "".join(f" {e.total_s / MS:13.3f}   " for e in ests))
    lines.append(f"{'tok/s (tau=' + format(tau, 'g') + ')':<16} {'':>8} |"
                 + "".join(f" {e.tokens_per_s(tau):13.1f}   " for e in ests))
    lines.append("(F = FLOP-bound component; other rows stream bytes at the profile's efficiency)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_jax.analysis.roofline", description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default=",".join(DESIGN_HARDWARE),
                   help=f"comma list of {sorted(PROFILES)} or cpu (calibrated now)")
    p.add_argument("--tau", type=float, default=4.0, help="acceptance length (tokens per round)")
    p.add_argument("--width", type=int, default=16, help="verify width per sequence (1 = autoregressive)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--strategy", default="tp", choices=STRATEGIES)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--tp", type=int, default=None, help="TP size inside tp_ep (default devices/2)")
    p.add_argument("--efficiency", type=float, default=None, help="bandwidth efficiency (default per profile)")
    p.add_argument("--overhead-ms", type=float, default=None,
                   help="fixed overhead per round (default: this design's kernel tails)")
    p.add_argument("--no-drafter", action="store_true", help="leave out the DFlash drafter")
    p.add_argument("--correlated-routing", action="store_true",
                   help="lower bound on routed bytes: all verify tokens of a sequence use its root's experts")
    p.add_argument("--allreduce", default="one_shot", choices=ALLREDUCE_IMPLS,
                   help="all-reduce implementation whose latency the collectives pay (one_shot: kimi_jax's default "
                        "compile; nccl: Runtime(one_shot_all_reduce=False))")
    p.add_argument("--no-design-table", action="store_true", help="skip the width x tau projection")
    p.add_argument("--json", default=None, help="write the estimates to this file")
    a = p.parse_args(argv)
    try:
        profiles = [get_profile(n.strip()) for n in a.hardware.split(",") if n.strip()]
        if a.width < 1 or a.batch < 1 or a.devices < 1 or a.context < 0:
            raise ValueError("width, batch and devices must be >= 1 and context >= 0")
        c = KIMI_K26
        drafter = None if a.no_drafter or a.width == 1 else KIMI_DFLASH
        ovh = (DesignOverhead().seconds(c, drafter) if a.overhead_ms is None else a.overhead_ms * MS)
        ests = [predict_round_time(c, prof, a.width * a.batch, a.context, batch=a.batch, strategy=a.strategy,
                                   devices=a.devices, tp=a.tp, drafter=drafter, efficiency=a.efficiency,
                                   overhead_s=ovh, independent_tokens=a.batch if a.correlated_routing else None,
                                   allreduce=a.allreduce)
                for prof in profiles]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{c.name}: strategy {a.strategy} x{a.devices}, batch {a.batch}, verify width {a.width}, "
          f"context {a.context}, INT4 experts ({INT4_BYTES_PER_PARAM} B/param), routing "
          f"{'correlated (lower bound)' if a.correlated_routing else 'uniform (upper bound)'}, "
          f"drafter {'DFlash 6L' if drafter else 'none'}, overhead "
          f"{'design kernel tails' if a.overhead_ms is None else str(a.overhead_ms) + ' ms'}, all-reduce "
          f"{a.allreduce}")
    print("efficiency: " + ", ".join(f"{pr.name} {a.efficiency or pr.efficiency:.0%} of "
                                     f"{pr.mem_bw / 1e12:.3g} TB/s" for pr in profiles))
    print(format_round_table(ests, a.tau))
    out: dict[str, Any] = dict(args=vars(a), rounds=[e.to_dict() | {"tokens_per_s": e.tokens_per_s(a.tau)}
                                                     for e in ests])
    if not a.no_design_table:
        proj = design_projection(profiles, context=a.context, devices=a.devices, strategy=a.strategy,
                                 batch=a.batch, drafter=None if a.no_drafter else KIMI_DFLASH,
                                 correlated_routing=a.correlated_routing, allreduce=a.allreduce)
        print(f"\nThis design (one dispatch per generate; overhead = kernel tails + collectives), batch {a.batch}, "
              f"context {a.context}, {a.strategy} x{a.devices}; tok/s per sequence:")
        print(format_design_table(proj))
        out["design"] = {n: [dict(width=w, **e.to_dict()) for w, e in zip(DESIGN_WIDTHS, rows)]
                         for n, rows in proj.items()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
