"""Slot buckets in the batcher: a lone request runs in a one-slot state, the state grows a bucket when every
slot is busy and compacts its rows into a smaller bucket when they leave, and no row's tokens change on the way
(the reference: each prompt through ``Model.generate`` alone)."""

import threading

import jax
import numpy as np
import pytest
from conftest import FIXTURES

import kimi_jax
from kimi_jax.serving.batcher import Batcher, Job, regroup, row_axes

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
PROMPTS = ["def area(r):\n    return", "import json\n\nclass Config:\n", "x = [i * i for i in", "for k, v in",
           "while True:\n    line =", "# parse the header\n", "print(", "return sorted("]
pytestmark = pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")


@pytest.fixture(scope="module")
def model():
    return kimi_jax.load(str(TARGET), drafter=str(DRAFTER))


# The fast loop runs the state with every per-row field (processors, automaton, logprobs); the plain one in the
# full suite (its fields are a subset).
@pytest.mark.parametrize("extra", [pytest.param({}, marks=pytest.mark.slow),
                                   dict(top_p=0.9, presence_penalty=0.5, logprobs=2,
                                        response_format={"type": "json_object"})])
def test_regroup_moves_every_per_row_field_and_keeps_the_batch_fields(model, extra):
    """regroup(state, rows) == numpy's take of every per-row field along its batch axis, free slots done; with
    the processors, an automaton and logprobs too (each per-row leaf has the batch's 3 rows on its axis)."""
    state, _ = model.prefill(model.prepare(PROMPTS[:3], 8, "ddtree", 4, **extra), **extra)
    rows = np.asarray([2, -1, 0, 1, -1], np.int32)
    moved = regroup(state, rows)
    for before, after, axis in zip(*(jax.tree.leaves(t) for t in (state, moved, row_axes(state)))):
        before, after = _raw(before), _raw(after)
        assert axis < 0 or before.shape[axis] == 3, (before.shape, axis)
        if axis < 0:                                  # the batch's own: untouched
            np.testing.assert_array_equal(after, before)
            continue
        want = np.take(before, np.maximum(rows, 0), axis=axis)
        if want.dtype == bool and want.shape == rows.shape:      # done: the free slots are done
            want = want | (rows < 0)
        np.testing.assert_array_equal(after, want)
    assert moved.drafter is not None and np.asarray(moved.done).tolist() == [False, True, False, False, True]


def _raw(a):
    return np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)


@pytest.mark.slow
def test_buckets_grow_compact_and_keep_every_rows_tokens(model):
    """Eight requests at once in a server of 8 slots: the state grows 1 -> 2 -> 4 -> 8 as they join, compacts
    as the short ones leave, ends in one slot, and every request gets its tokens alone (DDTree, budget 4)."""
    batcher = Batcher(model, max_batch=8, max_new=24, max_len=128, budget=4, rounds_per_dispatch=2)
    sizes, resize = [], batcher._resize

    def record(slots):
        resize(slots)
        sizes.append(slots)

    batcher._resize = record
    max_tokens = [4, 24, 6, 24, 3, 24, 8, 24]
    got, finished = [[] for _ in PROMPTS], threading.Semaphore(0)
    jobs = [Job(ids=model.tokenizer.encode(p), max_tokens=n, temperature=0.0, seed=0, emit=got[i].extend,
                finish=lambda reason: finished.release()) for i, (p, n) in enumerate(zip(PROMPTS, max_tokens))]
    for job in jobs:                                  # all queued before the loop starts: they join one by one
        batcher.submit(job)
    batcher.start()
    for _ in jobs:
        assert finished.acquire(timeout=300)
    batcher.stop(timeout=30)
    eos = set(model.config.eos_token_ids)
    for i, (p, n) in enumerate(zip(PROMPTS, max_tokens)):
        alone = model.generate(p, 24, method="ar").tokens[0][:n]
        assert got[i] == alone[:len(got[i])] and (len(got[i]) == n or got[i][-1] in eos), (i, got[i], alone)
    assert sizes[:3] == [2, 4, 8], sizes                               # grown while the eight joined
    assert any(b < a for a, b in zip(sizes, sizes[1:])) and sizes[-1] == 1 and batcher.slots == 1, sizes
