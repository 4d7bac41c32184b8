"""Compile targets: the GPUs and TPUs kimi_jax is compiled for from a CPU host, and compile-only meshes of them.

A GPU target is a ``GpuTargetConfig`` text proto transcribed from openxla/xla (``target_specs/*.txtpb``; each
file's header names the repository, path and commit); jax's cuda plugin compiles for it with no GPU present
(sm_90a for H100/H200, sm_100a B200, sm_103a B300, sm_120 RTX PRO 6000). A TPU target is a libtpu topology
(``v5e:2x2``); libtpu compiles for it with no TPU present. Per-device facts (memory, compute capability, SMs)
are read from the spec text, never typed a second time. (The five specs match the copies built into
jax-cuda12-plugin 0.12.0.1 but for driver/toolkit/cuDNN version strings, checked by hand, and for one field
kimi_jax adds to b300's: its NVLink links, ``device_interconnect_info``, which upstream's B300 spec omits; XLA
uses its own collective kernels, which CUDA graphs capture, only on a GPU with NVLink links, so without it every
all-reduce of a B300 program was an NCCL call that ended a CUDA graph. docs/b300_graphs.md.)

    mesh = compile_mesh("h200", 16, "tp=16")                  # 2 hosts x 8 H200, nothing allocated
    with lowering_for(mesh):                                   # Pallas sees a GPU while tracing
        lowered = jax.jit(f).lower(*shape_dtype_structs_with_shardings_on(mesh))
    compiled = lowered.compile(compiler_options("h200"))       # register spills are errors

Neither compiler is needed to import this module (a CPU-only ``decode`` install has neither):
``compiler_missing(target)`` says what to install; ``compile_mesh`` raises ``TargetError`` with the same line.
The compilers come with the ``compile`` extra (``pip install -e ".[compile]"``, part of ``test``):
``jax[cuda12-local]`` (the plugin alone, ~200 MB: no CUDA runtime libraries, which only running needs) and
``jax[tpu]`` (libtpu, ~215 MB).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

SPECS = pathlib.Path(__file__).with_name("target_specs")
TRITON_CALL = "__gpu$xla.gpu.triton"      # custom call target of a Pallas (Triton) kernel in compiled GPU HLO
MOSAIC_CALL = "mosaic_gpu_v2"              # and of a Mosaic GPU kernel
TPU_CALL = "tpu_custom_call"               # and of a Pallas TPU (Mosaic TPU) kernel
GPUS_PER_HOST = 8


class TargetError(ValueError):
    """An unknown target, a device count it cannot have, or a compiler that is not installed."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str                     # "h200", "v5e"
    platform: str                 # "cuda" | "tpu"
    device_kind: str              # as jax reports it: "NVIDIA H200 141GB HBM3e", "TPU v5 lite"
    memory_bytes: int             # per device
    cores: int                    # SMs per GPU; TensorCores per TPU chip
    compute_capability: str | None = None   # as the GPU spec states it, "9.0a" ("a": accelerated features;
    #                                         the b300 spec omits it, yet XLA compiles sm_103a for it)
    memory_bandwidth: float | None = None   # bytes/s, GPU spec's
    spec_file: str | None = None            # GPU: target_specs/<file>
    source: str = ""                        # where the facts come from

    @property
    def spec(self) -> str | None:
        """The GpuTargetConfig text (GPU targets)."""
        return (SPECS / self.spec_file).read_text() if self.spec_file else None


def _field(text: str, name: str) -> str:
    m = re.search(rf"^\s*{name}:\s*(\S+)", text, re.MULTILINE)
    if not m:
        raise TargetError(f"GPU spec has no {name}")
    return m.group(1).strip('"')


def _gpu(name: str, spec_file: str) -> Target:
    text = (SPECS / spec_file).read_text()
    cc = re.search(r"cuda_compute_capability\s*{([^}]*)}", text).group(1)
    major = re.search(r"major:\s*(\d+)", cc).group(1)
    minor = (re.search(r"minor:\s*(\d+)", cc) or [0, "0"])[1]
    accel = "ACCELERATED_FEATURES" in cc
    return Target(name=name, platform="cuda", device_kind=re.search(r'device_description_str:\s*"([^"]*)"',
                                                                    text).group(1),
                  memory_bytes=int(_field(text, "device_memory_size")), cores=int(_field(text, "core_count")),
                  compute_capability=f"{major}.{minor}{'a' if accel else ''}",
                  memory_bandwidth=float(_field(text, "memory_bandwidth")), spec_file=spec_file,
                  source=f"kimi_jax/analysis/target_specs/{spec_file} (openxla/xla; see its header)")


