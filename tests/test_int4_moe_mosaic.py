"""int4_moe's Mosaic GPU kernels (kimi_jax.ops.int4_moe.mosaic_gpu): GPU interpret mode on the CPU against the
dense reference and the Triton kernel, and a deviceless compile for H200 at K2.6 TP-8 slice shapes."""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax.analysis import targets
from kimi_jax.ops.int4_format import Int4Experts
from kimi_jax.ops.int4_moe.api import int4_moe
from kimi_jax.ops.int4_moe.mosaic_gpu import Tiles, gate_up_splits, int4_moe_mosaic
from kimi_jax.ops.int4_moe.reference import int4_moe_reference
from test_int4_moe import check_close, random_experts, routing

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
E, D, F = 4, 256, 128

mosaic = jax.jit(lambda x, i, w, ex, tiles: int4_moe_mosaic(x, i, w, ex, interpret=True, tiles=tiles),
                 static_argnums=4)
triton = jax.jit(lambda x, i, w, ex: int4_moe(x, i, w, ex, impl="pallas", interpret=True))


# block_m None: the default, 8 rows (swapped kernels) at 1 and 13 tokens, 32 (swapped) at 37, 64 at 70. Every case
# runs with the default block and with 64-row blocks, and the stage count alternates (each case and each block size
# meets both 1 stage and the default): the stages only change the copy ring, which test_mosaic_pipeline_wraps_its_
# ring covers from 1 to 4 stages, so the full cross product (16 interpreted runs) repeats what these 8 check. The fast
# run keeps one swapped case; the rest is slow.
CASES = [(13, 2, "random"),       # ragged groups
         (1, 4, "random"),        # decode: one token, one real row per block
         (37, 2, "one_expert"),   # 37 rows on expert 3 plus the rest: two 32-row blocks, or one 64-row block
         (70, 2, "one_expert")]   # 70 rows on expert 3: two blocks of one expert
MATRIX = [(*case, (Tiles().stages, 1)[(i + j) % 2], bm)
          for i, case in enumerate(CASES) for j, bm in enumerate((None, 64))]
FAST = {(13, Tiles().stages, None)}


@pytest.mark.interpret
@pytest.mark.parametrize("t,k,kind,stages,block_m", [
    pytest.param(*case, marks=() if (case[0], case[3], case[4]) in FAST else pytest.mark.slow) for case in MATRIX])
def test_mosaic_interpret_matches_reference(t, k, kind, stages, block_m):
    ex = random_experts(0, e=E, d=D, f=F)
    idx, w = routing(t + k, t, k, e=E, kind=kind)
    x = jnp.asarray(np.random.default_rng(t).normal(size=(t, D)), jnp.bfloat16)
    y = mosaic(x, idx, w, ex, Tiles(stages=stages, block_m=block_m))
    # bf16 activations and h, exact int4 weights, float32 accumulation: the Triton kernel's bf16 tolerance
    check_close(y, int4_moe_reference(x.astype(jnp.float32), idx, w, ex), rtol=2e-2)
    # the same numerics as the Triton kernel (scale applied to each group's float32 partial sum)
    check_close(y, triton(x, idx, w, ex), rtol=1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("stages,block_m", [pytest.param(s, bm, marks=pytest.mark.slow)
                                             for s, bm in [(2, None), (4, None), (2, 64), (1, None), (3, 8)]])
def test_mosaic_pipeline_wraps_its_ring(stages, block_m):
    """D = 1024 and F = 512: 4 chunks in gate/up and 2 in down, so the copy ring wraps (2, 3 stages), fills
    exactly (down at 2) or holds more slots than chunks (4 stages); all must give the Triton kernel's numbers.
    The default block here is 16 rows (swapped); 8 and 64 rows once each (each stage count once: the ring's
    slots do not depend on the block, and 4 stages at 64 rows or 3 at 16 repeated these)."""
    d, f, e = 1024, 512, 2      # two experts: the least interpret-mode work
    ex = random_experts(1, e=e, d=d, f=f)
    idx, w = routing(5, 9, 2, e=e)
    x = jnp.asarray(np.random.default_rng(9).normal(size=(9, d)), jnp.bfloat16)
    check_close(mosaic(x, idx, w, ex, Tiles(stages=stages, block_m=block_m)), triton(x, idx, w, ex), rtol=1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("block_m,splits", [pytest.param(None, 2, marks=pytest.mark.slow),
                                             pytest.param(64, 4, marks=pytest.mark.slow)])
def test_mosaic_gate_up_split_k(block_m, splits):
    """gate/up over K splits (float32 partial sums, silu outside): D = 1024 is 4 chunks, 2 or 1 per split."""
    d, f, e = 1024, 256, 2
    ex = random_experts(2, e=e, d=d, f=f)
    idx, w = routing(6, 5, 2, e=e)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(5, d)), jnp.bfloat16)
    y = mosaic(x, idx, w, ex, Tiles(block_m=block_m, splits_gate_up=splits))
    check_close(y, triton(x, idx, w, ex), rtol=1e-5)


