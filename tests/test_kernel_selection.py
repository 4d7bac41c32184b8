"""Kernels are chosen by the platform a program is lowered for (kimi_jax.ops.registry), never by the host: the same
DDTree generate program, with the default Runtime (impl "auto"), holds the GPU kernels when lowered for an H200
from this CPU, and none when lowered for the CPU. No monkeypatching: the real compiler decides what it got."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi_jax
from kimi_jax.analysis import targets
from kimi_jax.analysis.targets import MOSAIC_CALL, TPU_CALL, TRITON_CALL
from kimi_jax.decoding import engine
from kimi_jax.model.compute_layout import compute_params
from kimi_jax.ops.int4_moe.api import int4_moe
from kimi_jax.ops.tree_attention.api import latent_attention

from conftest import FIXTURES

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
GPU_MISSING = targets.compiler_missing("h200")
TPU_MISSING = targets.compiler_missing("v5e")


def _abstract(tree):
    return jax.tree.map(lambda a: None if a is None else jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


@functools.cache
def _generate_program(impl: str):
    """(lower(target or None) -> Lowered; both cached, since several tests read the same lowering) for the
    embedded default's DDTree generate program, budget 8, with the INT4 weights as stored (abstract: a program
    for another target never takes this host's prepared copies), in bfloat16 as a GPU runs it, the drafter too
    (the GPU kernels' rules refuse 32-bit caches, router inputs and drafter attention operands when compiled: a
    forced kernel would be an error; ``load`` keeps a drafter in float32)."""
    rt = kimi_jax.Runtime(moe_impl=impl, attn_impl=impl)
    model = kimi_jax.load(str(TARGET), drafter=str(DRAFTER), runtime=rt, dtype=jax.numpy.bfloat16)
    request = model.prepare("def f(x):\n", 8, "ddtree", 8)
    inputs = model.inputs(request)
    inputs = inputs.replace(
        params=compute_params(model.params, model.config, rt.replace(moe_impl="pallas")),   # INT4 experts kept
        drafter_params=jax.tree.map(lambda a: a.astype(jnp.bfloat16), inputs.drafter_params))
    inputs = _abstract(inputs)
    lower = jax.jit(engine.generate_program, static_argnames=engine.STATICS).lower

    @functools.cache
    def lowered(target):
        if target is None:
            return lower(inputs, **request.statics)
        with targets.lowering_for(targets.compile_mesh(target, 1)):
            return lower(inputs, **request.statics)
    return lowered


@pytest.mark.compile
@pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
# Slow, like every test of the embedded default (its generate program, ~25 s a case): the fast loop has "auto"
# choosing the GPU kernels for an H200 in the K2.6 round (test_each_target_gets_its_kernels_in_a_k26_round
# [h200-auto]) and the XLA path for the CPU (test_pallas_on_a_cpu_runs_interpret_mode_and_matches_xla).
@pytest.mark.parametrize("impl,gpu_kernels", [pytest.param(*case, marks=pytest.mark.slow)
                                              for case in [("auto", True), ("pallas", True), ("xla", False)]])
def test_generate_program_gets_the_kernels_of_its_target(impl, gpu_kernels):
    lowered = _generate_program(impl)
    for_cpu = lowered(None).as_text()
    assert TRITON_CALL not in for_cpu
    for_gpu = lowered("h200").as_text()
    # the MoE kernel's two calls (gate/up, down) and the tree attention's, in the target forward of the rounds
    assert (for_gpu.count(TRITON_CALL) >= 3) == gpu_kernels


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_generate_program_compiles_for_h200_with_gpu_kernels():
    """The whole DDTree generate program of a small K2-architecture model, default Runtime, compiled for an
    H200 with register spills as errors: GPU kernels in the executable, no interpret-mode loops."""
    compiled = _generate_program("auto")("h200").compile(targets.compiler_options("h200"))
    assert compiled.as_text().count(TRITON_CALL) >= 3


@pytest.mark.interpret
def test_pallas_on_a_cpu_runs_interpret_mode_and_matches_xla():
    """impl="pallas" lowered for the CPU is the kernel's interpret mode (no Triton call), with the XLA path's
    numbers; impl="auto" on the CPU is the XLA path."""
    from kimi_jax.ops.int4_format import Int4Experts
    rng = np.random.default_rng(0)
    e, d, f, t, k = 4, 256, 256, 5, 2
    experts = Int4Experts.quantize(rng.standard_normal((e, d, f), np.float32), rng.standard_normal((e, d, f), np.float32),
                               rng.standard_normal((e, f, d), np.float32))
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = rng.integers(0, e, (t, k)).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    outs = {}
    for impl in ("auto", "pallas", "xla"):
        fn = jax.jit(lambda *a, impl=impl: int4_moe(*a, impl=impl))
        assert TRITON_CALL not in fn.lower(x, ids, w, experts).as_text()
        outs[impl] = np.asarray(fn(x, ids, w, experts))
    # float32 sums in another order: differences ~1e-6 of the output's scale
    np.testing.assert_allclose(outs["pallas"], outs["xla"], rtol=0, atol=1e-5 * np.abs(outs["xla"]).max())
    np.testing.assert_array_equal(outs["auto"], outs["xla"])

    b, h, r, p, s = 1, 2, 32, 16, 64
    q, qpe = rng.standard_normal((b, 3, h, r), np.float32), rng.standard_normal((b, 3, h, p), np.float32)
    kv = rng.standard_normal((b, s, r + p), np.float32)
    lengths, mask = np.asarray([10], np.int32), np.tril(np.ones((b, 3, 3), bool))
    att = {impl: np.asarray(jax.jit(lambda *a, impl=impl: latent_attention(*a, 0.1, impl=impl))(q, qpe, kv, lengths,
                                                                                                  mask))
           for impl in ("auto", "pallas", "xla")}
    np.testing.assert_allclose(att["pallas"], att["xla"], rtol=0, atol=1e-5 * np.abs(att["xla"]).max())
    np.testing.assert_array_equal(att["auto"], att["xla"])


@functools.cache
def _k26_round(impl: str, target: str):
    """The lowered DDTree round (budget 16, 4096 slots) of K2.6 cut to 3 layers (1 dense, 2 MoE; every width
    K2.6's, bf16, INT4 experts; cached, since several tests read the same lowering, with no default target so
    that every call names the same key) on 8 compile-only ``target`` GPUs at TP-8, both kernels' impl ``impl``."""
    from bench.layer_ops import LAYERS, DENSE, small_k26
    from kimi_jax.analysis import target_sweep
    cfg, dcfg = small_k26()
    mesh = targets.compile_mesh(target, 8, "tp=8")
    with targets.lowering_for(mesh):
        lowered, _ = target_sweep.compile_round(cfg, dcfg, mesh, "tp", "ddtree", 1, 16, 4096, split=True, impl=impl,
                                                compile=lambda lowered: (lowered, {}))
    return lowered, LAYERS, LAYERS - DENSE


