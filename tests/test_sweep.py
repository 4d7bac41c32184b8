"""The sharding sweep on the full K2.6 config: one cell compiles on 8 fake devices without allocating weights.

How collectives are counted: the 60 MoE layers are one ``lax.scan``, i.e. one HLO ``while`` whose body holds
one layer's collectives and whose backend_config carries ``known_trip_count`` = 60. ``hlo_collectives``
weights every collective by the trip counts of the loops around it (the one dense layer's scan of length 1 is
inlined into the entry computation). Under ``tp`` each layer has one all-reduce after attention (the o
projection contracts the head-split axis) and one after the MoE/MLP block (the shard_map psum of routed +
shared experts over the F split), and the entry has one for the vocab-split embedding gather:
2 x 61 + 1 = 123. The greedy argmax over the vocab-split logits adds two tiny all-gathers (value, index).
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kimi_jax.analysis import sweep
from kimi_jax.analysis.hlo import hlo_collectives
from kimi_jax.config import KIMI_K26
from kimi_jax.model.params import abstract_params, param_partition_specs


@pytest.fixture(scope="module")
def tp_cell():
    import time
    t0 = time.perf_counter()
    row = sweep.run_cell(sweep.Cell("tp", 8, 1, 16))
    row["wall_s"] = time.perf_counter() - t0
    return row


def test_one_cell_under_a_minute(tp_cell):
    assert tp_cell["status"] == "ok"
    assert tp_cell["wall_s"] < 60
    for key in ("weight_bytes", "temp_bytes", "kv_bytes_4k", "kv_bytes_200k", "roofline_ms_h200",
                "roofline_ms_b300", "roofline_ms_rtx_pro_6000"):
        assert tp_cell[key] > 0, key


def test_tp_weight_bytes_are_checkpoint_over_8_plus_replicated(tp_cell):
    mesh = jax.sharding.AbstractMesh((8,), ("tp",))
    specs = param_partition_specs(KIMI_K26, mesh, "tp")
    abstract = jax.tree.leaves(abstract_params(KIMI_K26))
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    replicated = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, s in zip(abstract, flat_specs) if s == P())
    total = tp_cell["checkpoint_bytes"]
    expected = total / 8 + replicated * 7 / 8
    assert abs(tp_cell["weight_bytes"] - expected) <= 0.10 * expected
    assert 0.5e12 < total < 0.7e12          # ~594 GB: INT4 experts + bf16 rest (the K2.6 checkpoint size)
    # the latent cache is replicated under tp: layers x 4096 x 576 x 2 bytes at batch 1
    assert tp_cell["kv_bytes_4k"] == 61 * 4096 * 576 * 2


def test_tp_allreduce_count_matches_strategy(tp_cell):
    c = KIMI_K26
    assert tp_cell["all_reduce_count"] == 2 * c.num_hidden_layers + 1
    assert tp_cell["all_to_all_count"] == 0 and tp_cell["reduce_scatter_count"] == 0
    # each all-reduce carries one [tokens, hidden] activation (bf16 at the source)
    assert tp_cell["all_reduce_bytes"] == pytest.approx(123 * 17 * c.hidden_size * 2)


def test_hlo_counter_weights_while_bodies():
    hlo = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  %ag = bf16[2,8]{1,0} all-gather(%y), dimensions={1}
}

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"60"}}
  %ar2 = f32[4]{0} all-reduce(%a), to_apply=%add
}
"""
    c = hlo_collectives(hlo)["per_kind"]
    assert c["all-reduce"] == {"count": 61, "bytes": 61 * 16.0}
    assert c["all-gather"] == {"count": 60, "bytes": 60 * 32.0}


def test_cells_and_filters():
    assert len(sweep.all_cells()) == len(sweep.STRATEGIES) * 2 * 3 * 3
    assert sweep._parse_cells(["strategy=tp,ep", "batch=1"]) == {"strategy": ("tp", "ep"), "batch": (1,)}
    row = sweep.run_cell(sweep.Cell("dp_attn", 8, 1, 16))
    assert row["status"].startswith("n/a") and "batch 1" in row["status"]


@pytest.mark.slow
def test_full_k26_at_262144_tokens_dcp_holds_an_eighth_of_the_cache():
    """One DDTree verify step of the full K2.6 against a 262,144-slot latent cache, AOT on 8 fake devices: under
    tp every device holds the whole cache (61 x 576 x 2 B = 70 KB per token, 18.4 GB), under dcp an eighth;
    the compiled arguments shrink by the other seven eighths. dcp pays for it in collectives: the queries are
    all-gathered per layer and the partial softmaxes all-reduced."""
    ctx = 262_144
    tp, dcp = (sweep.run_cell(sweep.Cell(s, 8, 1, 16), compile_context=ctx) for s in ("tp", "dcp"))
    assert tp["status"] == dcp["status"] == "ok" and tp["context"] == ctx
    assert tp["kv_bytes_262k"] == 61 * ctx * 576 * 2 == 8 * dcp["kv_bytes_262k"]
    assert tp["argument_bytes"] - dcp["argument_bytes"] == pytest.approx(7 / 8 * tp["kv_bytes_262k"], rel=0.01)
    assert dcp["all_reduce_count"] > tp["all_reduce_count"] and dcp["all_gather_count"] > tp["all_gather_count"]


def test_a_quick_sweep_leaves_the_committed_tables(monkeypatch, tmp_path):
    """``--quick`` (a part of the sweep) writes its table under $KIMI_JAX_CACHE/sweep and says so; the committed
    sharding/results/sweep.{json,csv} keep their bytes. The cell's compile is stubbed: a cell that fails is a row
    too, which is all the writing needs."""
    monkeypatch.setenv("KIMI_JAX_CACHE", str(tmp_path))
    committed = {name: (Path(sweep.RESULTS) / name).read_bytes() for name in ("sweep.json", "sweep.csv")}
    monkeypatch.setattr(sweep, "run_cell", lambda cell, compile_context: 1 / 0)
    assert sweep._sweep(["--quick"]) == 0
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [(r["strategy"], r["devices"], r["status"].split(":")[0]) for r in rows] == [("tp", 8, "error")]
    assert {name: (Path(sweep.RESULTS) / name).read_bytes() for name in committed} == committed
    assert sweep.results_dir(None, partial=False, merge=False) == sweep.RESULTS       # the whole sweep: committed
    assert sweep.results_dir(None, partial=True, merge=True) == sweep.RESULTS
    assert sweep.results_dir(str(tmp_path), partial=False, merge=False) == str(tmp_path)
