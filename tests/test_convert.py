"""HF K2.6-layout import (kimi_jax.weights.convert), export back to HF, and sharded restore (CPU, 8 fake devices)."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import cpu_env, default_sigint
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import kimi_jax
from kimi_jax.model.params import abstract_params, param_shardings, quantize_experts
from kimi_jax.model.transformer import full_logits
from kimi_jax.ops.int4_format import Int4Experts, quantize_int4
from kimi_jax.weights import checkpoint, convert, export, hf
from kimi_jax.weights.checkpoint import CheckpointError

BF16 = ml_dtypes.bfloat16
TOKENS = jnp.array([[3, 17, 200, 45, 9, 120, 77, 5]], jnp.int32)
PRE = "language_model."


def _weight_map(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


@pytest.fixture(scope="module")
def k26(tmp_path_factory, fixtures_dir):
    """The hf_k25 fixture rewritten in K2.6's exact on-disk layout (INT4 experts, bf16 rest, shards + index)."""
    cfg, params = hf.load(str(fixtures_dir / "hf_k25"))
    qparams, qcfg = quantize_experts(params, cfg)
    d = str(tmp_path_factory.mktemp("k26"))
    export.export_hf(qparams, qcfg, d, int4=True, prefix=PRE, dtype=jnp.bfloat16, max_shard_bytes=40_000,
                      kimi_k25_wrapper=True, ignore=export.K26_IGNORE)
    return {"dir": d, "cfg": cfg, "params": params, "qparams": qparams, "qcfg": qcfg}


@pytest.fixture(scope="module")
def converted(k26, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("conv") / "ckpt")
    stats = convert.convert_hf(k26["dir"], out, progress=False)
    return out, stats


def test_k26_layout_on_disk(k26):
    d = k26["dir"]
    conf = json.load(open(os.path.join(d, "config.json")))
    assert conf["model_type"] == "kimi_k25" and conf["text_config"]["model_type"] == "kimi_k2"
    assert conf["quantization_config"]["ignore"] == export.K26_IGNORE
    wm = _weight_map(d)
    assert len(set(wm.values())) >= 3 and all(k.startswith(PRE) for k in wm)
    name = PRE + "model.layers.1.mlp.experts.3.gate_proj"
    with safe_open(os.path.join(d, wm[name + ".weight_packed"]), "numpy") as f:
        packed = f.get_tensor(name + ".weight_packed")
    with safe_open(os.path.join(d, wm[name + ".weight_scale"]), "numpy") as f:
        scale = f.get_tensor(name + ".weight_scale")
    with safe_open(os.path.join(d, wm[name + ".weight_shape"]), "numpy") as f:
        shape = f.get_tensor(name + ".weight_shape")
    with safe_open(os.path.join(d, wm[PRE + "model.layers.1.self_attn.q_b_proj.weight"]), "numpy") as f:
        assert f.get_tensor(PRE + "model.layers.1.self_attn.q_b_proj.weight").dtype == BF16
    assert packed.dtype == np.int32 and scale.dtype == BF16 and shape.dtype == np.int32
    # What compressed-tensors (quantize_int4, bit-exact against the package in test_quant.py) writes for the
    # HF [out, in] float weight.
    hf = load_file(os.path.join(os.path.dirname(__file__), "fixtures", "hf_k25", "model.safetensors"))
    want_p, want_s = quantize_int4(hf["model.layers.1.mlp.experts.3.gate_proj.weight"])
    np.testing.assert_array_equal(packed, want_p)
    np.testing.assert_array_equal(scale.view(np.uint16), want_s.view(np.uint16))
    assert shape.tolist() == list(hf["model.layers.1.mlp.experts.3.gate_proj.weight"].shape)


