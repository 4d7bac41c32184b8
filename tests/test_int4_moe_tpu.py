"""int4_moe's Pallas TPU kernels (kimi_jax.ops.int4_moe.pallas_tpu): Pallas TPU interpret mode on the CPU against
the dense reference, their rules, and deviceless libtpu compiles for v5e, v6e, v5p and tpu7x at K2.6 slice shapes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import SingleDeviceSharding

from kimi_jax.analysis import targets
from kimi_jax.ops.int4_format import Int4Experts
from kimi_jax.ops.int4_moe.pallas_tpu import TILES, int4_moe_tpu, tile_shape
from kimi_jax.ops.int4_moe.reference import int4_moe_reference
from kimi_jax.ops.int4_moe.rules import TPU_BLOCK_M, TPU_KINDS, MoeCall, tpu_rules
from test_int4_moe import D, check_close, padded_case, random_experts, routing

tpu = jax.jit(int4_moe_tpu, static_argnames=("interpret", "block_m", "device_kind"))
SLOW = pytest.mark.slow


@pytest.fixture(autouse=True)
def fresh_tpu_interpret_state():
    """Pallas' TPU interpret mode keeps simulated memory between kernels; a kernel that fails mid-interpretation
    would leave it to the next test (conftest does the same for the GPU interpreter)."""
    pltpu.reset_tpu_interpret_mode_state()
    yield


# --- numerics (interpret mode) ---------------------------------------------------------------------------------


# The fast loop interprets the kernel once (the first case, ~6 s on a 2-core VM); the other shapes, dtypes and
# tiles below run in the full suite.
@pytest.mark.interpret
@pytest.mark.parametrize("t,k,kind,block_m", [
    (13, 3, "random", None),      # ragged groups, 39 rows in 16-row blocks
    pytest.param(1, 8, "random", None, marks=SLOW),       # decode: one token, top-8 of 8 experts, one real row/block
    pytest.param(3, 8, "random", None, marks=SLOW),       # odd tokens, every expert touched
    pytest.param(17, 8, "random", None, marks=SLOW),      # a 17-token verify: 136 pairs, 32-row blocks (default)
    pytest.param(37, 2, "one_expert", 64, marks=SLOW),    # one expert gets every token: two 64-row blocks of it
    pytest.param(32, 2, "few", None, marks=SLOW),         # two experts used: 4 of 11 blocks used, 7 skipped
    pytest.param(20, 1, "few", 256, marks=SLOW),          # the largest row block, top-1
])
def test_matches_reference(t, k, kind, block_m):
    ex = random_experts(0)
    idx, w = routing(t + k, t, k, kind=kind)
    x = jnp.asarray(np.random.default_rng(t).normal(size=(t, D)), jnp.float32)
    check_close(tpu(x, idx, w, ex, interpret=True, block_m=block_m), int4_moe_reference(x, idx, w, ex))


@pytest.mark.interpret
@SLOW
def test_bf16_activations_and_v6e_tiles():
    ex = random_experts(1, f=256)    # F = 256: whole 128-lane tiles, no padding of h
    idx, w = routing(3, 9, 2)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(9, D)), jnp.bfloat16)
    ref = int4_moe_reference(x.astype(jnp.float32), idx, w, ex)
    # bf16 dots: the dequantized weights and h rounded to bf16, float32 accumulation (as the XLA path does)
    check_close(tpu(x, idx, w, ex, interpret=True, device_kind="TPU v6 lite"), ref, rtol=2e-2)


@pytest.mark.interpret
@SLOW
def test_padded_dims_from_compressed_tensors(fixtures_dir):
    ex, idx, w, x = padded_case(fixtures_dir)      # D 96, F 64: padded to 256 in the kernel layout (K tiles)
    check_close(tpu(x, idx, w, ex, interpret=True), int4_moe_reference(x, idx, w, ex))


@pytest.mark.interpret
@SLOW
def test_k26_slice_matches_reference():
    """D = 7168, F = 256 (K2.6's expert width under TP-8), 4 experts, top-2 of 5 tokens: the gate/up kernel runs
    two K tiles of 3584 inputs (v5e tiles), down one K tile (all 256 inputs) and two 3584-column tiles."""
    ex = random_experts(2, e=4, d=7168, f=256)
    idx, w = routing(4, 5, 2, e=4)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(5, 7168)), jnp.float32)
    check_close(tpu(x, idx, w, ex, interpret=True), int4_moe_reference(x, idx, w, ex), rtol=1e-4)


# --- tiles and rules --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,gate_up,down", [
    # (D, F) = (7168, 256) under TP-8 and (7168, 2048) under EP: (bk, bn) of gate/up [D, F] and down [F, D]
    ("TPU v5 lite", {256: (3584, 256), 2048: (3584, 256)}, {256: (256, 3584), 2048: (2048, 512)}),
    ("TPU v6 lite", {256: (3584, 256), 2048: (1792, 512)}, {256: (256, 3584), 2048: (2048, 512)}),
    ("TPU v5", {256: (7168, 128), 2048: (7168, 128)}, {256: (256, 3584), 2048: (2048, 512)}),   # megacore: >= 2 tiles
])
def test_tile_shapes_at_k26(kind, gate_up, down):
    for f in (256, 2048):
        assert tile_shape(7168, f, TILES[kind]) == gate_up[f]
        assert tile_shape(f, 7168, TILES[kind]) == down[f]
    assert TILES["TPU7x"] == TILES["TPU v6 lite"]
    assert tuple(TILES) == TPU_KINDS            # the generations the rules accept are the ones with tiles


@pytest.mark.parametrize("call,kind,reason", [
    (MoeCall("bfloat16", 7168, 256), "TPU v5", None),
    (MoeCall("float32", 96, 64, 16), None, None),
    (MoeCall("bfloat16", 7168, 256, 256), "TPU7x", None),
    (MoeCall("bfloat16", 7168, 256), "TPU v4", "has tiles for"),
    (MoeCall("float16", 7168, 256), None, "bfloat16 or float32 activations"),
    (MoeCall("bfloat16", 7168, 128 + 64), None, "multiples of 128"),
    (MoeCall("bfloat16", 7000, 256), None, "multiples of 128"),
    (MoeCall("float32", 128, 128), None, None),
    (MoeCall("bfloat16", 7168, 256, 8), None, "power of two from 16 to 256"),
    (MoeCall("bfloat16", 7168, 256, 512), None, "power of two from 16 to 256"),
    (MoeCall("bfloat16", 7168, 256, 48), None, "power of two from 16 to 256"),
])
def test_tpu_supports(call, kind, reason):
    got = tpu_rules(call, kind)
    assert got is None if reason is None else reason in got


def test_refuses_what_it_cannot_take():
    ex = random_experts(0)
    idx, w = routing(0, 3, 2)
    with pytest.raises(ValueError, match="power of two from 16"):
        int4_moe_tpu(jnp.zeros((3, D), jnp.float32), idx, w, ex, interpret=True, block_m=TPU_BLOCK_M[1] * 2)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        int4_moe_tpu(jnp.zeros((3, D), jnp.float16), idx, w, ex, interpret=True)


# --- deviceless compiles (libtpu) --------------------------------------------------------------------------------


TPU_MISSING = targets.compiler_missing("v5e")
KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5", "tpu7x": "TPU7x"}


def compile_device(target):
    return targets.compile_devices(target, 1)[0]


def compile_k26(target, e, f, tokens, k=8, d=7168) -> str:
    """HLO text of ``int4_moe_tpu`` compiled by libtpu for one compile-only ``target`` device, bf16 activations, at
    the scoped VMEM limit libtpu sets by default."""
    dev = compile_device(target)
    assert dev.device_kind == KINDS[target]
    sh = SingleDeviceSharding(dev)
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    ex = Int4Experts(w13=s((e, 2, d // 8, f), jnp.int32), s13=s((e, 2, d // 32, f), jnp.bfloat16),
                     w2=s((e, f // 8, d), jnp.int32), s2=s((e, f // 32, d), jnp.bfloat16))
    fn = jax.jit(lambda x, i, w, ex: int4_moe_tpu(x, i, w, ex, device_kind=dev.device_kind), out_shardings=sh)
    lowered = fn.lower(s((tokens, d), jnp.bfloat16), s((tokens, k), jnp.int32), s((tokens, k), jnp.float32), ex)
    return lowered.compile().as_text()


SHAPES = [(384, 256, 1), (384, 256, 17), (48, 2048, 17), (48, 2048, 512)]   # (E, F, tokens), top-8


# The fast loop compiles one slice for v5e; the other generations and shapes run in the full suite.
@pytest.mark.skipif(TPU_MISSING is not None, reason=str(TPU_MISSING))
@pytest.mark.parametrize("target", [t if t == "v5e" else pytest.param(t, marks=SLOW) for t in KINDS])
@pytest.mark.parametrize("e,f,tokens", [SHAPES[0]] + [pytest.param(*s, marks=pytest.mark.slow) for s in SHAPES[1:]])
def test_compiles_for_tpu_k26_slice(target, e, f, tokens):
    """K2.6 slices: TP-8 (F = 256, all 384 experts) at decode and a 17-token verify, EP-8 (F = 2048, 48 experts)
    at a verify and a 512-token prefill chunk. Two Mosaic kernels (gate/up, down) in the compiled program."""
    hlo = compile_k26(target, e, f, tokens)
    assert len(re.findall(r'custom_call_target="tpu_custom_call"', hlo)) == 2
