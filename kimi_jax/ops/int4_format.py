"""INT4 weights: the compressed-tensors "pack-quantized" format and the routed-expert container.

Two layouts live here.

**The checkpoint layout** (compressed-tensors ``pack-quantized``, what the K2-Thinking/K2.5/K2.6 safetensors
hold; checked bit for bit against the package in tests/test_quant.py). A logical weight ``W[n, k]`` (``n`` =
output row, ``k`` = input column, HF ``[out, in]``) is stored as

- ``weight_packed`` int32 ``[N, ceil(K/8)]``: nibble ``i`` (bits ``4i..4i+3``, lowest first) of word ``j`` holds
  ``u = q + 8`` of element ``k = 8j + i``; the word is the bit pattern read as a signed int32. When ``K % 8 != 0``
  the package pads the *columns* of the last word with ``u = 0`` nibbles (rows are never padded), and unpacking
  trims to ``weight_shape``;
- ``weight_scale`` bf16 ``[N, K/32]``: symmetric, one scale per group of 32 consecutive inputs, no zero point;
  ``W[n, k] = q[n, k] * scale[n, k // 32]`` with ``q`` in ``[-8, 7]``. Group quantization needs ``K % 32 == 0``
  (the package raises otherwise), so only the bare packer meets ``K % 8 != 0``.

**The kernel layout** (``Int4Experts``, repacked once at load time). Every expert matrix is stored input-major
(K-major, ``y = x @ W`` with ``W[k, n]``) because both the Pallas kernel and the XLA path stream row tiles of
``K`` against a contiguous run of output columns ``n``. Along ``K`` the matrix is cut into chunks of 256 inputs
(8 scale groups) and the 256 x N chunk is packed into 32 rows of int32 words:

    word row r = 32*c + j, nibble i (bits 4i..4i+3)  <->  input k = 256*c + 32*i + j,   u = q + 8

so unpacking nibble ``i`` of a ``[32, bn]`` tile of word rows gives the dense ``[32, bn]`` int4 tile of scale
group ``8c + i`` with its inputs in natural order. The kernel therefore needs no interleave/join (which the
Triton lowering handles badly): per chunk it loads one word tile, and for each of the 8 nibble planes does a
``[bm, 32] x [32, bn]`` dot against a contiguous slice of ``x`` and multiplies the partial sum by that group's
scale row. Scales stay in natural group order, transposed to ``[K/32, N]`` bf16. ``K`` is zero-padded to a
multiple of 256 (``q = 0``, scale 0) when needed; only tiny test models hit this, the K2 shapes (7168, 2048)
are multiples of 256.

``Int4Experts`` fields (``...`` = optional leading axes, e.g. the stacked-layer axis the model scans over):

    w13  int32 [..., E, 2, Dp/8,  F]   gate (index 0) and up (index 1): one kernel pass over x computes both
    s13  bf16  [..., E, 2, Dp/32, F]
    w2   int32 [..., E, Fp/8,  D]      down
    s2   bf16  [..., E, Fp/32, D]

(``Dp``/``Fp`` = ``D``/``F`` rounded up to 256.) Gate and up sit on their own length-2 axis rather than
concatenated along ``F`` so that tensor parallelism can split the ``F`` axis (the last axis of w13/s13 and the
word-row axis of w2/s2, which needs ``F / tp`` to be a multiple of 256: 2048 / 8 = 256 for K2) and every device
keeps matching gate, up and down slices. Storage is 4.5 bits per weight, exactly the checkpoint's bytes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

GROUP_SIZE = 32           # inputs per scale (fixed by the K2 checkpoints)
CHUNK = 256               # inputs per word row block in the kernel layout: 8 nibbles x 32-input groups
WORD_ROWS = CHUNK // 8    # = 32 word rows per chunk
QMIN, QMAX = -8, 7
BF16 = ml_dtypes.bfloat16


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ---------------------------------------------------------------------------------------------------------------
# checkpoint layout: pack / unpack / quantize / dequantize


def pack_int4(q) -> np.ndarray:
    """int values in [-8, 7], ``[..., N, K]`` -> int32 words ``[..., N, ceil(K/8)]`` (compressed-tensors layout).

    Works on numpy (host, the loader) and jnp arrays. Tail nibbles of a last partial word are 0, as the package
    writes them.
    """
    xp = _xp(q)
    k = q.shape[-1]
    u = q.astype(xp.int32) + 8
    pad = _round_up(k, 8) - k
    if pad:
        u = xp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, pad)])
    u = u.reshape(*u.shape[:-1], -1, 8)
    # OR-ing shifted nibbles in int32 wraps the top nibble into the sign bit: that is the bit-cast.
    shifts = (4 * xp.arange(8, dtype=xp.int32))
    words = u << shifts
    out = words[..., 0]
    for i in range(1, 8):
        out = out | words[..., i]
    return out


def unpack_int4(packed, k: int):
    """int32 words ``[..., N, W]`` -> int8 values in [-8, 7], ``[..., N, k]`` (inverse of :func:`pack_int4`)."""
    xp = _xp(packed)
    if packed.dtype != xp.int32:
        raise TypeError(f"packed INT4 weights must be int32, got {packed.dtype}")
    if not 0 < k <= 8 * packed.shape[-1]:
        raise ValueError(f"k={k} does not fit in {packed.shape[-1]} int32 words of 8 nibbles")
    shifts = 4 * xp.arange(8, dtype=xp.int32)
    # Arithmetic shift then mask: the sign-extended high bits are masked off.
    u = (packed[..., None] >> shifts) & 0xF
    u = u.reshape(*packed.shape[:-1], -1)[..., :k]
    return (u - 8).astype(xp.int8)


def _to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 -> bfloat16 (nearest-even), returned as float32 values."""
    return a.astype(np.float32).astype(BF16).astype(np.float32)


