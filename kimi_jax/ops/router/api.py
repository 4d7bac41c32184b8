"""The noaux_tc router (n_group = 1) as one op over two implementations.

``route_topk(x, router, bias, k=..., norm_topk_prob=..., scaling=...)`` returns the k experts with the largest
``sigmoid(x @ router) + bias`` and their unbiased scores, renormalised and scaled (``reference.py``). With
``scale=`` (the MoE's RMSNorm weight) x is the normalised rows before that weight: the kernels multiply the rows
they read, so the weighted rows need not be written for the router (the MoE's other readers take the weight too:
XLA fuses it into the shared expert's GEMM, the experts' kernels multiply the rows they gather; one GPU op a MoE
layer).

impl="xla" (``reference.py``: the GEMM, its split-K reduction, the bias add, top-k, gather and renormalise are
six GPU ops) or impl="pallas" (``pallas_triton.py``: two kernels), or impl="auto": the kernels where the program
is lowered for a GPU and they tile the call, XLA elsewhere (``kimi_jax.ops.registry``; the rules: ``ROUTER``).
impl="mosaic" (a MoE on Mosaic GPU: the model passes its MoE's impl) is served by the Triton kernels: there is no
Mosaic GPU router. Group-limited routing (n_group > 1) is not here: ``kimi_jax.model.moe.route`` keeps it on its
XLA path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from kimi_jax.ops.router.pallas_triton import Tiles, block, route_pallas
from kimi_jax.ops.router.reference import route_reference
from kimi_jax.ops.registry import Implementation, Lowering, Op, always, with_reference_jvp


@dataclasses.dataclass(frozen=True)
class RouterCall:
    """The static facts of a ``route_topk`` call that the implementations' rules read: x [T, d] over e experts,
    top-k, in ``dtype`` (x's, the scale's and the router's promoted)."""
    d: int
    e: int
    k: int
    dtype: str


def pallas_supports(call: RouterCall, lowering: Lowering) -> str | None:
    """Why the Triton kernels cannot route the call (None: they can)."""
    # deviceless compile at K2.6's d = 7168, e = 384: 288 KiB of shared memory asked on H100 (tests/
    # test_kernel_shapes.py)
    if why := lowering.refuses_wide(call.dtype, "the router kernels take 16-bit inputs (32-bit tiles exceed "
                                                "shared memory)"):
        return why
    if block(call.d, Tiles.block_k) is None or block(call.e, Tiles.block_e) is None:
        return f"d={call.d} and e={call.e} must be multiples of 16"
    if call.k & (call.k - 1) or call.k > call.e:
        return f"k={call.k} must be a power of two <= e={call.e}"
    return None


ROUTER = Op("router", (
    Implementation("pallas", pallas_supports,
                   "any GPU (interpret mode elsewhere); compiled: 16-bit inputs; d and e multiples of 16; k a "
                   "power of two <= e"),
    Implementation("xla", always, "every call"),
), stand_ins=(("mosaic", "pallas"), ("tpu", "xla")))


def route_topk(x, router, bias, scale=None, *, k: int, norm_topk_prob: bool, scaling: float, impl: str = "auto",
               interpret: bool = False):
    """x [T, D], router [D, E], bias [E], scale [D] or None (``scale * x`` is routed) -> (ids [T, k] int32,
    weights [T, k] float32)."""
    if scale is None:
        scale = jnp.ones(x.shape[-1:], x.dtype)
    kw = dict(k=k, norm_topk_prob=norm_topk_prob, scaling=scaling)
    dtype = jnp.promote_types(jnp.result_type(x, scale), router.dtype)
    call = RouterCall(x.shape[1], router.shape[1], k, dtype.name)
    return ROUTER.dispatch(call, (x, router, bias, scale), impl=impl,
                           interpret=interpret, run={"pallas": with_reference_jvp(route_pallas, route_reference, kw),
                                                     "xla": functools.partial(route_reference, **kw)})
