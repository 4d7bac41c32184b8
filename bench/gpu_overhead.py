"""What a decoding round launches on a GPU, read from programs XLA's real GPU compiler builds on this CPU.

    python -m bench.gpu_overhead [--target h200] [--devices 8] [--skip-k26]

Compiles, with no GPU present (kimi_jax.analysis.targets), and counts from the thunk sequence
(kimi_jax.analysis.thunks): GPU ops per round, how many run inside CUDA graphs, host submissions, blocking
host syncs, and the bytes of device-to-device copies, for

1. one whole DDTree round (budget 16, K2.6 DFlash drafter) and one AR step of the full K2.6 on a TP-8 mesh, in
   four builds: stacked layer scans with XLA's default command buffers (before), per-layer weight buffers,
   per-layer buffers with graph loops (``kimi_jax.config.compile_options``: what kimi_jax compiles), and that
   with ``Runtime(split_k=False)`` (GEMMs without split-K: the opt-in);
2. the embedded default's whole generate program (prefill + the round loop), with and without graph loops:
   the round loop's trip count is data-dependent, so without them its predicate is read by the host every round.

These are counts of what the compiled programs launch, not timings. Writes bench/results/gpu_overhead_<target>.json.
Takes ~10-15 min on a 2-core CPU (each per-layer K2.6 round compiles in ~2-5 min; 2026-12-06: ~10 min).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (name, per-layer weights, the Runtime it compiles with)
BUILDS = (("stacked, XLA defaults", False, dict(graph_loops=False)),
          ("per-layer, XLA defaults", True, dict(graph_loops=False)),
          ("per-layer + graph loops", True, dict()),
          ("per-layer + graph loops, no split-K", True, dict(split_k=False)))
KEYS = ("gpu_ops", "in_graphs", "graphs", "host_launches", "host_syncs", "copy_bytes", "compile_s")


def k26_rounds(target: str, devices: int) -> list[dict]:
    from kimi_jax.analysis import target_sweep, targets, thunks
    from kimi_jax.config import KIMI_K26, Runtime, compile_options
    from kimi_jax.decoding import drafter as dflash

    mesh = targets.compile_mesh(target, devices, f"tp={devices}")
    rows = []
    for method in ("ddtree", "ar"):
        for name, split, runtime in BUILDS:
            options = {**compile_options("cuda", Runtime(**runtime)), **targets.compiler_options(target)}
            with targets.lowering_for(mesh):
                _, got = target_sweep.compile_round(
                    KIMI_K26, dflash.PRESETS["kimi-k2.6-dflash"], mesh, "tp", method, 1, 16, 4096, split=split,
                    compile=lambda lowered: thunks.compile_dumped(lowered, options, target_sweep.SCOPES))
            rows.append(dict(program=f"K2.6 {method} round, tp={devices}", build=name, **got))
            print(_line(rows[-1]), flush=True)
            jax.clear_caches()
    return rows


def embedded_generate(target: str) -> list[dict]:
    """The embedded default's DDTree generate program (budget 8, 8 new tokens) for one ``target`` GPU."""
    import kimi_jax
    from kimi_jax.analysis import target_sweep, targets, thunks
    from kimi_jax.config import Runtime, compile_options
    from kimi_jax.decoding.programs import Programs
    from kimi_jax.model.compute_layout import split_stacks

    model = kimi_jax.load(str(ROOT / "checkpoints" / "target"), drafter=str(ROOT / "checkpoints" / "drafter"))
    request = model.prepare("def f(x):\n", 8, "ddtree", 8)
    inputs = model.inputs(request).replace(params=split_stacks(model.params))   # as stored: INT4, per layer
    inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), inputs)
    mesh = targets.compile_mesh(target, 1)
    lowered = Programs(Runtime(mesh=mesh)).lower_generate(request, inputs)    # lowered as kimi_jax lowers it
    rows = []
    for graph_loops in (False, True):
        t0 = time.perf_counter()
        _, got = thunks.compile_dumped(lowered, compile_options("cuda", Runtime(graph_loops=graph_loops)),
                                       target_sweep.SCOPES)
        rows.append(dict(program="embedded default, generate (per round + prefill)",
                         build="graph loops" if graph_loops else "XLA defaults",
                         compile_s=round(time.perf_counter() - t0, 1), **got))
        print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    return (f"| {r['program']} | {r['build']} | {r['gpu_ops']} | {r['in_graphs']} | {r['graphs']} | "
            f"{r['host_launches']} | {r['host_syncs']} | {r['copy_bytes'] / 1e9:.2f} | {r['compile_s']} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h200")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--skip-k26", action="store_true", help="only the embedded default's generate program")
    args = ap.parse_args(argv)
    from kimi_jax.analysis import targets
    if reason := targets.compiler_missing(args.target):
        raise SystemExit(reason)
    print("| program | build | GPU ops | in graphs | graphs | host launches | host syncs | copies GB | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = embedded_generate(args.target) + ([] if args.skip_k26 else k26_rounds(args.target, args.devices))
    out = ROOT / "bench" / "results" / f"gpu_overhead_{args.target}.json"
    out.write_text(json.dumps(dict(target=args.target, devices=args.devices, jax=jax.__version__,
                                   date=time.strftime("%Y-%m-%d"), rows=rows), indent=1))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    raise SystemExit(main())
