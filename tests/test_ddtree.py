"""DDTree builder, ancestor mask and walk against plain-Python references ([ddtree-golden] in docs/sources.md).

Shapes are fixed per case (a few (L, V, N) combos, batch of ROWS tables) so each jitted program compiles
once; hypothesis varies the table values, including exact ties and zero-probability (-inf) tokens.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from heap_reference import all_prefix_scores, heap_tree, log_softmax32, token_paths, walk_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kimi_jax.decoding import ddtree

ROWS = 4
build = jax.jit(ddtree.build_tree_from_log_probs, static_argnums=2, static_argnames="method")
build_logits = jax.jit(ddtree.build_tree, static_argnums=2)
mask_fn = jax.jit(ddtree.ancestor_mask)
walk_fn = jax.jit(ddtree.walk, static_argnums=2)

# (L, V, N): N = 0, N < V, N = V, N > V, a single-token vocab, budgets at and above the number of prefixes.
CASES = [
    (1, 5, 3),
    (2, 1, 4),  # only 2 prefixes exist
    (2, 3, 0),
    (2, 4, 4),
    (3, 3, 7),
    (3, 3, 39),  # exactly all 3 + 9 + 27 prefixes
    (3, 2, 40),  # 14 prefixes: padding
    (4, 6, 13),
    (4, 6, 40),
]
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


def n_prefixes(depth_l: int, vocab: int) -> int:
    return sum(vocab**d for d in range(1, depth_l + 1))


@st.composite
def tables(draw, depth_l: int, vocab: int):
    """ROWS logit tables [ROWS, L, V]: continuous, small-integer (many exact ties), or with -inf entries."""
    kind = draw(st.sampled_from(["float", "int", "int_inf"]))
    if kind == "float":
        elems = st.floats(-4.0, 4.0, width=32)
    elif kind == "int":
        elems = st.sampled_from([0.0, 1.0, 2.0])
    else:
        elems = st.sampled_from([-np.inf, 0.0, 1.0])
    x = draw(hnp.arrays(np.float32, (ROWS, depth_l, vocab), elements=elems))
    x[..., 0] = np.where(np.all(np.isinf(x), axis=-1), 0.0, x[..., 0])  # keep every row normalisable
    return x


def build_np(lp: np.ndarray, budget: int, root=None, method: str = "auto") -> dict:
    root = np.arange(len(lp), dtype=np.int32) + 100 if root is None else root
    tree = build(jnp.asarray(root), jnp.asarray(lp), budget, method=method)
    return {k: np.asarray(v) for k, v in tree._asdict().items()}


def check_structure(t: dict, b: int, lp: np.ndarray, budget: int) -> None:
    """Golden test 2 on row b: topology, prefix-closure, sibling distinctness, padding, sortedness."""
    depth_l, vocab = lp.shape
    n_valid = min(budget, n_prefixes(depth_l, vocab))
    tok, par, dep, sc, val = (t[k][b] for k in ("tokens", "parents", "depths", "scores", "valid"))
    assert tok.shape == (1 + budget,)
    assert par[0] == -1 and dep[0] == 0 and sc[0] == 0.0 and val[0]
    assert val[1 : 1 + n_valid].all() and not val[1 + n_valid :].any()
    pad = slice(1 + n_valid, None)
    assert (tok[pad] == 0).all() and (par[pad] == 0).all() and (dep[pad] == 0).all() and np.isneginf(sc[pad]).all()
    seen = set()
    for i in range(1, 1 + n_valid):
        assert 0 <= par[i] < i
        assert dep[i] == dep[par[i]] + 1 <= depth_l
        assert sc[i] <= sc[par[i]]
        assert (par[i], tok[i]) not in seen  # siblings distinct
        seen.add((par[i], tok[i]))
        assert sc[i] == np.float32(sc[par[i]] + lp[dep[i] - 1, tok[i]])  # score = log q(prefix)
    assert (sc[2 : 1 + n_valid] <= sc[1:n_valid]).all()  # non-increasing (-inf safe)
    if n_valid:
        assert dep[1] == 1 and tok[1] == np.argsort(-lp[0], kind="stable")[0]  # node 1 = (depth 1, rank 0)


# the two builders (module doc of ddtree: "auto" counts at these sizes); each must be the heap's tree
METHODS = ("count", "sort")


# The fast loop checks the counting builder ("auto" at these sizes) against the heap here and the sorting one
# against the counting one (test_the_builders_agree_past_the_counting_bound); the sorting builder here and the two
# largest cases run in the full suite: (3, 3, 39) is test_complete_tree_when_budget_covers_all's, (4, 6, 40) is
# (4, 6, 13)'s shape at a larger budget.
@pytest.mark.parametrize("method", ["count", pytest.param("sort", marks=pytest.mark.slow)])
@pytest.mark.parametrize("depth_l,vocab,budget", [c if c not in ((3, 3, 39), (4, 6, 40)) else
                                                  pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_matches_heap_and_brute_force(depth_l, vocab, budget, method):
    """Golden tests 1-2: same nodes, order, parents, depths and scores as the heap; top-N scores of all prefixes."""

    @SETTINGS
    @given(tables(depth_l, vocab))
    def run(logits):
        lp = log_softmax32(logits)
        t = build_np(lp, budget, method=method)
        for b in range(ROWS):
            check_structure(t, b, lp[b], budget)
            ref = heap_tree(lp[b], budget)
            n = len(ref["tokens"])
            assert n == min(budget, n_prefixes(depth_l, vocab))
            np.testing.assert_array_equal(t["tokens"][b, 1 : 1 + n], ref["tokens"])
            np.testing.assert_array_equal(t["parents"][b, : 1 + n], ref["parents"])
            np.testing.assert_array_equal(t["depths"][b, 1 : 1 + n], ref["depths"])
            np.testing.assert_array_equal(t["scores"][b, 1 : 1 + n], np.array(ref["scores"], np.float32))
            assert t["tokens"][b, 0] == 100 + b
            # brute force: the N largest prefix log-probs (float64 enumeration)
            best = np.sort(all_prefix_scores(lp[b]))[::-1][:n]
            np.testing.assert_allclose(t["scores"][b, 1 : 1 + n].astype(np.float64), best, rtol=1e-5, atol=1e-5)

    run()


@pytest.mark.parametrize("method", ["count", pytest.param("sort", marks=pytest.mark.slow)])     # as above
@pytest.mark.parametrize("depth_l,vocab,small,large", [(3, 3, 7, 39), (4, 6, 13, 40)])
def test_nesting(depth_l, vocab, small, large, method):
    """Golden test 3: T_N is the first N nodes of T_N'. The tie-break is a total order independent of N, so
    this holds even with ties (the paper states it for tie-free tables)."""

    @SETTINGS
    @given(tables(depth_l, vocab))
    def run(logits):
        lp = log_softmax32(logits)
        a, c = build_np(lp, small, method=method), build_np(lp, large, method=method)
        for key in ("tokens", "parents", "depths", "scores", "valid"):
            np.testing.assert_array_equal(a[key], c[key][:, : 1 + small])

    run()


def test_root_only_for_zero_budget():
    t = build(jnp.array([5, 6]), jnp.asarray(log_softmax32(np.zeros((2, 3, 4)))), 0)
    assert t.tokens.shape == (2, 1)
    np.testing.assert_array_equal(t.tokens[:, 0], [5, 6])
    np.testing.assert_array_equal(t.parents, [[-1], [-1]])
    path, path_len, bonus = walk_fn(t, jnp.array([[9], [8]]), 3)
    np.testing.assert_array_equal(path, [[0, -1, -1, -1]] * 2)
    np.testing.assert_array_equal(path_len, [1, 1])
    np.testing.assert_array_equal(bonus, [9, 8])


def test_one_hot_gives_top1_chain():
    """Golden test 4a: a one-hot draft (others -inf or far below) puts the argmax chain first."""
    rng = np.random.default_rng(0)
    depth_l, vocab, budget = 4, 6, 13
    hot = rng.integers(0, vocab, size=(ROWS, depth_l))
    logits = np.full((ROWS, depth_l, vocab), -np.inf, np.float32)
    logits[1::2] = -30.0  # strongly peaked but finite
    np.put_along_axis(logits, hot[..., None], 0.0, axis=-1)
    lp = log_softmax32(logits)
    t = build_np(lp, budget)
    np.testing.assert_array_equal(t["tokens"][:, 1 : 1 + depth_l], hot)
    chain_parents = np.broadcast_to(np.arange(depth_l), (ROWS, depth_l))
    np.testing.assert_array_equal(t["parents"][:, 1 : 1 + depth_l], chain_parents)
    np.testing.assert_array_equal(t["scores"][:, 1 : 1 + depth_l], 0.0)
    # a budget of L gives exactly the chain
    t = build_np(lp, depth_l)
    np.testing.assert_array_equal(t["tokens"][:, 1:], hot)


@pytest.mark.parametrize("depth_l,vocab,budget", [(3, 3, 39), (3, 2, 40), (2, 1, 4)])
def test_complete_tree_when_budget_covers_all(depth_l, vocab, budget):
    """Golden test 4b: N >= V + ... + V^L gives the complete V-ary tree."""
    lp = log_softmax32(np.random.default_rng(1).normal(size=(ROWS, depth_l, vocab)))
    t = build_np(lp, budget)
    full = {p for d in range(1, depth_l + 1) for p in itertools.product(range(vocab), repeat=d)}
    n = n_prefixes(depth_l, vocab)
    for b in range(ROWS):
        assert set(token_paths(t["tokens"][b, : 1 + n], t["parents"][b, : 1 + n])) == full


def closure(parents: np.ndarray, valid: np.ndarray) -> np.ndarray:
    size = len(parents)
    vis = np.eye(size, dtype=bool)
    for i in range(size):
        j = i
        while valid[i] and parents[j] >= 0:
            j = parents[j]
            vis[i, j] = True
    return vis


@pytest.mark.parametrize("depth_l,vocab,budget", [(3, 2, 40), (4, 6, 40), (2, 1, 4)])
def test_ancestor_mask(depth_l, vocab, budget):
    """Golden test 5: vis == reflexive-transitive closure of parents; row sums = depth + 1; padding sees itself."""
    lp = log_softmax32(np.random.default_rng(2).integers(0, 3, size=(ROWS, depth_l, vocab)))
    t = build(jnp.zeros(ROWS, jnp.int32), jnp.asarray(lp), budget)
    vis = np.asarray(mask_fn(t))
    tn = {k: np.asarray(v) for k, v in t._asdict().items()}
    for b in range(ROWS):
        np.testing.assert_array_equal(vis[b], closure(tn["parents"][b], tn["valid"][b]))
        v = tn["valid"][b]
        np.testing.assert_array_equal(vis[b].sum(1)[v], tn["depths"][b][v] + 1)
        np.testing.assert_array_equal(vis[b].sum(1)[~v], 1)
    # a chain: lower-triangular
    chain = ddtree.chain_tree(jnp.zeros(2, jnp.int32), jnp.ones((2, 7), jnp.int32))
    np.testing.assert_array_equal(mask_fn(chain), np.broadcast_to(np.tri(8, dtype=bool), (2, 8, 8)))


@pytest.mark.parametrize("depth_l,vocab,budget", [(3, 2, 40), (4, 6, 40), (3, 3, 7)])
def test_walk_matches_reference(depth_l, vocab, budget):
    """Golden test 10: the walk equals a plain-Python walk over child maps; 1 <= path_len <= L+1."""

    @SETTINGS
    @given(tables(depth_l, vocab), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
    def run(logits, seed, p_follow):
        lp = log_softmax32(logits)
        t = build(jnp.zeros(ROWS, jnp.int32), jnp.asarray(lp), budget)
        tn = {k: np.asarray(v) for k, v in t._asdict().items()}
        # targets that often follow a child (long paths) and sometimes miss or point at padding tokens
        rng = np.random.default_rng(seed)
        target = rng.integers(0, vocab, size=(ROWS, 1 + budget)).astype(np.int32)
        for b, i in np.ndindex(ROWS, 1 + budget):
            kids = [j for j in range(1, 1 + budget) if tn["valid"][b, j] and tn["parents"][b, j] == i]
            if kids and rng.random() < p_follow:
                target[b, i] = tn["tokens"][b, rng.choice(kids)]
        path, path_len, bonus = (np.asarray(x) for x in walk_fn(t, jnp.asarray(target), depth_l))
        assert path.shape == (ROWS, depth_l + 1)
        for b in range(ROWS):
            ref_path, ref_bonus = walk_reference(tn["tokens"][b], tn["parents"][b], tn["valid"][b], target[b])
            assert 1 <= path_len[b] <= depth_l + 1
            assert path_len[b] == len(ref_path)
            np.testing.assert_array_equal(path[b, : path_len[b]], ref_path)
            assert (path[b, path_len[b] :] == -1).all()
            assert bonus[b] == ref_bonus

    run()


def test_chain_walk_is_longest_matching_prefix():
    rng = np.random.default_rng(3)
    depth_l, rows = 6, 64
    draft = rng.integers(0, 3, size=(rows, depth_l)).astype(np.int32)
    root = rng.integers(0, 3, size=rows).astype(np.int32)
    # target token at chain node i is the target's choice for draft position i+1
    follow = rng.random((rows, depth_l + 1)) < 0.8
    target = np.where(follow, np.pad(draft, ((0, 0), (0, 1))), rng.integers(0, 3, (rows, depth_l + 1))).astype(np.int32)
    tree = ddtree.chain_tree(jnp.asarray(root), jnp.asarray(draft))
    path, path_len, bonus = (np.asarray(x) for x in walk_fn(tree, jnp.asarray(target), depth_l))
    for b in range(rows):
        k = 0
        while k < depth_l and draft[b, k] == target[b, k]:
            k += 1
        assert path_len[b] == k + 1
        np.testing.assert_array_equal(path[b, : k + 1], np.arange(k + 1))
        assert bonus[b] == target[b, k]


def test_accept_greedy_uses_argmax():
    lp = log_softmax32(np.random.default_rng(4).normal(size=(ROWS, 3, 3)))
    t = build(jnp.zeros(ROWS, jnp.int32), jnp.asarray(lp), 7)
    logits = np.random.default_rng(5).normal(size=(ROWS, 8, 3)).astype(np.float32)
    got = ddtree.accept_greedy(t, jnp.asarray(logits), 3)
    want = walk_fn(t, jnp.asarray(logits.argmax(-1).astype(np.int32)), 3)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_surrogate_expected_acceptance():
    """Golden test 7 (Prop. 1): sum_{u in T} q(u) == E_{y~Q}[alpha_T(y)], alpha_T = deepest prefix of y in T."""
    depth_l, vocab, budget = 3, 3, 7
    lp = log_softmax32(np.random.default_rng(6).normal(size=(ROWS, depth_l, vocab)) * 1.5)
    t = build_np(lp, budget)
    rng = np.random.default_rng(7)
    n_samples = 100_000
    for b in range(ROWS):
        nodes = set(token_paths(t["tokens"][b], t["parents"][b]))
        probs = np.exp(lp[b].astype(np.float64))
        probs /= probs.sum(-1, keepdims=True)
        y = np.stack([rng.choice(vocab, size=n_samples, p=probs[d]) for d in range(depth_l)], 1)
        alpha = np.zeros(n_samples)
        for d in range(1, depth_l + 1):
            keys = [tuple(r) for r in y[:, :d]]
            alpha += np.array([k in nodes for k in keys])  # prefix-closed tree: alpha = # of prefixes in T
        expected = np.exp(t["scores"][b, 1:].astype(np.float64)).sum()
        assert abs(alpha.mean() - expected) < 5 * alpha.std() / np.sqrt(n_samples) + 1e-9


def test_batch_rows_are_independent():
    lp = log_softmax32(np.random.default_rng(8).integers(0, 3, size=(3, 4, 6)))
    root = np.array([11, 12, 13], np.int32)
    whole = build(jnp.asarray(root), jnp.asarray(lp), 13)
    for b in range(3):
        alone = build(jnp.asarray(root[b : b + 1]), jnp.asarray(lp[b : b + 1]), 13)
        for w, a in zip(whole, alone):
            np.testing.assert_array_equal(np.asarray(w)[b], np.asarray(a)[0])


@pytest.mark.slow
def test_build_tree_from_logits_and_bf16():
    """build_tree applies log_softmax in float32 itself; bf16 logits work; tie-free tables match the heap."""
    logits = np.random.default_rng(9).normal(size=(ROWS, 4, 6)).astype(np.float32) * 3
    lp = log_softmax32(logits)
    t = build_logits(jnp.zeros(ROWS, jnp.int32), jnp.asarray(logits), 13)
    for b in range(ROWS):
        ref = heap_tree(lp[b], 13)
        np.testing.assert_array_equal(np.asarray(t.tokens)[b, 1:], ref["tokens"])
        np.testing.assert_array_equal(np.asarray(t.parents)[b], ref["parents"])
        np.testing.assert_allclose(np.asarray(t.scores)[b, 1:], ref["scores"], rtol=1e-5, atol=1e-5)
    tb = ddtree.build_tree(jnp.zeros(ROWS, jnp.int32), jnp.asarray(logits, jnp.bfloat16), 13)
    assert tb.scores.dtype == jnp.float32 and bool(tb.valid.all())


@pytest.mark.parametrize("method", METHODS)
def test_negative_zero_log_probs(method):
    """-0.0 and +0.0 are equal to the heap; XLA's top_k orders -0.0 lower, which must not reorder a chain of
    probability-1 tokens (a child scoring +0.0 would otherwise beat its -0.0 parent)."""
    lp = np.array([[-0.0, -3.0, -np.inf], [0.0, -2.0, -np.inf], [-0.0, -1.0, -4.0]], np.float32)
    lp = np.broadcast_to(lp, (ROWS, 3, 3)).copy()
    t = build_np(lp, 10, method=method)
    ref = heap_tree(lp[0], 10)
    for b in range(ROWS):
        check_structure(t, b, lp[b], 10)
        np.testing.assert_array_equal(t["tokens"][b, 1:], ref["tokens"])
        np.testing.assert_array_equal(t["parents"][b], ref["parents"])


def test_top_k_breaks_ties_by_index():
    """The builder's tie-break rests on lax.top_k(is_stable=True) returning equal values in index order."""
    x = jnp.asarray(np.random.default_rng(10).integers(0, 3, size=(3, 5000)).astype(np.float32))
    vals, idx = jax.lax.top_k(x, 4000)
    vals, idx = np.asarray(vals), np.asarray(idx)
    same = vals[:, 1:] == vals[:, :-1]
    assert (np.diff(vals, axis=1) <= 0).all() and (np.diff(idx, axis=1)[same] > 0).all()


def test_the_builders_agree_past_the_counting_bound():
    """Above ``COUNT_MAX`` "auto" sorts; forced counting gives the same tree there (budget 48 over 40 tokens:
    1920 candidates a depth), and a budget whose ranks do not fit the packed digits is refused by name."""
    lp = log_softmax32(np.random.default_rng(3).integers(0, 3, size=(2, 3, 40)).astype(np.float32))
    root = np.zeros(2, np.int32)
    a, c = build_np(lp, 48, root, method="auto"), build_np(lp, 48, root, method="count")
    for key in a:
        np.testing.assert_array_equal(a[key], c[key])
    with pytest.raises(ValueError, match="packs ranks"):
        build_np(log_softmax32(np.zeros((1, 2, 80), np.float32)), 70, np.zeros(1, np.int32), method="count")
    with pytest.raises(ValueError, match="method must be"):
        build_np(lp, 4, root, method="heap")
