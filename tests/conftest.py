"""Tests run on the CPU; 8 fake devices so sharding tests can build meshes in the same process."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import pathlib  # noqa: E402
import tempfile  # noqa: E402

# The auto policy's cost tables are cached on disk; tests keep theirs out of the user's cache.
os.environ.setdefault("KIMI_JAX_CACHE", tempfile.mkdtemp(prefix="kimi_jax_test_cache_"))

import pytest  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


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


@pytest.fixture(autouse=True, scope="module")
def compiled_programs_freed_per_module():
    """Drop JAX's compiled programs after each test module, so one process never holds every program the suite
    compiled. Tried against the segfault of 2026-12-06 (docs/design.md, "Tests"); it did not stop it alone, and
    it is not the memory-mapping limit (~0.6 mappings per program, not released by this)."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()
