"""The weights the programs compute with, per backend.

The model's code (``transformer``, ``moe``, the drafter) runs on stored weights as they are; this module decides,
once per loaded model (``kimi_jax.api.Model.compute_params``), which faster form a backend gets and why:

* **Per-layer buffers** (``own_buffers``, ``split_stacks``): every decoder layer in its own buffers instead of one
  stack per layer kind. XLA copies a layer's slice out of stacked weights on every step of a layer scan wherever
  the consumer cannot read the slice in place. XLA:CPU does it in its dynamic-slice fusions (~30% of a decode step
  on the embedded default; a static unrolled slice copies too); XLA:GPU does it for every slice that feeds a
  Triton GEMM fusion or a Pallas kernel, i.e. all of a layer's weights, routed experts included (a K2.6 TP-8
  DDTree round compiled for H200 copies 68 GB per device per round stacked, 6.7 GB split: docs/gpu_overhead.md).
  Weights held as one buffer per layer are read in place. Compile time grows with the layer count, so CPUs split
  only small unsharded models; GPUs always. ``kimi_jax.load`` reads such weights straight into per-layer buffers
  (no stacked copy on the device); stacked weights handed to a Model are split only where both copies fit the
  device (splitting copies them once), with a warning where they do not.
* **Float experts** (``expand_float_experts``): on the XLA MoE path INT4 experts are unpacked inside every
  forward, once per touched expert; on a CPU that unpacking, not the matmuls, was most of a decode step. When the
  float copy is small (the embedded default: 4.7 MB) it is made once, with exactly the INT4 values.
* **The dense expert form** (``DenseExperts``): with few experts per choice, every token through every expert,
  weighted by its routing coefficient (zero for unchosen experts): E/k times the multiply-adds but no per-token
  weight gather, the faster side on a CPU up to about 8 (16 experts top-2 at 32 tokens: dense 0.36 ms, gather
  0.49 ms per layer). K2.6 (384/8 = 48) gathers. Training always takes it (its backward gathers nothing).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from kimi_jax.config import ModelConfig, Runtime
from kimi_jax.model.params import map_experts
from kimi_jax.ops.registry import platform_of, runs_xla_only

PER_LAYER_MAX_LAYERS = 8         # CPUs split unsharded models of at most this many layers
SPLIT_MEMORY_FRACTION = 0.9      # of the device's memory limit that stacked + split weights may take
DENSE_EXPERTS_PER_CHOICE = 8     # float experts take the dense form when E <= this * k
FLOAT_EXPERTS_MAX_BYTES = 1 << 30   # the XLA path's INT4 experts are expanded when the float copy stays below this
MODEL_STACKS = ("dense_layers", "moe_layers")


def compute_params(params, cfg: ModelConfig, rt: Runtime = Runtime()):
    """The target's weights the generation programs run on, for the platform they live on
    (``program_platform``): float experts where ``expand_float_experts`` pays, every layer in its own buffers
    where ``own_buffers`` says so. Abstract weights (ShapeDtypeStructs) stay abstract."""
    params = expand_float_experts(params, cfg, rt)
    return split_stacks(params, MODEL_STACKS, cfg.name,
                        own_buffers(cfg.num_hidden_layers, program_platform(rt), rt.mesh is not None))


def program_platform(rt: Runtime) -> str:
    """The platform the weights and programs live on ("cuda", "cpu", "tpu"): ``rt.mesh``'s devices', else this
    process's default device's. Not ``jax.default_backend()`` as such: a mesh of other devices decides."""
    return platform_of(rt.mesh.devices.flat[0] if rt.mesh is not None else jax.devices()[0])


# ---- per-layer buffers ---------------------------------------------------------------------------------------

def own_buffers(num_layers: int, platform: str, sharded: bool) -> bool:
    """Whether programs on ``platform`` ("cpu", "gpu"/"cuda", "tpu") run on one buffer per layer
    (``split_layers``) rather than on stacked layers in a scan."""
    if platform in ("gpu", "cuda"):
        return True
    return not sharded and num_layers <= PER_LAYER_MAX_LAYERS


def split_stacks(params: dict, stacks=MODEL_STACKS, name: str = "the model", split: bool = True) -> dict:
    """``params`` with the layer stacks ``params[k]`` (k in ``stacks``) split into per-layer buffers
    (``split_layers``) when ``split`` and there is device memory to split in (``room_to_split``; else stacked,
    with a warning naming ``name``). Stacks loaded per layer (``kimi_jax.load(..., layers="per-layer")``, the
    default where ``own_buffers`` holds) are already tuples and stay as they are."""
    todo = [k for k in stacks if not isinstance(params[k], tuple)]
    if not split or not todo:
        return params
    if not room_to_split(params):
        warnings.warn(f"{name}: stacked and per-layer weights do not both fit the device, so the programs run the "
                      "stacked layer scan, which copies each layer's weights every step (docs/gpu_overhead.md); "
                      "kimi_jax.load(..., layers='per-layer') reads them into per-layer buffers without a stacked "
                      "copy", stacklevel=3)
        return params
    return {**params, **{k: split_layers(params[k]) for k in todo}}


def room_to_split(tree) -> bool:
    """Whether ``tree`` (arrays on this process's devices) can be split: stacked and split copies together fit
    ``SPLIT_MEMORY_FRACTION`` of the fullest device's memory limit (True where the backend reports no limit)."""
    leaves = [a for a in jax.tree.leaves(tree) if hasattr(a, "addressable_shards")]
    held: dict = {}
    for a in leaves:
        for sh in a.addressable_shards:
            held[sh.device] = held.get(sh.device, 0) + sh.data.nbytes
    for dev, used in held.items():
        limit = (dev.memory_stats() or {}).get("bytes_limit")
        if limit and 2 * used > SPLIT_MEMORY_FRACTION * limit:
            return False
    return True


def split_layers(stack):
    """A stacked layer tree (leading layer axis on every leaf) -> a tuple of per-layer trees (own buffers).
    Abstract leaves (``jax.ShapeDtypeStruct``, for lowering without weights) split into abstract layers with the
    stacked sharding less its layer entry."""
    leaves = jax.tree.leaves(stack)
    n = leaves[0].shape[0]
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
        def one(a):
            s = a.sharding
            if s is not None:
                s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=s)
        return tuple(jax.tree.map(one, stack) for _ in range(n))
    return tuple(jax.jit(lambda s, i=i: jax.tree.map(lambda a: a[i], s))(stack) for i in range(n))


