"""Loading straight into per-layer buffers (``kimi_jax.load(..., layers=)``): the same weights as the stacked load,
no stacked copy on the device, the same greedy tokens, and checkpoints / HF exports that round-trip."""

import filecmp

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from conftest import FIXTURES

import kimi_jax
from kimi_jax import api
from kimi_jax.model.params import is_spec, param_specs
from kimi_jax.weights import checkpoint
from kimi_jax.weights.export import export_hf

TARGET = FIXTURES.parent.parent / "checkpoints" / "target"
DRAFTER = FIXTURES.parent.parent / "checkpoints" / "drafter"
pytestmark = pytest.mark.skipif(not (DRAFTER / "drafter_config.json").exists(), reason="embedded default not built")
STACKS = ("dense_layers", "moe_layers")


@pytest.fixture(scope="module")
def stacked():
    return kimi_jax.load(str(TARGET), drafter=str(DRAFTER), layers="stacked")


@pytest.fixture(scope="module")
def per_layer():
    return kimi_jax.load(str(TARGET), drafter=str(DRAFTER), layers="per-layer")


def assert_same_weights(per_layer_params, stacked_params, cfg):
    """Every layer of the per-layer tree equals its slice of the stacked tree: values, dtypes, tree structure."""
    for k in checkpoint.GLOBAL_KEYS:
        np.testing.assert_array_equal(per_layer_params[k], stacked_params[k])
    for stack, n in zip(STACKS, (cfg.first_k_dense_replace, cfg.num_moe_layers)):
        layers = per_layer_params[stack]
        assert isinstance(layers, tuple) and len(layers) == n
        for j, layer in enumerate(layers):
            want = jax.tree.map(lambda a: a[j], stacked_params[stack])
            assert jax.tree.structure(layer) == jax.tree.structure(want)
            for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(want)):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)


def stacked_shapes(cfg) -> set:
    """The shapes of the stacked layer weights (leading layer axis) of ``cfg``."""
    specs = param_specs(cfg)
    return {tuple(s.shape) for stack in STACKS for s in jax.tree.leaves(specs[stack], is_leaf=is_spec)}


def test_per_layer_load_holds_no_stacked_copy(per_layer, stacked):
    cfg = per_layer.config
    assert not isinstance(stacked.params["moe_layers"], tuple)
    assert_same_weights(per_layer.params, stacked.params, cfg)
    # compute_params (INT4 experts expanded on the CPU's XLA path) keeps the per-layer buffers and splits nothing
    # again; neither tree the Model holds has a leaf with a layer axis.
    stacked_like = stacked_shapes(cfg)
    for tree in (per_layer.params, per_layer.compute_params):
        assert all(isinstance(tree[stack], tuple) for stack in STACKS)
        for stack in STACKS:
            assert not {tuple(a.shape) for a in jax.tree.leaves(tree[stack])} & stacked_like
    assert type(per_layer.compute_params["moe_layers"][0]["moe"]["experts"]) is \
        type(stacked.compute_params["moe_layers"][0]["moe"]["experts"])


@pytest.mark.parametrize("method,budget", [("ar", None), pytest.param("ddtree", 8, marks=pytest.mark.slow)])
def test_per_layer_greedy_tokens_equal_stacked(per_layer, stacked, method, budget):
    prompts = ["def fib(n):", "import os\nfor"]
    want = stacked.generate(prompts, 16, method=method, budget=budget)
    got = per_layer.generate(prompts, 16, method=method, budget=budget)
    assert got.tokens == want.tokens
    assert got.stats["mean_tau"] == want.stats["mean_tau"]


