"""Why an 8x B300 TP-8 program split into a CUDA graph per all-reduce, on the smallest program that shows it.

    python -m bench.b300_graphs_repro          # ~10 s on a 2-core CPU, no GPU

One jitted function: 4 unrolled layers of a tensor-parallel MLP (gate/up column-parallel, down row-parallel,
``psum`` over 'tp') under ``shard_map`` on an 8-device compile-only mesh, compiled with XLA's real GPU compiler
and kimi_jax's options (``kimi_jax.config.compile_options``); the thunk sequence is counted with
``kimi_jax.analysis.thunks``. Each row: the target, the spec or option that differs, what the all-reduce
became (XLA's own collective kernel, ``kCollectiveKernel``, or an NCCL call, ``kAllReduce``), and the counts.

* ``h200``: XLA's one-shot all-reduce kernel, captured like any kernel: the whole program is one graph.
* ``b300 (upstream spec)``: the B300 spec as openxla/xla ships it, which has no ``device_interconnect_info``. XLA
  then sees no NVLink and refuses its collective kernels (CollectiveKernelStrategyAnnotator: "Collective kernels
  are only supported on devices with NVLink/UALink support"); the all-reduce is an NCCL ``kAllReduce``, a thunk
  of command-buffer type COLLECTIVES, which kimi_jax's types do not include: a graph ends at every all-reduce and
  the all-reduce, with the kernel XLA overlaps with it, is launched by the host (one graph per layer here; 140
  graphs / 332 host launches for the K2.6 DDTree round, 127 all-reduces).
* ``b300``: kimi_jax's B300 spec (18 NVLink links, ``kimi_jax/analysis/target_specs/b300.txtpb``): as H200. So is
  B200 (sm_100, its upstream spec states its links): Blackwell is not the condition, the links are.
* ``b300 (upstream spec) + COLLECTIVES``: the compile option that puts NCCL calls in graphs gives the same counts,
  but a different program (NCCL inside the graph, not XLA's kernel); kimi_jax does not use it.
* ``h200, 8 MiB all-reduce``: above XLA's 4 MiB two-shot limit even an NVLink GPU falls back to NCCL, and the
  graph splits there too (likely the H200 batch-64 rounds' 128 graphs; not checked here).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pathlib
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # before jax is imported: compile-only GPUs, no GPU backend probe

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from kimi_jax.analysis import targets, thunks  # noqa: E402
from kimi_jax.config import GRAPH_LOOPS, Runtime, compile_options  # noqa: E402

KEYS = ("gpu_ops", "in_graphs", "graphs", "host_launches", "host_syncs")
WEIGHT_SPECS = (P(None, "tp"), P(None, "tp"), P("tp", None))      # gate, up (column-parallel), down (row-)
NVLINK_BLOCK = "  device_interconnect_info {\n    active_links: 18\n  }\n"


def upstream_b300() -> targets.Target:
    """The B300 target with upstream's spec: kimi_jax's minus the NVLink block it adds."""
    t = targets.get_target("b300")
    text = t.spec
    if NVLINK_BLOCK not in text:
        return t                            # already upstream's
    spec_dir = pathlib.Path(tempfile.mkdtemp(prefix="b300_upstream_spec_"))
    (spec_dir / "b300_upstream.txtpb").write_text(text.replace(NVLINK_BLOCK, ""))
    return dataclasses.replace(t, name="b300_upstream", spec_file=str(spec_dir / "b300_upstream.txtpb"))


def tp_mlp(target, layers: int = 4, rows: int = 8, hidden: int = 1024):
    """The lowered program: ``layers`` TP-8 MLP layers, unrolled (one all-reduce of ``rows`` x ``hidden`` bf16
    each): RMS norm, gated MLP with column-parallel gate/up and row-parallel down projections, ``psum``, and a
    small replicated side branch (so that the kernels between two all-reduces reach XLA's minimum graph size, 5)."""
    mesh = targets.compile_mesh(target, 8)

    def f(x, *ws):
        def body(x, *ws):
            for layer in range(layers):
                g, u, d = ws[3 * layer:3 * layer + 3]
                ms = jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
                h = x * jax.lax.rsqrt(ms + 1e-6).astype(x.dtype)
                y = jax.nn.silu(h @ g) * (h @ u)
                x = x + jax.lax.psum(y @ d, "tp") + jnp.tanh(h @ g[:, :64]) @ d[:64]
            return x
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), *WEIGHT_SPECS * layers), out_specs=P(),
                             check_vma=False)(x, *ws)

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    with targets.lowering_for(mesh):
        return jax.jit(f).lower(arg((rows, hidden), P()),
                                *[arg((hidden, hidden), spec) for spec in WEIGHT_SPECS * layers])


def count(target, extra: dict | None = None, **shape) -> dict:
    """Counts per execution, plus how the all-reduce was lowered (thunk kinds in the dumped sequence)."""
    options = {**compile_options("cuda", Runtime()), **targets.compiler_options(target), **(extra or {})}
    with tempfile.TemporaryDirectory() as tmp:
        _, got = thunks.compile_dumped(tp_mlp(target, **shape), options, keep=tmp)
        # (XLA writes the sequence after its thunk passes only where they changed it, as thunks.read_dump reads)
        found = [sorted(glob.glob(os.path.join(tmp, p))) for p in ("*thunk_sequence_after_thunk_passes.txt",
                                                                   "*thunk_sequence.txt")]
        seq = open((found[0] or found[1])[-1]).read()
    kinds = [k for k in ("kCollectiveKernel", "kAllReduce") if k + " " in seq or k + "\n" in seq]
    return {**{k: got[k] for k in KEYS}, "all_reduce": "+".join(kinds) or "-"}


def rows() -> list[tuple[str, dict]]:
    up = upstream_b300()
    collectives = {"xla_gpu_enable_command_buffer": GRAPH_LOOPS + ",COLLECTIVES"}
    return [("h200", count("h200")),
            ("b300 (upstream spec: no NVLink links)", count(up)),
            ("b300 (kimi_jax spec: 18 NVLink links)", count("b300")),
            ("b200 (upstream spec: 18 NVLink links)", count("b200")),
            ("b300 (upstream spec) + COLLECTIVES command buffers", count(up, collectives)),
            ("h200, 8 MiB all-reduce (rows=4096)", count("h200", rows=4096)),
            ("h200, 8 MiB all-reduce + COLLECTIVES", count("h200", collectives, rows=4096))]


def main() -> int:
    if reason := targets.compiler_missing("h200"):
        raise SystemExit(reason)
    print("| program | all-reduce thunk | GPU ops | in graphs | graphs | host launches | host syncs |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows():
        print(f"| {name} | {r['all_reduce']} | " + " | ".join(str(r[k]) for k in KEYS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
