"""Which JAX platforms a command starts, decided before JAX loads.

With JAX_PLATFORMS unset, JAX initialises every installed plugin. On a machine without an accelerator, the CUDA
plugin (installed by the `compile` and `test` extras for deviceless GPU compiles) prints a ~20-line "Unable to
load cuDNN" traceback and libtpu prints its own warnings, before any output of ours (even before a one-line error).
Device files tell cheaply whether an accelerator is attached: where none is, the command asks for the CPU alone.
Compile-only GPU and TPU targets (kimi_jax.analysis.targets) do not need those backends started, so the sweep and
the deviceless tools work the same either way.
"""

from __future__ import annotations

import glob
import os
import sys

# The device nodes each accelerator's driver creates: NVIDIA (nvidiactl, nvidia0, ...), AMD ROCm (kfd), and TPUs
# (accel0, ... on v4/v5e/v6e; vfio groups on v5p and later), the same files libtpu looks for.
ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def accelerator_attached(devices: tuple[str, ...] = ACCELERATOR_DEVICES) -> bool:
    return any(glob.glob(pattern) for pattern in devices)


def choose_platforms(environ=os.environ) -> None:
    """JAX_PLATFORMS=cpu when the user set none and no accelerator is attached; otherwise leave JAX to choose.
    JAX reads the variable when it is imported; a command that imported it already (convert, train) starts no
    backend before this runs, so its config is set too."""
    if "JAX_PLATFORMS" in environ or accelerator_attached():
        return
    environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules and environ is os.environ:
        sys.modules["jax"].config.update("jax_platforms", "cpu")
