"""Tree attention's Pallas TPU kernel (kimi_jax.ops.tree_attention.pallas_tpu): Pallas' TPU interpret mode on the
CPU against the dense oracle, deviceless libtpu compiles for v5e, v5p, v6e and TPU7x at K2.6 slice shapes, and
the rules of ``rules.tpu_rules``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, SingleDeviceSharding

from kimi_jax.analysis import targets
from kimi_jax.config import KIMI_K26
from kimi_jax.decoding import ddtree
from kimi_jax.ops.select import pick_tiles
from kimi_jax.ops.tree_attention.pallas_tpu import latent_attention_tpu
from kimi_jax.ops.tree_attention.reference import dense_reference
from kimi_jax.ops.tree_attention.rules import TILES, AttentionCall, tpu_rules
from test_paged_cache import PAGE, paged_copy, within_storage
from test_tree_attention import causal, inputs

TPU_MISSING = targets.compiler_missing("v5e")
SLOW = pytest.mark.slow
R, PE = KIMI_K26.kv_lora_rank, KIMI_K26.qk_rope_head_dim

tpu = jax.jit(latent_attention_tpu, static_argnames=("scale", "interpret", "block_q", "block_k", "num_splits",
                                                      "out_dtype", "device_kind"))


def ancestor_mask(b, t, seed):
    """[b, t, t] ancestor masks of random trees (node i's parent drawn below i): each node sees itself and its
    ancestors."""
    rng = np.random.default_rng(seed)
    parents = np.stack([np.r_[-1, [rng.integers(0, i) for i in range(1, t)]] for _ in range(b)]).astype(np.int32)
    z = jnp.zeros((b, t), jnp.int32)
    return ddtree.ancestor_mask(ddtree.Tree(z, jnp.asarray(parents), z, z.astype(jnp.float32),
                                            jnp.ones((b, t), bool)))


def check(out, q, qpe, kv_rows, lengths, mask, scale, rtol=2e-5):
    """float32 inputs: test_tree_attention's tolerance; bf16: its test_bf16's (rtol 3e-2)."""
    ref = np.asarray(dense_reference(q, qpe, kv_rows, jnp.asarray(lengths, jnp.int32), mask, scale), np.float32)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=rtol, atol=rtol * np.abs(ref).max())


# s = 70 is not a multiple of the 16-row key block (the last block runs past the cache; block_k None: the default
# 512 covers it, one 70-row block); lengths: an empty prefix, mid-block, and one whose tree slots run past the
# cache's end (kimi_jax.cache.visibility drops them)
# The fast loop interprets the kernel once (the first case, ~6 s on a 2-core VM); the other shapes, the second mask
# word, a paged cache, K2.6's widths and bf16 run in the full suite.
@pytest.mark.interpret
@pytest.mark.parametrize("t,h,lengths,block_k,splits", [
    (1, 1, [0, 23, 69], 16, 2),        # decode, one head a chip (TP-64)
    pytest.param(5, 4, [0, 33, 67], None, None, marks=SLOW),   # a 1 + 4-node tree, TP-16, the default bk, splits
    pytest.param(17, 8, [0, 48, 60], 16, 3, marks=SLOW),       # TP-8, 136 query rows: a ragged last query block
])
def test_contiguous(t, h, lengths, block_k, splits):
    q, qpe, kv = inputs(t, 3, t, h, 32, 16, 70)
    mask = ancestor_mask(3, t, seed=t)
    out = tpu(q, qpe, kv, jnp.asarray(lengths, jnp.int32), mask, scale=0.3, interpret=True, block_q=128,
              block_k=block_k, num_splits=splits)
    check(out, q, qpe, kv, lengths, mask, 0.3)


@pytest.mark.interpret
@SLOW
def test_two_mask_words_and_layer():
    """t = 33 spans two 32-bit mask words (the second holds one node); the cache is [layers, b, s, c], read at
    layer 1 in place; bk = 32 over 100 slots."""
    q, qpe, kv = inputs(4, 2, 33, 1, 32, 16, 100)
    whole = jnp.stack([kv * 0 + 7, kv])
    mask = ancestor_mask(2, 33, seed=4)
    out = tpu(q, qpe, whole, jnp.asarray([0, 50], jnp.int32), mask, scale=0.2, interpret=True, block_k=32,
              layer=jnp.int32(1))
    check(out, q, qpe, kv, [0, 50], mask, 0.2)


@pytest.mark.interpret
@SLOW      # fast: the paged kernel's lowering compiled by test_compiles_for_v5e_tp8_tree (pages of 64)
@pytest.mark.parametrize("t,h,splits", [(1, 8, 2), (5, 4, None)])
def test_paged(t, h, splits):
    """A shuffled page pool (garbage in its spare pages, unmapped table entries past each row's pages) at
    layer 1 of 2, lengths incl. an empty prefix: the kernel reads every page through the table."""
    lengths = [0, 37, 100 - t]
    q, qpe, kv = inputs(10 + t, 3, t, h, 32, 16, 112)
    kv = within_storage(jnp.stack([kv[::-1], kv]), [x + t for x in lengths])
    pool, table = paged_copy(kv, [x + t for x in lengths], PAGE, seed=t)
    mask = ancestor_mask(3, t, seed=t)
    out = tpu(q, qpe, pool, jnp.asarray(lengths, jnp.int32), mask, scale=0.3, interpret=True, num_splits=splits,
              page_table=table, layer=1)
    check(out, q, qpe, kv[1], lengths, mask, 0.3)


@pytest.mark.interpret
@SLOW
def test_k26_slice_bf16():
    """K2.6's latent 512 + 64, 8 heads (TP-8), t = 17, a bf16 cache of 384 slots in 3 splits of 128-row
    blocks, contiguous and paged (pages of 64: bk = 64)."""
    b, t, h, s = 2, 17, 8, 384
    q, qpe, kv = inputs(17, b, t, h, R, PE, s, jnp.bfloat16)
    lengths = [0, s - t - 3]
    mask = ancestor_mask(b, t, seed=17)
    kw = dict(scale=KIMI_K26.softmax_scale, interpret=True, block_k=128, num_splits=3)
    out = tpu(q, qpe, kv, jnp.asarray(lengths, jnp.int32), mask, **kw)
    check(out, q, qpe, kv, lengths, mask, KIMI_K26.softmax_scale, rtol=3e-2)
    pool, table = paged_copy(kv[None], [s, s], 64)
    out = tpu(q, qpe, pool[0], jnp.asarray(lengths, jnp.int32), mask, page_table=table, **kw)
    check(out, q, qpe, kv, lengths, mask, KIMI_K26.softmax_scale, rtol=3e-2)


@pytest.mark.interpret
@SLOW
def test_chain_bf16_out_dtype():
    """A chain (causal mask), bf16 in and out (the output takes q's dtype by default), one split: the kernel
    normalises and writes bf16 itself."""
    q, qpe, kv = inputs(6, 2, 6, 2, 32, 16, 48, jnp.bfloat16)
    out = tpu(q, qpe, kv, jnp.asarray([5, 42], jnp.int32), causal(2, 6), scale=0.2, interpret=True, block_k=16)
    assert out.dtype == jnp.bfloat16
    check(out, q, qpe, kv, [5, 42], causal(2, 6), 0.2, rtol=3e-2)


def compile_device(target):
    return targets.compile_devices(target, 1)[0]


def compiled_hlo(device, h, t, slots, page, *, layers=2, dtype=jnp.bfloat16):
    """The compiled HLO text of the kernel at K2.6 widths, one batch row, attending layer 1 of a whole cache
    [layers, ...] that has a row-major layout (pallas_tpu's module doc: XLA:TPU's default would be copied), on
    one compile-only TPU device; the mesh carries the device kind the kernel picks its tiles by. Asserts the
    kernel is there and that nothing relayouts the cache."""
    sh = SingleDeviceSharding(device)
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    cache = (layers, *((slots // page, page) if page else (1, slots)), R + PE)
    args = [spec((1, t, h, R), jnp.bfloat16), spec((1, t, h, PE), jnp.bfloat16), spec(cache, dtype),
            spec((1,), jnp.int32), spec((1, t, t), jnp.bool_)] + ([spec((1, slots // page), jnp.int32)] if page else [])
    shardings = [sh, sh, Format(Layout(tuple(range(len(cache)))), sh)] + [sh] * (len(args) - 3)

    def f(q, qpe, kv, lengths, mask, *table):
        return latent_attention_tpu(q, qpe, kv, lengths, mask, 0.1, page_table=table[0] if table else None,
                                    layer=1)

    with jax.set_mesh(Mesh([device], ("x",))):
        text = jax.jit(f, in_shardings=shardings, out_shardings=sh).lower(*args).compile().as_text()
    assert "tpu_custom_call" in text
    # every value of the cache's shape has the parameter's layout: no relayout (a same-layout copy-start /
    # copy-done of a small cache into VMEM, S(1), is XLA prefetching it whole, which a real one never fits)
    layouts = set(re.findall(rf"= \w+\[{','.join(map(str, cache))}\]\{{([\d,]+)", text))
    assert layouts == {",".join(map(str, range(len(cache) - 1, -1, -1)))}, layouts
    return text


@pytest.mark.skipif(TPU_MISSING is not None, reason=str(TPU_MISSING))
def test_compiles_for_v5e_tp8_tree():
    """The fast loop's compile: a 1 + 4-node tree (shapes test_compiles_for_tpus does not compile again: a
    compile-only program found in the persistent cache cannot be loaded back, and jax warns)."""
    device = compile_device("v5e")
    compiled_hlo(device, 8, 5, 4096, 0)
    compiled_hlo(device, 8, 5, 4096, 64, dtype=jnp.float8_e4m3fn)     # an fp8 cache, bf16 queries


@pytest.mark.slow
@pytest.mark.skipif(TPU_MISSING is not None, reason=str(TPU_MISSING))
@pytest.mark.parametrize("target", ["v5e", "v5p", "v6e", "tpu7x"])
def test_compiles_for_tpus(target):
    """K2.6 slices at TP-8 and TP-16 (h 8, 4), decode and trees of 17 and 33 tokens, 4096 slots contiguous and
    paged (pages of 64 and 128)."""
    device = compile_device(target)
    assert pick_tiles(TILES, device.device_kind) is not TILES[""]
    for h, t, page in [(8, 1, 0), (8, 17, 0), (4, 33, 0), (8, 1, 64), (8, 17, 128), (4, 33, 64)]:
        compiled_hlo(device, h, t, 4096, page)


def call(**kw):
    base = dict(batch=1, tokens=17, heads=8, latent=R, rope=PE, slots=4096, page=0, dtype="bfloat16")
    return AttentionCall(**{**base, **kw})


def test_supports_k26_shapes():
    for kind in [*TILES, None]:        # "": an unknown TPU
        assert tpu_rules(call(), kind) is None
        assert tpu_rules(call(page=64, tokens=256, heads=64), kind) is None


@pytest.mark.parametrize("kw,words", [
    (dict(tokens=257), "prefill"),
    (dict(dtype="float64"), "8-, 16- or 32-bit"),
    (dict(block_q=4), "block_q"),
    (dict(block_q=12), "block_q"),
    (dict(block_k=12), "block_k"),
    (dict(page=12), "page size"),               # key blocks of gcd(512, 12) = 4 rows
    (dict(page=48, block_k=20), "page size"),
    (dict(batch=64, slots=262144, page=64), "SMEM"),       # 64 x 4096 entries: libtpu's smem overflow
])
def test_supports_refuses(kw, words):
    reason = tpu_rules(call(**kw), "TPU v5 lite")
    assert reason is not None and words in reason


# the boundaries: the same rules one step inside (a key block that is a whole page or the whole cache may be
# any length: Pallas TPU takes an array's full dim)
@pytest.mark.parametrize("kw", [dict(tokens=256), dict(block_q=8), dict(block_k=8), dict(block_k=12, slots=12),
                                dict(page=4), dict(page=24), dict(page=48, block_k=16), dict(dtype="float8_e4m3fn"),
                                dict(batch=63, slots=262144, page=64)])
def test_supports_takes_the_boundaries(kw):
    assert tpu_rules(call(**kw), "TPU v5 lite") is None


def test_rejects_what_it_does_not_support():
    q, qpe, kv = inputs(8, 1, 2, 2, 32, 16, 20)
    with pytest.raises(ValueError, match="block_k"):
        latent_attention_tpu(q, qpe, kv, jnp.zeros((1,), jnp.int32), causal(1, 2), 1.0, interpret=True,
                             block_k=12)
