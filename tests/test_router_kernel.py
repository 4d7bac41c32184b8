"""The router kernels (kimi_jax/ops/router): interpret-mode equality with the jnp reference on this CPU, and deviceless
GPU compiles at K2.6's shapes with register spills as errors.

Inputs are multiples of 1/8 and 1/64 with small D, so every dot product is exact in float32 whatever the
summation order: the ids can be compared exactly, ties included."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax.analysis import targets
from kimi_jax.analysis.targets import TRITON_CALL
from kimi_jax.ops.registry import Lowering
from kimi_jax.ops.router.api import RouterCall, pallas_supports, route_topk
from kimi_jax.ops.router.reference import route_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPU_MISSING = targets.compiler_missing("h200")
K26 = dict(d=7168, e=384, k=8)
KW = dict(norm_topk_prob=True, scaling=2.827)


def _inputs(t, d, e, seed, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(-8, 9, (t, d)) / 8, dtype)
    w = jnp.asarray(rng.integers(-8, 9, (d, e)) / 64, dtype)
    bias = jnp.asarray(rng.integers(-4, 5, (e,)) / 32, jnp.float32)
    return x, w, bias


def _check(x, w, bias, k, **kw):
    kw = {**KW, **kw}
    ids, weights = route_topk(x, w, bias, k=k, impl="pallas", **kw)
    ref_ids, ref_weights = route_reference(x, w, bias, k=k, **kw)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-5, atol=1e-5)
    return ids


@pytest.mark.interpret
@pytest.mark.parametrize("t", [1, 17, 64])
# K2.6's router width (384 experts, top-8) in the full suite; the fast loop interprets the small one and compiles
# K2.6's (test_compiles_at_k26_shapes[h200-17]).
@pytest.mark.parametrize("d,e,k", [(256, 64, 4), pytest.param(512, 384, 8, marks=pytest.mark.slow)])
def test_kernel_matches_reference(t, d, e, k):
    _check(*_inputs(t, d, e, seed=t + e), k)


@pytest.mark.interpret
@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_applies_the_norm_weight_as_the_model_does(scale_dtype):
    """``scale`` (the MoE's RMSNorm weight) multiplies the rows first, rounded in the promoted dtype of x and the
    scale as ``rms_norm`` rounds it: the kernel routes ``scale * x`` exactly as the reference routes the product."""
    x, w, bias = _inputs(17, 256, 64, seed=5)
    scale = jnp.asarray(np.random.default_rng(6).integers(1, 17, 256) / 16 + 1 / 128, scale_dtype)
    ids, weights = route_topk(x, w, bias, scale, k=8, impl="pallas", **KW)
    ref_ids, ref_weights = route_reference(scale * x, w, bias, k=8, **KW)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(ids, route_reference(x, w, bias, k=8, **KW)[0])      # the scale does route


@pytest.mark.interpret
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_f32_and_no_renormalisation(norm):
    _check(*_inputs(17, 128, 32, seed=3, dtype=jnp.float32), 8, norm_topk_prob=norm, scaling=1.0)


@pytest.mark.interpret
def test_ties_go_to_the_lowest_id():
    """Zero rows score 0.5 everywhere, so the bias alone chooses, and it repeats across the column blocks; copied
    router columns tie exactly. The kernel's order must be jax.lax.top_k's (the lowest id first)."""
    t, d, e, k = 17, 256, 384, 8
    x, w, _ = _inputs(t, d, e, seed=5)
    x = x.at[::3].set(0)
    w = w.at[:, 200:].set(w[:, 8:192])                       # columns 200.. copy 8..: ties across blocks
    bias = jnp.asarray(np.tile(np.arange(4) / 64, e // 4), jnp.float32)[::-1]
    ids = _check(x, w, bias, k)
    np.testing.assert_array_equal(ids[0], np.arange(0, 32, 4))   # bias 3/64 at ids = 0 mod 4
    bias0 = jnp.zeros((e,), jnp.float32)
    np.testing.assert_array_equal(_check(x, w, bias0, k)[0], np.arange(k))
    bias1 = bias0.at[jnp.array([300, 5, 130])].set(1.0)     # equal maxima in all three column blocks
    np.testing.assert_array_equal(_check(x, w, bias1, k)[0], [5, 130, 300, 0, 1, 2, 3, 4])


def test_refusals():
    gpu = Lowering("cuda", targets.get_target("h200").device_kind)
    assert pallas_supports(RouterCall(**K26, dtype="bfloat16"), gpu) is None
    assert pallas_supports(RouterCall(7168, 384, 6, "bfloat16"), gpu) is not None
    assert pallas_supports(RouterCall(7168, 100, 8, "bfloat16"), gpu) is not None
    assert pallas_supports(RouterCall(**K26, dtype="float32"), gpu) is not None
    x, w, bias = _inputs(2, 64, 24, seed=0)
    with pytest.raises(ValueError, match="multiples of 16"):
        route_topk(x, w, bias, k=2, impl="pallas", **KW)
    ids, _ = route_topk(x, w, bias, k=2, impl="auto", **KW)     # auto: the XLA path for what the kernel refuses
    np.testing.assert_array_equal(ids, route_reference(x, w, bias, k=2, **KW)[0])


@pytest.mark.interpret
def test_derivative_is_the_reference_s():
    x, w, bias = _inputs(4, 128, 32, seed=1, dtype=jnp.float32)
    loss = lambda f: lambda x, w: f(x, w, bias, k=4, **KW)[1].sum()   # noqa: E731
    got = jax.grad(loss(functools.partial(route_topk, impl="pallas", interpret=True)), argnums=(0, 1))(x, w)
    want = jax.grad(loss(route_reference), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,t", [("h200", 17)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [("h200", 1), ("h200", 64), ("h100", 17), ("b200", 17),
                                                             ("rtx_pro_6000", 17)]])
def test_compiles_at_k26_shapes(target, t):
    """Both kernels, and nothing else, compile spill-free with XLA's real GPU compiler."""
    mesh = targets.compile_mesh(target, 1)
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    d, e, k = K26.values()
    fn = jax.jit(functools.partial(route_topk, k=k, **KW))          # impl="auto": the kernels on cuda
    with targets.lowering_for(mesh):
        lowered = fn.lower(s((t, d), jnp.bfloat16), s((d, e), jnp.bfloat16), s((e,), jnp.float32))
    assert lowered.as_text().count(TRITON_CALL) == 2
    compiled = lowered.compile(targets.compiler_options(target)).as_text()
    assert compiled.count(TRITON_CALL) == 2, compiled
