"""Tree attention's Mosaic GPU kernel (kimi_jax.ops.tree_attention.mosaic_gpu): GPU interpret mode on the CPU
against the dense oracle, and deviceless compiles for H200 at K2.6 TP-8 shapes with ptxas' spill report read."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kimi_jax.analysis import targets
from kimi_jax.cache import rows_view
from kimi_jax.config import KIMI_K26
from kimi_jax.decoding import ddtree
from kimi_jax.ops.tree_attention import mosaic_gpu
from kimi_jax.ops.tree_attention.api import latent_attention
from kimi_jax.ops.tree_attention.reference import dense_reference
from test_tree_attention import causal, tree_mask

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
R, PE = 128, 64         # the smallest latent the kernel takes: two 64-column value chunks with block_v = 64

attn = jax.jit(latent_attention, static_argnames=("scale", "impl", "interpret", "num_splits", "out_dtype"))
mosaic = jax.jit(mosaic_gpu.latent_attention_mosaic, static_argnames=("scale", "interpret", "num_splits", "tiles"))


def inputs(seed, b, t, h, s):
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    return n(b, t, h, R), n(b, t, h, PE), n(b, s, R + PE)


def check(out, q, qpe, kv_rows, lengths, mask, scale):
    """bf16 inputs, float32 softmax, bf16 probabilities (rounded before normalising here, after in the oracle):
    test_tree_attention.test_bf16's tolerance."""
    ref = np.asarray(dense_reference(q, qpe, kv_rows, jnp.asarray(lengths, jnp.int32), mask, scale))
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=3e-2, atol=3e-2 * np.abs(ref).max())


# 200 slots: not a multiple of the 64-row key block (the last block is read from s - 64 and its overlap masked).
@pytest.mark.interpret
@pytest.mark.parametrize("t,lengths,splits,block_v", [
    (1, [0, 70, 199], 3, 64),       # decode, width 1: an empty prefix, mid-block, a full cache; two value chunks
    # chain: causal, one value chunk; row 2's last 3 tree slots do not exist
    pytest.param(6, [5, 130, 197], 2, 128, marks=pytest.mark.slow),
])
def test_contiguous_causal(t, lengths, splits, block_v):
    q, qpe, kv = inputs(t, 3, t, 2, 200)
    out = mosaic(q, qpe, kv, jnp.asarray(lengths, jnp.int32), causal(3, t), scale=0.1, interpret=True,
                 num_splits=splits, tiles=mosaic_gpu.Tiles(block_v=block_v))
    check(out, q, qpe, kv, lengths, causal(3, t), 0.1)


