"""latent_attention: the Pallas kernel (interpret mode) and the XLA two-pass path against the dense-mask oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.cache import visibility
from kimi_jax.config import TINY
from kimi_jax.decoding import ddtree
from kimi_jax.model import mla
from kimi_jax.ops.tree_attention.api import latent_attention
from kimi_jax.ops.tree_attention.reference import dense_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

attn = jax.jit(latent_attention, static_argnames=("scale", "impl", "interpret", "block_q", "block_k",
                                                  "num_splits", "out_dtype"))


def inputs(seed, b, t, h, r, p, s, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    return n(b, t, h, r), n(b, t, h, p), n(b, s, r + p)


def causal(b, t):
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))


@functools.lru_cache(maxsize=None)
def tree_mask():
    """The ancestor mask [2, 8, 8] of a DDTree tree of 1 + 7 nodes over 2 depths of a 2-token vocabulary: only
    2 + 4 = 6 prefixes exist, so slot 7 is padding that sees only itself. Built once (jitted) for all tests."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 2, 2)) * 2, jnp.float32)
    tree = jax.jit(ddtree.build_tree, static_argnums=2)(jnp.zeros((2,), jnp.int32), logits, 7)
    assert bool(tree.valid[:, :7].all()) and not bool(tree.valid[:, 7].any())
    return jax.jit(ddtree.ancestor_mask)(tree)


def check_all(q, qpe, kv, lengths, mask, scale=0.3, rtol=2e-5, **pallas_kw):
    lengths = jnp.asarray(lengths, jnp.int32)
    ref = np.asarray(dense_reference(q, qpe, kv, lengths, mask, scale), np.float32)
    tol = dict(rtol=rtol, atol=rtol * np.abs(ref).max())
    xla = attn(q, qpe, kv, lengths, mask, scale=scale, impl="xla", out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(xla), ref, **tol)
    pal = attn(q, qpe, kv, lengths, mask, scale=scale, impl="pallas", out_dtype=jnp.float32, **pallas_kw)
    assert pal.shape == q.shape and pal.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(pal), ref, **tol)
    return ref


# s = 70 is not a multiple of the 16-row key block. lengths: an empty prefix, mid-block, a full cache; in the
# chain case row 2 has lengths + t > s, so its last 3 tree slots do not exist (kimi_jax.cache.visibility drops them).
@pytest.mark.interpret
@pytest.mark.parametrize("t,lengths,splits", [
    (1, [0, 23, 69], 5),               # decode, one key block per split
    pytest.param(6, [0, 33, 67], None, marks=pytest.mark.slow),    # chain: causal mask, default splits (2)
])
def test_causal(t, lengths, splits):
    q, qpe, kv = inputs(t, 3, t, 4, 32, 16, 70)
    check_all(q, qpe, kv, lengths, causal(3, t), block_k=16, num_splits=splits)


@pytest.mark.parametrize("lengths", [[0, 5, 20], [0, 128, 382]])
def test_xla_prefix_in_blocks_equals_the_dense_reference(lengths):
    """A cache of 384 slots: the XLA path's prefix loop (128-slot blocks, as many as the longest row needs: none
    past the first for short rows; three with a row mid-block whose last tree slots fall past the cache end), read
    from one layer's rows and in place from the whole cache [layers, ...], equals the dense-mask oracle."""
    q, qpe, kv = inputs(7, 3, 4, 4, 32, 16, 384)
    lengths = jnp.asarray(lengths, jnp.int32)
    ref = np.asarray(dense_reference(q, qpe, kv, lengths, causal(3, 4), 0.3))
    run = jax.jit(lambda kv, layer: latent_attention(q, qpe, kv, lengths, causal(3, 4), 0.3, impl="xla",
                                                     layer=layer, out_dtype=jnp.float32))
    for got in (run(kv, None), run(jnp.stack([kv * 0 + 7, kv]), 1)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.interpret
@pytest.mark.slow
def test_ddtree_tree_with_padding():
    mask = tree_mask()
    assert bool(mask[:, 7, 7].all()) and int(mask[:, 7].sum()) == 2 and int(mask[:, :, 7].sum()) == 2
    assert int(mask.sum()) > 2 * (8 + 6)         # depth-2 nodes see the root and their parent
    q, qpe, kv = inputs(1, 2, 8, 2, 32, 16, 96)
    check_all(q, qpe, kv, [7, 96 - 8], mask, block_k=32, num_splits=2)


@pytest.mark.interpret
@pytest.mark.slow
def test_big_tree_multiword_mask():
    # 40 nodes: the packed mask spans two words and two tree key blocks; node 0 of row 1 sees only itself
    rng = np.random.default_rng(2)
    parents = np.stack([np.r_[-1, [rng.integers(0, i) for i in range(1, 40)]] for _ in range(2)])
    valid = jnp.ones((2, 40), bool)
    z = jnp.zeros((2, 40), jnp.int32)
    mask = ddtree.ancestor_mask(ddtree.Tree(z, jnp.asarray(parents, jnp.int32), z, z.astype(jnp.float32), valid))
    assert int(mask[0].sum()) > 2 * 40 - 1          # some node has an ancestor besides the root
    q, qpe, kv = inputs(2, 2, 40, 1, 16, 16, 128)
    check_all(q, qpe, kv, [0, 50], mask, block_k=32)


@pytest.mark.interpret
@pytest.mark.slow
def test_k2_head_dims():
    """K2's latent 512 + 64 with 8 heads (a TP-8 shard), t = 8 tree nodes, four query blocks of 16."""
    q, qpe, kv = inputs(5, 1, 8, 8, 512, 64, 64)
    check_all(q, qpe, kv, [40], tree_mask()[:1], scale=0.05, rtol=1e-4, block_q=16, block_k=32)


@pytest.mark.interpret
@pytest.mark.slow
def test_bf16():
    mask = tree_mask()
    q, qpe, kv = inputs(6, 2, 8, 4, 32, 16, 80, jnp.bfloat16)
    lengths = jnp.asarray([30, 72], jnp.int32)
    ref = np.asarray(dense_reference(q, qpe, kv, lengths, mask, 0.2))
    for impl in ("xla", "pallas"):
        out = attn(q, qpe, kv, lengths, mask, scale=0.2, impl=impl, block_k=16)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=3e-2, atol=3e-2 * np.abs(ref).max())


