"""Tests run on the CPU; 8 fake devices so sharding tests can build meshes in the same process."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import atexit  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

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
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def fast_loop(markexpr: str) -> bool:
    """Whether ``-m`` is the fast loop's: "not slow", alone or and-ed with other markers."""
    expr = " ".join((markexpr or "").split())
    return " or " not in f" {expr} " and re.search(r"(^|\band )not slow( and\b|$)", expr) is not None


def pytest_configure(config):
    """The fast loop has XLA:CPU's LLVM backend compile at -O0: compiling is most of a test's time here, and the
    same optimized HLO (the HLO passes do not depend on the level) compiles in ~20% less CPU time at -O0, while
    the kernels run slower, which the fast loop's short runs do not feel (the full suite's long runs would: the
    16k-token prompt takes 45 s instead of 36). The full suite, CI's, keeps XLA's default; an XLA_FLAGS that sets
    the level wins. Set before any test creates an array (the backend reads XLA_FLAGS when it starts);
    pytest-xdist's workers and the CLI subprocesses inherit it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if fast_loop(config.getoption("markexpr", "")) and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()


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
