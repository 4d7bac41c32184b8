"""int4_moe: the Pallas kernels (interpret mode) and the XLA path against the dense dequantized reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from kimi_jax.ops.int4_format import Int4Experts
from kimi_jax.ops.int4_moe.api import int4_moe
from kimi_jax.ops.int4_moe.pallas_triton import (PALLAS_BLOCK_M, PLACE_COLS, PLACE_MAX_PAIRS, place_pallas,
                                                place_rows_pallas)
from kimi_jax.ops.int4_moe.reference import int4_moe_reference
from kimi_jax.ops.int4_moe.routing import gather_rows, num_blocks, sort_by_expert

E, D, F = 8, 256, 64
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def random_experts(seed, e=E, d=D, f=F) -> Int4Experts:
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.normal(size=s) * 0.05).astype(np.float32)  # noqa: E731
    return Int4Experts.quantize(w(e, d, f), w(e, d, f), w(e, f, d))


def fixture_experts(fixtures_dir, name) -> Int4Experts:
    """Experts compressed by the compressed-tensors package (tests/fixtures/make_ct_fixtures.py)."""
    with safe_open(fixtures_dir / "ct" / f"experts_{name}.safetensors", "flax") as fh:
        t = {k: np.asarray(fh.get_tensor(k)) for k in fh.keys()}
    n = 1 + max(int(k.split(".")[1]) for k in t)
    get = lambda p, f: np.stack([t[f"experts.{i}.{p}_proj.weight_{f}"] for i in range(n)])  # noqa: E731
    return Int4Experts.from_compressed_tensors(get("gate", "packed"), get("gate", "scale"), get("up", "packed"),
                                               get("up", "scale"), get("down", "packed"), get("down", "scale"))


def routing(seed, t, k, e=E, kind="random"):
    rng = np.random.default_rng(seed)
    if kind == "random":        # distinct experts per token, uneven load
        p = rng.dirichlet(np.ones(e) * 0.5)
        idx = np.stack([rng.choice(e, k, replace=False, p=p) for _ in range(t)])
    elif kind == "one_expert":  # every token's first slot on expert 3
        idx = np.stack([np.r_[3, rng.choice(np.delete(np.arange(e), 3), k - 1, replace=False)] for _ in range(t)])
    elif kind == "few":         # only experts 1 and 6 are ever used
        idx = np.tile(np.array([6, 1])[:k], (t, 1))
    w = rng.uniform(0.1, 1.0, (t, k))
    return jnp.asarray(idx, jnp.int32), jnp.asarray(w, jnp.float32)


def check_close(y, ref, rtol=2e-5):
    y, ref = np.asarray(y), np.asarray(ref)
    assert y.shape == ref.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


moe = jax.jit(int4_moe, static_argnames=("impl", "interpret", "block_m"))


# --- grouping ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t,k,bm,kind", [(13, 3, 16, "random"), (1, 8, 16, "random"), (37, 2, 16, "one_expert"),
                                         (32, 2, 16, "few"), (5, 4, 8, "random"), (64, 2, 64, "random")])
@pytest.mark.parametrize("method", ["sort", "count"])
def test_sort_by_expert(t, k, bm, kind, method):
    idx, _ = routing(t, t, k, kind=kind)
    r = jax.tree.map(np.asarray, sort_by_expert(idx, E, bm, method))
    m, flat = t * k, np.asarray(idx).reshape(-1)
    nb = num_blocks(m, E, bm)
    assert r.row_pair.shape == (nb * bm,) and r.block_expert.shape == (nb,)
    # every pair sits in exactly one row, of a block of its expert; pair_row is the inverse map
    real = r.row_pair < m
    assert sorted(r.row_pair[real]) == list(range(m))
    np.testing.assert_array_equal(r.row_pair[r.pair_row], np.arange(m))
    np.testing.assert_array_equal(r.block_expert[r.pair_row // bm], flat)
    # blocks are used up front, each touched expert gets ceil(n_e / bm) blocks, the rest are -1
    counts = np.bincount(flat, minlength=E)
    used = int(np.sum(-(-counts // bm)))
    assert np.all(r.block_expert[:used] >= 0) and np.all(r.block_expert[used:] == -1)
    assert np.all(np.diff(r.block_expert[:used]) >= 0)
    assert not real.reshape(nb, bm)[used:].any()


# Slow (~10 s, op by op): the fast loop checks each method's placement (test_sort_by_expert) and the placement
# kernel against the sort (test_placement_kernel_places_pairs_as_sorting_does[8]).
@pytest.mark.slow
@pytest.mark.parametrize("bm", [8, 16, 64])
def test_counting_places_pairs_as_sorting_does(bm):
    """The two placements agree exactly, also with an expert repeated within a token (EP masking maps every
    expert held elsewhere to local id 0) and with every pair on one expert."""
    rng = np.random.default_rng(bm)
    cases = [rng.integers(0, E, (29, 4)), np.where(rng.random((23, 8)) < 0.6, 0, rng.integers(0, E, (23, 8))),
             np.full((70, 2), 5), np.asarray(routing(bm, 40, 3)[0])]
    for idx in cases:
        idx = jnp.asarray(idx, jnp.int32)
        a, b = sort_by_expert(idx, E, bm, "sort"), sort_by_expert(idx, E, bm, "count")
        for name, x, y in zip(a._fields, a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    with pytest.raises(ValueError, match="method"):
        sort_by_expert(idx, E, bm, "bogus")


# 8: the Mosaic GPU path's decode block; 16 and 64 (Triton's) in the slow run
@pytest.mark.interpret
@pytest.mark.parametrize("bm", [8] + [pytest.param(bm, marks=pytest.mark.slow) for bm in (16, 64)])
def test_placement_kernel_places_pairs_as_sorting_does(bm):
    """The Pallas placement kernel (interpret mode) against the sort: one verify's 136 pairs over K2.6's 384
    experts, a repeated expert, every pair on one expert, one decode token, and the kernel's largest size."""
    rng = np.random.default_rng(bm)
    cases = [(rng.integers(0, 384, (17, 8)), 384), (np.where(rng.random((23, 8)) < 0.6, 0, rng.integers(0, E, (23, 8))), E),
             (np.full((70, 2), 5), E), (rng.integers(0, 384, (1, 8)), 384),
             (rng.integers(0, 16, (PLACE_MAX_PAIRS // 8, 8)), 16)]
    for idx, e in cases:
        idx = jnp.asarray(idx, jnp.int32)
        got = place_pallas(idx, bm, num_blocks(idx.size, e, bm), interpret=True)
        want = sort_by_expert(idx, e, bm, "sort")
        for name, x, y in zip(want._fields, got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{name}, {idx.shape}")
    with pytest.raises(ValueError, match="at most"):
        place_pallas(jnp.zeros((PLACE_MAX_PAIRS + 1, 1), jnp.int32), bm, 1, interpret=True)


@pytest.mark.interpret
@pytest.mark.parametrize("bm", [8, pytest.param(64, marks=pytest.mark.slow)])
def test_placement_kernel_gathers_the_rows_it_places(bm):
    """place_rows_pallas (interpret mode): the sort's placement and XLA's gather of scale * x, exactly (padding rows
    zeros), for a verify's 136 pairs over 384 experts, one decode token, and a repeated expert; two column tiles."""
    rng = np.random.default_rng(bm)
    d = 2 * PLACE_COLS
    for idx, e in [(rng.integers(0, 384, (17, 8)), 384), (rng.integers(0, 384, (1, 8)), 384),
                   (np.where(rng.random((9, 4)) < 0.6, 0, rng.integers(0, E, (9, 4))), E)]:
        idx = jnp.asarray(idx, jnp.int32)
        x = jnp.asarray(rng.standard_normal((idx.shape[0], d)), jnp.bfloat16)
        scale = jnp.asarray(rng.uniform(0.5, 2, d), jnp.bfloat16)
        routing, xs = place_rows_pallas(idx, x, scale, bm, num_blocks(idx.size, e, bm), interpret=True)
        want = sort_by_expert(idx, e, bm, "sort")
        for name, got_field, want_field in zip(want._fields, routing, want):
            np.testing.assert_array_equal(np.asarray(got_field), np.asarray(want_field), err_msg=name)
        np.testing.assert_array_equal(np.asarray(xs, np.float32),
                                      np.asarray(gather_rows(scale * x, want, idx.shape[1], d), np.float32))
    with pytest.raises(ValueError, match="multiple of"):
        place_rows_pallas(idx, x[:, :100], scale[:100], bm, 4, interpret=True)


# --- numerics ---------------------------------------------------------------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize("t,k,kind", [
    (13, 3, "random"),       # ragged groups, 39 rows: not a multiple of the block
    pytest.param(1, 4, "random", marks=pytest.mark.slow),        # decode: one token, most experts empty
    pytest.param(2, 2, "random", marks=pytest.mark.slow),        # more empty experts than used ones
    pytest.param(37, 2, "one_expert", marks=pytest.mark.slow),   # one expert gets every token (3 blocks, last partial)
    pytest.param(32, 2, "few", marks=pytest.mark.slow),          # all rows on two experts, 32 rows each = exact blocks
    pytest.param(20, 1, "few", marks=pytest.mark.slow),          # every token on one expert, top-1
])
def test_int4_moe_matches_reference(t, k, kind):
    ex = random_experts(0)
    idx, w = routing(t + k, t, k, kind=kind)
    x = jnp.asarray(np.random.default_rng(t).normal(size=(t, D)), jnp.float32)
    ref = int4_moe_reference(x, idx, w, ex)
    y_xla = moe(x, idx, w, ex, impl="xla")
    y_pallas = moe(x, idx, w, ex, impl="pallas")
    check_close(y_xla, ref)
    check_close(y_pallas, ref)
    check_close(y_pallas, y_xla)
    if kind == "one_expert":    # 64-row blocks: the prefill-width tiles (8-warp down, 32-column gate/up)
        check_close(moe(x, idx, w, ex, impl="pallas", block_m=64), ref)


@pytest.mark.interpret
def test_int4_moe_scale_multiplies_the_rows_every_impl_reads():
    """``scale`` (the MoE norm's weight, which the GPU kernels apply to the rows they gather: Triton's gate/up
    kernel, Mosaic GPU's placement kernel) equals passing ``scale * x`` rounded to bf16, on every implementation."""
    from kimi_jax.ops.int4_moe.mosaic_gpu import int4_moe_mosaic

    ex = random_experts(2)
    idx, w = routing(5, 7, 2)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(7, D)), jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, D), jnp.bfloat16)
    want = int4_moe_reference((scale * x).astype(jnp.float32), idx, w, ex)
    for impl in ("xla", "pallas"):
        got = moe(x, idx, w, ex, impl=impl, interpret=True, scale=scale)
        check_close(got, moe(scale * x, idx, w, ex, impl=impl, interpret=True), rtol=1e-6)
        check_close(got, want, rtol=2e-2)
    got = jax.jit(lambda *a: int4_moe_mosaic(*a, interpret=True, scale=scale))(x, idx, w, ex)
    check_close(got, want, rtol=2e-2)
    with pytest.raises(ValueError, match="scale must be"):
        int4_moe(x, idx, w, ex, scale=scale[:-1])


