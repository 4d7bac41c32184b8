"""The sweep on real compilers: full-size K2.6 rounds compiled for a GPU or TPU target from this CPU.

    python -m sharding.sweep --target h200 --devices 8            # every cell below, 8 compile-only H200s
    python -m sharding.sweep --target b200 --devices 8 --cells strategy=tp batch=1 context=262144

A cell is (strategy, batch, context, round): ``round`` is ``ar`` (one plain decoding step) or ``ddtree<N>`` (one
whole DDTree round with the K2.6 DFlash drafter: draft, build a tree of N nodes, verify, accept, commit). It is
lowered from abstract sharded weights and state (``compile_round``; nothing allocated)
on a compile-only mesh of the target (``kimi_jax.analysis.targets.compile_mesh``) with the kernels the target
gets (``Runtime`` impl "auto") and compiled by XLA's real GPU compiler or libtpu, with the options kimi_jax
compiles with (``kimi_jax.config.compile_options``). Per device it records:

* memory from ``compiled.memory_analysis()``: arguments (weights, drafter, cache, state), temporaries, outputs
  not aliased to the donated state, and whether their sum fits the device (the target spec's memory);
* collectives from the compiled HLO (kind, count per round, bytes; ``kimi_jax.analysis.hlo``);
* GPU targets: what one round launches, from XLA's thunk sequence (``kimi_jax.analysis.thunks``): GPU ops,
  how many run inside command buffers, host submissions, blocking host syncs, device-to-device copy bytes,
  and GPU ops per named scope;
* TPU targets: libtpu's cost analysis (flops, bytes accessed);
* compile time on this CPU.

These are facts about the compiled programs (memory, collectives, launches), not timings: projecting time is
the roofline's job (``kimi_jax.analysis.roofline``). Results: ``sharding/results/<target>_d<devices>.{json,csv}``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import time

import jax

from kimi_jax import sharding as part
from kimi_jax.model.params import abstract_sharded_params, param_shardings
from kimi_jax.analysis import targets, thunks

STRATEGIES = tuple(part.STRATEGIES)
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "sharding",
                       "results")
BATCHES = (1, 64)
CONTEXTS = (4096, 262_144)
ROUNDS = ("ar", "ddtree16")
# jax.named_scope names of the model and the round (kimi_jax.model, decoding.engine): GPU ops are counted per path
SCOPES = ("embed", "attention", "qkv_proj", "rope", "cache_write", "attend", "o_proj", "norm", "router",
          "experts", "shared_expert", "dense_mlp", "head", "drafter", "draft", "build_tree", "choose_width",
          "verify", "accept", "commit")


@dataclasses.dataclass(frozen=True)
class Cell:
    strategy: str
    batch: int
    context: int
    round: str                 # "ar" | "ddtree<nodes>"

    @property
    def key(self) -> str:
        return f"{self.strategy}/b{self.batch}/ctx{self.context}/{self.round}"

    @property
    def budget(self) -> int:
        return 0 if self.round == "ar" else int(self.round.removeprefix("ddtree"))


def compile_round(cfg, dcfg, mesh, strategy: str = "tp", method: str = "ddtree", batch: int = 1, budget: int = 16,
                  context: int = 4096, options: dict | None = None, compile=None, split: bool | None = None,
                  impl: str = "auto"):
    """Lower one whole decoding round of target ``cfg`` on ``mesh`` from abstract sharded weights and an abstract
    state (nothing is allocated) and compile it: ``method="ddtree"`` is draft, build tree, verify, accept, commit
    with drafter ``dcfg`` (replicated, as its feature cache); ``"ar"`` is one plain decoding step. The state is
    donated, as the generate loop carries it. ``mesh``: fake CPU devices (``kimi_jax.sharding.make_mesh``) or a
    compile-only mesh of a GPU/TPU target (``kimi_jax.analysis.targets.compile_mesh``); ``compile(lowered) ->
    (compiled, extra dict)`` replaces ``lowered.compile(options)`` (e.g. ``thunks.compile_dumped``). ``split``:
    per-layer weight buffers (True) or stacked layer scans (False); None: what kimi_jax runs on the mesh's
    platform (``kimi_jax.model.compute_layout.own_buffers``). ``impl``: both kernels' ``Runtime`` choice.
    Returns (compiled, sizes: per-device weight / drafter / feature-cache / latent-cache bytes, compile_s)."""
    from kimi_jax.config import Runtime
    from kimi_jax.decoding import drafter as dflash
    from kimi_jax.decoding import engine
    from kimi_jax.model.compute_layout import own_buffers, split_stacks

    jnp = jax.numpy
    rt = Runtime(moe_impl=impl, attn_impl=impl, mesh=mesh, strategy=strategy)
    if method == "ar":
        dcfg, spec = None, engine.Spec(cfg, "ar", 0, False, rt=rt)
    else:
        spec = engine.Spec(cfg, "ddtree", budget, False, dcfg, dcfg.block_size, rt=rt)
    # the weights in the layout kimi_jax runs on the mesh's platform (per-layer buffers on GPUs)
    if split is None:
        split = own_buffers(cfg.num_hidden_layers, mesh.devices.flat[0].platform, sharded=True)
    params = split_stacks(abstract_sharded_params(cfg, mesh, strategy), split=split)
    rep = part.replicated(mesh)
    dparams = None if dcfg is None else dflash.compute_params(jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=rep), dflash.param_shapes(dcfg),
        is_leaf=lambda x: isinstance(x, tuple)), mesh, split, strategy)
    inputs = engine.Inputs(params, dparams, prompt=jax.ShapeDtypeStruct((batch, 16), jnp.int32),
                           lens=jax.ShapeDtypeStruct((batch,), jnp.int32),
                           temperature=jax.ShapeDtypeStruct((), jnp.float32),
                           seed=jax.ShapeDtypeStruct((), jnp.uint32))
    with part.mesh_context(mesh):
        state, _ = jax.eval_shape(functools.partial(engine.prefill, spec=spec, max_new=64, max_len=context), inputs)
        cs = part.cache_sharding(cfg, mesh, strategy, batch=batch)
        shardings = jax.tree.map(lambda _: rep, state).replace(cache=cs)
        if dcfg is not None:        # the feature cache split as the drafter's weights (drafter.feature_sharding)
            shardings = shardings.replace(drafter=dflash.feature_sharding(dcfg, mesh, strategy))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
        t0 = time.perf_counter()
        step = jax.jit(engine.round_step, static_argnames=("spec",), donate_argnames=("state",))
        lowered = step.lower(params, dparams, spec=spec, state=state)
        compiled, extra = compile(lowered) if compile else (lowered.compile(options), {})
    sizes = dict(layers="per-layer" if isinstance(params["moe_layers"], tuple) else "stacked",
                 weight_bytes=part.per_device_bytes(params), kv_bytes=part.per_device_bytes(state.cache.kv),
                 drafter_bytes=0 if dparams is None else part.per_device_bytes(dparams),
                 feature_cache_bytes=0 if state.drafter is None else part.per_device_bytes(state.drafter),
                 compile_s=round(time.perf_counter() - t0, 1), **extra)
    return compiled, sizes


def all_cells(strategies=STRATEGIES, batches=BATCHES, contexts=CONTEXTS, rounds=ROUNDS) -> list[Cell]:
    return [Cell(*c) for c in itertools.product(strategies, batches, contexts, rounds)]


def run_cell(target: str, devices: int, cell: Cell, cfg=None, dcfg=None, split: bool | None = None,
             mesh_spec: str | None = None) -> dict:
    """Compile one cell for ``devices`` devices of ``target``; {"status": "ok" | "n/a: reason" | "error: ...",
    ...} with the measurements of the module docstring. ``cfg``/``dcfg``: target and drafter (K2.6 and its
    DFlash drafter); ``split``: weight layout (``compile_round``; None: what kimi_jax runs on the target);
    ``mesh_spec``: the mesh (default: the strategy's, ``sharding.default_mesh_spec``)."""
    from kimi_jax.config import compile_options
    from kimi_jax.analysis.hlo import hlo_collectives
    from kimi_jax.config import KIMI_K26
    from kimi_jax.decoding import drafter as dflash

    t = targets.get_target(target)
    cfg = cfg or KIMI_K26
    dcfg = dcfg or dflash.PRESETS["kimi-k2.6-dflash"]
    mesh_spec = mesh_spec or part.default_mesh_spec(cell.strategy, devices)
    row = dict(dataclasses.asdict(cell), target=t.name, devices=devices, mesh=mesh_spec, status="ok")
    try:
        mesh = targets.compile_mesh(t, devices, mesh_spec)
        part.cache_sharding(cfg, mesh, cell.strategy, batch=cell.batch)     # batch / axis checks
        param_shardings(cfg, mesh, cell.strategy)
    except part.ShardingError as e:
        return {**row, "status": f"n/a: {e}"}
    # Spills are not errors here: XLA's own fusions may spill a few bytes (tp_ep's DDTree round on H200: 12 bytes
    # in a routing gather fusion), which says nothing of our kernels; tests/test_targets.py compiles those with
    # spills as errors.
    options = {**compile_options(t.platform), **targets.compiler_options(t, spills_are_errors=False)}
    if t.platform == "cuda":
        def compile_fn(lowered):
            return thunks.compile_dumped(lowered, options, SCOPES)
    else:
        def compile_fn(lowered):
            return lowered.compile(options), {}
    with targets.lowering_for(mesh):
        compiled, sizes = compile_round(cfg, dcfg, mesh, cell.strategy, "ar" if cell.round == "ar" else "ddtree",
                                              cell.batch, max(cell.budget, 1), cell.context, compile=compile_fn,
                                              split=split)
    launches = {k: sizes.pop(k) for k in list(sizes) if k in ("gpu_ops", "in_graphs", "host_launches", "host_syncs",
                                                             "graphs", "copy_bytes", "unknown_loops", "by_scope")}
    row.update(sizes)
    mem = compiled.memory_analysis()
    for k in ("argument", "output", "alias", "temp", "generated_code"):
        row[f"{k}_bytes"] = int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
    row["device_bytes"] = (row["argument_bytes"] + row["temp_bytes"] + row["output_bytes"] - row["alias_bytes"]
                           + row["generated_code_bytes"])
    row["memory_bytes"] = t.memory_bytes
    row["fits"] = row["device_bytes"] <= t.memory_bytes
    for kind, v in hlo_collectives(compiled.as_text())["per_kind"].items():
        k = kind.replace("-", "_")
        row[f"{k}_count"], row[f"{k}_bytes"] = int(v["count"]), float(v["bytes"])
    if launches:
        row.update(launches)
    if t.platform == "tpu":
        # static counts in the HLO: a layer scan's body (TPUs keep stacked layers) is counted once
        row["tpu_kernels"] = compiled.as_text().count(targets.TPU_CALL)
        cost = compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        row["flops"] = float(cost.get("flops", 0.0))
        row["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    return row


def _gb(x) -> str:
    return f"{x / 1e9:.1f}"


def _other_collectives(r: dict) -> int:
    return sum(r.get(f"{k}_count", 0) for k in ("all_gather", "reduce_scatter", "all_to_all", "collective_permute"))


def _fit(r: dict) -> str:
    return "yes" if r["fits"] else f"no (+{_gb(r['device_bytes'] - r['memory_bytes'])} GB)"


# A table's columns after the cell's own (header, cell text of an "ok" row): memory and collectives for every
# target, then GPU cells' launches per round or TPU cells' Pallas TPU kernels in the HLO (a layer scan's body
# counted once) and libtpu's cost analysis
_MEMORY = [("args GB", lambda r: _gb(r["argument_bytes"])), ("temp GB", lambda r: _gb(r["temp_bytes"])),
           ("total GB / device", lambda r: _gb(r["device_bytes"])), ("fits", _fit)]
_GPU_COLUMNS = _MEMORY + [
    ("all-reduce n", lambda r: r.get("all_reduce_count", 0)), ("other collectives n", _other_collectives),
    ("GPU ops", lambda r: r.get("gpu_ops", "-")), ("host launches", lambda r: r.get("host_launches", "-")),
    ("host syncs", lambda r: r.get("host_syncs", "-")),
    ("copies GB", lambda r: _gb(r["copy_bytes"]) if "copy_bytes" in r else "-"),
    ("compile s", lambda r: r["compile_s"])]
_TPU_COLUMNS = _MEMORY + [
    ("all-reduce n (HLO)", lambda r: r.get("all_reduce_count", 0)), ("other collectives n", _other_collectives),
    ("Pallas TPU kernels (HLO)", lambda r: r.get("tpu_kernels", "-")),
    ("GFLOP (cost analysis)", lambda r: f"{r.get('flops', 0) / 1e9:.1f}"), ("compile s", lambda r: r["compile_s"])]


def table(rows: list[dict]) -> str:
    """Markdown table of the cells: per-device memory, fit, collectives, launches per round (TPU cells: the mesh,
    the Pallas TPU kernels and libtpu's FLOPs), compile time."""
    tpu = any(r.get("target") in targets.TARGETS and targets.get_target(r["target"]).platform == "tpu" for r in rows)
    keys = ("mesh",) * tpu + ("strategy", "batch", "context", "round")
    columns = _TPU_COLUMNS if tpu else _GPU_COLUMNS
    head = "| " + " | ".join([*keys, *(h for h, _ in columns)]) + " |"
    lines = [head, "|" + "|".join(["---"] * (len(keys) + len(columns))) + "|"]
    for r in rows:
        lead = "| " + " | ".join(str(r.get(k, "")) for k in keys) + " |"
        if r["status"] != "ok":
            lines.append(lead + f" {r['status'][:100]} |" + " |" * (len(columns) - 1))
        else:
            lines.append(lead + "".join(f" {cell(r)} |" for _, cell in columns))
    return "\n".join(lines)


def write(rows: list[dict], target: str, devices: int, out: str = RESULTS, mesh: str | None = None) -> list[str]:
    """``<target>_d<devices>.json`` / ``.csv`` / ``.md`` under ``out``, each written through a rename."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, stem_of(target, devices, mesh))
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "by_scope"))
    csv = [",".join(keys)] + [",".join(json.dumps(r.get(k, "")) if isinstance(r.get(k), str) else str(r.get(k, ""))
                                       for k in keys) for r in rows]
    texts = {".json": json.dumps(rows, indent=1), ".csv": "\n".join(csv) + "\n",
             ".md": f"# {target} x {devices}: K2.6 rounds compiled by the real compiler\n\n{table(rows)}\n"}
    for ext, text in texts.items():
        with open(stem + ext + ".tmp", "w") as f:
            f.write(text)
        os.replace(stem + ext + ".tmp", stem + ext)
    return [stem + ext for ext in texts]


def parse_cells(filters: list[str]) -> list[Cell]:
    allowed = {"strategy": STRATEGIES, "batch": BATCHES, "context": CONTEXTS, "round": ROUNDS}
    chosen = dict(allowed)
    for f in filters:
        k, sep, v = f.partition("=")
        if not sep or k not in allowed:
            raise SystemExit(f"--cells takes key=v1,v2 filters with keys {sorted(allowed)}, got {f!r}")
        vals = [x for x in v.split(",") if x]
        try:
            chosen[k] = tuple(vals if k in ("strategy", "round") else map(int, vals))
        except ValueError:
            raise SystemExit(f"--cells {k}: integers expected, got {v!r}") from None
    bad = [r for r in chosen["round"] if r != "ar" and not (r.startswith("ddtree") and r[6:].isdigit())]
    bad += [s for s in chosen["strategy"] if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"--cells: unknown {bad}; strategies {STRATEGIES}, rounds 'ar' or 'ddtree<nodes>'")
    return all_cells(chosen["strategy"], chosen["batch"], chosen["context"], chosen["round"])


def failure(e: Exception) -> str:
    """A cell's failed compile in one line; libtpu's refusal to compile past the device's HBM
    (CompileTimeHbmOom) says by how much it misses."""
    oom = re.search(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", str(e))
    if oom:
        need, have = map(float, oom.groups())
        return f"no fit: libtpu needs {need:.1f} GB of the device's {have:.1f} GB (misses by {need - have:.1f} GB)"
    return f"error: {type(e).__name__}: {str(e)[:300]}"


def stem_of(target: str, devices: int, mesh: str | None = None) -> str:
    """A results file's name: ``<target>_d<devices>``, and the mesh when it is not the strategies' default."""
    return f"{target}_d{devices}" + (f"_{mesh.replace('=', '').replace(',', '_')}" if mesh else "")


def run(target: str, devices: int, cells: list[Cell], out: str = RESULTS, merge: bool = True,
        mesh: str | None = None) -> list[dict]:
    """Compile ``cells``, writing results after each (an interrupted sweep keeps what it finished); with
    ``merge`` the file's other cells are kept. ``mesh``: one mesh for every cell (its strategy's rules apply)."""
    path = os.path.join(out, stem_of(target, devices, mesh) + ".json")
    rows = []
    if merge and os.path.exists(path):
        with open(path) as fh:
            keys = {c.key for c in cells}
            rows = [r for r in json.load(fh) if Cell(r["strategy"], r["batch"], r["context"], r["round"]).key
                    not in keys]
    order = {c.key: i for i, c in enumerate(all_cells())}
    for cell in cells:
        try:
            rows.append(run_cell(target, devices, cell, mesh_spec=mesh))
        except Exception as e:   # a cell the compiler rejects is a result too; keep going
            rows.append(dict(dataclasses.asdict(cell), target=target, devices=devices,
                             mesh=mesh or part.default_mesh_spec(cell.strategy, devices), status=failure(e)))
        rows.sort(key=lambda r: order.get(Cell(r["strategy"], r["batch"], r["context"], r["round"]).key, 1 << 30))
        write(rows, target, devices, out, mesh)
    jax.clear_caches()
    return rows
