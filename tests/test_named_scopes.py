"""The model's parts are named in the HLO: every op of the embedded default's DDTree generate program carries the
jax.named_scope path of the block it came from in its op_name metadata (what profiles and per-scope kernel counts
read)."""

import re

import pytest

import kimi_jax

from conftest import FIXTURES

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"

ATTENTION_PARTS = ("qkv_proj", "rope", "cache_write", "attend", "o_proj")
MODEL_PARTS = ("embed", "attention", "norm", "router", "experts", "shared_expert", "dense_mlp", "head", "drafter")


@pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")
def test_every_model_part_names_its_ops():
    model = kimi_jax.load(str(TARGET), drafter=str(DRAFTER))
    request = model.prepare("def f(x):\n", 8, "ddtree", 8)
    lowered = model.lower(request)
    op_names = re.findall(r'op_name="([^"]*)"', lowered.as_text(dialect="hlo", debug_info=True))
    scopes = {part for name in op_names for part in name.split("/")}
    assert set(MODEL_PARTS) <= scopes, sorted(set(MODEL_PARTS) - scopes)
    # the MLA block's steps sit inside it (RoPE and the cache write inside the projections that hold them:
    # kimi_jax.ops.latent)
    inside = ["/" + name.split("/attention/", 1)[1] for name in op_names if "/attention/" in name]
    for part in ATTENTION_PARTS:
        assert any(f"/{part}/" in name for name in inside), part
