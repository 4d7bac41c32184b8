"""The kernel registry over the shape space (kimi_jax.ops.registry, issue 38): for every compile target and a grid
of call shapes, what "auto" picks is the first of the target's preference whose rules take the call; then a sample
of those picks, one per (op, target, implementation) and both sides of every rule's boundary, lowered (and some
compiled) with the real compilers, deviceless, through the ops' public entry points. Before the registry, "auto"
gave the Mosaic GPU tree attention 17 tree tokens x 4 heads (64 heads on 16 devices) and its TMA setup failed
("dimension 1 must have size smaller or a multiple of its tiling 8")."""

import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from kimi_jax.analysis import targets
from kimi_jax.analysis.targets import MOSAIC_CALL, TPU_CALL, TRITON_CALL
from kimi_jax.ops import registry
from kimi_jax.ops.int4_format import Int4Experts
from kimi_jax.ops.int4_moe.api import int4_moe
from kimi_jax.ops.int4_moe.rules import INT4_MOE, MoeCall
from kimi_jax.ops.registry import Lowering
from kimi_jax.ops.router.api import ROUTER, RouterCall, route_topk
from kimi_jax.ops.tree_attention.api import latent_attention
from kimi_jax.ops.tree_attention.rules import MAX_TREE_TOKENS, TREE_ATTENTION, AttentionCall

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPUS = ("h100", "h200", "b200", "b300", "rtx_pro_6000")
HOPPER = ("h100", "h200")
TPUS = ("v5e", "v6e", "v5p", "tpu7x")
LOWERINGS = {**{n: Lowering(targets.get_target(n).platform, targets.get_target(n).device_kind) for n in GPUS + TPUS},
             "cpu": Lowering("cpu")}
GPU_MISSING = targets.compiler_missing("h100")
TPU_MISSING = targets.compiler_missing("v5e")


def decide(op, call, lowering: Lowering) -> str:
    """The resolver's pick, checked against the rules: it supports the call, and every implementation the
    target prefers to it refuses the call with a reason."""
    name = op.resolve(call, lowering)
    assert op.refusal(name, call, lowering) is None
    ranked = [n for n in registry.preference(lowering) if n in {i.name for i in op.implementations}]
    for better in ranked[:ranked.index(name)]:
        reason = op.auto_refusal(better, call, lowering)
        assert isinstance(reason, str) and reason, (better, call)
    return name


# ---- the resolver over the grid ----------------------------------------------------------------------------------

ATTENTION_DIMS = [  # (batch, latent, rope, slots, page, dtype)
    (1, 512, 64, 4096, 0, "bfloat16"), (3, 512, 64, 200, 0, "bfloat16"), (2, 512, 64, 4101, 0, "bfloat16"),
    (1, 512, 64, 40, 0, "bfloat16"), (2, 512, 64, 4096, 64, "bfloat16"), (1, 512, 64, 4096, 16, "bfloat16"),
    (1, 512, 64, 4096, 96, "bfloat16"), (1, 512, 64, 4096, 0, "float32"), (1, 128, 64, 256, 0, "bfloat16"),
    (1, 96, 32, 256, 0, "bfloat16")]


