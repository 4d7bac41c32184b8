"""Regression guard on what one MoE layer launches on a GPU (bench/layer_ops.py, issue 29 item 2).

Compiles the 3-layer K2.6-shaped DDTree round (1 dense + 2 MoE layers, 17-token verify, 8 compile-only H200s,
TP) with XLA's real GPU compiler and pins the verify forward's GPU ops per MoE layer in the router, routed-expert
and shared-expert scopes, and the whole round's ops (which also holds the unscoped copies XLA adds, e.g. the carry
copies of the binary search the routing used to run). Before the cuts: 40 per MoE layer (router 6, experts 31,
shared expert 3) and 514 per round; after: 15 and 421 (docs/gpu_overhead.md). Attention (docs/gpu_overhead.md,
"Cutting the attention's kernels"): attend 12 -> 5.33 per layer, round 421 -> 407. Router (kimi_jax/ops/router:
two Pallas kernels): 6 -> 2 per MoE layer, 15 -> 11 per MoE layer, round 407 -> 399. Layer indices as constants:
round 399 -> 397. The pairs placed by one Pallas kernel: experts 6 -> 3, 11 -> 8 per MoE layer, round 397 -> 391.
Issue 41: round 393 -> 263 (part two), then the drafter's packed q/k/v and context K/V weight and W_UV in the tree
attention's merge: 263 -> 240 (attend 5.33 -> 3.33 a layer, fixed ops 180 -> 163). The residual in the experts'
all-reduce (240 -> 239: the add after it gone, but in the last layer, whose add the head's norm already took),
the Mosaic GPU experts' rows gathered by the placement kernel (experts 4 -> 3 per MoE layer, 239 -> 237) and the
all-Triton round's rows multiplied by the norm's weight in its gate/up kernel (239 -> 237); the latent projection
as a split-K GEMM and one kernel (kimi_jax.ops.latent: the attention norm, the latent norms and the key's RoPE;
qkv_proj + the attention norm 6 -> 4.33 a layer, 237 -> 232); the absorbed queries as a split-K GEMM and one kernel
(q_b's partial sums, the query's RoPE and W_UK: attend + rope 4.67 -> 2.33 a layer, 232 -> 226); the shared expert
as a split-K GEMM and one kernel (kimi_jax.ops.swiglu: 3 -> 2 per MoE layer, 226 -> 224); the cache write in the
latent kernel (the scatter gone from every layer, the slots materialized once: 224 -> 222). 18 ops per MoE layer.
The drafter's and the dense layer's MLPs through the same SwiGLU op in a shard_map over their width (its partial
sums, silu(g) * u and the down GEMM's split-K reduction in one kernel): draft/drafter 86 -> 74, dense_mlp 5 -> 4,
fixed ops 163 -> 151, 222 -> 208.
"""

import pytest

from kimi_jax.analysis import targets

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPU_MISSING = targets.compiler_missing("h200")


@pytest.mark.compile
@pytest.mark.slow     # one ~30 s compile a case on a 2-core CPU
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
@pytest.mark.parametrize("impl,experts,round_ops", [("auto", 3, 208), ("pallas", 3, 208)])
def test_moe_layer_ops_for_h200(impl, experts, round_ops):
    """The default round for H200 (Mosaic GPU experts and attention) and the all-Triton one: experts at par (the
    Mosaic GPU kernels read rows the placement kernel gathered: Hopper's TMA copies boxes, not rows; the Triton
    gate/up kernel gathers its own), the attention at par
    (its tree rows and queries read in place, the merge in one kernel). Issue 41's fixed ops (drafter, tree,
    walk, commit, unscoped: 151 from 309) and the whole round in one CUDA graph (docs/gpu_overhead.md)."""
    from bench import layer_ops

    got = layer_ops.count_round("h200", 8, impl=impl)
    per = layer_ops.per_layer(got["by_scope"])
    assert per["experts"] <= experts and per["router"] <= 2 and per["shared_expert"] <= 2, per
    assert layer_ops.moe_layer_ops(got["by_scope"]) <= experts + 4, per
    assert per["attend"] <= 7 / 3 and per["qkv_proj"] <= 13 / 3 and per["o_proj"] <= 2, per
    assert per.get("rope", 0) == per.get("cache_write", 0) == 0, per    # RoPEs and the cache write in the kernels
    assert got["gpu_ops"] <= round_ops and got["host_launches"] == 1, got["by_scope"]
    assert per["norm"] <= 1, per     # the MoE norm's weight rides in the router kernel, the attention's in the GEMM
    fixed = {scope: n for scope, n in got["by_scope"].items() if not scope.startswith("verify")}
    assert sum(fixed.values()) <= 151 and fixed["build_tree"] <= 38 and fixed["accept"] <= 9, fixed
    assert fixed["draft/drafter"] <= 74 and fixed["commit/drafter"] <= 6, fixed   # packed q/k/v, SwiGLU kernels


@pytest.mark.compile
@pytest.mark.slow     # one ~20 s compile on a 2-core CPU
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_ar_step_layer_ops_for_h200():
    """The AR step (a one-token forward) launches per layer what the DDTree round's verify does: at one token the
    Mosaic GPU gate/up kernel splits K over a cluster and sums the splits itself (experts 5 -> 3 a MoE layer;
    before, XLA summed the partials and applied silu(g) * u in two fusions). Its qkv_proj holds one op more than
    the round's, once a step, not a layer: the RoPE table at the step's position (two broadcast fusions, the
    round's one cos/sin fusion), so 4 a layer + 2."""
    from bench import layer_ops

    got = layer_ops.count_round("h200", 8, method="ar")
    per = layer_ops.per_layer(got["by_scope"])
    assert per["experts"] <= 3 and per["router"] <= 2 and per["shared_expert"] <= 2, per
    assert per["attend"] <= 7 / 3 and per["qkv_proj"] <= 14 / 3 and per["o_proj"] <= 2 and per["norm"] <= 1, per
    assert got["gpu_ops"] <= 85 and got["host_launches"] == 1, got["by_scope"]
