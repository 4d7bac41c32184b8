"""Logical axes -> mesh axes: named sharding strategies, mesh helpers and the sharded MoE block.

Every weight declares logical axis names in ``kimi_jax.model.transformer.param_specs`` (layers, vocab, embed,
q_lora, kv_lora, latent, heads, head_dim, mlp, experts, experts_out, expert_mlp, pair); the latent cache is
``kv [layers, batch, slots, latent]`` + ``lengths [batch]``. A *strategy* is a table mapping some of those logical
names to mesh axis names; everything it does not name is replicated. Mesh axes a strategy names but the mesh
lacks are dropped (so ``dp_attn`` works on ``dp=8`` and on ``dp=2,tp=4``).

=========  ==================  ===========================================================================
strategy   mesh (8 devices)    logical axis -> mesh axes
=========  ==================  ===========================================================================
tp         tp=8                heads, mlp, expert_mlp, vocab -> tp. Latent cache, q_a/kv_a, norms, router
                               replicated (the latent cache is not head-split).
ep         ep=8                experts -> ep; attention/dense/shared/vocab TP over the same devices
                               (heads, mlp, vocab -> ep). Each device holds E/8 whole experts.
tp_ep      tp=4,ep=2           experts -> ep, expert_mlp -> tp; heads, mlp, vocab -> (tp, ep).
dp_attn    dp=8 or dp=2,tp=4   batch (cache, activations) -> dp; heads -> tp (attention weights replicated
                               over dp); mlp, expert_mlp, vocab -> (dp, tp).
=========  ==================  ===========================================================================

Attention and dense parts run under plain GSPMD (``jax.jit`` of the model's ``forward`` with these shardings
on the inputs). The MoE block runs in ``jax.shard_map`` (``sharded_moe_block``): every device computes its local
experts (EP: ids not local are remapped to local expert 0 with weight 0) on its local F slice (TP) plus its
slice of the shared expert, then one ``psum`` over the sharded axes, i.e. **one all-reduce per attention block
and one per MoE block** under ``tp``. The model reaches it through a context (``use(mesh, strategy)``) that
``kimi_jax.model.moe.moe_block`` consults (see ``moe_hook``).

Meshes use ``AxisType.Auto`` so the unannotated forward is partitioned by GSPMD propagation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax.config import ModelConfig

AXES = ("tp", "ep", "dp")


class ShardingError(ValueError):
    """A mesh/strategy that cannot shard this model (or a malformed mesh string); the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    rules: tuple[tuple[str, tuple[str, ...]], ...]   # logical axis -> mesh axes (in order)
    doc: str = ""

    def mesh_axes(self, logical: str | None, mesh: Mesh) -> tuple[str, ...]:
        """Mesh axes (present in ``mesh``, size > 1 or not) that ``logical`` maps to."""
        if logical is None:
            return ()
        for name, axes in self.rules:
            if name == logical:
                return tuple(a for a in axes if a in mesh.axis_names)
        return ()

    def table(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rules)


STRATEGIES: dict[str, Strategy] = {
    "tp": Strategy("tp", (("heads", ("tp",)), ("mlp", ("tp",)), ("expert_mlp", ("tp",)), ("vocab", ("tp",))),
                   "heads and expert intermediate over the devices; latent cache replicated"),
    "ep": Strategy("ep", (("experts", ("ep",)), ("heads", ("ep",)), ("mlp", ("ep",)), ("vocab", ("ep",))),
                   "whole experts over the devices (E/d each); attention/dense/shared/lm_head TP"),
    "tp_ep": Strategy("tp_ep", (("experts", ("ep",)), ("expert_mlp", ("tp",)), ("heads", ("tp", "ep")),
                                ("mlp", ("tp", "ep")), ("vocab", ("tp", "ep"))),
                      "experts over ep, each expert's intermediate over tp; attention TP over all devices"),
    "dp_attn": Strategy("dp_attn", (("batch", ("dp",)), ("heads", ("tp",)), ("mlp", ("dp", "tp")),
                                    ("expert_mlp", ("dp", "tp")), ("vocab", ("dp", "tp"))),
                        "sequences split over dp for attention and the latent cache; MoE/dense TP over all"),
}

