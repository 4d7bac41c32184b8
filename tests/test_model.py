"""Model invariants on tiny random configs, the full K2.6 config abstractly, and bad input."""

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES

import kimi_jax
from kimi_jax.cache import KVCache, init_cache
from kimi_jax.config import ConfigError, ModelConfig, param_count, preset
from kimi_jax.decoding.engine import GenerationError
from kimi_jax.model.params import abstract_params, init_params
from kimi_jax.model.compute_layout import compute_params
from kimi_jax.model.transformer import forward, full_logits
from kimi_jax.weights import checkpoint, hf

TINY = preset("tiny")


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(TINY, jax.random.key(0), scale=2.0)


def test_param_count_kimi_k26():
    assert param_count(preset("kimi-k2.6")) == 1_026_408_232_448


@pytest.mark.slow
def test_param_count_matches_param_tree(tiny_params):
    assert sum(x.size for x in jax.tree.leaves(tiny_params)) == param_count(TINY)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "tiny-grouped"])
def test_absorbed_equals_full(name):
    cfg = preset(name)
    params = init_params(cfg, jax.random.key(1), scale=2.0)
    ids = jax.random.randint(jax.random.key(2), (2, 20), 0, cfg.vocab_size)
    a = jit_full_logits(params, cfg, ids, attn_form="absorbed")
    f = jit_full_logits(params, cfg, ids, attn_form="full")
    np.testing.assert_allclose(a, f, rtol=1e-4, atol=1e-4)


jit_forward = jax.jit(forward, static_argnums=(1,))
jit_full_logits = jax.jit(full_logits, static_argnums=(1,), static_argnames=("attn_form",))


def test_prefill_then_decode_equals_full_forward(tiny_params):
    ids = jax.random.randint(jax.random.key(3), (2, 16), 0, TINY.vocab_size)
    full = jit_full_logits(tiny_params, TINY, ids)
    cache = init_cache(TINY, 2, 32)
    out = jit_forward(tiny_params, TINY, ids[:, :9], cache)
    cache = KVCache(out.cache.kv, out.cache.lengths + 9)
    pieces = [out.logits]
    for t in range(9, 16):
        step = jit_forward(tiny_params, TINY, ids[:, t:t + 1], cache)
        cache = KVCache(step.cache.kv, cache.lengths + 1)
        pieces.append(step.logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.slow     # the fast loop has per-layer == stacked tokens (test_per_layer_load)
def test_per_layer_weights_compute_what_stacked_layers_do(tiny_params):
    """compute_params splits a small unsharded model into per-layer buffers (a Python loop over layers instead of
    lax.scan); logits, taps, expert loads and cache rows must be the scanned forward's."""
    split = compute_params(tiny_params, TINY)
    assert isinstance(split["moe_layers"], tuple) and len(split["moe_layers"]) == TINY.num_moe_layers
    assert isinstance(split["dense_layers"], tuple) and len(split["dense_layers"]) == TINY.first_k_dense_replace
    ids = jax.random.randint(jax.random.key(4), (2, 7), 0, TINY.vocab_size)
    cache = init_cache(TINY, 2, 16)
    run = jax.jit(lambda p: forward(p, TINY, ids, cache, taps=(0, 2)))
    want, got = run(tiny_params), run(split)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    deep = TINY.replace(num_hidden_layers=9)        # past PER_LAYER_MAX_LAYERS: the stacks (one scan body) stay
    assert not isinstance(compute_params(init_params(deep, jax.random.key(0)), deep)["moe_layers"], tuple)


def greedy_reference(params, cfg, prompt, n, width=32):
    """Greedy decoding by re-running the full causal forward for every token (no cache); the sequence is
    right-padded to a fixed width, which a causal forward ignores, so one compiled program serves all steps."""
    ids = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([ids + [0] * (width - len(ids))])
        ids.append(int(jnp.argmax(jit_full_logits(params, cfg, padded)[0, len(ids) - 1])))
    return ids[len(prompt):]


@pytest.mark.slow
def test_batched_ar_with_different_prompt_lengths(tiny_params):
    cfg = TINY.replace(eos_token_ids=())
    model = kimi_jax.Model(cfg, tiny_params)
    prompts = [[5, 6, 7], list(range(20, 31)), [9]]
    out = model.generate(prompts, max_new_tokens=8, method="ar")
    for p, toks in zip(prompts, out.tokens):
        assert toks == greedy_reference(tiny_params, cfg, p, 8)


@pytest.mark.slow
def test_eos_stops_a_row_and_is_kept(tiny_params):
    model = kimi_jax.Model(TINY.replace(eos_token_ids=()), tiny_params)
    free = model.generate([[5, 6, 7]], max_new_tokens=8, method="ar").tokens[0]
    stop = free[3]
    model = kimi_jax.Model(TINY.replace(eos_token_ids=(stop,)), tiny_params)
    got = model.generate([[5, 6, 7]], max_new_tokens=8, method="ar").tokens[0]
    assert got == free[:free.index(stop) + 1]


@pytest.mark.slow
def test_sampling_is_seeded(tiny_params):
    model = kimi_jax.Model(TINY.replace(eos_token_ids=()), tiny_params)
    a = model.generate([[1, 2, 3]], max_new_tokens=12, temperature=1.0, seed=7).tokens
    b = model.generate([[1, 2, 3]], max_new_tokens=12, temperature=1.0, seed=7).tokens
    c = model.generate([[1, 2, 3]], max_new_tokens=12, temperature=1.0, seed=8).tokens
    assert a == b and a != c


@pytest.mark.slow
def test_orbax_round_trip(tmp_path):
    cfg, params = hf.load(str(FIXTURES / "hf_k25"))
    checkpoint.save(str(tmp_path / "ck"), cfg, params)
    model = kimi_jax.load(str(tmp_path / "ck"))
    assert model.config == cfg
    ids = np.load(FIXTURES / "hf_k25" / "reference.npz")["input_ids"]
    np.testing.assert_allclose(model.logits(ids), kimi_jax.load(str(FIXTURES / "hf_k25")).logits(ids), rtol=1e-6)
    with pytest.raises(checkpoint.CheckpointError, match="already exists"):
        checkpoint.save(str(tmp_path / "ck"), cfg, params)


@pytest.mark.slow     # a long compile (the full K2.6 decode step); fast: 3-layer K2.6 rounds in test_kernel_selection
def test_full_k26_abstract_and_aot_compile():
    """eval_shape of the full params and AOT compile of a one-token decode step, nothing allocated."""
    cfg = preset("kimi-k2.6")
    t0 = time.perf_counter()
    params = abstract_params(cfg, jnp.bfloat16)
    assert params["moe_layers"]["moe"]["experts"].w13.shape == (60, 384, 2, 7168 // 8, 2048)
    shapes = jax.eval_shape(lambda: init_params(cfg.replace(int4_experts=False), jax.random.key(0)))
    assert shapes["moe_layers"]["moe"]["experts"]["gate"].shape == (60, 384, 7168, 2048)
    cache = KVCache(jax.ShapeDtypeStruct((61, 1, 4096, 576), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32))
    step = jax.jit(lambda p, t, c: forward(p, cfg, t, c)[:2], donate_argnums=(2,))
    compiled = step.lower(params, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache).compile()
    # INT4 experts + bf16 rest = the ~594 GB of the HF checkpoint (plus the 4.3 GB latent cache at 4k)
    assert 5.9e11 < compiled.memory_analysis().argument_size_in_bytes < 6.1e11
    assert time.perf_counter() - t0 < 120


# ---- bad input -------------------------------------------------------------------------------------------

def test_config_of_another_architecture_is_rejected():
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 8})


