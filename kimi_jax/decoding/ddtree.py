"""DDTree draft trees on the device: build, ancestor mask, acceptance walk.

Everything here is pure JAX with static shapes, batched over a leading dim B, and jittable: no host round
trips and no Python loops over data (the loops below run over the static depth L or over log2 of the size).
Bracketed tags refer to entries of docs/sources.md.

Tree building ([ddtree-build])
------------------------------
The drafter gives L per-position distributions q_1..q_L. The best tree of N nodes under the surrogate
Q(y) = prod_d q_d(y_d) is the set of the N most probable non-empty prefixes (Prop. 2 of the DDTree paper).
The paper finds them with a best-first heap over rank tuples (Algorithm 1); we compute the same set, in the
same order, with static shapes:

  1. lp = log_softmax(logits) in float32; K = min(N, V); per depth keep the top-K tokens (lax.top_k), so a
     prefix is a rank tuple (r_1..r_d), r_i in [0, K).
  2. Depth 1 candidates: the K top tokens. Depth d+1 candidates: each of the N prefixes kept at depth d times
     the K top tokens of depth d+1, score = parent score + lp (a float32 running sum, always in depth order).
     Keep the best N of those N*K candidates. The N best prefixes of every depth are among the kept ones: a
     prefix's parent ranks no worse than the prefix itself, and the global top-N is closed under parents.
  3. Take the global top-N over the L*N kept prefixes. Because a parent never scores below its child (lp <= 0)
     and sorts first on ties (below), the result is prefix-closed and lists every parent before its children.

Tie-break (matches the heap). Python's heapq pops entries (-score, rank_tuple, ...) in order of score
descending, then rank tuple ascending in Python's tuple order (a proper prefix sorts before its extensions).
We use exactly that total order, written `≺`. Ranks among equal log-probs within one depth follow lax.top_k:
the lower token id gets the lower rank. Floats are never perturbed; the tie-break is positional instead:
lax.top_k(..., is_stable=True) returns equal values in index order, so it is enough to lay candidates out
in rank-tuple order before each top_k:
  - within a depth, the kept prefixes are stored sorted by rank tuple, so candidate (parent slot p, rank r)
    sits at flat index p*K + r, which is its rank-tuple order among the depth's candidates;
  - across depths, the kept prefixes form a tree (every kept parent is kept) and Python's tuple order on
    rank tuples is the pre-order (depth-first, children by rank) of that tree; we compute each node's
    pre-order number from subtree sizes and lay the L*N nodes out by it for the final top_k.
Scores are compared as the same float32 values the heap reference computes (parent + lp in float32), so
ties are exact, not approximate.

Cost: log_softmax + top_k over [L, V]; then per depth one top_k over N*K candidates, i.e. O(L*N*K) work with
K = min(N, V) (1M candidates per depth at N = 1024); pre-order and the final top_k over L*N are O(L*N).

Two builders give that same tree (``method``). "sort" is the above: per depth a top_k and a sort, pre-order
numbers from subtree sizes (scatter-adds, cumsums), five scatters a depth into the pre-order layout, a final
top_k. On a GPU that is ~100 small kernels at N = 16, L = 7 (docs/gpu_overhead.md). "count" selects by counting
instead: a candidate's place is the number of candidates ahead of it in the same order (a [M, M] compare summed
per candidate), and a one-hot reduction gathers the first N. Levels are kept in score order, and each node
carries its rank tuple packed into int32 words (6 bits a rank, most significant first, ranks + 1 so that a
prefix sorts before its extensions), so ties compare by tuple across depths without pre-order numbers: 3 GPU
kernels a depth and ~4 for the final order. Its work is O(L*(N*K)^2 + (L*N)^2), so "auto" counts only up to
``COUNT_MAX`` (1024) candidates a depth and kept nodes in all, i.e. budgets up to 32; above, it sorts.

Padding: when fewer than N prefixes exist (V + V^2 + ... + V^L < N) the tail slots have valid=False,
token 0, parent 0, depth 0 and score -inf. They appear after every valid node. The engine masks them out of
attention and the walk never enters them.

Acceptance ([ddtree-accept]): `walk` follows, from the root, the child whose token equals the
target's token at the current node, and stops at the first node with no such child; that node's target
token is the bonus. Greedy decoding passes the per-node argmax (`accept_greedy`), sampling passes one
independent target sample per node; the walk is identical, which is what makes sampling lossless. It is
computed without stepping: the path is the nodes whose every ancestor (and itself) is its parent's target
token, found by pointer jumping (O(N log N)); L, the path's length bound, is a static argument because the
tree's shape only bounds the depth by N.

The ancestor mask uses pointer jumping, ceil(log2(1+N)) rounds of whole-row gathers (O(N^2 log N) bits).

Constrained trees (structured output, ``kimi_jax.text.grammar``): an automaton ``step(states, tokens) -> states``
(-1 = dead: the token is not allowed there) with each row's state after its committed text. The builder then
keeps only candidates whose step from their parent's state is alive, so every node of the tree is a prefix the
grammar allows (the per-depth top-K is taken first, so a depth whose best K tokens the grammar refuses yields
fewer nodes; depth 1 can be given the exact allowed set, ``first_allowed``). ``node_states`` gives each node's
state, which verify uses to mask the target's distribution at that node. Losslessness does not depend on the
restriction: the target samples only allowed tokens, so a refused node could never be accepted; the
restriction only stops the budget going to such nodes.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Tree(NamedTuple):
    """A draft tree, batched. Arrays have shape [B, 1+N]; index 0 is the root (the previous bonus token)."""

    tokens: jax.Array  # int32; tokens[:, 0] = root token
    parents: jax.Array  # int32; parents[:, 0] = -1, parents[:, i] < i
    depths: jax.Array  # int32; root 0
    scores: jax.Array  # float32; log q(prefix), root 0.0, padding -inf
    valid: jax.Array  # bool; False for padding slots


def root_only(root: jax.Array, budget: int) -> Tree:
    """Root plus `budget` padding slots (N == 0, no draft position, or a plain AR step)."""
    b = root.shape[0]
    pad_i = jnp.zeros((b, budget), jnp.int32)
    return Tree(
        tokens=jnp.concatenate([root.astype(jnp.int32)[:, None], pad_i], axis=1),
        parents=jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), pad_i], axis=1),
        depths=jnp.zeros((b, 1 + budget), jnp.int32),
        scores=jnp.concatenate(
            [jnp.zeros((b, 1), jnp.float32), jnp.full((b, budget), -jnp.inf, jnp.float32)], axis=1
        ),
        valid=jnp.concatenate([jnp.ones((b, 1), bool), jnp.zeros((b, budget), bool)], axis=1),
    )


def ar_tree(root: jax.Array, pad: bool) -> Tree:
    """A plain decoding step's tree: the root alone, or with ``pad`` the root and one padding slot that repeats its
    token (``methods.pads_one_row``: one row on a GPU). XLA lowers a matmul of one row as a reduction, two kernels
    at K2.6's widths, and one row's norms miss the fused normalization kernel: the 3-layer K2.6 AR step compiled
    for 8 H200s launched 143 GPU ops where the same step over two rows launches 114 (docs/gpu_overhead.md). The
    padding row is invalid (no row sees it, the walk never enters it), and with the root's token it routes to the
    root's experts, so it reads no weights the root does not."""
    tree = root_only(root, 1 if pad else 0)
    return tree._replace(tokens=jnp.broadcast_to(tree.tokens[:, :1], tree.tokens.shape))