def _kernel_calls(target: str, impl: str) -> tuple[int, int, int, int, int]:
    """(Triton calls, Mosaic GPU calls, layers, MoE layers, drafter layers) of the lowered K2.6 round for
    ``target``."""
    from bench.layer_ops import small_k26
    lowered, layers, moe = _k26_round(impl, target)
    text = lowered.as_text()
    return text.count(TRITON_CALL), text.count(MOSAIC_CALL), layers, moe, small_k26()[1].num_hidden_layers


@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("target,impl", [("h200", "auto")] + [       # one in the fast loop
    pytest.param(*case, marks=pytest.mark.slow)
    for case in [("rtx_pro_6000", "auto"), ("h100", "auto"), ("b200", "auto"), ("h200", "mosaic"),
                 ("h200", "pallas")]])
def test_each_target_gets_its_kernels_in_a_k26_round(target, impl):
    """ops/registry.py's preference, read from the lowered round (per MoE layer: the router's 2 Triton kernels, the
    placement's 1 and the shared expert's SwiGLU, then the experts' 2; per dense layer its SwiGLU; per layer: the
    latent projection's and the absorbed queries' Triton kernels, the tree attention's kernel and its Triton
    merge; per drafter layer: the drafter attention's kernel, its merge and its SwiGLU, Triton's on every GPU):
    Hopper's "auto" (and "mosaic") runs the experts and the tree attention on Mosaic GPU, the rest on Triton;
    Blackwell (no wgmma), sm_120 and "pallas" run all on Triton."""
    triton, mosaic, layers, moe, draft_layers = _kernel_calls(target, impl)
    on_mosaic = impl == "mosaic" or (impl == "auto" and target in ("h100", "h200"))
    expected = (4 * moe + 3 * layers, 2 * moe + layers) if on_mosaic else (6 * moe + 4 * layers, 0)
    assert (triton, mosaic) == (expected[0] + (layers - moe) + 3 * draft_layers, expected[1])


@pytest.mark.compile
@pytest.mark.skipif(TPU_MISSING is not None, reason=TPU_MISSING or "")
# Slow (~35 s with libtpu's compile): the fast loop lowers the K2.6 round for a TPU slice (test_target_sweep.py's
# test_round_for_a_tpu_slice), compiles both TPU kernels (test_int4_moe_tpu, test_tree_attention_tpu) and checks
# the registry's TPU choices over the shape space (test_kernel_shapes).
@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5e", "v6e", "v5p", "tpu7x"])
def test_each_tpu_gets_its_kernels_in_a_k26_round(target):
    """The K2.6 round (3 layers, TP-8) lowered for an 8-device slice of each TPU generation under the default
    Runtime: per MoE layer the INT4 experts' two Pallas TPU kernels, per layer the tree attention's one; no GPU
    kernel. v5e's compiles with libtpu."""
    lowered, layers, moe = _k26_round("auto", target)
    text = lowered.as_text()
    assert (text.count(TPU_CALL), text.count(TRITON_CALL), text.count(MOSAIC_CALL)) == (2 * moe + layers, 0, 0)
    if target == "v5e":
        assert lowered.compile().as_text().count(TPU_CALL) == 2 * moe + layers


