"""Tests run on the CPU; 8 fake devices so sharding tests can build meshes in the same process."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's LLVM backend at -O0: compiling is most of a test's time here, and the same optimized HLO (the HLO
# passes do not depend on the level) compiles in less CPU time at -O0 (~20% for the fast loop; test_engine and
# test_convert side by side, 7.4 against 8.6 min), while the kernels run slower, which only the long runs feel
# (the 16k-token prompt: 45 s instead of 36). An XLA_FLAGS that sets the level wins. Set before JAX starts a
# backend; pytest-xdist's workers inherit it, and the subprocesses through ``cpu_env``.
flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = flags.strip()

import atexit  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# JAX keeps only programs that took >= 1 s to compile; most of a tiny model's take less, and the run repeats many
# of them (fresh Models, CLI and server subprocesses, programs freed under mapping pressure): keep them all. Set
# in the environment, so the subprocesses (which inherit it) keep theirs too.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The auto policy's calibration times each width as the best of 3 runs: the tests check what calibration does
# (every process in step, tables stored and shared, monotone costs), not how steady its timings are, so one run
# each (a third of the calibration time: most of the two-process auto decode's 3 minutes). Subprocesses inherit it.
os.environ.setdefault("KIMI_JAX_CALIBRATION_REPEATS", "1")
# The auto policy's cost tables and the CLI's compiled programs are cached on disk ($KIMI_JAX_CACHE); tests keep
# theirs in a directory of this run, removed when the run ends (the process that made it removes it; pytest-xdist's
# workers and the CLI subprocesses inherit the variable and share it), so nothing outlives the run and CI stays
# honest: a clean clone compiles everything once.
if "KIMI_JAX_CACHE" not in os.environ:
    os.environ["KIMI_JAX_CACHE"] = tempfile.mkdtemp(prefix="kimi_jax_test_cache_")
    atexit.register(shutil.rmtree, os.environ["KIMI_JAX_CACHE"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

from kimi_jax.cli.decode import persistent_compile_cache  # noqa: E402

# A program built again in the run (a fresh kimi_jax.Model, a jit of the same function, programs freed below) is
# read back, not recompiled: JAX's in-memory caches are keyed by Python objects, its persistent cache by the
# program itself (~6% of the CPU time measured, docs/design.md "Tests"). The CLI's own cache, under $KIMI_JAX_CACHE.
persistent_compile_cache()

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


# ---- the time table: every run prints where its time went, per module ---------------------------------------------
# pytest's --durations (pyproject's addopts) lists the slowest tests; this adds the per-module sums that
# docs/design.md "Tests" budgets. The controller sees every worker's reports, so the sums are of test time (setup,
# call and teardown) across workers, not wall time.
MODULE_TIMES: dict[str, list] = {}            # module -> [seconds, tests, compile seconds]
MODULE_TIMES_FILE = pathlib.Path(__file__).parent / "module_times.json"

# The compile share of a test: JAX reports each program's tracing, lowering and XLA compile as monitoring events
# (in this process; a subprocess's compiles count as plain test time). Summed per test in its worker, carried to
# the controller in the report's user_properties.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
COMPILE_SECONDS = [0.0]


def _count_compile(event: str, duration: float, **_):
    if event in COMPILE_EVENTS:
        COMPILE_SECONDS[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.user_properties.append(("compile_s", COMPILE_SECONDS[0]))
    COMPILE_SECONDS[0] = 0.0


def pytest_addoption(parser):
    parser.addoption("--record-module-times", action="store_true",
                     help=f"record this run's per-module test times in {MODULE_TIMES_FILE.name} (the order estimates)")


def pytest_collection_modifyitems(config, items):
    """Slowest modules first, from the recorded per-module times: ``--dist loadfile`` hands whole modules to the
    workers in collection order, so a long module collected last leaves one worker running it alone at the end
    (largest-first is the classic balance for two workers). A module not recorded yet counts as slow, so a new
    one is not the tail either. Within a module the order stays the file's."""
    known = json.loads(MODULE_TIMES_FILE.read_text()) if MODULE_TIMES_FILE.exists() else {}
    slow = max(known.values(), default=0.0)
    order = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        order.setdefault(module, (-known.get(module, slow), len(order)))
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


