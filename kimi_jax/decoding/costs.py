"""The cost table of the ``budget="auto"`` policy: seconds per round at each candidate width, measured.

Next to the costs the table keeps a prior outlook (expected tokens per row at each width, from the drafter's
node probabilities in the calibration runs), on which the first round of a generation is planned, and on which
the host decides whether a call runs its drafter at all. The policy that reads the table is
``kimi_jax.decoding.auto``.

A round's cost is calibrated on the backend that serves it, once per (model, drafter, widths, batch, cache
slots, kimi_jax source: a change to the programs changes their cost): the very generation program that serves
requests runs with each width forced (``force``) and two round limits, and the difference of the two wall times
over the difference of the rounds run is the cost of one round at that width (prefill and the launch cancel
out). Each measurement is the best of a few runs.
Costs are made monotone in the width (a running maximum: a wider tree never costs less, whatever the noise).

Tables are cached in memory by ``kimi_jax.decoding.programs.Programs`` next to its compiled programs (across
processes: process 0's table, ``programs._one_table_for_all``), and on disk as JSON under
``$KIMI_JAX_CACHE`` (default ``~/.cache/kimi_jax``)``/costs/<key>.json``, written atomically; a later process
with the same key reloads instead of measuring.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from typing import Callable

import jax
import numpy as np


def cache_root() -> str:
    """$KIMI_JAX_CACHE, default ~/.cache/kimi_jax: cost tables here, the CLI's compiled programs under xla/."""
    return os.environ.get("KIMI_JAX_CACHE", os.path.expanduser("~/.cache/kimi_jax"))


def cache_dir() -> str:
    return os.path.join(cache_root(), "costs")


@functools.cache
def source_digest() -> str:
    """A digest of the kimi_jax package's Python source (what the compiled programs are made of)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def table_key(spec, batch: int, max_len: int) -> str:
    """What a round's cost depends on: backend, model and drafter configs, widths, batch, cache slots, code."""
    dev = jax.devices()[0]
    parts = dict(backend=jax.default_backend(), device=getattr(dev, "device_kind", ""), jax=jax.__version__,
                 source=source_digest(),
                 cfg=spec.cfg.to_dict(), drafter=spec.drafter_cfg.to_dict(), widths=list(spec.widths),
                 block=spec.block_size, sample=spec.sample, batch=batch, max_len=max_len)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def monotone(costs) -> np.ndarray:
    return np.maximum.accumulate(np.asarray(costs, np.float64))


def calibration_repeats() -> int:
    """Runs per measurement (the best is kept): 3, or $KIMI_JAX_CALIBRATION_REPEATS (at least 1). More runs only
    steady the timings; the test suite, which checks what calibration does and not how fast a round is, runs one."""
    try:
        return max(1, int(os.environ.get("KIMI_JAX_CALIBRATION_REPEATS", 3)))
    except ValueError:
        return 3


def measure(run: Callable[[int, int], tuple[int, np.ndarray]], n_widths: int, rounds: tuple[int, int] = (1, 12),
            repeats: int | None = None) -> np.ndarray:
    """run(force, max_rounds) executes the program, returning (rounds run, the final outlook per row); each
    measurement is the best of ``repeats`` runs (default ``calibration_repeats()``).

    -> the table [2, n_widths]: seconds per round at each width (monotone), and the prior outlook (expected
    tokens per row at each width, averaged over the forced tree runs; 1 for the AR step)."""
    repeats = repeats or calibration_repeats()
    seconds, outlooks = [], []
    for force in range(n_widths):
        run(force, rounds[0])                                   # warm
        timed = []
        for limit in rounds:
            best, ran = float("inf"), 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                ran, outlook = run(force, limit)
                best = min(best, time.perf_counter() - t0)
            timed.append((best, ran))
        if force:
            outlooks.append(outlook)
        (t1, n1), (t2, n2) = timed
        seconds.append((t2 - t1) / (n2 - n1) if n2 > n1 else t2 / max(n2, 1))   # no room for more: upper bound
    prior = np.mean(outlooks, axis=0) if outlooks else np.ones(n_widths)
    prior[0] = 1.0
    return np.stack([monotone(np.maximum(seconds, 1e-7)), prior])


def load(key: str) -> np.ndarray | None:
    path = os.path.join(cache_dir(), key + ".json")
    try:
        with open(path) as f:
            d = json.load(f)
        return np.asarray([d["seconds_per_round"], d["expected_tokens_per_row"]], np.float64)
    except (OSError, ValueError, KeyError):
        return None


def save(key: str, table, widths) -> str:
    os.makedirs(cache_dir(), exist_ok=True)
    path = os.path.join(cache_dir(), key + ".json")
    fd, tmp = tempfile.mkstemp(dir=cache_dir(), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"widths": list(widths), "seconds_per_round": [float(c) for c in table[0]],
                   "expected_tokens_per_row": [float(c) for c in table[1]],
                   "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d %H:%M")}, f)
    os.replace(tmp, path)
    return path