def test_tree_attention_over_the_grid():
    """Heads per device 1-16 x tree tokens 1-65 (and 256, 257) x the cache shapes above, on every target."""
    picks = {}
    for (b, r, p, s, page, dtype), h, t in itertools.product(ATTENTION_DIMS, range(1, 17), [*range(1, 66), 256, 257]):
        call = AttentionCall(b, t, h, r, p, s, page, dtype)
        for target, lowering in LOWERINGS.items():
            name = decide(TREE_ATTENTION, call, lowering)
            picks.setdefault((target, name), call)
            if lowering.platform == "tpu":    # the TPU kernel takes every tree call of these shapes
                assert name == ("tpu" if t <= MAX_TREE_TOKENS else "xla"), (target, call)
            elif lowering.platform != "cuda" or t > MAX_TREE_TOKENS or dtype == "float32":
                assert name == "xla"
            else:                           # every GPU's kernels take every 16-bit tree call
                assert name != "xla" or page % 16 or page & (page - 1), (target, call)
            dims = p == 64 and r % 64 == 0 and dtype == "bfloat16" and page in (0, 64)     # wgmma's tiles
            tma = (t * h <= 8 or t * h % 8 == 0) and (page > 0 or s < 64 or s % 8 == 0)
            assert (name == "mosaic") == (target in HOPPER and t <= MAX_TREE_TOKENS and dims and tma), (target, call)
    # every target's kernels serve some call: Hopper both, the other GPUs Triton's, TPUs theirs, the CPU XLA only
    assert {k for k in picks} == {(g, n) for g in GPUS for n in ("pallas", "xla")} | \
        {(g, "mosaic") for g in HOPPER} | {(g, n) for g in TPUS for n in ("tpu", "xla")} | {("cpu", "xla")}


def test_the_issue_38_call_is_not_given_to_mosaic():
    """K2.6's 64 heads on 16 devices: 4 heads x 17 tree tokens = 68 query rows, not whole 8-row TMA tiles."""
    call = AttentionCall(1, 17, 4, 512, 64, 4096, 0, "bfloat16")
    for target in HOPPER:
        assert TREE_ATTENTION.resolve(call, LOWERINGS[target]) == "pallas"
        assert "8" in TREE_ATTENTION.refusal("mosaic", call, LOWERINGS[target])
    with pytest.raises(ValueError, match="t\\*h = 17\\*4 = 68"):
        TREE_ATTENTION.require("mosaic", call, LOWERINGS["h100"])
    # GPU interpret mode runs no TMA: the rule is the compiler's
    assert TREE_ATTENTION.refusal("mosaic", call, Lowering("cuda", None, interpret=True)) is None


MOE_DIMS = [(7168, 256), (7168, 192), (7168, 160), (7168, 2048), (7040, 256), (256, 64)]     # (d_model, d_ff)


def test_int4_moe_and_router_over_the_grid():
    for (d, f), dtype, bm, target in itertools.product(MOE_DIMS, ("bfloat16", "float16", "float32"),
                                                       (None, 8, 16, 32, 64, 128), LOWERINGS):
        lowering = LOWERINGS[target]
        call = MoeCall(dtype, d, f, bm)
        name = decide(INT4_MOE, call, lowering)
        mosaic_ok = dtype != "float32" and f % 64 == 0 and d % 128 == 0 and bm in (None, 8, 16, 32, 64)
        assert (name == "mosaic") == (target in HOPPER and mosaic_ok), (target, call)
        tpu_ok = dtype != "float16" and all(n % 128 == 0 or n <= 128 for n in (d, f)) and bm != 8
        assert (name == "tpu") == (target in TPUS and tpu_ok), (target, call)
        assert name != "xla" or lowering.platform != "cuda" or bm == 8           # Triton's blocks start at 16
    for (d, e, k), dtype, target in itertools.product([(7168, 384, 8), (7168, 384, 6), (7000, 384, 8), (128, 16, 2),
                                                       (128, 24, 2)], ("bfloat16", "float32"), LOWERINGS):
        name = decide(ROUTER, RouterCall(d, e, k, dtype), LOWERINGS[target])
        assert name == ("pallas" if LOWERINGS[target].platform == "cuda" and d % 16 == 0 and e % 16 == 0
                        and not k & (k - 1) and dtype == "bfloat16" else "xla")
    assert ROUTER.require("mosaic", RouterCall(7168, 384, 8, "bfloat16"), LOWERINGS["h200"]) == "pallas"  # stand-in