Step = Callable[[jax.Array, jax.Array], jax.Array]      # (states [B, n], tokens [B, n]) -> states; -1 = dead
TopK = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]   # jax.lax.top_k's contract


def build_tree(root: jax.Array, draft_logits: jax.Array, budget: int, step: Step | None = None,
               root_state: jax.Array | None = None, first_allowed: jax.Array | None = None,
               top_k: TopK = jax.lax.top_k) -> Tree:
    """The `budget` most probable prefixes of the draft, as a Tree. root [B] int, draft_logits [B, L, V].
    With ``step`` and ``root_state`` [B], only prefixes the automaton allows (module doc); ``first_allowed``
    [B, V] bool: the tokens root_state allows, applied before depth 1's top-K. ``top_k``: the vocabulary's top-K
    (``kimi_jax.model.vocab.top_k`` where a mesh splits the vocabulary)."""
    log_probs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    if first_allowed is not None and log_probs.shape[1]:      # budget 0 drafts no depth
        log_probs = log_probs.at[:, 0].set(jnp.where(first_allowed, log_probs[:, 0], -jnp.inf))
    return build_tree_from_log_probs(root, log_probs, budget, step, root_state, top_k=top_k)


# Up to this many candidates per depth (N x K) and kept nodes (L x N), "auto" builds by counting (module doc)
COUNT_MAX = 1024
_DIGIT_BITS, _DIGITS_PER_WORD = 6, 5    # a rank tuple packed into int32 words: rank + 1 < 64 when K <= 32


