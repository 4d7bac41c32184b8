"""Which implementation of a kernel runs: chosen by the platform a program is lowered for, never by the host.

``impl`` (``Runtime.moe_impl`` / ``Runtime.attn_impl``, and the ops' own ``impl=``):

* ``"auto"`` (the default): the GPU kernels in a program lowered for a GPU (cuda), by the table below (Mosaic
  GPU where the target is Hopper and the call suits the kernel, Triton elsewhere), the XLA path in a program
  lowered for a CPU or a TPU;
* ``"pallas"``: the Pallas Triton kernels on every GPU; on other platforms the same kernels in Pallas interpret
  mode (their own code run as plain HLO, which is how the tests check them on a CPU);
* ``"xla"``: the XLA path everywhere;
* ``"mosaic"`` (both ops): the Mosaic GPU kernels in a program lowered for a GPU (where they compile: Hopper),
  Pallas' GPU interpret mode with ``interpret=True``, refused elsewhere (``mosaic_lowering``); a call they do not
  take is an error, not a fallback.

``interpret=True`` runs the Pallas kernel in interpret mode on every platform (a caller who asks for it).

The choice is ``jax.lax.platform_dependent``: every candidate is traced, only the one for the platform the
program is lowered for is lowered. So a program lowered for cuda on a CPU host (``kimi_jax.analysis.targets``)
holds the GPU kernels, and the same jitted function lowered for cpu holds none. Within cuda, the GPU it is
lowered for (``lowering_gpu``: the compile-only target's device kind, or this process's GPU) picks Mosaic GPU
or Triton at trace time (``hopper``). (Until this module, the choice followed ``jax.default_backend()`` at trace
time, and a cuda program lowered on a CPU host silently carried interpret-mode loops.)

Which implementation serves which target under "auto", and why (none of these kernels has run on a GPU yet:
interpret mode checks their numbers, the real compilers their code; ``bench.gpu_check`` times them side by side):

=====================  ===================  ==================  ==============  ==================================
target                 INT4 MoE             tree attention      router          why
=====================  ===================  ==================  ==============  ==================================
CPU, TPU               XLA                  XLA                 XLA             no Pallas GPU kernels there; TPU
                                                                                kernels not written
H100, H200 (sm_90a)    **Mosaic GPU**       **Mosaic GPU**      Pallas Triton   TMA + wgmma, the backend JAX
                       (placement: Triton)  (merge: Triton)     (2 kernels)     supports there; at launch parity
                                                                                but for one op a MoE layer (the
                                                                                routed rows' gather: TMA copies
                                                                                boxes, not rows): 393 against 391
                                                                                ops for the 3-layer K2.6 round
B200, B300 (sm_100a)   Pallas Triton        Pallas Triton       Pallas Triton   no wgmma on sm_100a. The MoE's
                       (Mosaic tcgen05:                                         tcgen05 version compiles spill-
                       impl="mosaic")                                           free, but Mosaic GPU hands ptxas
                                                                                the arch of the first kernel a
                                                                                process compiles, so "auto" on
                                                                                B200 would break any process
                                                                                that also compiles for H200 (the
                                                                                sweep, the tests). Attention:
                                                                                no tcgen05 version
RTX PRO 6000 (sm_120)  Pallas Triton        Pallas Triton       Pallas Triton   no wgmma, so Mosaic GPU's Hopper
                       (8 warps)            (16-query blocks)   (128-input      path cannot serve it; own tiles
                                                                chunks)         (``TILES``) against spills and smem
=====================  ===================  ==================  ==============  ==================================

Where a Mosaic kernel does not take a call on Hopper, "auto" takes Triton's: 32-bit activations or caches (wgmma
takes 16-bit ones), widths that are not whole tiles (``int4_moe/mosaic_gpu.takes``,
``tree_attention/mosaic_gpu.check_cache``: pages of whole 64-key blocks), explicit Triton tiles (``block_m``,
``block_q``/``block_k``). The Mosaic attention merges its split-K partials with Triton's merge kernel. Both GPU
MoE paths place their (token, slot) pairs by expert with one
Triton kernel up to 512 pairs (``int4_moe/pallas_triton.place``), on XLA above (``routing.py``); Mosaic GPU has
no placement or router kernel of ours. The router (``kimi_jax/ops/router``, impl = ``Runtime.moe_impl``,
"mosaic" meaning its Triton kernels) takes its kernels only with one expert group (K2.6) and shapes they tile;
group-limited routing and other shapes stay on XLA (``model.moe.route``). Its kernels compile spill-free for
H100, H200, B200 and RTX PRO 6000 (tests/test_router_kernel.py); B300 is not compiled.

The Triton backend is deprecated since JAX 0.11. When it goes, Hopper keeps both Mosaic kernels and needs the
router, placement and merge on XLA (~8 launches a MoE layer and 1 a layer more) or in Mosaic GPU; Blackwell
needs "auto" to take the MoE's tcgen05 kernels (once Mosaic GPU compiles for several architectures in one
process) and a tcgen05 tree attention (docs/mosaic_gpu.md).
"""