_TPU_DOCS = "Cloud TPU docs (docs.cloud.google.com/tpu/docs/{}): HBM capacity per chip, read as 10^9 bytes"
TARGETS: dict[str, Target] = {
    "h100": _gpu("h100", "h100_sxm.txtpb"),
    "h200": _gpu("h200", "h200.txtpb"),
    "b200": _gpu("b200", "b200.txtpb"),
    "b300": _gpu("b300", "b300.txtpb"),
    "rtx_pro_6000": _gpu("rtx_pro_6000", "rtx6000pro.txtpb"),
    # TPU chips: libtpu reports no memory for compile-only devices, so capacity is the documented figure;
    # device_kind and cores are what libtpu's compile-only devices report.
    "v5e": Target("v5e", "tpu", "TPU v5 lite", 16 * 10**9, 1, source=_TPU_DOCS.format("v5e")),
    "v6e": Target("v6e", "tpu", "TPU v6 lite", 32 * 10**9, 1, source=_TPU_DOCS.format("v6e")),
    "v5p": Target("v5p", "tpu", "TPU v5", 95 * 10**9, 2, source=_TPU_DOCS.format("v5p")),
    # Ironwood: 192 GB of HBM a chip, and jax's devices are its two TensorCores (libtpu: 2 devices a chip, one
    # core each), so a device holds half a chip's memory
    "tpu7x": Target("tpu7x", "tpu", "TPU7x", 96 * 10**9, 1,
                    source=_TPU_DOCS.format("tpu7x") + "; libtpu: 2 devices a chip"),
}
TPU7X_DEVICES_PER_CHIP = 2


def get_target(target: str | Target) -> Target:
    if isinstance(target, Target):
        return target
    if target not in TARGETS:
        raise TargetError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[target]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:          # a missing parent package (no jax_plugins at all)
        return False


def compiler_missing(target: str | Target) -> str | None:
    """None when this machine can compile for ``target``, else one line saying what to install."""
    t = get_target(target)
    if t.platform == "cuda":
        found = _installed("jax_plugins.xla_cuda12") or _installed("jax_plugins.xla_cuda13")
        what = "the XLA GPU compiler (jax's cuda plugin)"
    else:
        found = _installed("libtpu")
        what = "the TPU compiler (libtpu)"
    return None if found else (f"compiling for {t.name} needs {what}: pip install -e '.[compile]' "
                               "(or jax[cuda12-local] / jax[tpu] at your jax version)")