def test_a_call_left_to_the_partitioner_is_xlas_on_a_tpu():
    """A cache split by position (dcp) leaves the attention to XLA's SPMD partitioner, which refuses Mosaic TPU
    calls ("Mosaic kernels cannot be automatically partitioned", the v5p sweep's dcp cell before this rule); GPU
    kernels are partitioned (gathered) as before."""
    call = AttentionCall(tokens=17, heads=8, partitioned=True, **K2)
    for target in TPUS:
        assert TREE_ATTENTION.resolve(call, LOWERINGS[target]) == "xla"
        assert "dcp" in TREE_ATTENTION.refusal("tpu", call, LOWERINGS[target])
    assert TREE_ATTENTION.resolve(call, LOWERINGS["h200"]) == TREE_ATTENTION.resolve(
        AttentionCall(tokens=17, heads=8, **K2), LOWERINGS["h200"])


def test_forced_implementations_name_the_reason():
    call = AttentionCall(1, 9, 1, 512, 64, 4096, 0, "bfloat16")
    with pytest.raises(ValueError, match="tree attention impl='mosaic'.*query rows"):
        TREE_ATTENTION.require("mosaic", call, LOWERINGS["h200"])
    with pytest.raises(ValueError, match="Hopper"):
        TREE_ATTENTION.require("mosaic", AttentionCall(1, 8, 8, 512, 64, 4096, 0, "bfloat16"), LOWERINGS["b200"])
    with pytest.raises(ValueError, match="16-bit"):
        INT4_MOE.require("mosaic", MoeCall("float32", 7168, 256), LOWERINGS["h100"])
    assert INT4_MOE.require("mosaic", MoeCall("bfloat16", 7168, 256, 16), LOWERINGS["b300"]) == "mosaic"  # tcgen05
    with pytest.raises(ValueError, match="one of \\(16, 32, 64\\)"):
        INT4_MOE.require("mosaic", MoeCall("bfloat16", 7168, 256, 8), LOWERINGS["b200"])


# ---- what the resolver picks, lowered and compiled ------------------------------------------------------------------

def _lower(target: str, fn, *args):
    """fn(*args) lowered for one compile-only ``target`` device (args abstract, replicated on it)."""
    mesh = targets.compile_mesh(target, 1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), args)
    with targets.lowering_for(mesh):
        return jax.jit(fn).lower(*args)


def _kernel_in(text: str) -> str:
    return ("mosaic" if MOSAIC_CALL in text else "pallas" if TRITON_CALL in text else
            "tpu" if TPU_CALL in text else "xla")