def quantize_int4_values(w, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """float ``[..., N, K]`` -> (q int8 ``[..., N, K]``, scale bf16 ``[..., N, K/group]``), on the host.

    Bit-exact with compressed-tensors' symmetric minmax group quantization (``calculate_qparams`` then
    ``quantize``), tested against the package:
    - ``scale = max(|min(w_g, 0)|, max(w_g, 0)) / 7.5`` computed in float32 and rounded to bf16 (the scale dtype
      of the K2 checkpoints); an all-zero group gets ``scale = finfo(bf16).eps``;
    - ``q = round_half_even(clamp(w / scale, -8, 7))``. For bf16 ``w`` the package divides in bf16, so the
      quotient is rounded to bf16 before clamping and rounding; float32 (or other float) ``w`` divides in float32
      (what the package does for a float32 weight with ``scale_dtype=bfloat16``).
    """
    w = np.asarray(w)
    is_bf16 = w.dtype == BF16
    if not (is_bf16 or np.issubdtype(w.dtype, np.floating)):
        raise TypeError(f"quantize_int4 expects a float weight, got {w.dtype}")
    k = w.shape[-1]
    if k % group_size:
        raise ValueError(f"input dim K={k} must be a multiple of group_size={group_size} "
                         "(compressed-tensors group quantization requires it)")
    g = w.astype(np.float32).reshape(*w.shape[:-1], k // group_size, group_size)
    lo = np.minimum(g.min(-1), 0.0)
    hi = np.maximum(g.max(-1), 0.0)
    amax = np.maximum(np.abs(lo), np.abs(hi))
    scale = _to_bf16(amax / np.float32((QMAX - QMIN) / 2))
    scale = np.where(scale == 0, np.float32(np.finfo(BF16).eps), scale)
    ratio = g / scale[..., None]
    if is_bf16:
        ratio = _to_bf16(ratio)
    q = np.round(np.clip(ratio, QMIN, QMAX)).astype(np.int8)
    return q.reshape(w.shape), scale.astype(BF16)


def quantize_int4(w, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """float ``[..., N, K]`` -> (packed int32 ``[..., N, K/8]``, scale bf16 ``[..., N, K/32]``), checkpoint layout."""
    q, scale = quantize_int4_values(w, group_size)
    return pack_int4(q), scale


def dequantize_int4(packed, scale, shape) -> jax.Array:
    """Checkpoint layout -> float32 ``[..., N, K]`` (``shape`` = ``weight_shape`` = ``(N, K)``). Plain jnp reference."""
    n, k = (int(s) for s in tuple(shape)[-2:])
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    if packed.shape[-2] != n or scale.shape[-2] != n:
        raise ValueError(f"packed {packed.shape} / scale {scale.shape} do not have N={n} rows")
    q = unpack_int4(packed, k).astype(jnp.float32)
    s = jnp.repeat(scale.astype(jnp.float32), GROUP_SIZE, axis=-1)[..., :k]
    return q * s


# ---------------------------------------------------------------------------------------------------------------
# kernel layout (see the module docstring)


def to_kernel_layout(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF orientation (q int ``[..., N, K]``, scale ``[..., N, K/32]``) -> (words int32 ``[..., Kp/8, N]``,
    scale bf16 ``[..., Kp/32, N]``), K zero-padded to a multiple of 256. Host-side numpy, run once at load."""
    q = np.asarray(q)
    scale = np.asarray(scale)
    *lead, n, k = q.shape
    if k % GROUP_SIZE or scale.shape[-1] != k // GROUP_SIZE or scale.shape[-2] != n:
        raise ValueError(f"q {q.shape} and scale {scale.shape} are not a group-{GROUP_SIZE} pair")
    kp = _round_up(k, CHUNK)
    u = np.swapaxes(q.astype(np.int32) + 8, -1, -2)                # [..., K, N]
    u = np.pad(u, [(0, 0)] * len(lead) + [(0, kp - k), (0, 0)], constant_values=8)
    u = u.reshape(*lead, kp // CHUNK, 8, WORD_ROWS, n)              # (c, i, j, n): k = 256c + 32i + j
    words = np.zeros((*lead, kp // CHUNK, WORD_ROWS, n), np.int32)
    for i in range(8):
        words |= u[..., i, :, :] << (4 * i)
    s = np.swapaxes(scale.astype(BF16), -1, -2)                     # [..., K/32, N]
    s = np.pad(s, [(0, 0)] * len(lead) + [(0, (kp - k) // GROUP_SIZE), (0, 0)])
    return words.reshape(*lead, kp // 8, n), np.ascontiguousarray(s)


def unpack_kernel_layout(words):
    """Kernel-layout words ``[..., Kp/8, N]`` -> int8 q ``[..., Kp, N]`` in natural input order (numpy or jnp)."""
    xp = _xp(words)
    *lead, rows, n = words.shape
    shifts = (4 * xp.arange(8, dtype=xp.int32))[:, None]
    u = (words[..., None, :] >> shifts) & 0xF                        # [..., Kp/8, 8, N] = (c*32 + j, i, n)
    u = u.reshape(*lead, rows // WORD_ROWS, WORD_ROWS, 8, n)
    u = xp.swapaxes(u, -3, -2)                                       # (c, i, j, n)
    return (u.reshape(*lead, rows * 8, n) - 8).astype(xp.int8)


def dequantize_kernel_layout(words, scale, k: int | None = None) -> jax.Array:
    """Kernel layout -> float32 ``[..., K, N]`` (input-major), trimmed to ``k`` inputs. jnp."""
    q = unpack_kernel_layout(jnp.asarray(words)).astype(jnp.float32)
    s = jnp.repeat(jnp.asarray(scale).astype(jnp.float32), GROUP_SIZE, axis=-2)
    w = q * s
    return w if k is None else w[..., :k, :]


def from_kernel_layout(words, scale, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`to_kernel_layout`: -> (q int8 ``[..., N, k]``, scale bf16 ``[..., N, k/32]``), numpy."""
    q = unpack_kernel_layout(np.asarray(words))[..., :k, :]
    s = np.asarray(scale).astype(BF16)[..., : k // GROUP_SIZE, :]
    return np.ascontiguousarray(np.swapaxes(q, -1, -2)), np.ascontiguousarray(np.swapaxes(s, -1, -2))


# ---------------------------------------------------------------------------------------------------------------
# routed-expert container


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Experts:
    """All routed experts of one MoE layer (or of all layers, with leading stacked axes), INT4 kernel layout.

    See the module docstring for the layout. Expert ``e`` computes
    ``down_e(silu(x @ gate_e) * (x @ up_e))``. Every method uses negative axes, so a leading stacked-layer axis
    (sliced with ``jax.tree.map(lambda a: a[i], experts)`` or by ``lax.scan``) works unchanged. Arrays may be numpy
    (fresh from the loader, on the host) or jax arrays; ``jax.device_put(experts, shardings)`` moves them.
    """

    w13: jax.Array   # int32 [..., E, 2, Dp/8, F]
    s13: jax.Array   # bf16  [..., E, 2, Dp/32, F]
    w2: jax.Array    # int32 [..., E, Fp/8, D]
    s2: jax.Array    # bf16  [..., E, Fp/32, D]

    # Logical axis names of each field without leading stacked axes (the model prepends "layers").
    # F ("mlp") is the tensor-parallel axis; E ("expert") the expert-parallel one.
    LOGICAL_AXES = {
        "w13": ("expert", None, "embed", "mlp"),
        "s13": ("expert", None, "embed", "mlp"),
        "w2": ("expert", "mlp", "embed"),
        "s2": ("expert", "mlp", "embed"),
    }

    @property
    def num_experts(self) -> int:
        return self.w13.shape[-4]

    @property
    def d_model(self) -> int:
        return self.w2.shape[-1]

    @property
    def d_ff(self) -> int:
        return self.w13.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of the INT4 storage (packed words + bf16 scales), all experts and stacked layers."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in (self.w13, self.s13, self.w2, self.s2))

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert's three matrices occupy (what the kernel streams per touched expert)."""
        lead = int(np.prod(self.w13.shape[:-4]))
        return self.nbytes // (lead * self.num_experts)

    # -- conversions (host-side numpy; run once at load / export) --------------------------------------------

    @classmethod
    def from_compressed_tensors(cls, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                                ) -> Int4Experts:
        """From HF per-expert tensors stacked over experts (numpy, host):
        gate/up ``weight_packed`` int32 ``[..., E, F, D/8]``, ``weight_scale`` bf16 ``[..., E, F, D/32]``;
        down ``weight_packed`` ``[..., E, D, F/8]``, ``weight_scale`` ``[..., E, D, F/32]``.
        Shapes come from the scales (group 32 implies K = 32 * groups)."""
        arrays = [np.asarray(a) for a in (gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)]
        gp, gs, upk, us, dp, ds = arrays
        f, d = gs.shape[-2], gs.shape[-1] * GROUP_SIZE
        expect = {
            "gate_packed": (gp, (f, -(-d // 8))), "gate_scale": (gs, (f, d // GROUP_SIZE)),
            "up_packed": (upk, (f, -(-d // 8))), "up_scale": (us, (f, d // GROUP_SIZE)),
            "down_packed": (dp, (d, -(-f // 8))), "down_scale": (ds, (d, f // GROUP_SIZE)),
        }
        lead = gs.shape[:-2]
        for name, (a, shape) in expect.items():
            if a.shape != (*lead, *shape):
                raise ValueError(f"{name} has shape {a.shape}, expected {(*lead, *shape)} for "
                                 f"experts {lead}, hidden D={d}, expert width F={f}")
            want = np.int32 if name.endswith("packed") else BF16
            if a.dtype != want and not (want is BF16 and np.issubdtype(a.dtype, np.floating)):
                raise TypeError(f"{name} has dtype {a.dtype}, expected {np.dtype(want)}")
        w1, s1 = to_kernel_layout(unpack_int4(gp, d), gs)
        w3, s3 = to_kernel_layout(unpack_int4(upk, d), us)
        w2, s2 = to_kernel_layout(unpack_int4(dp, f), ds)
        return cls(w13=np.stack([w1, w3], axis=-3), s13=np.stack([s1, s3], axis=-3), w2=w2, s2=s2)

    def to_compressed_tensors(self) -> dict[str, np.ndarray]:
        """Inverse of :meth:`from_compressed_tensors` (numpy): keys gate/up/down ``_packed`` and ``_scale``."""
        d, f = self.d_model, self.d_ff
        w13, s13, w2, s2 = (np.asarray(a) for a in (self.w13, self.s13, self.w2, self.s2))
        out = {}
        for name, words, scale, k in (("gate", w13[..., 0, :, :], s13[..., 0, :, :], d),
                                      ("up", w13[..., 1, :, :], s13[..., 1, :, :], d),
                                      ("down", w2, s2, f)):
            q, s = from_kernel_layout(words, scale, k)
            out[f"{name}_packed"], out[f"{name}_scale"] = pack_int4(q), s
        return out

    @classmethod
    def quantize(cls, gate, up, down, group_size: int = GROUP_SIZE) -> Int4Experts:
        """From float expert weights in the model's input-major layout: gate/up ``[..., E, D, F]``, down
        ``[..., E, F, D]`` (``y = x @ W``). Uses :func:`quantize_int4_values` (compressed-tensors' rule), so
        ``to_compressed_tensors()`` of the result is what the package would write for the HF ``[out, in]`` weights."""
        if group_size != GROUP_SIZE:
            raise ValueError(f"the INT4 kernel layout fixes group_size={GROUP_SIZE}, got {group_size}")
        gate, up, down = (np.asarray(a) for a in (gate, up, down))
        if gate.shape != up.shape or down.shape != (*gate.shape[:-2], gate.shape[-1], gate.shape[-2]):
            raise ValueError(f"expected gate/up [..., E, D, F] and down [..., E, F, D], got "
                             f"{gate.shape}, {up.shape}, {down.shape}")
        parts = [to_kernel_layout(*quantize_int4_values(np.swapaxes(w, -1, -2))) for w in (gate, up, down)]
        (w1, s1), (w3, s3), (w2, s2) = parts
        return cls(w13=np.stack([w1, w3], axis=-3), s13=np.stack([s1, s3], axis=-3), w2=w2, s2=s2)

    def dequantize(self) -> dict[str, jax.Array]:
        """float32 ``gate``/``up`` ``[..., E, D, F]`` and ``down`` ``[..., E, F, D]`` (jnp)."""
        w13 = dequantize_kernel_layout(self.w13, self.s13, self.d_model)
        return {"gate": w13[..., 0, :, :], "up": w13[..., 1, :, :],
                "down": dequantize_kernel_layout(self.w2, self.s2, self.d_ff)}