def build_tree_from_log_probs(root: jax.Array, log_probs: jax.Array, budget: int, step: Step | None = None,
                              root_state: jax.Array | None = None, method: str = "auto",
                              top_k: TopK = jax.lax.top_k) -> Tree:
    """`build_tree` on normalised log-probs [B, L, V] (float32, every entry <= 0 so that a parent never scores
    below its child). Tests call this directly to feed the heap reference bit-identical log-probs. ``method``:
    "sort", "count", or "auto": counting up to ``COUNT_MAX`` (module doc)."""
    if method not in ("auto", "sort", "count"):
        raise ValueError(f"method must be 'auto', 'sort' or 'count', got {method!r}")
    n = int(budget)
    bsz, depth_l, vocab = log_probs.shape
    if n <= 0 or depth_l == 0:
        return root_only(root, max(n, 0))
    k = min(n, vocab)
    # Top-K tokens per depth, ties: lower id first. Rows flattened to 2-D: in this program XLA:CPU lowered
    # the 3-D top_k to a full sort over V instead of its TopK kernel (20x slower at V = 163840).
    top_lp, top_id = top_k(log_probs.astype(jnp.float32).reshape(bsz * depth_l, vocab), k)
    top_lp = top_lp.reshape(bsz, depth_l, k)
    top_id = top_id.reshape(bsz, depth_l, k)
    # XLA's top_k ranks -0.0 below +0.0 (total order); a heap treats them as equal. Only a probability-1
    # token can have log-prob 0, so normalising the sign after selection is enough.
    top_lp = jnp.where(top_lp == 0.0, 0.0, top_lp)
    if method == "count" or (method == "auto" and max(n * k, depth_l * n) <= COUNT_MAX):
        if k >= 1 << _DIGIT_BITS:
            raise ValueError(f"counting packs ranks into {_DIGIT_BITS} bits: budget {n} > {(1 << _DIGIT_BITS) - 1}")
        tokens, parents, depths, scores, valid = _tree_by_counting(top_lp, top_id, n, step, root_state)
    else:
        tokens, parents, depths, scores, valid = _tree_by_sorting(top_lp, top_id, n, step, root_state)
    return Tree(
        tokens=jnp.concatenate([root.astype(jnp.int32)[:, None], jnp.where(valid, tokens, 0)], axis=1),
        parents=jnp.concatenate([jnp.full((bsz, 1), -1, jnp.int32), jnp.where(valid, parents, 0)], axis=1),
        depths=jnp.concatenate([jnp.zeros((bsz, 1), jnp.int32), jnp.where(valid, depths, 0)], axis=1),
        scores=jnp.concatenate([jnp.zeros((bsz, 1), jnp.float32), jnp.where(valid, scores, -jnp.inf)], axis=1),
        valid=jnp.concatenate([jnp.ones((bsz, 1), bool), valid], axis=1),
    )


