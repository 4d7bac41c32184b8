"""Sharding sweep: compile the full Kimi K2.6 verify step per strategy on fake CPU devices, read what it costs.

    python -m kimi_jax.analysis.sweep                 # every cell: strategy x devices (8, 16) x batch x budget
    python -m kimi_jax.analysis.sweep --quick         # one cell (tp, 8 devices, batch 1, budget 16)
    python -m kimi_jax.analysis.sweep --cells strategy=tp,ep devices=8 batch=1,64
    python -m kimi_jax.analysis.sweep --target h200 --devices 8    # real compilers: kimi_jax.analysis.target_sweep

With ``--target`` the sweep compiles whole rounds for a GPU or TPU with XLA's real compilers instead
(``kimi_jax.analysis.target_sweep``: memory that fits or not, collectives, kernel launches per round). The
fake-device sweep below stays for what that one does not give: any device count without the ``compile`` extra,
and the roofline's projected step time per hardware profile for every cell.

A cell AOT-compiles the DDTree verify step -- the target forward over ``[batch, budget + 1]`` tree tokens at
positions ``P + depth`` with the ancestor mask, against a latent cache of ``--context`` slots (4096), then the
greedy choice per node -- with every weight, cache and input an abstract ``ShapeDtypeStruct`` carrying its
sharding (nothing is allocated). Per device it reports:

* weight bytes (the largest shard of every parameter; INT4 experts at 4.5 bits per weight),
* latent-cache bytes at 4k/32k/128k/200k/256k context (the cache's shard shape x context; ``dcp`` splits it by
  position over the devices),
* compiler temporaries and arguments (``compiled.memory_analysis()`` at ``--context``),
* collectives by kind with count and bytes, read from the optimized HLO (``kimi_jax.analysis.hlo.hlo_collectives``:
  a collective inside the layer-scan while body counts once per layer),
* the roofline round time per hardware profile (``kimi_jax.analysis.roofline.predict_round_time`` at ``--context``).

Cells a strategy cannot serve (a mesh axis that does not divide heads/experts/F/batch) are recorded with the
reason. A whole sweep (or ``--merge``) writes sharding/results/sweep.{csv,json} and PNG plots, the committed tables;
a part of one (``--quick``, ``--cells``) writes to $KIMI_JAX_CACHE/sweep (``results_dir``), so a first look leaves
the committed tables as they are. ``--out`` puts either anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import time

STRATEGIES = ("tp", "ep", "tp_ep", "dp_attn", "dcp")
DEVICES = (8, 16)
BATCHES = (1, 8, 64)
BUDGETS = (16, 64, 256)
CONTEXTS = (4096, 32768, 131072, 200_000, 262_144)
COMPILE_CONTEXT = 4096
PROFILES = ("rtx_pro_6000", "h100", "h200", "b200", "b300")
# the repository's sharding/results (kimi_jax/analysis -> repo root)
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "sharding",
                       "results")


@dataclasses.dataclass(frozen=True)
class Cell:
    strategy: str
    devices: int
    batch: int
    budget: int

    @property
    def key(self) -> str:
        return f"{self.strategy}/d{self.devices}/b{self.batch}/n{self.budget}"


def all_cells(strategies=STRATEGIES, devices=DEVICES, batches=BATCHES, budgets=BUDGETS) -> list[Cell]:
    return [Cell(*c) for c in itertools.product(strategies, devices, batches, budgets)]


def _step(params, cache, tokens, positions, new_mask, *, cfg, rt):
    from kimi_jax.model.transformer import forward
    out = forward(params, cfg, tokens, cache, positions=positions, new_mask=new_mask, rt=rt)
    return out.cache, jax.numpy.argmax(out.logits, axis=-1).astype(jax.numpy.int32)


def checkpoint_bytes(cfg) -> tuple[int, int]:
    """(all weights, weights outside the routed experts) in bytes: bf16 + INT4 experts (unsharded)."""
    from kimi_jax.model.params import abstract_params
    params = abstract_params(cfg, jax.numpy.bfloat16)
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params))
    experts = sum(math.prod(a.shape) * a.dtype.itemsize
                  for a in jax.tree.leaves(params["moe_layers"]["moe"]["experts"]))
    return total, total - experts


def run_cell(cell: Cell, cfg=None, compile_context: int = COMPILE_CONTEXT) -> dict:
    """Compile one cell and measure it; {"status": "ok" | "n/a: reason", ...}."""
    from kimi_jax import sharding as part
    from kimi_jax.analysis import roofline
    from kimi_jax.analysis.hlo import hlo_collectives
    from kimi_jax.cache import KVCache
    from kimi_jax.config import KIMI_K26, Runtime
    from kimi_jax.model.params import abstract_sharded_params

    cfg = cfg or KIMI_K26
    row = dict(dataclasses.asdict(cell), mesh=part.default_mesh_spec(cell.strategy, cell.devices), status="ok")
    if cell.devices > len(jax.devices()):
        return {**row, "status": f"n/a: needs {cell.devices} devices, {len(jax.devices())} visible"}
    try:
        mesh = part.make_mesh(row["mesh"])
        params = abstract_sharded_params(cfg, mesh, cell.strategy)
        cs = part.cache_sharding(cfg, mesh, cell.strategy, batch=cell.batch)
    except part.ShardingError as e:
        return {**row, "status": f"n/a: {e}"}
    jnp = jax.numpy
    b, w = cell.batch, cell.budget + 1
    sds = jax.ShapeDtypeStruct
    cache = KVCache(kv=sds((cfg.num_hidden_layers, b, compile_context, cfg.latent_dim), jnp.bfloat16,
                          sharding=cs.kv),
                    lengths=sds((b,), jnp.int32, sharding=cs.lengths))
    act = part.batch_sharding(mesh, cell.strategy, 2)
    tokens = sds((b, w), jnp.int32, sharding=act)
    positions = sds((b, w), jnp.int32, sharding=act)
    mask = sds((b, w, w), jnp.bool_, sharding=part.batch_sharding(mesh, cell.strategy, 3))
    t0 = time.perf_counter()
    rt = Runtime(mesh=mesh, strategy=cell.strategy)
    with part.mesh_context(mesh):
        step = jax.jit(_step, static_argnames=("cfg", "rt"), donate_argnums=(1,))
        compiled = step.lower(params, cache, tokens, positions, mask, cfg=cfg, rt=rt).compile()
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["context"] = compile_context
    mem = compiled.memory_analysis()
    row["weight_bytes"] = part.per_device_bytes(params)
    row["checkpoint_bytes"], row["non_expert_bytes"] = checkpoint_bytes(cfg)
    kv_shard = cs.kv.shard_shape(cache.kv.shape)       # [L, b_local, slots_local, latent]; dcp splits slots
    per_slot = kv_shard[0] * kv_shard[1] * kv_shard[3] * 2 * kv_shard[2] / compile_context
    for ctx in CONTEXTS:
        row[f"kv_bytes_{ctx // 1000}k"] = int(per_slot * ctx)
    row["temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
    row["argument_bytes"] = int(getattr(mem, "argument_size_in_bytes", 0) or 0)
    coll = hlo_collectives(compiled.as_text())["per_kind"]
    for kind, v in coll.items():
        k = kind.replace("-", "_")
        row[f"{k}_count"], row[f"{k}_bytes"] = int(v["count"]), float(v["bytes"])
    tp = mesh.shape.get("tp") if cell.strategy == "tp_ep" else None
    for name in PROFILES:
        est = roofline.predict_round_time(cfg, roofline.get_profile(name), b * w, compile_context, batch=b,
                                          strategy=cell.strategy, devices=cell.devices, tp=tp)
        row[f"roofline_ms_{name}"] = round(est.total_s * 1e3, 3)
    return row


def _fmt_gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.1f}"


def table(rows: list[dict], devices: int = 8, batches=(1, 64), profile: str = "h200") -> str:
    """Markdown table of the ok cells at ``devices`` for the given batches."""
    head = ("| strategy | mesh | batch | budget | weights GB | KV 32k GB | KV 200k GB | temp GB | all-reduce n / MB "
            "| all-gather n / MB | all-to-all n | other n | roofline " + profile + " ms |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        if r["devices"] != devices or r["batch"] not in batches:
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | {r.get('mesh', '-')} | {r['batch']} | {r['budget']} | "
                         f"{r['status'][:90]} |" + " |" * 8)
            continue
        other = r["reduce_scatter_count"] + r["collective_permute_count"]
        lines.append(
            f"| {r['strategy']} | {r['mesh']} | {r['batch']} | {r['budget']} | {_fmt_gb(r['weight_bytes'])} | "
            f"{_fmt_gb(r['kv_bytes_32k'])} | {_fmt_gb(r['kv_bytes_200k'])} | {_fmt_gb(r['temp_bytes'])} | "
            f"{r['all_reduce_count']} / {r['all_reduce_bytes'] / 1e6:.1f} | "
            f"{r['all_gather_count']} / {r['all_gather_bytes'] / 1e6:.1f} | {r['all_to_all_count']} | {other} | "
            f"{r[f'roofline_ms_{profile}']:.2f} |")
    return "\n".join(lines)


def write(rows: list[dict], out: str = RESULTS) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "sweep.json"), os.path.join(out, "sweep.csv")]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    csv = [",".join(keys)] + [",".join(json.dumps(r.get(k, "")) if isinstance(r.get(k), str) else str(r.get(k, ""))
                                       for k in keys) for r in rows]
    # Each file through a temporary and a rename: an interrupted sweep leaves the previous complete results.
    for path, text in zip(paths, (json.dumps(rows, indent=1), "\n".join(csv) + "\n")):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    paths += plot(rows, out)
    return paths


def plot(rows: list[dict], out: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = [r for r in rows if r["status"] == "ok"]
    paths = []
    for devices in sorted({r["devices"] for r in ok}):
        sub = [r for r in ok if r["devices"] == devices]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for s in STRATEGIES:
            rs = sorted([r for r in sub if r["strategy"] == s], key=lambda r: (r["batch"], r["budget"]))
            if not rs:
                continue
            x = [f"b{r['batch']}/n{r['budget']}" for r in rs]
            axes[0].plot(x, [(r["weight_bytes"] + r["kv_bytes_32k"] + r["temp_bytes"]) / 1e9 for r in rs], "o-",
                         label=s)
            axes[1].plot(x, [r["all_reduce_bytes"] / 1e6 + r["all_gather_bytes"] / 1e6
                             + r["all_to_all_bytes"] / 1e6 + r["reduce_scatter_bytes"] / 1e6 for r in rs], "o-",
                         label=s)
            axes[2].plot(x, [r["roofline_ms_h200"] for r in rs], "o-", label=s)
        axes[0].set_title(f"per-device GB (weights + KV@32k + temporaries), {devices} devices")
        axes[1].set_title("collective MB per step (HLO)")
        axes[2].set_title("roofline ms per verify step, H200")
        for ax in axes:
            ax.tick_params(axis="x", rotation=60)
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        p = os.path.join(out, f"sweep_d{devices}.png")
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


def _parse_cells(filters: list[str]) -> dict:
    allowed = {"strategy": STRATEGIES, "devices": DEVICES, "batch": BATCHES, "budget": BUDGETS}
    out = {}
    for f in filters:
        if "=" not in f:
            raise SystemExit(f"--cells takes key=v1,v2 filters (keys {sorted(allowed)}), got {f!r}")
        k, v = f.split("=", 1)
        if k not in allowed:
            raise SystemExit(f"--cells: unknown key {k!r}; keys are {sorted(allowed)}")
        vals = [x for x in v.split(",") if x]
        out[k] = tuple(vals if k == "strategy" else map(int, vals))
    return out


def _target_sweep(args) -> int:
    from kimi_jax.analysis import target_sweep, targets
    try:
        targets.topology(args.target, args.devices)
        if reason := targets.compiler_missing(args.target):
            raise targets.TargetError(reason)
    except targets.TargetError as e:
        raise SystemExit(f"sweep: {e}") from None
    cells = target_sweep.parse_cells(args.cells)
    from tqdm import tqdm
    bar = tqdm(total=len(cells), desc=f"sweep {args.target} x{args.devices}", unit="cell", file=sys.stderr)

    rows = []
    for cell in cells:
        bar.set_postfix_str(cell.key)
        rows = target_sweep.run(args.target, args.devices, [cell], args.out, mesh=args.mesh)
        bar.update()
    bar.close()
    print(target_sweep.table(rows))
    print(f"\nwrote {os.path.join(args.out, target_sweep.stem_of(args.target, args.devices, args.mesh))}"
          ".{json,csv,md}")
    return 0


def results_dir(out: str | None, partial: bool, merge: bool) -> str:
    """Where a fake-device sweep writes: ``out`` if given; the committed sharding/results for a whole sweep or a
    merge into it; else (a part of a sweep replacing the whole table) $KIMI_JAX_CACHE/sweep."""
    if out:
        return out
    if merge or not partial:
        return RESULTS
    from kimi_jax.decoding.costs import cache_root
    return os.path.join(cache_root(), "sweep")


def main(argv=None) -> int:
    from kimi_jax.cli.exits import run_command
    return run_command("kimi_jax.analysis.sweep", lambda: _sweep(argv))


def _sweep(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_jax.analysis.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one cell: tp, 8 devices, batch 1, budget 16")
    ap.add_argument("--cells", nargs="*", default=[], help="filters like strategy=tp,ep devices=8 batch=1,64")
    ap.add_argument("--out", default=None, help="where results go (default: results_dir)")
    ap.add_argument("--context", type=int, default=COMPILE_CONTEXT,
                    help="latent-cache slots the cells compile with (e.g. 262144: memory at full K2.6 context)")
    ap.add_argument("--merge", action="store_true", help="merge into existing sweep.json instead of replacing")
    ap.add_argument("--target", help="compile for this GPU/TPU with the real compiler (kimi_jax.analysis.targets: "
                    "h100, h200, b200, b300, rtx_pro_6000, v5e, v6e, v5p, tpu7x); cells strategy=, batch=, context=, round=")
    ap.add_argument("--devices", type=int, default=8, help="with --target: how many devices (default 8)")
    ap.add_argument("--mesh", default=None, help="with --target: one mesh for every cell, e.g. tp=8,ep=16 (default: "
                    "each strategy's); results go to <target>_d<devices>_<mesh>")
    args = ap.parse_args(argv)
    if args.target:
        args.out = args.out or RESULTS
        return _target_sweep(args)
    args.out = results_dir(args.out, args.quick or bool(args.cells), args.merge)
    if args.quick:
        cells = [Cell("tp", 8, 1, 16)]
    else:
        f = _parse_cells(args.cells)
        cells = all_cells(f.get("strategy", STRATEGIES), f.get("devices", DEVICES), f.get("batch", BATCHES),
                          f.get("budget", BUDGETS))
    rows = []
    if args.merge and os.path.exists(os.path.join(args.out, "sweep.json")):
        with open(os.path.join(args.out, "sweep.json")) as fh:
            rows = [r for r in json.load(fh) if Cell(r["strategy"], r["devices"], r["batch"], r["budget"])
                    not in set(cells)]
    from tqdm import tqdm
    bar = tqdm(cells, desc="sweep", unit="cell", file=sys.stderr)
    for cell in bar:
        bar.set_postfix_str(cell.key)
        try:
            rows.append(run_cell(cell, compile_context=args.context))
        except Exception as e:   # a cell that fails to compile is a result too; keep going
            rows.append(dict(dataclasses.asdict(cell), status=f"error: {type(e).__name__}: {str(e)[:300]}"))
        write(sorted(rows, key=lambda r: (STRATEGIES.index(r["strategy"]), r["devices"], r["batch"],
                                          r["budget"])), args.out)
    rows.sort(key=lambda r: (STRATEGIES.index(r["strategy"]), r["devices"], r["batch"], r["budget"]))
    paths = write(rows, args.out)
    for d in sorted({c.devices for c in cells}):
        print(f"\n{d} devices\n" + table(rows, d, batches=sorted({c.batch for c in cells})))
    print("\nwrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    # 16 fake CPU devices must be requested before jax is imported.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={max(DEVICES)}").strip()
    from kimi_jax.cli.exits import exit_with, run_command

    def _import_and_run():
        global jax
        import jax  # noqa: E402  (inside run_command: Ctrl-C while JAX loads is handled too)
        return main()

    exit_with(run_command("kimi_jax.analysis.sweep", _import_and_run))
else:
    import jax  # noqa: E402
