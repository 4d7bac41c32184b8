"""The drafter attention op (kimi_jax.ops.drafter_attention): the Triton kernels in interpret mode against the
reference over block widths, GQA groups, heads, ragged contexts, masks and dtypes; its derivative; the drafter
run through it; what "auto" picks over the shape space on every target; and deviceless compiles (spills as
errors) of what "auto" picks at K2.6's shapes and others on every GPU target."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.analysis import targets
from kimi_jax.analysis.targets import TRITON_CALL
from kimi_jax.config import Runtime
from kimi_jax.decoding import drafter as dflash
from kimi_jax.ops import registry
from kimi_jax.ops.drafter_attention.api import (DRAFTER_ATTENTION, MAX_BLOCK_TOKENS, DrafterAttentionCall, attend,
                                               pack_qkv, pallas_supports, unpack_qkv)
from kimi_jax.ops.drafter_attention.reference import attend_reference
from kimi_jax.ops.registry import Lowering

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPUS = ("h100", "h200", "b200", "b300", "rtx_pro_6000")
TPUS = ("v5e", "v6e", "v5p", "tpu7x")
LOWERINGS = {**{n: Lowering(targets.get_target(n).platform, targets.get_target(n).device_kind) for n in GPUS + TPUS},
             "cpu": Lowering("cpu")}
GPU_MISSING = targets.compiler_missing("h100")


def drafter_mask(rng, b, t, s, causal, window):
    """visible [b, t, s + t] as drafter.block_hidden builds it: a ring of s context slots after a random number
    of committed positions (slots never written are invisible), the block at the positions after them."""
    lengths = rng.integers(1, 3 * s, b)
    positions = lengths[:, None] + np.arange(t)[None]
    ctx_positions = np.asarray(dflash.slot_positions(jnp.asarray(lengths), s))
    allowed = np.concatenate([np.broadcast_to((ctx_positions >= 0)[:, None], (b, t, s)), np.ones((b, t, t), bool)], -1)
    ahead = positions[:, :, None] - np.concatenate([ctx_positions, positions], 1)[:, None, :]
    visible = allowed & ((not causal) | (ahead >= 0))
    return visible & ((window == 0) | ((ahead < window) & (causal | (-ahead < window))))


def operands(rng, b, t, heads, kv_heads, hd, s, mask, dtype, layers=2):
    x = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    if mask == "random":
        visible = rng.random((b, t, s + t)) < 0.4
    elif mask == "block_only":              # rows that see only (some of) their block, the rest everything
        visible = np.ones((b, t, s + t), bool)
        visible[:, ::2, :s] = False
    else:
        causal, window = {"causal_window": (True, max(2, s // 3)), "noncausal_window": (False, s // 2 + 1),
                          "full": (False, 0)}[mask]
        visible = drafter_mask(rng, b, t, s, causal, window)
    visible[:, np.arange(t), s + np.arange(t)] = True      # every row sees itself, as in the drafter
    return (x(b, t, heads, hd), x(layers, b, s, kv_heads, hd), x(layers, b, s, kv_heads, hd), x(b, t, kv_heads, hd),
            x(b, t, kv_heads, hd), jnp.asarray(visible))


# (b, t, heads, kv_heads, head_dim, s, mask): odd block widths, groups 1, 2 and 8 with 1-8 heads, contexts that are
# not a multiple of the 64-key block (and one slot), drafter masks (causal/window over a ring) and rows that see
# only their block
CASES = [(1, 8, 8, 1, 128, 100, "noncausal_window"), (2, 1, 2, 1, 16, 70, "random"), (1, 3, 4, 2, 32, 1, "full"),
         (2, 17, 8, 4, 16, 130, "causal_window"), (1, 8, 1, 1, 32, 64, "block_only"), (1, 5, 6, 3, 16, 37, "random"),
         (1, 3, 16, 2, 16, 200, "causal_window")]


# The fast loop interprets the first case in both dtypes; the other shapes and masks run in the full suite.
@pytest.mark.interpret
@pytest.mark.parametrize("b,t,heads,kv_heads,hd,s,mask", CASES[:1] + [pytest.param(*c, marks=pytest.mark.slow)
                                                                      for c in CASES[1:]])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_reference(b, t, heads, kv_heads, hd, s, mask, dtype):
    rng = np.random.default_rng(hash((b, t, heads, s)) % 2**32)
    q, k_ctx, v_ctx, k_blk, v_blk, visible = operands(rng, b, t, heads, kv_heads, hd, s, mask, dtype)
    got = attend(pack_qkv(q, k_blk, v_blk), k_ctx, v_ctx, visible, layer=1, impl="pallas", interpret=True)
    want = attend_reference(q, k_ctx[1], v_ctx[1], k_blk, v_blk, visible)
    assert got.dtype == want.dtype == dtype
    # float32: sums in another order; bf16: the unnormalised probabilities are rounded where the reference
    # rounds normalised ones
    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0,
                               atol=tol * float(jnp.abs(want.astype(jnp.float32)).max()))


def test_packing_keeps_each_query_head_with_its_kv_head():
    """pack_qkv puts query head h beside kv head h // G (the reference's GQA reading), and unpack_qkv undoes it."""
    rng = np.random.default_rng(2)
    q, _, _, k, v, _ = operands(rng, 2, 3, 6, 2, 16, 5, "random", jnp.float32)
    qkv = pack_qkv(q, k, v)
    assert qkv.shape == (2, 3, 2, 5, 16)
    for h in range(6):
        np.testing.assert_array_equal(qkv[:, :, h // 3, h % 3], q[:, :, h])
    np.testing.assert_array_equal(qkv[:, :, :, 3], k)
    np.testing.assert_array_equal(qkv[:, :, :, 4], v)
    for got, want in zip(unpack_qkv(qkv), (q, k, v)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.interpret
def test_many_splits_and_a_ragged_query_block():
    """65 block tokens of group 4 (query blocks of 16 tokens, the last one ragged) over 300 slots: 5 key blocks in 2
    splits, the last block ragged."""
    rng = np.random.default_rng(7)
    q, k_ctx, v_ctx, k_blk, v_blk, visible = operands(rng, 1, 65, 4, 1, 16, 300, "random", jnp.float32, layers=1)
    got = attend(pack_qkv(q, k_blk, v_blk), k_ctx[0], v_ctx[0], visible, impl="pallas", interpret=True)
    want = attend_reference(q, k_ctx[0], v_ctx[0], k_blk, v_blk, visible)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(jnp.abs(want).max()))


@pytest.mark.interpret
def test_a_row_that_sees_nothing_is_zeros():
    """The contract's one difference from the reference (which averages every key there)."""
    rng = np.random.default_rng(3)
    q, k_ctx, v_ctx, k_blk, v_blk, visible = operands(rng, 1, 3, 2, 1, 16, 40, "random", jnp.float32, layers=1)
    visible = visible.at[0, 1].set(False)
    got = np.asarray(attend(pack_qkv(q, k_blk, v_blk), k_ctx[0], v_ctx[0], visible, impl="pallas",
                            interpret=True))
    want = np.asarray(attend_reference(q, k_ctx[0], v_ctx[0], k_blk, v_blk, visible))
    np.testing.assert_array_equal(got[0, 1], 0)
    np.testing.assert_allclose(got[0, ::2], want[0, ::2], rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.interpret
def test_the_derivative_is_the_references():
    """Training differentiates through the drafter: the kernel's jvp (and so its vjp) is the reference's."""
    rng = np.random.default_rng(4)
    q, k_ctx, v_ctx, k_blk, v_blk, visible = operands(rng, 1, 3, 4, 2, 16, 20, "random", jnp.float32, layers=1)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(impl):
        return lambda *a: jnp.sum(w * attend(*a, visible, impl=impl, interpret=impl == "pallas"))
    args = (pack_qkv(q, k_blk, v_blk), k_ctx[0], v_ctx[0])
    got, want = (jax.grad(loss(impl), argnums=range(3))(*args) for impl in ("pallas", "xla"))
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(jnp.abs(r).max()))


@pytest.mark.interpret
@pytest.mark.parametrize("split", [True, pytest.param(False, marks=pytest.mark.slow)])   # fast: per-layer
def test_the_drafter_through_the_kernel(split):
    """draft() with Runtime(attn_impl="pallas") (interpret mode on the CPU) against the XLA path, per-layer
    buffers (the kernel reads each layer of the whole feature cache in place) and a stacked scan."""
    c = dflash.DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=96, vocab_size=128, block_size=5, mask_token_id=127,
                             target_layer_ids=(0, 1), layer_causal=(True, False), layer_window=(6, 0))
    p = dflash.compute_params(dflash.init_params(c, jax.random.key(0)), split=split)
    rng = np.random.default_rng(5)
    target = {"embed": jnp.asarray(rng.standard_normal((128, 64)), jnp.float32),
              "lm_head": jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)}
    taps = jnp.asarray(rng.standard_normal((2, 2, 11, 64)), jnp.float32)
    lengths = jnp.asarray([11, 7])
    cache, _ = dflash.prefill_features(p, c, target, taps, lengths, 20)
    bonus = jnp.asarray([3, 9])
    got, want = (dflash.draft(p, c, target, cache, bonus, lengths, 5, rt=Runtime(attn_impl=impl))
                 for impl in ("pallas", "xla"))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