@pytest.mark.slow
def test_convert_logits_match_dequantised_reference(k26, converted):
    out, stats = converted
    cfg, params = checkpoint.restore(out, dtype=jnp.float32)
    assert cfg.int4_experts and isinstance(params["moe_layers"]["moe"]["experts"], Int4Experts)
    assert params["moe_layers"]["attn"]["q_b"].dtype == jnp.float32
    raw_cfg, raw = checkpoint.restore(out)
    assert raw["moe_layers"]["attn"]["q_b"].dtype == jnp.bfloat16            # stored bf16
    assert raw["moe_layers"]["moe"]["router_bias"].dtype == jnp.float32
    # INT4 bits survive the round trip HF triplets -> kernel layout -> disk exactly
    q = k26["qparams"]["moe_layers"]["moe"]["experts"]
    for f in ("w13", "s13", "w2", "s2"):
        np.testing.assert_array_equal(np.asarray(getattr(raw["moe_layers"]["moe"]["experts"], f)),
                                      np.asarray(getattr(q, f)))
    # Reference: the float model with bf16-rounded non-expert weights and experts = Int4Experts.dequantize().
    ref = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16).astype(jnp.float32) if a.dtype != jnp.int32 else a,
                       k26["qparams"])
    ref["moe_layers"]["moe"]["router_bias"] = k26["qparams"]["moe_layers"]["moe"]["router_bias"]
    ref["moe_layers"]["moe"]["experts"] = q.dequantize()
    want = full_logits(ref, k26["qcfg"].replace(int4_experts=False), TOKENS)
    got = full_logits(params, cfg, TOKENS)
    rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert rel < 1e-3, rel
    assert stats["converted"] == 3 and stats["bytes"] > 0 and stats["peak_rss_mib"] > 0
    assert not os.path.exists(os.path.join(out, convert.WORK_DIR))
    # the layered form: one orbax directory per decoder layer + globals, no stacked params/
    assert sorted(os.listdir(out)) == ["globals", "kimi_config.json", "layers", "manifest.json"]
    assert sorted(os.listdir(os.path.join(out, "layers"))) == ["layer_000", "layer_001", "layer_002"]


class _Killed(RuntimeError):
    pass


def test_killed_midway_then_resume_is_identical(k26, converted, tmp_path):
    out = str(tmp_path / "ckpt")

    def kill_after_layer_1(i):
        if i == 1:
            raise _Killed

    with pytest.raises(_Killed):
        convert.convert_hf(k26["dir"], out, progress=False, on_layer_written=kill_after_layer_1)
    work = os.path.join(out, convert.WORK_DIR)
    assert sorted(x for x in os.listdir(work) if x.startswith("layer_")) == ["layer_000", "layer_001"]
    assert not checkpoint.is_kimi_checkpoint(out)
    stats = convert.convert_hf(k26["dir"], out, progress=False)
    assert (stats["converted"], stats["skipped"]) == (1, 2)
    assert_same_checkpoint(out, converted[0])
    with pytest.raises(CheckpointError, match="already holds"):
        convert.convert_hf(k26["dir"], out, progress=False)


def assert_same_checkpoint(out, ref_dir):
    """Same config bytes and bit-identical arrays (orbax's file names are random, so files are not compared)."""
    assert open(os.path.join(out, "kimi_config.json"), "rb").read() == \
        open(os.path.join(ref_dir, "kimi_config.json"), "rb").read()
    a = checkpoint.flat(checkpoint.restore(out, verify=True)[1])
    b = checkpoint.flat(checkpoint.restore(ref_dir)[1])
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8), err_msg=k)