@pytest.mark.interpret
def test_ddtree_mask_through_the_api():
    """A DDTree ancestor mask (not causal; slot 7 is padding that sees only itself), impl="mosaic" through
    api.latent_attention with interpret=True, default splits."""
    mask = tree_mask()
    q, qpe, kv = inputs(1, 2, 8, 4, 300)
    lengths = [3, 250]
    out = attn(q, qpe, kv, jnp.asarray(lengths, jnp.int32), mask, scale=0.1, impl="mosaic", interpret=True,
               out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    check(out, q, qpe, kv, lengths, mask, 0.1)


@pytest.mark.interpret
def test_paged_whole_cache_at_a_layer():
    """A page pool of 64-slot pages in a shuffled order, the whole cache [layers, pages, page, c] read at
    layer 1, a tree of 8 nodes."""
    b, t, h, page, per_row, layers = 2, 8, 2, 64, 3, 2
    rng = np.random.default_rng(3)
    q, qpe, _ = inputs(3, b, t, h, 1)
    pool = jnp.asarray(rng.normal(size=(layers, b * per_row + 1, page, R + PE)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(b * per_row + 1)[:b * per_row].reshape(b, per_row), jnp.int32)
    lengths, mask = [100, 150], tree_mask()
    out = attn(q, qpe, pool, jnp.asarray(lengths, jnp.int32), mask, scale=0.1, impl="mosaic", interpret=True,
               num_splits=2, page_table=table, layer=1)
    check(out, q, qpe, rows_view(pool[1], table), lengths, mask, 0.1)


@pytest.mark.interpret
@pytest.mark.slow      # fast: a whole cache read at a layer by the paged test above
def test_whole_contiguous_cache_at_a_layer_and_a_query_that_sees_nothing():
    """kv [layers, b, s, c] read at layer 2; row 1 has an empty prefix and its node 1 sees no key at all (outside
    the model's contract): zeros, as api.py promises, where the kernel itself would hold junk (no second where)."""
    b, t, h, s = 2, 3, 2, 100
    q, qpe, _ = inputs(6, b, t, h, 1)
    whole = jnp.asarray(np.random.default_rng(6).normal(size=(3, b, s, R + PE)), jnp.bfloat16)
    mask = causal(b, t).at[1, 1].set(False)
    lengths = [40, 0]
    out = attn(q, qpe, whole, jnp.asarray(lengths, jnp.int32), mask, scale=0.1, impl="mosaic", interpret=True,
               out_dtype=jnp.float32, layer=2)
    assert not np.asarray(out[1, 1]).any() and np.asarray(out[1, 0]).any()
    ref = np.array(dense_reference(q, qpe, whole[2], jnp.asarray(lengths, jnp.int32), mask, 0.1))
    ref[1, 1] = 0                                   # the dense oracle averages all slots there
    np.testing.assert_allclose(np.asarray(out), ref, rtol=3e-2, atol=3e-2 * np.abs(ref).max())


@pytest.mark.interpret
@pytest.mark.slow      # fast: one query and tree block (test_contiguous_causal, test_ddtree_mask_through_the_api)
def test_wide_tree_two_query_and_tree_blocks():
    """70 nodes with random parents, one head: two query blocks and two tree key blocks (tree keys 64..69 in
    the second)."""
    t = 70
    rng = np.random.default_rng(4)
    parents = np.r_[-1, [rng.integers(0, i) for i in range(1, t)]][None]
    z = jnp.zeros((1, t), jnp.int32)
    mask = ddtree.ancestor_mask(ddtree.Tree(z, jnp.asarray(parents, jnp.int32), z, z.astype(jnp.float32),
                                            jnp.ones((1, t), bool)))
    q, qpe, kv = inputs(5, 1, t, 1, 256)
    out = mosaic(q, qpe, kv, jnp.asarray([90], jnp.int32), mask, scale=0.1, interpret=True, num_splits=2)
    check(out, q, qpe, kv, [90], mask, 0.1)


@pytest.mark.interpret
def test_rejects_what_it_cannot_run():
    q, qpe, kv = inputs(0, 1, 2, 2, 64)
    lengths = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="16-bit"):
        mosaic_gpu.latent_attention_mosaic(q, qpe, kv.astype(jnp.float32), lengths, causal(1, 2), 0.1,
                                           interpret=True)
    with pytest.raises(ValueError, match="block_q = 64"):
        mosaic_gpu.latent_attention_mosaic(q, qpe, kv, lengths, causal(1, 2), 0.1, interpret=True, block_k=32)
    with pytest.raises(ValueError, match="multiple of 64"):
        latent_attention(q, qpe, kv[:, :32].reshape(2, 16, -1), lengths, causal(1, 2), 0.1, impl="mosaic",
                         interpret=True, page_table=jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="lowered for a GPU"):     # a CPU program: no silent fallback to XLA
        latent_attention(q, qpe, kv, lengths, causal(1, 2), 0.1, impl="mosaic")


GPU_MISSING = targets.compiler_missing("h200")
TP = 8


def compile_h200(width, page, slots, capfd, monkeypatch):
    """Lower and compile for a compile-only H200 at the K2.6 TP-8 slice (64 heads / 8 = 8 per device, latent
    512 + 64), spills as errors; returns ptxas' report (MOSAIC_GPU_DUMP_PTXAS) of the one Mosaic GPU kernel and
    the shared memory Mosaic GPU allocates for it."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    smem = []
    size = mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda tree: smem.append(size(tree)) or smem[-1])
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    h, r, p = KIMI_K26.num_attention_heads // TP, KIMI_K26.kv_lora_rank, KIMI_K26.qk_rope_head_dim
    mesh = targets.compile_mesh("h200", 1)
    rep = NamedSharding(mesh, P())
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    bf16 = jnp.bfloat16
    kv = s((1, slots, r + p), bf16) if not page else s((slots // page, page, r + p), bf16)
    args = [s((1, width, h, r), bf16), s((1, width, h, p), bf16), kv, s((1,), jnp.int32), s((1, width, width), bool)]
    if page:
        args.append(s((1, slots // page), jnp.int32))

    def fn(q, qpe, kv, lengths, mask, table=None):
        return latent_attention(q, qpe, kv, lengths, mask, 0.1, impl="mosaic", page_table=table)

    capfd.readouterr()
    with targets.lowering_for(mesh):
        lowered = jax.jit(fn).lower(*args)
    hlo = lowered.compile(targets.compiler_options("h200")).as_text()
    assert len(re.findall(r'custom_call_target="mosaic_gpu[^"]*"', hlo)) == 1
    report = capfd.readouterr()
    return report.out + report.err, smem


def check_ptxas(ptxas, smem):
    # Mosaic GPU also refuses, at lowering, a kernel over the device's limit (227 KiB a block on H100/H200)
    assert len(smem) == 1 and smem[0] <= 227 * 1024, smem
    used = re.findall(r"Used (\d+) registers", ptxas)
    if not used:
        pytest.skip("ptxas printed no report (MOSAIC_GPU_DUMP_PTXAS read before this test?); spills unchecked")
    assert len(used) == 1 and "sm_90a" in ptxas
    # XLA's spill option does not reach Mosaic GPU kernels (they compile their own PTX): read ptxas' report
    assert re.findall(r"(\d+) bytes spill stores", ptxas) == ["0"], ptxas


# The code is the same for every width with the same number of tree blocks (one up to 64 nodes, two up to 128)
# and of value chunks; only constants change. Shared memory: 231,448 B (226.0 KiB) at every width.
@pytest.mark.compile
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("width,page", [(1, 0), pytest.param(65, 64, marks=pytest.mark.slow)])   # fast: one
def test_compiles_for_h200_k26_slice(width, page, monkeypatch, capfd):
    check_ptxas(*compile_h200(width, page, 4096, capfd, monkeypatch))


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("width,page,slots", [(17, 0, 4096), (17, 64, 4096), (64, 0, 4096), (64, 64, 4096),
                                              (65, 0, 4096)]     # (1, 0) and (65, 64): the fast test's
                         + [(w, page, 262144) for w in (1, 65) for page in (0, 64)])
def test_compiles_for_h200_more_widths_and_256k_slots(width, page, slots, monkeypatch, capfd):
    check_ptxas(*compile_h200(width, page, slots, capfd, monkeypatch))


@pytest.mark.interpret
def test_w_uv_in_the_merge_equals_the_einsum_after_it():
    """With w_uv (MLA's kv_b), the Mosaic kernel's 64-row padded partials merge and project in one Triton kernel
    (merge.merge_project): equal to its own o_lat through the einsum."""
    q, qpe, kv = inputs(2, 1, 8, 4, 120)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(R, 4, 96)) / 12, jnp.bfloat16)
    lengths, mask = jnp.asarray([70], jnp.int32), tree_mask()[:1]
    o_lat = attn(q, qpe, kv, lengths, mask, scale=0.1, impl="mosaic", interpret=True)
    want = np.asarray(jnp.einsum("bthr,rhv->bthv", o_lat, w[..., 32:]), np.float32)
    got = latent_attention(q, qpe, kv, lengths, mask, 0.1, impl="mosaic", interpret=True, w_uv=w, w_uv_from=32)
    assert got.shape == (1, 8, 4, 64) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=1e-2 * np.abs(want).max())
