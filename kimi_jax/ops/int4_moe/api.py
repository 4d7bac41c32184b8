"""Routed-expert SwiGLU over INT4 weights: one entry point over two implementations.

``int4_moe(x, topk_idx, topk_weight, experts)`` returns ``y[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) *
up_e(x_t))`` with ``e = topk_idx[t, j]``, for the experts of one MoE layer in the kernel layout of
``kimi_jax.ops.int4_format.Int4Experts`` (K-major int32 words; nibble ``i`` of word row ``32c + j`` = input
``256c + 32i + j``; bf16 scales ``[K/32, N]``).

impl="xla" (``xla.py``), impl="pallas" (``pallas_triton.py``: Triton kernels), impl="mosaic" (``mosaic_gpu.py``:
TMA + wgmma for Hopper, tcgen05 for B200/B300, 16-bit activations; a program lowered for a GPU, or GPU interpret
mode), impl="tpu" (``pallas_tpu.py``: Pallas TPU grouped matmuls, the weights dequantized in VMEM; a program
lowered for a TPU, or TPU interpret mode), or impl="auto": the first of the target's preference whose rules take the call (``kimi_jax.ops.registry``;
the rules: ``rules.py``). All group the pairs by expert the same way (``routing.py``; the GPU
paths place up to ``PLACE_MAX_PAIRS`` pairs with one Triton kernel, the same placement exactly);
``reference.py`` is the oracle they are tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimi_jax.ops.int4_format import CHUNK, WORD_ROWS, Int4Experts
from kimi_jax.ops.int4_moe.pallas_triton import PALLAS_BLOCK_M, experts_pallas, place
from kimi_jax.ops.int4_moe.routing import combine, default_block_m, gather_rows, sort_by_expert
from kimi_jax.ops.int4_moe.rules import INT4_MOE, MoeCall
from kimi_jax.ops.int4_moe.pallas_tpu import int4_moe_tpu
from kimi_jax.ops.int4_moe.xla import XLA_BLOCK_M, experts_xla
from kimi_jax.ops.select import lowering_tpu



def _check(x, topk_idx, topk_weight, ex: Int4Experts) -> None:
    if ex.w13.ndim != 4 or ex.w2.ndim != 3:
        raise ValueError(f"int4_moe takes one layer's experts (w13 [E, 2, D/8, F]), got w13 {ex.w13.shape}; "
                         "slice the stacked layer axis first, e.g. jax.tree.map(lambda a: a[i], experts)")
    if x.ndim != 2 or x.shape[1] != ex.d_model:
        raise ValueError(f"x must be [T, {ex.d_model}], got {x.shape}")
    if topk_idx.shape != topk_weight.shape or topk_idx.shape[:1] != x.shape[:1] or topk_idx.ndim != 2:
        raise ValueError(f"topk_idx {topk_idx.shape} and topk_weight {topk_weight.shape} "
                         f"must both be [T={x.shape[0]}, k]")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise TypeError(f"topk_idx must be integer, got {topk_idx.dtype}")
    rows_d, rows_f = ex.w13.shape[-2], ex.w2.shape[-2]
    if rows_d % WORD_ROWS or rows_f % WORD_ROWS or {rows_d * 8 - ex.d_model, rows_f * 8 - ex.d_ff} - set(range(CHUNK)):
        raise ValueError(f"expert word rows must come in whole 256-input chunks (w13 {ex.w13.shape}, w2 "
                         f"{ex.w2.shape}); a tensor-parallel shard of F must be a multiple of {CHUNK}")


def int4_moe(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, experts: Int4Experts, *,
             impl: str = "auto", interpret: bool = False, block_m: int | None = None, scale=None) -> jax.Array:
    """Routed experts of one MoE layer: ``x [T, D]``, ``topk_idx [T, k]`` int (valid expert ids),
    ``topk_weight [T, k]`` -> float32 ``[T, D]``. The dots run in ``x.dtype`` with float32 accumulation.
    ``scale`` [D] (the MoE norm's weight): the experts read the rows ``scale * x`` (rounded to ``x.dtype``); the
    GPU kernels multiply the rows they gather (Triton's gate/up kernel, Mosaic GPU's placement kernel), the XLA and
    TPU paths leave the product to XLA's fusions.

    ``impl``: "auto", "xla", "pallas", "mosaic" or "tpu", resolved for the platform the program is lowered for
    (``kimi_jax.ops.registry``; a forced one that does not take the call is an error saying why);
    ``interpret=True`` forces Pallas interpret mode. ``block_m`` overrides the row
    block (a power of two; >= 16 for pallas; 8, 16, 32 or 64 for mosaic).
    """
    _check(x, topk_idx, topk_weight, experts)
    if scale is not None and scale.shape != x.shape[1:]:
        raise ValueError(f"scale must be [{x.shape[1]}], got {scale.shape}")
    experts = jax.tree.map(jnp.asarray, experts)     # numpy leaves (fresh from the loader) cannot be traced-indexed
    scaled = (lambda x: x) if scale is None else (lambda x: scale.astype(x.dtype) * x)

    def mosaic(x, topk_idx, topk_weight, experts, interpret=False):
        # imported here: Mosaic GPU's Python side loads only for programs that lower it
        from kimi_jax.ops.int4_moe.mosaic_gpu import Tiles, int4_moe_mosaic
        return int4_moe_mosaic(x, topk_idx, topk_weight, experts, interpret=interpret, tiles=Tiles(block_m=block_m),
                               scale=None if scale is None else scale.astype(x.dtype))

    def run(x, topk_idx, topk_weight, experts, *, kernel, interpret=False):
        t, k = topk_idx.shape
        lo, hi = PALLAS_BLOCK_M if kernel == "pallas" else XLA_BLOCK_M
        bm = block_m or default_block_m(t * k, experts.num_experts, lo, hi)
        if kernel == "pallas":      # one kernel where XLA runs four (up to PLACE_MAX_PAIRS pairs)
            routing = place(topk_idx, experts.num_experts, bm, interpret)
        else:
            routing = sort_by_expert(topk_idx, experts.num_experts, bm)
        width = experts.w13.shape[-2] * 8
        if kernel == "xla":
            out = experts_xla(gather_rows(scaled(x), routing, k, width), routing.block_expert, experts)
        elif width != x.shape[1]:   # D not whole chunks (small models): one XLA kernel pads the scaled rows
            x = jnp.pad(scaled(x), ((0, 0), (0, width - x.shape[1])))
            out = experts_pallas(x, routing.row_pair, k, routing.block_expert, experts, interpret)
        else:   # the gate/up kernel gathers its rows of x itself, and multiplies them by the scale
            out = experts_pallas(x, routing.row_pair, k, routing.block_expert, experts, interpret,
                                 scale=None if scale is None else scale.astype(x.dtype))
        return combine(out, routing, topk_weight).astype(jnp.float32)

    def tpu(x, topk_idx, topk_weight, experts, interpret=False):
        return int4_moe_tpu(scaled(x), topk_idx, topk_weight, experts, interpret=interpret, block_m=block_m,
                            device_kind=lowering_tpu())

    call = MoeCall(jnp.dtype(x.dtype).name, experts.d_model, experts.d_ff, block_m)
    return INT4_MOE.dispatch(call, (x, topk_idx, topk_weight, experts), impl=impl, interpret=interpret,
                             run={"xla": functools.partial(run, kernel="xla"), "mosaic": mosaic, "tpu": tpu,
                                  "pallas": functools.partial(run, kernel="pallas")})
