"""The sweep on real compilers (kimi_jax.analysis.target_sweep): whole rounds of a small K2-architecture model
compiled for H200s and a TPU slice on this CPU, measured from the executables. The full-size K2.6 cells take
minutes each; their results are committed under sharding/results/ and read in docs/gpu_overhead.md."""

import math

import jax
import pytest

from kimi_jax import sharding as part
from kimi_jax.model.params import abstract_sharded_params
from kimi_jax.analysis import target_sweep, targets
from kimi_jax.config import TINY
from kimi_jax.decoding import drafter as dflash

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPU_MISSING = targets.compiler_missing("h200")
TPU_MISSING = targets.compiler_missing("v5e")
CFG = TINY.replace(int4_experts=True, moe_intermediate_size=1024)   # tp=4 slices of 256: the INT4 kernel's tile
DCFG = dflash.DrafterConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=64, vocab_size=256, block_size=5, mask_token_id=255,
                            target_layer_ids=(0, 2))


def _cell(target, cell, split=None):
    return target_sweep.run_cell(target, 4, cell, CFG, DCFG, split=split)


def _expert_bytes_per_device():
    """One device's share of every MoE layer's routed experts under tp=4, from the abstract sharded weights."""
    params = abstract_sharded_params(CFG, targets.compile_mesh("h200", 4, "tp=4"), "tp")
    return part.per_device_bytes(params["moe_layers"]["moe"]["experts"])


@pytest.mark.compile
@pytest.mark.slow     # two whole-round compiles for 4 H200s (~30-60 s)
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_ddtree_round_for_h200_per_layer_and_stacked():
    cell = target_sweep.Cell("tp", 1, 512, "ddtree4")
    row = _cell("h200", cell)
    assert row["status"] == "ok" and row["layers"] == "per-layer" and row["mesh"] == "tp=4"
    assert row["fits"] and row["memory_bytes"] == targets.get_target("h200").memory_bytes
    assert row["device_bytes"] >= row["argument_bytes"] > row["weight_bytes"] > 0
    # tp: the o projection and the MoE/MLP block each end in an all-reduce, in every layer of the verify forward;
    # the tree kernel runs on each device's own heads, so no layer gathers heads (only the vocab argmax gathers)
    assert row["all_reduce_count"] >= 2 * CFG.num_hidden_layers
    assert row["all_gather_count"] < CFG.num_hidden_layers
    # one round holds no loop of unknown length: nothing blocks the host; graphs carry most of it
    assert row["host_syncs"] == 0 and row["graphs"] >= 1 and row["in_graphs"] > row["gpu_ops"] / 2
    assert {"verify", "draft", "build_tree"} <= {k.split("/")[0] for k in row["by_scope"]}
    assert any(k.startswith("verify/attention") for k in row["by_scope"])
    # stacked layer scans copy each layer's weights (routed experts included) out of the stack every round
    stacked = _cell("h200", cell, split=False)
    assert stacked["layers"] == "stacked"
    experts = _expert_bytes_per_device()
    assert stacked["copy_bytes"] >= experts > row["copy_bytes"]


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")
def test_ar_step_and_unservable_cells():
    ar = _cell("h200", target_sweep.Cell("tp", 1, 512, "ar"))
    assert ar["status"] == "ok" and ar["drafter_bytes"] == 0 and ar["host_syncs"] == 0
    assert not any(k.startswith("draft") for k in ar["by_scope"])
    odd = _cell("h200", target_sweep.Cell("dp_attn", 1, 512, "ar"))     # batch 1 cannot split over dp
    assert odd["status"].startswith("n/a:")


@pytest.mark.compile
@pytest.mark.skipif(TPU_MISSING is not None, reason=TPU_MISSING or "")
def test_round_for_a_tpu_slice():
    row = _cell("v5e", target_sweep.Cell("tp", 1, 512, "ddtree4"))
    assert row["status"] == "ok" and row["layers"] == "stacked"          # TPUs keep the layer scans
    assert row["flops"] > 0 and row["bytes_accessed"] > 0 and "gpu_ops" not in row
    assert row["fits"] and row["memory_bytes"] == 16 * 10**9


def test_cells_parse_and_refuse_by_name():
    cells = target_sweep.parse_cells(["strategy=tp,ep", "batch=1", "context=4096", "round=ar,ddtree32"])
    assert [c.key for c in cells] == ["tp/b1/ctx4096/ar", "tp/b1/ctx4096/ddtree32", "ep/b1/ctx4096/ar",
                                      "ep/b1/ctx4096/ddtree32"]
    assert cells[1].budget == 32 and cells[0].budget == 0
    assert len(target_sweep.parse_cells([])) == math.prod(len(v) for v in (
        target_sweep.STRATEGIES, target_sweep.BATCHES, target_sweep.CONTEXTS, target_sweep.ROUNDS))
    for bad in (["round=beam"], ["strategy=zz"], ["batch=x"], ["depth=3"]):
        with pytest.raises(SystemExit):
            target_sweep.parse_cells(bad)


def test_a_compile_past_the_hbm_says_by_how_much():
    """libtpu's refusal (its message as the v5p K2.6 256k cell got it) becomes a no-fit row with the numbers; any
    other failure stays an error."""
    oom = RuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
                       "required for HLO temporaries (133.75G) exceeds available HBM (95.73G). HLO module: "
                       "jit_round_step.")
    assert target_sweep.failure(oom) == "no fit: libtpu needs 133.8 GB of the device's 95.7 GB (misses by 38.0 GB)"
    assert target_sweep.failure(ValueError("bad")) == "error: ValueError: bad"
    assert target_sweep.stem_of("v6e", 32, "tp=8,ep=4") == "v6e_d32_tp8_ep4" and target_sweep.stem_of("h200", 8) == \
        "h200_d8"
