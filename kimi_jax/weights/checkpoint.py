"""kimi_jax checkpoints: orbax save/restore (the one helper), onto shardings, one layer at a time.

A kimi_jax checkpoint directory holds ``kimi_config.json`` (our ModelConfig) plus the weights in one of two
forms, both read by :func:`restore`:

- *stacked*: ``params/``, one orbax checkpoint of the whole params pytree (what :func:`save` writes for stacked
  params; the shipped embedded default). With shardings every device reads only its shard.
- *layered*: ``layers/layer_{i:03d}/`` (one orbax checkpoint per decoder layer: that layer's subtree without the
  leading stack axis; INT4 experts as ``{w13, s13, w2, s2}``) + ``globals/`` (embed, final_norm, lm_head). What
  ``python -m kimi_jax.convert`` writes; read back one layer at a time (:func:`stack_layers`), each layer
  restored straight onto its per-layer shardings and written into its slot of the stacked arrays on device (or,
  with ``split``, kept as that layer's own buffers), so host memory holds about one layer. The HF reader
  (``weights.hf``) stacks its layers the same way. :func:`save` writes this form for per-layer params.

Orbax writes into a temporary directory and renames it when complete, and ``kimi_config.json`` is written last
through an atomic rename, so a directory with ``kimi_config.json`` in it is always complete. Every tensor is
checked against the shape the config implies; a mismatch names the tensor and both shapes.

Just before the config, ``manifest.json`` records every weight file's size and CRC-32. Loading checks every size
first (a stat per file), and the CRC-32s too when the weights total at most ``HASH_ALWAYS_BYTES`` (the embedded
default: milliseconds) or when asked (``verify=True``, ``--verify``); a mismatch is a one-line
``CheckpointError`` naming the file. Checkpoints written before manifests load with a one-time note.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import sys
import time
import traceback
import warnings
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kimi_jax.config import ModelConfig
from kimi_jax.model.params import ParamSpec, abstract_params, is_spec, param_specs
from kimi_jax.sharding import per_device_bytes, place

CONFIG_FILE = "kimi_config.json"
PARAMS_DIR = "params"
LAYERS_DIR = "layers"
GLOBALS_DIR = "globals"
GLOBAL_KEYS = ("embed", "final_norm", "lm_head")
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "kimi_jax-manifest-1"
HASH_ALWAYS_BYTES = 512 << 20
REPAIR = "re-run the conversion or training that wrote it (both resume) or restore a good copy"


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or cannot be read; the message names the tensor or file."""


# ---- orbax: the one helper -------------------------------------------------------------------------------------

def save_tree(path: str, tree) -> None:
    """One orbax checkpoint at ``path`` (orbax writes a temporary directory and renames it when complete)."""
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), tree)
        ckptr.wait_until_finished()


def stored_tree(path: str) -> dict:
    """The metadata tree (shape, dtype per leaf) of the orbax checkpoint at ``path``."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    meta = _orbax_read(path, lambda ckptr, where: ckptr.metadata(where))
    if meta is None or meta.item_metadata is None:
        raise CheckpointError(f"cannot read the metadata of the orbax checkpoint {path}: files are missing or "
                              f"damaged; {REPAIR}")
    return meta.item_metadata.tree


def restore_tree(path: str, target=None, sharding: jax.sharding.Sharding | None = None):
    """Restore ``path``; ``target`` a tree of ShapeDtypeStructs (dtype to cast to, sharding to place onto), or
    None for the stored shapes and dtypes, every leaf on ``sharding`` (default: this process's first device; in
    a run across processes the global first device is process 0's alone)."""
    if target is None:
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), stored_tree(path))
    return _orbax_read(path, lambda ckptr, where: ckptr.restore(where, target),
                       "the files are damaged or incomplete: ")


def _orbax_read(path: str, read: Callable, damage_note: str = ""):
    """``read(checkpointer, absolute path)``; a failure of it is one CheckpointError, and the reports it leaves
    behind are dropped (``_abandoned_read_reports_dropped``)."""
    import orbax.checkpoint as ocp
    with _abandoned_read_reports_dropped(path) as settle:
        try:
            with ocp.StandardCheckpointer() as ckptr:
                return read(ckptr, os.path.abspath(path))
        except Exception as e:   # orbax/tensorstore raise bare Exceptions for truncated, emptied or missing files
            detail = _storage_detail(e)
        settle()       # out of the except clause: the failure's traceback would keep the abandoned reads alive
    raise CheckpointError(f"cannot read the orbax checkpoint {path}: {detail}; {damage_note}{REPAIR}")