from __future__ import annotations

import functools
import re
from typing import Callable

import jax

IMPLS = ("auto", "xla", "pallas", "mosaic")


def lowering_gpu() -> str | None:
    """The device kind of the GPU a kernel is being lowered for, read at trace time inside a cuda branch: the
    abstract mesh's device (a compile-only target: ``kimi_jax.analysis.targets.lowering_for``), else this
    process's GPU; None when neither is a GPU. Kernels pick their tiles by it (``lowering_tiles``)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform in ("gpu", "cuda"):
        return device.device_kind
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else None


def pick_tiles(table: dict, device_kind: str | None):
    """The entry of ``table`` (device-kind substring -> tiles; "" the default) whose key is the longest
    substring of ``device_kind``."""
    return table[max((k for k in table if k in (device_kind or "")), key=len)]


def lowering_tiles(table: dict):
    """A kernel's tiles (``pick_tiles``) for the GPU it is being lowered for (``lowering_gpu``)."""
    return pick_tiles(table, lowering_gpu())


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def mosaic_interpret_params(interpret):
    """``plgpu.kernel``'s interpret argument: None (compile), GPU interpret mode's default parameters for True,
    or the caller's own ``InterpretGPUParams``."""
    if not interpret:
        return None
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        return InterpretGPUParams()
    return interpret


def mosaic_lowering(interpret: bool) -> None:
    """impl="mosaic" is not chosen through ``dispatch``'s platform_dependent (the GPU interpreter's io_callbacks
    are effects, which one branch of a cond cannot have alone): the program must be lowered for a GPU (the one
    Pallas lowers for, ``lowering_gpu``) or run in GPU interpret mode."""
    if not interpret and lowering_gpu() is None:
        raise ValueError('impl="mosaic" is lowered for a GPU (jax.set_mesh of a GPU mesh, or a process with a GPU), '
                         "or runs with interpret=True (GPU interpret mode)")


def hopper(device_kind: str | None) -> bool:
    """Whether ``device_kind`` (as jax reports it: "NVIDIA H200 141GB HBM3e") is an sm_90 GPU: H100, H200,
    H800, H20, GH200. By name, as the tile tables pick, since compile-only targets carry no compute capability."""
    return bool(re.search(r"\bG?H(100|200|800|20)\b", device_kind or ""))


def blackwell(device_kind: str | None) -> bool:
    """Whether ``device_kind`` is an sm_100 GPU with tcgen05 (B200, B300, GB200, GB300; not the RTX PRO 6000
    Blackwell, sm_120, which has neither wgmma nor tcgen05)."""
    return bool(re.search(r"\bG?B(200|300)\b", device_kind or ""))


def dispatch(operands: tuple, *, impl: str, interpret: bool, pallas: Callable, xla: Callable,
             mosaic: Callable | None = None):
    """``pallas(*operands, interpret=bool)``, ``mosaic(*operands)`` or ``xla(*operands)``, as ``impl`` says for the
    lowering platform (module doc). ``mosaic``: the Mosaic GPU kernel that "auto" runs in a cuda lowering; the
    caller passes it only where it serves the GPU being lowered for and the call (the ops' ``mosaic_serves``).
    Operands are pytrees; every implementation must return the same shapes and dtypes."""
    check_impl(impl)
    if impl == "xla":
        return xla(*operands)
    if interpret:
        return pallas(*operands, interpret=True)
    elsewhere = xla if impl == "auto" else functools.partial(pallas, interpret=True)
    cuda = mosaic if impl == "auto" and mosaic is not None else functools.partial(pallas, interpret=False)
    return jax.lax.platform_dependent(*operands, cuda=cuda, default=elsewhere)
