"""The JAX model against HF transformers' DeepseekV3ForCausalLM (fixtures from tests/fixtures/make_hf_fixtures.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, HF_FIXTURES

import kimi_jax
from kimi_jax.cache import init_cache
from kimi_jax.model.layers import yarn_inv_freq
from kimi_jax.model.transformer import forward, full_logits
from kimi_jax.weights.hf import load as load_hf


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


# The fast loop checks hf_k25; hf_k2 (hf_k25's forward but for the YaRN step, which test_yarn_at_real_size_matches_hf
# checks at the real size, and the norm eps) and hf_grouped (grouped routing, n_group 4: K2.x's is 1) in the full suite.
@pytest.fixture(scope="module", params=[n if n == "hf_k25" else pytest.param(n, marks=pytest.mark.slow)
                                        for n in HF_FIXTURES])
def hf(request):
    d = FIXTURES / request.param
    cfg, params = load_hf(str(d))
    return request.param, cfg, params, np.load(d / "reference.npz")


def test_config_reads_release_fields(hf):
    name, cfg, _, ref = hf
    assert cfg.rope_factor == {"hf_k25": 64.0, "hf_k2": 32.0, "hf_grouped": 64.0}[name]
    assert (cfg.rope_beta_fast, cfg.rope_beta_slow) == {"hf_k2": (1.0, 1.0)}.get(name, (32.0, 1.0))
    assert cfg.rms_norm_eps == (1e-6 if name == "hf_k2" else 1e-5)
    assert cfg.softmax_scale == pytest.approx(float(ref["softmax_scale"]), rel=1e-6)
    assert cfg.n_group == (4 if name == "hf_grouped" else 1)


@pytest.mark.parametrize("form", ["full", "absorbed"])
def test_logits_match_hf(hf, form):
    _, cfg, params, ref = hf
    logits = full_logits(params, cfg, jnp.asarray(ref["input_ids"]), attn_form=form)
    assert rel_err(logits, ref["logits"]) < 1e-4


def test_hidden_state_taps_match_hf(hf):
    _, cfg, params, ref = hf
    ids = jnp.asarray(ref["input_ids"])
    layers = tuple(range(cfg.num_hidden_layers))
    out = forward(params, cfg, ids, init_cache(cfg, *ids.shape), taps=layers)
    # HF hidden_states[l + 1] is the output of layer l; its last entry (and our last tap) is after the final norm.
    for l in layers:
        assert rel_err(out.taps[l], ref["hidden_states"][l + 1]) < 1e-4


def test_yarn_inv_freq_matches_hf(hf):
    _, cfg, _, ref = hf
    np.testing.assert_allclose(yarn_inv_freq(cfg), ref["inv_freq"], rtol=1e-6)


def test_yarn_at_real_size_matches_hf():
    """Rope dim 64 and original length 4096: the fractional YaRN blend of K2.5 and the hard step of K2."""
    ref = np.load(FIXTURES / "hf_yarn_inv_freq.npz")
    base = kimi_jax.preset("kimi-k2.6")
    cases = {"k2_0711": (32.0, 1.0, 1.0), "k2_0905": (64.0, 1.0, 1.0), "k25": (64.0, 32.0, 1.0)}
    for name, (factor, fast, slow) in cases.items():
        cfg = base.replace(rope_factor=factor, rope_beta_fast=fast, rope_beta_slow=slow)
        np.testing.assert_allclose(yarn_inv_freq(cfg), ref[f"{name}_inv_freq"], rtol=1e-6)
        assert cfg.softmax_scale == pytest.approx(float(ref[f"{name}_softmax_scale"]), rel=1e-6)


def test_greedy_generate_matches_hf(hf):
    name, cfg, params, ref = hf
    model = kimi_jax.Model(cfg, params)
    out = model.generate(ref["gen_prompt"][0].tolist(), max_new_tokens=ref["gen_tokens"].shape[1], method="ar")
    assert out.tokens == ref["gen_tokens"].tolist()
    assert out.stats["dispatches"] == 1
