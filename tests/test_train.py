"""Training of the embedded target: the training forward equals the model, loss decreases, the router bias
moves toward balance, and a resumed run continues at the right step with identical params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.config import TINY
from kimi_jax.model.params import init_params
from kimi_jax.model.transformer import full_logits
from kimi_jax.training import corpus
from kimi_jax.training import target as T
from kimi_jax.training.optim import Hyper

CFG = TINY.replace(num_hidden_layers=2, vocab_size=64, rope_original_max_position_embeddings=16)
STREAM = np.tile(np.arange(64, dtype=np.int32), 40)            # a learnable cyclic sequence
HP = Hyper(lr=1e-2, warmup=2, total=8, bias_gamma=0.01)


@pytest.mark.slow
def test_train_forward_matches_model():
    p = init_params(CFG, jax.random.PRNGKey(0))
    bias = p["moe_layers"]["moe"]["router_bias"]
    p["moe_layers"]["moe"]["router_bias"] = 0.1 * jax.random.normal(jax.random.PRNGKey(1), bias.shape)
    tok = jax.random.randint(jax.random.PRNGKey(2), (2, 10), 0, CFG.vocab_size)
    logits, loads = T.train_forward(p, CFG, tok)
    np.testing.assert_allclose(logits, full_logits(p, CFG, tok), atol=1e-4, rtol=1e-4)
    assert loads.shape == (CFG.num_moe_layers, CFG.n_routed_experts)
    np.testing.assert_array_equal(loads.sum(-1), 2 * 10 * CFG.num_experts_per_tok)


@pytest.mark.slow
def test_loss_decreases_and_resume_is_exact(tmp_path):
    lines = []
    state, hist = T.train(CFG, STREAM, steps=8, batch=4, seq_len=16, seed=3, hp=HP, log_every=1,
                          log=lines.append)
    assert int(state["step"]) == 8
    assert hist[-1][1] < hist[0][1] - 0.5, hist
    # Interrupted after 4 steps (state saved), then the same command again: it resumes at step 4.
    d = str(tmp_path / "state")
    T.train(CFG, STREAM, steps=4, batch=4, seq_len=16, seed=3, hp=HP, state_dir=d, save_every=2,
            log=lambda m: None)
    assert T.latest_state(d).endswith("step_00000004")
    lines = []
    resumed, _ = T.train(CFG, STREAM, steps=8, batch=4, seq_len=16, seed=3, hp=HP, state_dir=d,
                         save_every=100, log=lines.append)
    assert any("resumed" in l and "step 4" in l for l in lines), lines
    assert int(resumed["step"]) == 8
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bias_balancing_moves_toward_balance():
    loads = jnp.array([[10.0, 0.0, 2.0, 4.0]])
    b = T.balance_bias(jnp.zeros((1, 4)), loads, 0.1)
    np.testing.assert_allclose(b, [[-0.1, 0.1, 0.1, 0.0]])   # load == mean: unchanged
    # Through the train step: a router skewed toward expert 0 gets a lower bias for it, no gradient on it.
    p = init_params(CFG, jax.random.PRNGKey(0))
    p["moe_layers"]["moe"]["router"] = p["moe_layers"]["moe"]["router"].at[:, :, 0].add(5.0)
    step = T.make_train_step(CFG, HP)
    state = T.init_state(p)
    for i in range(3):
        state, m = step(state, T.sample_batch(STREAM, 0, i, 4, 16))
    bias = np.asarray(state["params"]["moe_layers"]["moe"]["router_bias"])
    assert (bias[:, 0] < 0).all()
    assert np.abs(bias).max() <= 0.03 + 1e-6
    assert np.all(np.asarray(state["mu"]["moe_layers"]["moe"]["router_bias"]) == 0)


def test_heldout_rule_is_deterministic():
    assert corpus.is_held_out("contextlib.py") and not corpus.is_held_out("os.py")
    files = corpus.stdlib_files()
    held = [f for f in files if corpus.is_held_out(f)]
    assert 0 < len(held) < len(files) // 10
    assert not any("/test/" in "/" + f or f.startswith("test_") for f in files)
