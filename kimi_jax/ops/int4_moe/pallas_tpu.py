"""The INT4 routed experts as two grouped Pallas TPU (Mosaic TPU) kernels, megablox-style.

``int4_moe_tpu(x, topk_idx, topk_weight, experts)`` computes ``y[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) *
up_e(x_t))``, ``e = topk_idx[t, j]``, over the kernel layout of ``kimi_jax.ops.int4_format.Int4Experts``
(K-major int32 words, nibble ``i`` of word row ``32c + j`` = input ``256c + 32i + j`` stored as ``u = q + 8``;
bf16 scales ``[K/32, N]``; w13 ``[E, 2, Dp/8, F]``, w2 ``[E, Fp/8, D]``).

The pairs are grouped as every other path groups them (``routing.sort_by_expert``: row block ``b`` of ``bm``
rows belongs to expert ``block_expert[b]``, unused trailing blocks carry -1) and their rows gathered
(``routing.gather_rows``). Then

1. gate/up: grid ``(F / bn, nb, Dp / bk)``. ``block_expert`` is a scalar-prefetch operand, so the BlockSpec
   index maps pick the block's expert's ``[2, bk/8, bn]`` word tile and ``[2, bk/32, bn]`` scale tile and the
   pipeline DMAs only the touched experts' tiles. Each step unpacks the words in VMEM (one xor for the word, then
   per nibble a shift left and an arithmetic shift right give ``q`` sign-extended, see ``_dequantize``), scales
   each 32-row group by its bf16 scale row and stores the ``[bk, bn]`` tile in natural input order into a VMEM
   scratch in the activation dtype; one ``[bm, bk] x [bk, bn]`` MXU dot per half (float32 accumulation in a VMEM
   scratch) follows. K is the last, "arbitrary" grid axis; its last step writes ``h = silu(g) * u``.
2. down: the same over ``h [rows, Fp]`` and w2, grid ``(D / bn, nb, Fp / bk)``, float32 rows out.

Then ``routing.combine`` gathers each pair's row and sums a token's ``k`` rows with its weights.

Unused blocks (``b >= used``) compute nothing and move nothing: their index maps repeat the last used block's
tiles (the pipeline skips a copy whose block index did not change) and send their output to one extra row block
past the used ones (written once per column tile, never read; pointing them at the last used block instead would
need that block's output to stay resident, and races where two cores hold it).

The weight tile is dequantized before the dot rather than the partial sums scaled per group (what the Triton
kernel does): per-group dots would be ``[bm, 32] x [32, bn]``, 1/4 to 1/8 of the MXU's depth. The dequantized
weights are rounded to the activation dtype, as the XLA path rounds them (``xla.experts_xla``).

Grid order ``(column tile, row block, K tile)``, semantics ("parallel", "arbitrary", "arbitrary"): the unused
blocks' shared sink must be visited in consecutive steps, which a "parallel" block axis does not promise (Pallas'
TPU interpreter runs parallel axes in a shuffled order and rejected the first version, grid ``(nb, N/bn, K/bk)``
with the block axis parallel, with "Revisited block ... of output 0"). Megacore (v5p) therefore splits column
tiles; tpu7x shows each TensorCore as its own device, v5e and v6e have one.

Tiles (``TILES``, by ``jax.Device.device_kind``; ``tile_shape``). Nothing here has run on a TPU yet: the budgets
below are libtpu's own accounting (the smallest ``vmem_limit_bytes`` at which the two kernels compile,
deviceless, 2026-12-06), not timings.
- A grid step streams one ``[bk, bn]`` weight tile (two for gate/up) and pays ~0.35 us of pipeline overhead, so
  each kernel gets ``area = bk * bn = 2^20`` weights per step (512 KiB of words per matrix: 0.64 us of v5e's
  819 GB/s, 0.32 us of v6e's 1.6 TB/s; gate/up streams two): bn up to ``block_n``, bk filling the area in
  multiples of 256 inputs (one chunk of the layout; the K tiles must divide the padded K, whose chunks come in
  256s); where bk is the whole K (down under TP-8, K = F = 256) bn widens instead. K2.6 (D = 7168) at TP-8
  (F = 256): gate/up (bk, bn) = (3584, 256), down (256, 3584); at EP (F = 2048): gate/up (3584, 256) on v5e and
  (1792, 512) on v6e and tpu7x, down (2048, 512); v5p below.
- ``block_n`` 256 on v5e ("TPU v5 lite": 128x128 MXUs, 16 MiB scoped VMEM by default), 512 on v6e ("TPU v6
  lite": 256x256 MXU, 32 MiB) and tpu7x ("TPU7x", 64 MiB VMEM per core): 1-2 KiB contiguous per word row DMA'd,
  a multiple of the MXU's width. 128 on v5p ("TPU v5", 32 MiB): megacore splits the column tiles between its two
  TensorCores, and at TP-8 gate/up has F = 256 columns: two 128-column tiles (bk then the whole 7168) keep both
  cores streaming, where one 256-column tile would leave one core idle through gate/up.
- VMEM at K2.6 shapes (bf16, libtpu's figure, max of the two kernels, 16-row / 256-row blocks): v5e 4.3 / 9.9
  MiB, v6e 2.3 / 8.3, v5p 4.2 / 11.3, tpu7x 2.3 / 8.3. All under the default scoped limits, so no
  ``vmem_limit_bytes`` is set. v5e/v5p need ~2x v6e's: no bf16 VPU there, the dequantization's temporaries are
  float32. (The per-step sum of the double-buffered blocks and scratch: gate/up ``2 * (bm*bk*a + 2*bk/8*bn*4 +
  2*bk/32*bn*2 + bm*bn*a) + 2*bm*bn*4 + bk*bn*a``, ``a`` = activation bytes; down likewise with one matrix,
  float32 out.)
- The Mosaic TPU (8, 128) rule: every block's last two dims are multiples of (8, 128) or the whole dim. bn is a
  multiple of 128 or the whole N (``rules.tpu_rules`` refuses N above 128 that is not a multiple of 128, which would
  make one unbounded tile); bk / 8 word rows are multiples of 32. The bf16 scale tile has bk / 32 rows, e.g. 56
  at bk = 1792 or 8 at bk = 256: not a multiple of bf16's 16-row packing, and libtpu took it for every target.
- The row block ``bm`` (``TPU_BLOCK_M``): a power of two from 16 (bf16 packs 16 rows per sublane tile) to 256
  (bounding the x and out blocks in VMEM), near the mean rows per touched expert (``routing.default_block_m``).

libtpu rejected nothing of the kernel code itself at these shapes; what it did reject is an undersized scoped
VMEM limit ("CompileTimeScopedVmemOom ... Scoped allocation with size"), which is how the budgets above were read.

Not yet done: a run on a TPU (timings; whether the VPU dequantization, ~6 vector ops per weight, or HBM bounds
a decode step: on v5e it is likely the VPU); the gathered rows are a copy of ``x`` per (token, slot) with padding
rows (15/16 of them at a 17-token verify with 16-row blocks), DMA'd once per column tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kimi_jax.ops.int4_format import CHUNK, GROUP_SIZE, WORD_ROWS, Int4Experts
from kimi_jax.ops.int4_moe.routing import combine, default_block_m, gather_rows, sort_by_expert
from kimi_jax.ops.int4_moe.rules import DEFAULT_KIND, LANES, TPU_BLOCK_M, MoeCall, tpu_rules
from kimi_jax.ops.numerics import F32

K_STEP = 256                  # K tiles in whole chunks of the layout (256 inputs = 32 word rows, 8 scale rows)


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_n: int       # output columns per tile where N is wide
    area: int          # weights per tile (bk * bn): what one grid step streams and dequantizes


TILES = {"TPU v5 lite": Tiles(256, 1 << 20), "TPU v6 lite": Tiles(512, 1 << 20), "TPU v5": Tiles(128, 1 << 20),
         "TPU7x": Tiles(512, 1 << 20)}


def _block(n: int, target: int, step: int) -> int:
    """Largest multiple of ``step`` <= max(target, step) dividing n; n itself when none does (a full dim is always
    a legal block: ``rules.tpu_rules`` keeps those small)."""
    for b in range(max(step, target - target % step), 0, -step):
        if n % b == 0:
            return b
    return n


def tile_shape(kdim: int, n: int, tiles: Tiles) -> tuple[int, int]:
    """(bk, bn) of a ``[kdim, n]`` expert matrix: bn up to ``block_n``, bk filling ``area``; when bk is the
    whole K (the down matrix under TP-8: K = 256), bn widens to fill ``area`` instead, so that a step still
    streams enough bytes to hide its ~0.35 us of pipeline overhead."""
    bn = _block(n, tiles.block_n, LANES)
    bk = _block(kdim, tiles.area // bn, K_STEP)
    return bk, _block(n, max(bn, tiles.area // bk), LANES)


def _dequantize(words_ref, scales_ref, w_ref) -> None:
    """words [bk/8, bn] int32 and scales [bk/32, bn] -> w_ref [bk, bn] = q * scale in natural input order."""
    for c in range(words_ref.shape[0] // WORD_ROWS):
        # u = q + 8 has its top bit set iff q >= 0; u ^ 8 is then q's 4-bit two's complement
        words = words_ref[c * WORD_ROWS:(c + 1) * WORD_ROWS, :] ^ jnp.int32(0x88888888 - (1 << 32))
        scales = scales_ref[c * 8:(c + 1) * 8, :].astype(F32)
        for i in range(8):        # nibble plane i = scale group 8c + i = inputs 256c + 32i .. + 31
            q = (words << (28 - 4 * i)) >> 28
            rows = slice(c * CHUNK + i * GROUP_SIZE, c * CHUNK + (i + 1) * GROUP_SIZE)
            w_ref[rows, :] = (q.astype(F32) * scales[i:i + 1, :]).astype(w_ref.dtype)


# The kernels take both scalar-prefetch refs first (the index maps read the experts; the kernels the used count).
def _gate_up_kernel(block_expert_ref, used_ref, x_ref, w_ref, s_ref, h_ref, acc_ref, wdq_ref):
    k, nk = pl.program_id(2), pl.num_programs(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    @pl.when(pl.program_id(1) < used_ref[0])
    def _():
        for half in (0, 1):       # gate, up: one dequantized tile in VMEM at a time
            _dequantize(w_ref.at[half], s_ref.at[half], wdq_ref)
            acc_ref[half] += jnp.dot(x_ref[...], wdq_ref[...], preferred_element_type=F32)

    @pl.when(k == nk - 1)
    def _():
        g, u = acc_ref[0], acc_ref[1]
        h_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype)


def _down_kernel(block_expert_ref, used_ref, h_ref, w_ref, s_ref, o_ref, wdq_ref):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, F32)

    @pl.when(pl.program_id(1) < used_ref[0])
    def _():
        _dequantize(w_ref, s_ref, wdq_ref)
        o_ref[...] += jnp.dot(h_ref[...], wdq_ref[...], preferred_element_type=F32)


def _expert_matmul(kernel, xs, w, s, block_expert, used, *, bm: int, tiles: Tiles, out_dtype, scratch,
                   interpret: bool):
    """Rows ``[(nb + 1) * bm, N]`` of ``kernel`` over the row blocks of ``xs [nb * bm (+ bm), K]`` against the
    expert ``block_expert[b]`` of ``w [E, (2,) K/8, N]`` / ``s [E, (2,) K/32, N]``; the last row block is the
    unused blocks' sink (module docstring)."""
    nb = block_expert.shape[0]
    kdim, n = w.shape[-2] * 8, w.shape[-1]
    bk, bn = tile_shape(kdim, n, tiles)
    nn, nk = n // bn, kdim // bk
    halves = (2,) if w.ndim == 4 else ()

    def live(j, b, k, be_ref, used_ref):
        """Block, K tile and expert that step (j, b, k) reads: an unused block repeats the last used block's
        last step, so the pipeline fetches nothing for it."""
        on = b < used_ref[0]
        bb = jnp.where(on, b, used_ref[0] - 1)
        return bb, jnp.where(on, k, nk - 1), be_ref[bb]

    def x_map(j, b, k, *refs):
        bb, kk, _ = live(j, b, k, *refs)
        return bb, kk

    def w_map(j, b, k, *refs):
        _, kk, e = live(j, b, k, *refs)
        return (e, *(0 for _ in halves), kk, j)

    def out_map(j, b, k, be_ref, used_ref):
        return jnp.where(b < used_ref[0], b, nb), j

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(nn, nb, nk),
        in_specs=[pl.BlockSpec((bm, bk), x_map),
                  pl.BlockSpec((pl.Squeezed(), *halves, bk // 8, bn), w_map),
                  pl.BlockSpec((pl.Squeezed(), *halves, bk // GROUP_SIZE, bn), w_map)],
        out_specs=pl.BlockSpec((bm, bn), out_map),
        scratch_shapes=[*scratch(bn), pltpu.VMEM((bk, bn), xs.dtype)])
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(((nb + 1) * bm, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(block_expert, used, xs, w, s)


def int4_moe_tpu(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, experts: Int4Experts, *,
                 interpret: bool = False, block_m: int | None = None, device_kind: str | None = None) -> jax.Array:
    """Routed experts of one MoE layer on a TPU: ``x [T, D]`` (bf16 or float32), ``topk_idx [T, k]``,
    ``topk_weight [T, k]`` -> float32 ``[T, D]``. ``interpret=True``: Pallas' TPU interpreter (any platform;
    ``pltpu.InterpretParams``: it simulates the pipeline's DMAs, fills uninitialized VMEM with NaN and refuses
    revisited output blocks, which plain ``interpret=True``, the generic HLO interpreter, does not check);
    ``block_m``: rows per block (``rules.tpu_rules``); ``device_kind``: the TPU whose ``TILES`` to use (None:
    ``DEFAULT_KIND``)."""
    call = MoeCall(jnp.dtype(x.dtype).name, experts.d_model, experts.d_ff, block_m)
    if reason := tpu_rules(call, device_kind):
        raise ValueError(reason)
    tiles = TILES[device_kind or DEFAULT_KIND]
    t, k = topk_idx.shape
    bm = block_m or default_block_m(t * k, experts.num_experts, *TPU_BLOCK_M)
    routing = sort_by_expert(topk_idx, experts.num_experts, bm)
    xs = gather_rows(x, routing, k, experts.w13.shape[-2] * 8)
    used = jnp.sum(routing.block_expert >= 0, dtype=jnp.int32)[None]
    matmul = functools.partial(_expert_matmul, block_expert=routing.block_expert, used=used, bm=bm, tiles=tiles,
                               interpret=interpret)
    h = matmul(_gate_up_kernel, xs, experts.w13, experts.s13, out_dtype=x.dtype,
               scratch=lambda bn: [pltpu.VMEM((2, bm, bn), F32)])
    h = jnp.pad(h, ((0, 0), (0, experts.w2.shape[-2] * 8 - h.shape[1])))    # a no-op unless F is not whole chunks
    out = matmul(_down_kernel, h, experts.w2, experts.s2, out_dtype=F32, scratch=lambda bn: [])
    return combine(out, routing, topk_weight)
