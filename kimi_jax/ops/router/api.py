"""The noaux_tc router (n_group = 1) as one op over two implementations.

``route_topk(x, router, bias, k=..., norm_topk_prob=..., scaling=...)`` returns the k experts with the largest
``sigmoid(x @ router) + bias`` and their unbiased scores, renormalised and scaled (``reference.py``).

impl="xla" (``reference.py``: the GEMM, its split-K reduction, the bias add, top-k, gather and renormalise are
six GPU ops) or impl="pallas" (``pallas_triton.py``: two kernels), or impl="auto": the kernels where the program
is lowered for a GPU, XLA elsewhere (``kimi_jax.ops.select``). Shapes the kernels cannot tile
(``kernel_refusal``) take the XLA path under "auto" and are refused under "pallas". Group-limited routing
(n_group > 1) is not here: ``kimi_jax.model.moe.route`` keeps it on its XLA path.
"""

from __future__ import annotations

import functools

import jax

from kimi_jax.ops.router.pallas_triton import Tiles, block, route_pallas
from kimi_jax.ops.router.reference import route_reference
from kimi_jax.ops.select import check_impl, dispatch


def kernel_refusal(d: int, e: int, k: int) -> str | None:
    """Why the Pallas kernels cannot route x [T, d] over e experts, top-k (None: they can)."""
    if block(d, Tiles.block_k) is None or block(e, Tiles.block_e) is None:
        return f"d={d} and e={e} must be multiples of 16"
    if k & (k - 1) or k > e:
        return f"k={k} must be a power of two <= e={e}"
    return None


def route_topk(x, router, bias, *, k: int, norm_topk_prob: bool, scaling: float, impl: str = "auto",
               interpret: bool = False):
    """x [T, D], router [D, E], bias [E] -> (ids [T, k] int32, weights [T, k] float32)."""
    check_impl(impl)
    if impl == "mosaic":
        raise ValueError('the router has no Mosaic GPU kernel; impl="mosaic" applies to the MoE and attention ops')
    reference = functools.partial(route_reference, k=k, norm_topk_prob=norm_topk_prob, scaling=scaling)
    refusal = kernel_refusal(x.shape[1], router.shape[1], k)
    if refusal is not None:
        if impl == "pallas" or interpret:
            raise ValueError(f"router kernel: {refusal}; use impl='xla'")
        return reference(x, router, bias)

    def pallas(x, router, bias, *, interpret):
        kernel = jax.custom_jvp(functools.partial(route_pallas, k=k, norm_topk_prob=norm_topk_prob,
                                                  scaling=scaling, interpret=interpret))

        # pallas_call has no derivative; the kernel computes the reference's function, so the reference's
        # derivative stands in (training differentiates through the router on every platform).
        @kernel.defjvp
        def _(primals, tangents):
            return kernel(*primals), jax.jvp(reference, primals, tangents)[1]

        return kernel(x, router, bias)

    return dispatch((x, router, bias), impl=impl, interpret=interpret, pallas=pallas, xla=reference)