def test_matches_attend_absorbed():
    """latent_attention between W_UK and W_UV reproduces mla.attend_absorbed on TINY's MLA dims (r = 16, p = 8:
    p zero-padded to 16 for the kernel) with a cache of s = 14 < 16 rows (padded to one key block)."""
    cfg = TINY
    rng = np.random.default_rng(7)
    b, t, h, s = 2, 8, cfg.num_attention_heads, 14
    n, v, r, p = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    params = {"kv_b": f(r, h, n + v) * 0.3}
    q_nope, q_pe, kv = f(b, t, h, n), f(b, t, h, p), f(b, s, r + p)
    lengths = jnp.asarray([0, 6], jnp.int32)
    mask = tree_mask()
    want = mla.attend_absorbed(q_nope, q_pe, kv, visibility(lengths, mask, s), params, cfg)
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, params["kv_b"][..., :n])
    for impl in ("xla", "pallas"):
        o_lat = attn(q_lat, q_pe, kv, lengths, mask, scale=cfg.softmax_scale, impl=impl)
        got = jnp.einsum("bthr,rhv->bthv", o_lat, params["kv_b"][..., n:])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * np.abs(want).max())
        # W_UV given to the op (what mla.attend_tree does)
        got = latent_attention(q_lat, q_pe, kv, lengths, mask, cfg.softmax_scale, impl=impl, w_uv=params["kv_b"],
                               w_uv_from=n)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * np.abs(want).max())


def partials(rng, b, parts, rows, r, dtype=np.float32):
    """Random split-K partials (acc, max, sum) as the kernels write them; query row 1 saw no key in any part
    (max still MASK_VALUE: zeros out), and row 2 only in part 0."""
    from kimi_jax.ops.numerics import MASK_VALUE
    m = rng.standard_normal((b, parts, rows)) * 3
    m[:, :, 1] = MASK_VALUE
    m[:, 1:, 2] = MASK_VALUE
    total = np.where(m > MASK_VALUE / 2, rng.random((b, parts, rows)) + 0.5, 0.0)
    o = rng.standard_normal((b, parts, rows, r)) * total[..., None]
    return [jnp.asarray(a, jnp.float32) for a in (o, m, total)]


# (b, parts, tokens, heads, padded rows, r, c, w_uv_from, dtype): K2.6's split of heads at a tree's width (17
# parts, 17 tokens of 8 heads, rows padded to whole 64-row blocks as the Mosaic kernel writes them), 2 parts and
# a ragged token block, 3 heads, bf16 with float32 weights
PROJECTIONS = [(1, 17, 17, 8, 192, 64, 64, 32, jnp.bfloat16), (2, 2, 33, 1, 33, 64, 40, 8, jnp.float32),
               (2, 3, 5, 3, 15, 96, 32, 16, jnp.float32)]


@pytest.mark.interpret
@pytest.mark.parametrize("b,parts,tokens,heads,rows,r,c,col,dtype", PROJECTIONS)
def test_the_projecting_merge_is_the_merge_then_w_uv(b, parts, tokens, heads, rows, r, c, col, dtype):
    """merge.merge_project against merge_pallas (rounded to the output dtype) then ``project`` in XLA."""
    from kimi_jax.ops.tree_attention import merge
    rng = np.random.default_rng(parts)
    o, m, total = partials(rng, b, parts, rows, r)
    w = jnp.asarray(rng.standard_normal((r, heads, c)) / np.sqrt(r), jnp.float32)
    assert merge.project_supports(r, heads, rows, w.shape, col) is None
    got = merge.merge_project(o, m, total, w, col, tokens, dtype, True)
    lat = merge.merge_pallas(o, m, total, 16, dtype, True, rows=tokens * heads).reshape(b, tokens, heads, r)
    want = merge.project(lat, w, col)
    assert got.shape == (b, tokens, heads, c - col) and got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(jnp.abs(want).max()))
    assert not np.asarray(got[:, 0, 1] if heads > 1 else got[:, 1, 0]).any()      # the row that saw nothing