# A failed read's stragglers are the reads in flight when it failed: on the embedded default all of them report
# within 4 ms of the failure. settle() waits until none has reported for QUIET_S (WAIT_S at most); a read of a huge
# array still running after that would report to the process's own hook.
_STRAGGLERS_QUIET_S = 0.1
_STRAGGLERS_WAIT_S = 5.0


@contextlib.contextmanager
def _abandoned_read_reports_dropped(path: str):
    """Orbax starts the reads of all arrays at once. When one fails, the restore raises and closes its event loop
    while the other reads still run in tensorstore's threads; each of those then reports from its own thread that
    the loop is closed, that its failure was never retrieved, or that a coroutine of it was never awaited. Those
    reports repeat a failure we raise anyway: drop them, and nothing else. Installed before the read (not when it
    fails) because the first reports can come before the failure reaches us. Yields ``settle``, which a failed
    read calls to wait for its stragglers and collect its abandoned coroutines, so that the process's own hook,
    asyncio filters and warning display are put back as they were with nothing of the read left to report."""
    path = os.path.abspath(path)
    last_report = time.monotonic()

    def straggler(is_one: bool) -> bool:
        nonlocal last_report
        if is_one:
            last_report = time.monotonic()
        return is_one

    def hook(unraisable):
        if not straggler(_is_abandoned_read(unraisable.exc_value, unraisable.exc_traceback, unraisable.object, path)):
            previous_hook(unraisable)

    def showwarning(message, category, *args, **kwargs):
        if not straggler(category is RuntimeWarning and _is_orbax_coroutine(str(message))):
            previous_show(message, category, *args, **kwargs)

    def log_filter(record):
        return not straggler(bool(record.exc_info) and _is_abandoned_read(record.exc_info[1], None, None, path))

    def settle():
        nonlocal last_report
        start = last_report = time.monotonic()
        while time.monotonic() - last_report < _STRAGGLERS_QUIET_S and time.monotonic() - start < _STRAGGLERS_WAIT_S:
            time.sleep(0.01)
        gc.collect()

    previous_hook, previous_show = sys.unraisablehook, warnings.showwarning
    sys.unraisablehook, warnings.showwarning = hook, showwarning
    logging.getLogger("asyncio").addFilter(log_filter)
    try:
        yield settle
    finally:
        sys.unraisablehook, warnings.showwarning = previous_hook, previous_show
        logging.getLogger("asyncio").removeFilter(log_filter)


def _is_orbax_coroutine(message: str) -> bool:
    """"coroutine 'Store._get_array_metadatas' was never awaited", where that name is defined in an orbax
    module: a step of a failed read that the closed loop never ran."""
    m = re.fullmatch(r"coroutine '([\w.]+)' was never awaited", message)
    if m is None:
        return False
    for name, module in list(sys.modules.items()):
        if name.startswith("orbax.") and module is not None:
            obj = module
            for part in m.group(1).split("."):
                obj = getattr(obj, part, None)
            if obj is not None and getattr(obj, "__module__", "").startswith("orbax."):
                return True
    return False


def _is_abandoned_read(exc, tb, obj, path: str) -> bool:
    """A straggler of a failed orbax read of ``path``: its coroutine, a tensorstore error naming that directory, or
    the callback that found its event loop closed."""
    if getattr(getattr(obj, "cr_code", None), "co_name", "") == "_read_array_index_and_device_put":
        return True
    if path in str(exc):
        return True
    frames = {f.name for f in traceback.extract_tb(tb)} if tb is not None else set()
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and "call_soon_threadsafe" in frames


