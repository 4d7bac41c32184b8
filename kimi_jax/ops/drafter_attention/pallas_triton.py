"""The drafter attention as two Pallas (Triton) kernels: split-K flash decoding over the context rows and the
block's own keys, then the tree attention's LSE merge.

Contract (``api.pallas_supports`` states the same conditions as rules):

- the block's q, k, v packed in one array qkv [b, t, KVH, G + 2, hd] (per kv head its G query heads, its key,
  its value: ``api.pack_qkv``; the drafter projects and normalises them as one, so they reach the kernel as one
  XLA output, read in place), context k/v [layers, b, s, KVH, hd] read at ``layer`` in place (the whole feature
  cache, so no layer's slice is copied into a buffer of its own for the call), visible [b, t, s + t] (context
  keys first), all of one dtype; compiled, a 16-bit one (the checks against the
  reference run float32 in interpret mode). Output [b, t, H, hd] in that dtype; scores, softmax and
  accumulation in float32; probabilities rounded to the dtype before the PV dot, as the reference does.
- hd a power of two >= 16 (Triton's dots and loads); the GQA group G = H / KVH a power of two <= 64 (a
  program's query rows are whole groups); 1 <= t <= 256 (a drafter block); s >= 1, any s (the last key block is
  ragged: its loads are masked, nothing is padded or copied).
- A query row that sees no key returns zeros (the reference, with a finite mask value, averages every key). No
  drafter row does: each sees at least its own block slot.

Kernel 1, grid ``(nq, ns + 1, KVH, b)``. Program ``(i, j, h, bi)`` takes ``tq`` block tokens (query block i) of
the G query heads that read kv head h: ``tq * G`` query rows (64 for K2.6's 8-token block and group 8), one
[tq, G, hd] load from qkv in place, reshaped to rows. The GQA group shares its keys, so each key is read once per
query block (once per round at drafter widths). Splits ``j < ns`` stream context key blocks ``[j*bps,
(j+1)*bps)`` of ``bk`` keys with an online softmax (``tree_attention.pallas_triton.online_update``); split
``ns`` streams the block's t keys. Each key block loads its [tq, bk] slice of ``visible`` (int8), which the
group's rows share. Each program writes its float32 partial (acc [tq, G, hd], max, sum) straight into
[b, ns + 1, t, H, hd]: that is the tree attention merge's [b, parts, t*H, hd] (``merge_pallas``, kernel 2), whose
output [b, t*H, hd] is q's layout, so neither side transposes or pads anything.

Splits: ``tree_attention.pallas_triton.default_splits`` (~2 programs per H200 SM, at least 4 key blocks a
split): at K2.6's 4096 slots 16 splits a kv head, each streaming 4 x 64 keys x 128 x 2 (K and V) x 2 B = 128 KiB
and writing 32 KiB of partials; split by heads over 8 GPUs (``drafter.PARAM_AXES``) a device holds 1 kv head,
16 + 1 programs and 2 MiB a layer; on one device, 8 kv heads, 136 programs and 16 MiB. Nothing here has run on a GPU; the tiles are the tree attention's, compiled
deviceless spill-free on the GPU targets (tests/test_drafter_attention.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.numerics import F32, MASK_VALUE, next_pow2
from kimi_jax.ops.select import lowering_tiles
from kimi_jax.ops.tree_attention.merge import merge_pallas
from kimi_jax.ops.tree_attention.pallas_triton import MERGE_BLOCK, MIN_DOT, default_splits, dot_nt, online_update

MAX_GROUP = 64          # query heads per kv head: a program's rows are whole groups


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The kernel's tiles (module docstring): the most query rows a program (fewer for short blocks), key rows a
    block, Triton launch parameters."""
    block_rows: int = 64
    block_k: int = 64
    # at 4 warps, 65 block tokens (a ragged query block of 32 tokens x group 2, head_dim 64) spilled registers on
    # B200 (deviceless compile); 8 warps compile spill-free over tests/test_drafter_attention.py's shapes
    num_warps: int = 8
    num_stages: int = 2


# Per GPU (device-kind substring; "" every other): on the RTX PRO 6000 (sm_120, ~99 KiB of shared memory a
# block) 64 query rows spilled registers at K2.6's shapes and exceeded shared memory at head_dim 256 (deviceless
# compiles); 32 rows compile spill-free over the shapes tested
TILES = {"": Tiles(), "RTX PRO 6000": Tiles(block_rows=32)}


