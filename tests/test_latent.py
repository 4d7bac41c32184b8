"""MLA's latent projections (kimi_jax.ops.latent): the latent projection (the norm, q_a and kv_a, their norms, the
key's RoPE) and the absorbed queries (q_b, the query's RoPE, W_UK), each Triton kernel in interpret mode against
the jnp reference (HF's order of operations), the rules over the shape space, the derivatives, and the kernels
compiled spill-free with XLA's real GPU compiler at K2.6 shapes (8 heads a device at TP-8, 4 at TP-16)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kimi_jax import cache as cache_lib
from kimi_jax.analysis import targets
from kimi_jax.analysis.targets import TRITON_CALL
from kimi_jax.model.layers import yarn_frequencies
from kimi_jax.ops.latent.api import (LATENT, MAX_ROWS, QUERIES, LatentCall, QueriesCall, absorbed_queries,
                                     latent_projection)
from kimi_jax.ops.latent.pallas_triton import CHUNK, splits_for
from kimi_jax.ops.numerics import pow2_divisor
from kimi_jax.ops.latent.reference import latent_reference, queries_reference
from kimi_jax.ops.registry import Lowering

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPU_MISSING = targets.compiler_missing("h200")
KW = dict(eps=1e-6, latent_eps=1e-6)
K26 = dict(d=7168, q=1536, r=512, p=64)


def _inputs(t, d, q, r, p, seed=0, dtype=jnp.bfloat16, batch=1):
    rng = np.random.default_rng(seed)
    arr = lambda shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, dtype)  # noqa: E731
    weight = lambda n: jnp.asarray(rng.uniform(0.5, 1.5, n), dtype)  # noqa: E731
    return (arr((batch, t, d), 3.0), weight(d), arr((d, q), d ** -0.5), arr((d, r + p), d ** -0.5), weight(q),
            weight(r), jnp.asarray(rng.integers(0, 200_000, (batch, t)), jnp.int32),
            yarn_frequencies(p, 50000.0, 64.0, 4096, 32.0, 1.0))


def _close(got, want):
    """bf16 results one or two roundings apart (the kernel's GEMM reads norm * x rounded, the reference's norm(x)
    * weight: a bf16 rounding in a different place, carried through the latent norms): each element within 2^-6
    of itself (two bf16 ulps) plus 2^-8 of the largest."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    err = np.abs(got - want)
    bound = 2.0 ** -6 * np.abs(want) + 2.0 ** -8 * np.abs(want).max()
    assert (err <= bound).all(), (err.max(), (err / bound).max())


@pytest.mark.interpret
@pytest.mark.parametrize("t,d,q,r,p", [(17, 1024, 1536, 512, 64), (1, 7168, 1536, 512, 64), (3, 64, 48, 32, 16),
                                       pytest.param(5, 96, 80, 48, 8, marks=pytest.mark.slow),
                                       pytest.param(300, 1024, 48, 32, 16, marks=pytest.mark.slow)])
def test_kernel_matches_reference(t, d, q, r, p):
    """A verify width on K2.6's latent widths, a decode token on all of K2.6's (8 K splits), the tiny test model's
    widths (one split, chunks that are not 512), and a prefill width a forced kernel takes (one split)."""
    args = _inputs(t, d, q, r, p, seed=t)
    want = latent_reference(*args, **KW)
    got = jax.jit(functools.partial(latent_projection, impl="pallas", interpret=True, **KW))(*args)
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.interpret
def test_batch_rows_and_rope_positions():
    """Two rows of a batch, each token at its own position: the rows' tokens are the kernel's programs."""
    args = _inputs(4, 64, 48, 32, 16, seed=3, batch=2)
    want = latent_reference(*args, **KW)
    got = latent_projection(*args, impl="pallas", interpret=True, **KW)
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.interpret
@pytest.mark.parametrize("paged", [False, True])
def test_kernel_writes_the_cache_as_cache_write_does(paged):
    """The rows go into the whole cache at their layer and slots, in place (contiguous: a row a batch entry;
    paged: through the page table), slots past a row's storage dropped; every other row of the cache unchanged."""
    b, t, d, q, r, p = 2, 3, 64, 48, 32, 16
    args = _inputs(t, d, q, r, p, seed=4, batch=b)
    rng = np.random.default_rng(4)
    if paged:       # 4 pages of 8 slots a row at most; row 1 has only 2 pages mapped (8 = unmapped)
        kv = jnp.asarray(rng.normal(size=(2, 8, 8, r + p)), jnp.bfloat16)
        table = jnp.asarray([[3, 0, 5, 7], [2, 6, 8, 8]], jnp.int32)
        slots = jnp.asarray([[9, 10, 30], [14, 15, 16]], jnp.int32)         # row 1's slot 16: page 2, unmapped
    else:
        kv = jnp.asarray(rng.normal(size=(2, b, 20, r + p)), jnp.bfloat16)
        table, slots = None, jnp.asarray([[4, 5, 6], [17, 19, 20]], jnp.int32)   # slot 20: past the storage
    cache = (kv, table, 1, slots)
    cq_ref, kv_ref = latent_reference(*args, cache, **KW)
    cq, kv_got = jax.jit(functools.partial(latent_projection, impl="pallas", interpret=True, **KW))(*args, cache)
    _close(cq, cq_ref)
    # where cache.write puts the six rows (a row it drops marks nothing)
    written = np.asarray(cache_lib.write(jnp.zeros(kv.shape, bool), table, 1, slots, jnp.ones((b, t, r + p), bool)))
    np.testing.assert_array_equal(np.asarray(kv_got)[~written], np.asarray(kv_ref)[~written])
    _close(np.asarray(kv_got)[written], np.asarray(kv_ref)[written])
    assert written.any(axis=-1).sum() == b * t - 1          # one slot of the six dropped


