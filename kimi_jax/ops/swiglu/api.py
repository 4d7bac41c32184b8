"""SwiGLU ``down(silu(x @ gate) * (x @ up))`` as one op over two implementations.

impl="xla" (``reference.py``; three GPU launches at decode widths: the gate|up GEMM split over K, the partial
sums with silu(g) * u, the down GEMM) or impl="pallas" (``pallas_triton.py``: a split-K GEMM and one kernel), or
impl="auto": the kernel where the program is lowered for a GPU and the call is a decode or verify width (it takes
every width; prefills are XLA's), XLA elsewhere (``kimi_jax.ops.registry``; the rules: ``SWIGLU``). The model calls
it for the MoE's shared expert on each device's slice (inside the experts' shard_map), and for the dense layer's
and the drafter's MLPs (``model.layers.residual_swiglu``), with the MoE's impl: "mosaic" is served by the Triton
kernel, "tpu" by XLA.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kimi_jax.ops.latent.api import MAX_ROWS, decode_width
from kimi_jax.ops.registry import Implementation, Lowering, Op, always, with_reference_jvp
from kimi_jax.ops.swiglu.pallas_triton import swiglu_pallas
from kimi_jax.ops.swiglu.reference import swiglu_reference


@dataclasses.dataclass(frozen=True)
class SwigluCall:
    """The static facts of a ``swiglu`` call: ``tokens`` rows of ``d`` inputs, ``f`` hidden and ``n`` output
    columns, in ``dtype``."""
    tokens: int
    d: int
    f: int
    n: int
    dtype: str


def pallas_supports(call: SwigluCall, lowering: Lowering) -> str | None:
    """Why the Triton kernel cannot take the call (None: it can)."""
    if why := lowering.refuses_wide(call.dtype, "the SwiGLU kernel takes 16-bit rows (its down dot)"):
        return why
    if call.f % 16 or call.n % 16:
        return f"the hidden ({call.f}) and output ({call.n}) widths must be multiples of 16 (Triton's dots)"
    return None


SWIGLU = Op("swiglu", (
    Implementation("pallas", pallas_supports,
                   "any GPU (interpret mode elsewhere); compiled: 16-bit rows; hidden and output widths multiples of "
                   f"16; auto: at most {MAX_ROWS} rows", auto=decode_width),
    Implementation("xla", always, "every call"),
), stand_ins=(("mosaic", "pallas"), ("tpu", "xla")))


def swiglu(x, gate, up, down, *, impl: str = "auto", interpret: bool = False):
    """x [..., T, D], gate and up [D, F], down [F, N] -> [..., T, N] in x's dtype."""
    call = SwigluCall(int(x.size // x.shape[-1]), x.shape[-1], down.shape[0], down.shape[1], jnp.dtype(x.dtype).name)
    return SWIGLU.dispatch(call, (x, gate, up, down), impl=impl, interpret=interpret,
                           run={"pallas": with_reference_jvp(swiglu_pallas, swiglu_reference, {}),
                                "xla": swiglu_reference})