# ---- the rules and what "auto" picks ------------------------------------------------------------------------------

def test_the_rules_name_each_limit():
    call = DrafterAttentionCall(8, 64, 8, 128, 4096, ("bfloat16",) * 3)
    gpu, interpret = LOWERINGS["h200"], Lowering("default", interpret=True)
    assert pallas_supports(call, gpu) is None
    refusals = {"dtype": call.__class__(8, 64, 8, 128, 4096, ("float32",) * 3),
                "mixed": call.__class__(8, 64, 8, 128, 4096, ("bfloat16", "float32", "float32")),
                "tokens": call.__class__(MAX_BLOCK_TOKENS + 1, 64, 8, 128, 4096, call.dtypes),
                "slots": call.__class__(8, 64, 8, 128, 0, call.dtypes),
                "head_dim": call.__class__(8, 64, 8, 96, 4096, call.dtypes),
                "small_head_dim": call.__class__(8, 64, 8, 8, 4096, call.dtypes),
                "group": call.__class__(8, 12, 4, 128, 4096, call.dtypes),
                "big_group": call.__class__(8, 128, 1, 128, 4096, call.dtypes)}
    for name, c in refusals.items():
        assert isinstance(pallas_supports(c, gpu), str), name
    assert pallas_supports(refusals["dtype"], interpret) is None        # float32 in interpret mode (the tests)
    with pytest.raises(ValueError, match="at least one context row"):
        attend(jnp.zeros((1, 2, 1, 4, 16)), jnp.zeros((1, 0, 1, 16)), jnp.zeros((1, 0, 1, 16)),
               jnp.ones((1, 2, 2), bool), impl="pallas")