@pytest.mark.compile
@pytest.mark.slow      # the embedded default's generate program (~15 s); fast: see test_each_tpu_gets_its_kernels_...
@pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")
@pytest.mark.skipif(TPU_MISSING is not None, reason=TPU_MISSING or "")
def test_the_embedded_generate_program_gets_tpu_kernels_on_a_tpu():
    lowered = _generate_program("auto")
    assert TPU_CALL not in lowered(None).as_text()
    assert lowered("v5e").as_text().count(TPU_CALL) >= 3


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_the_mosaic_k26_round_compiles_for_h200():
    lowered, layers, moe = _k26_round("mosaic", "h200")
    compiled = lowered.compile(targets.compiler_options("h200"))
    assert compiled.as_text().count(MOSAIC_CALL) == 2 * moe + layers


@pytest.mark.interpret
def test_mosaic_outside_a_gpu_lowering_is_refused_with_the_reason():
    from kimi_jax.ops.int4_format import Int4Experts
    rng = np.random.default_rng(0)
    e, d, f = 4, 256, 256
    experts = Int4Experts.quantize(*(rng.standard_normal(s, np.float32) for s in ((e, d, f), (e, d, f), (e, f, d))))
    x = rng.standard_normal((3, d)).astype(np.float32)
    with pytest.raises(ValueError, match="lowered for a GPU"):
        int4_moe(x, np.zeros((3, 2), np.int32), np.ones((3, 2), np.float32), experts, impl="mosaic")
    q = np.zeros((1, 2, 2, 32), np.float32)
    with pytest.raises(ValueError, match="lowered for a GPU"):
        latent_attention(q, q[..., :16], np.zeros((1, 64, 48), np.float32), np.asarray([4], np.int32),
                         np.ones((1, 2, 2), bool), 0.1, impl="mosaic")
    with pytest.raises(ValueError, match="lowered for a TPU"):          # and the Pallas TPU kernels
        int4_moe(x, np.zeros((3, 2), np.int32), np.ones((3, 2), np.float32), experts, impl="tpu")
    with pytest.raises(ValueError, match="lowered for a TPU"):
        latent_attention(q, q[..., :16], np.zeros((1, 64, 48), np.float32), np.asarray([4], np.int32),
                         np.ones((1, 2, 2), bool), 0.1, impl="tpu")


@pytest.mark.interpret
@pytest.mark.slow      # fast: the same kernels in TPU interpret mode in test_int4_moe_tpu and test_tree_attention_tpu
def test_tpu_kernels_in_interpret_mode_through_the_entry_points():
    """impl="tpu", interpret=True: the Pallas TPU kernels in TPU interpret mode on the CPU, with the XLA path's
    numbers (the kernels' own tests check them against the references over their shape space)."""
    from kimi_jax.ops.int4_format import Int4Experts
    rng = np.random.default_rng(1)
    e, d, f, t, k = 4, 256, 256, 5, 2
    experts = Int4Experts.quantize(*(rng.standard_normal(s, np.float32) for s in ((e, d, f), (e, d, f), (e, f, d))))
    x, ids = rng.standard_normal((t, d)).astype(np.float32), rng.integers(0, e, (t, k)).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    got, want = (np.asarray(int4_moe(x, ids, w, experts, impl=i, interpret=i == "tpu")) for i in ("tpu", "xla"))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    q, qpe = rng.standard_normal((1, 3, 2, 32), np.float32), rng.standard_normal((1, 3, 2, 16), np.float32)
    kv, lengths, mask = jnp.asarray(rng.standard_normal((1, 64, 48), np.float32)), np.asarray([10], np.int32), \
        np.tril(np.ones((1, 3, 3), bool))
    got, want = (np.asarray(latent_attention(q, qpe, kv, lengths, mask, 0.1, impl=i, interpret=i == "tpu"))
                 for i in ("tpu", "xla"))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_hopper_is_read_from_the_device_kind():
    """What jax reports for sm_90 parts (and the compile-only targets' kinds) against other GPUs' and none."""
    from kimi_jax.ops.select import hopper
    kinds = {"NVIDIA H100 80GB HBM3": True, "NVIDIA H200 141GB HBM3e": True, "NVIDIA GH200 480GB": True,
             "NVIDIA H800": True, "NVIDIA H20": True, "NVIDIA B200": False, "NVIDIA A100-SXM4-80GB": False,
             "NVIDIA RTX PRO 6000 Blackwell Server Edition": False, "NVIDIA H2000": False, None: False}
    assert {k: hopper(k) for k in kinds} == kinds
    assert [hopper(targets.get_target(n).device_kind) for n in ("h100", "h200", "b200", "b300", "rtx_pro_6000")] == \
        [True, True, False, False, False]
