"""The DFlash drafter: tap formula, the public checkpoint layout, non-causal blocks."""

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from kimi_jax.config import preset
from kimi_jax.decoding import drafter as dflash
from kimi_jax.weights.drafter import load_drafter

TARGET = preset("tiny")


def test_fallback_tap_formula_matches_published_drafters():
    assert dflash.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]          # Qwen3-4B/8B DFlash
    assert dflash.build_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]     # Kimi-K2.5-DFlash
    assert dflash.build_target_layer_ids(48, 5) == [1, 12, 23, 34, 45]
    assert dflash.build_target_layer_ids(61, 1) == [30]


def public_layout(tmp_path, taps_in_config=True):
    """A DFlash checkpoint as z-lab publishes it: Qwen3 config + dflash_config, [out, in] safetensors."""
    h, heads, kv, hd, inter, n = 64, 4, 2, 16, 96, 2
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h, "num_hidden_layers": n,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": inter,
           "vocab_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "block_size": 8,
           "num_target_layers": 3,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
           "dflash_config": {"mask_token_id": 250, **({"target_layer_ids": [0, 2]} if taps_in_config else {})}}
    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)
    tensors = {"fc.weight": w(h, 2 * h), "hidden_norm.weight": w(h), "norm.weight": w(h)}
    for i in range(n):
        p = f"layers.{i}."
        tensors.update({p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
                        p + "self_attn.q_proj.weight": w(heads * hd, h), p + "self_attn.k_proj.weight": w(kv * hd, h),
                        p + "self_attn.v_proj.weight": w(kv * hd, h), p + "self_attn.o_proj.weight": w(h, heads * hd),
                        p + "self_attn.q_norm.weight": w(hd), p + "self_attn.k_norm.weight": w(hd),
                        p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                        p + "mlp.down_proj.weight": w(h, inter)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return cfg, tensors


def test_loads_the_public_dflash_layout(tmp_path):
    cfg, t = public_layout(tmp_path)
    d = load_drafter(str(tmp_path), TARGET)
    c, p = d.config, d.params
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_key_value_heads) == (8, 250, (0, 2), 2)
    assert c.rope_factor == 4.0 and c.rope_scale == 1.0                   # mscale 1/1: unscaled cos/sin
    np.testing.assert_array_equal(p["fc"], t["fc.weight"].T)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    # y = x @ W.T in torch; ours keeps heads explicit: q [d, heads, head_dim], o [heads, head_dim, d]
    np.testing.assert_allclose(np.einsum("td,dhk->thk", x, p["layers"]["q"][1]).reshape(3, -1),
                               x @ t["layers.1.self_attn.q_proj.weight"].T, rtol=1e-5, atol=1e-5)
    o_in = np.random.default_rng(2).standard_normal((3, 4, 16)).astype(np.float32)
    np.testing.assert_allclose(np.einsum("thk,hkd->td", o_in, p["layers"]["o"][0]),
                               o_in.reshape(3, -1) @ t["layers.0.self_attn.o_proj.weight"].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(p["layers"]["down"][1], t["layers.1.mlp.down_proj.weight"].T)


def test_loads_onto_a_mesh_split_as_the_programs_run_it(tmp_path):
    """On a mesh each weight lands as param_shardings says: heads and MLP width split (4 query and 2 kv heads,
    MLP 96 over 2 devices), fc and the norms replicated; the values are the single-device load's."""
    import jax
    from kimi_jax import sharding

    public_layout(tmp_path)
    mesh = sharding.make_mesh("tp=2")
    split = load_drafter(str(tmp_path), TARGET.replace(hidden_size=64), mesh=mesh)
    whole = load_drafter(str(tmp_path), TARGET.replace(hidden_size=64))
    layers = split.params["layers"]
    assert layers["q"].addressable_shards[0].data.shape == (2, 64, 2, 16)        # [layers, d, heads / 2, hd]
    assert layers["k"].addressable_shards[0].data.shape == (2, 64, 1, 16)
    assert layers["o"].addressable_shards[0].data.shape == (2, 2, 16, 64)
    assert layers["down"].addressable_shards[0].data.shape == (2, 48, 64)
    assert split.params["fc"].sharding.is_fully_replicated
    want = dflash.param_shardings(split.config, mesh)
    for got, s in zip(jax.tree.leaves(split.params), jax.tree.leaves(want)):
        assert got.sharding.is_equivalent_to(s, got.ndim)
    for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tap_fallback_when_config_has_no_layer_ids(tmp_path):
    public_layout(tmp_path, taps_in_config=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert dflash.DrafterConfig.from_hf(cfg).target_layer_ids == (1, 0)    # round(1 + i * (3 - 4) / 1)


def test_drafter_that_does_not_fit_its_target(tmp_path):
    public_layout(tmp_path)
    with pytest.raises(dflash.DrafterError, match="hidden_size 64 does not match the target's 32"):
        load_drafter(str(tmp_path), TARGET.replace(hidden_size=32))


@pytest.mark.parametrize("change, msg", [
    (dict(architectures=["DFlash2DraftModel"]), "DFlash2 drafters .* are not supported yet"),
    (dict(dflash_config={"mask_token_id": 250, "selector_rank": 16}), "DFlash2 drafters"),
    (dict(dflash_config={"mask_token_id": 250, "draft_temperature": 0.5}),
     "dflash_config field 'draft_temperature' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(layer_types=["chunked_attention"] * 2), "layer type 'chunked_attention' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope type 'llama3' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                        "truncate": False}), "truncate=false"),
])
def test_unsupported_drafter_configs_are_refused_by_name(tmp_path, change, msg):
    cfg, _ = public_layout(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(dflash.DrafterError, match=msg):
        load_drafter(str(tmp_path), TARGET.replace(hidden_size=64))


def test_k26_drafter_preset_has_the_published_size():
    """6 layers of hidden 7168, 64/8 heads of 128, fc over six taps: 6.48 GiB in bf16, as z-lab publishes it."""
    c = dflash.PRESETS["kimi-k2.6-dflash"]
    assert c.target_layer_ids == tuple(dflash.build_target_layer_ids(61, 6))
    n = dflash.param_count(c)
    assert n == 3_479_277_056 and round(2 * n / 2**30, 2) == 6.48
    assert dflash.feature_slots(c, 262_144) == 4096                 # the context window bounds the ring


@pytest.mark.slow
def test_k26_round_with_its_drafter_compiles_on_eight_devices():
    """One whole DDTree round of the full K2.6 target and the K2.6 DFlash drafter, AOT on a TP-8 mesh of fake
    devices, with a target cache longer than the drafter's window."""
    from kimi_jax import sharding as part
    from kimi_jax.analysis.target_sweep import compile_round
    from kimi_jax.config import KIMI_K26
    c = dflash.PRESETS["kimi-k2.6-dflash"]
    _, row = compile_round(KIMI_K26, c, part.make_mesh("tp=8"), "tp", batch=1, budget=16, context=8192)
    # bf16, split 8 ways by heads and MLP width (drafter.PARAM_AXES); fc and the norms replicated;
    shapes = dflash.param_shapes(c)
    layers = shapes["layers"]
    split = sum(math.prod(layers[k]) for k in ("q", "k", "v", "o", "gate", "up", "down"))
    # in the programs' layout (drafter.fuse): q/k/v's norms as one [G + 2, hd] a layer, and the context K/V
    # weights of every layer stored once more as one, split the same, with the k norms
    norms = c.num_hidden_layers * (c.num_attention_heads // c.num_key_value_heads + 2) * c.head_dim
    context = (math.prod(layers["k"]) + math.prod(layers["v"])) // 8 + math.prod(layers["k_norm"])
    packed = norms - math.prod(layers["q_norm"]) - math.prod(layers["k_norm"]) + context
    assert row["drafter_bytes"] == 2 * (dflash.param_count(c) - split + split // 8 + packed)
    # ring of 4096 slots x 6 layers x 1 KV head a device (8 split 8 ways) x 128, K and V, bf16
    assert row["feature_cache_bytes"] == 4096 * 6 * 1 * 128 * 2 * 2
    assert row["weight_bytes"] < 100e9                                           # the target is sharded 8 ways
