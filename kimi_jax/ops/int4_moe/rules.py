"""What each implementation of the INT4 MoE (``api.int4_moe``) takes: ``INT4_MOE``, its registry entry
(``kimi_jax.ops.registry``). Apart from the kernels, so that reading the rules loads no Mosaic GPU."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kimi_jax.ops.int4_moe.pallas_triton import PALLAS_BLOCK_M
from kimi_jax.ops.registry import Implementation, Lowering, Op
from kimi_jax.ops.select import blackwell, hopper

# The Mosaic kernels' facts their rules read (mosaic_gpu.py takes them from here)
WGMMA_M = 64                        # wgmma's M for one warpgroup: the row block, or (swapped) the weight columns
TC_MIN_ROWS = 16                    # tcgen05's row blocks: TMEM columns come in 16s
MOSAIC_BLOCK_M = (8, 16, 32, 64)    # the row blocks the kernels take (tcgen05: from TC_MIN_ROWS)


@dataclasses.dataclass(frozen=True)
class MoeCall:
    """The static facts of an ``int4_moe`` call that the implementations' rules read."""
    dtype: str              # the activations'
    d_model: int
    d_ff: int
    block_m: int | None = None


def _power_of_two_block(call: MoeCall, lo: int) -> str | None:
    bm = call.block_m
    if bm is not None and (bm < lo or bm & (bm - 1)):
        return f"block_m must be a power of two >= {lo}, got {bm}"
    return None


def mosaic_supports(call: MoeCall, lowering: Lowering) -> str | None:
    tcgen05 = lowering.compiles_for_gpu and blackwell(lowering.device_kind)
    if lowering.compiles_for_gpu and not (hopper(lowering.device_kind) or tcgen05):
        return f"the Mosaic GPU MoE needs wgmma (Hopper) or tcgen05 (B200, B300), not {lowering.device_kind}"
    if jnp.dtype(call.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the Mosaic GPU kernels run 16-bit activations (wgmma, tcgen05), got {call.dtype}"
    # output widths in whole CTA tiles in both tilings (mosaic_gpu.takes' doc)
    if call.d_ff % WGMMA_M or call.d_model % (2 * WGMMA_M):
        return (f"the Mosaic GPU kernels need d_ff a multiple of {WGMMA_M} and d_model a multiple of "
                f"{2 * WGMMA_M}, got {call.d_model}, {call.d_ff}")
    blocks = tuple(b for b in MOSAIC_BLOCK_M if b >= TC_MIN_ROWS) if tcgen05 else MOSAIC_BLOCK_M
    if call.block_m is not None and call.block_m not in blocks:
        return f"block_m must be one of {blocks} for the Mosaic GPU kernels here, got {call.block_m}"
    return None


# The Pallas TPU kernel's facts its rules read (pallas_tpu.py takes them from here; its TILES has these kinds)
TPU_KINDS = ("TPU v5 lite", "TPU v6 lite", "TPU v5", "TPU7x")
DEFAULT_KIND = "TPU v5 lite"  # the smallest scoped VMEM (16 MiB): its tiles fit every generation
TPU_BLOCK_M = (16, 256)       # min, max rows per block
LANES = 128                   # a vreg's lanes: output tiles come in multiples of 128 columns
TPU_DTYPES = ("bfloat16", "float32")


def tpu_rules(call: MoeCall, device_kind: str | None) -> str | None:
    """None when ``pallas_tpu.int4_moe_tpu`` takes the call on ``device_kind`` (None: ``DEFAULT_KIND``), else why
    not."""
    if device_kind is not None and device_kind not in TPU_KINDS:
        return f"the Pallas TPU MoE has tiles for {', '.join(TPU_KINDS)}, not {device_kind!r}; use impl='xla'"
    if call.dtype not in TPU_DTYPES:
        return f"the Pallas TPU MoE runs bfloat16 or float32 activations, got {call.dtype}"
    if any(n % LANES and n > LANES for n in (call.d_model, call.d_ff)):
        return (f"the Pallas TPU MoE needs d_model and d_ff to be multiples of {LANES} (the lane width) or at most "
                f"{LANES}, got {call.d_model}, {call.d_ff}; use impl='xla'")
    lo, hi = TPU_BLOCK_M
    bm = call.block_m
    if bm is not None and (bm < lo or bm > hi or bm & (bm - 1)):
        return f"block_m must be a power of two from {lo} to {hi} for the Pallas TPU MoE, got {bm}"
    return None


def tpu_supports(call: MoeCall, lowering: Lowering) -> str | None:
    """The Pallas TPU kernel's rules (``tpu_rules``) for the TPU being lowered for."""
    if lowering.platform == "cuda":
        return "the Pallas TPU MoE runs on TPUs (or in TPU interpret mode)"
    return tpu_rules(call, lowering.device_kind)


INT4_MOE = Op("INT4 MoE", (
    Implementation("mosaic", mosaic_supports,
                   "Hopper (wgmma) or B200/B300 (tcgen05) when compiled; bf16/fp16 activations; d_ff a multiple "
                   "of 64, d_model of 128; block_m 8, 16, 32 or 64 (tcgen05: 16, 32, 64)"),
    Implementation("tpu", tpu_supports,
                   "TPU v5e, v6e, v5p or TPU7x (interpret mode elsewhere); bf16 or float32 activations; d_model and "
                   "d_ff multiples of 128 or at most 128; block_m a power of two from 16 to 256"),
    Implementation("pallas", lambda call, lowering: _power_of_two_block(call, PALLAS_BLOCK_M[0]),
                   "any GPU (interpret mode elsewhere); block_m a power of two >= 16"),
    Implementation("xla", lambda call, lowering: _power_of_two_block(call, 1), "block_m a power of two"),
))