@pytest.mark.slow     # three more loads, one on a mesh (~10 s); fast: the rule's memory side, test_no_room_to_split_...
def test_load_decides_by_own_buffers_for_the_weights_platform(stacked, monkeypatch):
    """No ``layers``: the embedded default (4 layers, one CPU) gets per-layer buffers, a mesh of CPUs keeps the
    stacks, and a mesh whose devices are GPUs gets per-layer buffers on the per-layer shardings."""
    assert isinstance(kimi_jax.load(str(TARGET)).params["moe_layers"], tuple)
    sharded = kimi_jax.load(str(TARGET), mesh="ep=2")
    assert not isinstance(sharded.params["moe_layers"], tuple)
    monkeypatch.setattr(api, "program_platform", lambda rt: "cuda")
    gpu = kimi_jax.load(str(TARGET), mesh="ep=2")
    assert isinstance(gpu.params["moe_layers"], tuple)
    for j, layer in enumerate(gpu.params["moe_layers"]):
        for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(sharded.params["moe_layers"])):
            assert a.sharding.spec == PartitionSpec(*b.sharding.spec[1:])
            np.testing.assert_array_equal(a, b[j])
    ids = [3, 17, 250, 9, 41]
    np.testing.assert_allclose(gpu.logits(ids), stacked.logits(ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layers must be one of"):
        kimi_jax.load(str(TARGET), layers="split")


@pytest.mark.slow
def test_hf_per_layer_load_equals_stacked(per_layer, stacked, tmp_path):
    """A float HF fixture, and an INT4 (compressed-tensors) HF export of the per-layer embedded default, which reads
    back per layer equal to the stacked load of the original checkpoint."""
    want = kimi_jax.load(str(FIXTURES / "hf_k2"), layers="stacked")
    assert_same_weights(kimi_jax.load(str(FIXTURES / "hf_k2"), layers="per-layer").params, want.params, want.config)
    export_hf(per_layer.params, per_layer.config, str(tmp_path / "hf"))
    assert_same_weights(kimi_jax.load(str(tmp_path / "hf"), layers="per-layer").params, stacked.params,
                        stacked.config)


@pytest.mark.slow     # a save, two restores, two HF exports (~20 s); fast: the layered form's restore in test_convert
def test_save_and_export_of_per_layer_params(per_layer, stacked, tmp_path):
    """A per-layer model saves as the layered form (no stacked copy made) that restores, either way, equal to the
    stacked load; its HF export is byte for byte the stacked model's."""
    checkpoint.save(str(tmp_path / "ckpt"), per_layer.config, per_layer.params)
    assert checkpoint.is_layered(str(tmp_path / "ckpt"))
    cfg, restored = checkpoint.restore(str(tmp_path / "ckpt"))
    assert cfg == per_layer.config
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(stacked.params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    _, split = checkpoint.restore(str(tmp_path / "ckpt"), split=True)
    assert_same_weights(split, stacked.params, cfg)
    with pytest.raises(checkpoint.CheckpointError, match="already exists"):
        checkpoint.save(str(tmp_path / "ckpt"), per_layer.config, per_layer.params)
    for model, out in ((per_layer, "per_layer"), (stacked, "stacked")):
        export_hf(model.params, model.config, str(tmp_path / out), int4=False, prefix="")
    assert filecmp.cmp(tmp_path / "per_layer" / "model.safetensors", tmp_path / "stacked" / "model.safetensors",
                       shallow=False)


def test_no_room_to_split_keeps_the_stacks_and_says_so(stacked, monkeypatch):
    """Stacked weights are split on the device only where both copies fit ``SPLIT_MEMORY_FRACTION`` of the
    fullest device's memory limit; where they do not, the target and the drafter alike keep their stacks and warn
    (one rule for both: ``compute_layout.split_stacks``)."""
    from kimi_jax.decoding import drafter as dflash
    from kimi_jax.model import compute_layout

    params = jax.device_put(stacked.params)
    dparams = jax.device_put(stacked.drafter.params)
    device = jax.devices()[0]
    used = sum(sh.data.nbytes for a in jax.tree.leaves(params) for sh in a.addressable_shards)
    for limit, fits in ((int(2 * used / compute_layout.SPLIT_MEMORY_FRACTION) + 1, True),
                        (int(2 * used / compute_layout.SPLIT_MEMORY_FRACTION) - 1, False)):
        monkeypatch.setattr(type(device), "memory_stats", lambda self, limit=limit: {"bytes_limit": limit})
        assert compute_layout.room_to_split(params) is fits
    monkeypatch.setattr(type(device), "memory_stats", lambda self: {"bytes_limit": 1})
    with pytest.warns(UserWarning, match="do not both fit"):
        target = compute_layout.split_stacks(params, name="target")
    with pytest.warns(UserWarning, match="the drafter: stacked and per-layer weights do not both fit"):
        drafter = dflash.compute_params(dparams, split=True)
    assert target is params and not isinstance(drafter["layers"], tuple)       # stacked, not split
    monkeypatch.undo()
    assert isinstance(compute_layout.split_stacks(params)["moe_layers"], tuple)
    assert isinstance(dflash.compute_params(dparams, split=True)["layers"], tuple)