def test_splits_and_chunks():
    assert splits_for(7168, 17) == 8 and splits_for(1024, 1) == 8 and splits_for(64, 1) == 1
    assert splits_for(384, 17) == 2 and splits_for(7168, 100) == 4 and splits_for(7168, 300) == 1
    assert [pow2_divisor(n, CHUNK) for n in (1536, 576, 48, 7168)] == [512, 64, 16, 512]


def test_rules_over_the_shape_space():
    """"auto": the kernel on every GPU for 16-bit rows up to MAX_ROWS, XLA past it (a forced kernel takes those
    too), for f32 compiled, on TPUs and CPUs."""
    gpus = [Lowering("cuda", kind) for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200",
                                                "NVIDIA RTX PRO 6000 Blackwell Server Edition")]
    for t, dtype, p in itertools.product([1, 2, 17, 64, 65, 255, 512, 513, 4096], ("bfloat16", "float16", "float32"),
                                         (64, 16, 6)):
        call = LatentCall(t, 7168, 1536, 512, p, dtype)
        for lowering in gpus:
            want = "pallas" if t <= MAX_ROWS and dtype != "float32" and p in (64, 16) else "xla"
            assert LATENT.resolve(call, lowering) == want, (call, lowering)
        for lowering in (Lowering("cpu"), Lowering("tpu", "TPU v5 lite")):
            assert LATENT.resolve(call, lowering) == "xla"
    call = LatentCall(17, 7168, 1536, 512, 64, "bfloat16")
    assert LATENT.require("mosaic", call, gpus[1]) == "pallas"                  # the attention's impl's stand-in
    assert LATENT.require("pallas", LatentCall(4096, 7168, 1536, 512, 64, "bfloat16"), gpus[1]) == "pallas"
    assert "prefill" in LATENT.auto_refusal("pallas", LatentCall(4096, 7168, 1536, 512, 64, "bfloat16"), gpus[1])
    with pytest.raises(ValueError, match="power of two"):
        LATENT.require("pallas", LatentCall(17, 7168, 1536, 512, 6, "bfloat16"), gpus[1])


@pytest.mark.interpret
def test_derivative_is_the_reference_s():
    args = _inputs(3, 64, 48, 32, 16, seed=1, dtype=jnp.float32)
    loss = lambda f: lambda x, q_a: sum(o.sum() for o in f(x, args[1], q_a, *args[3:], **KW))   # noqa: E731
    got = jax.grad(loss(functools.partial(latent_projection, impl="pallas", interpret=True)), (0, 1))(args[0], args[2])
    want = jax.grad(loss(latent_reference), (0, 1))(args[0], args[2])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,t", [("h200", 17)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [("h200", 1), ("h200", 255), ("h200", 16),
                                                             ("h100", 65), ("b200", 17), ("b300", 2),
                                                             ("rtx_pro_6000", 17)]])
