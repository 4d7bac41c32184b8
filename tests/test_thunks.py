"""What a compiled GPU program launches (kimi_jax.analysis.thunks), and the compile options kimi_jax uses on GPUs.

The counter is checked twice: on a thunk sequence written by hand in XLA's dump format, whose counts are worked
out by hand below, and on programs XLA's real GPU compiler builds for an H200 on this CPU, where a loop's known
trip count must multiply its body and ``kimi_jax.config.compile_options`` must turn a host-driven loop (a
device-to-host predicate read per iteration) into one CUDA graph.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from kimi_jax.analysis import targets, thunks
from kimi_jax.config import Runtime, compile_options

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
GPU_MISSING = targets.compiler_missing("h200")
needs_gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=GPU_MISSING or "")

# A graph; a 61-trip layer loop holding an async weight-slice copy, a graph of two kernels and a loop of unknown
# trip count (two kernels: its condition and its body); one kernel at the end.
SEQUENCE = """\
000: kCommandBuffer [source       | next=014 (1)] 
    001: kPartitionId  [source       | next=002 (1)] kPartitionId
    002: kCustomKernel [prev=001 (1) | sink        ] loop_a grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
014: kWhile         [prev=000 (1) | next=070 (1)]   
condition:
    015: kCustomKernel [source | sink] cmp grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    016: kAsyncStart    [source        | next=046 (11)] stream=computation_stream[0], async_id=16
        018: kDynamicSliceFusion [source | sink] params=1, results=1
            017: kCopy [source | sink] kCopy
    046: kAsyncDone    [source        | sink         ] async_id=16
    000: kCommandBuffer [prev=046 (2)  | next=060 (2) ] 
        050: kCustomKernel [source       | next=051 (1)] k1 grid: [8, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
        051: kCustomKernel [prev=050 (1) | sink        ] k2 grid: [8, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    060: kWhile         [prev=000 (1)  | next=000 (1) ]       
condition:
        061: kCustomKernel [source | sink] cmp2 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        062: kCustomKernel [source | sink] k3 grid: [2, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
070: kCustomKernel [prev=014 (1) | sink] tail grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
"""
METADATA = "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{a}"\n    thunk_id: {i}\n  }}\n}}\n'
                   for i, a in [(14, "while.1"), (60, "while.2"), (16, "fusion-start.1"), (50, "fusion.1"),
                                (51, "fusion.2"), (62, "fusion.3")])
HLO = """\
  %fusion-start.1 = ((bf16[61,1024]{1,0}, s32[]), bf16[1,1024]{1,0}, u32[]) async-start(%p, %i), calls=%c
  %fusion.1 = f32[8]{0} fusion(%x), kind=kLoop, metadata={op_name="jit(f)/while/body/verify/attention/dot"}
  %fusion.2 = f32[8]{0} fusion(%x), kind=kLoop, metadata={op_name="jit(f)/while/body/verify/experts/mul"}
  %fusion.3 = f32[8]{0} fusion(%x), kind=kLoop, metadata={op_name="jit(f)/build_tree/while/body/add"}
  %while.1 = (s32[], f32[8]{0}) while(%t), condition=%c1, body=%b1, backend_config={"known_trip_count":{"n":"61"}}
  %while.2 = (s32[], f32[8]{0}) while(%t2), condition=%c2, body=%b2
"""


def test_counts_of_a_hand_written_sequence(tmp_path):
    for name, text in (("m.sm_9.0a_gpu_after_optimizations.txt", HLO), ("m.thunk_metadata.txt", METADATA),
                       ("m.thunk_sequence_after_thunk_passes.txt", SEQUENCE)):
        (tmp_path / name).write_text(text)
    got = thunks.read_dump(str(tmp_path), ("verify", "attention", "experts", "build_tree"))
    # by hand: the first graph runs once (2 ops); the layer loop's body 61 times: the slice copy (outside any
    # graph), the inner graph (2 ops, one submission), and the unknown loop: its condition and body once per
    # iteration counted, outside a graph, so one blocking predicate read per layer iteration; the tail once.
    assert got["gpu_ops"] == 2 + 61 * (1 + 2 + 2) + 1
    assert got["in_graphs"] == 2 + 61 * 2
    assert got["graphs"] == 1 + 61
    assert got["host_launches"] == 1 + 61 * (1 + 1 + 2) + 1
    assert got["host_syncs"] == 61 and got["unknown_loops"] == 1
    assert got["copy_bytes"] == 61 * 1024 * 2                      # the copy's value, not the stacked operand
    assert got["by_scope"] == {"verify/attention": 61, "verify/experts": 61, "build_tree": 61, "": 2 + 61 * 2 + 1}


def _loop_program(layers: int):
    """A round loop of unknown trip count around a ``layers``-trip layer loop: lowered for one H200."""
    mesh = targets.compile_mesh("h200", 1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def f(x, n):
        def round_(c):
            i, x = c
            x = jax.lax.fori_loop(0, layers, lambda _, x: jnp.tanh(x @ x) + 1, x)
            return i + 1, jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype)
        return jax.lax.while_loop(lambda c: (c[0] < n) & (c[1][0, 0] < 100), round_, (0, x))[1]

    with targets.lowering_for(mesh):
        return jax.jit(f).lower(jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=rep),
                                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))


@pytest.mark.compile
@needs_gpu
def test_real_compiler_trip_counts_and_graph_loops():
    host_loops = compile_options("cuda", Runtime(graph_loops=False))
    _, five = thunks.compile_dumped(_loop_program(5), host_loops)
    _, ten = thunks.compile_dumped(_loop_program(10), host_loops)
    per_layer = (ten["gpu_ops"] - five["gpu_ops"]) / 5
    assert per_layer >= 1 and five["gpu_ops"] - 5 * per_layer == ten["gpu_ops"] - 10 * per_layer
    # without graph loops the round loop is host-driven: a blocking predicate read per round, every op its own
    # submission; with kimi_jax's options the whole program is one graph, submitted once, no host read
    assert five["host_syncs"] == 1 and five["unknown_loops"] == 1 and five["graphs"] == 0
    assert five["host_launches"] == five["gpu_ops"]
    _, graphed = thunks.compile_dumped(_loop_program(5), compile_options("cuda", Runtime()))
    assert graphed["gpu_ops"] == five["gpu_ops"]
    assert (graphed["graphs"], graphed["host_launches"], graphed["host_syncs"]) == (1, 1, 0)
    assert graphed["in_graphs"] == graphed["gpu_ops"]


def test_compile_options_only_touch_gpus():
    assert compile_options("cpu") == {} and compile_options("tpu") == {}
    assert compile_options("cpu", Runtime(split_k=False)) == {}
    assert "WHILE" in compile_options("cuda")["xla_gpu_enable_command_buffer"]
    one_shot = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True}
    assert compile_options("gpu", Runtime(graph_loops=False)) == one_shot
    assert compile_options("gpu", Runtime(graph_loops=False, one_shot_all_reduce=False)) == {}


@pytest.mark.compile
@needs_gpu
def test_the_one_shot_all_reduce_option_compiles_to_xlas_collective_kernel_thunk(tmp_path):
    """An 8-device H200 all-reduce of one token's hidden state compiles with the option and without it, each time
    to XLA's collective-kernel thunk, which picks the one-shot kernel or NCCL when the program first runs (its
    conditions: one host, peer access, the message size), so the program a GPU gets is the same either way."""
    import glob

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = targets.compile_mesh("h200", 8, "tp=8")
    x = jax.ShapeDtypeStruct((8, 7168), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    lowered = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P())).lower(x)
    for on in (True, False):
        where = str(tmp_path / str(on))
        options = {**compile_options("cuda", Runtime(one_shot_all_reduce=on)), **targets.compiler_options("h200")}
        assert options.get("xla_gpu_unsupported_use_all_reduce_one_shot_kernel", False) is on
        thunks.compile_dumped(lowered, options, keep=where)
        sequence = open(glob.glob(where + "/*thunk_sequence*.txt")[0]).read()
        assert sequence.count("kCollectiveKernel [") == 1, sequence


@pytest.mark.compile
@needs_gpu
def test_split_k_off_is_one_kernel_per_gemm():
    """A verify-width GEMM (17 rows, K2.6's q_b: [17, 1536] x [1536, 1536] on one of 8 devices): XLA splits K for
    it by default, a partial GEMM and a reduction; Runtime(split_k=False) compiles it as one kernel."""
    mesh = targets.compile_mesh("h200", 1)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)  # noqa: E731
    with targets.lowering_for(mesh):
        lowered = jax.jit(lambda x, w: x @ w).lower(arg(17, 1536), arg(1536, 1536))
    _, split = thunks.compile_dumped(lowered, compile_options("cuda", Runtime()))
    _, whole = thunks.compile_dumped(lowered, compile_options("cuda", Runtime(split_k=False)))
    assert (split["gpu_ops"], whole["gpu_ops"]) == (2, 1)


def _b300_repro():
    """bench/b300_graphs_repro.py, loaded by path (bench is not a package pytest puts on sys.path)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "b300_graphs_repro.py"
    spec = importlib.util.spec_from_file_location("b300_graphs_repro", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nvlink_links_in_the_nvlink_gpu_specs():
    # XLA uses its own collective kernels (which CUDA graphs capture) only where the spec states NVLink links;
    # upstream's b300 spec omits them and kimi_jax's adds them (docs/b300_graphs.md)
    for name in ("h100", "h200", "b200", "b300"):
        assert re.search(r"device_interconnect_info\s*{\s*active_links:\s*18\s*}", targets.get_target(name).spec), name


@pytest.mark.compile
@pytest.mark.slow      # three TP-8 programs (~10 s); fast: test_real_compiler_trip_counts_and_graph_loops
@needs_gpu
def test_b300_all_reduces_stay_in_graphs_as_on_h200():
    repro = _b300_repro()
    h200, b300, upstream = (repro.count(t) for t in ("h200", "b300", repro.upstream_b300()))
    # 4 unrolled TP-8 layers, one all-reduce each: on H200 and on kimi_jax's B300 every all-reduce is XLA's
    # collective kernel and the whole program is one graph, submitted once
    for got in (h200, b300):
        assert got["all_reduce"] == "kCollectiveKernel"
        assert (got["graphs"], got["host_launches"], got["host_syncs"]) == (1, 1, 0)
        assert got["in_graphs"] == got["gpu_ops"] == h200["gpu_ops"]
    # the cause, kept visible: without NVLink links in the spec (upstream's b300) the all-reduces are NCCL calls,
    # outside kimi_jax's command buffer types, and a graph ends at each of them: one graph per layer, the
    # all-reduce and the kernel overlapping it launched by the host
    assert upstream["all_reduce"] == "kAllReduce" and upstream["gpu_ops"] == h200["gpu_ops"]
    assert upstream["graphs"] == 4 and upstream["host_launches"] > 3 * upstream["graphs"]
    assert upstream["in_graphs"] < upstream["gpu_ops"]
