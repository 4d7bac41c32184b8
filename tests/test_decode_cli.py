"""`python -m kimi_jax.decode`: the embedded default runs, and every bad input is one line on stderr + exit != 0."""

import json
import os
import subprocess
import sys

import pytest
from conftest import FIXTURES

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
needs_default = pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")


def decode(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = ""                     # one CPU device, like a user's shell
    return subprocess.run([sys.executable, "-m", "kimi_jax.decode", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def one_line_error(res, *words):
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@needs_default
@pytest.mark.slow
def test_default_run_json():
    res = decode("--max-new-tokens", "24", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["method"] == "ddtree" and 1 <= len(out["tokens"]) <= 24
    assert out["stats"]["dispatches"] == 1 and out["stats"]["mean_tau"] >= 1.0
    assert set(out["stats"]["width_per_round"]) <= {0, 4, 8, 16, 32}          # --budget auto is the default


@needs_default
@pytest.mark.slow
def test_stream_prints_text_then_stats():
    res = decode("--prompt", "import os\n", "--max-new-tokens", "16", "--stream", "--method", "dflash")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("import os\n") and len(res.stdout) > len("import os\n")
    assert "tok/s" in res.stderr and "dispatches" in res.stderr


def test_missing_checkpoint():
    one_line_error(decode("--checkpoint", "/nonexistent/ck", "--method", "ar"), "does not exist")


@pytest.mark.parametrize("flags,words", [(["--budget", "-3"], ["budget", ">= 0"]), (["--budget", "wide"], ["--budget", "auto"]), (["--max-new-tokens", "0"], ["max_new_tokens", ">= 1"]),
                                         (["--method", "beam"], ["invalid choice"]), (["--temperature", "x"], ["invalid float"])])
def test_bad_flag_values(flags, words):
    one_line_error(decode(*flags), *words)


@needs_default
def test_drafter_that_does_not_fit(tmp_path):
    cfg = json.loads((DRAFTER / "drafter_config.json").read_text())
    bad = tmp_path / "drafter"
    bad.mkdir()
    os.symlink(DRAFTER / "params", bad / "params")
    (bad / "drafter_config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 1}))
    one_line_error(decode("--drafter", str(bad), "--max-new-tokens", "4"), "vocab_size")


@needs_default
def test_prompt_longer_than_context(tmp_path):
    long_prompt = tmp_path / "p.py"
    long_prompt.write_text("x = 1\n" * 3000)
    one_line_error(decode("--prompt-file", str(long_prompt), "--max-new-tokens", "4"), "context")


def test_mesh_larger_than_the_devices():
    one_line_error(decode("--mesh", "ep=2", "--method", "ar", "--max-new-tokens", "4"), "needs 2 devices")