def padded_case(fixtures_dir):
    """(experts, topk_idx, topk_weight, x) with D = 96 and F = 64, which the kernel layout pads to 256; the weights
    compressed by the compressed-tensors package itself."""
    ex = fixture_experts(fixtures_dir, "e2_d96_f64")
    idx = jnp.asarray([[0, 1], [1, 0], [1, 0], [0, 1], [1, 0]], jnp.int32)
    w = jnp.asarray(np.random.default_rng(1).uniform(size=(5, 2)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(5, 96)), jnp.float32)
    return ex, idx, w, x


@pytest.mark.interpret
@pytest.mark.slow
def test_int4_moe_padded_dims_from_compressed_tensors(fixtures_dir):
    ex, idx, w, x = padded_case(fixtures_dir)
    ref = int4_moe_reference(x, idx, w, ex)
    check_close(moe(x, idx, w, ex, impl="xla"), ref)
    check_close(moe(x, idx, w, ex, impl="pallas", block_m=32), ref)


@pytest.mark.interpret
@pytest.mark.slow
def test_int4_moe_bf16_activations():
    ex = random_experts(1)
    idx, w = routing(3, 9, 2)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(9, D)), jnp.bfloat16)
    ref = int4_moe_reference(x.astype(jnp.float32), idx, w, ex)
    # dots in bf16 (exact int4 weights, bf16 x and h) with float32 accumulation
    check_close(moe(x, idx, w, ex, impl="xla"), ref, rtol=2e-2)
    check_close(moe(x, idx, w, ex, impl="pallas"), ref, rtol=2e-2)


