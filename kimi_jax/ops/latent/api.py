"""MLA's two latent projections as ops over two implementations each.

* ``latent_projection(x, norm, q_a, kv_a, q_a_norm, kv_a_norm, positions, inv_freq, eps=..., latent_eps=...)``
  returns ``(cq, rows)``: the query's normalised latent (what ``q_b`` reads) and the new tokens' cache rows
  ``[c_kv ‖ rope(k_pe)]``, from a layer's input rows before the attention's RMSNorm.
* ``absorbed_queries(cq, q_b, kv_b, positions, inv_freq)`` returns ``(q_lat, q_pe)``: absorbed MLA's queries,
  W_UK folded into q_nope and q_pe rotated (what the tree attention reads).

impl="xla" (``reference.py``; at decode widths on a GPU five and four launches a layer) or impl="pallas"
(``pallas_triton.py``: a split-K GEMM and one kernel each), or impl="auto": the kernels where the program is
lowered for a GPU and the call is a decode or verify width (they take every width; prefills are XLA's), XLA
elsewhere (``kimi_jax.ops.registry``; the rules:
``LATENT``, ``QUERIES``). The model passes its attention's impl: "mosaic" is served by the Triton kernels (there
are no Mosaic GPU ones), "tpu" by XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from kimi_jax.ops.latent.pallas_triton import latent_pallas, queries_pallas
from kimi_jax.ops.latent.reference import latent_reference, queries_reference
from kimi_jax.ops.registry import Implementation, Lowering, Op, always, with_reference_jvp

# Most rows "auto" gives the kernels (they take any): decode and verify widths, a batch of them included. Past it
# (prefill chunks) XLA's GEMMs need no split and its norms and RoPE are bandwidth-bound kernels anyway, where the
# kernels' split-K partial sums would be float32 traffic of their own.
MAX_ROWS = 512


def decode_width(call, lowering: Lowering) -> str | None:
    """The kernels' ``auto`` rule: at most ``MAX_ROWS`` rows."""
    if call.tokens > MAX_ROWS:
        return f"{call.tokens} rows is a prefill width (auto gives the kernel up to {MAX_ROWS})"
    return None


@dataclasses.dataclass(frozen=True)
class LatentCall:
    """The static facts of a ``latent_projection`` call that the rules read: ``tokens`` rows of ``d`` inputs
    into ``q`` query-latent and ``r + p`` cache columns, in ``dtype``."""
    tokens: int
    d: int
    q: int
    r: int
    p: int
    dtype: str


def pallas_supports(call: LatentCall, lowering: Lowering) -> str | None:
    """Why the Triton kernel cannot take the call (None: it can)."""
    if why := lowering.refuses_wide(call.dtype, "the latent kernel takes 16-bit rows (its GEMM reads them as the "
                                                 "model's)"):
        return why
    if call.p % 2 or call.p & (call.p - 1):
        return f"the rope width must be an even power of two (a Triton tensor), got {call.p}"
    return None


LATENT = Op("latent projection", (
    Implementation("pallas", pallas_supports,
                   "any GPU (interpret mode elsewhere); compiled: 16-bit rows; the rope width a power of two; auto: "
                   f"at most {MAX_ROWS} rows", auto=decode_width),
    Implementation("xla", always, "every call"),
), stand_ins=(("mosaic", "pallas"), ("tpu", "xla")))


def latent_projection(x, norm, q_a, kv_a, q_a_norm, kv_a_norm, positions, inv_freq, cache=None, *, eps: float,
                      latent_eps: float, impl: str = "auto", interpret: bool = False):
    """x [b, T, D] (a layer's input rows), norm [D] (the attention's RMSNorm weight), q_a [D, Q], kv_a [D, R + P],
    q_a_norm [Q], kv_a_norm [R], positions [b, T], inv_freq [P / 2] -> (cq [b, T, Q], rows [b, T, R + P]).
    ``cache`` = (kv, page_table or None, layer, slots [b, T]): the rows are written into the whole cache kv at
    ``layer`` (``kimi_jax.cache.write``; the kernel writes them in place) and (cq, kv) is returned."""
    kw = dict(eps=eps, latent_eps=latent_eps)
    r = kv_a_norm.shape[0]
    call = LatentCall(int(x.size // x.shape[-1]), x.shape[-1], q_a.shape[-1], r, kv_a.shape[-1] - r,
                      jnp.dtype(x.dtype).name)
    return LATENT.dispatch(call, (x, norm, q_a, kv_a, q_a_norm, kv_a_norm, positions, inv_freq, cache), impl=impl,
                           interpret=interpret, run={"pallas": with_reference_jvp(latent_pallas, latent_reference, kw),
                                                     "xla": functools.partial(latent_reference, **kw)})


@dataclasses.dataclass(frozen=True)
class QueriesCall:
    """The static facts of an ``absorbed_queries`` call: ``tokens`` rows of a ``q``-wide latent into ``heads``
    heads of ``nope`` + ``p`` columns, W_UK's ``r`` latent rows, in ``dtype``."""
    tokens: int
    q: int
    heads: int
    nope: int
    p: int
    r: int
    dtype: str


def queries_supports(call: QueriesCall, lowering: Lowering) -> str | None:
    """Why the Triton kernel cannot take the call (None: it can)."""
    if why := lowering.refuses_wide(call.dtype, "the queries kernel takes 16-bit rows (its W_UK dot)"):
        return why
    if call.nope % 16 or call.r % 16:
        return f"W_UK's widths (nope {call.nope}, latent {call.r}) must be multiples of 16 (Triton's dots)"
    if call.p < 2 or call.p & (call.p - 1):
        return f"the rope width must be a power of two >= 2 (its halves are Triton tensors), got {call.p}"
    return None


QUERIES = Op("absorbed queries", (
    Implementation("pallas", queries_supports,
                   "any GPU (interpret mode elsewhere); compiled: 16-bit rows; nope and latent widths multiples of 16; "
                   f"the rope width a power of two; auto: at most {MAX_ROWS} rows", auto=decode_width),
    Implementation("xla", always, "every call"),
), stand_ins=(("mosaic", "pallas"), ("tpu", "xla")))


def absorbed_queries(cq, q_b, kv_b, positions, inv_freq, *, impl: str = "auto", interpret: bool = False):
    """cq [..., T, Q], q_b [Q, H, nope + P], kv_b [R, H, nope + V] (W_UK: its first nope columns), positions
    [..., T], inv_freq [P / 2] -> (q_lat [..., T, H, R], q_pe [..., T, H, P])."""
    p = 2 * inv_freq.shape[0]
    call = QueriesCall(int(cq.size // cq.shape[-1]), cq.shape[-1], q_b.shape[1], q_b.shape[-1] - p, p,
                       kv_b.shape[0], jnp.dtype(cq.dtype).name)
    return QUERIES.dispatch(call, (cq, q_b, kv_b, positions, inv_freq), impl=impl, interpret=interpret,
                            run={"pallas": with_reference_jvp(queries_pallas, queries_reference, {}),
                                 "xla": queries_reference})

