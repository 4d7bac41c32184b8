"""Long prompts: chunked prefill (kimi_jax.model.transformer.chunked_forward) against the one-shot forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimi_jax
from kimi_jax.api import _chunked_logits
from kimi_jax.config import Runtime, preset
from kimi_jax.decoding import drafter as dflash
from kimi_jax.model.params import init_params
from kimi_jax.model.transformer import full_logits

CFG = preset("tiny").replace(max_position_embeddings=32768)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


@pytest.mark.parametrize("chunk", [pytest.param(64, marks=pytest.mark.slow), 100,
                                   pytest.param(128, marks=pytest.mark.slow)])
def test_chunked_logits_equal_one_shot(params, chunk):
    ids = np.random.default_rng(0).integers(2, 250, (2, 300))
    one_shot = kimi_jax.Model(CFG, params).logits(ids)
    chunked = kimi_jax.Model(CFG, params, runtime=Runtime(prefill_chunk=chunk)).logits(ids)
    np.testing.assert_allclose(chunked, one_shot, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_chunked_prefill_generates_the_one_shot_tokens_for_rows_of_very_different_lengths(params):
    rng = np.random.default_rng(1)
    rows = [rng.integers(2, 250, n).tolist() for n in (300, 7, 130)]
    dcfg = dflash.DrafterConfig(hidden_size=CFG.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=CFG.vocab_size,
                                block_size=4, mask_token_id=255, target_layer_ids=(0, 2))
    drafter = dflash.Drafter(dcfg, dflash.init_params(dcfg, jax.random.key(1)))
    want = kimi_jax.Model(CFG, params).generate(rows, 10, method="ar").tokens
    for method in ("ar", "ddtree"):
        m = kimi_jax.Model(CFG, params, drafter=drafter, runtime=Runtime(prefill_chunk=32))
        assert m.generate(rows, 10, method=method, budget=6).tokens == want


@pytest.mark.slow
def test_a_16k_prompt_runs_in_chunks_without_quadratic_memory(params):
    """16384 tokens: one-shot attention scores alone would be 4 heads x 16384^2 x 4 bytes = 4 GiB; in chunks of
    1024 the whole program's temporaries stay far below that, and causality checks the values."""
    t = 16384
    ids = jnp.asarray(np.random.default_rng(2).integers(2, 250, (1, t)), jnp.int32)
    compiled = _chunked_logits.lower(params, CFG, ids, rt=Runtime()).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 1 << 30
    logits = np.asarray(compiled(params, ids))
    np.testing.assert_allclose(logits[0, :512], full_logits(params, CFG, ids[:, :512])[0], rtol=2e-4, atol=2e-4)
    assert np.isfinite(logits).all()


@pytest.mark.slow
def test_greedy_ddtree_on_a_paged_cache_equals_ar_after_a_long_prompt(params):
    """A 4000-token prompt prefilled in 16 chunks into 16 pages: DDTree with a random drafter on the paged cache
    emits plain AR's tokens on the contiguous cache (prefilled in 4 chunks of the default 1024). What is long about
    it is the number of chunks and pages; the memory at 16k tokens is the test above, positions past 100k the
    YaRN test below."""
    prompt = [np.random.default_rng(3).integers(2, 250, 4000).tolist()]
    dcfg = dflash.DrafterConfig(hidden_size=CFG.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=CFG.vocab_size,
                                block_size=4, mask_token_id=255, target_layer_ids=(0, 2))
    drafter = dflash.Drafter(dcfg, dflash.init_params(dcfg, jax.random.key(1)))
    want = kimi_jax.Model(CFG, params).generate(prompt, 12, method="ar").tokens
    paged = kimi_jax.Model(CFG, params, drafter=drafter, runtime=Runtime(page_size=256, prefill_chunk=256))
    got = paged.generate(prompt, 12, method="ddtree", budget=6)
    assert got.tokens == want and got.stats["rounds"] >= 1


@pytest.mark.slow
def test_yarn_logits_beyond_100k_positions_equal_hf(tmp_path):
    """K2.6's rope scaling (factor 64 over 4096 positions) at positions 150000..150015: the logits equal HF
    transformers', closer than HF's own logits at positions 0..15 are (RoPE is relative; only large-angle float32
    arithmetic differs, and it must differ the same way)."""
    import shutil

    from conftest import FIXTURES

    from kimi_jax.cache import init_cache
    from kimi_jax.model.transformer import forward
    from kimi_jax.weights.hf import load as load_hf
    shutil.copy(FIXTURES / "hf_long_rope" / "config.json", tmp_path)
    shutil.copy(FIXTURES / "hf_k25" / "model.safetensors", tmp_path)
    cfg, p = load_hf(str(tmp_path))
    assert (cfg.rope_factor, cfg.rope_original_max_position_embeddings, cfg.max_position_embeddings) == \
        (64.0, 4096, 262144)
    ref = np.load(FIXTURES / "hf_long_rope" / "reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    out = forward(p, cfg, ids, init_cache(cfg, 1, ids.shape[1]), positions=jnp.asarray(ref["positions"]))
    near = forward(p, cfg, ids, init_cache(cfg, 1, ids.shape[1])).logits
    far_err = np.abs(np.asarray(out.logits) - ref["logits"]).max()
    assert far_err < 1e-4 < np.abs(np.asarray(near) - ref["logits"]).max()


def test_a_cache_that_cannot_fit_names_the_memory(params, monkeypatch):
    from kimi_jax import api
    from kimi_jax.decoding.engine import GenerationError
    monkeypatch.setattr(api, "device_memory_bytes", lambda: 1 << 20)          # a 1 MiB device
    m = kimi_jax.Model(CFG, params)
    need = CFG.num_hidden_layers * 1 * 32768 * CFG.latent_dim * 4
    with pytest.raises(GenerationError, match=f"needs {need / 2**30:.2f} GiB but the device has 0.00 GiB"):
        m.generate([[5] * 20000], 8, method="ar")
    with pytest.raises(GenerationError, match="34000 tokens leaves no room .* context of 32768"):
        m.generate([[5] * 34000], 8, method="ar")                 # before any compute
