"""The program layer (kimi_jax.decoding.programs): the server's batch rounds are compiled as generate's are.

Compiled for an H200 with no GPU present (kimi_jax.analysis.targets) and counted from the thunk sequence
(kimi_jax.analysis.thunks): the chunk program the server's batcher runs, from the batcher's own request and
inputs, compiled by the program layer with the options it picks for a GPU mesh, launches each round as
``Model.generate``'s program does: at most its GPU ops per round stage, all inside one CUDA graph, no host read.
"""

import functools
import os

import jax
import pytest

import kimi_jax
from kimi_jax.analysis import target_sweep, targets, thunks
from kimi_jax.config import Runtime, compile_options
from kimi_jax.decoding import engine
from kimi_jax.decoding.programs import Programs
from kimi_jax.model.compute_layout import split_stacks
from kimi_jax.serving.batcher import Batcher

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_MISSING = targets.compiler_missing("h200")
ROUND_STAGES = ("draft", "build_tree", "choose_width", "verify", "accept", "commit")


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


@pytest.mark.compile
@pytest.mark.slow            # two programs of the embedded default compiled for an H200: ~20 s each
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_servers_chunk_program_launches_rounds_as_generate_does():
    # generate's cache as the batcher's (128 slots): the XLA attention's block loop runs only past 128
    model = kimi_jax.load(os.path.join(ROOT, "checkpoints", "target"),
                          drafter=os.path.join(ROOT, "checkpoints", "drafter"), runtime=Runtime(context=128))
    batcher = Batcher(model, max_batch=1, max_new=8, max_len=128, budget=8, prefix_pages=0)
    served, served_inputs = batcher._program((False, False), 1)  # what the batcher's greedy dispatches run
    request = model.prepare("def f(x):\n", 8, "ddtree", 8)
    assert served.spec == request.spec

    programs = Programs(Runtime(mesh=targets.compile_mesh("h200", 1)))
    assert programs.options == compile_options("cuda", Runtime())       # graph loops: the GPU's options
    options = {**programs.options, **targets.compiler_options("h200")}
    stored = split_stacks(model.params)                                  # as stored: INT4, per layer
    counts = {}
    inputs = _abstract(model.inputs(request).replace(params=stored))
    _, counts["generate"] = thunks.compile_dumped(programs.lower_generate(request, inputs), options,
                                                  target_sweep.SCOPES)
    inputs = _abstract(served_inputs.replace(params=stored))
    state, _ = jax.eval_shape(functools.partial(engine.prefill, **served.statics), inputs)
    _, counts["chunk"] = thunks.compile_dumped(programs.lower_chunk(served, inputs, state), options,
                                               target_sweep.SCOPES)
    for got in counts.values():      # the whole program one graph, submitted once, no host read per round
        assert (got["graphs"], got["host_launches"], got["host_syncs"]) == (1, 1, 0), got
        assert got["in_graphs"] == got["gpu_ops"]
    per_round = {name: {k: v for k, v in got["by_scope"].items() if k.split("/")[0] in ROUND_STAGES}
                 for name, got in counts.items()}
    # every round stage no more GPU ops than generate's, and the rounds within 5 of each other (2026-12-06: 281
    # against 283 per round, one fewer in verify/attention/cache_write and in commit; 2026-12-07, the drafter's
    # q/k/v packed: 241 against 245, draft/drafter 36 against 38; XLA fusing the two programs' loops
    # differently), so the server's
    # rounds launch no more than generate's and neither program lost a part of the round
    assert per_round["chunk"].keys() == per_round["generate"].keys()
    for stage, ops in per_round["generate"].items():
        assert per_round["chunk"][stage] <= ops, (stage, per_round)
    assert sum(per_round["generate"].values()) - sum(per_round["chunk"].values()) <= 5, per_round
    assert sum(per_round["chunk"].values()) > 100
