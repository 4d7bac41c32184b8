"""DDTree trees under an automaton (structured output): the builder keeps exactly the most probable prefixes the
automaton allows, in the heap's order, and ``node_states`` replays each node's path. References: brute force over
every rank tuple in plain Python, and a plain-Python replay of the automaton."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from heap_reference import log_softmax32, token_paths
from kimi_jax.decoding import ddtree


def random_automaton(rng, states: int, vocab: int, refuse: float) -> np.ndarray:
    """next_state [S, V] int32, -1 where a token is refused (state 0 the start)."""
    table = rng.integers(0, states, size=(states, vocab)).astype(np.int32)
    table[rng.random((states, vocab)) < refuse] = -1
    return table


def stepper(table: np.ndarray):
    t = jnp.asarray(table)
    return lambda states, tokens: jnp.where(states >= 0, t[jnp.maximum(states, 0), tokens], -1)


def replay(table, start: int, path) -> int:
    s = start
    for tok in path:
        s = -1 if s < 0 else int(table[s, tok])
    return s


def brute_force(lp: np.ndarray, budget: int, table, start: int) -> list[tuple]:
    """The `budget` best (score, rank tuple) prefixes whose ranks lie in each depth's top-K and whose path the
    automaton allows, in the heap's order: score descending, then rank tuple (Python's tuple order)."""
    depth_l, vocab = lp.shape
    k = min(budget, vocab)
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    found = []
    for d in range(1, depth_l + 1):
        for ranks in itertools.product(range(k), repeat=d):
            toks = tuple(int(order[i, r]) for i, r in enumerate(ranks))
            if replay(table, start, toks) < 0:
                continue
            score = np.float32(0.0)
            for i, r in enumerate(ranks):
                score = np.float32(score + lp[i, order[i, r]])
            found.append((-score, ranks, toks))
    found.sort(key=lambda x: (x[0], x[1]))
    return [(toks, -neg) for neg, _, toks in found[:budget]]


@pytest.mark.parametrize("method", ("count", "sort"))
@pytest.mark.parametrize("depth_l,vocab,budget,refuse", [(3, 5, 7, 0.4)] + [   # one case in the fast loop
    pytest.param(*case, marks=pytest.mark.slow) for case in [(2, 6, 12, 0.5), (4, 3, 9, 0.3), (3, 4, 5, 0.0)]])
def test_constrained_tree_is_the_best_allowed_prefixes(depth_l, vocab, budget, refuse, method):
    rng = np.random.default_rng(depth_l * 100 + vocab)
    rows = 4
    table = random_automaton(rng, 5, vocab, refuse)
    lp = log_softmax32(rng.normal(size=(rows, depth_l, vocab)) * 2)
    starts = np.array([0, 1, 2, 3], np.int32)
    roots = np.arange(rows, dtype=np.int32)
    tree = jax.jit(ddtree.build_tree_from_log_probs, static_argnums=(2, 3), static_argnames="method")(
        jnp.asarray(roots), jnp.asarray(lp), budget, stepper(table), jnp.asarray(starts), method=method)
    states = ddtree.node_states(tree, stepper(table), jnp.asarray(starts), depth_l)
    for b in range(rows):
        want = brute_force(lp[b], budget, table, int(starts[b]))
        valid = np.asarray(tree.valid[b])
        n = int(valid.sum()) - 1
        assert n == len(want) and valid[1:1 + n].all() and not valid[1 + n:].any()
        got = token_paths(np.asarray(tree.tokens[b])[:1 + n], np.asarray(tree.parents[b])[:1 + n])
        assert got == [w[0] for w in want]
        np.testing.assert_array_equal(np.asarray(tree.scores[b])[1:1 + n], np.array([w[1] for w in want]))
        assert [int(s) for s in states[b, 1:1 + n]] == [replay(table, int(starts[b]), p) for p in got]
        assert int(states[b, 0]) == starts[b] and (np.asarray(states[b, 1 + n:]) == -1).all()


def test_unconstrained_automaton_gives_the_plain_tree():
    """An automaton that refuses nothing changes nothing: same tree as the plain builder."""
    rng = np.random.default_rng(7)
    lp = jnp.asarray(log_softmax32(rng.normal(size=(3, 4, 6))))
    roots = jnp.zeros(3, jnp.int32)
    plain = ddtree.build_tree_from_log_probs(roots, lp, 10)
    free = ddtree.build_tree_from_log_probs(roots, lp, 10, stepper(np.zeros((1, 6), np.int32)),
                                            jnp.zeros(3, jnp.int32))
    for a, b in zip(plain, free):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_first_allowed_ranks_depth_one_among_the_allowed_tokens():
    """With K smaller than the vocabulary, depth 1's top-K is taken among the tokens the root state allows, so a
    root whose best drafts are refused still gets a full first level."""
    vocab, budget = 8, 3
    table = np.full((1, vocab), -1, np.int32)
    table[0, 5:] = 0                                             # only tokens 5, 6, 7 allowed, the least likely
    logits = jnp.asarray(-np.arange(vocab, dtype=np.float32))[None, None, :]
    start = jnp.zeros(1, jnp.int32)
    without = ddtree.build_tree(jnp.zeros(1, jnp.int32), logits, budget, stepper(table), start)
    assert int(without.valid.sum()) == 1                         # top-3 are 0, 1, 2: all refused
    allowed = jnp.asarray(table[0] >= 0)[None]
    tree = ddtree.build_tree(jnp.zeros(1, jnp.int32), logits, budget, stepper(table), start, first_allowed=allowed)
    assert tree.tokens[0, 1:].tolist() == [5, 6, 7] and bool(tree.valid.all())
