"""What each implementation of the tree attention (``api.latent_attention``) takes: ``TREE_ATTENTION``, its
registry entry (``kimi_jax.ops.registry``), whose rules ``api.py`` resolves with and ``mosaic_gpu.py`` checks
direct calls against. Apart from the kernels, so that reading the rules loads no Mosaic GPU."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kimi_jax.ops.registry import Implementation, Lowering, Op, always
from kimi_jax.ops.select import hopper, pick_tiles
from kimi_jax.ops.tree_attention.pallas_triton import MIN_DOT

# Tree widths up to this go through the kernels; wider calls are prefills, which the XLA path serves (the
# Mosaic kernel unrolls its tree blocks, and the per-call ancestor mask grows as t^2 h)
MAX_TREE_TOKENS = 256
MOSAIC_BLOCK = 64           # the Mosaic kernel's block_q = block_k (mosaic_gpu.BLOCK_Q, BLOCK_K)
TMA_TILE_ROWS = 8           # rows of the 16-bit smem tiles Mosaic GPU's TMA copies into
# The Pallas TPU kernel's scalar-prefetched page table lives in SMEM, 1 MiB on all four generations (deviceless
# compiles: 64 rows x 4096 pages overflow it by 2 KiB, "Ran out of memory in memory space smem"); 16 KiB are left
# for the lengths and Mosaic's own scalars. pallas_tpu.py takes it from here.
MAX_TABLE_ENTRIES = (1 << 18) - (1 << 12)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The static facts of a ``latent_attention`` call that the implementations' rules read."""
    batch: int
    tokens: int             # t: new (tree) tokens
    heads: int              # h: heads on the device
    latent: int             # r
    rope: int               # p
    slots: int              # logical cache slots per batch row
    page: int               # page size, 0: a contiguous cache
    dtype: str              # the cache's
    block_q: int | None = None
    block_k: int | None = None
    block_v: int = 256      # the Mosaic kernel's output columns a CTA (mosaic_gpu.Tiles.block_v)
    partitioned: bool = False   # left to XLA's partitioner (a cache split by position, dcp), not in shard_map

    @property
    def rows(self) -> int:
        """The query rows of a batch row: (tree token, head) pairs, one query axis in both kernels."""
        return self.tokens * self.heads


def _pow2_at_least(v: int, lo: int) -> bool:
    return v >= lo and not v & (v - 1)


def pallas_supports(call: AttentionCall, lowering: Lowering) -> str | None:
    if call.tokens > MAX_TREE_TOKENS:
        return f"t={call.tokens} tree tokens is a prefill (kernels take up to {MAX_TREE_TOKENS}); use impl='xla'"
    # deviceless compiles, latent 128-512: register spills on H100 and B200, over the shared memory on the
    # RTX PRO 6000 (tests/test_kernel_shapes.py)
    if why := lowering.refuses_wide(call.dtype, "the Triton kernel takes a 16-bit cache (a 32-bit one spills "
                                                "registers)"):
        return why
    if call.page and not _pow2_at_least(call.page, MIN_DOT):
        return f"the Triton kernel needs a page size that is a power of two >= {MIN_DOT}, got {call.page}"
    for name in ("block_q", "block_k"):
        if (v := getattr(call, name)) is not None and not _pow2_at_least(v, MIN_DOT):
            return f"{name} must be a power of two >= {MIN_DOT}, got {v}"
    return None


def mosaic_supports(call: AttentionCall, lowering: Lowering) -> str | None:
    if lowering.compiles_for_gpu and not hopper(lowering.device_kind):
        return f"the Mosaic GPU tree attention needs wgmma: Hopper (sm_90a), not {lowering.device_kind}"
    if call.tokens > MAX_TREE_TOKENS:
        return f"t={call.tokens} tree tokens is a prefill (kernels take up to {MAX_TREE_TOKENS}); use impl='xla'"
    if jnp.dtype(call.dtype).itemsize != 2:
        return f"the Mosaic GPU kernel runs a 16-bit cache (wgmma), got {call.dtype}"
    dv = min(call.block_v, call.latent)
    if call.rope != 64 or call.latent % 64 or call.latent % dv or dv % 64:
        return (f"the Mosaic GPU kernel needs rope dim 64 and a latent dim that is a multiple of 64 and of "
                f"block_v={dv} (K2: 512 + 64), got {call.latent} + {call.rope}")
    if call.page % MOSAIC_BLOCK:
        return f"the Mosaic GPU kernel needs a page size that is a multiple of {MOSAIC_BLOCK}, got {call.page}"
    if {call.block_q, call.block_k} - {None, MOSAIC_BLOCK}:
        return (f"the Mosaic GPU kernel has block_q = {MOSAIC_BLOCK} and block_k = {MOSAIC_BLOCK}, got "
                f"{call.block_q}, {call.block_k}")
    if lowering.interpret:      # GPU interpret mode runs no TMA
        return None
    # Compiled, a TMA copy from a global array whose tiled dim is longer than a tile needs whole 8-row tiles
    # there (Mosaic GPU's TileTransform without a rounding mode: "dimension 1 must have size smaller or a
    # multiple of its tiling 8"): the queries [b, t*h, r], and a contiguous cache [b, s, r+p] (one shorter than a
    # key block is padded to one)
    if call.rows > TMA_TILE_ROWS and call.rows % TMA_TILE_ROWS:
        return (f"the Mosaic GPU kernel's TMA needs the query rows t*h = {call.tokens}*{call.heads} = {call.rows} "
                f"to be at most {TMA_TILE_ROWS} or a multiple of {TMA_TILE_ROWS}")
    if not call.page and call.slots >= MOSAIC_BLOCK and call.slots % TMA_TILE_ROWS:
        return (f"the Mosaic GPU kernel's TMA needs a contiguous cache of a multiple of {TMA_TILE_ROWS} slots "
                f"(or fewer than {MOSAIC_BLOCK}), got {call.slots}")
    return None