@pytest.mark.interpret
@pytest.mark.slow
def test_int4_moe_stacked_layers_scan():
    layers = [random_experts(s) for s in (4, 5)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    idx, w = routing(6, 7, 3)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(7, D)), jnp.float32)

    @functools.partial(jax.jit, static_argnames="impl")
    def two_layers(x, stacked, impl):
        def layer(h, ex):
            return h + 0.1 * int4_moe(h, idx, w, ex, impl=impl), None
        return jax.lax.scan(layer, x, stacked)[0]

    want = x
    for ex in layers:
        want = want + 0.1 * int4_moe_reference(want, idx, w, ex)
    check_close(two_layers(x, stacked, "xla"), want)
    check_close(two_layers(x, stacked, "pallas"), want)
    # slicing a layer out of the stack with tree.map gives that layer's experts
    check_close(moe(x, idx, w, jax.tree.map(lambda a: a[1], stacked)), int4_moe_reference(x, idx, w, layers[1]))


def test_int4_moe_rejects_bad_input():
    ex = random_experts(0)
    idx, w = routing(0, 3, 2)
    x = jnp.zeros((3, D), jnp.float32)
    with pytest.raises(ValueError, match="slice the stacked layer axis"):
        int4_moe(x, idx, w, jax.tree.map(lambda a: a[None], ex))
    with pytest.raises(ValueError, match="impl must be"):
        int4_moe(x, idx, w, ex, impl="cuda")
    with pytest.raises(ValueError, match=r"x must be \[T, 256\]"):
        int4_moe(x[:, :128], idx, w, ex)
    with pytest.raises(ValueError, match="topk_idx"):
        int4_moe(x, idx[:2], w, ex)
    with pytest.raises(ValueError, match="power of two >= 16"):
        int4_moe(x, idx, w, ex, impl="pallas", block_m=8)
    with pytest.raises(ValueError, match="power of two"):
        int4_moe(x, idx, w, ex, block_m=12)
    # a tensor-parallel shard of F that splits a 256-input chunk of the down projection
    with pytest.raises(ValueError, match="whole 256-input chunks"):
        int4_moe(x, idx, w, Int4Experts(ex.w13, ex.s13, ex.w2[:, :16], ex.s2[:, :4]))


