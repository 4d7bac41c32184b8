"""Logical axes -> mesh axes: named sharding strategies, meshes, and the shardings of the cache.

Every weight declares logical axis names in ``kimi_jax.model.params.param_specs`` (layers, vocab, embed,
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
on the inputs). The MoE block runs in ``jax.shard_map`` (``kimi_jax.model.moe``, given the mesh explicitly as
``Runtime.mesh``): every device computes its local experts on its local F slice plus its slice of the shared
expert, then one ``psum`` over the sharded axes, i.e. **one all-reduce per attention block and one per MoE
block** under ``tp``. This module knows no weight: the weights' shardings are ``kimi_jax.model.params``'s
(``param_shardings``), which maps its table through these strategies.

Meshes use ``AxisType.Auto`` so the unannotated forward is partitioned by GSPMD propagation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax.cache import KVCache
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
    "dcp": Strategy("dcp", (("heads", ("tp",)), ("mlp", ("tp",)), ("expert_mlp", ("tp",)), ("vocab", ("tp",)),
                            ("slots", ("tp",))),
                    "tp, plus the latent cache split by position over the same devices (decode context parallel)"),
}

DEFAULT_MESH = {"tp": "tp={n}", "ep": "ep={n}", "tp_ep": "tp={h},ep=2", "dp_attn": "dp={n}", "dcp": "tp={n}"}


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


def axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def shard_index(axes: tuple[str, ...], mesh: Mesh):
    """Inside ``jax.shard_map``: this device's position along ``axes`` taken together (the first axis the most
    significant, as a PartitionSpec entry of several axes splits an array)."""
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
    return idx


def mlp_split(mesh: Mesh | None, strategy: str | Strategy | None, width: str | None = "mlp") -> dict:
    """How an MLP of hidden width ``width`` (a logical axis, or None: not split) runs in ``jax.shard_map`` on
    ``mesh`` (``model.layers.residual_swiglu``'s arguments; none without a mesh of several devices): ``mlp_axes``
    its width is split over and the ``rows_spec`` of its rows, split as "batch" unless the batch shares a mesh axis
    with the width (dp_attn splits both over "dp": the rows are then gathered, as the partitioner gathers them)."""
    if mesh is None or mesh.size == 1:
        return {}
    st = get_strategy(strategy or infer_strategy(mesh))
    mlp_axes = st.mesh_axes(width, mesh)
    batch = st.mesh_axes("batch", mesh)
    rows = P() if set(batch) & set(mlp_axes) else logical_to_spec(("batch", None, None), mesh, st)
    return dict(mesh=mesh, mlp_axes=mlp_axes, rows_spec=rows)


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


def check_divides(path: str, shape, axes, spec: P, mesh: Mesh):
    for i, (dim, logical) in enumerate(zip(shape, axes)):
        part = spec[i] if i < len(spec) else None
        if part is None:
            continue
        mesh_axes = (part,) if isinstance(part, str) else tuple(part)
        n = axis_size(mesh, mesh_axes)
        if dim % n:
            raise ShardingError(
                f"mesh {format_mesh(mesh)}: {path} axis {logical!r} has size {dim}, which mesh axis "
                f"{'x'.join(mesh_axes)} of size {n} does not divide; use a mesh whose {'x'.join(mesh_axes)} size "
                f"{_FIX.get(logical, 'divides it')} (or another strategy)")


CACHE_AXES = {"kv": ("layers", "batch", "slots", "latent"), "lengths": ("batch",)}


def check_batch(batch: int, mesh: Mesh, strategy: str | Strategy | None = None):
    st = get_strategy(strategy or infer_strategy(mesh))
    n = axis_size(mesh, st.mesh_axes("batch", mesh))
    if batch % n:
        raise ShardingError(f"mesh {format_mesh(mesh)}: batch {batch} is not divisible by the batch axis of size "
                            f"{n} ({st.name}); use a batch that is a multiple of {n}, or a smaller dp")


def cache_sharding(cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy | None = None, batch: int | None = None):
    """KVCache of NamedShardings: kv [layers, batch, slots, latent], lengths [batch]."""
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


def place(x, s):
    """One host array (identical on every process) onto sharding ``s`` (None: the default device); across
    processes each places only its own devices' shards."""
    if s is None or jax.process_count() == 1:
        return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])


def per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs / arrays (the largest shard)."""
    total = 0
    for a in jax.tree.leaves(abstract_tree):
        shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return total


def mesh_context(mesh: Mesh | None):
    """``jax.set_mesh(mesh)`` around a program's trace and launch, or nothing on one device. The model itself
    gets the mesh explicitly (``Runtime.mesh``); this only tells JAX where unannotated inputs live."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
