"""The GPU or TPU a kernel is being lowered for, read at trace time: its device kind, a GPU's architecture
(``hopper``, ``blackwell``) and the tiles a kernel picks for it (``lowering_tiles``). Which implementation serves a
call is ``kimi_jax.ops.registry``'s; the kernels read their tiles here.
"""

from __future__ import annotations

import re

import jax


def lowering_gpu() -> str | None:
    """The device kind of the GPU a kernel is being lowered for, read at trace time inside a cuda branch: the
    abstract mesh's device (a compile-only target: ``kimi_jax.analysis.targets.lowering_for``), else this
    process's GPU; None when neither is a GPU. Kernels pick their tiles by it (``lowering_tiles``)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform in ("gpu", "cuda"):
        return device.device_kind
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else None


def lowering_tpu() -> str | None:
    """The device kind of the TPU a kernel is being lowered for, read at trace time: the abstract mesh's device
    (a compile-only target), else this process's TPU; None when neither is a TPU (the Pallas TPU kernels then
    take their default tiles: a tpu branch traced in a program lowered for another platform)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform == "tpu":
        return device.device_kind
    return jax.devices()[0].device_kind if jax.default_backend() == "tpu" else None


def pick_tiles(table: dict, device_kind: str | None):
    """The entry of ``table`` (device-kind substring -> tiles; "" the default) whose key is the longest
    substring of ``device_kind``."""
    return table[max((k for k in table if k in (device_kind or "")), key=len)]


def lowering_tiles(table: dict):
    """A kernel's tiles (``pick_tiles``) for the GPU it is being lowered for (``lowering_gpu``)."""
    return pick_tiles(table, lowering_gpu())


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
    """impl="mosaic" is not chosen through ``registry.Op.dispatch``'s platform_dependent (the GPU interpreter's
    io_callbacks are effects, which one branch of a cond cannot have alone): the program must be lowered for a GPU
    (the one Pallas lowers for, ``lowering_gpu``) or run in GPU interpret mode."""
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
