"""The kernel registry: one API per op over its implementations, each stating what it supports.

An ``Op`` (INT4 MoE, tree attention, router, placement of (token, slot) pairs, split-K merge, drafter attention)
lists its ``Implementation``s; each states ``supports(call, lowering) -> None | reason`` with every condition it
has (dtypes, dims, rows, pages, tiles, the architecture, what the compiler needs), where ``call`` is the op's own
description of a call's static facts and ``lowering`` what it is lowered for (``Lowering``). One resolver
(``Op.resolve``) walks the target's preference list (``preference``) and takes the first implementation that
supports the call; ``docs/design.md``'s table of rules is generated from here (``rules_table``).

``impl`` (``Runtime.moe_impl`` / ``Runtime.attn_impl``, and the ops' own ``impl=``; names in
``kimi_jax.config.IMPLS``):

* ``"auto"`` (the default): in a program lowered for a GPU (cuda), the first of the target's preference that
  supports the call (Hopper: Mosaic GPU, Pallas Triton, XLA; other GPUs: Pallas Triton, XLA); for a TPU, the
  Pallas TPU kernels, then XLA; XLA in a program lowered for a CPU;
* ``"pallas"``: the Pallas Triton kernels on every GPU; on other platforms the same kernels in Pallas interpret
  mode (their own code run as plain HLO, which is how the tests check them on a CPU);
* ``"xla"``: the XLA path everywhere;
* ``"mosaic"``: the Mosaic GPU kernels in a program lowered for a GPU, Pallas' GPU interpret mode with
  ``interpret=True``, refused elsewhere (``select.mosaic_lowering``). An op without a Mosaic kernel names the
  implementation that serves it instead (``Op.stand_ins``: the router's Triton kernels).
* ``"tpu"``: the Pallas TPU (Mosaic TPU) kernels in a program lowered for a TPU, Pallas' TPU interpret mode
  (``pltpu.InterpretParams``) with ``interpret=True``, refused elsewhere (``tpu_lowering``); ops without a TPU
  kernel (the router) are served by XLA.

A forced implementation (anything but "auto") that does not support a call is an error naming the reason, never
a fallback. ``interpret=True`` runs the Pallas kernel in interpret mode on every platform.

The choice is ``jax.lax.platform_dependent``: every candidate is traced, only the one for the platform the program is
lowered for is lowered. So a program lowered for cuda on a CPU host (``kimi_jax.analysis.targets``) holds the GPU
kernels, and the same jitted function lowered for cpu holds none. Within cuda, the GPU it is lowered for
(``select.lowering_gpu``: the compile-only target's device kind, or this process's GPU) picks the implementation at
trace time; within tpu, the TPU (``select.lowering_tpu``) picks the kernels' tiles. (Choosing by
``jax.default_backend()`` at trace time once made a cuda program lowered on a CPU host silently carry interpret-mode
loops.) Mosaic GPU and Pallas TPU kernels are never a forced choice inside ``platform_dependent`` (the interpreters'
io_callbacks are effects, which one branch of a cond cannot have alone): impl="mosaic" and impl="tpu" are lowered
directly.

Why the preference is what it is (none of these kernels has run on a GPU yet: interpret mode checks their
numbers, the real compilers their code; ``bench.gpu_check`` times them side by side):

* H100, H200 (sm_90a): Mosaic GPU first: TMA + wgmma, the backend JAX supports there; at launch parity but for
  one op a MoE layer (393 against 391 ops for the 3-layer K2.6 round). The router, placement and merge have no
  Mosaic kernel of ours, so their Triton kernels serve Hopper too.
* B200, B300 (sm_100a): Pallas Triton first. The MoE's tcgen05 version compiles spill-free (impl="mosaic"), but
  Mosaic GPU hands ptxas the arch of the first kernel a process compiles, so "auto" on B200 would break any
  process that also compiles for H200 (the sweep, the tests). Attention: no tcgen05 version.
* RTX PRO 6000 (sm_120): Pallas Triton (no wgmma), with its own tiles (``TILES`` in each kernel module).
* TPU (v5e, v6e, v5p, TPU7x): the Pallas TPU kernels (INT4 MoE, tree attention; tiles per generation in each
  kernel's ``TILES``), XLA for the router, placement and merge; compiled deviceless with libtpu, never run on
  a TPU.
* CPU: XLA.

The Triton backend is deprecated since JAX 0.11. When it goes, Hopper keeps both Mosaic kernels and needs the
router, placement and merge on XLA (~8 launches a MoE layer and 1 a layer more) or in Mosaic GPU; Blackwell needs
"auto" to take the MoE's tcgen05 kernels and a tcgen05 tree attention (docs/mosaic_gpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kimi_jax.config import IMPLS
from kimi_jax.ops.select import hopper, lowering_gpu, lowering_tpu, mosaic_lowering

# The modules that register the ops (``all_ops`` imports them: an op's module defines its calls and rules)
OP_MODULES = ("kimi_jax.ops.int4_moe.rules", "kimi_jax.ops.int4_moe.pallas_triton", "kimi_jax.ops.tree_attention.rules",
              "kimi_jax.ops.router.api", "kimi_jax.ops.drafter_attention.api", "kimi_jax.ops.latent.api",
              "kimi_jax.ops.swiglu.api")
_OPS: dict[str, "Op"] = {}


@dataclasses.dataclass(frozen=True)
class Lowering:
    """What a call is lowered for: ``platform`` "cuda" or another ("cpu", "tpu", "default": whatever is not
    cuda), the GPU's ``device_kind`` as jax reports it, and whether the kernels run in interpret mode (then the
    compiler's rules do not apply: the kernel's code runs as HLO). A cuda lowering with no GPU known is the cuda
    branch of a program lowered for another platform: traced, never compiled (Pallas lowers for a GPU only
    where one is known: ``select.lowering_gpu``)."""
    platform: str
    device_kind: str | None = None
    interpret: bool = False

    @property
    def compiles_for_gpu(self) -> bool:
        return self.platform == "cuda" and self.device_kind is not None and not self.interpret

    @property
    def compiles_for_tpu(self) -> bool:
        return self.platform == "tpu" and self.device_kind is not None and not self.interpret

    def refuses_wide(self, dtype, reason: str) -> str | None:
        """The Triton kernels' shared rule: compiled for a GPU they take 16-bit operands only (their tiles are
        sized for them; 32-bit ones spill registers or exceed shared memory). Why not, with ``reason`` (the
        kernel's own words), or None; interpret mode takes any dtype."""
        if self.compiles_for_gpu and jnp.dtype(dtype).itemsize != 2:
            return f"compiled, {reason}, got {dtype}"
        return None


def gpu(interpret: bool = False) -> Lowering:
    """The cuda lowering being traced: the GPU of ``select.lowering_gpu``."""
    return Lowering("cuda", lowering_gpu(), interpret)


def tpu(interpret: bool = False) -> Lowering:
    """The tpu lowering being traced: the TPU of ``select.lowering_tpu``."""
    return Lowering("tpu", lowering_tpu(), interpret)


def tpu_lowering(interpret: bool) -> None:
    """impl="tpu" is not chosen through ``Op.dispatch``'s platform_dependent (module doc): the program must be
    lowered for a TPU or run in TPU interpret mode."""
    if not interpret and lowering_tpu() is None:
        raise ValueError('impl="tpu" is lowered for a TPU (jax.set_mesh of a TPU mesh, or a process with a TPU), '
                         "or runs with interpret=True (TPU interpret mode)")


def preference(lowering: Lowering) -> tuple[str, ...]:
    """The implementations "auto" tries for a lowering, best first (module doc: why)."""
    if lowering.platform == "tpu":
        return ("tpu", "xla")
    if lowering.platform != "cuda":
        return ("xla",)
    if hopper(lowering.device_kind):
        return ("mosaic", "pallas", "xla")
    return ("pallas", "xla")


def platform_of(device) -> str:
    """"cuda" for a GPU device (jax says "gpu" for a local one, "cuda" for a compile-only one), else its
    platform."""
    return "cuda" if device.platform in ("gpu", "cuda") else device.platform


def runs_xla_only(impl: str, platform: str) -> bool:
    """Whether every call of an op under ``impl`` in a program lowered for ``platform`` takes the XLA path."""
    check_impl(impl)
    return impl == "xla" or (impl == "auto" and preference(Lowering(platform)) == ("xla",))


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


Supports = Callable[[Any, Lowering], "str | None"]


def always(call, lowering: Lowering) -> None:
    """The XLA paths: every call, every platform."""
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str              # "mosaic", "pallas" (Pallas Triton), "tpu" (Pallas TPU) or "xla"
    supports: Supports     # None, or why not: a sentence a user can act on
    rules: str             # the supports conditions in words (docs/design.md's table)
    # calls "auto" leaves to the implementations after this one though this one takes them (None: every call it
    # takes), e.g. a decode-width kernel that computes a prefill right but slower than XLA; a forced impl ignores it
    auto: Supports | None = None


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    implementations: tuple[Implementation, ...]
    stand_ins: tuple[tuple[str, str], ...] = ()     # (asked for, served by): a name with no kernel of its own

    def __post_init__(self):
        _OPS[self.name] = self

    def implementation(self, name: str) -> Implementation | None:
        name = dict(self.stand_ins).get(name, name)
        return next((i for i in self.implementations if i.name == name), None)

    def refusal(self, name: str, call, lowering: Lowering) -> str | None:
        """Why implementation ``name`` cannot take ``call`` lowered for ``lowering`` (None: it can)."""
        impl = self.implementation(name)
        if impl is None:
            return f"{self.name} has no {name!r} implementation (it has {[i.name for i in self.implementations]})"
        return impl.supports(call, lowering)

    def auto_refusal(self, name: str, call, lowering: Lowering) -> str | None:
        """Why "auto" does not give ``call`` to implementation ``name`` (None: it would, if preferred)."""
        if (reason := self.refusal(name, call, lowering)) is not None:
            return reason
        impl = self.implementation(name)
        return None if impl.auto is None else impl.auto(call, lowering)

    def resolve(self, call, lowering: Lowering) -> str:
        """The first implementation of the lowering's preference that supports the call."""
        own = {i.name: i for i in self.implementations}       # stand-ins serve forced names only
        for name in preference(lowering):
            if name in own and self.auto_refusal(name, call, lowering) is None:
                return name
        reasons = "; ".join(f"{name}: {self.auto_refusal(name, call, lowering)}" for name in preference(lowering)
                            if name in own)
        raise ValueError(f"{self.name}: no implementation takes {call} lowered for {lowering.platform} ({reasons})")

    def require(self, name: str, call, lowering: Lowering) -> str:
        """``name`` as the implementation that serves it, or the error saying why it cannot take the call."""
        if (reason := self.refusal(name, call, lowering)) is not None:
            raise ValueError(f"{self.name} impl={name!r}: {reason}")
        return self.implementation(name).name

    def dispatch(self, call, operands: tuple, *, impl: str, interpret: bool, run: dict[str, Callable]):
        """Runs ``run[name](*operands)`` (kernels: ``run[name](*operands, interpret=bool)``) for the implementation
        ``impl`` resolves to on the platform the program is lowered for (module doc). Operands are pytrees; every
        implementation must return the same shapes and dtypes."""
        check_impl(impl)
        served = self.implementation(impl).name if self.implementation(impl) is not None else impl
        if served == "mosaic":
            mosaic_lowering(interpret)
            self.require(impl, call, gpu(bool(interpret)))
            return run["mosaic"](*operands, interpret=interpret)
        if served == "tpu":
            tpu_lowering(interpret)
            self.require(impl, call, tpu(bool(interpret)))
            return run["tpu"](*operands, interpret=interpret)
        if interpret and served != "xla":
            lowering = Lowering("default", interpret=True)
            return self._runner(self.require("pallas", call, lowering), lowering, run)(*operands)

        def on(lowering: Lowering) -> Callable:
            name = self.resolve(call, lowering) if impl == "auto" else self.require(impl, call, lowering)
            return self._runner(name, lowering, run)

        forced = impl != "auto"                   # a forced GPU kernel off its GPU: interpret mode
        return jax.lax.platform_dependent(*operands, cuda=on(gpu()), tpu=on(tpu(forced)),
                                          default=on(Lowering("default", interpret=forced)))

    @staticmethod
    def _runner(name: str, lowering: Lowering, run: dict[str, Callable]) -> Callable:
        return run[name] if name == "xla" else functools.partial(run[name], interpret=lowering.interpret)


def with_reference_jvp(kernel_fn: Callable, reference: Callable, kw: dict) -> Callable:
    """A kernel's runner for ``Op.dispatch`` (``run[name](*operands, interpret=...)``) whose derivative is the
    reference's: pallas_call has none, and the kernel computes the reference's function (training differentiates
    through the model on every platform)."""
    def run(*operands, interpret):
        kernel = jax.custom_jvp(functools.partial(kernel_fn, **kw, interpret=interpret))

        @kernel.defjvp
        def _(primals, tangents):
            return kernel(*primals), jax.jvp(functools.partial(reference, **kw), primals, tangents)[1]

        return kernel(*operands)
    return run


def all_ops() -> dict[str, Op]:
    """Every registered op, by name (importing the modules that define them)."""
    for module in OP_MODULES:
        importlib.import_module(module)
    return dict(_OPS)


def rules_table() -> str:
    """docs/design.md's table: each op, its implementations and their supports rules (Markdown)."""
    ops = sorted(all_ops().values(), key=lambda op: op.name.lower())
    rows = [row for op in ops for row in [(op.name, impl.name, impl.rules) for impl in op.implementations] +
            [(op.name, asked, f"served by {by} (no {asked} kernel of its own)") for asked, by in op.stand_ins]]
    return "\n".join(["| op | implementation | supports (preference: Hopper mosaic, pallas, xla; other GPUs pallas, "
                      "xla; TPU tpu, xla; CPU xla) |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])