def _storage_detail(e: BaseException) -> str:
    """The most telling line of an orbax/tensorstore failure: the innermost cause (which names the array and the
    byte range), on one line."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return " ".join(str(e).split())[:300]


def _path_key(path) -> str:
    """'moe_layers/moe/experts/w13': one spelling of a tree path for dicts and dataclasses (orbax stores both as
    dicts)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def flat(tree, is_leaf=None) -> dict:
    """{path key: leaf} of a tree (see ``_path_key``)."""
    return {_path_key(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _restore_checked(path: str, want: dict, shardings: dict, dtype, what: str, host: bool = False) -> dict:
    """One orbax directory -> {flat path: array}, checked against ``want`` ({flat path: ParamSpec-like with
    .shape, .dtype}); floating leaves without a fixed dtype are cast to ``dtype`` while reading. ``host``: numpy
    arrays in host memory instead of arrays on ``shardings``."""
    stored = stored_tree(path)
    have = flat(stored)
    if set(want) != set(have):
        raise CheckpointError(f"{what} ({path}) has params {sorted(set(have) ^ set(want))[:3]} that the config "
                              "does not imply (or lacks them); was it written for another config?")
    for k, spec in want.items():
        if tuple(have[k].shape) != tuple(spec.shape):
            raise CheckpointError(f"{what}: param {k} has shape {tuple(have[k].shape)} in the checkpoint but the "
                                  f"config implies {tuple(spec.shape)}")

    def target(p, meta):
        key = _path_key(p)
        keep = dtype is None or want[key].dtype is not None or not jnp.issubdtype(meta.dtype, jnp.floating)
        if host:    # orbax restores numpy leaves into host memory (an untouched template costs no pages)
            return np.zeros(meta.shape, meta.dtype if keep else dtype)
        return jax.ShapeDtypeStruct(meta.shape, meta.dtype if keep else dtype, sharding=shardings.get(key))

    return flat(restore_tree(path, jax.tree_util.tree_map_with_path(target, stored)))


# ---- the manifest ----------------------------------------------------------------------------------------------

def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_manifest(directory: str, subdirs) -> None:
    """``manifest.json``: size and CRC-32 of every file under ``subdirs`` (atomic rename)."""
    files = {}
    for sub in subdirs:
        for root, dirs, names in os.walk(os.path.join(directory, sub)):
            dirs.sort()
            for name in sorted(names):
                full = os.path.join(root, name)
                files[os.path.relpath(full, directory)] = {"size": os.path.getsize(full), "crc32": _crc32(full)}
    write_config(directory, MANIFEST_FILE, {"format": MANIFEST_FORMAT, "files": files})


_NOTED: set[str] = set()


def check_manifest(directory: str, verify: bool | None = None) -> None:
    """Every file the manifest lists exists with its size (and, if ``verify`` or the weights are small, its
    CRC-32); else a CheckpointError naming the file. No manifest: a one-time note, nothing checked."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.exists(path):
        if directory not in _NOTED:
            _NOTED.add(directory)
            print(f"kimi_jax: note: {directory} has no {MANIFEST_FILE} (written before manifests): file sizes "
                  "and checksums are not checked", file=sys.stderr)
        return
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not all(
                isinstance(v.get("size"), int) and isinstance(v.get("crc32"), str) for v in files.values()):
            raise ValueError("unexpected format")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e}); {REPAIR}") from None
    if verify is None:
        verify = sum(v["size"] for v in files.values()) <= HASH_ALWAYS_BYTES
    for rel, want in files.items():
        full = os.path.join(directory, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing; {REPAIR}")
        size = os.path.getsize(full)
        if size != want["size"]:
            raise CheckpointError(f"{full} is {size} bytes, the manifest says {want['size']}: the file is damaged; "
                                  f"{REPAIR}")
    if verify:
        for rel, want in files.items():
            if _crc32(os.path.join(directory, rel)) != want["crc32"]:
                raise CheckpointError(f"{os.path.join(directory, rel)} does not match its checksum in "
                                      f"{MANIFEST_FILE}: the file is damaged; {REPAIR}")


# ---- kimi_jax checkpoint directories ------------------------------------------------------------------------

def save(directory: str, cfg: ModelConfig, params) -> None:
    """Write a kimi_jax checkpoint (config + orbax params). Refuses to overwrite an existing one. Stacked params
    are written as ``params/``; per-layer params (tuples of layer trees, ``stack_layers(split=True)``) in the
    layered form, one orbax checkpoint per layer as they are held, so saving them never builds a stacked copy."""
    if not isinstance(params["moe_layers"], tuple):
        _write_trees(directory, {PARAMS_DIR: params}, CONFIG_FILE, cfg.to_dict())
        return
    layers = params["dense_layers"] + params["moe_layers"]
    trees = {os.path.relpath(layer_dir(directory, i), directory): layer for i, layer in enumerate(layers)}
    _write_trees(directory, {GLOBALS_DIR: {k: params[k] for k in GLOBAL_KEYS}, **trees}, CONFIG_FILE,
                 cfg.to_dict())


def write_config(directory: str, config_file: str, config: dict) -> None:
    """The config JSON through a temporary file and an atomic rename (written last: it marks completeness)."""
    tmp = os.path.join(directory, config_file + ".tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, os.path.join(directory, config_file))


def write_tree(directory: str, tree, config_file: str, config: dict) -> None:
    """orbax ``params/``, its manifest, then the config JSON: a directory with the config file in it is always
    complete."""
    _write_trees(directory, {PARAMS_DIR: tree}, config_file, config)


def _write_trees(directory: str, trees: dict, config_file: str, config: dict) -> None:
    """One orbax checkpoint per {relative path: tree}, the manifest of their top directories, then the config."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    tops = sorted({rel.split(os.sep)[0] for rel in trees})
    for top in tops:
        target = os.path.join(directory, top)
        if os.path.exists(target):
            if os.path.exists(os.path.join(directory, config_file)):
                raise CheckpointError(f"{target} already exists; choose another directory or remove it first")
            shutil.rmtree(target)    # no config: an interrupted earlier write, never a checkpoint
    for rel, tree in trees.items():
        save_tree(os.path.join(directory, rel), tree)
    write_manifest(directory, tops)
    write_config(directory, config_file, config)


def is_kimi_checkpoint(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, CONFIG_FILE))


def read_config(directory: str) -> ModelConfig:
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        return ModelConfig.from_dict(json.load(f))


def layer_dir(directory: str, i: int) -> str:
    """Decoder layer ``i``'s orbax directory in a layered checkpoint."""
    return os.path.join(directory, LAYERS_DIR, f"layer_{i:03d}")


def is_layered(directory: str) -> bool:
    return os.path.isdir(os.path.join(directory, LAYERS_DIR))


def restore(directory: str, cfg: ModelConfig | None = None, shardings=None, dtype=None, verify: bool | None = None,
            split: bool = False):
    """(config, params); with ``shardings`` (a pytree of jax.sharding.Sharding like the params) every weight is
    read straight onto its shardings. ``dtype`` casts the floating weights (not the float32 router bias).
    ``verify``: checksum every file against the manifest (None: only when the weights are small). ``split``: each
    layer stack as a tuple of per-layer trees (``stack_layers``); a stacked ``params/`` checkpoint is then read
    into host memory and its layers placed one by one, so no stacked copy reaches the device."""
    directory = os.path.abspath(directory)
    cfg = cfg or read_config(directory)
    check_manifest(directory, verify)
    specs = param_specs(cfg)
    want = flat(specs, is_leaf=is_spec)
    flat_sh = flat(shardings) if shardings is not None else {}
    if shardings is not None and set(flat_sh) != set(want):
        raise CheckpointError(f"shardings do not match the params tree: {sorted(set(flat_sh) ^ set(want))[:3]}")
    if not is_layered(directory):
        leaves = _restore_checked(os.path.join(directory, PARAMS_DIR), want, flat_sh, dtype, "params", host=split)
        if split:
            def host_layer(i, _):
                stack, j = ("moe_layers", i - cfg.first_k_dense_replace) if i >= cfg.first_k_dense_replace else \
                    ("dense_layers", i)
                return {s: leaves[k][j] for s, k in _per_layer_paths(want, stack).items()}
            return cfg, stack_layers(cfg, host_layer, {k: leaves[k] for k in GLOBAL_KEYS}, shardings, split=True)
        # Back into the param tree's own node types (orbax hands dataclass nodes such as Int4Experts back as dicts).
        return cfg, jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), [leaves[k] for k in want])
    globals_ = _restore_checked(os.path.join(directory, GLOBALS_DIR), {k: want[k] for k in GLOBAL_KEYS},
                                {k: flat_sh[k] for k in GLOBAL_KEYS if k in flat_sh}, dtype, "globals")

    layer_want = {stack: {s: ParamSpec(want[k].shape[1:], want[k].axes[1:], dtype=want[k].dtype)
                          for s, k in _per_layer_paths(want, stack).items()}
                  for stack in ("dense_layers", "moe_layers")}

    def layer(i, layer_sh):
        stack = "moe_layers" if i >= cfg.first_k_dense_replace else "dense_layers"
        return _restore_checked(layer_dir(directory, i), layer_want[stack], layer_sh, dtype, f"layer {i}")

    return cfg, stack_layers(cfg, layer, globals_, shardings, split)


