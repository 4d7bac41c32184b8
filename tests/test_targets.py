"""Compile targets (kimi_jax.analysis.targets): the transcribed GPU specs, compile-only meshes, and the real
compilers on this CPU: both Pallas kernels at K2.6 TP-8 slice shapes for H100 / H200 / B200 with register spills
as errors, and the model's XLA path for a TPU slice. Compiler tests skip, saying why, where the `compile` extra
(jax[cuda12-local], jax[tpu]) is not installed; the test extra installs it, so they run in CI.

Spills are made errors per compile (``targets.compiler_options``: the debug option
xla_gpu_fail_ptx_compilation_on_register_spilling as a compile option), not through XLA_FLAGS: XLA reads
XLA_FLAGS once per process, so an environment flag would have to be set before any backend starts (a subprocess
per test, or conftest for the whole suite); a compile option holds for exactly the compiles that ask for it.
"""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax import sharding as part
from kimi_jax.model.params import abstract_sharded_params
from kimi_jax.analysis import targets
from kimi_jax.analysis.targets import TRITON_CALL, TargetError
from kimi_jax.config import KIMI_K26, TINY, Runtime

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

GPU_MISSING = targets.compiler_missing("h200")
TPU_MISSING = targets.compiler_missing("v5e")
needs_gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
needs_tpu = pytest.mark.skipif(TPU_MISSING is not None, reason=TPU_MISSING or "")
KERNEL_TARGETS = ("h100", "h200", "b200")
TP = 8


def matrix(*axes, fast):
    """Every combination of ``axes``; all but ``fast`` (the fast loop's representative) slow-marked (each compile
    is 1-3 s, the whole matrix ~1 min)."""
    return [pytest.param(*c, marks=() if c == fast else pytest.mark.slow) for c in itertools.product(*axes)]


# ---- the library, no compiler needed -------------------------------------------------------------------------

def test_gpu_facts_come_from_the_specs():
    h200 = targets.get_target("h200")
    assert (h200.platform, h200.device_kind, h200.compute_capability) == ("cuda", "NVIDIA H200 141GB HBM3e", "9.0a")
    assert h200.memory_bytes == 151397597184 and h200.cores == 132 and h200.memory_bandwidth == 4.8e12
    assert [targets.get_target(n).compute_capability for n in ("h100", "b200", "b300", "rtx_pro_6000")] == \
        ["9.0a", "10.0a", "10.3", "12.0"]
    for t in targets.TARGETS.values():
        if t.platform == "cuda":
            header = t.spec.split("gpu_device_info")[0]
            assert re.search(r"openxla/xla.*\n.*specs/\S+\.txtpb, commit [0-9a-f]{40}", header), t.name
            assert f'device_description_str: "{t.device_kind}"' in t.spec
            assert t.memory_bytes > 64 << 30


def test_topologies():
    assert [targets.topology("h200", n) for n in (1, 4, 8, 16, 32)] == \
        ["1x1x1", "1x1x4", "1x1x8", "1x2x8", "1x4x8"]
    assert targets.topology("v5e", 4) == "v5e:2x2" and targets.topology("v6e", 16) == "v6e:4x4"
    assert [targets.topology("v5p", n) for n in (4, 8, 16, 64)] == \
        ["v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:4x4x4"]
    # tpu7x: two devices (TensorCores) a chip; one device is a chip's first
    assert [targets.topology("tpu7x", n) for n in (1, 2, 8, 16)] == \
        ["tpu7x:1x1x1", "tpu7x:1x1x1", "tpu7x:2x2x1", "tpu7x:2x2x2"]
    with pytest.raises(TargetError, match="2 a chip"):
        targets.topology("tpu7x", 3)
    with pytest.raises(TargetError, match="multiple of 8"):
        targets.topology("h200", 12)
    with pytest.raises(TargetError, match="powers of two"):
        targets.topology("v6e", 6)
    with pytest.raises(TargetError, match="unknown target 'a100'; choose one of h100, h200"):
        targets.get_target("a100")