# tcgen05 (Blackwell): always swapped, 128 weight columns a tile, row blocks of 16 or more (default 16 here);
# GPU interpret mode simulates TMEM and the tensor-core barrier. F = 128 is one gate/up tile, D = 256 one down CTA.
@pytest.mark.interpret
@pytest.mark.parametrize("t,k,block_m,splits", [(13, 2, None, None)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [(1, 4, None, None), (37, 2, 64, None)]])
def test_tcgen05_interpret_matches_the_triton_kernel(t, k, block_m, splits):
    ex = random_experts(0, e=E, d=D, f=F)
    idx, w = routing(t + k, t, k, e=E, kind="random")
    x = jnp.asarray(np.random.default_rng(t).normal(size=(t, D)), jnp.bfloat16)
    y = mosaic(x, idx, w, ex, Tiles(mma="tcgen05", block_m=block_m, splits_gate_up=splits))
    check_close(y, int4_moe_reference(x.astype(jnp.float32), idx, w, ex), rtol=2e-2)
    check_close(y, triton(x, idx, w, ex), rtol=1e-5)


@pytest.mark.interpret
@pytest.mark.slow      # ~10 s interpreted; fast: tcgen05's numerics without splits (test_tcgen05_interpret_...)
def test_tcgen05_gate_up_split_k():
    """The float32 partial sums (a TMEM accumulator read per group, stored [N, rows]) over 2 K splits."""
    d, f, e = 512, 128, 2
    ex = random_experts(2, e=e, d=d, f=f)
    idx, w = routing(6, 5, 2, e=e)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(5, d)), jnp.bfloat16)
    check_close(mosaic(x, idx, w, ex, Tiles(mma="tcgen05", splits_gate_up=2)), triton(x, idx, w, ex), rtol=1e-5)


@pytest.mark.interpret
def test_gate_up_splits_fill_h200_at_decode():
    # K2.6 TP-8 (D = 7168: 28 chunks, F = 256): 8 blocks x 4 column tiles at one token, 64 x 4 at eight
    assert gate_up_splits(8 * 4, 28) == 7 and gate_up_splits(64 * 4, 28) == 1
    assert gate_up_splits(8 * 4, 1) == 1      # too few chunks to split


@pytest.mark.interpret
@pytest.mark.slow      # a dtype variant of test_mosaic_interpret_matches_reference's fast (bf16) case
def test_mosaic_float16_activations():
    """f16 takes the unpack's other base (1024 instead of bf16's 128)."""
    ex = random_experts(0, e=E, d=D, f=F)
    idx, w = routing(15, 13, 2, e=E)
    x = jnp.asarray(np.random.default_rng(13).normal(size=(13, D)), jnp.float16)
    y = mosaic(x, idx, w, ex, Tiles())
    check_close(y, int4_moe_reference(x.astype(jnp.float32), idx, w, ex), rtol=2e-2)
    check_close(y, triton(x, idx, w, ex), rtol=1e-5)