def test_the_projecting_merge_names_what_it_does_not_take():
    from kimi_jax.ops.tree_attention.merge import project_supports
    assert project_supports(512, 8, 17 * 8, (512, 8, 256), 128) is None              # K2.6 at TP-8
    assert "power of two" in project_supports(512, 8, 136, (512, 8, 152), 128)       # 24 output columns
    assert "multiple" in project_supports(48, 8, 136, (48, 8, 256), 128)             # a latent of 48
    assert "whole tokens" in project_supports(512, 3, 64, (512, 3, 256), 128)        # 64 rows of 3 heads
    assert "is not" in project_supports(512, 8, 136, (512, 4, 256), 128)             # heads disagree


@pytest.mark.interpret
@pytest.mark.parametrize("c,col", [(48, 16), (40, 16)])      # v = 32 (the projecting merge), 24 (XLA after)
def test_w_uv_through_the_op_equals_the_einsum_after_it(c, col):
    """latent_attention(..., w_uv=) through the Triton kernels (interpret mode) and XLA, against XLA's o_lat then
    the einsum, on a tree of 8 nodes x 4 heads and a latent of 64."""
    q, qpe, kv = inputs(9, 2, 8, 4, 64, 16, 90)
    w = jnp.asarray(np.random.default_rng(9).standard_normal((64, 4, c)) / 8, jnp.float32)
    lengths, mask = jnp.asarray([20, 75], jnp.int32), tree_mask()
    want = jnp.einsum("bthr,rhv->bthv", attn(q, qpe, kv, lengths, mask, scale=0.2, impl="xla"), w[..., col:])
    for impl in ("xla", "pallas"):
        got = latent_attention(q, qpe, kv, lengths, mask, 0.2, impl=impl, w_uv=w, w_uv_from=col)
        assert got.shape == (2, 8, 4, c - col)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(jnp.abs(want).max()))
    with pytest.raises(ValueError, match="w_uv"):
        latent_attention(q, qpe, kv, lengths, mask, 0.2, w_uv=w[:, :3], w_uv_from=col)


def test_rejects_bad_shapes():
    q, qpe, kv = inputs(8, 1, 2, 2, 16, 16, 20)
    with pytest.raises(ValueError):
        latent_attention(q, qpe, kv, jnp.zeros((1,), jnp.int32), causal(1, 3), 1.0)
    with pytest.raises(ValueError):
        latent_attention(q, qpe, kv, jnp.zeros((1,), jnp.int32), causal(1, 2), 1.0, impl="triton")
    with pytest.raises(ValueError):
        latent_attention(q, qpe, kv, jnp.zeros((1,), jnp.int32), causal(1, 2), 1.0, impl="pallas", block_k=24)


def test_merge_states_is_the_softmax_over_all_parts():
    """xla.merge_states (the XLA path's merge: one variadic reduction and one weighted sum) against a
    softmax over every part's visible keys at once: parts that see nothing, a query that sees nothing (zeros),
    scores 60 apart (the shift must be the true max), and the merge axis in the middle."""
    from kimi_jax.ops.numerics import MASK_VALUE
    from kimi_jax.ops.tree_attention.xla import merge_states
    rng = np.random.default_rng(3)
    parts, nq, keys, r = 5, 7, 4, 3
    scores = rng.standard_normal((parts, nq, keys)) * 20
    visible = rng.random((parts, nq, keys)) < 0.5
    visible[1:, 2] = False          # query 2 sees part 0 only
    visible[:, 5] = False           # query 5 sees nothing
    values = rng.standard_normal((parts, keys, r))
    m = np.where(visible, scores, MASK_VALUE).max(-1)
    p = np.where(visible, np.exp(scores - m[..., None]), 0.0)
    acc = np.einsum("pqk,pkr->pqr", p, values)
    args = [np.asarray(a, np.float32) for a in (m, p.sum(-1), acc)]
    out = merge_states(*args, axis=0)
    mid = merge_states(*(a[None] for a in args), axis=1)
    for q in range(nq):
        s, v = scores[:, q][visible[:, q]], values[visible[:, q]]
        want = np.zeros(r) if not s.size else np.exp(s - s.max()) @ v / np.exp(s - s.max()).sum()
        np.testing.assert_allclose(np.asarray(out[q]), want, rtol=1e-5, atol=1e-6, err_msg=f"query {q}")
        np.testing.assert_allclose(np.asarray(mid[0, q]), want, rtol=1e-5, atol=1e-6)
