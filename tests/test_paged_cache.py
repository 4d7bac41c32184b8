"""The paged latent cache (kimi_jax.cache) against the contiguous one, from the kernel up to generate.

Rows of one batch hold very different lengths (3 .. 100 committed tokens); pages are laid out in a shuffled pool so
that a wrong table lookup cannot pass by accident.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi_jax
from kimi_jax import cache as cache_lib
from kimi_jax.config import TINY, Runtime
from kimi_jax.model import params as params_lib
from kimi_jax.model.transformer import forward
from kimi_jax.ops.tree_attention.api import latent_attention
from kimi_jax.ops.tree_attention.reference import dense_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

ROOT = Path(__file__).resolve().parent.parent
PAGE = 16
LENGTHS = [3, 40, 100]


def within_storage(kv, capacities):
    """kv [L, b, s, c] zeroed past each row's whole pages: what the paged copy of it can hold (the contiguous
    oracle then sees the zeros the paged cache reads there)."""
    ends = jnp.asarray([-(-c // PAGE) * PAGE for c in capacities])
    return kv * (jnp.arange(kv.shape[2])[None, None, :, None] < ends[None, :, None, None])


def paged_copy(kv, capacities, page, seed=0):
    """A contiguous cache kv [L, b, s, c] as a paged one: row b's first ceil(capacity/page) pages, at shuffled
    positions of a pool with two spare pages (whose contents are garbage, never read); the rest unmapped."""
    layers, b, s, c = kv.shape
    per_row = s // page
    need = [-(-cap // page) for cap in capacities]
    rng = np.random.default_rng(seed)
    pool_pages = sum(need) + 2
    order = rng.permutation(pool_pages)
    pool = rng.normal(size=(layers, pool_pages, page, c)).astype(np.float32) * 100
    table = np.full((b, per_row), pool_pages, np.int32)
    k = 0
    for i in range(b):
        for j in range(need[i]):
            table[i, j] = order[k]
            pool[:, order[k]] = np.asarray(kv[:, i, j * page:(j + 1) * page])
            k += 1
    return jnp.asarray(pool, kv.dtype), jnp.asarray(table)


def test_page_table_allocation_and_pool_size():
    caps = [5, 33, 0, 64]
    cache = cache_lib.init_paged_cache(TINY, jnp.asarray(caps), 64, 16, cache_lib.pool_size(np.asarray(caps), 64, 16))
    n = cache.kv.shape[1]
    assert n == 8 and cache.max_len == 64                     # 1 + 3 + 0 + 4 = 8 pages, not 4 rows x 4
    np.testing.assert_array_equal(cache.page_table, [[0, n, n, n], [1, 2, 3, n], [n, n, n, n], [4, 5, 6, 7]])


# Each path once in the fast loop (xla at a decode step, the kernel on a 5-node tree); the other two in the full suite.
@pytest.mark.interpret
@pytest.mark.parametrize("t,impl", [(1, "xla"), pytest.param(1, "pallas", marks=pytest.mark.slow),
                                    pytest.param(5, "xla", marks=pytest.mark.slow), (5, "pallas")])
def test_paged_attention_equals_dense_reference(impl, t):
    rng = np.random.default_rng(t)
    b, h, r, p, s = 3, 4, 32, 16, 128
    q, qpe = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for d in (r, p))
    kv = jnp.asarray(rng.normal(size=(1, b, s, r + p)), jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool)) & (rng.random((b, t, t)) < 0.7) | np.eye(t, dtype=bool))
    caps = [n + t for n in LENGTHS]
    kv = within_storage(kv, caps)
    pool, table = paged_copy(kv, caps, PAGE)
    ref = dense_reference(q, qpe, kv[0], lengths, mask, 0.3)
    kw = dict(block_k=16, num_splits=3) if impl == "pallas" else {}
    out = jax.jit(lambda *a: latent_attention(*a, 0.3, impl=impl, page_table=table, **kw))(q, qpe, pool[0], lengths,
                                                                                            mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_xla_attention_reads_a_long_paged_cache_in_blocks():
    """A paged cache of 384 logical slots (pages shuffled in the pool, garbage in the spare ones): the XLA path's
    prefix loop gathers each 128-slot block through the table, as many as the longest row needs, and equals the
    dense-mask oracle on the contiguous rows."""
    rng = np.random.default_rng(3)
    b, t, h, r, p, s = 3, 4, 4, 32, 16, 384
    q, qpe = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for d in (r, p))
    lengths = [3, 140, 300]
    caps = [n + t for n in lengths]
    kv = within_storage(jnp.asarray(rng.normal(size=(1, b, s, r + p)), jnp.float32), caps)
    pool, table = paged_copy(kv, caps, PAGE)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    ref = dense_reference(q, qpe, kv[0], jnp.asarray(lengths, jnp.int32), mask, 0.3)
    out = jax.jit(lambda *a: latent_attention(*a, 0.3, impl="xla", page_table=table))(
        q, qpe, pool[0], jnp.asarray(lengths, jnp.int32), mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_over_used_slots_reads_the_smallest_bucket_that_holds_the_used_slots():
    """cache.over_used_slots against brute force: for every used count (bucket edges included) the branch taken
    is the smallest of 64, 256, 1024, 1500 slots that holds it (the last: the cache's own width)."""
    assert cache_lib.slot_buckets(1500) == (64, 256, 1024, 1500) and cache_lib.slot_buckets(64) == (64,)
    pick = jax.jit(lambda used: cache_lib.over_used_slots(used, 1500, lambda s: jnp.int32(s)))
    for used in (0, 1, 64, 65, 256, 257, 1024, 1025, 1500):
        assert int(pick(used)) == min(s for s in (64, 256, 1024, 1500) if s >= used), used
    assert int(jax.jit(lambda u: cache_lib.over_used_slots(u, 1500, lambda s: jnp.int32(s), 100))(1)) == 100


def test_paged_commit_equals_contiguous_commit():
    rng = np.random.default_rng(1)
    kv = jnp.asarray(rng.normal(size=(2, 3, 128, 8)), jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    caps = [n + 8 for n in LENGTHS]
    kv = within_storage(kv, caps)
    pool, table = paged_copy(kv, caps, PAGE)
    path = jnp.asarray([[0, 2, 3, -1], [0, 1, 5, 7], [0, -1, -1, -1]], jnp.int32)
    path_len = jnp.asarray([3, 4, 1], jnp.int32)
    flat = cache_lib.commit(cache_lib.KVCache(kv, lengths), path, path_len)
    paged = cache_lib.commit(cache_lib.KVCache(pool, lengths, table), path, path_len)
    np.testing.assert_array_equal(paged.lengths, flat.lengths)
    for layer in range(2):
        view = cache_lib.rows_view(paged.kv[layer], table)
        for i, n in enumerate(np.asarray(flat.lengths)):
            np.testing.assert_array_equal(view[i, :n], flat.kv[layer, i, :n])


@pytest.mark.interpret
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_paged_forward_equals_contiguous_prefill_decode_and_tree(impl):
    """Prefill rows of very different lengths, decode two steps, verify a tree and commit part of it: logits and
    committed rows of the paged cache equal the contiguous cache's at every step."""
    cfg = TINY
    params = params_lib.init_params(cfg, jax.random.key(0))
    rt = Runtime(attn_impl=impl)
    b, max_len = 3, 128
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, max(LENGTHS))), jnp.int32)
    lens = jnp.asarray(LENGTHS, jnp.int32)
    caps = lens + 12
    flat = cache_lib.init_cache(cfg, b, max_len)
    paged = cache_lib.init_paged_cache(cfg, caps, max_len, PAGE, cache_lib.pool_size(np.asarray(caps), max_len, PAGE))
    assert paged.kv.shape[1] < b * max_len // PAGE
    fwd = jax.jit(forward, static_argnames=("cfg", "rt"))
    caches = []
    for c in (flat, paged):
        out = fwd(params, cfg, prompt, c, rt=rt)
        caches.append((out, out.cache.replace(lengths=lens)))
    (o_flat, flat), (o_paged, paged) = caches
    for i, n in enumerate(LENGTHS):     # prefill logits up to each row's length
        np.testing.assert_allclose(o_paged.logits[i, :n], o_flat.logits[i, :n], rtol=1e-5, atol=1e-5)
    tok = jnp.argmax(o_flat.logits[jnp.arange(b), lens - 1], -1)[:, None].astype(jnp.int32)
    for _ in range(2):                  # decode steps
        a, c = fwd(params, cfg, tok, flat, rt=rt), fwd(params, cfg, tok, paged, rt=rt)
        np.testing.assert_allclose(c.logits, a.logits, rtol=1e-5, atol=1e-5)
        flat = a.cache.replace(lengths=flat.lengths + 1)
        paged = c.cache.replace(lengths=paged.lengths + 1)
        tok = jnp.argmax(a.logits[:, -1], -1)[:, None].astype(jnp.int32)
    tree = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 4)), jnp.int32)
    mask = jnp.broadcast_to(jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool), (b, 4, 4))
    depths = jnp.asarray([0, 1, 1, 2], jnp.int32)
    a = fwd(params, cfg, tree, flat, positions=flat.lengths[:, None] + depths, new_mask=mask, rt=rt)
    c = fwd(params, cfg, tree, paged, positions=paged.lengths[:, None] + depths, new_mask=mask, rt=rt)
    np.testing.assert_allclose(c.logits, a.logits, rtol=1e-5, atol=1e-5)
    path, path_len = jnp.asarray([[0, 2, 3], [0, 1, -1], [0, -1, -1]], jnp.int32), jnp.asarray([3, 2, 1], jnp.int32)
    flat, paged = cache_lib.commit(a.cache, path, path_len), cache_lib.commit(c.cache, path, path_len)
    nxt = jnp.zeros((b, 1), jnp.int32)
    np.testing.assert_allclose(fwd(params, cfg, nxt, paged, rt=rt).logits, fwd(params, cfg, nxt, flat, rt=rt).logits,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_generate_with_a_paged_cache_gives_the_contiguous_tokens(method):
    model = kimi_jax.load(str(ROOT / "checkpoints" / "target"), drafter=str(ROOT / "checkpoints" / "drafter"))
    paged = kimi_jax.load(str(ROOT / "checkpoints" / "target"), drafter=str(ROOT / "checkpoints" / "drafter"),
                          runtime=Runtime(page_size=PAGE))
    prompts = ["def f(x):\n    return", "import os\nimport sys\n\n\nclass Config:\n    \"\"\"Settings read from the "
               "environment, with defaults for every field that the service needs to start.\"\"\"\n\n    def __init__"]
    request = paged.prepare(prompts, 24, method, 8 if method == "ddtree" else None)
    assert 0 < request.pool_pages * PAGE < 2 * request.max_len                      # the rows own less than two full-length blocks
    a = model.generate(prompts, 24, method=method, budget=8 if method == "ddtree" else None)
    b = paged.generate(prompts, 24, method=method, budget=8 if method == "ddtree" else None)
    assert b.tokens == a.tokens