# ---- the Pallas TPU kernel's facts its rules read (pallas_tpu.py takes them from here) -------------------------

@dataclasses.dataclass(frozen=True)
class Tiles:
    """The Pallas TPU kernel's tiles (pallas_tpu.py's module doc: why): key rows a block, the most query rows a block (fewer for small trees) and the prefix splits for one row
    and one query block (module doc: why)."""
    block_k: int
    block_q: int
    num_splits: int = 1


TILES = {
    "": Tiles(block_k=512, block_q=256),                            # an unknown TPU, interpret mode: as v5e
    "TPU v5 lite": Tiles(block_k=512, block_q=256),                 # v5e: 0.82 TB/s, ~240-row ridge
    "TPU v6 lite": Tiles(block_k=1024, block_q=512),                # v6e: 1.64 TB/s, ~560-row ridge
    "TPU v5": Tiles(block_k=1024, block_q=256, num_splits=2),       # v5p: 1.23 TB/s a core, ~190 rows; megacore
    "TPU7x": Tiles(block_k=2048, block_q=512),                      # 3.7 TB/s, ~310 rows; 1 TensorCore a device
}
SUBLANES = 8    # Pallas TPU: a block's second-minor dim is a multiple of 8 or the array's whole dim


def tpu_rules(call: AttentionCall, device_kind: str | None = None) -> str | None:
    """None when the Pallas TPU kernel (``pallas_tpu.py``) takes ``call`` (with the tiles of ``device_kind``, None: the default ones),
    else why not. The block rules are Pallas TPU's (a deviceless compile refuses the rest, pallas_tpu's module doc)."""
    if call.tokens > MAX_TREE_TOKENS:
        return f"t={call.tokens} tree tokens is a prefill (kernels take up to {MAX_TREE_TOKENS}); use impl='xla'"
    if jnp.dtype(call.dtype).itemsize not in (1, 2, 4):
        return f"the TPU kernel reads 8-, 16- or 32-bit cache rows, got {call.dtype}"
    if call.block_q is not None and (call.block_q < SUBLANES or call.block_q % SUBLANES):
        return f"block_q must be a positive multiple of {SUBLANES}, got {call.block_q}"
    block_k = call.block_k or pick_tiles(TILES, device_kind).block_k
    bk = key_block(block_k, call.page, call.slots, bool(call.page))
    if bk % SUBLANES and bk != (call.page or call.slots):
        if call.page:
            return (f"pages of {call.page} slots with block_k={block_k}: a key block (their largest common factor, "
                    f"{bk}) must be a multiple of {SUBLANES} rows or a whole page; use a page size that is a "
                    f"multiple of {SUBLANES} or divides block_k")
        return f"block_k must be a multiple of {SUBLANES} or cover the whole cache ({call.slots} slots), got {bk}"
    if call.page and (entries := call.batch * -(-call.slots // call.page)) > MAX_TABLE_ENTRIES:
        return (f"the page table ({call.batch} rows x {-(-call.slots // call.page)} pages = {entries} entries) must "
                f"fit the kernel's SMEM ({MAX_TABLE_ENTRIES} entries): use larger pages or fewer rows a call")
    return None


def key_block(block_k: int, page: int, slots: int, paged: bool) -> int:
    """Key rows a block: block_k, the whole cache when it is shorter, on a paged cache the largest common
    factor of block_k and the page size (a block never straddles two pages)."""
    return math.gcd(block_k, page) if paged else min(block_k, slots)


def tpu_supports(call: AttentionCall, lowering: Lowering) -> str | None:
    """The Pallas TPU kernel's rules (``tpu_rules``) for the TPU being lowered for."""
    if lowering.platform == "cuda":
        return "the Pallas TPU tree attention runs on TPUs (or in TPU interpret mode)"
    if call.partitioned:
        return ("XLA cannot partition a Mosaic TPU kernel (\"wrap the call in a shard_map\"), and this call is left "
                "to its partitioner: the cache is split by position (dcp)")
    return tpu_rules(call, lowering.device_kind)


TREE_ATTENTION = Op("tree attention", (
    Implementation("mosaic", mosaic_supports,
                   "Hopper (wgmma) when compiled; t <= 256; 16-bit cache; rope 64, latent a multiple of 64 and of "
                   "dv = min(block_v = 256, latent), dv a multiple of 64; pages of a multiple of 64 slots; "
                   "block_q = block_k = 64; compiled (TMA): query rows t*h <= 8 or a multiple of 8, a contiguous cache of < 64 or a multiple of 8 slots"),
    Implementation("tpu", tpu_supports,
                   "any TPU (interpret mode elsewhere); not left to XLA's partitioner (dcp); t <= 256; a cache of "
                   "8-, 16- or 32-bit rows; block_q a "
                   "multiple of 8; key blocks (block_k, the cache when shorter, on a paged cache the largest common "
                   "factor of block_k and the page size) a multiple of 8 rows or the whole cache / page; batch x "
                   f"pages per row <= {MAX_TABLE_ENTRIES} (the page table in SMEM)"),
    Implementation("pallas", pallas_supports,
                   "any GPU (interpret mode elsewhere); t <= 256; compiled: a 16-bit cache; pages of a power of two "
                   ">= 16 slots; block_q, block_k powers of two >= 16"),
    Implementation("xla", always, "every call"),
))