DEFAULT_MESH = {"tp": "tp={n}", "ep": "ep={n}", "tp_ep": "tp={h},ep=2", "dp_attn": "dp={n}"}


def get_strategy(strategy: str | Strategy) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if strategy not in STRATEGIES:
        raise ShardingError(f"unknown sharding strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[strategy]


# ---- meshes -------------------------------------------------------------------------------------------------

def parse_mesh(spec: str) -> dict[str, int]:
    """'tp=4,ep=2' -> {'tp': 4, 'ep': 2} (order kept: it is the mesh's axis order)."""
    out: dict[str, int] = {}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        m = re.fullmatch(r"([a-z_]+)\s*=\s*(\d+)", part)
        if not m:
            raise ShardingError(f"bad mesh {spec!r}: write axis=size pairs separated by commas, e.g. 'tp=8' or "
                                "'tp=4,ep=2' or 'dp=2,tp=4'")
        name, size = m.group(1), int(m.group(2))
        if name not in AXES:
            raise ShardingError(f"bad mesh {spec!r}: unknown axis {name!r}; mesh axes are {AXES}")
        if name in out:
            raise ShardingError(f"bad mesh {spec!r}: axis {name!r} given twice")
        if size < 1:
            raise ShardingError(f"bad mesh {spec!r}: axis {name!r} has size {size}; sizes must be >= 1")
        out[name] = size
    if not out:
        raise ShardingError(f"empty mesh {spec!r}: e.g. 'tp=8'")
    return out


def make_mesh(spec: str | dict | Mesh, devices=None) -> Mesh:
    """A mesh from 'tp=8' / 'tp=4,ep=2' / 'dp=2,tp=4' over the first prod(sizes) devices (all processes')."""
    if isinstance(spec, Mesh):
        return spec
    axes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    n = math.prod(axes.values())
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        raise ShardingError(
            f"mesh {format_mesh(axes)} needs {n} devices but {len(devices)} are visible; use a smaller mesh, or "
            f"more devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax; "
            "across hosts: jax.distributed.initialize())")
    arr = np.asarray(devices[:n], dtype=object).reshape(tuple(axes.values()))
    return Mesh(arr, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def format_mesh(mesh: Mesh | dict) -> str:
    shape = dict(mesh) if isinstance(mesh, dict) else dict(mesh.shape)
    return ",".join(f"{k}={v}" for k, v in shape.items())


def default_mesh_spec(strategy: str, devices: int) -> str:
    return DEFAULT_MESH[strategy].format(n=devices, h=max(devices // 2, 1))


def infer_strategy(mesh: Mesh) -> str:
    names = set(mesh.axis_names)
    if "dp" in names:
        return "dp_attn"
    if names == {"tp", "ep"}:
        return "tp_ep"
    if names == {"ep"}:
        return "ep"
    if names == {"tp"}:
        return "tp"
    raise ShardingError(f"cannot infer a strategy from mesh axes {mesh.axis_names}; pass strategy=")


def _axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(axes, mesh: Mesh, strategy: str | Strategy) -> P:
    """Logical axis names (None = unnamed) -> PartitionSpec; a mesh axis may be used once per array."""
    st = get_strategy(strategy)
    parts, used = [], set()
    for a in axes:
        m = tuple(x for x in st.mesh_axes(a, mesh) if x not in used)
        used.update(m)
        parts.append(None if not m else m[0] if len(m) == 1 else m)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


# ---- parameters and cache -----------------------------------------------------------------------------------

_FIX = {
    "heads": "divides the attention heads",
    "experts": "divides the routed experts",
    "expert_mlp": "divides moe_intermediate_size",
    "mlp": "divides the MLP widths",
    "vocab": "divides vocab_size",
}


def _check_divides(path: str, shape, axes, spec: P, mesh: Mesh):
    for i, (dim, logical) in enumerate(zip(shape, axes)):
        part = spec[i] if i < len(spec) else None
        if part is None:
            continue
        mesh_axes = (part,) if isinstance(part, str) else tuple(part)
        n = _axis_size(mesh, mesh_axes)
        if dim % n:
            raise ShardingError(
                f"mesh {format_mesh(mesh)}: {path} axis {logical!r} has size {dim}, which mesh axis "
                f"{'x'.join(mesh_axes)} of size {n} does not divide; use a mesh whose {'x'.join(mesh_axes)} size "
                f"{_FIX.get(logical, 'divides it')} (or another strategy)")


def _spec_leaves(cfg: ModelConfig):
    from kimi_jax.model.transformer import ParamSpec, param_specs
    specs = param_specs(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    return specs, flat, treedef


def param_partition_specs(cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy) -> Any:
    """PartitionSpec of every weight (same tree as ``param_specs``), checking that the mesh divides them."""
    st = get_strategy(strategy)
    _, flat, treedef = _spec_leaves(cfg)
    out = []
    for path, s in flat:
        name = jax.tree_util.keystr(path)
        spec = logical_to_spec(s.axes, mesh, st)
        _check_divides(name, s.shape, s.axes, spec, mesh)
        out.append(spec)
    _check_int4(cfg, mesh, st)
    return jax.tree.unflatten(treedef, out)


def _check_int4(cfg: ModelConfig, mesh: Mesh, st: Strategy):
    if not cfg.int4_experts:
        return
    from kimi_jax.ops.int4_format import CHUNK
    n = _axis_size(mesh, st.mesh_axes("expert_mlp", mesh))
    if n > 1:
        fp = -(-cfg.moe_intermediate_size // CHUNK) * CHUNK
        if fp % n or (fp // n) % CHUNK:
            raise ShardingError(
                f"mesh {format_mesh(mesh)}: INT4 experts need each device's slice of moe_intermediate_size "
                f"({cfg.moe_intermediate_size}, padded {fp}) split {n} ways to be a multiple of {CHUNK}; use a "
                f"smaller tp for the experts, strategy 'ep', or float experts")


def param_shardings(cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy | None = None) -> Any:
    """NamedSharding of every weight, the same pytree as ``param_specs(cfg)`` / the params."""
    strategy = strategy or infer_strategy(mesh)
    return jax.tree.map(lambda p: NamedSharding(mesh, p), param_partition_specs(cfg, mesh, strategy),
                        is_leaf=lambda x: isinstance(x, P))


CACHE_AXES = {"kv": ("layers", "batch", "slots", "latent"), "lengths": ("batch",)}


def check_batch(batch: int, mesh: Mesh, strategy: str | Strategy | None = None):
    st = get_strategy(strategy or infer_strategy(mesh))
    n = _axis_size(mesh, st.mesh_axes("batch", mesh))
    if batch % n:
        raise ShardingError(f"mesh {format_mesh(mesh)}: batch {batch} is not divisible by the batch axis of size "
                            f"{n} ({st.name}); use a batch that is a multiple of {n}, or a smaller dp")


def cache_sharding(cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy | None = None, batch: int | None = None):
    """KVCache of NamedShardings: kv [layers, batch, slots, latent], lengths [batch]."""
    from kimi_jax.cache import KVCache
    st = get_strategy(strategy or infer_strategy(mesh))
    if batch is not None:
        check_batch(batch, mesh, st)
    return KVCache(kv=NamedSharding(mesh, logical_to_spec(CACHE_AXES["kv"], mesh, st)),
                   lengths=NamedSharding(mesh, logical_to_spec(CACHE_AXES["lengths"], mesh, st)))


def batch_sharding(mesh: Mesh, strategy: str | Strategy | None = None, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] activation / token array."""
    st = get_strategy(strategy or infer_strategy(mesh))
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), mesh, st))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_params(params, cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy | None = None):
    """Place a params pytree (numpy or jax arrays, identical on every process) onto the mesh."""
    shardings = param_shardings(cfg, mesh, strategy)

    def put(x, s):
        if jax.process_count() == 1:
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, params, shardings)


def abstract_sharded_params(cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy | None = None,
                            dtype=jnp.bfloat16):
    """ShapeDtypeStructs with shardings: AOT lowering of the sharded model without allocating weights."""
    from kimi_jax.model.transformer import abstract_params
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params(cfg, dtype), param_shardings(cfg, mesh, strategy))


def per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs / arrays (the largest shard)."""
    total = 0
    for a in jax.tree.leaves(abstract_tree):
        shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return total


# ---- the model's mesh context and the sharded MoE ------------------------------------------------------------

_CURRENT: list[tuple[Mesh, Strategy]] = []


@contextlib.contextmanager
def use(mesh: Mesh | str | None, strategy: str | Strategy | None = None):
    """Trace the model under this mesh: MoE blocks run in shard_map (via ``moe_hook``). ``mesh=None``: no-op."""
    if mesh is None:
        yield None
        return
    mesh = make_mesh(mesh)
    st = get_strategy(strategy or infer_strategy(mesh))
    _CURRENT.append((mesh, st))
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _CURRENT.pop()


def current() -> tuple[Mesh, Strategy] | None:
    return _CURRENT[-1] if _CURRENT else None


def moe_hook(x, p, cfg: ModelConfig):
    """What ``moe_block`` calls first: the sharded block under ``use(mesh)``, else None (single device)."""
    ctx = current()
    if ctx is None or ctx[0].size == 1:
        return None
    return sharded_moe_block(x, p, cfg, *ctx)


def _local_index(axes: tuple[str, ...], mesh: Mesh):
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
    return idx


def _local_routed(x, ids, weights, experts, cfg: ModelConfig, ep_axes, mesh):
    """Inside shard_map: this device's experts (EP) on its F slice (TP); a partial sum over the sharded axes."""
    if ep_axes:
        n_local = experts["gate"].shape[-3] if isinstance(experts, dict) else experts.num_experts
        lo = _local_index(ep_axes, mesh) * n_local
        local = (ids >= lo) & (ids < lo + n_local)
        ids = jnp.where(local, ids - lo, 0)
        weights = jnp.where(local, weights, 0.0)
    if isinstance(experts, dict):
        from kimi_jax.model.moe import float_routed_experts
        return float_routed_experts(x, ids, weights, experts)
    from kimi_jax.ops.int4_moe import int4_moe
    return int4_moe(x, ids, weights, experts, impl=cfg.moe_impl)


def _layer_specs(tree_axes, mesh, st):
    return jax.tree.map(lambda axes: logical_to_spec(axes, mesh, st), tree_axes,
                        is_leaf=lambda a: isinstance(a, tuple) and all(isinstance(s, (str, type(None))) for s in a))


def _moe_axes(cfg: ModelConfig):
    """Per-layer logical axes (no leading 'layers') of the routed experts and the shared expert."""
    from kimi_jax.model.transformer import _layer_specs as specs
    moe = specs(cfg, 1, moe=True)["moe"]
    strip = lambda t: jax.tree.map(lambda s: s.axes[1:], t, is_leaf=lambda s: hasattr(s, "axes"))
    return strip(moe["experts"]), strip(moe["shared"])


def sharded_routed_experts(x, ids, weights, experts, cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy,
                           shared=None):
    """``routed_experts`` under a mesh: x [n, d], ids/weights [n, k] (replicated) -> [n, d] replicated.

    Each device runs its local experts (ids not on it masked to weight 0) on its local expert_mlp slice,
    adds its slice of the shared expert when ``shared`` is given (and sharded over the same axes), then one
    psum over the sharded axes. INT4 experts go through ``kimi_jax.ops.int4_moe`` (cfg.moe_impl).
    """
    st = get_strategy(strategy)
    exp_axes, shared_axes = _moe_axes(cfg)
    ex_specs = _layer_specs(exp_axes, mesh, st)
    ep_axes = st.mesh_axes("experts", mesh)
    sum_axes = tuple(a for a in mesh.axis_names if a in ep_axes + st.mesh_axes("expert_mlp", mesh))
    with_shared = shared is not None and set(st.mesh_axes("mlp", mesh)) == set(sum_axes)
    sh_specs = _layer_specs(shared_axes, mesh, st) if with_shared else None

    def body(x, ids, weights, experts, shared):
        y = _local_routed(x, ids, weights, experts, cfg, ep_axes, mesh)
        if shared is not None:
            from kimi_jax.model.layers import swiglu
            y = y + swiglu(x, shared["gate"], shared["up"], shared["down"]).astype(jnp.float32)
        y = y.astype(x.dtype)
        return jax.lax.psum(y, sum_axes) if sum_axes else y

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), ex_specs, sh_specs), out_specs=P(),
                       check_vma=False)
    y = fn(x, ids, weights, experts, shared if with_shared else None)
    if shared is not None and not with_shared:
        from kimi_jax.model.layers import swiglu
        y = y + swiglu(x, shared["gate"], shared["up"], shared["down"])
    return y


def sharded_moe_block(x, p, cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy):
    """``moe_block`` under a mesh: routing replicated (GSPMD), experts + shared expert in one shard_map and
    one psum."""
    from kimi_jax.model.moe import route
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    ids, weights = route(flat, p["router"], p["router_bias"], cfg)
    y = sharded_routed_experts(flat, ids, weights, p["experts"], cfg, mesh, strategy, shared=p["shared"])
    return y.reshape(shape)


# ---- reading collectives from compiled HLO --------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\))?.*\{\s*$")


def _shape_bytes(text: str) -> float:
    total = 0.0
    for dt, dims in _SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DT_BYTES.get(dt, 4)
    return total


def hlo_collectives(hlo: str) -> dict:
    """Collectives of an optimized HLO module, weighted by how often each runs.

    Each computation's multiplicity is the sum over its callers of (caller multiplicity x trip count when
    it is a while body with a ``known_trip_count``); the layer scans are while loops, so a collective in the
    MoE scan body counts ``num_moe_layers`` times. Bytes are result bytes, at the source dtype for all-reduces
    that the CPU backend promoted from bf16 to f32. Returns {"per_kind": {kind: {"count", "bytes"}},
    "sites": [(kind, computation, multiplicity, bytes)]}. Async pairs (``-start``/``-done``) count once.
    """
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        s = line.strip()
        if cur is None:
            if s.endswith("{") and not s.startswith("HloModule"):
                m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", s)
                if m:
                    cur = m.group(2)
                    comps[cur] = []
                    if m.group(1):
                        entry = cur
            continue
        if s == "}":
            cur = None
            continue
        comps[cur].append(s)
    calls: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}   # callee -> [(caller, factor)]
    for c, lines in comps.items():
        for s in lines:
            trip = 1
            if " while(" in s:
                m = re.search(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)', s)
                trip = int(m.group(1)) if m else 1
            for key, braced, single in re.findall(r"\b(body|condition|to_apply|calls|branch_computations|"
                                                  r"true_computation|false_computation|called_computations)="
                                                  r"(?:\{([^}]*)\}|%?([\w.\-]+))", s):
                for name in re.split(r",\s*", braced or single):
                    name = name.strip().lstrip("%")
                    if name in calls:
                        calls[name].append((c, trip if key == "body" else 1))
    mult: dict[str, int] = {}

    def multiplicity(c, depth=0):
        if c in mult:
            return mult[c]
        if c == entry or depth > 50:
            mult[c] = 1
            return 1
        m = sum(multiplicity(caller, depth + 1) * f for caller, f in calls.get(c, []))
        mult[c] = m
        return m

    per_kind = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    sites = []
    for c, lines in comps.items():
        for s in lines:
            m = re.match(r"^%?[\w.\-]+\s*=\s*(.*?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(", s)
            if not m:
                continue
            kind = m.group(2)
            nbytes = _shape_bytes(m.group(1))
            if m.group(3):   # async start: result is a tuple (operands, outputs); count the output half
                nbytes /= 2
            if kind == "all-reduce" and "_promoted" in s and m.group(1).startswith("f32"):
                nbytes /= 2  # the CPU backend promotes bf16 all-reduces to f32 (to_apply=..._promoted); GPU keeps bf16
            k = multiplicity(c)
            per_kind[kind]["count"] += k
            per_kind[kind]["bytes"] += k * nbytes
            sites.append((kind, c, k, nbytes))
    return {"per_kind": per_kind, "sites": sites}
