"""bench/gpu_check.py, the prepared GPU check, kept from rotting: its CPU smoke run (--tiny: small shapes,
interpret-mode Pallas) end to end in a subprocess, its refusal without a GPU, and that its kernel check does catch
a wrong kernel."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest
from conftest import cpu_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ("kernels", "copy", "moe", "attention", "allreduce", "round")
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def run_check(*args, timeout=600):
    env = cpu_env()                                   # not conftest's 8 fake CPU devices
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.interpret
@pytest.mark.slow      # ~70 s on the 2-core VM: every section compiles its programs
def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = run_check("--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "total wall time" in proc.stdout
    result = json.loads(out.read_text())
    sec = result["sections"]
    assert result["tiny"] and result["interpret"] and result["wall_s"] > 0
    assert set(sec) == set(SECTIONS)
    for name in SECTIONS:
        assert sec[name]["status"] == "ok", (name, sec[name].get("error"), sec[name].get("traceback"))

    # 1. every kernel case against its reference, both impls, within tolerance
    cases = sec["kernels"]["cases"]
    assert {(c["kernel"], c["impl"]) for c in cases} == {(k, i) for k in ("int4_moe", "tree_attention")
                                                         for i in ("pallas", "xla", "mosaic")} | {
        (k, "pallas") for k in ("latent_projection", "absorbed_queries", "swiglu")}
    assert {c["dtype"] for c in cases if c["impl"] == "mosaic"} == {"bfloat16"}   # wgmma takes 16-bit inputs
    assert any(c["page_size"] for c in cases if c["kernel"] == "tree_attention")      # a paged cache is checked
    for c in cases:
        assert "error" not in c, c
        assert c["max_rel_err"] <= c["tol"] and c["ok"], c
        assert c["tol"] <= (1e-4 if c["dtype"] == "float32" else 3e-2)   # float32 on a CPU: exact up to order
    assert sec["kernels"]["passed"] == sec["kernels"]["checked"] == len(cases)

    # 2. copy bandwidth
    assert sec["copy"]["best_ms"] > 0 and sec["copy"]["gb_per_s"] > 0

    # 3. MoE: every token count, both impls, bytes/s against the copy bandwidth; tokamax skipped with a note
    rows = sec["moe"]["rows"]
    assert [r["tokens"] for r in rows] == [1, 8]
    for r in rows:
        assert r["bytes_per_call"] > 0
        for impl in ("pallas", "xla"):
            assert r[impl]["per_call_us"] > 0 and r[impl]["gb_per_s"] > 0 and r[impl]["frac_of_copy"] > 0, r
    assert isinstance(sec["moe"]["tokamax"], str)

    # 4. tree attention vs width
    rows = sec["attention"]["rows"]
    assert [r["width"] for r in rows] == [1, 5, 17]
    for r in rows:
        for impl in ("pallas", "xla"):
            assert r[impl]["per_call_us"] > 0 and r[impl]["gb_per_s"] > 0, r

    # 5. all-reduce: one CPU device here (run_check drops the fake devices), so it says why it timed nothing
    assert sec["allreduce"]["status_note"] == "skipped: 1 device (an all-reduce needs 2+)"

    # 6. the round: each kernel choice, AR and DDTree, timed and profiled by stage
    rows = sec["round"]["rows"]
    assert {(r["impl"], r["method"]) for r in rows} == {(i, m) for i in ("xla", "pallas") for m in ("ar", "ddtree")}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["compile_s"] > 0 and all(v > 0 for v in r["run_ms"].values()), r
        prof = r["profile"]
        assert "error" not in prof, prof
        assert prof["mapped_us"] > 0 and prof["shares"]["verify"] > 0, prof
        if r["method"] == "ddtree":
            assert prof["shares"]["draft"] > 0 and prof["shares"]["build_tree"] > 0, prof


def test_budget_skips_sections_with_a_note(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = run_check("--tiny", "--budget-s", "0", "--sections", "copy,round", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sec = json.loads(out.read_text())["sections"]
    assert set(sec) == {"copy", "round"}
    assert all(s["status"].startswith("skipped: budget") for s in sec.values()), sec
    assert "total wall time" in proc.stdout


def test_refuses_without_gpu():
    proc = run_check("--sections", "copy", timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "no GPU" in proc.stderr and "--tiny" in proc.stderr


@pytest.mark.interpret
@pytest.mark.slow      # ~15 s: interpret-mode Pallas compiles
def test_kernel_check_catches_a_wrong_kernel(monkeypatch):
    """The numbers are a real check: a Pallas MoE that drops each token's last expert and a Pallas or Mosaic GPU
    attention that reads the tree mask transposed (descendants instead of ancestors) fail their tolerance; xla
    stays ok."""
    from bench import gpu_check
    from kimi_jax.ops.int4_moe import api as moe_api
    from kimi_jax.ops.tree_attention import api as attn_api

    moe, attn = moe_api.int4_moe, attn_api.latent_attention

    def wrong_moe(x, idx, w, experts, *, impl="xla", **kw):
        return moe(x, idx, w.at[:, -1].set(0) if impl == "pallas" else w, experts, impl=impl, **kw)

    def wrong_attn(q, qpe, kv, lengths, mask, scale, *, impl="xla", **kw):
        return attn(q, qpe, kv, lengths, jnp.swapaxes(mask, 1, 2) if impl != "xla" else mask, scale,
                    impl=impl, **kw)

    monkeypatch.setattr(moe_api, "int4_moe", wrong_moe)
    monkeypatch.setattr(attn_api, "latent_attention", wrong_attn)
    plan = dataclasses.replace(gpu_check.TINY, moe_cases=gpu_check.TINY.moe_cases[:1],
                               attn_cases=(gpu_check.TINY.attn_cases[0], gpu_check.TINY.attn_cases[-1]))
    rec = {}
    gpu_check.check_kernels(plan, dict(on_gpu=False, tiny=True, budget=gpu_check.Budget(600)), rec)
    cases = rec["cases"]
    # int4_moe f32: pallas, xla; tree_attention f32: pallas, xla; bf16 paged-64: pallas, xla, mosaic
    assert [(c["kernel"], c["impl"]) for c in cases if c["kernel"] == "tree_attention"][2:] == \
        [("tree_attention", i) for i in ("pallas", "xla", "mosaic")]
    # and the latent projection, the absorbed queries and SwiGLU, untouched: ok
    assert len(cases) == rec["checked"] == 10 and rec["passed"] == 6
    for c in cases:
        if c["kernel"] in ("latent_projection", "absorbed_queries", "swiglu"):
            assert c["ok"], c
        elif c["impl"] == "xla":
            assert c["ok"] and c["max_rel_err"] <= (1e-4 if c["dtype"] == "float32" else c["tol"]), c
        else:
            assert not c["ok"] and c["max_rel_err"] > 0.05, c