def topology(target: str | Target, devices: int) -> str:
    """The topology string of ``devices`` devices: GPUs 'PxHxD' (partitions x hosts x devices per host, at most
    8 per host: 16 -> '1x2x8'); TPUs 'v5e:4x4' / 'v5p:2x2x4' (power-of-two slices, the shapes Cloud TPU sells;
    tpu7x: chips of 2 devices, 'tpu7x:2x2x1' is 8)."""
    t = get_target(target)
    if devices < 1:
        raise TargetError(f"{t.name}: devices must be >= 1, got {devices}")
    if t.platform == "cuda":
        if devices > GPUS_PER_HOST and devices % GPUS_PER_HOST:
            raise TargetError(f"{t.name}: {devices} GPUs do not fill hosts of {GPUS_PER_HOST}; use a multiple of "
                              f"{GPUS_PER_HOST} (or at most {GPUS_PER_HOST})")
        per_host = min(devices, GPUS_PER_HOST)
        return f"1x{devices // per_host}x{per_host}"
    chips = devices
    if t.name == "tpu7x":                  # a device is half a chip; one device: one chip's first
        if devices > 1 and devices % TPU7X_DEVICES_PER_CHIP:
            raise TargetError(f"{t.name}: devices come {TPU7X_DEVICES_PER_CHIP} a chip, got {devices}")
        chips = max(1, devices // TPU7X_DEVICES_PER_CHIP)
    k = chips.bit_length() - 1
    if chips != 1 << k:
        raise TargetError(f"{t.name}: TPU slices come in powers of two chips, got {chips}")
    if t.name not in ("v5p", "tpu7x"):                    # 2D torus: 1x2, 2x2, 2x4, 4x4, 4x8, ..., 16x16
        exps = [k // 2, k - k // 2]
    elif k == 2:                                          # 3D torus: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
        exps = [1, 1, 0]
    else:
        exps = [k // 3 + (i >= 3 - k % 3) for i in range(3)]
    return f"{t.name}:" + "x".join(str(1 << e) for e in exps)


def compile_devices(target: str | Target, devices: int) -> list:
    """``devices`` compile-only devices of ``target`` (jax Device objects that can be compiled for, not run on)."""
    from jax.experimental import topologies

    t = get_target(target)
    if reason := compiler_missing(t):
        raise TargetError(reason)
    topo = topology(t, devices)
    if t.platform == "tpu":
        # libtpu takes /tmp/libtpu_lockfile when it loads, and refuses (aborting the process) while another process
        # holds it, e.g. any JAX process on this machine that probed for TPUs. Compile-only devices never touch a
        # chip, so the lock guards nothing here.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if t.platform == "cuda":
        desc = topologies.get_topology_desc(platform="cuda", target_config=t.spec, topology=topo)
    else:
        desc = topologies.get_topology_desc(topology_name=topo, platform="tpu")
    return list(desc.devices)[:devices]     # one tpu7x device: the first of a chip's two


def _axes(axes, devices: int | None) -> dict[str, int]:
    if axes is None:
        if devices is None:
            raise TargetError("give devices, axes ('tp=8'), or both")
        return {"tp": devices}
    if isinstance(axes, str):
        from kimi_jax.sharding import parse_mesh  # the project's mesh syntax and axis names
        return parse_mesh(axes)
    return dict(axes)


def compile_mesh(target: str | Target, devices: int | None = None, axes: str | dict | None = None) -> Mesh:
    """A mesh of compile-only devices of ``target``: ``compile_mesh("h200", 8)`` (axis 'tp'),
    ``compile_mesh("h200", 16, "ep=2,tp=8")`` (2 hosts, tp inside each), ``compile_mesh("v5e", axes="dp=2,tp=2")`` (devices
    from the axes). Axis types are Auto, as ``kimi_jax.sharding.make_mesh`` makes them, so GSPMD partitions
    the model's unannotated code. TPU devices are laid out along the physical torus (``mesh_utils``)."""
    shape = _axes(axes, devices)
    n = math.prod(shape.values())
    if devices is not None and devices != n:
        raise TargetError(f"mesh {axes} has {n} devices, not {devices}")
    devs = compile_devices(target, n)
    if get_target(target).platform == "tpu":
        from jax.experimental import mesh_utils
        arr = mesh_utils.create_device_mesh(tuple(shape.values()), devs, allow_split_physical_axes=True)
    else:
        arr = np.asarray(devs, dtype=object).reshape(tuple(shape.values()))   # device ids in order: the last
        #                                        axes stay within a host ('ep=2,tp=8': tp inside each 8-GPU host)
    return Mesh(arr, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def lowering_for(mesh: Mesh):
    """Context to trace and lower under for ``mesh``'s platform: ``jax.set_mesh``, which also sets the abstract
    mesh (with the target's device kind and platform) that Pallas reads to pick its GPU lowering; without it
    a CPU host's trace fails with "No supported GPU devices found"."""
    return jax.set_mesh(mesh)


def compiler_options(target: str | Target, *, spills_are_errors: bool = True) -> dict:
    """``.compile(compiler_options=...)`` for ``target``: on GPUs a register spill in any kernel fails the
    compile ("Compilation result discarded due to register spilling"), and LLVM generates code at XLA's default
    level (3), the one a GPU run compiles at: NVPTX code at -O0 spills where -O3's does not, so a spill check at
    another level judges a program nobody runs (the test suite runs XLA:CPU at -O0 through XLA_FLAGS). Per
    compile, so both hold whatever XLA_FLAGS the process started with and whenever the GPU backend first parsed
    them."""
    if get_target(target).platform != "cuda":
        return {}
    options = {"xla_backend_optimization_level": 3}
    if spills_are_errors:
        options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = True
    return options