def query_tokens(t: int, group: int, block_rows: int) -> int:
    """Block tokens a program takes: a power of two covering t where the rows allow, at most ``block_rows``
    rows, and at least Triton's 16-row dot (rows past t are masked, never stored)."""
    return max(MIN_DOT // group, min(next_pow2(t), block_rows // group), 1)


def _kernel(layer_ref, q_ref, kc_ref, vc_ref, qkv_ref, vis_ref, o_ref, m_ref, l_ref, *, scale, s, t, bk, bkb, bps,
            n_splits):
    split, h, bi = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    tq, group, hd = q_ref.shape
    rows = tq * group
    q = q_ref[...].reshape(rows, hd)
    init = (jnp.full((rows,), MASK_VALUE, F32), jnp.zeros((rows,), F32), jnp.zeros((rows, hd), F32))

    def keys(k_ref, v_ref, lead, k_tail, v_tail, col, n, nk, j, carry):
        """Keys ``j*nk ..`` of the n in ``k_ref[*lead, key, *k_tail]`` (values: v_ref, v_tail), their mask
        columns from ``col``; keys past n are masked loads (a ragged last block reads nothing out of bounds)."""
        start = j * nk
        ok = start + jnp.arange(nk, dtype=jnp.int32) < n
        k = pltriton.load(k_ref.at[(*lead, pl.ds(start, nk), *k_tail)], mask=jnp.broadcast_to(ok[:, None], (nk, hd)),
                          other=0)
        v = pltriton.load(v_ref.at[(*lead, pl.ds(start, nk), *v_tail)], mask=jnp.broadcast_to(ok[:, None], (nk, hd)),
                          other=0)
        seen = pltriton.load(vis_ref.at[:, pl.ds(col + start, nk)], mask=jnp.broadcast_to(ok[None, :], (tq, nk)),
                             other=0) != 0
        valid = jnp.broadcast_to(seen[:, None, :], (tq, group, nk)).reshape(rows, nk)   # the group shares its row
        return online_update(carry, dot_nt(q, k) * scale, valid, v)

    def store(state):
        m, l, acc = state
        m_ref[...] = m.reshape(tq, group)
        l_ref[...] = l.reshape(tq, group)
        o_ref[...] = acc.reshape(tq, group, hd)

    @pl.when(split < n_splits)
    def _context():
        layer = layer_ref[0]
        first = split * bps
        last = jnp.minimum(first + bps, pl.cdiv(s, bk))
        body = functools.partial(keys, kc_ref, vc_ref, (layer, bi), (h,), (h,), 0, s, bk)
        store(jax.lax.fori_loop(first, jnp.maximum(last, first), body, init))

    @pl.when(split == n_splits)
    def _block():
        at_k, at_v = jnp.int32(group), jnp.int32(group + 1)       # (a Python int does not index a ref)
        body = functools.partial(keys, qkv_ref, qkv_ref, (bi,), (h, at_k), (h, at_v), s, t, bkb)
        store(jax.lax.fori_loop(0, pl.cdiv(t, bkb), body, init))


def attend_pallas(qkv, k_ctx, v_ctx, visible, layer, *, interpret: bool, tiles: Tiles | None = None,
                  num_splits: int | None = None):
    """qkv [b, t, KVH, G + 2, hd], k_ctx/v_ctx [layers, b, s, KVH, hd] at ``layer`` (int32 [1]), visible
    [b, t, s + t] -> [b, t, H, hd] (H = KVH * G) in qkv's dtype; shapes as ``api.pallas_supports`` takes (module
    doc). ``tiles``: None picks them for the GPU being lowered for."""
    b, t, kv_heads, group, hd = qkv.shape
    group -= 2
    heads, s = kv_heads * group, k_ctx.shape[2]
    tiles = tiles or (Tiles() if interpret else lowering_tiles(TILES))
    tq = query_tokens(t, group, tiles.block_rows)
    nq = pl.cdiv(t, tq)
    bk = tiles.block_k
    n_blocks = pl.cdiv(s, bk)
    ns = max(1, min(num_splits or default_splits(n_blocks, b * kv_heads * nq), n_blocks))
    bps = pl.cdiv(n_blocks, ns)
    bkb = min(bk, max(MIN_DOT, next_pow2(t)))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    kernel = functools.partial(_kernel, scale=float(hd) ** -0.5, s=s, t=t, bk=bk, bkb=bkb, bps=bps, n_splits=ns)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(nq, ns + 1, kv_heads, b),
        in_specs=[whole(layer),
                  # the query heads: block 0 of G along qkv's G + 2 (the key and value after them unread)
                  pl.BlockSpec((None, tq, None, group, hd), lambda i, j, h, k: (k, i, h, 0, 0)),
                  whole(k_ctx), whole(v_ctx), whole(qkv),
                  pl.BlockSpec((None, tq, s + t), lambda i, j, h, k: (k, i, 0))],
        out_specs=[pl.BlockSpec((None, None, tq, group, hd), lambda i, j, h, k: (k, j, i, h, 0)),
                   pl.BlockSpec((None, None, tq, group), lambda i, j, h, k: (k, j, i, h)),
                   pl.BlockSpec((None, None, tq, group), lambda i, j, h, k: (k, j, i, h))],
        out_shape=[jax.ShapeDtypeStruct((b, ns + 1, t, heads, hd), F32),
                   jax.ShapeDtypeStruct((b, ns + 1, t, heads), F32),
                   jax.ShapeDtypeStruct((b, ns + 1, t, heads), F32)],
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="drafter_attention",
    )(layer, qkv, k_ctx, v_ctx, qkv, visible.astype(jnp.int8))
    rows = t * heads        # the partials' [t, H] is the merge's query axis (bitcasts, no copies)
    out = merge_pallas(o.reshape(b, ns + 1, rows, hd), m.reshape(b, ns + 1, rows), l.reshape(b, ns + 1, rows),
                       MERGE_BLOCK, qkv.dtype, interpret, name="drafter_attention_merge")
    return out.reshape(b, t, heads, hd)
