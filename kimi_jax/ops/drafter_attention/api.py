"""The DFlash drafter's attention as one op over two implementations.

``attend(qkv, k_ctx, v_ctx, visible)``: each block slot's query heads attend, GQA, to the context rows' keys and
the block's own, where ``visible`` says (``reference.py``: the math ``drafter.block_hidden`` had). The block's
q, k and v come packed in one array (``pack_qkv``): the drafter projects and normalises them as one, and the
kernel reads all three from that one output in place (three operands were three more XLA kernels a layer).

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

import jax.numpy as jnp

from kimi_jax.cache import over_used_slots
from kimi_jax.ops.drafter_attention.pallas_triton import MAX_GROUP, attend_pallas
from kimi_jax.ops.drafter_attention.reference import attend_reference
from kimi_jax.ops.registry import Implementation, Lowering, Op, always, with_reference_jvp
from kimi_jax.ops.tree_attention.pallas_triton import MIN_DOT

MAX_BLOCK_TOKENS = 256      # a drafter block; wider calls are training's packed blocks, which XLA serves


@dataclasses.dataclass(frozen=True)
class DrafterAttentionCall:
    """The static facts of an ``attend`` call that the implementations' rules read: t block tokens of H query
    heads over KVH kv heads of head_dim hd, s context rows; the operands' dtypes (qkv, k_ctx, v_ctx)."""
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
        return f"the Triton kernel takes qkv and the context k, v of one dtype, got {call.dtypes}"
    # deviceless compiles of float32 at these tiles: register spills at K2.6's shapes on H200, shared memory
    # exceeded at head_dim 256 on H200, B200 and the RTX PRO 6000
    if why := lowering.refuses_wide(call.dtypes[0], "the Triton kernel takes 16-bit operands"):
        return why
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
                   f"any GPU (interpret mode elsewhere); qkv and context k, v of one dtype, compiled a 16-bit one; "
                   f"t <= {MAX_BLOCK_TOKENS}; s >= 1 context rows; head_dim a power of two >= {MIN_DOT}; query heads "
                   f"per kv head a power of two <= {MAX_GROUP}"),
    Implementation("xla", always, "every call"),
), stand_ins=(("mosaic", "pallas"), ("tpu", "xla")))


def pack_qkv(q, k, v):
    """q [b, t, H, hd], k/v [b, t, KVH, hd] -> qkv [b, t, KVH, H / KVH + 2, hd]: per kv head, the query heads that
    read it (h // (H / KVH)), then its key, then its value."""
    b, t, heads, hd = q.shape
    kv_heads = k.shape[2]
    return jnp.concatenate([q.reshape(b, t, kv_heads, heads // kv_heads, hd), k[:, :, :, None], v[:, :, :, None]],
                           axis=3)


def unpack_qkv(qkv):
    """``pack_qkv``'s inverse: (q, k, v)."""
    b, t, kv_heads, slots, hd = qkv.shape
    return qkv[:, :, :, :-2].reshape(b, t, kv_heads * (slots - 2), hd), qkv[:, :, :, -2], qkv[:, :, :, -1]


def attend(qkv, k_ctx, v_ctx, visible, *, layer=None, impl: str = "auto", interpret: bool = False):
    """qkv [b, t, KVH, G + 2, hd] (``pack_qkv``: G = H / KVH query heads, the key, the value of each kv head);
    context k_ctx/v_ctx [b, s, KVH, hd], or with ``layer`` (int or int32 scalar) the whole feature cache
    [layers, b, s, KVH, hd] and the layer attended over (the kernel reads it in place); visible [b, t, s + t] bool
    (context keys first) -> [b, t, H, hd].

    ``impl``: "auto", "xla", "pallas", "mosaic" (served by "pallas") or "tpu" (served by "xla"), resolved for
    the platform the program is lowered for (``kimi_jax.ops.registry``; a forced one that does not take the call
    is an error saying why); ``interpret=True`` runs the kernels in Pallas interpret mode. Differentiable: the
    kernel's derivative is the reference's."""
    if layer is None:
        k_ctx, v_ctx, layer = k_ctx[None], v_ctx[None], 0
    b, t, kv_heads, slots, hd = qkv.shape
    _, _, s, _, _ = k_ctx.shape
    if (slots < 3 or k_ctx.shape[1:] != (b, s, kv_heads, hd) or v_ctx.shape != k_ctx.shape
            or visible.shape != (b, t, s + t)):
        raise ValueError(f"shapes disagree: qkv {qkv.shape}, k_ctx {k_ctx.shape}, v_ctx {v_ctx.shape}, visible "
                         f"{visible.shape} (want qkv [b, t, KVH, G + 2, hd] with G >= 1, k/v_ctx "
                         "[layers, b, s, KVH, hd], visible [b, t, s + t])")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    visible = visible.astype(bool)

    def reference(qkv, k_ctx, v_ctx, visible, layer):
        q, k_blk, v_blk = unpack_qkv(qkv)
        def read(slots):        # the context rows below `slots` (no copy of the others), and the block's own
            seen = jnp.concatenate([visible[..., :slots], visible[..., s:]], axis=-1)
            return attend_reference(q, k_ctx[layer[0], :, :slots], v_ctx[layer[0], :, :slots], k_blk, v_blk, seen)
        # no query sees a context row at or past `used`: reading up to it is exact (cache.over_used_slots)
        used = jnp.max(jnp.where(jnp.any(visible[..., :s], axis=1), jnp.arange(1, s + 1), 0))
        return over_used_slots(used, s, read)

    call = DrafterAttentionCall(t, kv_heads * (slots - 2), kv_heads, hd, s,
                                tuple(jnp.dtype(x.dtype).name for x in (qkv, k_ctx, v_ctx)))
    return DRAFTER_ATTENTION.dispatch(call, (qkv, k_ctx, v_ctx, visible, layer), impl=impl, interpret=interpret,
                                      run={"pallas": with_reference_jvp(attend_pallas, reference, {}),
                                           "xla": reference})
