"""Drafter training sees exactly what serving sees: packed training blocks equal the serving draft."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.cache import init_cache
from kimi_jax.config import preset
from kimi_jax.decoding import drafter as dflash
from kimi_jax.model.params import init_params
from kimi_jax.model.transformer import forward
from kimi_jax.training.drafter import block_batch, packed_logits

CFG = preset("tiny")
DCFG = dflash.DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, vocab_size=256, block_size=5, mask_token_id=255,
                            target_layer_ids=(0, 2))


def test_labels_are_the_tokens_at_each_slot_position():
    seqs = np.random.default_rng(0).integers(0, 200, (3, 40)).astype(np.int32)
    anchors, tokens, positions, labels = block_batch(np.random.default_rng(1), seqs, 4, 5, 255)
    assert (labels == np.take_along_axis(seqs, positions, 1)).all()
    tokens = tokens.reshape(3, 4, 5)
    assert (tokens[:, :, 0] == np.take_along_axis(seqs, anchors, 1)).all() and (tokens[:, :, 1:] == 255).all()


@pytest.mark.slow
def test_packed_training_blocks_equal_the_serving_draft():
    target = init_params(CFG, jax.random.key(0), scale=2.0)
    dparams = dflash.init_params(DCFG, jax.random.key(1))
    seqs = np.random.default_rng(2).integers(0, 200, (1, 24)).astype(np.int32)
    taps = forward(target, CFG, jnp.asarray(seqs), init_cache(CFG, 1, 24), taps=DCFG.target_layer_ids).taps
    anchors, tokens, positions, _ = block_batch(np.random.default_rng(3), seqs, 3, 5, 255)
    packed = packed_logits(dparams, DCFG, target, taps, anchors, tokens, positions).reshape(1, 3, 5, -1)
    for i, a in enumerate(anchors[0]):
        cache, _ = dflash.prefill_features(dparams, DCFG, target, taps, jnp.asarray([a]), 24)
        served = dflash.draft(dparams, DCFG, target, cache, jnp.asarray(seqs[:, a]), jnp.asarray([a]), 5)
        np.testing.assert_allclose(packed[0, i, 1:], served[0], rtol=2e-4, atol=2e-4)