def _candidates(par_score, par_valid, par_state, lp, ids, n: int, step: Step | None):
    """One depth's candidates, each parent slot's K children in rank order, flattened to [B, max(N, P*K)]:
    (score, valid, token, state or None, parent slot, rank). The padding (fewer than N candidates: a tiny
    vocab at a shallow depth) is invalid, -inf, and points at the last parent."""
    bsz, n_par = par_score.shape
    k = lp.shape[1]
    flat = lambda a: jnp.broadcast_to(a, (bsz, n_par, k)).reshape(bsz, n_par * k)  # noqa: E731
    score = flat(par_score[:, :, None] + lp[:, None, :])
    valid = flat(par_valid[:, :, None])
    token = flat(ids[:, None, :])
    state = None
    if step is not None:        # a candidate the automaton refuses after its parent is no candidate
        state = step(flat(par_state[:, :, None]), token)
        valid = valid & (state >= 0)
    score = jnp.where(valid, score, -jnp.inf)
    parent = flat(jnp.arange(n_par, dtype=jnp.int32)[None, :, None])
    rank = flat(jnp.arange(k, dtype=jnp.int32)[None, None, :])
    pad = max(n - n_par * k, 0)
    fills = (-jnp.inf, False, 0, -1, n_par - 1, 0)
    return tuple(None if a is None else jnp.pad(a, ((0, 0), (0, pad)), constant_values=c)
                 for a, c in zip((score, valid, token, state, parent, rank), fills))


def _tree_by_sorting(top_lp, top_id, n: int, step: Step | None, root_state):
    """Steps 2-3 with top_k and sorts (module doc): levels in rank-tuple order, pre-order numbers, one top_k."""
    bsz, depth_l, _ = top_lp.shape
    rows = jnp.arange(bsz)[:, None]
    levels = []  # per depth: (score, valid, parent slot in previous level, token), each [B, N]
    par_score = jnp.zeros((bsz, 1), jnp.float32)
    par_valid = jnp.ones((bsz, 1), bool)
    par_state = None if step is None else root_state.astype(jnp.int32)[:, None]
    for d in range(depth_l):
        cand, cand_valid, cand_token, cand_state, cand_parent, _ = _candidates(
            par_score, par_valid, par_state, top_lp[:, d], top_id[:, d], n, step)
        # Stable top_k: among equal scores the lower flat index, i.e. the smaller rank tuple, wins; and a
        # valid -inf candidate beats the invalid ones, which all lie further right.
        _, idx = jax.lax.top_k(cand, n)
        idx = jnp.sort(idx, axis=-1)  # back to rank-tuple order for the next depth
        take = lambda a: jnp.take_along_axis(a, idx, axis=1)  # noqa: E731
        levels.append((take(cand), take(cand_valid), take(cand_parent), take(cand_token)))
        par_score, par_valid = levels[-1][:2]
        if step is not None:
            par_state = take(cand_state)

    # Pre-order numbers of the kept forest (root = 0, nodes 1..M), which order nodes exactly as Python orders
    # their rank tuples. Subtree sizes bottom-up, then each node's number is its parent's + 1 + the sizes of its
    # earlier siblings' subtrees (siblings are contiguous and rank-ordered in a level).
    sizes = [None] * depth_l
    sizes[-1] = levels[-1][1].astype(jnp.int32)
    for d in range(depth_l - 2, -1, -1):
        below = jnp.zeros((bsz, n), jnp.int32).at[rows, levels[d + 1][2]].add(sizes[d + 1])
        sizes[d] = jnp.where(levels[d][1], 1 + below, 0)
    pre = []
    par_pre = jnp.zeros((bsz, 1), jnp.int32)
    for d in range(depth_l):
        _, valid, parent, _ = levels[d]
        before_here = jnp.cumsum(sizes[d], axis=1) - sizes[d]  # sizes of rank-earlier nodes in this level
        if d == 0:
            before_group = 0
        else:  # part of `before_here` under rank-earlier parents = their descendants at depth >= d
            desc = sizes[d - 1] - levels[d - 1][1].astype(jnp.int32)
            before_group = jnp.take_along_axis(jnp.cumsum(desc, axis=1) - desc, parent, axis=1)
        p = jnp.take_along_axis(par_pre, parent, axis=1) + 1 + before_here - before_group
        pre.append(jnp.where(valid, p, -1))
        par_pre = p

    # Lay all kept nodes out by pre-order (slot 0 = root, unused slots invalid/-inf after slot M) and take the
    # global top-N; stable top_k makes equal scores come out in rank-tuple order.
    size = 1 + depth_l * n
    flat_score = jnp.full((bsz, size), -jnp.inf, jnp.float32)
    flat_valid = jnp.zeros((bsz, size), bool)
    flat_token = jnp.zeros((bsz, size), jnp.int32)
    flat_depth = jnp.zeros((bsz, size), jnp.int32)
    flat_parent = jnp.zeros((bsz, size), jnp.int32)  # parent's pre-order number
    prev_pre = jnp.zeros((bsz, 1), jnp.int32)
    for d in range(depth_l):
        score, valid, parent, token = levels[d]
        at = jnp.where(valid, pre[d], size)  # invalid nodes go out of range and are dropped
        flat_score = flat_score.at[rows, at].set(score, mode="drop")
        flat_valid = flat_valid.at[rows, at].set(valid, mode="drop")
        flat_token = flat_token.at[rows, at].set(token, mode="drop")
        flat_depth = flat_depth.at[rows, at].set(d + 1, mode="drop")
        flat_parent = flat_parent.at[rows, at].set(jnp.take_along_axis(prev_pre, parent, axis=1), mode="drop")
        prev_pre = pre[d]
    _, sel = jax.lax.top_k(flat_score[:, 1:], n)
    sel = sel + 1  # pre-order numbers of the chosen nodes, in final order

    # Renumber parents: pre-order number -> final index (root 0 -> 0; padding has parent pre 0 -> 0).
    final_index = jnp.zeros((bsz, size), jnp.int32).at[rows, sel].set(jnp.arange(1, n + 1, dtype=jnp.int32))
    take = lambda a: jnp.take_along_axis(a, sel, axis=1)  # noqa: E731
    return (take(flat_token), jnp.take_along_axis(final_index, take(flat_parent), axis=1), take(flat_depth),
            take(flat_score), take(flat_valid))


