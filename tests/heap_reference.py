"""Plain-Python references for the DDTree tests: the paper's heap (Algorithm 1), brute force, and the walk.

Independent of kimi_jax: numpy and heapq only.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np


def log_softmax32(logits: np.ndarray) -> np.ndarray:
    """float32 log-softmax over the last axis; every entry <= 0 (the max entry's log-sum term is >= 0)."""
    x = np.asarray(logits, np.float32)
    m = np.max(x, axis=-1, keepdims=True)
    s = x - m
    with np.errstate(divide="ignore"):
        return (s - np.log(np.sum(np.exp(s), axis=-1, keepdims=True))).astype(np.float32)


def heap_tree(lp: np.ndarray, budget: int) -> dict:
    """DDTree Algorithm 1 on one table lp [L, V] (float32 log-probs).

    Heap entries are (-score, rank_tuple, parent_node, depth, rank, parent_score); heapq pops the smallest,
    so equal scores come out in rank-tuple order (Python tuple order). Ranks within a depth come from a
    stable descending sort (lower token id first among equal log-probs). Scores are float32 running sums
    parent_score + lp, always added in depth order; the paper's sibling update s - lp[r] + lp[r+1] is the
    same number in exact arithmetic, and this form keeps it bit-identical to a prefix's own sum.
    Returns lists for nodes 1..n (root excluded) and parents in the 1+n numbering (parents[0] = -1).
    """
    lp = np.asarray(lp, np.float32)
    depth_l, vocab = lp.shape
    out = dict(tokens=[], parents=[-1], depths=[], scores=[], ranks=[])
    if budget <= 0 or depth_l == 0:
        return out
    k = min(budget, vocab)
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    top_lp = np.take_along_axis(lp, order, axis=1)
    zero = np.float32(0.0)
    heap = [(-(zero + top_lp[0, 0]), (0,), 0, 1, 0, zero)]
    while heap and len(out["tokens"]) < budget:
        neg, ranks, par, d, r, par_score = heapq.heappop(heap)
        score = -neg
        out["tokens"].append(int(order[d - 1, r]))
        out["parents"].append(par)
        out["depths"].append(d)
        out["scores"].append(np.float32(score))
        out["ranks"].append(ranks)
        idx = len(out["tokens"])
        if r + 1 < k:  # next sibling
            heapq.heappush(heap, (-(par_score + top_lp[d - 1, r + 1]), ranks[:-1] + (r + 1,), par, d, r + 1, par_score))
        if d < depth_l:  # first child
            heapq.heappush(heap, (-(score + top_lp[d, 0]), ranks + (0,), idx, d + 1, 0, score))
    return out


def all_prefix_scores(lp: np.ndarray) -> np.ndarray:
    """log q(u) (float64) of every non-empty prefix u, by enumeration: V + V^2 + ... + V^L values."""
    lp = np.asarray(lp, np.float64)
    depth_l, vocab = lp.shape
    scores = []
    for d in range(1, depth_l + 1):
        for toks in itertools.product(range(vocab), repeat=d):
            scores.append(sum(lp[i, t] for i, t in enumerate(toks)))
    return np.array(scores, np.float64)


def token_paths(tokens, parents) -> list[tuple]:
    """Token path (root excluded) of every node 1..n, from flat tokens/parents in the 1+n numbering."""
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (int(tokens[i]),))
    return paths[1:]


def walk_reference(tokens, parents, valid, target_tokens) -> tuple[list[int], int]:
    """Follow the child whose token equals the target token at the current node; returns (path, bonus)."""
    children = [dict() for _ in tokens]
    for i in range(1, len(tokens)):
        if valid[i]:
            children[parents[i]][int(tokens[i])] = i
    path = [0]
    while int(target_tokens[path[-1]]) in children[path[-1]]:
        path.append(children[path[-1]][int(target_tokens[path[-1]])])
    return path, int(target_tokens[path[-1]])