def pytest_runtest_logreport(report):
    entry = MODULE_TIMES.setdefault(report.nodeid.split("::")[0], [0.0, 0, 0.0])
    entry[0] += report.duration
    entry[1] += report.when == "call"
    entry[2] += dict(report.user_properties).get("compile_s", 0.0)


def pytest_terminal_summary(terminalreporter):
    if not MODULE_TIMES:
        return
    total = sum(t for t, _, _ in MODULE_TIMES.values())
    compiling = sum(c for _, _, c in MODULE_TIMES.values())
    terminalreporter.write_sep("=", f"test time per module ({total / 60:.1f} min in all, {compiling / 60:.1f} "
                                    "compiling in the test processes; slowest first)")
    for module, (seconds, tests, compile_s) in sorted(MODULE_TIMES.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{seconds:8.1f} s {100 * seconds / total:5.1f}% {compile_s:8.1f} s compiling "
                                    f"{tests:5d} tests  {module}")
    if terminalreporter.config.getoption("record_module_times"):     # the modules this run ran; others kept
        recorded = json.loads(MODULE_TIMES_FILE.read_text()) if MODULE_TIMES_FILE.exists() else {}
        recorded.update({m: round(t, 1) for m, (t, _, _) in MODULE_TIMES.items()})
        MODULE_TIMES_FILE.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


def cpu_env(devices: int | None = None) -> dict:
    """The environment of a subprocess the tests start: this run's variables on the CPU, with this run's XLA flags
    but not the 8 fake devices asked for above (``devices`` fake devices instead, if given)."""
    flags = [f for f in os.environ["XLA_FLAGS"].split() if "xla_force_host_platform_device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}


def serve_in_thread(app, grace: float):
    """Run ``kimi_jax.serving.server.serve(app, ...)`` on a free loopback port in a daemon thread; return (url,
    thread) once ``/health`` answers."""
    import socket
    import threading
    import time

    import httpx
    from kimi_jax.serving.server import serve
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    thread = threading.Thread(target=serve, args=(app, "127.0.0.1", port, grace), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    return url, thread


def default_sigint():
    """preexec_fn of subprocesses that test Ctrl-C: a shell that runs the suite in the background ignores SIGINT
    and children inherit that (our commands keep an ignored SIGINT ignored, as nohup users expect)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
HF_FIXTURES = ("hf_k25", "hf_k2", "hf_grouped")


@pytest.fixture(scope="session")
def fixtures_dir():
    return FIXTURES


@pytest.fixture(autouse=True)
def fresh_gpu_interpret_state(request):
    """Pallas' GPU interpret mode (the Mosaic GPU kernels on a CPU) keeps global state between kernels: simulated
    memory and race detection. A kernel that fails mid-interpretation can leave it behind, and the next kernel
    interpreted in the process then fails or crashes (a full CI run of 2026-12-06 failed one Mosaic test and
    segfaulted in the next; each passes alone). JAX's own remedy, run before every test that interprets them."""
    if "mosaic" in request.node.module.__name__ or "kernel_selection" in request.node.module.__name__:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
        except ImportError:      # a private module; without it the tests run as before
            pass
        else:
            reset_gpu_interpret_mode_state()
    yield


# XLA:CPU maps every kernel of a compiled program into memory on its own (code, read-only data, data: three
# mappings per kernel, ~50-200 per tiny-model program), and Linux allows a process vm.max_map_count of them
# (65,530 by default). A process that keeps every program of the suite alive passes that limit; the next mmap of
# XLA's JIT linker fails and the process dies with a segfault (the crash of 2026-12-06, in a compile or a cache
# write, always late in a one-process run; docs/design.md, "Tests"). Freeing programs costs recompiles (or
# persistent-cache reads), so it happens only when a module ends with the mappings past MAP_HIGH_WATER: one module
# has added up to ~27,000, which leaves room under the limit.
MAP_HIGH_WATER = 30_000


def memory_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.fixture(autouse=True, scope="module")
def programs_freed_under_mapping_pressure():
    yield
    if os.path.exists("/proc/self/maps") and memory_mappings() > MAP_HIGH_WATER:
        import gc
        jax.clear_caches()
        gc.collect()