@pytest.mark.interpret
def test_mosaic_block_sizes():
    """Swapped (tokens as wgmma's N) below 64 rows a block, a multiple of 8; 64 rows unswapped."""
    ex = random_experts(0, e=E, d=D, f=F)
    idx, w = routing(0, 3, 2, e=E)
    x = jnp.zeros((3, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="row blocks of 64 rows"):
        int4_moe_mosaic(x, idx, w, ex, interpret=True, tiles=Tiles(block_m=4))
    with pytest.raises(ValueError, match="row blocks of 64 rows"):
        int4_moe_mosaic(x, idx, w, ex, interpret=True, tiles=Tiles(block_m=128))


@pytest.mark.interpret
def test_tcgen05_block_sizes():
    ex = random_experts(0, e=E, d=D, f=F)
    idx, w = routing(0, 3, 2, e=E)
    x = jnp.zeros((3, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        int4_moe_mosaic(x, idx, w, ex, interpret=True, tiles=Tiles(mma="tcgen05", block_m=8))
    with pytest.raises(ValueError, match="Tiles.mma"):
        int4_moe_mosaic(x, idx, w, ex, interpret=True, tiles=Tiles(mma="mma.sync"))


@pytest.mark.interpret
def test_mosaic_rejects_f32_activations():
    ex = random_experts(0, e=E, d=D, f=F)
    idx, w = routing(0, 3, 2, e=E)
    with pytest.raises(TypeError, match="16-bit activations"):
        int4_moe_mosaic(jnp.zeros((3, D), jnp.float32), idx, w, ex, interpret=True)


GPU_MISSING = targets.compiler_missing("h200")
K26_TP8 = dict(e=384, d=7168, f=256, k=8)     # K2.6 under TP-8: expert width 2048 / 8


def compile_k26_slice(target, tokens, tiles, monkeypatch, capfd=None):
    """Lower and compile ``int4_moe_mosaic`` for a compile-only ``target`` at the K2.6 TP-8 slice; returns the HLO,
    ptxas' report (MOSAIC_GPU_DUMP_PTXAS: XLA's spill option does not reach Mosaic GPU kernels, which compile
    their own PTX; with ``capfd`` None it goes to this process's stderr) and the shared memory Mosaic GPU
    allocates for each kernel."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    smem = []
    size = mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda tree: smem.append(size(tree)) or smem[-1])
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    e, d, f, k = K26_TP8.values()
    mesh = targets.compile_mesh(target, 1)
    rep = NamedSharding(mesh, P())
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    ex = Int4Experts(w13=s((e, 2, d // 8, f), jnp.int32), s13=s((e, 2, d // 32, f), jnp.bfloat16),
                     w2=s((e, f // 8, d), jnp.int32), s2=s((e, f // 32, d), jnp.bfloat16))
    if capfd:
        capfd.readouterr()
    with targets.lowering_for(mesh):
        lowered = jax.jit(functools.partial(int4_moe_mosaic, tiles=tiles)).lower(
            s((tokens, d), jnp.bfloat16), s((tokens, k), jnp.int32), s((tokens, k), jnp.float32), ex)
    hlo = lowered.compile(targets.compiler_options(target)).as_text()
    report = capfd.readouterr() if capfd else None
    return hlo, report and report.out + report.err, smem


def blackwell_compile(target, tokens) -> dict:
    """``compile_k26_slice`` with the default tiles (tcgen05, picked by the target), for a process of its own
    (``test_tcgen05_compiles_for_blackwell_k26_slice``): the Mosaic GPU calls and the shared memory."""
    with pytest.MonkeyPatch.context() as mp:
        hlo, _, smem = compile_k26_slice(target, tokens, Tiles(), mp)
    return dict(calls=len(re.findall(r'custom_call_target="mosaic_gpu[^"]*"', hlo)), smem=smem)


# Shared memory per CTA (KiB), gate/up and down, as Mosaic GPU counts it (scratch and barriers), per stage count:
# 64-row blocks (41 KiB a stage) and 8-row swapped blocks (22 KiB a stage). At one token gate/up splits K over a
# cluster (gate_up_splits: 7 splits swapped, 4 at 64 rows); the exchange tiles CTA 0 reads the other splits' sums
# into alias the copy ring (6 x 4 KiB swapped, 3 x 16 KiB at 64 rows, both under the ring's size): no more smem.
SMEM_KIB = {64: {1: (49, 61), 2: (90, 102), 3: (131, 143), 4: (172, 184)},
            8: {1: (31, 34), 2: (53, 56), 3: (75, 78), 4: (97, 100)}}


# block_m None: the default, which is 8 rows (swapped) at 1, 8 and 64 tokens of K2.6 (<= 2 rows a touched expert)
@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
# The fast loop compiles the decode slice; the 64-row block's, like the rest, in the full suite.
@pytest.mark.parametrize("tokens,stages,block_m", [(1, Tiles().stages, None)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [(64, Tiles().stages, 64),
        (8, Tiles().stages, None), (64, Tiles().stages, None), (1, Tiles().stages, 64), (8, 1, None),
        (8, 3, None), (8, 4, None), (8, 1, 64), (8, 3, 64), (8, 4, 64)]])
def test_mosaic_compiles_for_h200_k26_slice(tokens, stages, block_m, monkeypatch, capfd):
    hlo, ptxas, smem = compile_k26_slice("h200", tokens, Tiles(stages=stages, block_m=block_m), monkeypatch, capfd)
    assert len(re.findall(r'custom_call_target="mosaic_gpu[^"]*"', hlo)) == 2
    gate_up, down = SMEM_KIB[block_m or 8][stages]
    assert [round(b / 1024) for b in smem] == [gate_up, down], smem
    assert max(smem) <= 227 * 1024     # Mosaic GPU refuses more at lowering too
    used = re.findall(r"Used (\d+) registers", ptxas)
    if not used:
        pytest.skip("ptxas printed no report (MOSAIC_GPU_DUMP_PTXAS read before this test?); spills unchecked")
    assert len(used) == 2 and "sm_90a" in ptxas
    assert re.findall(r"(\d+) bytes spill stores", ptxas) == ["0", "0"], ptxas


# tcgen05 for B200 / B300 (picked by the target: Tiles.mma None): two Mosaic GPU kernels at sm_100a / sm_103a,
# no spills. At one token gate/up splits K (8 blocks x 2 column tiles of 128). Each compile runs in a process of
# its own: Mosaic GPU (jax 0.12.0.1) hands ptxas the architecture of the first Mosaic kernel a process compiles,
# so after a B200 kernel a B300 one fails in ptxas ("SM version specified by .target is higher than default"),
# and after a B300 kernel an H200 one does (no wgmma on sm_103a); the rest of this suite compiles for H200.
@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.slow      # a process per compile (~10 s); fast: tcgen05's numerics (test_tcgen05_interpret_...)
@pytest.mark.parametrize("target,tokens", [("b200", 1), ("b200", 8), ("b200", 64), ("b300", 8)])
def test_tcgen05_compiles_for_blackwell_k26_slice(target, tokens):
    code = ("import json, test_int4_moe_mosaic as t; "
            f"print('RESULT', json.dumps(t.blackwell_compile({target!r}, {tokens})))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MOSAIC_GPU_DUMP_PTXAS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    got = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert got["calls"] == 2 and max(got["smem"]) <= 227 * 1024, got
    assert len(re.findall(r"Used (\d+) registers", out)) == 2 and {"b200": "sm_100a", "b300": "sm_103a"}[target] in out
    assert re.findall(r"(\d+) bytes spill stores", out) == ["0", "0"], out[-3000:]