# --- the GPU lowering, checked without a GPU ----------------------------------------------------------------------


def test_pallas_lowers_to_triton_for_h200_k2_shapes():
    """The kernels lower through Pallas' Triton backend for the full K2.6 expert shapes (power-of-two tiles,
    supported primitives, 64-bit offsets) using an abstract H200; only compilation and running need the GPU."""
    try:
        from jax._src.mesh import AbstractDevice
        abstract = jax.sharding.AbstractMesh(
            (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda"))
    except (ImportError, TypeError) as err:  # private API; the runtime kernels do not depend on it
        pytest.skip(f"abstract GPU device unavailable in this jax: {err}")
    e, d, f, t, k = 384, 7168, 2048, 64, 8
    s = jax.ShapeDtypeStruct
    ex = Int4Experts(w13=s((e, 2, d // 8, f), jnp.int32), s13=s((e, 2, d // 32, f), jnp.bfloat16),
                     w2=s((e, f // 8, d), jnp.int32), s2=s((e, f // 32, d), jnp.bfloat16))
    fn = jax.jit(functools.partial(int4_moe, impl="pallas", interpret=False))
    with jax.sharding.use_abstract_mesh(abstract):
        hlo = fn.trace(s((t, d), jnp.bfloat16), s((t, k), jnp.int32), s((t, k), jnp.float32), ex).lower(
            lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3      # placement, gate/up, down (64 x 8 pairs: one kernel)
    assert PALLAS_BLOCK_M[0] >= 16   # Triton dots need every dim >= 16
