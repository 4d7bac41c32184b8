"""The log-sum-exp merge of split-K attention partials, as Triton kernels: one launch where XLA's merge
(``xla.merge_states``) is two fusions. The tree attention's Triton and Mosaic GPU kernels and the drafter
attention's kernel write float32 partials (acc, max m, sum l) per key split; these kernels combine them.

``merge_pallas``: partials [b, parts, rows, r] -> [b, rows, r].

``merge_project``: the same merge, then each query row's merged value through its head's output projection,
``out[b, i, h] = merged[b, i, h] @ w[:, h, col:]`` (absorbed MLA's W_UV, the tail of ``kv_b``, read in place):
the attention output leaves the merge already projected, where XLA ran a GEMM and, at K2.6's widths, its split-K
reduction after the merge (2 GPU ops a layer). A program takes ``bt`` tokens of one head: it merges a [bt, rc]
column chunk of the latent at a time, rounds it to the output dtype (where ``merge_pallas``'s output is rounded),
and accumulates its dot with the [rc, v] rows of W_UV in float32.

A query row whose every part kept the initial max saw no key: zeros (the Mosaic GPU kernel leaves junk in such
a state's l and acc; the Triton kernels' own partials have l = 0 there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kimi_jax.ops.numerics import F32, MASK_VALUE

PROJECT_TOKENS = 16     # tokens a program of merge_project: Triton's smallest dot
PROJECT_CHUNK = 32      # latent columns merged and projected at a time (64 spilled registers on H200 and B200)


def _cdiv(a, b):
    return -(-a // b)


def _weights(m_ref, n_parts):
    """The max over the parts of each row, and whether the row saw any key: (max [rows], seen [rows])."""
    big_m = jax.lax.fori_loop(1, n_parts, lambda j, mx: jnp.maximum(mx, m_ref[j, :]), m_ref[0, :])
    return big_m, big_m > MASK_VALUE / 2


def _merged(o_ref, m_ref, l_ref, big_m, seen, n_parts, cols):
    """The merged float32 value of the columns ``cols`` (a slice) of every row in the block."""
    def body(j, carry):
        total, acc = carry
        w = jnp.exp(m_ref[j, :] - big_m)
        return total + w * l_ref[j, :], acc + w[:, None] * o_ref[j, :, cols]

    rows = m_ref.shape[1]
    width = o_ref.shape[2] if isinstance(cols, slice) else cols.size
    total, acc = jax.lax.fori_loop(0, n_parts, body, (jnp.zeros((rows,), F32), jnp.zeros((rows, width), F32)))
    return jnp.where(seen[:, None], acc / jnp.where(total > 0, total, 1.0)[:, None], 0.0)


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, n_parts):
    big_m, seen = _weights(m_ref, n_parts)
    out_ref[...] = _merged(o_ref, m_ref, l_ref, big_m, seen, n_parts, slice(None)).astype(out_ref.dtype)


def merge_pallas(o, m, l, bq, out_dtype, interpret, rows: int | None = None, name: str = "mla_tree_attention_merge"):
    """o [b, parts, n_q, r], m, l [b, parts, n_q] -> [b, rows, r] in out_dtype: the first ``rows`` (default
    n_q) queries' merged outputs, ``bq`` queries a program. The Triton kernel's merge, the Mosaic GPU kernel's
    (its partials hold whole 64-query blocks; ``rows`` drops the padding without a copy) and the drafter
    attention's."""
    b, parts, n_q, r = o.shape
    rows = rows or n_q
    return pl.pallas_call(
        functools.partial(_merge_kernel, n_parts=parts),
        grid=(_cdiv(rows, bq), b),
        in_specs=[pl.BlockSpec((None, parts, bq, r), lambda i, k: (k, 0, i, 0)),
                  pl.BlockSpec((None, parts, bq), lambda i, k: (k, 0, i)),
                  pl.BlockSpec((None, parts, bq), lambda i, k: (k, 0, i))],
        out_specs=pl.BlockSpec((None, bq, r), lambda i, k: (k, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, rows, r), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=name,
    )(o, m, l)


def project_supports(r: int, heads: int, n_q: int, w_shape, col: int) -> str | None:
    """Why ``merge_project`` cannot take partials of r latent columns over n_q = tokens x heads query rows (the
    padded rows too) and weights w [r, heads, c] from column ``col`` (None: it can)."""
    v = w_shape[2] - col
    if w_shape[:2] != (r, heads) or v < 1:
        return f"w {tuple(w_shape)} is not [r={r}, heads={heads}, > {col} columns]"
    if v < 16 or v & (v - 1):
        return f"the projection's {v} output columns are not a power of two >= 16 (Triton's dot)"
    if r % PROJECT_CHUNK:
        return f"the latent width {r} is not a multiple of {PROJECT_CHUNK}"
    if n_q % heads:
        return f"the partials' {n_q} rows are not whole tokens of {heads} heads"
    return None


def _project_kernel(o_ref, m_ref, l_ref, w_ref, out_ref, *, n_parts, col, latent_dtype):
    # o_ref [parts, bt, r], m_ref/l_ref [parts, bt]: bt tokens of one head; w_ref [r, c] its weights
    big_m, seen = _weights(m_ref, n_parts)
    bt, v = out_ref.shape
    dt = out_ref.dtype          # the dot's operands: the latent and the weights promoted, as XLA's einsum does

    def chunk(i, acc):
        cols = pl.ds(i * PROJECT_CHUNK, PROJECT_CHUNK)
        lat = _merged(o_ref, m_ref, l_ref, big_m, seen, n_parts, cols).astype(latent_dtype).astype(dt)
        return acc + jnp.dot(lat, w_ref[cols, pl.ds(col, v)].astype(dt), preferred_element_type=F32)

    acc = jax.lax.fori_loop(0, o_ref.shape[2] // PROJECT_CHUNK, chunk, jnp.zeros((bt, v), F32))
    out_ref[...] = acc.astype(out_ref.dtype)


def merge_project(o, m, l, w, col: int, tokens: int, out_dtype, interpret, name: str = "mla_tree_attention_merge"):
    """o [b, parts, n_q, r], m, l [b, parts, n_q] with n_q = T x heads query rows (token-major; rows past
    ``tokens`` x heads are padding), w [r, heads, c] -> [b, tokens, heads, c - col]: the merged latent of each
    row rounded to out_dtype, times ``w[:, head, col:]``, accumulated in float32, in the promoted dtype of the two
    (``project``'s). Shapes as ``project_supports`` takes."""
    b, parts, n_q, r = o.shape
    heads, c = w.shape[1], w.shape[2]
    if (why := project_supports(r, heads, n_q, w.shape, col)) is not None:
        raise ValueError(f"merge_project: {why}")
    big_t, v, bt = n_q // heads, c - col, PROJECT_TOKENS
    return pl.pallas_call(
        functools.partial(_project_kernel, n_parts=parts, col=col, latent_dtype=jnp.dtype(out_dtype)),
        grid=(_cdiv(tokens, bt), heads, b),
        in_specs=[pl.BlockSpec((None, parts, bt, None, r), lambda i, h, k: (k, 0, i, h, 0)),
                  pl.BlockSpec((None, parts, bt, None), lambda i, h, k: (k, 0, i, h)),
                  pl.BlockSpec((None, parts, bt, None), lambda i, h, k: (k, 0, i, h)),
                  pl.BlockSpec((r, None, c), lambda i, h, k: (0, h, 0))],
        out_specs=pl.BlockSpec((None, bt, None, v), lambda i, h, k: (k, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((b, tokens, heads, v), jnp.result_type(out_dtype, w.dtype)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=name,
    )(o.reshape(b, parts, big_t, heads, r), m.reshape(b, parts, big_t, heads), l.reshape(b, parts, big_t, heads), w)


def project(o_lat, w_uv, w_uv_from: int):
    """o_lat [b, t, heads, r] through each head's W_UV, ``w_uv[:, head, w_uv_from:]`` -> [b, t, heads, v] (in the
    promoted dtype): what ``merge_project`` computes, in XLA (the implementations without it, and calls it does
    not take)."""
    return jnp.einsum("bthr,rhv->bthv", o_lat, w_uv[..., w_uv_from:])


def merge_heads(o, m, l, tokens: int, heads: int, bq: int, out_dtype, interpret, w_uv=None, w_uv_from: int = 0,
                latent: int | None = None, name: str = "mla_tree_attention_merge"):
    """Partials o [b, parts, n_q, r], m, l [b, parts, n_q] of (token, head) query rows (token-major; rows past
    tokens x heads are padding) -> the merged [b, tokens, heads, latent] (the first ``latent`` columns, default r),
    or with ``w_uv`` [r, heads, c] projected by its columns from ``w_uv_from``: [b, tokens, heads, c - w_uv_from]:
    in ``merge_project`` where it takes the call (``project_supports``, and no latent padding), else
    ``merge_pallas`` and ``project`` in XLA."""
    b, _, n_q, r = o.shape
    latent = latent or r
    if (w_uv is not None and latent == r
            and project_supports(r, heads, n_q, w_uv.shape, w_uv_from) is None):
        return merge_project(o, m, l, w_uv, w_uv_from, tokens, out_dtype, interpret, name)
    out = merge_pallas(o, m, l, bq, out_dtype, interpret, rows=tokens * heads, name=name)
    out = out[..., :latent].reshape(b, tokens, heads, latent)
    return out if w_uv is None else project(out, w_uv, w_uv_from)
