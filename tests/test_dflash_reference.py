"""Our DFlash drafter against the authors' own implementation (PyPI ``dflash`` 0.1.0, PyTorch).

The fixtures in tests/fixtures/dflash/ were written by tests/fixtures/make_dflash_fixtures.py in a test-only
environment that has the package: drafters saved by its ``DFlashDraftModel.save_pretrained`` (so loading them also
checks the published layout), its forward outputs, and ``dflash_generate``'s tokens and acceptance lengths.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES

import kimi_jax
from kimi_jax.config import preset
from kimi_jax.decoding import drafter as dflash
from kimi_jax.weights.drafter import load_drafter

FORWARD = ("taps_mha", "formula_gqa", "window_causal", "window_noncausal", "yarn_scaled")
# A target the fixtures' drafters fit (hidden 32, vocab 128, at least 8 layers to tap)
TARGET = preset("tiny").replace(hidden_size=32, vocab_size=128, num_hidden_layers=8)


def forward_case(name):
    d = FIXTURES / "dflash" / f"forward_{name}"
    ref = np.load(d / "reference.npz")
    drafter = load_drafter(str(d), TARGET)
    target = {"embed": jnp.asarray(ref["embed"]), "lm_head": jnp.asarray(ref["lm_head"])}
    return drafter, target, ref


def ours(drafter, target, taps, block, commit_sizes=None):
    """Commit the context (at once, or in pieces as rounds do), then the block's hidden states and logits."""
    c, p = drafter.config, drafter.params
    t, bs = taps.shape[2], block.shape[1]
    if commit_sizes is None:
        cache, _ = dflash.prefill_features(p, c, target, taps, jnp.asarray([t]), t + bs)
    else:
        cache, _ = dflash.prefill_features(p, c, target, taps[:, :, :commit_sizes[0]], jnp.asarray([commit_sizes[0]]),
                                        t + bs)
        start = commit_sizes[0]
        for n in commit_sizes[1:]:
            path = jnp.arange(n, dtype=jnp.int32)[None]
            cache = dflash.commit_features(p, c, target, cache, taps[:, :, start:start + n], path,
                                           jnp.asarray([n]), jnp.asarray([start]))
            start += n
    hidden = dflash.draft_hidden(p, c, target, cache, block[:, 0], jnp.asarray([t]), bs)
    logits = dflash.draft(p, c, target, cache, block[:, 0], jnp.asarray([t]), bs)
    return np.asarray(hidden), np.asarray(logits), cache


