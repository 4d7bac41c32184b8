"""The DFlash drafter's attention as one op over two implementations.

``attend(q, k_ctx, v_ctx, k_blk, v_blk, visible)``: each block slot's query heads attend, GQA, to the context
rows' keys and the block's own, where ``visible`` says (``reference.py``: the math ``drafter.block_hidden`` had).

impl="xla" (``reference.py``: per drafter layer two concatenates, the scores GEMM, three or four softmax
reductions, two pads, two transposes, the PV GEMM and its split-K reduction: ~12 GPU ops at K2.6 shapes) or
impl="pallas" (``pallas_triton.py``: a split-K flash kernel reading every operand in place, and the tree
attention's LSE merge: 2), or impl="auto": the kernels where the program is lowered for a GPU and they take the
call, XLA elsewhere (``kimi_jax.ops.registry``; the rules: ``DRAFTER_ATTENTION``). impl="mosaic" (the drafter
follows the target's ``Runtime.attn_impl``) is served by the Triton kernels, impl="tpu" by XLA: neither has a
drafter kernel of its own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kimi_jax.ops.drafter_attention.pallas_triton import MAX_GROUP, attend_pallas
from kimi_jax.ops.drafter_attention.reference import attend_reference
from kimi_jax.ops.registry import Implementation, Lowering, Op, always
from kimi_jax.ops.tree_attention.pallas_triton import MIN_DOT

MAX_BLOCK_TOKENS = 256      # a drafter block; wider calls are training's packed blocks, which XLA serves


@dataclasses.dataclass(frozen=True)
class DrafterAttentionCall:
    """The static facts of an ``attend`` call that the implementations' rules read: t block tokens of H query
    heads over KVH kv heads of head_dim hd, s context rows; the operands' dtypes (q, k, v in that order)."""
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    slots: int
    dtypes: tuple[str, ...]

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def pallas_supports(call: DrafterAttentionCall, lowering: Lowering) -> str | None:
    """Why the Triton kernels cannot take the call (None: they can); pallas_triton.py's contract."""
    if len(set(call.dtypes)) != 1:
        return f"the Triton kernel takes q, k and v of one dtype, got {call.dtypes}"
    if lowering.compiles_for_gpu and jnp.dtype(call.dtypes[0]).itemsize != 2:
        # deviceless compiles of float32 at these tiles: register spills at K2.6's shapes on H200, shared memory
        # exceeded at head_dim 256 on H200, B200 and the RTX PRO 6000
        return f"compiled, the Triton kernel takes 16-bit q, k and v, got {call.dtypes[0]}"
    if call.tokens > MAX_BLOCK_TOKENS:
        return f"t={call.tokens} tokens is not a drafter block (kernels take up to {MAX_BLOCK_TOKENS}); use impl='xla'"
    if call.slots < 1:
        return "the Triton kernel needs at least one context row (s >= 1)"
    if not _pow2(call.head_dim) or call.head_dim < MIN_DOT:
        return f"the Triton kernel needs a head_dim that is a power of two >= {MIN_DOT}, got {call.head_dim}"
    if not _pow2(call.group) or call.group > MAX_GROUP:
        return (f"the Triton kernel needs query heads per kv head (H / KVH = {call.heads} / {call.kv_heads}) to be "
                f"a power of two <= {MAX_GROUP}")
    return None


DRAFTER_ATTENTION = Op("drafter attention", (
    Implementation("pallas", pallas_supports,
                   f"any GPU (interpret mode elsewhere); q, k, v of one dtype, compiled a 16-bit one; t <= "
                   f"{MAX_BLOCK_TOKENS}; s >= 1 context rows; head_dim a power of two >= {MIN_DOT}; query heads "
                   f"per kv head a power of two <= {MAX_GROUP}"),
    Implementation("xla", always, "every call"),
), stand_ins=(("mosaic", "pallas"), ("tpu", "xla")))


def attend(q, k_ctx, v_ctx, k_blk, v_blk, visible, *, layer=None, impl: str = "auto", interpret: bool = False):
    """q [b, t, H, hd]; context k_ctx/v_ctx [b, s, KVH, hd], or with ``layer`` (int or int32 scalar) the whole
    feature cache [layers, b, s, KVH, hd] and the layer attended over (the kernel reads it in place);
    k_blk/v_blk [b, t, KVH, hd]; visible [b, t, s + t] bool (context keys first) -> [b, t, H, hd].

    ``impl``: "auto", "xla", "pallas", "mosaic" (served by "pallas") or "tpu" (served by "xla"), resolved for
    the platform the program is lowered for (``kimi_jax.ops.registry``; a forced one that does not take the call
    is an error saying why); ``interpret=True`` runs the kernels in Pallas interpret mode. Differentiable: the
    kernel's derivative is the reference's."""
    if layer is None:
        k_ctx, v_ctx, layer = k_ctx[None], v_ctx[None], 0
    b, t, heads, hd = q.shape
    _, _, s, kv_heads, _ = k_ctx.shape
    if (k_ctx.shape[1:] != (b, s, kv_heads, hd) or v_ctx.shape != k_ctx.shape or k_blk.shape != (b, t, kv_heads, hd)
            or v_blk.shape != k_blk.shape or visible.shape != (b, t, s + t) or heads % kv_heads):
        raise ValueError(f"shapes disagree: q {q.shape}, k_ctx {k_ctx.shape}, v_ctx {v_ctx.shape}, k_blk "
                         f"{k_blk.shape}, v_blk {v_blk.shape}, visible {visible.shape} (want q [b, t, H, hd], "
                         "k/v_ctx [layers, b, s, KVH, hd], k/v_blk [b, t, KVH, hd], visible [b, t, s + t], "
                         "KVH dividing H)")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    visible = visible.astype(bool)

    def reference(q, k_ctx, v_ctx, k_blk, v_blk, visible, layer):
        return attend_reference(q, k_ctx[layer[0]], v_ctx[layer[0]], k_blk, v_blk, visible)

    def pallas(*operands, interpret):
        kernel = jax.custom_jvp(lambda q, k_ctx, v_ctx, k_blk, v_blk, visible, layer: attend_pallas(
            q, k_ctx, v_ctx, k_blk, v_blk, visible, layer, interpret=interpret))

        # pallas_call has no derivative; the kernel computes the reference's function, so the reference's
        # derivative stands in (training differentiates through the drafter)
        @kernel.defjvp
        def _(primals, tangents):
            return kernel(*primals), jax.jvp(reference, primals, tangents)[1]

        return kernel(*operands)

    call = DrafterAttentionCall(t, heads, kv_heads, hd, s, tuple(jnp.dtype(x.dtype).name for x in (q, k_ctx, v_ctx,
                                                                                                    k_blk, v_blk)))
    return DRAFTER_ATTENTION.dispatch(call, (q, k_ctx, v_ctx, k_blk, v_blk, visible, layer), impl=impl,
                                      interpret=interpret, run={"pallas": pallas, "xla": reference})
