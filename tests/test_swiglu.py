"""SwiGLU at decode widths (kimi_jax.ops.swiglu): the Triton kernel in interpret mode against the jnp reference,
the rules over the shape space, the derivative, and the kernel compiled spill-free with XLA's real GPU compiler at
the shared expert's widths on a device (K2.6 at TP-8 and TP-16, and unsplit)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kimi_jax.analysis import targets
from kimi_jax.analysis.targets import TRITON_CALL
from kimi_jax.ops.registry import Lowering
from kimi_jax.ops.swiglu.api import SWIGLU, SwigluCall, swiglu
from kimi_jax.ops.swiglu.reference import swiglu_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPU_MISSING = targets.compiler_missing("h200")


def _inputs(t, d, f, n, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    arr = lambda shape, scale: jnp.asarray(rng.normal(size=shape) * scale, dtype)  # noqa: E731
    return arr((t, d), 1.0), arr((d, f), d ** -0.5), arr((d, f), d ** -0.5), arr((f, n), f ** -0.5)


@pytest.mark.interpret
@pytest.mark.parametrize("t,d,f,n", [(17, 1024, 256, 512), (3, 64, 32, 64),
                                     pytest.param(40, 64, 48, 64, marks=pytest.mark.slow),
                                     pytest.param(600, 512, 32, 64, marks=pytest.mark.slow),
                                     pytest.param(1, 7168, 128, 256, marks=pytest.mark.slow)])
def test_kernel_matches_reference(t, d, f, n):
    """A verify on the shared expert's TP-8 hidden width, the tiny model's widths, two row blocks (the last ragged)
    with a hidden width of 3 chunks of 16, a decode token over K2.6's 7168 inputs (8 K splits)."""
    args = _inputs(t, d, f, n, seed=t)
    exact = np.asarray(swiglu_reference(*(a.astype(jnp.float32) for a in args)))      # float32 all the way
    xla = np.asarray(swiglu_reference(*args), np.float32)
    got = np.asarray(jax.jit(functools.partial(swiglu, impl="pallas", interpret=True))(*args), np.float32)
    # bf16 intermediates round in other places (the split-K sums, then g and u): as close to the float32 result
    # as XLA's bf16 path, element by element, to a rounding of the output
    ulp = 2.0 ** -7 * np.abs(exact).max()
    assert np.abs(got - exact).max() <= np.abs(xla - exact).max() + ulp
    np.testing.assert_allclose(got, xla, rtol=0, atol=2 * np.abs(xla - exact).max() + ulp)


def test_rules_over_the_shape_space():
    gpu = Lowering("cuda", "NVIDIA H200")
    for t, dtype, (f, n) in itertools.product([1, 17, 512, 513], ("bfloat16", "float32"),
                                              [(256, 7168), (128, 7168), (2048, 7168), (24, 64), (32, 72)]):
        call = SwigluCall(t, 7168, f, n, dtype)
        want = "pallas" if t <= 512 and dtype == "bfloat16" and f % 16 == 0 and n % 16 == 0 else "xla"
        assert SWIGLU.resolve(call, gpu) == want, call
        assert SWIGLU.resolve(call, Lowering("cpu")) == "xla"
    assert SWIGLU.require("mosaic", SwigluCall(17, 7168, 256, 7168, "bfloat16"), gpu) == "pallas"
    assert SWIGLU.require("pallas", SwigluCall(4096, 7168, 256, 7168, "bfloat16"), gpu) == "pallas"   # forced


@pytest.mark.interpret
def test_derivative_is_the_reference_s():
    args = _inputs(3, 64, 32, 64, seed=1, dtype=jnp.float32)
    loss = lambda f: lambda *a: f(*a).sum()   # noqa: E731
    got = jax.grad(loss(functools.partial(swiglu, impl="pallas", interpret=True)), (0, 1, 2, 3))(*args)
    want = jax.grad(loss(swiglu_reference), (0, 1, 2, 3))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,t,f", [("h200", 17, 256)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [("h200", 1, 256), ("h200", 255, 128), ("h100", 65, 2048),
                                                             ("b200", 17, 256), ("b300", 3, 256),
                                                             ("rtx_pro_6000", 17, 256)]])
def test_compiles_at_k26_shapes(target, t, f):
    mesh = targets.compile_mesh(target, 1)
    s = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P()))  # noqa: E731
    with targets.lowering_for(mesh):
        lowered = jax.jit(swiglu).lower(s((t, 7168)), s((7168, f)), s((7168, f)), s((f, 7168)))
    assert lowered.as_text().count(TRITON_CALL) == 1
    compiled = lowered.compile(targets.compiler_options(target)).as_text()
    assert compiled.count(TRITON_CALL) == 1, compiled
