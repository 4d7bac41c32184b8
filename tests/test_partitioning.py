"""Sharding strategies on 8 fake CPU devices: same greedy tokens and logits as one device; clear errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kimi_jax
from kimi_jax import sharding as part
from kimi_jax.analysis.hlo import hlo_collectives
from kimi_jax.cache import init_cache
from kimi_jax.config import KIMI_K26, TINY, Runtime
from kimi_jax.model import moe, transformer
from kimi_jax.model import params as params_lib
from kimi_jax.model.params import param_partition_specs, param_shardings, shard_params

# Tiny with 8 heads so every strategy can split them 8 ways; float experts (INT4's F=32 cannot be TP-split).
CFG = TINY.replace(num_attention_heads=8)
MESHES = {"tp": "tp=8", "ep": "ep=8", "tp_ep": "tp=4,ep=2", "dp_attn": "dp=2,tp=4"}
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7, 7, 200, 3, 64, 12, 90]]


@pytest.fixture(scope="module")
def params():
    return params_lib.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def reference(params):
    model = kimi_jax.Model(CFG, params)
    tokens = model.generate(PROMPTS, max_new_tokens=8, method="ar").tokens
    return tokens, np.asarray(_logits(params, jnp.asarray(PROMPTS, jnp.int32)))


@functools.partial(jax.jit, static_argnames="rt")
def _logits(params, tokens, rt=Runtime()):
    return transformer.forward(params, CFG, tokens, init_cache(CFG, tokens.shape[0], 16), rt=rt).logits


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(MESHES))
def test_strategy_matches_one_device(strategy, params, reference):
    ref_tokens, ref_logits = reference
    mesh = part.make_mesh(MESHES[strategy])
    assert part.infer_strategy(mesh) == strategy
    sharded = shard_params(params, CFG, mesh, strategy)
    # weights really are split: the routed experts of one device are a fraction of the whole
    gate = sharded["moe_layers"]["moe"]["experts"]["gate"]
    assert gate.addressable_shards[0].data.size < gate.size
    tokens = jax.device_put(jnp.asarray(PROMPTS, jnp.int32), part.batch_sharding(mesh, strategy))
    with part.mesh_context(mesh):
        logits = np.asarray(_logits(sharded, tokens, Runtime(mesh=mesh, strategy=strategy)))
    out = kimi_jax.Model(CFG, sharded, mesh=mesh).generate(PROMPTS, max_new_tokens=8, method="ar").tokens
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert out == ref_tokens


@pytest.mark.slow     # fast: the same count for K2.6's TP-8 forward, test_sweep's test_tp_allreduce_count_matches_...
def test_tp_collectives_one_allreduce_per_block(params):
    """Under tp the compiled forward has 2 all-reduces per layer (attention, MoE/MLP) + 1 for the embedding."""
    mesh = part.make_mesh("tp=8")
    sharded = shard_params(params, CFG, mesh)
    with part.mesh_context(mesh):
        hlo = _logits.lower(sharded, jnp.asarray(PROMPTS, jnp.int32), Runtime(mesh=mesh)).compile().as_text()
    c = hlo_collectives(hlo)["per_kind"]
    assert c["all-reduce"]["count"] == 2 * CFG.num_hidden_layers + 1
    assert sum(v["count"] for k, v in c.items() if k != "all-reduce") == 0


def test_strategy_tables_full_model():
    mesh = jax.sharding.AbstractMesh((8,), ("tp",))
    specs = param_partition_specs(KIMI_K26, mesh, "tp")
    attn = specs["moe_layers"]["attn"]
    assert attn["q_b"] == P(None, None, "tp") and attn["o"] == P(None, "tp")
    assert attn["q_a"] == P() and attn["kv_a"] == P()                     # small projections replicated
    ex = specs["moe_layers"]["moe"]["experts"]
    assert ex.w13 == P(None, None, None, None, "tp") and ex.w2 == P(None, None, "tp")
    assert specs["lm_head"] == P(None, "tp") and specs["embed"] == P("tp")
    assert part.cache_sharding(KIMI_K26, mesh, "tp").kv.spec == P()      # latent cache replicated
    ep = param_partition_specs(KIMI_K26, jax.sharding.AbstractMesh((8,), ("ep",)), "ep")
    assert ep["moe_layers"]["moe"]["experts"].w13 == P(None, "ep")
    tpep = param_partition_specs(KIMI_K26, jax.sharding.AbstractMesh((4, 2), ("tp", "ep")), "tp_ep")
    assert tpep["moe_layers"]["moe"]["experts"].w13 == P(None, "ep", None, None, "tp")
    assert tpep["moe_layers"]["attn"]["q_b"] == P(None, None, ("tp", "ep"))
    dp = jax.sharding.AbstractMesh((8,), ("dp",))
    assert part.cache_sharding(KIMI_K26, dp, "dp_attn").kv.spec == P(None, "dp")
    assert param_partition_specs(KIMI_K26, dp, "dp_attn")["moe_layers"]["attn"]["q_b"] == P()


def test_make_mesh_parsing():
    assert part.parse_mesh("tp=4, ep=2") == {"tp": 4, "ep": 2}
    assert dict(part.make_mesh("dp=2,tp=4").shape) == {"dp": 2, "tp": 4}
    for bad, words in [("tp8", "axis=size"), ("xx=2", "unknown axis"), ("tp=2,tp=4", "twice"),
                       ("tp=16", "needs 16 devices")]:
        with pytest.raises(part.ShardingError, match=words):
            part.make_mesh(bad)


def test_bad_meshes_name_axis_sizes_and_fix():
    with pytest.raises(part.ShardingError, match=r"'heads' has size 4.*tp of size 8.*tp size divides the attention"):
        param_shardings(TINY, part.make_mesh("tp=8"))                # TINY has 4 heads
    ep32 = jax.sharding.AbstractMesh((32,), ("ep",))
    with pytest.raises(part.ShardingError, match=r"'experts' has size 16.*ep of size 32.*ep size divides the routed"):
        param_partition_specs(CFG.replace(num_attention_heads=32), ep32, "ep")
    with pytest.raises(part.ShardingError, match=r"INT4 experts.*multiple of 256"):
        param_shardings(TINY.replace(num_attention_heads=8, int4_experts=True), part.make_mesh("tp=8"))
    # INT4 slices of 64 cannot split over any axis that carries expert_mlp; the error names that axis (dp here)
    # and the meshes that work: whole experts over ep, as long as ep divides the 4 heads.
    with pytest.raises(part.ShardingError, match=r"dp_attn splits .* over dp = 2 .*This model fits: ep=2, ep=4$"):
        param_shardings(TINY.replace(int4_experts=True), part.make_mesh("dp=2"))
    with pytest.raises(part.ShardingError, match=r"batch 3 is not divisible.*size 2"):
        part.cache_sharding(CFG, part.make_mesh("dp=2,tp=4"), batch=3)
    with pytest.raises(part.ShardingError, match="unknown sharding strategy"):
        param_shardings(CFG, part.make_mesh("tp=8"), "zz")
    # K2.6 INT4 experts: F = 2048 splits 8 ways (256 each) but not 16 ways
    param_partition_specs(KIMI_K26, jax.sharding.AbstractMesh((8,), ("tp",)), "tp")
    with pytest.raises(part.ShardingError, match="INT4"):
        param_partition_specs(KIMI_K26, jax.sharding.AbstractMesh((16,), ("tp",)), "tp")


@pytest.mark.slow
def test_int4_experts_under_ep_match():
    """INT4 routed experts through the int4_moe kernel path under EP (ids remapped to local experts)."""
    from kimi_jax.ops.int4_format import Int4Experts
    cfg = CFG.replace(int4_experts=True)
    p = jax.tree.map(lambda a: np.asarray(a[0]), params_float_moe())
    p["experts"] = jax.tree.map(jnp.asarray, Int4Experts.quantize(p["experts"]["gate"], p["experts"]["up"],
                                                                  p["experts"]["down"]))
    x = jax.random.normal(jax.random.key(2), (6, cfg.hidden_size), jnp.float32)
    ref, _ = jax.jit(moe.moe_block, static_argnums=2)(x, p, cfg)
    rt = Runtime(mesh=part.make_mesh("ep=8"), strategy="ep")
    got, _ = jax.jit(moe.moe_block, static_argnums=(2, 3))(x, p, cfg, rt)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-4)


def params_float_moe():
    return jax.jit(lambda k: params_lib.init_params(CFG, k)["moe_layers"]["moe"])(jax.random.key(1))


@pytest.mark.slow
def test_dcp_splits_the_cache_by_position_and_keeps_the_greedy_tokens(params, reference):
    """dcp on 8 fake devices: each device holds 1/8 of the latent cache's positions, and AR and DDTree emit
    the one-device AR tokens."""
    from kimi_jax.decoding import drafter as dflash
    ref_tokens, _ = reference
    mesh = part.make_mesh("tp=8")
    sharded = shard_params(params, CFG, mesh, "dcp")
    dcfg = dflash.DrafterConfig(hidden_size=CFG.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=CFG.vocab_size,
                                block_size=4, mask_token_id=255, target_layer_ids=(0, 2))
    drafter = dflash.Drafter(dcfg, dflash.init_params(dcfg, jax.random.key(1)))
    model = kimi_jax.Model(CFG, sharded, drafter=drafter, mesh=mesh, runtime=Runtime(strategy="dcp"))
    for method in ("ar", "ddtree"):
        assert model.generate(PROMPTS, max_new_tokens=8, method=method, budget=6).tokens == ref_tokens, method
    request = model.prepare(PROMPTS, 8, "ar")
    state, _ = model.prefill(request)
    kv = state.cache.kv
    assert kv.sharding.shard_shape(kv.shape)[2] == request.max_len // 8


# Slow (~25 s: the one-device reference, then the sharded forward with the kernel interpreted); the fast loop has a
# sharded forward's logits equal to one device's (test_convert's test_load_on_mesh_places_each_layer_on_its_shardings,
# ep=4) and the tree kernel in test_tree_attention.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp", "dp_attn"])
def test_tree_kernel_on_local_heads_matches_one_device(strategy, params, reference):
    """The Pallas tree-attention kernel under a mesh runs in shard_map on each device's own heads
    (mla._tree_on_local_heads; interpret mode on this CPU): the logits of one device, to rounding. The op picks
    its implementation inside, so the XLA path runs on local heads too."""
    mesh = part.make_mesh(MESHES[strategy])
    sharded = shard_params(params, CFG, mesh, strategy)
    tokens = jax.device_put(jnp.asarray(PROMPTS, jnp.int32), part.batch_sharding(mesh, strategy))
    rt = Runtime(mesh=mesh, strategy=strategy, attn_impl="pallas")
    with part.mesh_context(mesh):
        logits = np.asarray(_logits(sharded, tokens, rt))
        manual = [_logits.lower(sharded, tokens, r).as_text().count("sdy.manual_computation")
                  for r in (rt, rt.replace(attn_impl="xla"))]
    # the MoE's and the dense MLP's shard_maps, plus two per attention layer stack: the latent projection's and
    # the attention's
    assert manual == [6, 6]
    np.testing.assert_allclose(logits, reference[1], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp", "tp_ep"])
def test_drafter_split_by_heads_keeps_the_greedy_tokens(strategy, params, reference):
    """A drafter whose heads the mesh divides is split like the target (query and kv heads, MLP width): each device
    holds 1/8 of its attention and MLP weights and of its feature cache, and DDTree still emits the one-device AR
    tokens. Its attention runs in shard_map on each device's heads (the Pallas kernel in interpret mode too)."""
    from kimi_jax.decoding import drafter as dflash
    ref_tokens, _ = reference
    mesh = part.make_mesh(MESHES[strategy])
    sharded = shard_params(params, CFG, mesh, strategy)
    dcfg = dflash.DrafterConfig(hidden_size=CFG.hidden_size, num_hidden_layers=2, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=16, intermediate_size=64, vocab_size=CFG.vocab_size,
                                block_size=4, mask_token_id=255, target_layer_ids=(0, 2))
    drafter = dflash.Drafter(dcfg, dflash.init_params(dcfg, jax.random.key(1)))
    for impl in ("xla", "pallas"):
        model = kimi_jax.Model(CFG, sharded, drafter=drafter, mesh=mesh,
                               runtime=Runtime(strategy=strategy, attn_impl=impl))
        assert model.generate(PROMPTS, max_new_tokens=8, method="ddtree", budget=6).tokens == ref_tokens, impl
    layers = model.drafter_params["layers"]
    qkv = layers[0]["qkv"] if isinstance(layers, tuple) else layers["qkv"]      # [(layers,) d, kv heads, G + 2, hd]
    assert qkv.sharding.shard_shape(qkv.shape)[-3] == 8 // 8
    context = model.drafter_params["context"]["kv"]                             # [d, layers, 2, kv heads, hd]
    assert context.sharding.shard_shape(context.shape)[3] == 8 // 8
    state, _ = model.prefill(model.prepare(PROMPTS, 8, "ddtree", 6))
    k = state.drafter.k
    assert k.sharding.shard_shape(k.shape)[3] == 1