@pytest.mark.slow
def test_ctrl_c_during_convert_exits_130_and_the_rerun_resumes(k26, converted, tmp_path):
    """SIGINT right after layer 1 is written: one line, status 130, no checkpoint yet; the same command again
    converts the rest and the result equals an uninterrupted conversion."""
    out = str(tmp_path / "ckpt")
    env = cpu_env()
    interrupted = ("import os, signal, sys\n"
                   "from kimi_jax.cli.exits import exit_with, run_command\n"
                   "from kimi_jax.weights.convert import convert_hf\n"
                   "ctrl_c = lambda i: i == 1 and os.kill(os.getpid(), signal.SIGINT)\n"
                   "exit_with(run_command('kimi_jax.convert', lambda: [convert_hf(sys.argv[1], sys.argv[2], "
                   "progress=False, on_layer_written=ctrl_c), 0][1]))\n")
    res = subprocess.run([sys.executable, "-c", interrupted, k26["dir"], out], capture_output=True, text=True,
                         env=env, timeout=300, preexec_fn=default_sigint)
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1] == "kimi_jax.convert: interrupted"
    assert not checkpoint.is_kimi_checkpoint(out)
    res = subprocess.run([sys.executable, "-m", "kimi_jax.convert", "--hf", k26["dir"], "--out", out, "--quiet"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "converted 1 layers (skipped 2" in res.stdout, res.stdout + res.stderr
    assert_same_checkpoint(out, converted[0])


def test_truncated_shard_names_it_and_keeps_done_layers(k26, tmp_path):
    d = str(tmp_path / "hf")
    shutil.copytree(k26["dir"], d)
    wm = _weight_map(d)
    bad = wm[PRE + "model.layers.2.mlp.experts.15.down_proj.weight_packed"]
    assert not any(f == bad for k, f in wm.items() if ".layers.0." in k or ".layers.1." in k)
    path = os.path.join(d, bad)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    out = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=bad):
        convert.convert_hf(d, out, progress=False)
    work = os.path.join(out, convert.WORK_DIR)
    assert sorted(x for x in os.listdir(work) if x.startswith("layer_")) == ["layer_000", "layer_001"]
    layer0 = jax.tree.map(np.asarray, checkpoint.restore_tree(os.path.join(work, "layer_000")))
    want = np.asarray(k26["params"]["dense_layers"]["attn"]["q_a"][0]).astype(BF16)
    np.testing.assert_array_equal(layer0["attn"]["q_a"].view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("tensor,make_bad,match", [
    ("model.layers.1.self_attn.kv_b_proj.weight", lambda a: a[:-1], "kv_b_proj.weight"),
    ("model.layers.2.mlp.experts.4.up_proj.weight_packed", lambda a: a.astype(np.int64), "up_proj.weight_packed"),
    ("model.layers.1.mlp.experts.0.down_proj.weight_shape", lambda a: a[::-1].copy(), "down_proj.weight_shape"),
])
def test_bad_tensor_is_named(k26, tmp_path, tensor, make_bad, match):
    d = str(tmp_path / "hf")
    shutil.copytree(k26["dir"], d)
    shard = os.path.join(d, _weight_map(d)[PRE + tensor])
    tensors = load_file(shard)
    tensors[PRE + tensor] = make_bad(tensors[PRE + tensor])
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=match):
        convert.convert_hf(d, str(tmp_path / "ckpt"), progress=False)


def test_ignore_list_semantics():
    ign = export.K26_IGNORE
    assert hf.is_ignored("language_model.model.layers.1.self_attn.q_a_proj", ign)
    assert hf.is_ignored("language_model.model.layers.0.mlp.gate_proj", ign)
    assert hf.is_ignored("language_model.model.layers.3.mlp.shared_experts.down_proj", ign)
    assert hf.is_ignored("language_model.lm_head", ign)
    assert not hf.is_ignored("language_model.model.layers.1.mlp.experts.7.gate_proj", ign)
    assert hf.is_ignored("lm_head", ["lm_head"]) and not hf.is_ignored("language_model.lm_head", ["lm_head"])


def test_cli_error_is_one_line(tmp_path, capfd):
    from kimi_jax.cli.convert import main
    assert main(["--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimi_jax.convert: error:") and "config.json" in lines[0]


def test_export_float_roundtrip(k26, tmp_path):
    """int4=False, prefix='' (the transformers-loadable form) reads back with load_hf to the same weights."""
    d = str(tmp_path / "hf")
    export.export_hf(k26["params"], k26["cfg"], d, int4=False, prefix="")
    conf = json.load(open(os.path.join(d, "config.json")))
    assert conf["model_type"] == "deepseek_v3" and "quantization_config" not in conf
    assert conf["rope_scaling"]["factor"] == k26["cfg"].rope_factor
    cfg2, p2 = hf.load(d)
    assert cfg2.replace(name=k26["cfg"].name) == k26["cfg"]
    a, b = checkpoint.flat(p2), checkpoint.flat(k26["params"])
    for k in b:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


# ---- sharded restore -------------------------------------------------------------------------------------

def shardings_for(params_abstract, mesh):
    """Heads of q_b/kv_b/o and the expert-MLP axis over "tp", experts over "ep", everything else replicated."""
    def name(k):
        return str(getattr(k, "key", getattr(k, "name", k)))

    rules = {
        "attn/q_b": P(None, None, "tp", None), "attn/kv_b": P(None, None, "tp", None),
        "attn/o": P(None, "tp", None, None),
        "experts/w13": P(None, "ep", None, None, "tp"), "experts/s13": P(None, "ep", None, None, "tp"),
        "experts/w2": P(None, "ep", "tp", None), "experts/s2": P(None, "ep", "tp", None),
    }

    def one(path, leaf):
        key = "/".join(name(k) for k in path)
        spec = next((s for suffix, s in rules.items() if key.endswith(suffix)), P())
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, params_abstract)


@pytest.mark.slow
def test_sharded_restore(converted):
    out, _ = converted
    cfg = checkpoint.read_config(out)
    # 8 devices: 4 heads in the tiny model, so heads/expert-MLP over tp=4 and the 16 experts over ep=2.
    mesh = jax.make_mesh((2, 4), ("ep", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    shardings = shardings_for(abstract_params(cfg), mesh)
    _, sharded = checkpoint.restore(out, shardings=shardings, dtype=jnp.float32)
    q_b = sharded["moe_layers"]["attn"]["q_b"]
    assert q_b.sharding.spec == P(None, None, "tp", None)
    assert len(q_b.addressable_shards) == 8 and q_b.addressable_shards[0].data.shape[2] == cfg.num_attention_heads // 4
    w13 = sharded["moe_layers"]["moe"]["experts"].w13
    assert w13.sharding.spec == P(None, "ep", None, None, "tp")
    assert w13.addressable_shards[0].data.shape[1] == cfg.n_routed_experts // 2
    assert sharded["embed"].sharding.spec == P()
    _, single = checkpoint.restore(out, dtype=jnp.float32)
    want = full_logits(single, cfg, TOKENS)
    got = jax.jit(lambda p, t: full_logits(p, cfg, t))(sharded, TOKENS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_layered_equals_stacked(converted, tmp_path):
    """The layered form restores to exactly the params the stacked (params/) form of the same weights does."""
    out, _ = converted
    cfg, params = checkpoint.restore(out)
    stacked = str(tmp_path / "stacked")
    checkpoint.save(stacked, cfg, params)
    a = checkpoint.flat(checkpoint.restore(stacked)[1])
    b = checkpoint.flat(params)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8), err_msg=k)


@pytest.mark.slow     # a third conversion (~12 s); fast: a resume after a kill (test_killed_midway_then_resume_...)
def test_killed_during_finalize_resumes(k26, converted, tmp_path, monkeypatch):
    """A kill between the atomic moves (some layers in layers/, the rest in .convert) resumes and completes."""
    out = str(tmp_path / "ckpt")
    real_rename, n = os.rename, {"moves": 0}

    def rename_then_die(src, dst):  # orbax renames inside .convert too: count only the final moves
        if convert.WORK_DIR not in os.fspath(dst):
            if n["moves"] == 2:
                raise _Killed
            n["moves"] += 1
        real_rename(src, dst)

    monkeypatch.setattr(convert.os, "rename", rename_then_die)
    with pytest.raises(_Killed):
        convert.convert_hf(k26["dir"], out, progress=False)
    monkeypatch.setattr(convert.os, "rename", real_rename)
    assert not checkpoint.is_kimi_checkpoint(out)
    assert os.listdir(os.path.join(out, "layers")) and os.listdir(os.path.join(out, convert.WORK_DIR))
    stats = convert.convert_hf(k26["dir"], out, progress=False)
    assert (stats["converted"], stats["skipped"]) == (0, 3)
    a = checkpoint.flat(checkpoint.restore(out)[1])
    b = checkpoint.flat(checkpoint.restore(converted[0])[1])
    for k in b:
        np.testing.assert_array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8), err_msg=k)