def test_config_missing_field_is_named():
    hf = json.loads((FIXTURES / "hf_k25" / "config.json").read_text())
    del hf["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelConfig.from_hf(hf)


def test_kimi_k25_config_reads_text_config():
    hf = json.loads((FIXTURES / "hf_k25" / "config.json").read_text())
    wrapped = {"model_type": "kimi_k25", "text_config": {**hf, "model_type": "kimi_k2"}}
    assert ModelConfig.from_hf(wrapped).replace(name="x") == ModelConfig.from_hf(hf).replace(name="x")


def test_token_ids_out_of_range(tiny_params):
    model = kimi_jax.Model(TINY, tiny_params)
    with pytest.raises(GenerationError, match="token id 256 is outside"):
        model.generate([[1, 256]], max_new_tokens=2)
    with pytest.raises(GenerationError, match="outside"):
        model.logits([3, -1])


def test_prompt_longer_than_context(tiny_params):
    model = kimi_jax.Model(TINY.replace(max_position_embeddings=32), tiny_params)
    with pytest.raises(GenerationError, match="exceeds the context of 32"):
        model.generate([list(range(30))], max_new_tokens=8)


def test_checkpoint_shape_disagrees_with_config(tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(FIXTURES / "hf_k25", d)
    hf = json.loads((d / "config.json").read_text())
    hf["q_lora_rank"] = 48
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(checkpoint.CheckpointError, match="q_a_proj.weight.*shape"):
        kimi_jax.load(str(d))


def test_damaged_weight_file_is_a_checkpoint_error_naming_the_array(tmp_path):
    """Without a manifest (an old checkpoint), a truncated orbax data file surfaces at the loader as
    CheckpointError with the array and byte range named (storage errors are caught at that one boundary)."""
    src = FIXTURES.parent.parent / "checkpoints" / "target"
    d = tmp_path / "target"
    shutil.copytree(src, d)
    (d / "manifest.json").unlink()
    biggest = max((d / "params").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    os.truncate(biggest, biggest.stat().st_size // 2)
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot read the orbax checkpoint .*params.*Error reading"):
        kimi_jax.load(str(d))
