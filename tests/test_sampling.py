"""Sampling losslessness of sample-and-walk on DDTree trees, on a toy target with known conditionals.

The toy target is an order-2 Markov chain over 3 tokens with an explicit table P[prev2, prev1] -> next. The
drafter's marginals are fixed and deliberately wrong. Each round builds the best-first tree, draws one target
sample per node from the node's true conditional, and walks. The empirical distribution of the first three
emitted tokens must match the chain's (chi-square); Leviathan-style min(1, p/q) acceptance of the drafter's
deterministic top-1 chain is shown to fail the same test, as the DDTree paper warns ([ddtree-accept] in
docs/sources.md).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.decoding import ddtree

V, L, ROWS = 3, 2, 20000
CHI2_CRIT_26DF_P001 = 54.05          # 99.9% quantile of chi-square with 26 degrees of freedom
P = np.array([[[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]],
              [[0.3, 0.3, 0.4], [0.7, 0.2, 0.1], [0.25, 0.5, 0.25]],
              [[0.5, 0.1, 0.4], [0.1, 0.8, 0.1], [0.3, 0.6, 0.1]]], np.float32)
Q = np.array([[0.1, 0.2, 0.7], [0.8, 0.1, 0.1]], np.float32)      # drafter marginals for depths 1..L
START = (0, 1)                                                     # (t_-2, t_-1): t_-1 is the root


def true_distribution():
    out = np.zeros((V,) * 3)
    for a, b, c in itertools.product(range(V), repeat=3):
        out[a, b, c] = P[START[0], START[1], a] * P[START[1], a, b] * P[a, b, c]
    return out


def chi2(samples):
    counts = np.zeros((V,) * 3)
    np.add.at(counts, tuple(samples.T), 1)
    expected = true_distribution() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


@functools.partial(jax.jit, static_argnames=("width",))
def tree_round(key, prev2, root, budget_logits, width=6):
    # Built at 6 nodes and cut to `width`, as the auto policy verifies a prefix of the best-first order.
    tree = ddtree.truncate(ddtree.build_tree(root, budget_logits, 6), width)
    parent_tok = jnp.where(tree.parents >= 0, jnp.take_along_axis(tree.tokens, jnp.maximum(tree.parents, 0), 1),
                           prev2[:, None])
    probs = jnp.asarray(P)[parent_tok, tree.tokens]                                 # [rows, 1+N, V]
    target = jax.random.categorical(key, jnp.log(probs), axis=-1)
    path, path_len, bonus = ddtree.walk(tree, target, L)
    tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), 1)
    emitted = jnp.where(jnp.arange(L + 1) == (path_len - 1)[:, None], bonus[:, None],
                        jnp.concatenate([tokens[:, 1:], tokens[:, :1]], 1))
    return emitted, path_len


@jax.jit
def leviathan_round(key, prev2, root):
    """min(1, p/q) on the drafter's top-1 chain, residual resampling on rejection (biased here)."""
    draft = jnp.argmax(jnp.asarray(Q), -1)                                          # deterministic drafts
    k_acc, k_res, k_bonus = jax.random.split(key, 3)
    ctx = (prev2, root)
    emitted, n, alive = [], jnp.zeros_like(root), jnp.ones(root.shape, bool)
    u = jax.random.uniform(k_acc, (root.shape[0], L))
    for d in range(L):
        p = jnp.asarray(P)[ctx[0], ctx[1]]
        q = jnp.asarray(Q)[d]
        accept = u[:, d] < jnp.minimum(1.0, p[:, draft[d]] / q[draft[d]])
        residual = jnp.maximum(p - q, 0.0)
        resample = jax.random.categorical(jax.random.fold_in(k_res, d), jnp.log(residual / residual.sum(-1, keepdims=True)))
        tok = jnp.where(accept, draft[d], resample)
        emitted.append(jnp.where(alive, tok, -1))
        n = n + alive
        alive = alive & accept
        ctx = (ctx[1], jnp.full_like(root, draft[d]))
    bonus = jax.random.categorical(k_bonus, jnp.log(jnp.asarray(P)[ctx[0], ctx[1]]))
    emitted.append(jnp.where(alive, bonus, -1))
    n = n + alive
    return jnp.stack(emitted, 1), n


def first_three(round_fn, seed):
    key = jax.random.key(seed)
    prev2 = jnp.full((ROWS,), START[0]); root = jnp.full((ROWS,), START[1])
    out = [[] for _ in range(ROWS)]
    while min(map(len, out)) < 3:
        key, sub = jax.random.split(key)
        emitted, n = jax.device_get(round_fn(sub, prev2, root))
        for r in range(ROWS):
            out[r].extend(emitted[r, :n[r]].tolist())
        last2 = np.array([[row[-2] if len(row) > 1 else int(root[i]), row[-1]] for i, row in enumerate(out)])
        prev2, root = jnp.asarray(last2[:, 0]), jnp.asarray(last2[:, 1])
    return np.array([row[:3] for row in out])


SLOW = pytest.mark.slow


@pytest.mark.parametrize("width", [pytest.param(6, marks=SLOW), pytest.param(4, marks=SLOW), pytest.param(2, marks=SLOW),
                                   pytest.param(1, marks=SLOW), 0])
def test_sample_and_walk_matches_the_target_distribution(width):
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(Q)), (ROWS, L, V))
    samples = first_three(lambda k, p2, r: tree_round(k, p2, r, logits, width=width), seed=0)
    assert chi2(samples) < CHI2_CRIT_26DF_P001


@pytest.mark.slow
def test_min_p_over_q_acceptance_is_biased_on_the_same_test():
    samples = first_three(leviathan_round, seed=0)
    assert chi2(samples) > 10 * CHI2_CRIT_26DF_P001
