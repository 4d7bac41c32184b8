"""GPU ops per MoE layer, per named scope, of a K2.6-shaped DDTree round (or AR step) with 3 layers.

    python -m bench.layer_ops [--target h200 b200] [--devices 8] [--json out.json] [--no-split-k] [--method ar]

Compiles, with no GPU present, one whole DDTree round (budget 16: a 17-token verify; batch 1, 4096 cache slots)
of K2.6 cut to 3 layers (``first_k_dense_replace=1``: one dense layer and 2 MoE layers, every width K2.6's; INT4
experts, so the Pallas kernels a GPU runs) on a compile-only TP mesh, per-layer weight buffers and kimi_jax's
GPU compile options. It reuses ``target_sweep.compile_round`` (what ``bench.gpu_overhead`` compiles at 61
layers) and counts with ``thunks.compile_dumped``; the K2.6 DFlash drafter taps the 3 layers it has.

Prints the ops of the target's verify forward per MoE layer for the per-MoE-layer scopes (``router``,
``experts``, ``shared_expert``) and per layer for the others, and the whole round's total. The round's other
scopes (draft, build_tree, accept, commit) are outside the layers and listed as they are. A few hundred MB and
~1-2 min per target on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")     # before jax reads it: compile-only devices, no GPU runtime
import jax  # noqa: E402

MOE_SCOPES = ("router", "experts", "shared_expert")
LAYERS, DENSE = 3, 1


def small_k26():
    """K2.6 with 3 layers (1 dense, 2 MoE) and the DFlash drafter tapping them."""
    from kimi_jax.config import preset
    from kimi_jax.decoding import drafter as dflash

    cfg = preset("kimi-k2.6").replace(num_hidden_layers=LAYERS, first_k_dense_replace=DENSE)
    dcfg = dflash.PRESETS["kimi-k2.6-dflash"].replace(target_layer_ids=tuple(range(LAYERS)))
    return cfg, dcfg


def count_round(target: str = "h200", devices: int = 8, keep: str | None = None, split_k: bool = True,
                impl: str = "auto", method: str = "ddtree") -> dict:
    """thunks' count dict (gpu_ops, by_scope, ...) of the small round for ``devices`` x ``target``, TP.
    ``keep``: leave XLA's dump there (``thunks.compile_dumped``); ``split_k``: ``Runtime.split_k``; ``method``:
    "ddtree" or "ar" (one plain decoding step: its one-token forward is also scoped "verify")."""
    from kimi_jax.analysis import target_sweep, targets, thunks
    from kimi_jax.config import Runtime, compile_options

    cfg, dcfg = small_k26()
    mesh = targets.compile_mesh(target, devices, f"tp={devices}")
    got = {}
    for spills_are_errors in (True, False):
        options = {**compile_options("cuda", Runtime(split_k=split_k)),
                   **targets.compiler_options(target, spills_are_errors=spills_are_errors)}
        try:
            with targets.lowering_for(mesh):
                _, got = target_sweep.compile_round(
                    cfg, dcfg, mesh, "tp", method, 1, 16, 4096, split=True, impl=impl,
                    compile=lambda lowered: thunks.compile_dumped(lowered, options, target_sweep.SCOPES, keep))
            break
        except Exception as err:  # noqa: BLE001
            # counted anyway, and said: on B200 one of XLA's own small build_tree fusions spills 4 bytes
            # (jax 0.12.0.1); the kernels' own compiles keep spills as errors (tests/test_targets.py)
            if not spills_are_errors or "register spilling" not in str(err):
                raise
    got["spills"] = not spills_are_errors
    jax.clear_caches()
    return got


def per_layer(by_scope: dict) -> dict:
    """The verify forward's ops by innermost scope: per MoE layer for MOE_SCOPES, per layer for the others
    (dense_mlp: per dense layer); "verify" is the verify scope's own ops (outside the model's scopes)."""
    totals: dict[str, int] = {}
    for path, n in by_scope.items():
        parts = path.split("/")
        if parts[0] != "verify":
            continue
        totals[parts[-1]] = totals.get(parts[-1], 0) + n
    div = {**{s: LAYERS - DENSE for s in MOE_SCOPES}, "dense_mlp": DENSE, "verify": 1, "embed": 1, "head": 1}
    return {s: n / div.get(s, LAYERS) for s, n in sorted(totals.items(), key=lambda kv: -kv[1])}


def moe_layer_ops(by_scope: dict) -> float:
    """GPU ops of one MoE layer's router, routed experts and shared expert in the verify forward."""
    got = per_layer(by_scope)
    return sum(got.get(s, 0) for s in MOE_SCOPES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", nargs="+", default=["h200"])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--json", help="also write the counts here")
    ap.add_argument("--keep", help="leave XLA's dump of each target under KEEP/<target>")
    ap.add_argument("--impl", default="auto", help="both kernels' Runtime choice (auto, pallas, mosaic)")
    ap.add_argument("--no-split-k", action="store_true", help="compile as Runtime(split_k=False) does")
    ap.add_argument("--method", default="ddtree", choices=("ddtree", "ar"),
                    help="the DDTree round (a 17-token verify) or the AR step (a one-token forward)")
    args = ap.parse_args(argv)
    from kimi_jax.analysis import targets
    rows = {}
    for target in args.target:
        if reason := targets.compiler_missing(target):
            raise SystemExit(reason)
        t0 = time.perf_counter()
        got = count_round(target, args.devices, args.keep and os.path.join(args.keep, target), not args.no_split_k,
                          args.impl, args.method)
        rows[target] = dict(gpu_ops=got["gpu_ops"], host_launches=got["host_launches"], spills=got["spills"],
                            per_layer=per_layer(got["by_scope"]), by_scope=got["by_scope"],
                            moe_layer_ops=moe_layer_ops(got["by_scope"]),
                            compile_s=round(time.perf_counter() - t0, 1))
        r = rows[target]
        spills = "; a kernel spills registers (compiled with spills allowed)" if got["spills"] else ""
        print(f"## {target} x {args.devices}, TP, {args.method}: round {r['gpu_ops']} GPU ops, "
              f"{r['host_launches']} host launches ({r['compile_s']} s){spills}")
        print("| verify scope | ops per layer (MoE scopes: per MoE layer) |\n|---|---|")
        for s, n in r["per_layer"].items():
            print(f"| {s} | {n:g} |")
        print(f"| **router + experts + shared_expert** | **{r['moe_layer_ops']:g}** |")
        outside = {p: n for p, n in r["by_scope"].items() if not p.startswith("verify")}
        print("outside verify:", ", ".join(f"{p or 'unscoped'} {n}" for p, n in outside.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
