"""The shipped embedded default (checkpoints/): it loads, generates losslessly, and is a trained model."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES

import kimi_jax
from kimi_jax.model.transformer import full_logits

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (DRAFTER / "drafter_config.json").exists(), reason="embedded default not built")]


@pytest.fixture(scope="module")
def model():
    return kimi_jax.load(str(TARGET), drafter=str(DRAFTER))


@pytest.fixture(scope="module")
def heldout(model):
    from kimi_jax.training.corpus import heldout_prompts
    return heldout_prompts(model.tokenizer, 2, 48)


def test_shipped_target_is_int4_and_small(model):
    assert model.config.int4_experts
    size = sum(f.stat().st_size for d in (TARGET, DRAFTER) for f in d.rglob("*") if f.is_file())
    assert size < 12e6


def test_greedy_ddtree_equals_ar_on_heldout_prompts(model, heldout):
    ar = model.generate(heldout, 40, method="ar")
    for method, budget in (("dflash", None), ("ddtree", 32)):
        out = model.generate(heldout, 40, method=method, budget=budget)
        assert out.tokens == ar.tokens
        assert out.stats["mean_tau"] > 1.5                # the drafter really was trained
    assert model.tokenizer.decode(ar.tokens[0]) == ar.text[0]


def test_heldout_loss_below_model_card_bound(model):
    from kimi_jax.training.target import eval_windows, token_stream
    bound = float(re.search(r"held-out loss < ([0-9.]+)", (TARGET / "MODEL_CARD.md").read_text()).group(1))
    windows = eval_windows(token_stream(model.tokenizer, "heldout"), 256)   # the model card's held-out set
    assert len(windows) > 100

    @jax.jit
    def nll(params, w):
        logits = full_logits(params, model.config, w[:, :-1])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), w[:, 1:, None], -1).mean()

    chunks = np.array_split(windows, 7)
    loss = sum(float(nll(model.params, jnp.asarray(c))) * len(c) for c in chunks) / len(windows)
    assert loss < bound < np.log(model.config.vocab_size) / 1.5


def test_load_onto_a_mesh_splits_the_drafter_and_keeps_the_tokens(model, heldout):
    """load(mesh=) reads the drafter's checkpoint straight onto the shardings the programs run it on (its heads and
    MLP width over the mesh, drafter.param_shardings): no replicated copy of it on every device. DDTree on the
    mesh still emits the one-device AR tokens."""
    sharded = kimi_jax.load(str(TARGET), drafter=str(DRAFTER), mesh="ep=2")
    c, p = sharded.drafter.config, sharded.drafter.params
    q, gate = p["layers"]["q"], p["layers"]["gate"]
    assert q.sharding.shard_shape(q.shape)[2] == c.num_attention_heads // 2
    assert gate.sharding.shard_shape(gate.shape)[2] == c.intermediate_size // 2
    ar = model.generate(heldout, 16, method="ar").tokens
    assert sharded.generate(heldout, 16, method="ddtree", budget=8).tokens == ar