def test_missing_compiler_is_one_line(monkeypatch):
    def find_spec(name):            # no libtpu, and no jax_plugins package at all
        if "." in name:
            raise ModuleNotFoundError(name)

    monkeypatch.setattr(targets.importlib.util, "find_spec", find_spec)
    for name in ("h200", "v5e"):
        reason = targets.compiler_missing(name)
        assert reason and "\n" not in reason and ".[compile]" in reason
        with pytest.raises(TargetError, match=re.escape(reason)):
            targets.compile_mesh(name, 4)


# ---- compile-only meshes --------------------------------------------------------------------------------------

@pytest.mark.compile
@needs_gpu
@pytest.mark.parametrize("devices,axes,hosts", [(8, None, 1), (16, "ep=2,tp=8", 2)])
def test_h200_meshes(devices, axes, hosts):
    mesh = targets.compile_mesh("h200", devices, axes)
    assert mesh.size == devices and mesh.axis_names == (("tp",) if axes is None else ("ep", "tp"))
    devs = list(mesh.devices.flat)
    assert {d.device_kind for d in devs} == {"NVIDIA H200 141GB HBM3e"}
    assert len({d.process_index for d in devs}) == hosts
    if axes:                                  # tp stays inside a host
        assert all(len({d.process_index for d in row}) == 1 for row in mesh.devices)
    # a sharded matmul compiles across the hosts, with its all-reduce
    a = jax.ShapeDtypeStruct((16, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
    b = jax.ShapeDtypeStruct((1024, 16), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    with targets.lowering_for(mesh):
        compiled = jax.jit(jnp.matmul, out_shardings=NamedSharding(mesh, P())).lower(a, b).compile()
    assert "all-reduce" in compiled.as_text()


@pytest.mark.compile
@needs_gpu
def test_spills_are_errors():
    """The compile option really turns a spill into an error: a 128x128 float32 accumulator on one warp (512
    registers a thread) spills; without the option the same kernel compiles."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    n = 128

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, 4, lambda i, acc: acc + jnp.dot(
            a_ref[...], b_ref[...], preferred_element_type=jnp.float32), jnp.zeros((n, n), jnp.float32))

    def f(a, b):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n, n), jnp.float32), interpret=False,
                              compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1))(a, b)

    mesh = targets.compile_mesh("h100", 1)
    x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    with targets.lowering_for(mesh):
        lowered = jax.jit(f).lower(x, x)
    with pytest.raises(Exception, match="register spilling"):
        lowered.compile(targets.compiler_options("h100"))


# ---- the Pallas kernels at K2.6 TP-8 slice shapes -------------------------------------------------------------

@functools.cache
def k26_experts_slice(strategy: str):
    """Shapes of the INT4 experts one device holds of one K2.6 layer under ``strategy`` over 8 devices, from the
    model's own sharding rules: tp splits each expert's intermediate (2048/8), ep whole experts (384/8)."""
    mesh = part.make_mesh(f"{strategy}={TP}")         # conftest's 8 CPU devices: only for the shard shapes
    ex = abstract_sharded_params(KIMI_K26, mesh, strategy)["moe_layers"]["moe"]["experts"]
    return jax.tree.map(lambda a: (a.sharding.shard_shape(a.shape)[1:], a.dtype), ex)


def compile_on(target, fn, *args):
    """Lower ``fn`` for one compile-only device of ``target`` and compile it with spills as errors."""
    mesh = targets.compile_mesh(target, 1)
    rep = NamedSharding(mesh, P())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a[0], a[1], sharding=rep), args,
                        is_leaf=lambda a: isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], tuple))
    with targets.lowering_for(mesh):
        lowered = jax.jit(fn).lower(*args)
    return lowered.compile(targets.compiler_options(target)).as_text()


def int4_moe_hlo(target, strategy, tokens, scaled=True):
    """``scaled``: with the MoE norm's weight, as the model calls it (the gate/up kernel multiplies its rows)."""
    from kimi_jax.ops.int4_moe.api import int4_moe

    k, d = KIMI_K26.num_experts_per_tok, KIMI_K26.hidden_size
    experts = k26_experts_slice(strategy)
    assert experts.w13[0][-1] == (KIMI_K26.moe_intermediate_size // TP if strategy == "tp"
                                  else KIMI_K26.moe_intermediate_size)
    def fn(x, idx, w, experts, scale):
        return int4_moe(x, idx, w, experts, impl="pallas", interpret=False, scale=scale if scaled else None)
    return compile_on(target, fn, ((tokens, d), jnp.bfloat16), ((tokens, k), jnp.int32),
                      ((tokens, k), jnp.float32), experts, ((d,), jnp.bfloat16))


def tree_attention_hlo(target, page, width, slots=4096):
    """page 0: a contiguous cache of ``slots``; page 64: the same slots as a pool of 64-slot pages. Heads: K2.6's
    64 over TP-8 = 8 per device (the latent cache is not head-split)."""
    from kimi_jax.ops.tree_attention.api import latent_attention

    b = 1
    h, r, p = KIMI_K26.num_attention_heads // TP, KIMI_K26.kv_lora_rank, KIMI_K26.qk_rope_head_dim
    bf16 = jnp.bfloat16
    kv = ((b, slots, r + p), bf16) if not page else ((b * slots // page, page, r + p), bf16)
    args = [((b, width, h, r), bf16), ((b, width, h, p), bf16), kv, ((b,), jnp.int32), ((b, width, width), jnp.bool_)]
    if page:
        args.append(((b, slots // page), jnp.int32))

    def fn(q, qpe, kv, lengths, mask, table=None):
        return latent_attention(q, qpe, kv, lengths, mask, 0.1, impl="pallas", interpret=False, page_table=table)

    return compile_on(target, fn, *args)


@pytest.mark.compile
@needs_gpu
@pytest.mark.parametrize("target,strategy,tokens", matrix(KERNEL_TARGETS, ("tp", "ep"), (1, 8, 64),
                                                          fast=("h200", "tp", 8))
                         + [pytest.param(t, "tp", n, marks=pytest.mark.slow)
                            for t in ("b300", "rtx_pro_6000") for n in (8, 64)]
                         + [pytest.param(t, "tp", 2048, marks=pytest.mark.slow) for t in ("h200", "b300")])
def test_int4_moe_kernel_compiles(target, strategy, tokens):
    # placement (up to 64 tokens x 8 slots; above, XLA's), gate/up and down, as GPU kernels (not interpret-mode
    # loops); 2048 tokens: 64-row blocks, where the down kernel needs its 8 warps
    from kimi_jax.ops.int4_moe.pallas_triton import PLACE_MAX_PAIRS
    kernels = 3 if tokens * KIMI_K26.num_experts_per_tok <= PLACE_MAX_PAIRS else 2
    assert int4_moe_hlo(target, strategy, tokens).count(TRITON_CALL) == kernels


@pytest.mark.compile
@needs_gpu
@pytest.mark.parametrize("target,page,width", matrix(KERNEL_TARGETS, (0, 64), (1, 17, 65), fast=("h200", 64, 17))
                         + [pytest.param(t, page, w, marks=pytest.mark.slow)
                            for t in ("b300", "rtx_pro_6000") for page in (0, 64) for w in (17, 65)])
def test_tree_attention_kernel_compiles(target, page, width):
    assert tree_attention_hlo(target, page, width).count(TRITON_CALL) == 2     # the tree kernel and its merge


@pytest.mark.compile
@needs_gpu
@pytest.mark.slow
def test_rtx_pro_6000_needs_its_own_tiles(monkeypatch):
    """Why the kernels' tile tables have an RTX PRO 6000 (sm_120) entry, found by the real compiler: with 4 warps
    the INT4 gate/up kernel spills registers there (since it gathers its own rows of x it runs 8 warps on every
    GPU, as it spills at 4 on H200 too; the entry still gives the down kernel 8 warps, as before), and the tree
    kernel's 32-query blocks take 112 KiB of shared memory where the device allows 99 KiB a block (its spec's
    shared_memory_per_block_optin). When this fails, the default tiles fit: drop the entries. The spill is the
    unscaled gate/up kernel's (int4_moe without ``scale``): the model's, which multiplies the rows it gathers by
    the MoE norm's weight, compiles spill-free at 4 warps there and on H200 (deviceless, 2026-12-07; its warps
    stay 8 until a GPU times both)."""
    from kimi_jax.ops.int4_moe import pallas_triton as moe_kernel
    from kimi_jax.ops.tree_attention import pallas_triton as tree_kernel

    from kimi_jax.ops.select import pick_tiles

    tiles = {kind: pick_tiles(moe_kernel.TILES, kind) for kind in ("NVIDIA RTX PRO 6000 Blackwell", "NVIDIA H200")}
    assert tiles["NVIDIA RTX PRO 6000 Blackwell"] == moe_kernel.Tiles(num_warps=8) != tiles["NVIDIA H200"]
    monkeypatch.setattr(moe_kernel, "TILES", {"": moe_kernel.Tiles(num_warps_gate_up=4)})
    monkeypatch.setattr(tree_kernel, "TILES", {"": tree_kernel.Tiles()})
    with pytest.raises(Exception, match="register spilling"):
        int4_moe_hlo("rtx_pro_6000", "tp", 8, scaled=False)
    with pytest.raises(Exception, match="Shared memory size limit exceeded: requested 114688, available: 101376"):
        tree_attention_hlo("rtx_pro_6000", 0, 17)


# ---- the XLA path on a TPU slice ------------------------------------------------------------------------------

@pytest.mark.compile
@needs_tpu
@pytest.mark.parametrize("cfg,axes,strategy", [(TINY, "tp=4", "tp"),                    # one in the fast loop
                                               pytest.param(TINY.replace(int4_experts=True, moe_intermediate_size=256),
                                                            "ep=4", "ep", marks=pytest.mark.slow)],
                         ids=["tiny-tp4", "tiny-int4-ep4"])
def test_forward_compiles_for_tpu(cfg, axes, strategy):
    from kimi_jax.cache import KVCache
    from kimi_jax.model.transformer import forward

    mesh = targets.compile_mesh("v5e", 4, axes)
    assert {d.device_kind for d in mesh.devices.flat} == {"TPU v5 lite"}
    params = abstract_sharded_params(cfg, mesh, strategy)
    cs = part.cache_sharding(cfg, mesh, strategy, batch=2)
    sds = jax.ShapeDtypeStruct
    cache = KVCache(kv=sds((cfg.num_hidden_layers, 2, 256, cfg.latent_dim), jnp.bfloat16, sharding=cs.kv),
                    lengths=sds((2,), jnp.int32, sharding=cs.lengths))
    tokens = sds((2, 5), jnp.int32, sharding=part.batch_sharding(mesh, strategy, 2))

    def step(params, cache, tokens, rt):
        out = forward(params, cfg, tokens, cache, rt=rt)
        return out.cache, jnp.argmax(out.logits, -1)

    with targets.lowering_for(mesh):
        compiled = jax.jit(step, static_argnums=3).lower(params, cache, tokens, Runtime(mesh=mesh,
                                                                                       strategy=strategy)).compile()
    assert compiled.as_text().count("all-reduce(") >= cfg.num_hidden_layers   # one per block at least
    assert compiled.cost_analysis()["flops"] > 0
    assert np.isfinite(compiled.memory_analysis().temp_size_in_bytes)