# ---- expert forms ----------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseExperts:
    """Float experts laid out for the dense form: gate/up input-major over all experts, so each is one
    [d, E*f] matmul operand with no transpose (leading stacked-layer axes allowed)."""
    gate: jax.Array   # [..., d, E, f]
    up: jax.Array     # [..., d, E, f]
    down: jax.Array   # [..., E, f, d]


def to_compute_layout(experts: dict, cfg: ModelConfig, dense: bool | None = None):
    """Float experts {gate, up: [.., E, d, f], down: [.., E, f, d]} -> the layout ``moe.routed_experts`` runs
    fastest (``dense`` forces the choice: training always takes the dense form)."""
    if dense is None:
        dense = cfg.n_routed_experts <= DENSE_EXPERTS_PER_CHOICE * cfg.num_experts_per_tok
    if not dense:
        return experts
    return DenseExperts(gate=jnp.swapaxes(experts["gate"], -3, -2), up=jnp.swapaxes(experts["up"], -3, -2),
                        down=experts["down"])


def expand_float_experts(params, cfg: ModelConfig, rt: Runtime = Runtime()):
    """INT4 experts as float experts (exactly the INT4 values; the dense form where ``to_compute_layout`` picks
    it) when the programs on ``program_platform`` run the XLA MoE path for every call (``runs_xla_only``),
    unsharded, and the float copy stays below ``FLOAT_EXPERTS_MAX_BYTES``; otherwise ``params`` as they are. The
    kernels (GPU) keep streaming INT4, and large or sharded models keep the per-expert unpacking (programs
    lowered for another target take abstract weights, not these)."""
    xla_here = runs_xla_only(rt.moe_impl, program_platform(rt))
    if not cfg.int4_experts or not xla_here or rt.mesh is not None or not cfg.num_moe_layers:
        return params
    layers, dtype = params["moe_layers"], jnp.dtype(params["embed"].dtype)
    experts = [layer["moe"]["experts"] for layer in (layers if isinstance(layers, tuple) else (layers,))]
    if sum(e.w13.size + e.w2.size for e in experts) * 8 * dtype.itemsize > FLOAT_EXPERTS_MAX_BYTES:
        return params
    expand = jax.jit(lambda e: to_compute_layout(jax.tree.map(lambda a: a.astype(dtype), e.dequantize()), cfg))
    return map_experts(params, lambda e: expand(jax.tree.map(jnp.asarray, e)))