def _tree_by_counting(top_lp, top_id, n: int, step: Step | None, root_state):
    """Steps 2-3 without sorts or scatters (module doc): every selection is a count of the candidates ahead in
    the heap's order, each node carrying its rank tuple packed into int32 words, so that levels can be kept in
    score order and nodes of different depths compared directly."""
    bsz, depth_l, _ = top_lp.shape
    words = -(-depth_l // _DIGITS_PER_WORD)
    par = dict(score=jnp.zeros((bsz, 1), jnp.float32), valid=jnp.ones((bsz, 1), bool),
               state=None if step is None else root_state.astype(jnp.int32)[:, None],
               **{f"key{w}": jnp.zeros((bsz, 1), jnp.int32) for w in range(words)})
    kept = []                      # per depth, the N best in score order: dicts of [B, N]
    for d in range(depth_l):
        score, valid, token, state, parent, rank = _candidates(
            par["score"], par["valid"], par["state"], top_lp[:, d], top_id[:, d], n, step)
        key = [jnp.take_along_axis(par[f"key{w}"], parent, axis=1) for w in range(words)]
        key[d // _DIGITS_PER_WORD] += (rank + 1) << (_DIGIT_BITS * (_DIGITS_PER_WORD - 1 - d % _DIGITS_PER_WORD))
        if d == 0 and step is None:     # the root's children, top_k's order: already the heap's (3 kernels less)
            pick = lambda a: a  # noqa: E731
        else:
            place = _places(score, valid, key)
            pick = _picker(place[:, None, :] == jnp.arange(n)[None, :, None])
        par = dict(score=pick(score), valid=pick(valid), state=None if state is None else pick(state),
                   token=pick(token), parent=pick(parent), **{f"key{w}": pick(a) for w, a in enumerate(key)})
        kept.append(par)
    # Every kept node of every depth; the final tree is the first N in the same order
    flat = lambda f: jnp.concatenate([lv[f] for lv in kept], axis=1)  # noqa: E731
    score, valid, token = flat("score"), flat("valid"), flat("token")
    depth = jnp.repeat(jnp.arange(1, depth_l + 1, dtype=jnp.int32), n)
    place = _places(score, valid, [flat(f"key{w}") for w in range(words)])
    # a depth-d node's parent is slot p of depth d - 1 (flat index (d - 2) N + p); depth 1's is the root
    parent_at = jnp.maximum(flat("parent") + (depth - 2) * n, 0)
    parent = jnp.where(depth == 1, 0, jnp.take_along_axis(place, parent_at, axis=1) + 1)
    pick = _picker(place[:, None, :] == jnp.arange(n)[None, :, None])
    return pick(token), pick(parent), pick(jnp.broadcast_to(depth, score.shape)), pick(score), pick(valid)


def _places(score, valid, key):
    """Each node's place [B, M] in the heap's order: valid first, then score descending, then rank tuple (its
    packed ``key``, int32 words [B, M] most significant first); invalid ones by index. A permutation of 0..M-1:
    valid nodes' tuples differ."""
    i = jnp.arange(score.shape[1])
    key_before = jnp.zeros((*score.shape, score.shape[1]), bool)      # [B, node, other]: other's key < node's
    key_equal = jnp.ones((*score.shape, score.shape[1]), bool)
    for word in key:
        mine, other = word[:, :, None], word[:, None, :]
        key_before = key_before | (key_equal & (other < mine))
        key_equal = key_equal & (other == mine)
    mine, other = score[:, :, None], score[:, None, :]
    both = valid[:, :, None] & valid[:, None, :]
    ahead = jnp.where(both, (other > mine) | ((other == mine) & key_before),
                      jnp.where(valid[:, None, :] != valid[:, :, None], valid[:, None, :], i[None, :] < i[:, None]))
    return jnp.sum(ahead, axis=-1, dtype=jnp.int32)


def _picker(pick):
    """A gather by a one-hot [B, n, M] (one True per row): a [B, M, ...] array's picked entries [B, n, ...], as
    reductions XLA fuses into one kernel for every array picked (a float's by max: -inf and -0.0 pass exactly)."""
    def take(a):
        p = pick.reshape(*pick.shape, *(1,) * (a.ndim - 2))
        a = a[:, None]
        if a.dtype == jnp.bool_:
            return jnp.any(p & a, axis=2)
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.max(jnp.where(p, a, -jnp.inf), axis=2)
        return jnp.sum(jnp.where(p, a, 0), axis=2, dtype=a.dtype)
    return take


def chain_tree(root: jax.Array, draft_tokens: jax.Array) -> Tree:
    """Single-path tree [root, t_1, ..., t_L] (DFlash chain verification); N = L. Scores are 0 (unknown)."""
    bsz, depth_l = draft_tokens.shape
    idx = jnp.arange(1 + depth_l, dtype=jnp.int32)
    return Tree(
        tokens=jnp.concatenate([root.astype(jnp.int32)[:, None], draft_tokens.astype(jnp.int32)], axis=1),
        parents=jnp.broadcast_to(idx - 1, (bsz, 1 + depth_l)),
        depths=jnp.broadcast_to(idx, (bsz, 1 + depth_l)),
        scores=jnp.zeros((bsz, 1 + depth_l), jnp.float32),
        valid=jnp.ones((bsz, 1 + depth_l), bool),
    )


def node_states(tree: Tree, step: Step, root_state: jax.Array, max_depth: int) -> jax.Array:
    """[B, 1+N] int32: the automaton's state after each node's prefix (root: ``root_state``, the row's state after
    its committed text and the root token), by ``step`` along the node's path; -1 for a node the automaton
    refuses (and its descendants) and for padding. ``max_depth`` (static) bounds the tree's depth: one step of
    every node per depth, each node taking its parent's state once the parent's is final."""
    states = jnp.where(jnp.arange(tree.tokens.shape[1]) == 0, root_state.astype(jnp.int32)[:, None], -1)
    for d in range(1, max_depth + 1):
        from_parent = step(jnp.take_along_axis(states, jnp.maximum(tree.parents, 0), axis=1), tree.tokens)
        states = jnp.where(tree.valid & (tree.depths == d), from_parent, states)
    return states


def truncate(tree: Tree, width: int) -> Tree:
    """The root and the first `width` nodes of a best-first tree: the best tree of that many nodes.

    The best-first order lists every parent before its children (a parent never scores below its child and
    sorts first on ties), so any prefix of it is itself a prefix-closed tree whose parent indices stay inside.
    """
    return Tree(*(a[:, :1 + width] for a in tree))


def ancestor_mask(tree: Tree) -> jax.Array:
    """vis [B, 1+N, 1+N]: vis[b, i, j] <=> j is i or an ancestor of i. Padding slots see only themselves.

    Pointer jumping: after k rounds, vis holds every ancestor within 2^k - 1 steps and `up` is the 2^k-th
    ancestor (the root and padding point at themselves), so ceil(log2(1+N)) rounds of O(N^2) suffice for any
    depth, without knowing L.
    """
    bsz, size = tree.parents.shape
    self_idx = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (bsz, size))
    up = jnp.where(tree.valid & (tree.parents >= 0), tree.parents, self_idx)
    vis = jnp.broadcast_to(jnp.eye(size, dtype=bool), (bsz, size, size))
    rows_of = jax.vmap(lambda m, i: m[i])  # whole-row gather: ~100x faster than an elementwise gather on CPU
    for _ in range(max(size - 1, 1).bit_length()):
        vis = vis | rows_of(vis, up)  # add the rows of the 2^k-th ancestors
        up = jnp.take_along_axis(up, up, axis=1)
    return vis


def walk(tree: Tree, target_tokens: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Acceptance walk. target_tokens [B, 1+N]: the target's token at each node (argmax, or one sample each).

    max_depth (static) bounds the tree depth: the draft length L for `build_tree` / `chain_tree` trees; the path
    has max_depth + 1 entries. Returns (path [B, max_depth+1] int32 node indices, root (0) first, entries past
    path_len = -1; path_len [B] in [1, max_depth+1]; bonus [B] = target token at the last node of the path).

    Written without the walk's sequential steps: a node is on the path when it and each of its ancestors is the
    token the target chose at its parent (siblings are distinct, so that picks at most one node a depth), which
    pointer jumping over the parents finds in ceil(log2(1+N)) rounds of vector gathers (``ancestor_mask``'s
    rounds, on one bit a node); the path is then one reduction: ~10 fewer GPU kernels a round than L steps of
    compare-and-advance.
    """
    bsz, size = tree.tokens.shape
    target_tokens = target_tokens.astype(jnp.int32)
    node_idx = jnp.arange(size, dtype=jnp.int32)
    at_parent = jnp.take_along_axis(target_tokens, jnp.maximum(tree.parents, 0), axis=1)
    on_path = tree.valid & ((tree.parents < 0) | (tree.tokens == at_parent))    # after the pointer jumping below
    up = jnp.where(tree.valid & (tree.parents >= 0), tree.parents, node_idx)    # the root and padding: themselves
    for _ in range(max(size - 1, 1).bit_length()):
        on_path = on_path & jnp.take_along_axis(on_path, up, axis=1)
        up = jnp.take_along_axis(up, up, axis=1)
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    path = jnp.max(jnp.where(at_depth, node_idx, -1), axis=-1)                              # [B, max_depth+1]
    path_len = jnp.sum(path >= 0, axis=1).astype(jnp.int32)
    last = jnp.take_along_axis(path, (path_len - 1)[:, None], axis=1)
    bonus = jnp.take_along_axis(target_tokens, last, axis=1)[:, 0]
    return path, path_len, bonus


def accept_greedy(
    tree: Tree, target_logits: jax.Array, max_depth: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance: `walk` with the per-node argmax of target_logits [B, 1+N, V]."""
    return walk(tree, jnp.argmax(target_logits, axis=-1).astype(jnp.int32), max_depth)