def test_auto_over_the_shape_space():
    """Heads per device 1-16 over 1, 2 or 8 kv heads, block tokens 1-65 (and 256, 257), contexts 1 to 4101 slots,
    head_dim 128 and 96, bf16 and float32, on every target: the kernels on every GPU for exactly the calls their
    rules take (16-bit; a power-of-two group and head_dim), XLA on TPUs and the CPU."""
    picks = set()
    for heads, kv_heads, t, s, hd, dtype in itertools.product(range(1, 17), (1, 2, 8), [*range(1, 66), 256, 257],
                                                              (1, 37, 4096, 4101), (128, 96),
                                                              ("bfloat16", "float32")):
        if heads % kv_heads:
            continue
        call = DrafterAttentionCall(t, heads, kv_heads, hd, s, (dtype,) * 3)
        group = heads // kv_heads
        kernel_takes = (dtype == "bfloat16" and t <= MAX_BLOCK_TOKENS and hd == 128 and not group & (group - 1))
        for target, lowering in LOWERINGS.items():
            name = DRAFTER_ATTENTION.resolve(call, lowering)
            ranked = [n for n in registry.preference(lowering) if n in ("pallas", "xla")]
            for better in ranked[:ranked.index(name)]:      # everything preferred to the pick says why not
                assert DRAFTER_ATTENTION.refusal(better, call, lowering)
            assert name == ("pallas" if lowering.platform == "cuda" and kernel_takes else "xla"), (target, call)
            picks.add((target, name))
    assert picks == {(g, n) for g in GPUS for n in ("pallas", "xla")} | {(g, "xla") for g in (*TPUS, "cpu")}
    # the stand-ins: "mosaic" is the Triton kernels', "tpu" XLA's
    assert DRAFTER_ATTENTION.implementation("mosaic").name == "pallas"
    assert DRAFTER_ATTENTION.implementation("tpu").name == "xla"


# ---- deviceless compiles ------------------------------------------------------------------------------------------

# (b, t, heads, kv_heads, head_dim, s): K2.6's drafter as a device runs it (replicated: 64 heads over 8 kv heads,
# block 8, the 4096-slot ring), the same heads split 8 ways (8 heads over 1 kv head), and around them: a wider
# ragged block over a ragged context, one token, head_dim 256, the largest group
SHAPES = [(1, 8, 64, 8, 128, 4096), (1, 8, 8, 1, 128, 4096), (3, 65, 4, 2, 64, 300), (1, 1, 8, 8, 128, 4096),
          (2, 3, 16, 1, 256, 4096), (1, 17, 64, 1, 128, 100)]


def compiled_hlo(target, b, t, heads, kv_heads, hd, s, layers=6):
    """attend(impl="auto") of bf16 operands (the whole feature cache at layer 3) lowered for one compile-only
    ``target`` device, compiled with spills as errors."""
    mesh = targets.compile_mesh(target, 1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arg = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    args = (arg(b, t, kv_heads, heads // kv_heads + 2, hd), arg(layers, b, s, kv_heads, hd),
            arg(layers, b, s, kv_heads, hd), arg(b, t, s + t, dtype=bool))
    with targets.lowering_for(mesh):
        lowered = jax.jit(lambda *a: attend(*a, layer=3)).lower(*args)
    return lowered.compile(targets.compiler_options(target)).as_text()


@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,shape", [
    pytest.param(g, shape, marks=() if (g, shape) == ("h200", SHAPES[0]) else pytest.mark.slow)
    for g in GPUS for shape in SHAPES])
def test_auto_compiles_on_every_gpu(target, shape):
    """What "auto" picks (the kernel and its merge: 2 Triton calls) compiles spill-free, deviceless."""
    b, t, heads, kv_heads, hd, s = shape
    call = DrafterAttentionCall(t, heads, kv_heads, hd, s, ("bfloat16",) * 3)
    assert DRAFTER_ATTENTION.resolve(call, LOWERINGS[target]) == "pallas"
    assert compiled_hlo(target, *shape).count(TRITON_CALL) == 2