# ---- stacking layers on device ----------------------------------------------------------------------------------

def _drop_leading_axis(sharding):
    """The sharding of one layer of a stacked array: the PartitionSpec without its first (layer) entry."""
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if spec and spec[0] is not None:
            raise CheckpointError(f"sharding {sharding.spec} splits the stacked layer axis; the layered checkpoint "
                                  "form needs the leading axis unsharded")
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]), memory_kind=sharding.memory_kind)
    if sharding.is_fully_replicated:  # SingleDeviceSharding, replicated GSPMD/Positional shardings
        return sharding
    raise CheckpointError(f"cannot derive a per-layer sharding from {type(sharding).__name__}; pass NamedShardings")


def _per_layer_paths(want: dict, stack: str) -> dict:
    """{per-layer path: stacked path} of one layer stack ('attn/q_a' -> 'moe_layers/attn/q_a')."""
    return {k[len(stack) + 1:]: k for k in want if k.startswith(stack + "/")}


def stack_layers(cfg: ModelConfig, read_layer: Callable[[int, dict], dict], globals_: dict, shardings=None,
                 split: bool = False):
    """The params pytree from per-layer reads: ``read_layer(i, layer_shardings)`` gives decoder layer i as
    {per-layer flat path: array} (host arrays, or device arrays already on ``layer_shardings``, the per-layer
    shardings, {} without a mesh); ``globals_`` holds the embedding, final norm and lm_head.

    Each layer is placed onto its per-layer shardings. ``split=False``: written into its slot of the stacked
    arrays, which are allocated on device with the stacked shardings. ``split=True``: kept as it is, so each stack
    is a tuple of per-layer trees (the form ``kimi_jax.model.compute_layout.split_layers`` makes, for the programs that run
    one buffer per layer) and no stacked copy is ever allocated. A layer's host arrays are dropped before the next
    is read, so the host holds about one layer at a time."""
    specs = param_specs(cfg)
    want = flat(specs, is_leaf=is_spec)
    flat_sh = flat(shardings) if shardings is not None else {}
    for k in GLOBAL_KEYS:
        globals_[k] = globals_[k] if isinstance(globals_[k], jax.Array) else place(globals_[k], flat_sh.get(k))
    out = dict(globals_)
    stacks = {}
    for stack, first, n in (("dense_layers", 0, cfg.first_k_dense_replace),
                            ("moe_layers", cfg.first_k_dense_replace, cfg.num_moe_layers)):
        sub = _per_layer_paths(want, stack)
        out_sh = {s: flat_sh[k] for s, k in sub.items()} if flat_sh else None
        layer_sh = {s: _drop_leading_axis(flat_sh[k]) for s, k in sub.items()} if flat_sh else {}
        buf, layers = None, []
        for j in range(n):
            layer = read_layer(first + j, layer_sh)
            layer = {s: a if isinstance(a, jax.Array) else place(a, layer_sh.get(s)) for s, a in layer.items()}
            if split:
                layers.append(layer)
                jax.block_until_ready(layer)   # on device before its host arrays go
                continue
            if buf is None:
                shapes = {s: jax.ShapeDtypeStruct(want[k].shape, layer[s].dtype) for s, k in sub.items()}
                buf = jax.jit(lambda: {s: jnp.zeros(v.shape, v.dtype) for s, v in shapes.items()},
                              out_shardings=out_sh)()
                put = jax.jit(_put_layer, donate_argnums=0, out_shardings=out_sh)
            buf = put(buf, layer, j)
            del layer
            jax.block_until_ready(buf)   # the layer's buffers are free before the next one is read
            gc.collect()                 # (a reference cycle can otherwise keep the first one alive)
        if split:
            structure = jax.tree.structure(specs[stack], is_leaf=is_spec)
            stacks[stack] = tuple(jax.tree.unflatten(structure, [layer[s] for s in sub]) for layer in layers)
            continue
        if buf is None:  # zero layers of this kind: empty stacks
            float_dtype = out["embed"].dtype
            buf = {s: jnp.zeros(want[k].shape, want[k].dtype or float_dtype) for s, k in sub.items()}
        out.update({k: buf[s] for s, k in sub.items()})
    if split:
        return {**{k: out[k] for k in GLOBAL_KEYS}, **stacks}
    return jax.tree.unflatten(jax.tree.structure(specs, is_leaf=is_spec), [out[k] for k in want])


def _put_layer(buf: dict, layer: dict, j):
    return {k: jax.lax.dynamic_update_index_in_dim(buf[k], layer[k].astype(buf[k].dtype), j, 0) for k in buf}


# ---- planning ---------------------------------------------------------------------------------------------------

def load_plan(cfg: ModelConfig, shardings, dtype=jnp.bfloat16) -> dict:
    """What loading ``cfg`` onto ``shardings`` takes, without reading anything: bytes per device (the largest
    shard of every weight), the largest single layer (what the host holds at once) and the whole checkpoint."""
    abstract = abstract_params(cfg, dtype)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    layer = max(per_device_bytes(abstract[stack]) // n
                for stack, n in (("dense_layers", cfg.first_k_dense_replace), ("moe_layers", cfg.num_moe_layers))
                if n)
    return {"per_device_bytes": per_device_bytes(placed), "host_layer_bytes": layer,
            "total_bytes": per_device_bytes(abstract)}
