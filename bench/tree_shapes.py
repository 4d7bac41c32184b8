"""Depth vs breadth: which draft-tree shape accepts the most at a given width, on held-out text.

    python -m bench.tree_shapes [--prompts 8] [--new-tokens 96] [--widths 4,8,16,32]

Offline and exact for greedy decoding: the target's greedy continuation S of each held-out prompt is computed
once; at every round start P (P tokens committed, bonus S[P]) the drafter's marginals are those of the real
engine (its context is S[:P], which is what a lossless engine has committed). A tree accepts the longest
prefix of S[P+1:] it contains, so any shape can be scored without running the target again. Reported per
shape and width: mean accepted tokens per round (tau = accepted nodes + the bonus) averaged over all round
starts of the trajectory each shape really runs (a round starts where the previous one stopped: averaging over
every position instead would overstate tau about 2x, since rounds start right after a miss); per depth, how
often the true token is the drafter's rank-r token (over all positions: the acceptance a sibling of rank r
could add); and where the best-first tree spends its nodes. Checked: best-first's trajectory taus equal the
engine's own per-round taus.

Shapes at equal width w:
* best-first: the DDTree tree (the w most probable prefixes under the product of marginals);
* chain: the drafter's argmax path, cut to w nodes;
* spine+siblings: the argmax path, and the nodes beyond depth L spent on siblings of spine nodes at the depths
  where the argmax is least certain (largest surrogate mass of the alternatives): "branch only where the
  drafter is uncertain".

Writes bench/results/tree_shapes_<backend>.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def draft_log_probs(model, seq: np.ndarray, starts: list[int]) -> np.ndarray:
    """[len(starts), L, V] drafter log-probs at each round start (context seq[:P], bonus seq[P])."""
    from kimi_jax.cache import init_cache
    from kimi_jax.decoding import drafter as dflash
    from kimi_jax.model.transformer import forward
    c = model.drafter.config
    dp, tp = model.drafter_params, model.compute_params
    t = len(seq)
    fwd = jax.jit(lambda p, s: forward(p, model.config, s, init_cache(model.config, 1, t), taps=c.target_layer_ids))(
        tp, jnp.asarray(seq[None]))
    feats, _ = dflash.prefill_features(dp, c, tp, fwd.taps, jnp.asarray([t]), t)
    n = len(starts)
    cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (a.shape[0], n) + a.shape[2:]), feats)
    lens = jnp.asarray(starts, jnp.int32)
    logits = jax.jit(lambda cache, bonus, lens: dflash.draft(dp, c, tp, cache, bonus, lens, c.block_size))(
        cache, jnp.asarray(seq[starts]), lens)
    return np.asarray(jax.nn.log_softmax(logits, -1))


def accepted_len(tokens, parents, depths, truth) -> int:
    """Longest prefix of truth contained in the tree (tokens/parents/depths of nodes 1..N, root 0)."""
    on_path = {0}
    best = 0
    for i in range(1, len(tokens)):
        if parents[i] in on_path and depths[i] - 1 < len(truth) and tokens[i] == truth[depths[i] - 1]:
            on_path.add(i)
            best = max(best, int(depths[i]))
    return best


def best_first(lp, w):
    from kimi_jax.decoding import ddtree
    tree = ddtree.build_tree_from_log_probs(jnp.zeros((1,), jnp.int32), jnp.asarray(lp[None]), w)
    valid = np.asarray(tree.valid[0])
    return [np.asarray(a[0])[valid] for a in (tree.tokens, tree.parents, tree.depths)]


def chain(lp, w):
    n = min(w, lp.shape[0])
    toks = np.concatenate([[0], np.argmax(lp[:n], -1)])
    return toks, np.arange(-1, n), np.arange(0, n + 1)


def spine_and_siblings(lp, w):
    """Argmax path of min(w, L) nodes; the rest as siblings where the spine is least certain."""
    toks, parents, depths = (list(a) for a in chain(lp, w))
    extra = w - (len(toks) - 1)
    if extra > 0:
        order = np.argsort(-lp, axis=-1)
        spine_lp = np.cumsum(lp[np.arange(lp.shape[0]), order[:, 0]])
        cands = []   # (surrogate score, depth index, rank)
        for d in range(lp.shape[0]):
            reach = spine_lp[d - 1] if d else 0.0
            for r in range(1, min(extra + 1, lp.shape[1])):
                cands.append((reach + lp[d, order[d, r]], d, r))
        for _, d, r in sorted(cands, reverse=True)[:extra]:
            toks.append(order[d, r]); parents.append(d); depths.append(d + 1)   # parent = spine node at depth d
    return np.asarray(toks), np.asarray(parents), np.asarray(depths)


SHAPES = {"best-first": best_first, "chain": chain, "spine+siblings": spine_and_siblings}


def main(argv=None):
    import kimi_jax
    from kimi_jax.training.corpus import heldout_prompts
    p = argparse.ArgumentParser(prog="python -m bench.tree_shapes")
    p.add_argument("--target", default=str(ROOT / "checkpoints" / "target"))
    p.add_argument("--drafter", default=str(ROOT / "checkpoints" / "drafter"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--widths", default="4,8,16,32")
    a = p.parse_args(argv)
    model = kimi_jax.load(a.target, drafter=a.drafter)
    model = kimi_jax.Model(model.config.replace(eos_token_ids=()), model.params, model.tokenizer, model.drafter)
    L = model.drafter.config.block_size - 1
    widths = [int(w) for w in a.widths.split(",")]
    taus = {s: {w: [] for w in widths} for s in SHAPES}
    rank_hits = np.zeros((L, 4))        # [depth, rank 0..2, other]: true token's drafter rank given a true prefix
    spent = {w: np.zeros(L) for w in widths}          # best-first nodes per depth
    for prompt in heldout_prompts(model.tokenizer, a.prompts, a.prompt_len):
        cont = model.generate([prompt], a.new_tokens, method="ar").tokens[0]
        seq = np.asarray(prompt + cont, np.int32)
        starts = list(range(len(prompt), len(seq) - L))
        lps = dict(zip(starts, draft_log_probs(model, seq, starts)))
        for P, lp in lps.items():
            truth = seq[P + 1:P + 1 + L]
            ranks = np.argsort(np.argsort(-lp, axis=-1), axis=-1)[np.arange(L), truth]
            rank_hits[np.arange(L), np.minimum(ranks, 3)] += 1
        for s, fn in SHAPES.items():
            for w in widths:
                P = starts[0]
                while P in lps:        # the rounds a real engine runs: each starts where the last one stopped
                    tree = fn(lps[P], w)
                    accepted = accepted_len(*tree, seq[P + 1:P + 1 + L])
                    taus[s][w].append(1 + accepted)
                    if s == "best-first":
                        spent[w] += np.bincount(tree[2][1:] - 1, minlength=L)[:L]
                    P += 1 + accepted
    n = int(rank_hits[0].sum())
    table = {s: {w: float(np.mean(v)) for w, v in d.items()} for s, d in taus.items()}
    # P(true token at depth d has rank r | the true prefix is in the tree) ~ marginal rank frequencies
    rank_share = (rank_hits / rank_hits.sum(1, keepdims=True)).round(3).tolist()
    print(f"held-out prompts: {a.prompts} x {a.prompt_len} tokens, greedy continuations of {a.new_tokens}; "
          f"{n} positions")
    print("mean tau at equal width:   " + "  ".join(f"w={w:<4d}" for w in widths))
    for s, row in table.items():
        print(f"  {s:15s}           " + "  ".join(f"{row[w]:6.2f}" for w in widths))
    print("true token's drafter rank by depth (rank 1 / 2 / 3 / worse):")
    for d in range(L):
        print(f"  depth {d + 1:2d}: " + " / ".join(f"{x:.2f}" for x in rank_share[d]))
    for w in widths:
        print(f"best-first w={w}: nodes per depth {np.round(spent[w] / len(taus['best-first'][w]), 2).tolist()}")
    out = ROOT / "bench" / "results" / f"tree_shapes_{jax.default_backend()}.json"
    out.write_text(json.dumps(dict(command="python -m bench.tree_shapes " + " ".join(argv or []),
                                   prompts=a.prompts, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                                   positions=n, tau=table, rank_share_by_depth=rank_share,
                                   best_first_nodes_per_depth={w: (spent[w] / len(taus["best-first"][w])).tolist()
                                                               for w in widths},
                                   date=time.strftime("%Y-%m-%d")), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