# One forward in the fast loop (formula_gqa: GQA, formula taps); taps_mha's and window_noncausal's logits are checked
# against the reference through the cached-prefix path (test_a_prompt_after_a_cached_prefix_equals_the_reference),
# the causal window and YaRN scaling in the full suite.
@pytest.mark.parametrize("name", [n if n == "formula_gqa" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FORWARD])
def test_draft_hidden_and_logits_equal_the_reference(name):
    drafter, target, ref = forward_case(name)
    hidden, logits, _ = ours(drafter, target, jnp.asarray(ref["taps"]), jnp.asarray(ref["block"]))
    np.testing.assert_allclose(hidden, ref["hidden"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-4, atol=1e-4)


def test_configs_read_as_the_reference_reads_them():
    c = {n: forward_case(n)[0].config for n in FORWARD}
    assert c["taps_mha"].target_layer_ids == (0, 2, 3) and c["taps_mha"].context_window is None
    assert c["formula_gqa"].target_layer_ids == (1, 4, 7)             # build_target_layer_ids(10, 3)
    assert (c["formula_gqa"].block_size, c["formula_gqa"].num_key_value_heads) == (5, 2)
    assert c["window_causal"].causal == (False, True, True) and c["window_causal"].window == (0, 6, 6)
    assert c["window_causal"].context_window is None                  # a full layer still reads every row
    assert c["window_noncausal"].causal == (False, False) and c["window_noncausal"].context_window == 7
    y = c["yarn_scaled"]
    assert (y.rope_factor, y.input_embedding_scale, y.output_multiplier, y.final_logit_softcapping) == (8, 2, .5, 3)


@pytest.mark.parametrize("name", ["taps_mha", "window_noncausal"])
def test_a_prompt_after_a_cached_prefix_equals_the_reference(name):
    """A prefix cache's path: the first 8 positions' context rows come from an earlier prefill (padded with
    rows past the prefix that must be ignored), the other 12 are prefilled from position 8; the window-7 ring
    keeps only the newest 7 of the 20."""
    drafter, target, ref = forward_case(name)
    c, p = drafter.config, drafter.params
    taps, block = jnp.asarray(ref["taps"]), jnp.asarray(ref["block"])
    t, bs = taps.shape[2], block.shape[1]
    _, (k, v) = dflash.prefill_features(p, c, target, taps[:, :, :12], jnp.asarray([12]), t + bs)
    junk = jnp.full_like(k[:, :, 8:], 9.0)           # rows 8..11 of the earlier prefill: not the prefix's
    earlier = (jnp.concatenate([k[:, :, :8], junk], 2), jnp.concatenate([v[:, :, :8], junk], 2))
    cache, _ = dflash.prefill_features(p, c, target, taps[:, :, 8:], jnp.asarray([t - 8]), t + bs,
                                       start=jnp.asarray([8]), earlier=earlier)
    logits = dflash.draft(p, c, target, cache, block[:, 0], jnp.asarray([t]), bs)
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_ring_feature_cache_wraps_and_still_equals_the_reference():
    """Window 7 on every layer: 7 slots for a 20-token context committed in rounds of 3-4 rows, so the ring
    wraps twice; the block must still see exactly the reference's window."""
    drafter, target, ref = forward_case("window_noncausal")
    taps = jnp.asarray(ref["taps"])
    hidden, logits, cache = ours(drafter, target, taps, jnp.asarray(ref["block"]), commit_sizes=(6, 4, 3, 4, 3))
    assert cache.k.shape[2] == 7
    np.testing.assert_allclose(hidden, ref["hidden"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.slow      # guards the window tests themselves (that they are not vacuous), not the library
def test_the_window_matters():
    """Guard against a vacuous window test: with every row visible the logits differ from the reference's."""
    drafter, target, ref = forward_case("window_noncausal")
    unwindowed = dflash.Drafter(drafter.config.replace(layer_window=()), drafter.params)
    _, logits, _ = ours(unwindowed, target, jnp.asarray(ref["taps"]), jnp.asarray(ref["block"]))
    assert np.abs(logits - ref["logits"]).max() > 1e-2


@pytest.fixture(scope="module")
def e2e():
    model = kimi_jax.load(str(FIXTURES / "hf_k25"), drafter=str(FIXTURES / "dflash" / "e2e"))
    return model, np.load(FIXTURES / "dflash" / "e2e" / "reference.npz")


@pytest.mark.parametrize("case", ["stop", pytest.param("length", marks=pytest.mark.slow)])
def test_greedy_dflash_equals_reference_dflash_generate(e2e, case):
    model, ref = e2e
    stop = tuple(int(t) for t in ref[f"{case}_stop"])
    m = kimi_jax.Model(model.config.replace(eos_token_ids=stop), model.params, drafter=model.drafter)
    g = m.generate(ref["prompt"][0].tolist(), max_new_tokens=int(ref[f"{case}_max_new"]), method="dflash")
    assert g.tokens[0] == ref[f"{case}_tokens"].tolist()
    # The reference counts the tokens each round emitted; ours counts accepted + bonus, which differs only in a
    # round cut short by a stop token or max_new_tokens. Its block is also shortened near max_new_tokens (ours
    # always drafts a whole block), so only rounds with a whole block in both are compared one by one.
    want = ref[f"{case}_acceptance"].tolist()
    got = g.stats["tau_per_round"][0]
    assert len(got) == len(want)
    emitted = np.minimum(np.asarray(got), len(g.tokens[0]) - 1 - np.concatenate([[0], np.cumsum(got)[:-1]]))
    whole = [i for i in range(len(want)) if 1 + sum(want[:i]) + drafter_block(m) <= int(ref[f"{case}_max_new"])]
    assert emitted[whole].tolist() == [want[i] for i in whole]
    assert max(want) > 2                                             # the fixture's rounds really accept drafts


def drafter_block(model):
    return model.drafter.config.block_size