def test_compiles_at_k26_shapes(target, t):
    """What "auto" picks at K2.6's widths, odd token counts up to the rule's bound, writing into a contiguous cache
    of 4096 slots (odd counts) or a paged one (even): the kernel, spill-free."""
    mesh = targets.compile_mesh(target, 1)
    s = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    d, q, r, p = K26.values()
    paged = t % 2 == 0
    cache = ((s((3, 128, 64, r + p)), s((1, 64), jnp.int32)) if paged else (s((3, 1, 4096, r + p)), None))
    with targets.lowering_for(mesh):
        lowered = jax.jit(lambda *a: latent_projection(*a[:8], (a[8], a[9], 2, a[10]), **KW)).lower(
            s((1, t, d)), s((d,)), s((d, q)), s((d, r + p)), s((q,)), s((r,)), s((1, t), jnp.int32),
            s((p // 2,), jnp.float32), *cache, s((1, t), jnp.int32))
    assert lowered.as_text().count(TRITON_CALL) == 1
    compiled = lowered.compile(targets.compiler_options(target)).as_text()
    assert compiled.count(TRITON_CALL) == 1, compiled


# ---- the absorbed queries ----------------------------------------------------------------------------------------

def _query_inputs(t, q, h, nope, p, r, v, seed=0, dtype=jnp.bfloat16, batch=1):
    rng = np.random.default_rng(seed)
    arr = lambda shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, dtype)  # noqa: E731
    return (arr((batch, t, q)), arr((q, h, nope + p), q ** -0.5), arr((r, h, nope + v), nope ** -0.5),
            jnp.asarray(rng.integers(0, 200_000, (batch, t)), jnp.int32), yarn_frequencies(p, 50000.0, 64.0, 4096,
                                                                                            32.0, 1.0))


@pytest.mark.interpret
@pytest.mark.parametrize("t,q,h,nope,p,r,v", [(17, 1536, 8, 128, 64, 512, 128), (3, 32, 4, 16, 8, 16, 16),
                                              pytest.param(70, 64, 2, 16, 8, 32, 16, marks=pytest.mark.slow),
                                              pytest.param(1, 1536, 4, 128, 64, 512, 128, marks=pytest.mark.slow)])
def test_queries_kernel_matches_reference(t, q, h, nope, p, r, v):
    """K2.6's heads a device at TP-8 for a verify, the tiny model's widths, 70 rows (two row blocks, the last
    ragged), and one decode token on TP-16's 4 heads."""
    args = _query_inputs(t, q, h, nope, p, r, v, seed=t)
    want = queries_reference(*args)
    got = jax.jit(functools.partial(absorbed_queries, impl="pallas", interpret=True))(*args)
    for g, w in zip(got, want):
        _close(g, w)


def test_queries_rules_over_the_shape_space():
    gpu = Lowering("cuda", "NVIDIA H200")
    for t, h, dtype, (nope, p, r) in itertools.product([1, 17, 65, 512, 513], range(1, 17), ("bfloat16", "float32"),
                                                       [(128, 64, 512), (16, 8, 16), (24, 8, 16), (16, 6, 16)]):
        call = QueriesCall(t, 1536, h, nope, p, r, dtype)
        want = "pallas" if t <= MAX_ROWS and dtype == "bfloat16" and nope % 16 == 0 and p in (64, 8) else "xla"
        assert QUERIES.resolve(call, gpu) == want, call
        assert QUERIES.resolve(call, Lowering("cpu")) == "xla"
    with pytest.raises(ValueError, match="multiples of 16"):
        QUERIES.require("pallas", QueriesCall(17, 1536, 8, 24, 64, 512, "bfloat16"), gpu)


@pytest.mark.interpret
def test_queries_derivative_is_the_reference_s():
    cq, q_b, kv_b, pos, inv = _query_inputs(3, 32, 4, 16, 8, 16, 16, seed=2, dtype=jnp.float32)
    loss = lambda f: lambda cq, q_b, kv_b: sum(o.sum() for o in f(cq, q_b, kv_b, pos, inv))   # noqa: E731
    got = jax.grad(loss(functools.partial(absorbed_queries, impl="pallas", interpret=True)), (0, 1, 2))(cq, q_b, kv_b)
    want = jax.grad(loss(queries_reference), (0, 1, 2))(cq, q_b, kv_b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,t,h", [("h200", 17, 8)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [("h200", 1, 8), ("h200", 255, 8), ("h100", 65, 4),
                                                             ("b200", 17, 16), ("b300", 3, 1),
                                                             ("rtx_pro_6000", 17, 8)]])
def test_queries_compile_at_k26_shapes(target, t, h):
    mesh = targets.compile_mesh(target, 1)
    s = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    fn = jax.jit(absorbed_queries)
    with targets.lowering_for(mesh):
        lowered = fn.lower(s((1, t, 1536)), s((1536, h, 192)), s((512, h, 256)), s((1, t), jnp.int32),
                           s((32,), jnp.float32))
    assert lowered.as_text().count(TRITON_CALL) == 1
    compiled = lowered.compile(targets.compiler_options(target)).as_text()
    assert compiled.count(TRITON_CALL) == 1, compiled