# ---- kimi_jax.load: HF INT4 directly, and straight onto a mesh ----------------------------------------------

def test_load_hf_int4_directory_equals_converted(k26, converted):
    """K2.6's published layout opens without conversion: same config, same weights, same logits."""
    direct, conv = kimi_jax.load(k26["dir"]), kimi_jax.load(converted[0])
    assert direct.config == conv.config and direct.config.int4_experts
    a, b = checkpoint.flat(direct.params), checkpoint.flat(conv.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    np.testing.assert_array_equal(direct.logits(TOKENS[0]), conv.logits(TOKENS[0]))


def _live_host_bytes(monkeypatch):
    """Wrap HFCheckpoint.read_layer so that every array it returns is tracked until it is freed; returns the list
    of (layer, bytes of earlier layers still alive when it was read)."""
    import weakref
    live, seen = {"bytes": 0}, []
    original = hf.HFCheckpoint.read_layer

    def read_layer(self, i, dtype):
        seen.append((i, live["bytes"]))
        tree = original(self, i, dtype)
        for a in tree.values():
            live["bytes"] += a.nbytes
            weakref.finalize(a, lambda n=a.nbytes: live.__setitem__("bytes", live["bytes"] - n))
        return tree

    monkeypatch.setattr(hf.HFCheckpoint, "read_layer", read_layer)
    return seen


# The fast loop loads the layered form onto the mesh; the HF form read onto it (and read at all: test_load_hf_int4_
# directory_equals_converted) in the full suite.
@pytest.mark.parametrize("source", [pytest.param("hf", marks=pytest.mark.slow), "layered"])
def test_load_on_mesh_places_each_layer_on_its_shardings(k26, converted, source, monkeypatch):
    """load(path, mesh=) chooses the shardings first: every weight lands sharded as param_shardings says, the
    HF reader's host arrays of a layer are freed before the next layer is read, and the orbax reads ask for
    the per-layer shardings (each device reads its shard)."""
    seen = _live_host_bytes(monkeypatch)
    targets = []
    original_restore = checkpoint.restore_tree
    monkeypatch.setattr(checkpoint, "restore_tree",
                        lambda path, target=None: (targets.append(target), original_restore(path, target))[1])
    path = k26["dir"] if source == "hf" else converted[0]
    model = kimi_jax.load(path, mesh="ep=4")
    want = checkpoint.flat(param_shardings(model.config, model.mesh))
    got = checkpoint.flat(model.params)
    for k, s in want.items():
        assert got[k].sharding.is_equivalent_to(s, got[k].ndim), k
    w13 = model.params["moe_layers"]["moe"]["experts"].w13
    assert w13.addressable_shards[0].data.shape[1] == model.config.n_routed_experts // 4
    if source == "hf":
        assert [i for i, _ in seen] == list(range(model.config.num_hidden_layers))
        assert all(earlier == 0 for _, earlier in seen), seen
    else:
        leaves = [t for tree in targets for t in jax.tree.leaves(tree)]
        assert leaves and all(t.sharding is not None and t.sharding.mesh.shape == model.mesh.shape for t in leaves)
    ref = kimi_jax.load(converted[0])
    np.testing.assert_allclose(model.logits(TOKENS[0]), ref.logits(TOKENS[0]), atol=1e-4, rtol=1e-4)


def test_full_k26_load_plan_on_8_devices():
    """The full model's load onto tp=8 / ep=8, planned without reading: per-device bytes and the host's one layer."""
    from kimi_jax.config import KIMI_K26
    mesh = jax.sharding.AbstractMesh((8,), ("ep",))
    plan = checkpoint.load_plan(KIMI_K26, param_shardings(KIMI_K26, mesh))
    total, layer = plan["total_bytes"], plan["host_layer_bytes"]
    assert 550e9 < total < 650e9                       # ~1.03T params: INT4 experts + bf16 rest
    assert plan["per_device_bytes"] < total / 7        # experts split 8 ways, attention TP over ep
    assert 8e9 < layer < 11e9                          # one MoE layer: 384 x 3 INT4 matrices + bf16 attention
