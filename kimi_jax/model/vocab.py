"""argmax, top-k and sampling over a vocabulary that the mesh splits across devices, with all-reduces only.

The lm_head's columns, hence the logits' last axis, are split over the strategy's ``vocab`` mesh axes (``tp`` by
default). Over such an axis XLA's partitioner takes an argmax or a top-k as each device's own, then an all-gather
of every device's candidates and the final choice. On a GPU that all-gather is a NCCL call: it ends the CUDA graph
the round runs in (two more host submissions), and the scheduler moves unrelated work into its window outside
the graph (docs/gpu_overhead.md). Here the same choice is made with all-reduces, which XLA runs as its one-shot
kernels inside the graph:

* ``argmax``: each device's maximum and the global index of its first maximum; the global maximum is a max
  all-reduce, and the lowest index holding it a min all-reduce (the first maximum, as ``jnp.argmax``);
* ``top_k``: each device's top-k, written into its own slots of a zeroed [shards, k] array and summed, which is an
  all-gather as an all-reduce (every slot has one non-zero contribution, so the sum is exact); then the top-k of
  those shards * k candidates, stable, so that equal values keep the lower index (shards hold consecutive ids in
  order), as ``jax.lax.top_k``;
* ``categorical``: ``jax.random.categorical``'s own Gumbel-max, ``argmax(logits + gumbel)``, with the argmax above.
  The noise is drawn for the whole ``[..., V]`` shape from the same key (JAX's threefry draws are the same however
  the array is split), so a mesh samples the token one device samples.

Both are the plain ``jnp`` calls where no mesh splits the vocabulary, where the batch is split too (the
strategy's ``batch`` axes), or where a shard holds fewer than k entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kimi_jax import sharding
from kimi_jax.config import Runtime


def _vocab_axes(rt: Runtime, k: int, vocab: int) -> tuple[str, ...]:
    """The mesh axes the logits' last axis is split over, where this module's collectives apply; else ()."""
    mesh = rt.mesh
    if mesh is None or mesh.size == 1:
        return ()
    st = sharding.get_strategy(rt.strategy or sharding.infer_strategy(mesh))
    axes = tuple(a for a in st.mesh_axes("vocab", mesh) if mesh.shape[a] > 1)
    batch = [a for a in st.mesh_axes("batch", mesh) if mesh.shape[a] > 1]
    shards = sharding.axis_size(mesh, axes)
    if not axes or batch or vocab % shards or vocab // shards < k:
        return ()
    return axes


def _per_shard(fn, x, axes, rt: Runtime, out_specs):
    return jax.shard_map(fn, mesh=rt.mesh, in_specs=P(*([None] * (x.ndim - 1)), axes), out_specs=out_specs,
                         check_vma=False)(x)


def argmax(x: jax.Array, rt: Runtime) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32 (ties: the lowest index)."""
    axes = _vocab_axes(rt, 1, x.shape[-1])
    if not axes:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def local(x):
        first = sharding.shard_index(axes, rt.mesh) * x.shape[-1]
        best = jnp.max(x, axis=-1)
        at = jnp.argmax(x, axis=-1).astype(jnp.int32) + first
        top = jax.lax.pmax(best, axes)
        return jax.lax.pmin(jnp.where(best == top, at, jnp.iinfo(jnp.int32).max), axes)

    return _per_shard(local, x, axes, rt, P())


def top_k(x: jax.Array, k: int, rt: Runtime) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)``: values and int32 indices, equal values in index order."""
    axes = _vocab_axes(rt, k, x.shape[-1])
    if not axes:
        return jax.lax.top_k(x, k)
    shards = sharding.axis_size(rt.mesh, axes)

    def local(x):
        me = sharding.shard_index(axes, rt.mesh)
        values, at = jax.lax.top_k(x, k)
        mine = (jnp.arange(shards) == me)[:, None]                       # [shards, 1]: this device's slots
        every = [jax.lax.psum(jnp.where(mine, a[..., None, :], jnp.zeros((), a.dtype)), axes).reshape(
            *a.shape[:-1], shards * k) for a in (values, at + me * x.shape[-1])]
        values, pick = jax.lax.top_k(every[0], k)
        return values, jnp.take_along_axis(every[1], pick, axis=-1)

    return _per_shard(local, x, axes, rt, (P(), P()))


def categorical(key: jax.Array, logits: jax.Array, rt: Runtime) -> jax.Array:
    """``jax.random.categorical(key, logits, axis=-1)`` as int32: the same token for the same key (its
    ``argmax(gumbel(key, logits.shape) + logits)``, the argmax by all-reduces where the vocabulary is split)."""
    return argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits, rt)
