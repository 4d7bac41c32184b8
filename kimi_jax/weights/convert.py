"""HF K2.x checkpoint -> layered kimi_jax checkpoint (``python -m kimi_jax.convert``), streaming and resumable.

:func:`convert_hf` reads an HF checkpoint directory in the K2-Thinking / K2.5 / K2.6 layout through the one HF
reader (:mod:`kimi_jax.weights.hf`):
``config.json`` (``kimi_k25`` wrapper with a ``text_config``, or a plain ``deepseek_v3`` / ``kimi_k2`` config),
the ``quantization_config`` (top level or inside ``text_config``; compressed-tensors ``pack-quantized``, 4-bit
symmetric int, group 32) and sharded safetensors with ``model.safetensors.index.json``. Tensor names carry the
``model.`` or ``language_model.model.`` prefix. Whether a module is INT4 is decided per module by the ignore
list, as compressed-tensors does it: ``re:PATTERN`` entries are regexes (``re.match`` on the module name), plain
entries are exact module names. Only routed experts may be INT4; they are read as ``weight_packed`` /
``weight_scale`` / ``weight_shape`` triplets, stacked over experts and repacked into
:class:`kimi_jax.ops.int4_format.Int4Experts` without ever being dequantised. Every tensor's shape and dtype is checked
against the config; an error names the tensor (and the shard when the file itself is bad).

Streaming and resume. Layers are converted one at a time and each is written at once as its own orbax
checkpoint ``OUT/.convert/layer_{i:03d}`` (orbax writes into a temporary directory and renames it, so a
directory under its final name is complete); embedding, final norm and lm_head go to ``OUT/.convert/globals``.
Host memory is bounded by about one layer throughout (~9.5 GB for K2.6: 384 x 3 INT4 matrices plus the bf16
attention). A rerun after a crash or kill skips every layer whose directory exists, so the final result is
identical to an uninterrupted run.

Output: the *layered* kimi_jax checkpoint form (:mod:`kimi_jax.weights.checkpoint`): when every layer is done, the
per-layer directories are moved (atomic renames, no copy, nothing read back) to ``OUT/layers/layer_{i:03d}`` and
``OUT/globals``, then ``OUT/kimi_config.json`` is written last (atomically), so a directory with
``kimi_config.json`` is complete; ``.convert`` is then removed. A kill during the moves resumes too (a layer is
done when it is in either place). :func:`kimi_jax.weights.checkpoint.restore` reads the layered form one layer at a time
(with per-device shardings) and stacks the layers on device: no step needs the whole model in host memory.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time

import jax.numpy as jnp
import numpy as np

from kimi_jax.config import ModelConfig
from kimi_jax.weights import checkpoint as ckpt
from kimi_jax.weights.checkpoint import CheckpointError, save_tree
from kimi_jax.weights.hf import BF16, HFCheckpoint

WORK_DIR = ".convert"


def _nest(flat_tree: dict) -> dict:
    """{'attn/q_a': a, ...} -> {'attn': {'q_a': a}, ...}: the nested form orbax stores per layer."""
    out: dict = {}
    for path, a in flat_tree.items():
        *head, last = path.split("/")
        node = out
        for k in head:
            node = node.setdefault(k, {})
        node[last] = a
    return out


def _clean_tmp(work: str) -> None:
    for name in os.listdir(work):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)


# ---- convert ---------------------------------------------------------------------------------------------

def convert_hf(hf_dir: str, out_dir: str, progress: bool = True, dtype=jnp.bfloat16, on_layer_written=None) -> dict:
    """Convert an HF K2.x checkpoint directory into a layered kimi_jax checkpoint at ``out_dir``; resumable.

    ``dtype`` is the storage dtype of the non-expert float weights (bfloat16 or float32; the router bias stays
    float32). ``on_layer_written(i)`` is called after layer i's directory is complete (tests use it to simulate a
    kill). Returns stats: bytes read, seconds, MB/s, peak RSS (MiB), layers converted / skipped.
    """
    t0 = time.perf_counter()
    dtype = np.dtype(jnp.dtype(dtype))
    if dtype not in (np.dtype(BF16), np.dtype(np.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    src = HFCheckpoint(hf_dir)
    cfg, reader = src.config, src.reader

    out_dir = os.path.abspath(out_dir)
    work = os.path.join(out_dir, WORK_DIR)
    if ckpt.is_kimi_checkpoint(out_dir):
        if os.path.isdir(work):  # killed after the final save but before the clean-up
            shutil.rmtree(work)
            return {"bytes": 0, "seconds": time.perf_counter() - t0, "mb_per_s": 0.0,
                    "peak_rss_mib": _peak_rss_mib(), "converted": 0, "skipped": cfg.num_hidden_layers}
        raise CheckpointError(f"{out_dir} already holds a kimi_jax checkpoint; choose another --out or remove it")
    os.makedirs(work, exist_ok=True)
    _clean_tmp(work)
    source = {"config": cfg.to_dict(), "dtype": dtype.name, "hf_dir": os.path.abspath(hf_dir)}
    src_file = os.path.join(work, "source.json")
    if os.path.exists(src_file):
        with open(src_file) as f:
            prev = json.load(f)
        if prev != source:
            raise CheckpointError(f"{work} holds a partial conversion of another checkpoint/config/dtype "
                                  f"({prev.get('hf_dir')}, {prev.get('dtype')}); remove it to start over")
    else:
        with open(src_file + ".tmp", "w") as f:
            json.dump(source, f, indent=1)
        os.replace(src_file + ".tmp", src_file)

    converted = skipped = 0
    layers = range(cfg.num_hidden_layers)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.num_hidden_layers + 1, desc="convert", unit="layer", file=sys.stderr)
    for i in layers:
        target = os.path.join(work, f"layer_{i:03d}")
        if os.path.isdir(target) or os.path.isdir(ckpt.layer_dir(out_dir, i)):  # done (maybe already moved)
            skipped += 1
        else:
            save_tree(target, _nest(src.read_layer(i, dtype)))
            reader.release()
            converted += 1
            if on_layer_written is not None:
                on_layer_written(i)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(MBps=f"{reader.bytes / 1e6 / max(time.perf_counter() - t0, 1e-9):.1f}")
    target = os.path.join(work, ckpt.GLOBALS_DIR)
    if not os.path.isdir(target) and not os.path.isdir(os.path.join(out_dir, ckpt.GLOBALS_DIR)):
        save_tree(target, src.read_globals(dtype))
        reader.release()
    if bar is not None:
        bar.update(1)
        bar.close()

    finalize(cfg, out_dir)
    dt = time.perf_counter() - t0
    return {"bytes": reader.bytes, "seconds": dt, "mb_per_s": reader.bytes / 1e6 / max(dt, 1e-9),
            "peak_rss_mib": _peak_rss_mib(), "converted": converted, "skipped": skipped, "config": cfg}


def finalize(cfg: ModelConfig, out_dir: str) -> None:
    """``.convert`` -> the layered checkpoint: atomic directory renames, then ``kimi_config.json`` (atomic),
    then ``.convert`` is removed. Nothing is read back; safe to rerun after a kill at any point."""
    work = os.path.join(out_dir, WORK_DIR)
    os.makedirs(os.path.join(out_dir, ckpt.LAYERS_DIR), exist_ok=True)
    moves = [(os.path.join(work, f"layer_{i:03d}"), ckpt.layer_dir(out_dir, i)) for i in range(cfg.num_hidden_layers)]
    moves.append((os.path.join(work, ckpt.GLOBALS_DIR), os.path.join(out_dir, ckpt.GLOBALS_DIR)))
    for src, dst in moves:
        if os.path.isdir(src):
            if os.path.exists(dst):
                raise CheckpointError(f"{dst} already exists; remove it (or {out_dir}) to convert again")
            os.rename(src, dst)
        elif not os.path.isdir(dst):
            raise CheckpointError(f"{src} is missing; the conversion is incomplete")
    ckpt.write_manifest(out_dir, [ckpt.LAYERS_DIR, ckpt.GLOBALS_DIR])
    ckpt.write_config(out_dir, ckpt.CONFIG_FILE, cfg.to_dict())
    shutil.rmtree(work)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