def _attention(target: str, call: AttentionCall, impl: str = "auto"):
    s = lambda *shape, dtype=jnp.dtype(call.dtype): jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    b, t, h = call.batch, call.tokens, call.heads
    args = [s(b, t, h, call.latent), s(b, t, h, call.rope),
            s(call.slots // call.page, call.page, call.latent + call.rope) if call.page else
            s(b, call.slots, call.latent + call.rope), s(b, dtype=jnp.int32), s(b, t, t, dtype=jnp.bool_)]
    args.append(s(call.latent, h, 2 * 128))                   # kv_b: K2.6's 128 nope + 128 value columns a head
    if call.page:
        args.append(s(b, call.slots // call.page, dtype=jnp.int32))

    def fn(q, qpe, kv, lengths, mask, kv_b, table=None):       # W_UV given to the op, as the model does
        return latent_attention(q, qpe, kv, lengths, mask, 0.1, impl=impl, page_table=table, w_uv=kv_b,
                                w_uv_from=128)
    return _lower(target, fn, *args)


K2 = dict(batch=1, latent=512, rope=64, slots=4096, page=0, dtype="bfloat16")
SHORT = {**K2, "slots": 256}     # one prefix split: the merge takes 2 partial states
# (target, call): one per (target, implementation), both sides of each Mosaic rule on H100, and the Triton
# kernel's merge at 2 partial states with a ragged last query block on every GPU (it spilled at 32-row blocks)
ATTENTION_SAMPLES = [(g, AttentionCall(tokens=16, heads=8, **K2)) for g in GPUS] + [
    (g, AttentionCall(tokens=17, heads=4, **SHORT)) for g in GPUS] + [
    ("h100", AttentionCall(tokens=t, heads=h, **K2)) for t, h in [(8, 1), (9, 1), (17, 4), (18, 4), (3, 3),
                                                                  (65, 1), (1, 16), (257, 1)]] + [
    ("h200", AttentionCall(tokens=t, heads=h, **SHORT)) for t, h in [(18, 4), (33, 1)]] + [
    ("h100", AttentionCall(tokens=16, heads=4, **{**K2, **kw})) for kw in [
        dict(slots=63), dict(slots=72), dict(slots=201), dict(page=64), dict(page=32), dict(page=96),
        dict(dtype="float32")]]


def _ids(samples):
    return [f"{g}-t{c.tokens}h{c.heads}s{c.slots}p{c.page}-{c.dtype}" for g, c in samples]


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,call", ATTENTION_SAMPLES, ids=_ids(ATTENTION_SAMPLES))
def test_tree_attention_compiles_what_auto_picks(target, call):
    """Through latent_attention(impl="auto", w_uv=...): the program holds the picked implementation's kernel, the
    GPU kernels' merge projects by W_UV (no dot left in XLA where merge.project_supports takes the call), and it
    compiles with spills as errors (the Mosaic kernel by ptxas, the Triton ones by XLA's Triton pipeline)."""
    from kimi_jax.ops.tree_attention.merge import project_supports
    lowered = _attention(target, call)
    picked = TREE_ATTENTION.resolve(call, LOWERINGS[target])
    assert _kernel_in(lowered.as_text()) == picked
    compiled = lowered.compile(targets.compiler_options(target)).as_text()
    if picked in ("pallas", "mosaic"):
        rows = call.rows if picked == "pallas" else -(-call.rows // 64) * 64
        in_kernel = project_supports(call.latent, call.heads, rows, (call.latent, call.heads, 256), 128) is None
        assert (re.search(r"= \S+ dot\(", compiled) is None) == in_kernel, (target, call)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("call", [AttentionCall(tokens=9, heads=1, **K2), AttentionCall(tokens=17, heads=4, **K2),
                                  AttentionCall(tokens=16, heads=4, **{**K2, "slots": 201})],
                         ids=["rows9", "rows68", "slots201"])
def test_the_tma_rule_is_the_compilers(call, monkeypatch):
    """Past the rule (checked off in the kernel's own entry), Mosaic GPU itself refuses to lower the kernel: the
    rule is no stricter than the compiler (the calls on its other side compile above)."""
    from kimi_jax.ops.tree_attention import mosaic_gpu
    monkeypatch.setattr(mosaic_gpu, "mosaic_supports", lambda call, lowering: None)
    s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    b, t, h = call.batch, call.tokens, call.heads
    args = (s(b, t, h, 512), s(b, t, h, 64), s(b, call.slots, 576), s(b, dtype=jnp.int32), s(b, t, t, dtype=bool))
    # the queries' copy names the tiling; a ragged cache fails earlier, in Mosaic GPU's layout inference
    with pytest.raises((ValueError, AssertionError), match="multiple of its tiling 8" if call.slots % 8 == 0 else None):
        _lower("h100", lambda *a: mosaic_gpu.latent_attention_mosaic(*a, 0.1, interpret=False), *args)


def _moe_args(t: int, k: int, e: int, d: int, f: int, dtype):
    s = jax.ShapeDtypeStruct
    experts = Int4Experts(w13=s((e, 2, d // 8, f), jnp.int32), s13=s((e, 2, d // 32, f), jnp.bfloat16),
                          w2=s((e, -(-f // 256) * 32, d), jnp.int32), s2=s((e, -(-f // 256) * 8, d), jnp.bfloat16))
    return s((t, d), dtype), s((t, k), jnp.int32), s((t, k), jnp.float32), experts


MOE_SAMPLES = [(g, 16, 7168, 256, jnp.bfloat16) for g in GPUS] + [
    ("h100", 16, 7168, 160, jnp.bfloat16), ("h100", 16, 7168, 256, jnp.float32), ("h200", 65, 7168, 256, jnp.bfloat16),
    ("h200", 1, 7168, 256, jnp.bfloat16)]


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,t,d,f,dtype", MOE_SAMPLES,
                         ids=[f"{g}-t{t}-d{d}-f{f}-{jnp.dtype(dt).name}" for g, t, d, f, dt in MOE_SAMPLES])
def test_int4_moe_and_router_compile_what_auto_picks(target, t, d, f, dtype):
    """K2.6's 384 experts top-8 at TP-8 widths (F = 256 a device) and around them; 65 tokens are 520 pairs, past
    the placement kernel's 512 (XLA places them)."""
    args = _moe_args(t, 8, 384, d, f, dtype)
    lowered = _lower(target, lambda *a: int4_moe(*a), *args)
    text = lowered.as_text()
    want = INT4_MOE.resolve(MoeCall(jnp.dtype(dtype).name, d, f), LOWERINGS[target])
    assert _kernel_in(text) == want
    placed_by_kernel = t * 8 <= 512 and want != "xla"
    # Triton kernels: pallas' gate/up and down, and (both GPU paths) the placement up to 512 pairs
    assert text.count(TRITON_CALL) == {"pallas": 2, "mosaic": 0, "xla": 0}[want] + placed_by_kernel
    lowered.compile(targets.compiler_options(target))
    router = _lower(target, lambda x, w, bias: route_topk(x, w, bias, k=8, norm_topk_prob=True, scaling=2.5),
                    jax.ShapeDtypeStruct((t, d), dtype), jax.ShapeDtypeStruct((d, 384), dtype),
                    jax.ShapeDtypeStruct((384,), jnp.float32))
    # its two kernels on every GPU for 16-bit inputs (T = 16: the top-k kernel spilled at 4 warps)
    assert router.as_text().count(TRITON_CALL) == (2 if dtype == jnp.bfloat16 else 0)
    router.compile(targets.compiler_options(target))


# (target, attention call): K2.6's heads per chip at TP-8 and TP-16, decode and trees, contiguous and paged,
# and a prefill (XLA's), on every TPU generation
TPU_ATTENTION = [(g, AttentionCall(tokens=t, heads=h, **{**K2, "page": page})) for g in TPUS
                 for t, h, page in [(17, 8, 0), (1, 4, 64)]] + [("v5e", AttentionCall(tokens=257, heads=1, **SHORT))]
# Slow (~10 s with libtpu); the fast loop compiles both TPU kernels in test_int4_moe_tpu and test_tree_attention_tpu,
# and checks the registry's TPU choices over the shape space above.
TPU_ATTENTION = [pytest.param(*sample, marks=pytest.mark.slow) for sample in TPU_ATTENTION]


@pytest.mark.compile
@pytest.mark.skipif(TPU_MISSING is not None, reason=TPU_MISSING or "")
@pytest.mark.parametrize("target,call", TPU_ATTENTION, ids=_ids(p.values for p in TPU_ATTENTION))
def test_tpu_compiles_what_auto_picks(target, call):
    """Through the public entry points (impl="auto") lowered for a TPU: the Pallas TPU tree attention and INT4 MoE
    kernels where their rules take the call (XLA otherwise), compiled by libtpu."""
    lowered = _attention(target, call)
    assert _kernel_in(lowered.as_text()) == TREE_ATTENTION.resolve(call, LOWERINGS[target])
    lowered.compile()
    moe = _lower(target, lambda *a: int4_moe(*a), *_moe_args(call.tokens, 8, 384, 7168, 256, jnp.bfloat16))
    assert moe.as_text().count(TPU_CALL) == 2                   # gate/up and down
    moe.compile()


def test_docs_table_is_the_registrys():
    """docs/design.md's table of rules is ``registry.rules_table()`` as it is now."""
    import pathlib
    design = (pathlib.Path(__file__).parent.parent / "docs" / "design.md").read_text()
    start = design.index("<!-- rules table: generated by kimi_jax.ops.registry.rules_table() -->\n")
    table = design[design.index("\n", start) + 1:design.index("\n<!-- end of rules table -->")]
    assert table == registry.rules_table()
