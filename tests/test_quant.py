"""INT4 pack-quantized weights: our packer/quantizer against compressed-tensors' own output, and Int4Experts.

Fixtures come from tests/fixtures/make_ct_fixtures.py (compressed-tensors 0.20.1, torch, Python 3.11).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from kimi_jax.ops.int4_format import (
    Int4Experts,
    dequantize_int4,
    dequantize_kernel_layout,
    pack_int4,
    quantize_int4,
    quantize_int4_values,
    to_kernel_layout,
    unpack_int4,
    unpack_kernel_layout,
)

CT = "ct"


def load(fixtures_dir, name) -> dict[str, np.ndarray]:
    with safe_open(fixtures_dir / CT / name, "flax") as f:
        return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}


def cases(tensors):
    return sorted({k.split(".")[0] for k in tensors})


def hf_experts(fixtures_dir, name):
    """Stack the HF per-expert tensors of a fixture into the arrays from_compressed_tensors takes."""
    t = load(fixtures_dir, f"experts_{name}.safetensors")
    e = 1 + max(int(k.split(".")[1]) for k in t)
    stack = lambda proj, field: np.stack([t[f"experts.{i}.{proj}.{field}"] for i in range(e)])  # noqa: E731
    arrays = {}
    for proj in ("gate", "up", "down"):
        arrays[f"{proj}_packed"] = stack(f"{proj}_proj", "weight_packed")
        arrays[f"{proj}_scale"] = stack(f"{proj}_proj", "weight_scale")
        arrays[f"{proj}_weight"] = stack(f"{proj}_proj", "weight")
        arrays[f"{proj}_shape"] = stack(f"{proj}_proj", "weight_shape")
    return arrays


CT_KEYS = ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")
EXPERT_SETS = ("e3_d256_f32", "e2_d96_f64")


# --- checkpoint layout ------------------------------------------------------------------------------------------


def test_pack_matches_compressed_tensors(fixtures_dir):
    t = load(fixtures_dir, "pack.safetensors")
    for case in cases(t):
        q, packed = t[f"{case}.q"], t[f"{case}.packed"]
        k = q.shape[-1]
        np.testing.assert_array_equal(pack_int4(q), packed, err_msg=case)
        np.testing.assert_array_equal(unpack_int4(packed, k), q, err_msg=case)
        np.testing.assert_array_equal(t[f"{case}.unpacked"], q, err_msg=case)
        # the jnp versions agree with the numpy ones
        np.testing.assert_array_equal(np.asarray(pack_int4(jnp.asarray(q))), packed, err_msg=case)
        np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), k)), q, err_msg=case)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), k=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_pack_roundtrip(n, k, seed):
    q = np.random.default_rng(seed).integers(-8, 8, (2, n, k)).astype(np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (2, n, -(-k // 8))
    np.testing.assert_array_equal(unpack_int4(packed, k), q)


def test_unpack_rejects_bad_input():
    with pytest.raises(TypeError, match="int32"):
        unpack_int4(np.zeros((2, 2), np.int64), 16)
    with pytest.raises(ValueError, match="does not fit"):
        unpack_int4(np.zeros((2, 2), np.int32), 17)


def test_quantize_matches_compressed_tensors(fixtures_dir):
    t = load(fixtures_dir, "quant.safetensors")
    assert set(cases(t)) == {"bf16", "f32"}
    for case in cases(t):
        w = t[f"{case}.weight"]
        q, scale = quantize_int4_values(w)
        np.testing.assert_array_equal(scale.astype(np.float32), t[f"{case}.scale"].astype(np.float32), err_msg=case)
        np.testing.assert_array_equal(q, t[f"{case}.q"], err_msg=case)
        packed, scale2 = quantize_int4(w)
        np.testing.assert_array_equal(packed, t[f"{case}.packed"], err_msg=case)
        assert scale2.dtype == ml_dtypes.bfloat16
        # the package's decompress (computed in the scale/weight dtype) equals our exact float32 product,
        # rounded the same way
        ours = np.asarray(dequantize_int4(packed, scale2, w.shape))
        ref = t[f"{case}.dequant"]
        np.testing.assert_array_equal(ours.astype(ref.dtype), ref, err_msg=case)


def test_quantize_rejects_ragged_groups():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_int4(np.zeros((4, 48), np.float32))


def test_dequantize_reference():
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (3, 5, 64)).astype(np.int8)
    s = rng.uniform(0.01, 1.0, (3, 5, 2)).astype(ml_dtypes.bfloat16)
    w = np.asarray(dequantize_int4(pack_int4(q), s, (5, 64)))
    want = q.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=-1)
    np.testing.assert_array_equal(w, want)


# --- kernel layout ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [32, 96, 256, 512, 288])
def test_kernel_layout_roundtrip(k):
    rng = np.random.default_rng(k)
    q = rng.integers(-8, 8, (2, 48, k)).astype(np.int8)
    s = rng.uniform(0.01, 1.0, (2, 48, k // 32)).astype(ml_dtypes.bfloat16)
    words, st_ = to_kernel_layout(q, s)
    kp = -(-k // 256) * 256
    assert words.shape == (2, kp // 8, 48) and st_.shape == (2, kp // 32, 48)
    # nibble i of word row 32c + j holds input 256c + 32i + j
    u = (words[..., None, :] >> (4 * np.arange(8))[:, None]) & 0xF        # [2, kp/8, 8, 48]
    for kk in rng.integers(0, k, 20):
        c, i, j = kk // 256, (kk % 256) // 32, kk % 32
        np.testing.assert_array_equal(u[:, 32 * c + j, i, :] - 8, q[:, :, kk])
    unpacked = unpack_kernel_layout(words)
    np.testing.assert_array_equal(np.swapaxes(unpacked[:, :k], -1, -2), q)
    np.testing.assert_array_equal(unpacked[:, k:], 0)                          # padding is q = 0
    np.testing.assert_array_equal(np.asarray(unpack_kernel_layout(jnp.asarray(words))), unpacked)
    w = np.asarray(dequantize_kernel_layout(words, st_, k))
    np.testing.assert_array_equal(np.swapaxes(w, -1, -2), np.asarray(dequantize_int4(pack_int4(q), s, (48, k))))


# --- Int4Experts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [pytest.param(EXPERT_SETS[0], marks=pytest.mark.slow), EXPERT_SETS[1]])  # fast: one
def test_experts_from_compressed_tensors(fixtures_dir, name):
    a = hf_experts(fixtures_dir, name)
    ex = Int4Experts.from_compressed_tensors(*(a[k] for k in CT_KEYS))
    e, f, d = a["gate_shape"].shape[0], *a["gate_shape"][0]
    assert (ex.num_experts, ex.d_model, ex.d_ff) == (e, d, f)
    assert ex.w13.dtype == np.int32 and ex.s13.dtype == ml_dtypes.bfloat16

    # export gives back the package's exact tensors
    back = ex.to_compressed_tensors()
    for k in CT_KEYS:
        np.testing.assert_array_equal(np.asarray(back[k]).view(np.uint8), a[k].view(np.uint8), err_msg=k)

    # dequantize == the checkpoint-layout reference, transposed to the model's input-major layout
    deq = ex.dequantize()
    for proj in ("gate", "up", "down"):
        ref = dequantize_int4(a[f"{proj}_packed"], a[f"{proj}_scale"], a[f"{proj}_shape"][0])
        np.testing.assert_array_equal(np.asarray(deq[proj]), np.swapaxes(np.asarray(ref), -1, -2), err_msg=proj)

    # quantizing the package's float weights (given input-major) reproduces its checkpoint exactly
    t = lambda w: np.swapaxes(w, -1, -2)  # noqa: E731
    ex2 = Int4Experts.quantize(t(a["gate_weight"]), t(a["up_weight"]), t(a["down_weight"]))
    for f1, f2 in zip(jax.tree.leaves(ex), jax.tree.leaves(ex2)):
        np.testing.assert_array_equal(np.asarray(f1).view(np.uint8), np.asarray(f2).view(np.uint8))


def test_experts_bytes():
    e, d, f = 4, 7168 // 28, 2048 // 8   # K2 ratios, small
    ex = Int4Experts.quantize(np.ones((e, d, f), np.float32), np.ones((e, d, f), np.float32),
                              np.ones((e, f, d), np.float32))
    # 4 bits per weight + one bf16 scale per 32 weights = 4.5 bits, three matrices per expert
    assert ex.expert_nbytes == 3 * d * f * 9 // 16
    assert ex.nbytes == e * ex.expert_nbytes
    # the K2 expert: 24,772,608 B for the three INT4 matrices and their scales
    assert 3 * 7168 * 2048 * 9 // 16 == 24_772_608


def test_experts_rejects_mismatched_shapes(fixtures_dir):
    a = hf_experts(fixtures_dir, "e3_d256_f32")
    bad = dict((k, a[k]) for k in CT_KEYS)
    bad["down_scale"] = bad["down_scale"][:, :-1]
    with pytest.raises(ValueError, match="down_scale has shape"):
        Int4Experts.from_compressed_tensors(*(bad[k] for k in CT_KEYS))
    bad = dict((k, a[k]) for k in CT_KEYS)
    bad["up_packed"] = bad["up_packed"].astype(np.int64)
    with pytest.raises(TypeError, match="up_packed has dtype"):
        Int4Experts.from_compressed_tensors(*(bad[k] for k in CT_KEYS))


def test_experts_stacked_layers(fixtures_dir):
    a = hf_experts(fixtures_dir, "e2_d96_f64")
    one = Int4Experts.from_compressed_tensors(*(a[k] for k in CT_KEYS))
    layers = [one, jax.tree.map(lambda x: x[::-1], one)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    # the same constructor on stacked [L, E, ...] inputs builds the same pytree
    stacked_ct = {k: np.stack([a[k], a[k][::-1]]) for k in CT_KEYS}
    again = Int4Experts.from_compressed_tensors(*(stacked_ct[k] for k in CT_KEYS))
    for x, y in zip(jax.tree.leaves(stacked), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    assert (stacked.num_experts, stacked.d_model, stacked.d_ff) == (2, 96, 64)
    assert stacked.nbytes == 2 * one.nbytes and stacked.expert_nbytes == one.expert_nbytes
    deq = jax.jit(Int4Experts.dequantize)(jax.tree.map(jnp.asarray, stacked))
    ref = one.dequantize()
    for k in ("gate", "up", "down"):
        assert deq[k].shape == (2, *ref[k].shape)
        np.testing.assert_array_equal(np.asarray(deq[k][0]), np.asarray(ref[k]))
        np.testing.assert_array_equal(np.asarray(deq[k][1]), np.asarray(ref[k])[::-1])
    back = stacked.to_compressed_tensors()
    for k in CT_KEYS:
        np.testing.assert_array_equal(back[k].view(np.uint8), stacked_ct[k].view(np.uint8))
