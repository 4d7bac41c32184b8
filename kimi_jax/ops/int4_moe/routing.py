"""Grouping the (token, slot) pairs of a MoE layer by expert, shared by both implementations.

Plain jnp, static shapes. The ``M = T*k`` (token, slot) pairs are
sorted by expert; each expert's run is padded to a multiple of the row block ``bm``, so every row block belongs
to exactly one expert (the layout vLLM's ``moe_align_block_size`` produces). The number of blocks is bounded
statically by ``nb = (M + min(E, M) * (bm - 1)) // bm``; blocks past the used ones carry expert ``-1`` and are
skipped. ``row_pair`` names each row's pair; the XLA and Mosaic GPU paths gather the activations in that order
(``gather_rows``, padding rows zeros), the Triton gate/up kernel reads its rows of ``x`` itself. After the experts,
each pair's output row is gathered back and the ``k`` rows of a token are summed with their routing weights in
float32 (a gather, so padding rows and skipped blocks are never read).

Two ways to place the pairs, with the same result: ``"sort"`` (a stable argsort, per-expert counts, a cumsum and
scatters) and ``"count"`` (for few pairs: each pair's rank within its expert and the blocks of lower experts
counted by comparing every pair with every other, then each row's pair and each block's expert by comparison:
``O(M^2)`` work in a few fused kernels, no sort, no scatter). ``"auto"`` counts up to ``COUNT_MAX_PAIRS`` pairs
(decode and verify widths), sorts above.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kimi_jax.ops.numerics import F32, next_pow2


def default_block_m(num_pairs: int, num_experts: int, lo: int, hi: int) -> int:
    """Power of two near the mean number of rows per touched expert, clamped to [lo, hi]."""
    touched = max(1, min(num_experts, num_pairs))
    return min(hi, max(lo, next_pow2(-(-num_pairs // touched))))


class Routing(NamedTuple):
    """Pairs ``p = t*k + j`` sorted by expert into row blocks of ``bm`` rows, one expert per block."""

    row_pair: jax.Array      # int32 [nb * bm]: pair in each padded row, M for padding rows
    block_expert: jax.Array  # int32 [nb]: expert of each block, -1 for unused blocks
    pair_row: jax.Array      # int32 [M]: padded row of each pair


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on sum_e ceil(n_e / bm) when sum_e n_e = M over at most min(E, M) nonempty experts."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


# Largest M placed by counting: its [M, M] and [nb * bm, M] comparisons are then at most ~4M and ~8M elements,
# each one fused kernel; above, sorting does less work.
COUNT_MAX_PAIRS = 2048


def sort_by_expert(topk_idx: jax.Array, num_experts: int, block_m: int, method: str = "auto") -> Routing:
    """``method``: "sort", "count" or "auto" (see the module docstring); all give the same Routing."""
    flat = topk_idx.reshape(-1).astype(jnp.int32)
    m = flat.shape[0]
    nb = num_blocks(m, num_experts, block_m)
    if method not in ("auto", "sort", "count"):
        raise ValueError(f"method must be 'auto', 'sort' or 'count', got {method!r}")
    if method == "count" or (method == "auto" and m <= COUNT_MAX_PAIRS):
        return _place_by_counting(flat, block_m, nb)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    blocks = -(-counts // block_m)
    block_end = jnp.cumsum(blocks)                   # first block after expert e's run
    row_start = (block_end - blocks) * block_m       # expert e's first padded row
    group_start = jnp.cumsum(counts) - counts        # expert e's first sorted pair
    sorted_e = flat[order]
    dest = row_start[sorted_e] + jnp.arange(m, dtype=jnp.int32) - group_start[sorted_e]
    row_pair = jnp.full(nb * block_m, m, jnp.int32).at[dest].set(order)
    pair_row = jnp.zeros(m, jnp.int32).at[order].set(dest)
    b = jnp.arange(nb, dtype=jnp.int32)
    # compare_all: one fused compare-and-count; the default binary search is a 9-step while loop on a GPU (~36
    # GPU ops per MoE layer: each step's compare, update and two carry copies)
    block_expert = jnp.searchsorted(block_end, b, side="right", method="compare_all").astype(jnp.int32)
    block_expert = jnp.where(b < block_end[-1], block_expert, -1)
    return Routing(row_pair, block_expert, pair_row)


def _place_by_counting(flat: jax.Array, block_m: int, nb: int) -> Routing:
    """The placement of ``sort_by_expert`` without a sort: pair p's row is (blocks of lower experts) * bm + (pairs
    of its expert before p); a block is opened by every bm-th pair of an expert."""
    m = flat.shape[0]
    p = jnp.arange(m, dtype=jnp.int32)
    rank = jnp.sum((flat[None, :] == flat[:, None]) & (p[None, :] < p[:, None]), axis=1, dtype=jnp.int32)
    opens = rank % block_m == 0
    blocks_below = jnp.sum((flat[None, :] < flat[:, None]) & opens[None, :], axis=1, dtype=jnp.int32)
    pair_row = blocks_below * block_m + rank
    rows = jnp.arange(nb * block_m, dtype=jnp.int32)
    row_pair = jnp.min(jnp.where(pair_row[None, :] == rows[:, None], p[None, :], m), axis=1)
    first = rows[::block_m]
    block_expert = jnp.max(jnp.where(pair_row[None, :] == first[:, None], flat[None, :], -1), axis=1)
    return Routing(row_pair, block_expert, pair_row)


def gather_rows(x: jax.Array, routing: Routing, k: int, width: int) -> jax.Array:
    """xs[r] = x[token of row r] (zeros for padding rows), columns zero-padded to ``width``."""
    x = jnp.pad(x, ((0, 1), (0, width - x.shape[1])))         # row t is the zero row padding rows point at
    return x[routing.row_pair // k]


def combine(out: jax.Array, routing: Routing, topk_weight: jax.Array) -> jax.Array:
    t, k = topk_weight.shape
    rows = out[routing.pair_row.reshape(t, k)]      # [T, k, D], float32
    return jnp.sum(rows * topk_weight.astype(F32)[..., None], axis=1)
